"""Economic mode's own promises: items go item worker -> batch worker, never through the main
process (flat samples written into their batch's slab: the main process names their runs, and
batch workers collate only what is not so); at most ``prefetch_factor`` batches in flight whatever ``num_workers`` is; the first batch
is built by many item workers; ``get_worker_info()`` says which kind of worker asks; the same seed
gives the same batches whatever the timing and the worker count; a failed item fails only its
batch; dead item or batch workers are named; ``__getitems__`` gets sub-batches.
"""

from __future__ import annotations

import multiprocessing
import os
import random
import re
import signal
import threading
import time
from pathlib import Path
from typing import Any, NamedTuple

import numpy as np
import pytest
import torch
from conftest import in_shared_memory, once_the_main_thread_waits, pid_gone, sizes_past_errors, wait_until
from faults import (
    ECONOMIC,
    ECONOMIC_THREAD,
    FORK,
    DiesAt,
    MakesTensors,
    Numbers,
    RaisesAt,
    SampleFailed,
    Stalls,
    Uneven,
    delay_for,
    die,
    engine_params,
    flatten,
    loader_kwargs,
    worker_pids,
)

from pipeload import BatchSampler, DataLoader, SequentialSampler, default_collate, get_worker_info, random_split
from pipeload.engine.budget import POOL_TOLERATED_WAIT
from pipeload.engine.economic import EconomicConfig, EconomicEngine
from pipeload.engine.plan import DatasetKind, EconomicSetup, FetchSpec, WorkerSetup
from pipeload.errors import WorkerDiedError

pytestmark = [
    pytest.mark.usefixtures("leak_guard", "no_gc"),
    pytest.mark.timeout(60),
    pytest.mark.filterwarnings("ignore:This DataLoader will create:UserWarning"),
]

BOTH = engine_params(ECONOMIC, ECONOMIC_THREAD)


# -- where the work happens ---------------------------------------------------------------


class _WhoFetches(Numbers):
    def __getitem__(self, index: int) -> dict[str, Any]:
        info = get_worker_info()
        return {"index": index, "kind": info.kind, "id": info.id, "num_workers": info.num_workers}


def _collate_saying_who(samples: list[Any]) -> dict[str, Any]:
    info = get_worker_info()
    batch = default_collate(samples)
    batch["collated_by"] = (info.kind, info.id, info.num_workers)
    return batch


@pytest.mark.parametrize("engine", BOTH)
def test_worker_info_names_the_kind_of_worker(engine):
    loader = DataLoader(_WhoFetches(24), batch_size=4, num_workers=3, num_batch_workers=2,
                        collate_fn=_collate_saying_who, **loader_kwargs(engine))
    batches = list(loader)
    assert flatten([b["index"] for b in batches]) == list(range(24))
    assert {kind for b in batches for kind in b["kind"]} == {"item"}
    assert {int(i) for b in batches for i in b["id"]} <= {0, 1, 2}
    assert {int(n) for b in batches for n in b["num_workers"]} == {3}
    collators = {b["collated_by"] for b in batches}
    assert {kind for kind, _, _ in collators} == {"batch"}
    assert {worker for _, worker, _ in collators} <= {0, 1}
    assert {count for _, _, count in collators} == {2}


@pytest.mark.parametrize("engine", BOTH)
def test_many_item_workers_build_the_first_batch_together(engine):
    loader = DataLoader(_WhoFetches(64), batch_size=8, num_workers=4, **loader_kwargs(engine))
    first = next(iter(loader))
    assert first["index"].tolist() == list(range(8))
    assert set(first["id"].tolist()) == {0, 1, 2, 3}  # classic mode: one worker builds it alone


class _Traveller:
    """A sample that notes which process unpickled it (None: it was never pickled)."""

    def __init__(self, index: int, unpickled_in: int | None = None) -> None:
        self.index = index
        self.unpickled_in = unpickled_in

    def __reduce__(self) -> Any:
        return (_arrive, (self.index,))


def _arrive(index: int) -> _Traveller:
    return _Traveller(index, os.getpid())


class _Travellers(Numbers):
    def __getitem__(self, index: int) -> _Traveller:
        return _Traveller(index)


def _where_they_arrived(samples: list[_Traveller]) -> dict[str, Any]:
    return {"indices": [s.index for s in samples], "unpickled_in": {s.unpickled_in for s in samples},
            "collated_in": os.getpid()}


def test_items_travel_from_item_worker_to_batch_worker_directly():
    loader = DataLoader(_Travellers(12), batch_size=4, num_workers=2, mode="economic",
                        collate_fn=_where_they_arrived, multiprocessing_context="fork")
    iterator = iter(loader)
    batches = list(iterator)
    batch_worker_pids = {handle.pid for handle in iterator._workers[2:]}  # started as needed
    assert [b["indices"] for b in batches] == [[0, 1, 2, 3], [4, 5, 6, 7], [8, 9, 10, 11]]
    for batch in batches:
        assert batch["unpickled_in"] == {batch["collated_in"]}  # by the batch worker itself
        assert batch["collated_in"] in batch_worker_pids
        assert batch["collated_in"] != os.getpid()


class _TracedImage(NamedTuple):
    """A sample default_collate takes (a named tuple: not flat, for item workers), whose
    unpickling says where it happened."""

    image: torch.Tensor
    unpickled_in: int = -1

    def __reduce__(self) -> Any:
        return (_arrive_image, tuple(self))


def _arrive_image(image: torch.Tensor, unpickled_in: Any) -> _TracedImage:
    # a sample notes where it arrives; a batch (its field collated into a tensor) travels as is
    return _TracedImage(image, os.getpid() if isinstance(unpickled_in, int) else unpickled_in)


class _TracedImages(Numbers):
    def __getitem__(self, index: int) -> _TracedImage:
        return _TracedImage(torch.full((3, 40, 40), float(index)))  # laid out in slabs


def test_samples_that_are_not_flat_pass_through_the_main_process_in_the_first_batch_alone():
    # With default_collate too: the session's first batch goes out before anything is known of
    # its samples, and comes to the main process; its pieces say the samples are not flat, and
    # every later batch goes to batch workers. (Out of order, a second batch opens at once: its
    # pieces wait for the first report all the same.)
    loader = DataLoader(_TracedImages(48), batch_size=8, num_workers=1, mode="economic",
                        multiprocessing_context="fork", in_order=False)
    iterator = iter(loader)
    arrivals = [set(batch.unpickled_in.tolist()) for batch in iterator]
    batch_worker_pids = {handle.pid for handle in iterator._workers[1:]}
    assert len(arrivals) == 6 and arrivals.count({os.getpid()}) == 1
    assert all(pids <= batch_worker_pids for pids in arrivals if pids != {os.getpid()})


class _ShapeShifters(torch.utils.data.Dataset):
    """Large items whose layout changes along the epoch: same-sized dicts, then longer ones (the
    layout learned from the first batches no longer fits), then transposed (non-contiguous)
    tensors in a tuple with a second large leaf. Every batch is still stackable."""

    def __len__(self) -> int:
        return 96

    def __getitem__(self, index: int) -> Any:
        value = float(index)
        if index < 32:
            return {"x": torch.full((20_000,), value), "label": index}
        if index < 64:
            return {"x": torch.full((30_000,), value), "label": index}
        grid = torch.arange(20_000.0).reshape(100, 200) + value
        return (grid.t(), torch.full((40_000,), -value), index)


def test_items_written_into_their_batch_slab_give_torchs_batches_whatever_their_layout():
    expected = list(torch.utils.data.DataLoader(_ShapeShifters(), batch_size=8))
    loader = DataLoader(_ShapeShifters(), batch_size=8, num_workers=3, mode="economic",
                        multiprocessing_context="fork", persistent_workers=True)
    for _ in range(2):  # the second epoch starts with the layout the first one ended with
        got = list(loader)
        assert len(got) == len(expected)
        for number, (ours, theirs) in enumerate(zip(got, expected)):
            assert _same(ours, theirs), f"batch {number} differs"
        del got


def _same(ours: Any, theirs: Any) -> bool:
    if isinstance(theirs, torch.Tensor):
        return ours.shape == theirs.shape and torch.equal(ours, theirs) and ours.is_contiguous()
    if isinstance(theirs, dict):
        return ours.keys() == theirs.keys() and all(_same(ours[k], theirs[k]) for k in theirs)
    return len(ours) == len(theirs) and all(_same(a, b) for a, b in zip(ours, theirs))


class _FlatSamples(torch.utils.data.Dataset):
    """Flat samples (a tensor, or a tuple, list or dict of tensors and every scalar kind), large
    enough to be written into their batch's slab: item workers send them as columns."""

    def __init__(self, kind: str) -> None:
        self.kind = kind

    def __len__(self) -> int:
        return 44

    def __getitem__(self, index: int) -> Any:
        image = torch.arange(3 * 40 * 40, dtype=torch.float32).reshape(3, 40, 40) + index
        if self.kind == "tensor":
            return image
        fields = [image, torch.full((1600,), index % 3, dtype=torch.uint8), f"img/{index}.jpg",
                  index / 4, index % 2 == 0, index]
        if self.kind == "dict":
            return dict(zip(("image", "mask", "path", "weight", "flip", "label"), fields))
        return tuple(fields) if self.kind == "tuple" else fields


def _same_typed(ours: Any, theirs: Any) -> bool:
    """Equal, and of the same types all the way down (a tuple of strings is no list of them)."""
    if type(ours) is not type(theirs):
        return False
    if isinstance(theirs, torch.Tensor):
        return ours.dtype == theirs.dtype and ours.shape == theirs.shape and torch.equal(ours, theirs)
    if isinstance(theirs, dict):
        return list(ours) == list(theirs) and all(_same_typed(ours[k], theirs[k]) for k in theirs)
    if isinstance(theirs, (list, tuple)):
        return len(ours) == len(theirs) and all(_same_typed(a, b) for a, b in zip(ours, theirs))
    return ours == theirs


@pytest.mark.parametrize("kind", ["tuple", "list", "dict", "tensor"])
def test_flat_samples_sent_as_columns_give_torchs_batches(kind: str) -> None:
    expected = list(torch.utils.data.DataLoader(_FlatSamples(kind), batch_size=8))
    loader = DataLoader(_FlatSamples(kind), batch_size=8, num_workers=2, mode="economic",
                        multiprocessing_context="fork")
    got = list(loader)
    assert len(got) == len(expected)  # the last batch holds 4
    for number, (ours, theirs) in enumerate(zip(got, expected)):
        assert _same_typed(ours, theirs), f"batch {number} differs"


def _batch_worker_tasks(loader: DataLoader) -> int:
    return sum(worker.tasks for worker in loader.stats().workers if worker.kind == "batch")


def _same_batches_as_torchs(dataset: torch.utils.data.Dataset) -> int:
    """Loads ``dataset`` in economic mode, checks its batches against torch's loader; returns
    how many batches the batch workers collated."""
    expected = list(torch.utils.data.DataLoader(dataset, batch_size=8))
    loader = DataLoader(dataset, batch_size=8, num_workers=2, mode="economic",
                        multiprocessing_context="fork", stats=True)
    got = list(loader)
    assert len(got) == len(expected)
    assert all(_same_typed(ours, theirs) for ours, theirs in zip(got, expected))
    return _batch_worker_tasks(loader)


def test_flat_batches_are_all_assembled_by_the_main_process() -> None:
    # the first batch from its samples (sent before the items' sizes were known), the rest
    # laid out in slabs: no batch worker collates any
    assert _same_batches_as_torchs(_FlatSamples("dict")) == 0


def _stage_line(loader: DataLoader) -> str:
    line, = (line for line in loader.stats().summary().splitlines() if line.startswith("time per stage"))
    return line


def test_the_stats_say_how_many_batches_the_main_process_assembled() -> None:
    # The collate stage is the batch workers' alone, not the batches the main process put together.
    loader = DataLoader(_FlatSamples("dict"), batch_size=8, num_workers=2, mode="economic",
                        multiprocessing_context="fork", stats=True)
    assert len(list(loader)) == 6 and _batch_worker_tasks(loader) == 0
    assert ("collate: none in batch workers (the main process put together all 6 batches from "
            "item workers' pieces)") in _stage_line(loader)
    mixed = DataLoader(_WithArrays("dict"), batch_size=8, num_workers=2, mode="economic",
                       multiprocessing_context="fork", stats=True)
    assert len(list(mixed)) == 6 and _batch_worker_tasks(mixed) == 5  # the first: see below
    assert ("over the 5 batches the batch workers collated; the main process put together the "
            "other 1 from item workers' pieces") in _stage_line(mixed)


class _FailsAt21(_FlatSamples):
    def __getitem__(self, index: int) -> Any:
        if index == 21:
            raise KeyError(f"no item {index}")
        return super().__getitem__(index)


def test_a_failed_item_of_a_direct_batch_fails_that_batch_alone_as_torchs_loader_does() -> None:
    loader = DataLoader(_FailsAt21("tuple"), batch_size=8, num_workers=2, mode="economic",
                        multiprocessing_context="fork", stats=True)
    iterator = iter(loader)
    got = [next(iterator), next(iterator)]
    with pytest.raises(KeyError, match=r"Caught KeyError in DataLoader worker process \d"):
        next(iterator)  # batch 2 holds item 21
    got += list(iterator)
    expected = list(torch.utils.data.DataLoader(_FlatSamples("tuple"), batch_size=8))
    assert [batch[5].tolist() for batch in got] == [expected[n][5].tolist() for n in (0, 1, 3, 4, 5)]
    assert _batch_worker_tasks(loader) <= 2  # the failed batch too was the main process's


class _WithArrays(_FlatSamples):
    """As _FlatSamples, with a numpy field: no longer flat (default_collate turns arrays into
    tensors, which item workers leave to the batch workers)."""

    def __getitem__(self, index: int) -> Any:
        return {**super().__getitem__(index), "extra": np.full(3, index)}


def test_samples_that_are_not_flat_are_collated_by_batch_workers() -> None:
    # all but the session's first batch, which went out before anything was known of them
    assert _same_batches_as_torchs(_WithArrays("dict")) == 5


def test_the_next_set_of_workers_sends_samples_that_are_not_flat_to_batch_workers_at_once() -> None:
    # Without persistent workers each epoch is a new set: the loader remembers that its samples
    # cannot go as columns, so only the loader's very first batch passes through the main process.
    loader = DataLoader(_WithArrays("dict"), batch_size=8, num_workers=2, mode="economic",
                        multiprocessing_context="fork", stats=True)
    for _ in range(3):
        assert len(list(loader)) == 6
    assert _batch_worker_tasks(loader) == 17


class _LargeArrays(torch.utils.data.Dataset):
    """numpy arrays of 256 KiB: samples that are not tensors, each larger than a socket's buffer."""

    def __len__(self) -> int:
        return 8

    def __getitem__(self, index: int) -> np.ndarray:
        return np.full(65536, index, dtype=np.float32)


@pytest.mark.timeout(60)
def test_a_later_epoch_of_large_samples_that_are_not_flat_starts_its_batch_worker() -> None:
    # The second epoch hung: its first batch's COLLATE (which forks the batch worker) waited for
    # an item worker's first report, and the item worker was blocked handing its large item to
    # that batch worker, never started.
    loader = DataLoader(_LargeArrays(), batch_size=4, num_workers=2, mode="economic",
                        multiprocessing_context="fork", timeout=20)
    expected = [[float(i) for i in range(start, start + 4)] for start in (0, 4)]
    for _ in range(3):
        assert [batch[:, 0].tolist() for batch in loader] == expected


class _SubBatches(Numbers):
    """Defines ``__getitems__``; each call's size is recorded with its first item."""

    def __getitems__(self, indices: list[int]) -> list[tuple[int, int]]:
        return [(index, len(indices)) for index in indices]


@pytest.mark.parametrize("engine", BOTH)
def test_getitems_is_called_on_sub_batches(engine):
    loader = DataLoader(_SubBatches(16), batch_size=8, num_workers=2, **loader_kwargs(engine))
    batches = list(loader)
    assert [b[0].tolist() for b in batches] == [list(range(8)), list(range(8, 16))]
    assert {size for b in batches for size in b[1].tolist()} == {4}  # 8 items over 2 item workers


class _DropsOneOfEachCall(Numbers):
    """A ``__getitems__`` that returns one sample fewer than asked for (a bug in a dataset)."""

    def __getitems__(self, indices: list[int]) -> list[int]:
        return list(indices)[:-1]


@pytest.mark.parametrize("engine", BOTH)
def test_getitems_returning_the_wrong_number_of_samples_fails_its_batch_by_name(engine):
    # Sub-batches would otherwise be glued into a batch with holes: [0, 2] for indices 0-3.
    loader = DataLoader(_DropsOneOfEachCall(8), batch_size=4, num_workers=2, **loader_kwargs(engine))
    iterator = iter(loader)
    for first in (0, 4):
        with pytest.raises(ValueError) as caught:
            next(iterator)
        text = str(caught.value)
        assert "_DropsOneOfEachCall.__getitems__ returned 1 samples for 2 indices" in text, text
        assert f"sample indices [{first}, {first + 1}]" in text or f"sample indices [{first + 2}, {first + 3}]" in text
    with pytest.raises(StopIteration):
        next(iterator)


class _ReturnsColumns(Numbers):
    """A ``__getitems__`` that returns a mapping of columns, one key per index asked for."""

    def __getitems__(self, indices: list[int]) -> dict[str, Any]:
        return {f"column{k}": torch.tensor(list(indices)) for k in range(len(indices))}


class _ReturnsAGenerator(Numbers):
    def __getitems__(self, indices: list[int]) -> Any:
        return (index for index in indices)


@pytest.mark.parametrize("engine", BOTH)
@pytest.mark.parametrize("dataset", [_ReturnsColumns, _ReturnsAGenerator])
def test_getitems_returning_no_list_of_samples_fails_its_batch_by_name(engine, dataset):
    # Sub-batches are glued by position: a mapping's keys were taken for its samples (a batch of
    # column names, without a word), and a generator, which has no length, ended the item worker.
    loader = DataLoader(dataset(8), batch_size=4, num_workers=2, collate_fn=_identity,
                        **loader_kwargs(engine))
    iterator = iter(loader)
    for first in (0, 4):
        with pytest.raises(TypeError) as caught:
            next(iterator)
        text = str(caught.value)
        assert f"{dataset.__name__}.__getitems__ returned a" in text, text
        assert "not a list of samples" in text, text
        assert f"sample indices [{first}, {first + 1}]" in text or f"sample indices [{first + 2}, {first + 3}]" in text
    with pytest.raises(StopIteration):
        next(iterator)


def _identity(samples: Any) -> Any:
    return samples


# -- memory bound ---------------------------------------------------------------------------


class _CountsAhead(Numbers):
    """Counts fetches in shared memory (fork workers share the counters) and records the most
    items ever fetched ahead of the batches the test has taken, plus the one being handed over."""

    def __init__(self, length: int, batch_size: int) -> None:
        super().__init__(length)
        self.batch_size = batch_size
        self.fetched = multiprocessing.get_context("fork").Value("i", 0)
        self.taken = multiprocessing.get_context("fork").Value("i", 0)
        self.most_ahead = multiprocessing.get_context("fork").Value("i", 0)

    def __getitem__(self, index: int) -> int:
        with self.fetched.get_lock():
            self.fetched.value += 1
            ahead = self.fetched.value - (self.taken.value + 1) * self.batch_size
            self.most_ahead.value = max(self.most_ahead.value, ahead)
        return index


def _take_slowly(dataset: _CountsAhead, loader: DataLoader, fill_to: int) -> None:
    """Take every batch, each time waiting until the loader has fetched ``fill_to`` items beyond
    the batches taken (or the dataset's end): the loader runs as far ahead as it may."""
    for _ in loader:
        dataset.taken.value += 1
        target = min(len(dataset), dataset.taken.value * dataset.batch_size + fill_to)
        assert wait_until(lambda: dataset.fetched.value >= target, 10.0)


@pytest.mark.parametrize("mode", ["economic", "torch"])
def test_items_in_flight_are_bounded_by_prefetch_factor_not_num_workers(mode):
    batch_size, prefetch_factor, num_workers = 4, 2, 8
    dataset = _CountsAhead(30 * batch_size, batch_size)
    arguments = dict(batch_size=batch_size, num_workers=num_workers,
                     prefetch_factor=prefetch_factor, multiprocessing_context="fork")
    bound = prefetch_factor * batch_size
    if mode == "economic":
        # A consumer that takes batches as fast as they come gets prefetch_factor in flight (a
        # slow one gets fewer: see the slab test below), and never more.
        iterator = iter(DataLoader(dataset, mode="economic", **arguments))
        in_flight = []
        for _ in iterator:
            dataset.taken.value += 1
            in_flight.append(iterator._engine._ledger.outstanding)
        assert max(in_flight) == prefetch_factor, in_flight
        assert dataset.most_ahead.value <= bound
    else:
        # The contrast that makes the bound mean something: torch's loader (the model classic
        # mode follows) keeps num_workers * prefetch_factor batches in flight. Classic mode's
        # own in-flight budget shrinks to what a slow consumer needs (tests/engine/test_budget.py),
        # so it is not the contrast here.
        loader = torch.utils.data.DataLoader(dataset, **arguments)
        _take_slowly(dataset, loader, fill_to=bound + batch_size + 1)
        assert dataset.most_ahead.value > bound


LARGE_ITEM_FLOATS = 1 << 18  # 1 MiB items, 12 MiB batches: each batch in flight costs a slab


def test_a_slow_training_loop_keeps_two_slabs_the_one_it_holds_and_the_next():
    # The pool builds a batch far quicker than the loop's step, so one batch in flight keeps it
    # fed (engine/budget.py): with the slab of the batch being dropped granted ahead, two slabs
    # serve the epoch, whatever prefetch_factor allows.
    loader = DataLoader(MakesTensors(12 * 10, LARGE_ITEM_FLOATS), batch_size=12, num_workers=4,
                        prefetch_factor=3, mode="economic", multiprocessing_context="fork")
    iterator = iter(loader)
    slabs = iterator._engine._workers.slabs
    # A pool's budget: another slab only when the loop would wait over half a step (budget.py).
    assert iterator._engine._budget._tolerated_wait == POOL_TOLERATED_WAIT
    live = []
    for number, batch in enumerate(iterator):
        assert batch[:, 0].tolist() == [float(number * 12 + k) for k in range(12)]
        live.append(slabs.slab_count)
        time.sleep(0.3)  # the training step
    assert max(live) <= 2, live


# -- seeding --------------------------------------------------------------------------------


class _Draws(Uneven):
    """Each item draws from torch, random and numpy; timing is uneven on purpose."""

    def __getitem__(self, index: int) -> torch.Tensor:
        super().__getitem__(index)
        rng = get_worker_info().rng
        if rng is None:  # a process worker: the global generators are its own
            draws = [torch.rand(()).item(), random.random(), np.random.rand()]
        else:  # a thread worker: its own generators, seeded the same way
            draws = [torch.rand((), generator=rng.torch_generator).item(),
                     rng.random_generator.random(), rng.numpy_generator.rand()]
        return torch.tensor([index, *draws], dtype=torch.float64)


def _collate_with_a_draw(samples: list[torch.Tensor]) -> tuple[torch.Tensor, float]:
    rng = get_worker_info().rng
    noise = random.random() if rng is None else rng.random_generator.random()
    return torch.stack(samples), noise


def _epochs(engine, seed: int, epochs: int = 1, **kwargs: Any) -> list[list[tuple]]:
    kwargs.setdefault("num_workers", 2)
    loader = DataLoader(_Draws(24, unit_s=0.002), batch_size=4, shuffle=True,
                        generator=torch.Generator().manual_seed(seed), collate_fn=_collate_with_a_draw,
                        **kwargs, **loader_kwargs(engine))
    return [sorted((tuple(b.flatten().tolist()), noise) for b, noise in loader) for _ in range(epochs)]


def test_the_same_seed_gives_the_same_batches_whatever_the_timing_and_worker_count():
    reference = _epochs(ECONOMIC, seed=5)
    assert _epochs(ECONOMIC, seed=5) == reference
    assert _epochs(ECONOMIC, seed=5, num_workers=3, num_batch_workers=1) == reference
    assert _epochs(ECONOMIC, seed=5, in_order=False) == reference
    assert _epochs(ECONOMIC_THREAD, seed=5) == reference  # threads draw from their own generators
    assert _epochs(ECONOMIC, seed=6) != reference


def test_a_random_split_subset_gives_the_same_batches_whatever_the_worker_count():
    # A Subset's __getitems__ only passes its indices on: cut into one call (one seed) per item
    # worker, its values changed with num_workers (a newcomer's probe at stop 53).
    def epochs(**kwargs: Any) -> list[list[tuple]]:
        loader = DataLoader(random_split(_Draws(32, unit_s=0.0), [24, 8],
                                         generator=torch.Generator().manual_seed(0))[0],
                            batch_size=8, shuffle=True, generator=torch.Generator().manual_seed(3),
                            collate_fn=_collate_with_a_draw, **kwargs, **loader_kwargs(ECONOMIC))
        return [sorted((tuple(b.flatten().tolist()), noise) for b, noise in loader)]
    reference = epochs(num_workers=1)
    assert epochs(num_workers=2) == reference and epochs(num_workers=3) == reference


class _MixedDtypes(Numbers):
    """float32 samples, every fourth float64; or (``grad``) some that require grad."""

    def __init__(self, count: int, grad: bool = False) -> None:
        super().__init__(count)
        self.grad = grad

    def __getitem__(self, index: int) -> torch.Tensor:
        if self.grad:
            return torch.full((4,), float(index), requires_grad=index % 2 == 0)
        return torch.full((4,), index + 0.1, dtype=torch.float64 if index % 4 == 3 else torch.float32)


@pytest.mark.parametrize("num_workers", [1, 3])
def test_every_batch_is_collated_as_a_worker_collates_it_whoever_collates_it(num_workers: int) -> None:
    # The session's first batch, collated by the main process, took the promoted dtype (float64
    # among float32 samples) and let samples that require grad through, where batch workers and
    # torch's workers give the first sample's dtype and refuse them (stop 53's economic skeptic).
    loader = DataLoader(_MixedDtypes(32), batch_size=8, num_workers=num_workers, **loader_kwargs(ECONOMIC))
    theirs = torch.utils.data.DataLoader(_MixedDtypes(32), batch_size=8, num_workers=2, multiprocessing_context="fork")
    assert [(b.dtype, b.tolist()) for b in loader] == [(b.dtype, b.tolist()) for b in theirs]
    grads = DataLoader(_MixedDtypes(32, grad=True), batch_size=8, num_workers=num_workers, **loader_kwargs(ECONOMIC))
    assert sizes_past_errors(grads, RuntimeError) == []  # every batch failed, the first included


@pytest.mark.parametrize("engine", BOTH)
def test_persistent_epochs_draw_differently_and_repeatably(engine):
    first = _epochs(engine, seed=1, epochs=2, persistent_workers=True)
    assert first[0] != first[1]
    assert _epochs(engine, seed=1, epochs=2, persistent_workers=True) == first


# -- failures -------------------------------------------------------------------------------


def _engine(dataset: Any, engine_choice, in_order: bool = True, forks_as_tasks_go: bool = True) -> EconomicEngine:
    spec = FetchSpec(dataset, DatasetKind.MAP, True, default_collate, False)
    method = "thread" if engine_choice.threads else "multiprocessing"
    setup = EconomicSetup(WorkerSetup(spec, 2, 0, None, method), num_batch_workers=2)
    context = None if engine_choice.threads else multiprocessing.get_context(engine_choice.context)
    config = EconomicConfig(setup, prefetch_factor=2, in_order=in_order, timeout_s=0.0,
                            worker_type=engine_choice.worker_type, mp_context=context,
                            forks_as_tasks_go=forks_as_tasks_go)
    return EconomicEngine(config)


def test_item_workers_are_forked_as_their_first_pieces_go_out_and_batch_workers_when_needed():
    # The first item workers fetch while the others are forked (a shorter first batch when
    # CPUs are contended); by the time the epoch has started every item worker runs. A batch
    # worker starts with the first batch sent to it: the first batch goes to the main process
    # (nothing is known of its items yet), and batches of small ints then to batch workers.
    engine = _engine(Numbers(40), ECONOMIC)
    try:
        assert len(engine.workers) == 1  # item worker 0: any start-up error shows at once
        engine.start_epoch(iter([[i, i + 1] for i in range(0, 40, 2)]))
        assert len(engine.workers) in (2, 3) and all(worker.is_alive() for worker in engine.workers)
        batches = []
        while True:
            try:
                batches.append(engine.next_batch().tolist())
            except StopIteration:
                break
        assert batches == [[i, i + 1] for i in range(0, 40, 2)]
        assert len(engine.workers) == 4
    finally:
        engine.close()


def test_item_workers_all_fork_before_the_first_draw_where_a_draw_may_change_what_they_see():
    # A sampler whose draws may run the user's code (a dataset's own __len__, a user's sampler):
    # every item worker inherits the main process from before them, as a classic pool's.
    engine = _engine(Numbers(8), ECONOMIC, forks_as_tasks_go=False)
    try:
        assert len(engine.workers) == 2  # both item workers; the batch workers when needed
        engine.start_epoch(iter([[i, i + 1] for i in range(0, 8, 2)]))
        assert len(engine.workers) in (2, 3, 4)
        assert [engine.next_batch().tolist() for _ in range(4)] == [[i, i + 1] for i in range(0, 8, 2)]
    finally:
        engine.close()


@pytest.mark.parametrize("num_workers", [1, 2])
def test_every_first_batch_is_laid_out_in_its_slab_the_loaders_very_first_too(num_workers, leak_guard):
    # Without persistent workers each epoch starts a new set: the loader keeps the items' size,
    # so its later sets lay out their first batch at once. The very first set learns it from
    # one item per item worker, fetched alone (a probe): the main process writes those into
    # the slab beside the rest, where before the whole first batch came as samples and was
    # stacked into a copy here.
    expected = list(torch.utils.data.DataLoader(_FlatSamples("tensor"), batch_size=8))
    loader = DataLoader(_FlatSamples("tensor"), batch_size=8, num_workers=num_workers, mode="economic",
                        multiprocessing_context="fork")
    for epoch in range(3):
        placed = []
        for ours, theirs in zip(loader, expected):
            assert torch.equal(ours, theirs)
            placed.append(in_shared_memory(ours))
        assert placed == [True] * 6, (epoch, placed)


def test_the_loader_keeps_the_item_workers_time_per_item_for_its_next_set(leak_guard):
    # It decides how finely the next set cuts its batches into pieces (item_scheduler.py),
    # from its second batch on, before that set's own first reports.
    loader = DataLoader(_FlatSamples("tensor"), batch_size=8, num_workers=2, mode="economic",
                        multiprocessing_context="fork")
    assert loader._slab_keeper.item_s is None
    assert len(list(loader)) == 6
    measured = loader._slab_keeper.item_s
    assert measured is not None and 0 < measured < 1.0
    assert len(list(loader)) == 6
    assert loader._slab_keeper.item_s is not None and loader._slab_keeper.item_s > 0


@pytest.mark.slow  # spawned processes, each importing torch
@pytest.mark.timeout(120)
def test_spawned_batch_workers_start_only_when_needed_and_up_front_once_known(leak_guard):
    # A spawned worker takes a second or more to start. Up front, two batch workers beside two
    # item workers doubled the first batch's wait on 2 CPUs; flat samples never need them.
    loader = DataLoader(_FlatSamples("tensor"), batch_size=8, num_workers=2, mode="economic",
                        multiprocessing_context="spawn", timeout=30)
    iterator = iter(loader)
    assert len(list(iterator)) == 6
    assert len(iterator._workers) == 2  # the main process assembled every batch
    pids = worker_pids(iterator)
    del iterator, loader
    leak_guard.assert_exited(pids, within_s=2.0)
    # Samples that are not flat: batch workers start when the first report says so, in the
    # middle of the first epoch; the loader's next set of workers starts them with its item
    # workers.
    loader = DataLoader(_Nested(), batch_size=8, num_workers=2, mode="economic",
                        multiprocessing_context="spawn", timeout=30)
    expected = list(torch.utils.data.DataLoader(_Nested(), batch_size=8))
    for epoch in range(2):
        iterator = iter(loader)
        started = len(iterator._workers)
        batches = list(iterator)
        assert all(torch.equal(ours["x"]["y"], theirs["x"]["y"]) for ours, theirs in zip(batches, expected))
        assert (started, len(iterator._workers)) == ((2, 4) if epoch == 0 else (4, 4))
        pids = worker_pids(iterator)
        del iterator
        leak_guard.assert_exited(pids, within_s=2.0)
    del loader


class _Nested(torch.utils.data.Dataset):
    """Samples that are not flat (a dict inside a dict): a batch worker collates them."""

    def __len__(self) -> int:
        return 44

    def __getitem__(self, index: int) -> Any:
        return {"x": {"y": torch.full((3, 40, 40), float(index))}}


@pytest.mark.parametrize("persistent", [True, False])
def test_a_loader_whose_batches_the_main_process_assembles_starts_no_batch_worker(persistent, leak_guard):
    expected = list(torch.utils.data.DataLoader(_FlatSamples("tuple"), batch_size=8))
    loader = DataLoader(_FlatSamples("tuple"), batch_size=8, num_workers=2, mode="economic",
                        multiprocessing_context="fork", persistent_workers=persistent)
    pids = set()
    for _ in range(3):
        iterator = iter(loader)
        # A training loop's shape: each batch dropped as the next comes, the last one of an epoch
        # alive until the next epoch's first replaces it. (A loop that keeps them all holds every
        # slab, and the batches that find none go to a batch worker.)
        for number, batch in enumerate(iterator):
            assert _same_typed(batch, expected[number])
        assert number == 5
        workers = iterator._workers
        assert [handle.name for handle in workers] == ["pipeload-item-worker-0", "pipeload-item-worker-1"]
        pids |= {handle.pid for handle in workers}
    assert len(pids) == (2 if persistent else 6)
    del loader, iterator, batch
    leak_guard.assert_exited(sorted(pids), within_s=1.0)


def test_an_engine_closed_before_its_epoch_leaves_nothing_behind():
    engine = _engine(Numbers(8), ECONOMIC)  # one worker started, three never will be
    engine.close()
    assert not engine.workers[0].is_alive()


@pytest.mark.parametrize("in_order", [True, False])
@pytest.mark.parametrize("engine", BOTH)
def test_a_failed_item_fails_its_batch_only_and_the_epoch_goes_on(engine, in_order):
    economic = _engine(RaisesAt(20, bad_index=6), engine, in_order)
    try:
        economic.start_epoch(iter(BatchSampler(SequentialSampler(range(20)), 4, False)))
        batches, errors = [], []
        while True:
            try:
                batches.append(economic.next_batch().tolist())
            except StopIteration:
                break
            except SampleFailed as error:
                errors.append(str(error))
    finally:
        economic.close()
    expected = [list(range(s, s + 4)) for s in (0, 8, 12, 16)]
    assert (batches if in_order else sorted(batches)) == expected
    assert len(errors) == 1 and "sample 6 is corrupt" in errors[0] and "[6]" in errors[0]


def _dies_in_collate(samples: list[int]) -> Any:
    if samples[0] == 8:
        die("sigkill")
    return default_collate(samples)


def _named_worker(error: BaseException, kind: str, iterator: Any, num_item_workers: int) -> int:
    """The id the error names for a dead ``kind`` worker; checks its pid and how it ended."""
    text = str(error)
    assert text.startswith("DataLoader worker (pid "), text  # torch's sentence first
    match = re.search(rf"{kind} worker (\d+) \(pid (\d+)\) ended with signal 9 \(SIGKILL\)", text)
    assert match, text
    worker_id, pid = int(match.group(1)), int(match.group(2))
    offset = 0 if kind == "item" else num_item_workers
    assert iterator._workers[offset + worker_id].pid == pid
    return worker_id


@pytest.mark.parametrize("kind", ["item", "batch"])
def test_a_worker_dying_is_named_by_kind_and_everything_stops(kind, leak_guard):
    if kind == "item":
        loader = DataLoader(DiesAt(24, 9, "sigkill"), batch_size=4, num_workers=2, mode="economic",
                            multiprocessing_context="fork")
    else:
        loader = DataLoader(Numbers(24), batch_size=4, num_workers=2, mode="economic",
                            collate_fn=_dies_in_collate, multiprocessing_context="fork")
    iterator = iter(loader)
    with pytest.raises(WorkerDiedError) as caught:
        for _ in range(10):
            next(iterator)
    _named_worker(caught.value, kind, iterator, num_item_workers=2)
    pids = worker_pids(iterator)  # batch workers start as batches are sent to them
    assert len(pids) >= 3
    leak_guard.assert_exited(pids, within_s=1.0)


@pytest.mark.parametrize("slot", [0, 2], ids=["item-worker", "batch-worker"])
def test_an_idle_worker_killed_from_outside(slot, leak_guard):
    loader = DataLoader(Numbers(80), batch_size=2, num_workers=2, mode="economic",
                        multiprocessing_context="fork")
    iterator = iter(loader)
    assert next(iterator).tolist() == [0, 1]  # the main process's: nothing was known of the items
    assert next(iterator).tolist() == [2, 3]  # a batch worker's: small ints ride in its batch
    pids = worker_pids(iterator)
    assert len(pids) >= 3
    os.kill(pids[slot], signal.SIGKILL)
    assert wait_until(lambda: pid_gone(pids[slot]), 5.0)
    with pytest.raises(WorkerDiedError) as caught:
        for _ in range(40):
            next(iterator)
    name = "item worker 0" if slot == 0 else "batch worker 0"
    text = str(caught.value)
    assert text.startswith(f"DataLoader worker (pid {pids[slot]}) is killed by signal: Killed."), text
    assert f"{name} (pid {pids[slot]}) ended with signal 9 (SIGKILL)" in text
    leak_guard.assert_exited(pids, within_s=1.0)


def test_an_item_worker_killed_while_the_main_process_waits(leak_guard):
    loader = DataLoader(Stalls(16, stall_index=0), batch_size=2, num_workers=2, mode="economic",
                        multiprocessing_context="fork")
    iterator = iter(loader)
    pids = worker_pids(iterator)
    # Index 0 is item worker 0's first piece (an idle pool starts at worker 0): it stalls there,
    # and batch 0 cannot be handed out without it. The kill comes once the main thread is in its
    # wait for reports (the engine's receive), which it cannot leave before then.
    with once_the_main_thread_waits(lambda: os.kill(pids[0], signal.SIGKILL)) as seen:
        with pytest.raises(WorkerDiedError, match=rf"item worker 0 \(pid {pids[0]}\).*SIGKILL"):
            next(iterator)
    assert seen == [True], "the main thread was never seen waiting for item worker 0"
    leak_guard.assert_exited(pids, within_s=1.0)


# -- persistent workers ----------------------------------------------------------------------


def _log_start(worker_id: int) -> None:
    info = get_worker_info()
    with open(os.environ["PIPELOAD_TEST_INIT_LOG"], "a") as log:
        log.write(f"{info.kind} {worker_id}\n")


@pytest.mark.parametrize("engine", BOTH)
def test_worker_init_fn_runs_once_in_every_item_and_batch_worker(engine, tmp_path: Path, monkeypatch):
    log = tmp_path / "starts.log"
    monkeypatch.setenv("PIPELOAD_TEST_INIT_LOG", str(log))
    loader = DataLoader(Numbers(12), batch_size=2, num_workers=3, num_batch_workers=2,
                        persistent_workers=True, worker_init_fn=_log_start, **loader_kwargs(engine))
    for _ in range(3):
        assert flatten(list(loader)) == list(range(12))
    assert sorted(log.read_text().splitlines()) == ["batch 0", "batch 1", "item 0", "item 1", "item 2"]


def test_uneven_items_still_come_in_sampler_order():
    order = [int(i) for i in torch.randperm(60, generator=torch.Generator().manual_seed(2))]
    assert max(delay_for(i) for i in order) > 0
    loader = DataLoader(Uneven(60), batch_size=5, sampler=order, num_workers=4, num_batch_workers=3,
                        prefetch_factor=3, **loader_kwargs(ECONOMIC))
    assert flatten(list(loader)) == order


def test_classic_workers_say_they_are_classic():
    loader = DataLoader(_WhoFetches(4), batch_size=2, num_workers=2, **loader_kwargs(FORK))
    assert {kind for batch in loader for kind in batch["kind"]} == {"classic"}


@pytest.mark.parametrize("engine", BOTH)
def test_out_of_order_batches_overtake_one_stuck_at_the_start_of_an_epoch(engine):
    # Item 5 (batch 1) never comes back (a process worker stays stuck until it is stopped). With
    # in_order=False the other batches must keep coming while the training loop waits for it.
    # They did not: the pool's build time is measured from the batch before's arrival, so none
    # was known, the budget kept one batch in flight until it was, and nothing more opened.
    dataset = Stalls(32, stall_index=5)
    loader = DataLoader(dataset, batch_size=4, num_workers=2, prefetch_factor=3, in_order=False,
                        timeout=5, **loader_kwargs(engine))
    iterator = iter(loader)
    try:
        # The stuck worker may also hold one piece of another batch: six of the seven others come.
        firsts = [next(iterator).tolist()[0] for _ in range(6)]
    finally:
        dataset.release.set()  # thread workers share it; process workers are stopped below
        del iterator
    assert len(set(firsts)) == 6 and 4 not in firsts, firsts


class _WithALock(torch.utils.data.Dataset):
    """Samples holding something that cannot be pickled, which the collate_fn drops."""

    def __len__(self) -> int:
        return 4

    def __getitem__(self, index: int) -> Any:
        return {"x": torch.full((2,), float(index)), "lock": threading.Lock()}


def _drop_the_locks(samples: list[dict]) -> torch.Tensor:
    return torch.stack([sample["x"] for sample in samples])


def test_a_sample_that_cannot_be_pickled_says_why_economic_mode_pickles_it():
    # torch (and classic mode) collate a sample where it was fetched; economic mode sends it to
    # a batch worker first. The error says so, and what to use instead.
    assert len(list(DataLoader(_WithALock(), batch_size=2, num_workers=2, collate_fn=_drop_the_locks,
                               multiprocessing_context="fork"))) == 2
    loader = DataLoader(_WithALock(), batch_size=2, num_workers=2, collate_fn=_drop_the_locks,
                        mode="economic", multiprocessing_context="fork")
    with pytest.raises(TypeError) as caught:
        next(iter(loader))
    text = str(caught.value)
    assert text.startswith("Caught TypeError in DataLoader worker process ")  # torch's words first
    assert "cannot pickle" in text and "mode='classic' collates samples in the worker" in text
