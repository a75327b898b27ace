"""Large tensors cross a process DataLoaderQueue in slabs the getting end grants with its credits:
a queue made by hand owns its slabs and frees them when closed; a queue boundary keeps them from
one run to the next, frees them on request, with the pipe, and after a run that fails; values
arrive bit for bit, and a consumer holding many items is never granted a slab ahead of its
release."""

from __future__ import annotations

import copy
import gc
import multiprocessing
import os
import pickle
import signal
from typing import Any

import pytest
import torch
from conftest import in_shared_memory, our_mappings

from pipeload.collate import default_collate
from pipeload.datapipes import DataLoaderQueue, QueueError
from pipeload.datapipes.iter import IterableWrapper
from pipeload.errors import WorkerDiedError

pytestmark = [pytest.mark.usefixtures("leak_guard", "no_gc"), pytest.mark.timeout(90)]
DEADLINE_S = 10.0
ITEM_FLOATS = 1 << 18  # 1 MiB of float32 per item: far beyond what rides inside a message


def random_item(index: int) -> torch.Tensor:
    """Item ``index``: 1 MiB of random floats, the same ones wherever it is made."""
    return torch.randn(ITEM_FLOATS, generator=torch.Generator().manual_seed(index))


def check_items(items: Any, first: int = 0) -> None:
    for offset, item in enumerate(items):
        assert torch.equal(item, random_item(first + offset)), f"item {first + offset} differs"


def die_at(index: int, at: int, how: str) -> torch.Tensor:
    if index == at:
        if how == "kill":
            os.kill(os.getpid(), signal.SIGKILL)
        raise KeyError(f"no item {index}")
    return random_item(index)


class DieAt:
    """``die_at`` with its place and way fixed (picklable for spawn)."""

    def __init__(self, at: int, how: str) -> None:
        self.at, self.how = at, how

    def __call__(self, index: int) -> torch.Tensor:
        return die_at(index, self.at, self.how)


# -- a queue boundary keeps its slabs from one run to the next ---------------------------------


@pytest.mark.parametrize("method", ["fork", pytest.param("spawn", marks=pytest.mark.slow)])  # spawn: ~3.5 s
def test_a_process_boundary_keeps_its_slabs_from_one_run_to_the_next(method: str) -> None:
    pipe = IterableWrapper(range(24)).map(random_item).queue_boundary(
        "process", buffer_size=4, multiprocessing_context=method)
    runs = 3 if method == "fork" else 2
    counts = []
    for _ in range(runs):
        for number, item in enumerate(pipe):
            check_items([item], number)
        counts.append(pipe._transient_slabs.counts())
    first, last = counts[0], counts[-1]
    # The first run learns the items' size from its first items (one-shot buffers), then makes
    # its slabs; each later run finds them: no slab made, every item in one (bit for bit above).
    assert first.slabs_made > 0 and first.batches_in_slabs > 0
    assert last.slabs_made == first.slabs_made
    assert last.batches_in_fresh_memory == first.batches_in_fresh_memory
    assert last.batches_in_slabs == first.batches_in_slabs + 24 * (runs - 1)
    assert last.late == last.busy == 0
    keeper = pipe._transient_slabs
    assert keeper.held_bytes >= first.slabs_made * ITEM_FLOATS * 4
    pipe.release_shared_memory()
    pipe.release_shared_memory()  # idempotent
    assert keeper.held_bytes == 0
    assert "_transient_slabs" not in vars(copy.deepcopy(pipe))  # copies keep slabs of their own
    assert "_transient_slabs" not in vars(pickle.loads(pickle.dumps(pipe)))


def test_slabs_go_with_the_pipe() -> None:
    before = our_mappings()
    pipe = IterableWrapper(range(12)).map(random_item).queue_boundary("process", buffer_size=2)
    check_items(list(pipe))
    keeper = pipe._transient_slabs
    assert keeper.held_bytes > 0 and our_mappings() > before
    del pipe  # a weakref.finalize, not the garbage collector (which is off)
    assert keeper.held_bytes == 0 and our_mappings() == before


def test_a_batch_downstream_is_never_granted_a_slab_ahead_of_its_release() -> None:
    """A ``batch`` after the boundary holds many items at once: none of them may be written
    over by a later item (each is still bit for bit itself when its batch is complete)."""
    pipe = IterableWrapper(range(48)).map(random_item).queue_boundary("process", buffer_size=4)
    for run in range(2):
        for number, batch in enumerate(pipe.batch(12)):
            check_items(batch, 12 * number)
    counts = pipe._transient_slabs.counts()
    assert counts.batches_in_slabs > 0 and counts.late == counts.busy == 0
    pipe.release_shared_memory()


@pytest.mark.parametrize("how", ["kill", "raise"])
def test_nothing_is_left_after_an_upstream_that_dies_or_fails_mid_run(how: str) -> None:
    before = our_mappings()
    pipe = IterableWrapper(range(40)).map(DieAt(20, how)).queue_boundary("process", buffer_size=4)
    expected = WorkerDiedError if how == "kill" else KeyError
    taken = 0
    with pytest.raises(expected):
        for item in pipe:
            check_items([item], taken)
            taken += 1
    del item
    assert taken == 20
    keeper = pipe._transient_slabs
    assert keeper.counts().batches_in_slabs > 0  # slabs were in use when it ended
    assert keeper.held_bytes == 0 and our_mappings() == before  # let go with the failed run
    check_items(list(pipe.header(8)))  # the next run starts afresh
    pipe.release_shared_memory()


def iterate_inherited(pipe: Any, verdict: DataLoaderQueue) -> None:
    torch.set_num_threads(1)  # a fork's copy of torch's thread pool would hang
    inherited = id(pipe._transient_slabs)  # the parent's keeper, as the fork copied it
    try:
        check_items(list(pipe))
        verdict.put(id(pipe._transient_slabs) != inherited and pipe._transient_slabs.counts().slabs_made > 0)
        pipe.release_shared_memory()
    finally:
        verdict.close()


def test_a_pipe_a_forked_process_inherited_makes_slabs_of_its_own() -> None:
    """A fork's copy of a pipe that kept slabs must not grant the original's slabs to its own
    upstream: the original's consumer may be granting them at the same time."""
    pipe = IterableWrapper(range(16)).map(random_item).queue_boundary("process", buffer_size=2)
    check_items(list(pipe))  # slabs kept in this process
    made = pipe._transient_slabs.counts().slabs_made
    verdict = DataLoaderQueue(kind="process", maxsize=1)
    child = multiprocessing.get_context("fork").Process(target=iterate_inherited, args=(pipe, verdict))
    child.start()
    check_items(list(pipe))  # at the same time
    assert verdict.get(timeout=DEADLINE_S * 3) is True
    child.join(DEADLINE_S)
    assert pipe._transient_slabs.counts().slabs_made == made  # ours, untouched and reused
    pipe.release_shared_memory()
    verdict.close()
    child.close()


# -- a queue made by hand ---------------------------------------------------------------------


def put_items(queue: DataLoaderQueue, count: int) -> None:
    torch.set_num_threads(1)  # a fork's copy of torch's thread pool would hang
    for index in range(count):
        queue.put(random_item(index))
    queue.close()


def put_collated(queue: DataLoaderQueue, count: int) -> None:
    """Build each item after prepare_put(), as feed() does: default_collate stacks it straight
    into the shared memory it travels in. Last, how many were stacked there."""
    torch.set_num_threads(1)
    stacked_there = 0
    for index in range(count):
        queue.prepare_put()
        item = default_collate(list(random_item(index).view(4, -1)))
        stacked_there += in_shared_memory(item)
        queue.put(item)
        del item
    queue.put(stacked_there)
    queue.close()


def take_and_check(queue: DataLoaderQueue, count: int, verdict: DataLoaderQueue) -> None:
    torch.set_num_threads(1)
    try:
        for index in range(count):
            check_items([queue.get(timeout=DEADLINE_S)], index)
        verdict.put(("ok", queue.slab_counts.batches_in_slabs))
    except BaseException as error:  # noqa: BLE001  (the test process says what went wrong)
        verdict.put(("failed", repr(error)))
    finally:
        queue.close()
        verdict.close()


@pytest.mark.parametrize("method", ["fork", pytest.param("spawn", marks=pytest.mark.slow)])  # spawn: ~2 s
def test_a_queue_made_by_hand_carries_large_tensors_in_slabs_it_frees_when_closed(method: str) -> None:
    before = our_mappings()
    queue = DataLoaderQueue(kind="process", maxsize=4)
    child = multiprocessing.get_context(method).Process(target=put_items, args=(queue, 30))
    child.start()
    in_slab = 0
    for index in range(30):
        item = queue.get(timeout=DEADLINE_S)
        check_items([item], index)
        assert in_shared_memory(item)
        in_slab += not item.is_shared()  # a slab view (a one-shot buffer answers True)
    del item
    counts = queue.slab_counts
    assert counts.batches_in_slabs >= 20 and in_slab == counts.batches_in_slabs
    with pytest.raises(QueueError, match="closed the queue"):
        queue.get(timeout=DEADLINE_S)
    child.join(DEADLINE_S)
    queue.close()
    assert our_mappings() == before and queue.slab_counts is None
    child.close()


def test_collation_after_prepare_put_stacks_into_the_memory_the_item_travels_in() -> None:
    expected = [random_item(index) for index in range(30)]  # a quick consumer: room ahead
    queue = DataLoaderQueue(kind="process", maxsize=4)
    child = multiprocessing.get_context("fork").Process(target=put_collated, args=(queue, 30))
    child.start()
    for index in range(30):
        assert torch.equal(queue.get(timeout=DEADLINE_S).view(-1), expected[index])
    # An item built while the far end had room for it was stacked straight into shared memory
    # (its slab, or a one-shot buffer); one built before is copied there by put().
    assert queue.get(timeout=DEADLINE_S) > 0
    assert queue.slab_counts.batches_in_slabs >= 20
    child.join(DEADLINE_S)
    queue.close()
    child.close()


def test_a_queue_made_by_hand_the_other_way_round() -> None:
    """The process that made the queue puts; the one it went to gets, and owns the slabs."""
    queue, verdict = DataLoaderQueue(kind="process", maxsize=3), DataLoaderQueue(kind="process", maxsize=1)
    child = multiprocessing.get_context("spawn").Process(target=take_and_check, args=(queue, 20, verdict))
    child.start()
    put_items(queue, 20)
    outcome, detail = verdict.get(timeout=DEADLINE_S * 3)
    assert outcome == "ok" and detail >= 10, detail
    child.join(DEADLINE_S)
    verdict.close()
    child.close()


# -- under a DataLoader: the loader's request reaches its graph's boundaries -------------------


def loader_items(loader: Any) -> list[int]:
    """Which of ``random_item``'s items the loader's batches hold (each one bit for bit)."""
    return sorted(numbers_of(item) for batch in loader for item in batch)


def numbers_of(item: torch.Tensor) -> int:
    """Which of ``random_item``'s items ``item`` is (among the first 64)."""
    return next(index for index in range(64) if torch.equal(item, random_item(index)))


@pytest.mark.parametrize("workers", [
    {"num_workers": 0},
    {"num_workers": 2, "worker_type": "thread", "persistent_workers": True},
])
def test_a_loaders_release_shared_memory_frees_the_slabs_of_its_graphs_process_boundaries(workers) -> None:
    """"On request" is every pool the loader keeps: the slabs of the process boundaries in its
    graph too, and those of the copies of the graph its thread workers iterate."""
    from pipeload import DataLoader

    before = our_mappings()
    pipe = IterableWrapper(range(16)).sharding_filter().map(random_item).queue_boundary(
        "process", buffer_size=2)
    loader = DataLoader(pipe, batch_size=4, **workers)
    assert loader_items(loader) == list(range(16))
    assert our_mappings() > before  # kept for the next epoch
    loader.release_shared_memory()
    assert our_mappings() == before
    assert loader_items(loader) == list(range(16))  # the next epoch makes new ones
    loader.release_shared_memory()
    assert our_mappings() == before
    del loader


def fails_at_item_9(item: torch.Tensor) -> torch.Tensor:
    """A step after the boundary that fails on item 9, keeping nothing of it (a kept item would
    keep its slab mapped, as a batch the loop holds does)."""
    if numbers_of(item) == 9:
        del item
        raise KeyError("no item 9")
    return item


@pytest.mark.parametrize("workers", [
    {"num_workers": 0},
    {"num_workers": 2, "worker_type": "thread", "persistent_workers": True},
])
def test_a_failed_epoch_frees_the_slabs_of_its_graphs_process_boundaries_while_the_error_is_kept(workers) -> None:
    """As the loader's own slabs after a failed epoch: the error may keep the loader, and its
    graph, alive for long (a step after the boundary failed: the run itself did not)."""
    from pipeload import DataLoader

    before = our_mappings()
    pipe = IterableWrapper(range(16)).sharding_filter().map(random_item).queue_boundary(
        "process", buffer_size=2)
    loader = DataLoader(pipe, batch_size=4, **workers)
    assert loader_items(loader) == list(range(16))  # the slabs are kept for the next epoch
    failing = DataLoader(pipe.map(fails_at_item_9), batch_size=4, **workers)
    with pytest.raises(KeyError, match="no item 9") as caught:
        for batch in failing:
            del batch
    del loader, failing  # the error (kept below) may keep them, and the pipe, alive
    # (Its frames keep the items they held: those alone stay mapped, as a batch kept does.)
    assert pipe._transient_slabs.held_bytes == 0
    kept = caught.value
    del pipe, kept, caught
    gc.collect()  # the error's frames hold each other
    assert our_mappings() == before


def test_an_epoch_that_goes_on_past_caught_errors_keeps_its_boundaries_slabs_for_the_next() -> None:
    """An error for one batch that the loop catches leaves the epoch running, as in torch: once it
    ends, the boundary keeps its slabs for the next run, as after any epoch (they went at every
    caught error, and each epoch made them anew: the diff review's probe)."""
    from pipeload import DataLoader

    pipe = IterableWrapper(range(16)).sharding_filter().map(random_item).queue_boundary(
        "process", buffer_size=2)
    loader = DataLoader(pipe.map(fails_at_item_9), batch_size=None)
    got, failed = [], 0
    iterator = iter(loader)
    while True:
        try:
            got.append(numbers_of(next(iterator)))
        except KeyError:
            failed += 1
        except StopIteration:
            break
    assert failed == 1 and got == [i for i in range(16) if i != 9]
    del iterator
    assert pipe._transient_slabs.held_bytes > 0
    pipe.release_shared_memory()
