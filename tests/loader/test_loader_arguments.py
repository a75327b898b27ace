"""DataLoader argument checking against torch.utils.data as the oracle.

Every argument torch refuses, pipeload refuses with the same exception type (so ``except``
clauses written for torch still work), and pipeload's message names the argument together with
the value it received.
"""

from __future__ import annotations

import multiprocessing
import re
import warnings
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from types import ModuleType
from typing import Any

import numpy as np
import pytest
import torch
import torch.utils.data as tud

import pipeload

pytestmark = pytest.mark.timeout(60)


class TorchCounter(tud.IterableDataset):
    def __iter__(self) -> Iterator[int]:
        return iter(range(4))


class PipeCounter(pipeload.IterableDataset):
    def __iter__(self) -> Iterator[int]:
        return iter(range(4))


COUNTER = {tud: TorchCounter, pipeload: PipeCounter}


def numbers(m: ModuleType) -> Any:
    return m.TensorDataset(torch.arange(6))


@dataclass(frozen=True)
class BadCall:
    """A DataLoader call torch refuses, and what pipeload's message must contain.

    ``call`` builds the loader from the given module (and may go on to use it); ``mentions``
    returns the text fragments pipeload's message must include (objects appear by their repr).
    """

    call: Callable[[ModuleType], object]
    mentions: Callable[[ModuleType], list[str]]


def iterate(loader: Any) -> object:
    return next(iter(loader))


BAD_CALLS: dict[str, BadCall] = {
    "shuffle-with-sampler": BadCall(
        lambda m: m.DataLoader(numbers(m), shuffle=True, sampler=m.SequentialSampler(range(6))),
        lambda m: ["shuffle=True", "leave shuffle out, or give a sampler that shuffles (RandomSampler"],
    ),
    "batch-sampler-with-batch-size": BadCall(
        lambda m: m.DataLoader(numbers(m), batch_size=3, batch_sampler=[[0, 1]]),
        lambda m: ["batch_size=3",
                   "leave those four out, or pass batch_size, shuffle and drop_last to the batch sampler"],
    ),
    "batch-sampler-with-batch-size-none": BadCall(
        lambda m: m.DataLoader(numbers(m), batch_size=None, batch_sampler=[[0, 1]]),
        lambda m: ["batch_size=None"],
    ),
    "batch-sampler-with-shuffle": BadCall(
        lambda m: m.DataLoader(numbers(m), shuffle=True, batch_sampler=[[0, 1]]),
        lambda m: ["shuffle=True"],
    ),
    "batch-sampler-with-sampler": BadCall(
        lambda m: m.DataLoader(numbers(m), sampler=SAMPLER[m], batch_sampler=[[0, 1]]),
        lambda m: [f"sampler={SAMPLER[m]!r}"],
    ),
    "batch-sampler-with-drop-last": BadCall(
        lambda m: m.DataLoader(numbers(m), drop_last=True, batch_sampler=[[0, 1]]),
        lambda m: ["drop_last=True"],
    ),
    "batch-size-none-with-drop-last": BadCall(
        lambda m: m.DataLoader(numbers(m), batch_size=None, drop_last=True),
        lambda m: ["drop_last=True", "batch_size=None"],
    ),
    "batch-size-zero": BadCall(lambda m: m.DataLoader(numbers(m), batch_size=0), lambda m: ["batch_size=0"]),
    "batch-size-negative": BadCall(lambda m: m.DataLoader(numbers(m), batch_size=-1), lambda m: ["batch_size=-1"]),
    "batch-size-bool": BadCall(lambda m: m.DataLoader(numbers(m), batch_size=True), lambda m: ["batch_size=True"]),
    "batch-size-float": BadCall(lambda m: m.DataLoader(numbers(m), batch_size=2.5), lambda m: ["batch_size=2.5"]),
    "batch-size-string": BadCall(lambda m: m.DataLoader(numbers(m), batch_size="4"), lambda m: ["batch_size='4'"]),
    "batch-size-zero-iterable": BadCall(
        lambda m: m.DataLoader(COUNTER[m](), batch_size=0), lambda m: ["batch_size=0"]
    ),
    "drop-last-not-bool": BadCall(
        lambda m: m.DataLoader(numbers(m), batch_size=2, drop_last="yes"), lambda m: ["drop_last='yes'"]
    ),
    "num-workers-negative": BadCall(lambda m: m.DataLoader(numbers(m), num_workers=-1), lambda m: ["num_workers=-1"]),
    "num-workers-string": BadCall(lambda m: m.DataLoader(numbers(m), num_workers="2"), lambda m: ["num_workers='2'"]),
    "num-workers-negative-float": BadCall(
        lambda m: m.DataLoader(numbers(m), num_workers=-0.5), lambda m: ["num_workers=-0.5"]
    ),
    "num-workers-fraction": BadCall(
        # torch takes it when the loader is built and fails in range() when the epoch starts.
        lambda m: iterate(m.DataLoader(numbers(m), num_workers=0.5)), lambda m: ["num_workers=0.5"]
    ),
    "num-workers-whole-float": BadCall(
        # torch takes it too when the loader is built, and fails in range() as the epoch starts;
        # 0.0 alone it loads with (compared with 0: no workers).
        lambda m: iterate(m.DataLoader(numbers(m), num_workers=2.0)), lambda m: ["num_workers=2.0"]
    ),
    "prefetch-factor-negative-float": BadCall(
        lambda m: m.DataLoader(numbers(m), num_workers=1, prefetch_factor=-1.5), lambda m: ["prefetch_factor=-1.5"]
    ),
    "prefetch-factor-whole-float": BadCall(
        lambda m: iterate(m.DataLoader(numbers(m), num_workers=1, prefetch_factor=2.0)),
        lambda m: ["prefetch_factor=2.0"],
    ),
    "timeout-true-without-workers": BadCall(
        lambda m: iterate(m.DataLoader(numbers(m), timeout=True)), lambda m: ["timeout="]
    ),
    "timeout-negative": BadCall(lambda m: m.DataLoader(numbers(m), timeout=-1), lambda m: ["timeout=-1"]),
    "timeout-negative-float": BadCall(
        lambda m: m.DataLoader(numbers(m), num_workers=1, timeout=-0.5), lambda m: ["timeout=-0.5"]
    ),
    "timeout-without-workers": BadCall(
        lambda m: iterate(m.DataLoader(numbers(m), timeout=5)), lambda m: ["timeout=5"]
    ),
    "prefetch-factor-without-workers": BadCall(
        lambda m: m.DataLoader(numbers(m), prefetch_factor=2), lambda m: ["prefetch_factor=2"]
    ),
    "prefetch-factor-negative": BadCall(
        lambda m: m.DataLoader(numbers(m), num_workers=2, prefetch_factor=-1), lambda m: ["prefetch_factor=-1"]
    ),
    "prefetch-factor-zero": BadCall(
        # torch accepts it when the loader is built and refuses it when the epoch starts.
        lambda m: iterate(m.DataLoader(numbers(m), num_workers=1, prefetch_factor=0)),
        lambda m: ["prefetch_factor=0"],
    ),
    "persistent-workers-without-workers": BadCall(
        lambda m: m.DataLoader(numbers(m), persistent_workers=True), lambda m: ["persistent_workers=True"]
    ),
    "unknown-start-method": BadCall(
        lambda m: m.DataLoader(numbers(m), num_workers=2, multiprocessing_context="bogus"),
        lambda m: ["multiprocessing_context='bogus'"],
    ),
    "start-method-wrong-case": BadCall(
        lambda m: m.DataLoader(numbers(m), num_workers=2, multiprocessing_context="Fork"),
        lambda m: ["multiprocessing_context='Fork'"],
    ),
    "context-not-a-context": BadCall(
        lambda m: m.DataLoader(numbers(m), num_workers=2, multiprocessing_context=42),
        lambda m: ["multiprocessing_context=42"],
    ),
    "context-module-not-a-context": BadCall(
        lambda m: m.DataLoader(numbers(m), num_workers=2, multiprocessing_context=multiprocessing),
        lambda m: ["multiprocessing_context", "module 'multiprocessing'"],
    ),
    "context-without-workers": BadCall(
        lambda m: m.DataLoader(numbers(m), multiprocessing_context="fork"),
        lambda m: ["multiprocessing_context='fork'", "num_workers=0"],
    ),
    "context-object-without-workers": BadCall(
        lambda m: m.DataLoader(numbers(m), multiprocessing_context=SPAWN),
        lambda m: [f"multiprocessing_context={SPAWN!r}", "num_workers=0"],
    ),
    "iterable-with-shuffle": BadCall(lambda m: m.DataLoader(COUNTER[m](), shuffle=True), lambda m: ["shuffle=True"]),
    "iterable-with-truthy-shuffle": BadCall(lambda m: m.DataLoader(COUNTER[m](), shuffle=1.0), lambda m: ["shuffle=1.0"]),
    "iterable-with-sampler": BadCall(
        lambda m: m.DataLoader(COUNTER[m](), sampler=SAMPLER[m]), lambda m: [f"sampler={SAMPLER[m]!r}"]
    ),
    "iterable-with-batch-sampler": BadCall(
        lambda m: m.DataLoader(COUNTER[m](), batch_sampler=BATCH_SAMPLER[m]),
        lambda m: [f"batch_sampler={BATCH_SAMPLER[m]!r}"],
    ),
    "torch-iterable-with-shuffle": BadCall(
        lambda m: m.DataLoader(TorchCounter(), shuffle=True), lambda m: ["shuffle=True"]
    ),
}

# Fixed objects, so the message can be checked against the very object pipeload received.
SPAWN = multiprocessing.get_context("spawn")
SAMPLER = {tud: tud.SequentialSampler(range(6)), pipeload: pipeload.SequentialSampler(range(6))}
BATCH_SAMPLER = {
    tud: tud.BatchSampler(range(4), 2, False),
    pipeload: pipeload.BatchSampler(range(4), 2, False),
}


def raised_by(call: Callable[[ModuleType], object], module: ModuleType) -> BaseException:
    """The exception ``call(module)`` raises, its traceback dropped so that whatever the failed
    call built is released now, inside the test, rather than at some later collection."""
    with pytest.raises(Exception) as caught:
        call(module)
    error = caught.value
    error.__traceback__ = None
    del caught
    return error


def bad_call_params() -> list[Any]:
    # torch's half-built iterator complains from __del__ when prefetch_factor=0 stops it.
    quiet = pytest.mark.filterwarnings("ignore::pytest.PytestUnraisableExceptionWarning")
    return [pytest.param(name, marks=quiet) if name == "prefetch-factor-zero" else name for name in BAD_CALLS]


@pytest.mark.parametrize("name", bad_call_params())
def test_bad_argument_raises_like_torch_and_names_it(name: str) -> None:
    bad = BAD_CALLS[name]
    theirs, mine = raised_by(bad.call, tud), raised_by(bad.call, pipeload)
    assert isinstance(mine, type(theirs)), (
        f"torch raises {type(theirs).__name__}, pipeload raised {type(mine).__name__}: {mine}"
    )
    message = str(mine)
    for fragment in bad.mentions(pipeload):
        assert fragment in message, f"{fragment!r} is missing from the message: {message!r}"


@pytest.mark.parametrize("kwargs", [
    {"drop_last": 1, "collate_fn": 3},
    {"batch_size": 1.5, "collate_fn": 3},
    {"generator": 3, "drop_last": 1},
    {"sampler": [0, 1], "shuffle": True, "worker_init_fn": 3, "num_workers": 2},
], ids=["drop-last+collate", "batch-size+collate", "generator+drop-last", "sampler-shuffle+init"])
def test_a_loader_wrong_two_ways_raises_the_error_torchs_constructor_raises(kwargs: dict[str, Any]) -> None:
    # Our checks of what torch finds wrong only when iterating ran first: a TypeError where
    # torch's constructor raises a ValueError (stop 54's parity fuzz).
    theirs = raised_by(lambda m: m.DataLoader(numbers(m), **kwargs), tud)
    mine = raised_by(lambda m: m.DataLoader(numbers(m), **kwargs), pipeload)
    assert type(mine) is type(theirs) and str(mine).startswith(str(theirs)), (theirs, mine)


# ------------------------------------------------------------------ accepted edge values


ACCEPTED: dict[str, Callable[[ModuleType], Any]] = {
    "iterable-with-shuffle-false": lambda m: m.DataLoader(COUNTER[m](), shuffle=False),
    "iterable-with-shuffle-none": lambda m: m.DataLoader(COUNTER[m](), shuffle=None),
    "batch-sampler-with-default-batch-size": lambda m: m.DataLoader(numbers(m), batch_sampler=[[0, 1], [2]]),
    "batch-size-none": lambda m: m.DataLoader(numbers(m), batch_size=None),
    "sampler-with-shuffle-false": lambda m: m.DataLoader(numbers(m), shuffle=False, sampler=[0, 2]),
    "context-string-with-workers": lambda m: m.DataLoader(numbers(m), num_workers=1, multiprocessing_context="fork"),
    "context-object-with-workers": lambda m: m.DataLoader(
        numbers(m), num_workers=1, multiprocessing_context=multiprocessing.get_context("fork")
    ),
    "timeout-zero-float": lambda m: m.DataLoader(numbers(m), timeout=0.0),
}


@pytest.mark.parametrize("name", list(ACCEPTED))
def test_arguments_torch_accepts_are_accepted(name: str) -> None:
    theirs = ACCEPTED[name](tud)
    mine = ACCEPTED[name](pipeload)
    assert (mine.batch_size, mine.drop_last) == (theirs.batch_size, theirs.drop_last)
    assert type(mine.multiprocessing_context) is type(theirs.multiprocessing_context)
    if mine.multiprocessing_context is not None:
        assert mine.multiprocessing_context.get_start_method() == theirs.multiprocessing_context.get_start_method()


# torch compares num_workers, timeout and prefetch_factor with numbers and never checks their type:
# numpy integers, bools and whole floats it can use, it uses. Each call here runs with torch.
NUMBERS_TORCH_TAKES: dict[str, dict[str, Any]] = {
    "num-workers-numpy": {"num_workers": np.int64(2)},
    "num-workers-numpy-zero": {"num_workers": np.int32(0)},
    "num-workers-true": {"num_workers": True},
    "num-workers-false": {"num_workers": False},
    "num-workers-whole-float-zero": {"num_workers": 0.0},
    "num-workers-tensor": {"num_workers": torch.tensor(2)},
    "timeout-true": {"num_workers": 1, "timeout": True},
    "timeout-false": {"timeout": False},
    "timeout-numpy-int": {"num_workers": 1, "timeout": np.int64(30)},
    "timeout-tensor": {"num_workers": 1, "timeout": torch.tensor(30.0)},
    "prefetch-factor-numpy": {"num_workers": 1, "prefetch_factor": np.int64(3)},
    "prefetch-factor-true": {"num_workers": 1, "prefetch_factor": True},
}


@pytest.mark.parametrize("name", list(NUMBERS_TORCH_TAKES))
def test_numbers_of_other_types_torch_takes_are_taken(name: str) -> None:
    kwargs = NUMBERS_TORCH_TAKES[name]
    if kwargs.get("num_workers"):
        kwargs = {**kwargs, "multiprocessing_context": "fork"}
    theirs = tud.DataLoader(numbers(tud), batch_size=4, **kwargs)
    mine = pipeload.DataLoader(numbers(pipeload), batch_size=4, **kwargs)
    for option in ("num_workers", "timeout", "prefetch_factor"):
        assert getattr(mine, option) == getattr(theirs, option), option
    assert [b[0].tolist() for b in mine] == [b[0].tolist() for b in theirs] == [[0, 1, 2, 3], [4, 5]]


# ------------------------------------------------------------------ attributes after init

FROZEN_AFTER_INIT = ["batch_size", "batch_sampler", "sampler", "drop_last", "dataset", "persistent_workers"]


REFUSED_VALUE = {"batch_size": 7, "drop_last": True, "persistent_workers": True}


def set_after_init(module: ModuleType, attribute: str) -> BaseException:
    loader = module.DataLoader(numbers(module), batch_size=2)
    before = getattr(loader, attribute)
    with pytest.raises(Exception) as caught:
        setattr(loader, attribute, REFUSED_VALUE.get(attribute, [[0]]))
    assert getattr(loader, attribute) is before  # refused, so unchanged
    return caught.value


@pytest.mark.parametrize("attribute", FROZEN_AFTER_INIT)
def test_setting_a_frozen_attribute_after_init_raises_like_torch(attribute: str) -> None:
    theirs, mine = set_after_init(tud, attribute), set_after_init(pipeload, attribute)
    assert type(mine) is type(theirs)
    assert attribute in str(mine)


@pytest.mark.parametrize("attribute", FROZEN_AFTER_INIT)
def test_setting_a_frozen_attribute_after_init_names_the_refused_value(attribute: str) -> None:
    message = str(set_after_init(pipeload, attribute))
    value = REFUSED_VALUE.get(attribute, [[0]])
    assert f"{attribute}={value!r}" in message, f"the refused value is missing from: {message!r}"


@pytest.mark.parametrize("attribute", ["num_workers", "pin_memory", "timeout", "collate_fn", "worker_init_fn"])
def test_other_attributes_may_be_set_after_init_as_in_torch(attribute: str) -> None:
    value = {"num_workers": 0, "pin_memory": False, "timeout": 0}.get(attribute, None)
    for module in (tud, pipeload):
        loader = module.DataLoader(numbers(module), batch_size=2)
        setattr(loader, attribute, value)
        assert getattr(loader, attribute) == value


@pytest.mark.parametrize(
    ("value", "error"), [("bogus", ValueError), (3.5, TypeError)], ids=["unknown-method", "not-a-context"]
)
def test_multiprocessing_context_set_after_init_is_checked_like_torch(value: Any, error: type) -> None:
    for module in (tud, pipeload):
        loader = module.DataLoader(numbers(module), num_workers=2)
        with pytest.raises(error) as caught:
            loader.multiprocessing_context = value
    assert f"multiprocessing_context={value!r}" in str(caught.value)


def test_multiprocessing_context_set_after_init_is_resolved_like_torch() -> None:
    contexts = []
    for module in (tud, pipeload):
        loader = module.DataLoader(numbers(module), num_workers=2)
        loader.multiprocessing_context = "spawn"
        contexts.append(loader.multiprocessing_context)
    assert [c.get_start_method() for c in contexts] == ["spawn", "spawn"]


# ------------------------------------------------------------------ worker_type (pipeload only)


@pytest.mark.parametrize("worker_type", ["bogus", "threads", "Process", None, 1])
def test_unknown_worker_type_is_refused_by_name(worker_type: Any) -> None:
    with pytest.raises(ValueError) as caught:
        pipeload.DataLoader(numbers(pipeload), num_workers=2, worker_type=worker_type)
    message = str(caught.value)
    assert f"worker_type={worker_type!r}" in message
    assert "'process'" in message and "'thread'" in message  # says what would be accepted


def test_a_start_method_for_thread_workers_is_refused_by_name() -> None:
    with pytest.raises(ValueError) as caught:
        pipeload.DataLoader(numbers(pipeload), num_workers=2, worker_type="thread",
                            multiprocessing_context="spawn")
    assert "multiprocessing_context='spawn'" in str(caught.value)
    assert "worker_type='thread'" in str(caught.value)


def test_worker_type_is_keyword_only() -> None:
    # batch_size ... generator: every parameter torch takes by position.
    positional = [1, None, None, None, 0, None, False, False, 0, None, None, None]
    pipeload.DataLoader(numbers(pipeload), *positional)
    with pytest.raises(TypeError):
        pipeload.DataLoader(numbers(pipeload), *positional, "thread")


@pytest.mark.parametrize("worker_type", ["process", "thread"])
def test_known_worker_types_are_accepted(worker_type: str) -> None:
    loader = pipeload.DataLoader(numbers(pipeload), batch_size=3, worker_type=worker_type)
    assert [batch[0].tolist() for batch in loader] == [[0, 1, 2], [3, 4, 5]]


# ------------------------------------------------------------------ mode (pipeload only)


@pytest.mark.parametrize("mode", ["Economic", "fast", None, 1])
def test_unknown_mode_is_refused_by_name(mode: Any) -> None:
    with pytest.raises(ValueError) as caught:
        pipeload.DataLoader(numbers(pipeload), num_workers=2, mode=mode)
    message = str(caught.value)
    assert f"mode={mode!r}" in message
    assert "'classic'" in message and "'economic'" in message


@pytest.mark.parametrize(
    ("kwargs", "error", "mentions"),
    [
        ({"num_batch_workers": 0}, ValueError, "num_batch_workers=0"),
        ({"num_batch_workers": -2}, ValueError, "num_batch_workers=-2"),
        ({"num_batch_workers": 1.5}, TypeError, "num_batch_workers=1.5"),
        ({"num_batch_workers": True}, TypeError, "num_batch_workers=True"),
        ({"prefetch_factor": 0}, ValueError, "prefetch_factor=0"),
        ({"prefetch_factor": "2"}, TypeError, "prefetch_factor='2'"),
    ],
)
def test_bad_economic_counts_are_refused_by_name(kwargs: dict, error: type, mentions: str) -> None:
    with pytest.raises(error) as caught:
        pipeload.DataLoader(numbers(pipeload), num_workers=2, mode="economic", **kwargs)
    assert mentions in str(caught.value)


@pytest.mark.parametrize("count", [np.int64(3), torch.tensor(3)], ids=["numpy", "tensor"])
def test_num_batch_workers_takes_whole_numbers_as_num_workers_does(count: Any) -> None:
    # A config that yields numpy ints (or tensors) for every count: num_workers takes them.
    loader = pipeload.DataLoader(numbers(pipeload), batch_size=2, num_workers=np.int64(2), mode="economic",
                                 num_batch_workers=count, worker_type="thread")
    assert type(loader.num_batch_workers) is int and loader.num_batch_workers == 3
    assert [x for batch in loader for x in batch[0].tolist()] == list(range(6))


def test_num_batch_workers_without_economic_mode_is_refused() -> None:
    with pytest.raises(ValueError) as caught:
        pipeload.DataLoader(numbers(pipeload), num_workers=2, num_batch_workers=2)
    assert "num_batch_workers=2" in str(caught.value) and "mode='economic'" in str(caught.value)


def test_economic_mode_without_workers_loads_in_the_main_process() -> None:
    # The economic RFC: num_workers=0 "disables multiprocessing (as today)"; it used to be refused.
    loader = pipeload.DataLoader(numbers(pipeload), mode="economic", batch_size=3, shuffle=True,
                                 generator=torch.Generator().manual_seed(5))
    classic = pipeload.DataLoader(numbers(pipeload), batch_size=3, shuffle=True,
                                  generator=torch.Generator().manual_seed(5))
    assert [b[0].tolist() for b in loader] == [b[0].tolist() for b in classic]
    assert loader.num_batch_workers == 0 and loader.stats().setup.num_workers == 0


def test_economic_mode_refuses_an_iterable_dataset_naming_the_mode() -> None:
    with pytest.raises(ValueError) as caught:
        pipeload.DataLoader(PipeCounter(), num_workers=2, mode="economic")
    message = str(caught.value)
    assert "mode='economic'" in message and "map-style" in message and "PipeCounter" in message


@pytest.mark.parametrize(("prefetch_factor", "expected"), [(None, 2), (3, 3)])
def test_num_batch_workers_defaults_to_prefetch_factor(prefetch_factor: Any, expected: int) -> None:
    loader = pipeload.DataLoader(numbers(pipeload), num_workers=2, mode="economic",
                                 prefetch_factor=prefetch_factor)
    assert (loader.mode, loader.num_batch_workers, loader.prefetch_factor) == ("economic", expected, expected)
    assert pipeload.DataLoader(numbers(pipeload), num_workers=2).num_batch_workers is None


@pytest.mark.parametrize("attribute", ["mode", "num_batch_workers"])
def test_mode_and_batch_workers_are_frozen_after_init(attribute: str) -> None:
    loader = pipeload.DataLoader(numbers(pipeload), num_workers=2, mode="economic")
    with pytest.raises(ValueError, match=attribute):
        setattr(loader, attribute, "classic" if attribute == "mode" else 3)


def test_mode_and_num_batch_workers_are_keyword_only() -> None:
    positional = [1, None, None, None, 2, None, False, False, 0, None, None, None]
    with pytest.raises(TypeError):
        pipeload.DataLoader(numbers(pipeload), *positional, "economic")


# ------------------------------------------------------------------ max_shm_bytes (pipeload only)


@pytest.mark.parametrize("value, error", [(0, ValueError), (-1, ValueError), (1.5, TypeError),
                                          ("1G", TypeError), (True, TypeError)])
def test_a_bad_max_shm_bytes_is_refused_by_name(value: Any, error: type) -> None:
    with pytest.raises(error) as caught:
        pipeload.DataLoader(numbers(pipeload), num_workers=2, max_shm_bytes=value)
    assert f"max_shm_bytes={value!r}" in str(caught.value)
    assert "positive number of bytes" in str(caught.value)


@pytest.mark.parametrize("value", [None, 1, 1 << 40])
def test_max_shm_bytes_is_keyword_only_and_accepted(value: Any) -> None:
    loader = pipeload.DataLoader(numbers(pipeload), batch_size=3, max_shm_bytes=value)
    assert loader.max_shm_bytes == value
    assert [batch[0].tolist() for batch in loader] == [[0, 1, 2], [3, 4, 5]]
    positional = [1, None, None, None, 0, None, False, False, 0, None, None, None]
    with pytest.raises(TypeError):
        pipeload.DataLoader(numbers(pipeload), *positional, 1 << 20)


# ------------------------------------------------------------------ stats (pipeload only)


def test_stats_is_refused_by_name_unless_true_or_false() -> None:
    # "no" would be taken as true: the loader would count every batch while the user thinks it off
    for value in ["yes", "no", 1, 0, None, np.True_]:
        with pytest.raises(TypeError, match=rf"stats should be True or False, but got stats={value!r}"):
            pipeload.DataLoader(numbers(pipeload), stats=value)
    for stats in (True, False):
        loader = pipeload.DataLoader(numbers(pipeload), batch_size=6, stats=stats)
        assert [batch[0].tolist() for batch in loader] == [list(range(6))]


# ------------------------------------------------------------------ generator


@pytest.mark.parametrize("value", [5, "seed", 0.5, torch.tensor(3)])
@pytest.mark.parametrize(
    "make",
    [
        lambda mod, g: mod.DataLoader(list(range(8)), shuffle=True, generator=g),
        lambda mod, g: mod.RandomSampler(range(8), generator=g),
        lambda mod, g: mod.SubsetRandomSampler([1, 2, 3], generator=g),
        lambda mod, g: mod.WeightedRandomSampler([1.0, 2.0], 4, generator=g),
    ],
    ids=["DataLoader", "RandomSampler", "SubsetRandomSampler", "WeightedRandomSampler"],
)
def test_a_generator_that_is_not_one_is_refused_by_name_when_given(make: Callable, value: Any) -> None:
    # torch takes it and fails at the first draw, inside randperm/multinomial, with a TypeError
    # naming neither the argument nor the class: the same type, raised where the mistake is.
    with pytest.raises(TypeError):
        list(make(tud, value))
    with pytest.raises(TypeError) as caught:
        make(pipeload, value)
    assert "generator should be a torch.Generator or None" in str(caught.value)
    assert type(value).__name__ in str(caught.value)


# ------------------------------------------------------------------ generics


def test_dataloader_can_be_subscripted_like_torch() -> None:
    alias = pipeload.DataLoader[list[torch.Tensor]]
    assert alias.__origin__ is pipeload.DataLoader
    assert alias.__args__ == tud.DataLoader[list[torch.Tensor]].__args__
    loader = alias(numbers(pipeload), batch_size=6)
    assert isinstance(loader, pipeload.DataLoader)
    assert next(iter(loader))[0].tolist() == list(range(6))


class Records(pipeload.Dataset[dict]):
    def __getitem__(self, index: int) -> dict:
        return {"index": index}

    def __len__(self) -> int:
        return 3


class Counts(pipeload.IterableDataset[int]):
    def __iter__(self) -> Iterator[int]:
        return iter(range(3))


class Evens(pipeload.Sampler[int]):
    def __iter__(self) -> Iterator[int]:
        return iter([0, 2])

    def __len__(self) -> int:
        return 2


def test_dataset_sampler_subclasses_of_subscripted_generics_work() -> None:
    assert next(iter(pipeload.DataLoader(Records(), batch_size=3)))["index"].tolist() == [0, 1, 2]
    assert next(iter(pipeload.DataLoader(Counts(), batch_size=3))).tolist() == [0, 1, 2]
    assert next(iter(pipeload.DataLoader(Records(), sampler=Evens(), batch_size=2)))["index"].tolist() == [0, 2]
    # ... and torch's DataLoader takes them too, as iterable-style where they are.
    assert next(iter(tud.DataLoader(Counts(), batch_size=3))).tolist() == [0, 1, 2]
    assert Records.__orig_bases__ == (pipeload.Dataset[dict],)


@pytest.mark.parametrize(
    "generic",
    [
        lambda: pipeload.Dataset[int],
        lambda: pipeload.IterableDataset[str],
        lambda: pipeload.Sampler[list[int]],
        lambda: pipeload.Subset[int],
        lambda: pipeload.ConcatDataset[int],
        lambda: pipeload.StackDataset[tuple],
    ],
)
def test_public_generics_can_be_subscripted(generic: Callable[[], Any]) -> None:
    alias = generic()
    assert alias.__origin__ is not None


def test_the_excessive_workers_warning_counts_every_process_economic_mode_starts() -> None:
    import os

    cpus = len(os.sched_getaffinity(0))
    with pytest.warns(UserWarning, match=rf"will create {cpus + 1} worker processes in total.*"
                                         rf"\(pipeload: {cpus} item workers and up to 1 batch workers"):
        pipeload.DataLoader(numbers(pipeload), batch_size=2, num_workers=cpus, num_batch_workers=1,
                            mode="economic")


@pytest.mark.parametrize("mode", ["classic", "economic"])
def test_thread_workers_beyond_the_cpus_start_no_process_and_are_not_warned_about(mode: str) -> None:
    import os

    with warnings.catch_warnings():
        warnings.simplefilter("error")
        loader = pipeload.DataLoader(numbers(pipeload), batch_size=2, mode=mode, worker_type="thread",
                                     num_workers=len(os.sched_getaffinity(0)) + 2)
        loader.check_worker_number_rationality()


@pytest.mark.parametrize("name", ["collate_fn", "worker_init_fn"])
def test_a_function_argument_that_is_not_callable_is_refused_when_the_loader_is_made(name: str) -> None:
    # torch calls it only in the first batch (in a worker), and Python's words alone name
    # neither the argument nor the value: said at once, with those words first.
    with pytest.raises(TypeError, match=rf"^'int' object is not callable: {name} should be a function, "
                                        rf"but got {name}=3$"):
        pipeload.DataLoader(list(range(4)), num_workers=1, **{name: 3})


def test_a_worker_init_fn_without_workers_is_left_alone_as_torch_does_until_workers_are_asked_for() -> None:
    mine = pipeload.DataLoader(list(range(4)), batch_size=2, worker_init_fn=3)
    theirs = torch.utils.data.DataLoader(list(range(4)), batch_size=2, worker_init_fn=3)
    assert [b.tolist() for b in mine] == [b.tolist() for b in theirs] == [[0, 1], [2, 3]]
    mine.num_workers = 1
    with pytest.raises(TypeError, match=r"^'int' object is not callable: worker_init_fn should be a function"):
        iter(mine)


@pytest.mark.parametrize("name, value, error, words", [
    # torch's iterator refuses it as the epoch starts; ours ended every epoch after its first batch
    ("prefetch_factor", 0, AssertionError, "prefetch_factor must be greater than 0"),
    ("prefetch_factor", -1, AssertionError, "prefetch_factor option should be non-negative"),
    ("num_workers", -1, ValueError, "num_workers option should be non-negative"),
    ("num_workers", 1.5, TypeError, "num_workers should be an int"),
    ("num_workers", 2.0, TypeError, "'float' object cannot be interpreted as an integer"),
    ("timeout", -2, ValueError, "timeout option should be non-negative"),
    ("generator", 3, TypeError, "generator should be a torch.Generator or None"),
    ("worker_type", "fiber", ValueError, "worker_type should be one of"),
    ("num_workers", "auto", ValueError, "num_workers='auto' is given when the DataLoader is made"),
    ("max_shm_bytes", -1, ValueError, "max_shm_bytes should be a positive number of bytes"),
    ("worker_init_fn", 3, TypeError, "'int' object is not callable: worker_init_fn should be a function"),
])
def test_a_setting_assigned_after_construction_is_checked_when_set(name: str, value: Any, error: type,
                                                                   words: str) -> None:
    loader = pipeload.DataLoader(numbers(pipeload), batch_size=2, num_workers=2)
    with pytest.raises(error, match=re.escape(words)):
        setattr(loader, name, value)


def test_settings_assigned_after_construction_load_every_batch() -> None:
    loader = pipeload.DataLoader(numbers(pipeload), batch_size=2)
    loader.num_workers = np.int64(2)  # a numpy integer counts as the int, as in the constructor
    assert loader.num_workers == 2 and type(loader.num_workers) is int
    loader.collate_fn = None  # the constructor's default, not a None to call
    loader.multiprocessing_context = "fork"
    batches = [batch[0].tolist() for batch in loader]  # workers, with torch's default prefetch
    assert batches == [[0, 1], [2, 3], [4, 5]] and loader.prefetch_factor == 2
    loader.prefetch_factor = 1
    loader.in_order = np.True_  # what the constructor takes, too
    assert [batch[0].tolist() for batch in loader] == batches


def test_workers_set_to_none_after_construction_load_in_this_process_as_torchs_do() -> None:
    loader = pipeload.DataLoader(numbers(pipeload), batch_size=2, num_workers=2, persistent_workers=True)
    loader.num_workers = 0
    assert [batch[0].tolist() for batch in loader] == [[0, 1], [2, 3], [4, 5]]


@pytest.mark.parametrize("persistent_workers", [False, True])
def test_the_excessive_workers_warning_comes_as_torchs_does_when_workers_start(persistent_workers: bool) -> None:
    # torch says it when the loader is made and again in every new iterator with workers: each
    # epoch without persistent workers, the first one with them.
    import os

    def warned(module: Any) -> list[str]:
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            loader = module.DataLoader(list(range(4)), batch_size=2, persistent_workers=persistent_workers,
                                       num_workers=len(os.sched_getaffinity(0)) + 1)
            for _ in range(2):
                list(loader)
        return [str(w.message)[:60] for w in caught if "worker processes in total" in str(w.message)]

    assert warned(pipeload) == warned(torch.utils.data) and len(warned(pipeload)) == (2 if persistent_workers else 3)


@pytest.mark.parametrize("kwargs", [{"num_workers": "2"}, {"num_workers": None}, {"num_workers": 2.0},
                                    {"num_workers": 1, "prefetch_factor": 2.0}],
                         ids=["num-workers-str", "num-workers-none", "num-workers-whole-float",
                              "prefetch-factor-whole-float"])
def test_number_arguments_of_the_wrong_type_are_refused_in_torchs_words_first(kwargs: dict[str, Any]) -> None:
    # torch's own sentence (from its comparison with 0, or from range() once iterating) came
    # after ours, or not at all: a match= written for torch failed.
    with pytest.raises(TypeError) as theirs:
        iterate(tud.DataLoader(numbers(tud), batch_size=2, multiprocessing_context="fork", **kwargs))
    with pytest.raises(TypeError) as mine:
        pipeload.DataLoader(numbers(pipeload), batch_size=2, multiprocessing_context="fork", **kwargs)
    assert str(mine.value).startswith(str(theirs.value).splitlines()[0]), (str(mine.value), str(theirs.value))


@pytest.mark.parametrize("timeout", [None, "1"], ids=["None", "str"])
def test_a_timeout_that_is_no_number_is_refused_in_torchs_words_first(timeout: Any) -> None:
    with pytest.raises(TypeError) as theirs:
        torch.utils.data.DataLoader(list(range(4)), timeout=timeout)
    with pytest.raises(TypeError) as mine:
        pipeload.DataLoader(list(range(4)), timeout=timeout)
    assert str(mine.value).startswith(str(theirs.value)) and "timeout=" in str(mine.value)
