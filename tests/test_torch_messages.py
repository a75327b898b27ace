"""torch's own words stay in our messages: every error and warning torch.utils.data raises for a
situation pipeload also detects is provoked side by side, and torch's text must appear in ours,
first (numbers formatted as torch formats them), with only pids and addresses normalised.

Users and their tests match torch's sentences with regular expressions; our own detail may follow
torch's sentence, never replace it. A new raise or warn for a situation torch also reports
belongs in CASES.

Left out on purpose, with the reason:
  * an iterator's pickling error: torch's ``str()`` is the repr of an argument tuple
    ("('{} cannot be pickled', ...)"); ours says "_EpochIterator cannot be pickled";
  * ``Subset`` subclasses overriding ``__getitem__`` only: torch 2.13 refuses them, we accept them;
  * Python's incidental messages (comparing a str num_workers with 0, an empty RandomSampler):
    no sentence of torch's, only the exception type, which we keep (a ConcatDataset index past
    the end and ``len()`` of an empty TensorDataset are in CASES: torch's IndexError always reads
    "list index out of range" or "tuple index out of range", and code written for it may match
    those words);
  * "Pin memory thread exited unexpectedly" and pin-thread errors: torch pins only with an
    accelerator (tests/engine/test_pin_stage.py checks ours);
  * running out of file descriptors: needs its own process (tests/engine/test_fd_limit.py).
"""

from __future__ import annotations

import faulthandler
import gc
import os
import re
import signal
import time
import warnings
from collections.abc import Callable
from dataclasses import dataclass
from types import ModuleType
from typing import Any

import numpy as np
import pytest
import torch
import torch.utils.data as tud

import pipeload
from pipeload.pin import pinning_available

pytestmark = [
    pytest.mark.usefixtures("leak_guard"),
    pytest.mark.timeout(60),
    pytest.mark.filterwarnings("ignore:The PyTorch API of nested tensors"),
    # torch's half-built iterator complains from __del__ when prefetch_factor=0 stops it.
    pytest.mark.filterwarnings("ignore::pytest.PytestUnraisableExceptionWarning"),
]


def first_line(text: str) -> str:
    return text.splitlines()[0]


@dataclass(frozen=True)
class Case:
    """One situation, provoked through either module.

    ``provoke(m)`` raises, or warns, or both. ``relevant`` cuts torch's text down to the part
    users match (the first line of a worker's error, whose traceback differs by nature);
    ``first`` asks that ours start with it, not only contain it.
    """

    provoke: Callable[[ModuleType], object]
    error: bool = True
    relevant: Callable[[str], str] = staticmethod(lambda text: text)  # type: ignore[assignment]
    first: bool = True


# -- datasets and hooks used by the cases ----------------------------------------------------


class Bad(ValueError):
    pass


class RaisesAt:
    def __len__(self) -> int:
        return 4

    def __getitem__(self, index: int) -> int:
        if index == 1:
            raise Bad("sample 1 is corrupt")
        return index


class DiesAt:
    """The worker fetching item 1 dies: ``how`` is a signal number or an exit code."""

    def __init__(self, how: str) -> None:
        self.how = how

    def __len__(self) -> int:
        return 4

    def __getitem__(self, index: int) -> int:
        if index == 1:
            faulthandler.disable()  # pytest's, inherited through fork: no dump for a planned crash
            if self.how == "segfault":
                os.kill(os.getpid(), signal.SIGSEGV)
            os._exit(3)
        return index


class Slow:
    def __len__(self) -> int:
        return 4

    def __getitem__(self, index: int) -> int:
        if index == 1:
            time.sleep(1.3)
        return index


def failing_init(worker_id: int) -> None:
    raise Bad(f"worker_init_fn refused worker {worker_id}")


class ShortGetitems:
    def __len__(self) -> int:
        return 4

    def __getitem__(self, index: int) -> int:
        return index

    def __getitems__(self, indices: list[int]) -> list[int]:
        return list(indices)[:-1]


class GeneratorGetitems(ShortGetitems):
    """``__getitems__`` returns a generator: torch's default_collate fails on it."""

    def __getitems__(self, indices: list[int]) -> Any:
        return (index for index in indices)


def last_line(text: str) -> str:
    return text.strip().splitlines()[-1]


def longer_than_its_len(m: ModuleType) -> Any:
    class Stream(m.IterableDataset):
        def __iter__(self) -> Any:
            return iter(range(4))

        def __len__(self) -> int:
            return 2

    return Stream()


def counter(m: ModuleType) -> Any:
    class Counter(m.IterableDataset):
        def __iter__(self) -> Any:
            return iter(range(4))

    return Counter()


def run(loader: Any) -> list[Any]:
    return list(loader)


def with_length_read(loader: Any) -> list[Any]:
    len(loader)
    return list(loader)


def too_many_workers() -> int:
    return len(os.sched_getaffinity(0)) + 1


FORK = {"multiprocessing_context": "fork"}
CASES: dict[str, Case] = {
    # DataLoader arguments
    "num_workers<0": Case(lambda m: m.DataLoader(range(4), num_workers=-1)),
    "num_workers<0, a float": Case(lambda m: m.DataLoader(range(4), num_workers=-0.5)),
    "timeout<0": Case(lambda m: m.DataLoader(range(4), timeout=-1)),
    "prefetch_factor without workers": Case(lambda m: m.DataLoader(range(4), prefetch_factor=2)),
    "prefetch_factor<0": Case(lambda m: m.DataLoader(range(4), num_workers=1, prefetch_factor=-1)),
    "prefetch_factor=0": Case(lambda m: next(iter(m.DataLoader(range(4), num_workers=1, prefetch_factor=0, **FORK)))),
    "persistent_workers without workers": Case(lambda m: m.DataLoader(range(4), persistent_workers=True)),
    "iterable with shuffle": Case(lambda m: m.DataLoader(counter(m), shuffle=True)),
    "iterable with sampler": Case(lambda m: m.DataLoader(counter(m), sampler=[0, 1])),
    "iterable with batch_sampler": Case(lambda m: m.DataLoader(counter(m), batch_sampler=[[0, 1]])),
    "sampler with shuffle": Case(lambda m: m.DataLoader(range(4), sampler=[0, 1], shuffle=True)),
    "batch_sampler with batch_size": Case(lambda m: m.DataLoader(range(4), batch_size=2, batch_sampler=[[0]])),
    "batch_size=None with drop_last": Case(lambda m: m.DataLoader(range(4), batch_size=None, drop_last=True)),
    "batch_size=0": Case(lambda m: m.DataLoader(range(4), batch_size=0)),
    "batch_size='4'": Case(lambda m: m.DataLoader(range(4), batch_size="4")),
    "drop_last='yes'": Case(lambda m: m.DataLoader(range(4), batch_size=2, drop_last="yes")),
    "unknown start method": Case(lambda m: m.DataLoader(range(4), num_workers=1, multiprocessing_context="bogus")),
    "context not a context": Case(lambda m: m.DataLoader(range(4), num_workers=1, multiprocessing_context=42)),
    "context without workers": Case(lambda m: m.DataLoader(range(4), multiprocessing_context="fork")),
    "frozen attribute": Case(lambda m: setattr(m.DataLoader(range(4)), "batch_size", 3)),
    "timeout without workers": Case(lambda m: next(iter(m.DataLoader(range(4), timeout=5)))),
    "too many workers": Case(lambda m: m.DataLoader(range(4), num_workers=too_many_workers()), error=False),
    "unpicklable under spawn": Case(
        lambda m: iter(m.DataLoader(range(4), num_workers=1, collate_fn=lambda b: b, multiprocessing_context="spawn"))
    ),
    "unpicklable under spawn (warning)": Case(
        lambda m: iter(m.DataLoader(range(4), num_workers=1, collate_fn=lambda b: b, multiprocessing_context="spawn")),
        error=False,
    ),
    "IterableDataset longer than its len": Case(
        lambda m: with_length_read(m.DataLoader(longer_than_its_len(m), batch_size=None)), error=False
    ),
    "IterableDataset longer than its len, workers": Case(
        lambda m: with_length_read(m.DataLoader(longer_than_its_len(m), batch_size=None, num_workers=2, **FORK)),
        error=False,
    ),
    # workers
    "error in __getitem__": Case(lambda m: run(m.DataLoader(RaisesAt(), num_workers=1, **FORK)), relevant=first_line),
    "error in worker_init_fn": Case(
        lambda m: run(m.DataLoader(range(4), num_workers=1, worker_init_fn=failing_init, **FORK)), relevant=first_line
    ),
    "worker killed by a signal": Case(lambda m: run(m.DataLoader(DiesAt("segfault"), num_workers=1, **FORK)), first=False),
    "worker exits with a code": Case(lambda m: run(m.DataLoader(DiesAt("exit3"), num_workers=1, **FORK)), first=False),
    # An int timeout: torch prints it as given ("after 1 seconds"), not as a float.
    "timeout": Case(lambda m: run(m.DataLoader(Slow(), num_workers=1, timeout=1, **FORK))),
    # Counting the samples for stats() asked the generator's len() first, in other words.
    "__getitems__ returns a generator": Case(lambda m: run(m.DataLoader(GeneratorGetitems(), batch_size=2))),
    "__getitems__ returns a generator, workers": Case(
        lambda m: run(m.DataLoader(GeneratorGetitems(), batch_size=2, num_workers=1, **FORK)), relevant=last_line,
        first=False,
    ),
    # datasets
    "Dataset without __getitem__": Case(lambda m: m.Dataset()[0]),
    "TensorDataset sizes": Case(lambda m: m.TensorDataset(torch.zeros(2), torch.zeros(3))),
    "TensorDataset of nothing": Case(lambda m: len(m.TensorDataset())),
    "StackDataset of nothing": Case(lambda m: m.StackDataset()),
    "StackDataset args and kwargs": Case(lambda m: m.StackDataset([1], a=[1])),
    "StackDataset sizes": Case(lambda m: m.StackDataset([1], [1, 2])),
    "StackDataset short __getitems__": Case(lambda m: m.StackDataset(ShortGetitems()).__getitems__([0, 1, 2, 3])),
    "StackDataset short __getitems__ by keyword": Case(lambda m: m.StackDataset(a=ShortGetitems()).__getitems__([0, 1])),
    "ConcatDataset of nothing": Case(lambda m: m.ConcatDataset([])),
    "ConcatDataset of a stream": Case(lambda m: m.ConcatDataset([counter(m)])),
    "ConcatDataset index below -len": Case(lambda m: m.ConcatDataset([[1, 2]])[-3]),
    "ConcatDataset index past the end": Case(lambda m: m.ConcatDataset([[1, 2], [3]])[3]),
    "ConcatDataset.cummulative_sizes": Case(lambda m: m.ConcatDataset([[1, 2]]).cummulative_sizes, error=False),
    "ChainDataset of a map-style dataset": Case(lambda m: list(m.ChainDataset([[1, 2]]))),
    "len of ChainDataset of a map-style dataset": Case(lambda m: len(m.ChainDataset([[1, 2]]))),
    "random_split fraction above 1": Case(lambda m: m.random_split(range(4), [1.5, -0.5])),
    "random_split lengths not summing": Case(lambda m: m.random_split(range(4), [1, 2])),
    "random_split empty split": Case(lambda m: m.random_split(range(3), [1.0, 0.0]), error=False),
    # samplers
    "RandomSampler replacement=0": Case(lambda m: m.RandomSampler(range(4), replacement=0)),
    "RandomSampler num_samples=0": Case(lambda m: m.RandomSampler(range(4), num_samples=0)),
    "RandomSampler drawing from nothing": Case(lambda m: list(m.RandomSampler([], num_samples=3))),
    "WeightedRandomSampler num_samples=0": Case(lambda m: m.WeightedRandomSampler([1.0], 0)),
    "WeightedRandomSampler replacement=0": Case(lambda m: m.WeightedRandomSampler([1.0], 1, replacement=0)),
    "WeightedRandomSampler 2-d weights": Case(lambda m: m.WeightedRandomSampler([[1.0]], 1)),
    "WeightedRandomSampler negative weight": Case(lambda m: list(m.WeightedRandomSampler([1.0, -1.0], 1))),
    "WeightedRandomSampler infinite weight": Case(lambda m: list(m.WeightedRandomSampler([1.0, float("inf")], 1))),
    "WeightedRandomSampler zero weights": Case(lambda m: list(m.WeightedRandomSampler([0.0, 0.0], 1))),
    "WeightedRandomSampler too many draws": Case(
        lambda m: list(m.WeightedRandomSampler([1.0, 1.0], 3, replacement=False))
    ),
    "BatchSampler batch_size=0": Case(lambda m: m.BatchSampler(range(4), 0, False)),
    "BatchSampler drop_last=1": Case(lambda m: m.BatchSampler(range(4), 2, 1)),
    "DistributedSampler rank out of range": Case(lambda m: m.DistributedSampler(range(4), num_replicas=2, rank=2)),
    # collate
    "collate of an unknown type": Case(lambda m: m.default_collate([object(), object()])),
    "collate of text arrays": Case(lambda m: m.default_collate([np.array(["a"]), np.array(["b"])])),
    "collate of lists of different lengths": Case(lambda m: m.default_collate([[1, 2], [1]])),
    "collate of tensors of different shapes": Case(lambda m: m.default_collate([torch.zeros(2), torch.zeros(3)])),
    "collate of nested tensors": Case(
        lambda m: m.default_collate([torch.nested.nested_tensor([torch.zeros(2)])] * 2)
    ),
    "collate of sparse tensors": Case(lambda m: m.default_collate([torch.zeros(2).to_sparse()] * 2)),
}

if not pinning_available():  # torch warns about pinning only where it cannot pin
    CASES["pin_memory without an accelerator"] = Case(
        lambda m: run(m.DataLoader(range(4), pin_memory=True)), error=False
    )
    CASES["pin_memory_device"] = Case(
        lambda m: run(m.DataLoader(range(4), pin_memory=True, pin_memory_device="cuda")), error=False
    )


# -- comparing ---------------------------------------------------------------------------------


_VOLATILE = [
    (re.compile(r"pid\(s\) [\d, ]+\)"), "pid(s) N)"),
    (re.compile(r"pid \d+"), "pid N"),
    (re.compile(r"0x[0-9a-f]+"), "0xADDR"),
    (re.compile(r"torch_\d+_\d+_\d+"), "torch_SEGMENT"),
]


def normalise(text: str) -> str:
    for pattern, replacement in _VOLATILE:
        text = pattern.sub(replacement, text)
    return text


@dataclass
class Outcome:
    error: BaseException | None
    warnings: list[str]


def provoke(case: Case, module: ModuleType) -> Outcome:
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        try:
            case.provoke(module)
        except Exception as exc:  # noqa: BLE001 - any error is the subject here
            _drop_tracebacks(exc)  # let whatever the failed call built go now
            return Outcome(exc, [str(w.message) for w in caught])
        finally:
            if module is tud:
                gc.collect()  # torch's iterators sit in reference cycles after errors
    return Outcome(None, [str(w.message) for w in caught])


def _drop_tracebacks(error: BaseException | None) -> None:
    while error is not None:
        error.__traceback__ = None
        error = error.__cause__ or error.__context__


def assert_keeps(theirs: str, ours: str, first: bool) -> None:
    theirs, ours = normalise(theirs), normalise(ours)
    if first:
        assert ours.startswith(theirs), f"torch's words must come first:\n torch: {theirs!r}\n ours:  {ours!r}"
    else:
        assert theirs in ours, f"torch's words are missing:\n torch: {theirs!r}\n ours:  {ours!r}"


@pytest.mark.parametrize("name", list(CASES))
def test_our_message_keeps_torchs_words(name: str) -> None:
    case = CASES[name]
    theirs, ours = provoke(case, tud), provoke(case, pipeload)
    if case.error:
        assert theirs.error is not None, "the case must provoke torch"
        assert isinstance(ours.error, type(theirs.error)), f"torch: {theirs.error!r}, ours: {ours.error!r}"
        assert_keeps(case.relevant(str(theirs.error)), str(ours.error), case.first)
    else:
        torch_warnings = [w for w in theirs.warnings if "nested tensors" not in w]
        assert torch_warnings, "the case must make torch warn"
        for text in torch_warnings:
            relevant = normalise(case.relevant(text))
            assert any(normalise(mine).startswith(relevant) for mine in ours.warnings), (
                f"torch's warning {relevant!r} is missing from ours: {ours.warnings!r}"
            )
