"""A loader's slabs belong to the loader, not to one set of workers.

Each epoch without persistent workers, each new iterator, starts new workers; they find the
slabs of the set before them, and the batch size, so no batch of theirs travels in a one-shot
buffer for want of a slab, and no slab is made again. The slabs go with the loader (deleted,
collected), with a copy's own (pickled, deep-copied), after an error, or on request; nothing the
loader kept (descriptor, mapping, worker) is left after it (the leak guard checks descriptors and
mappings of pipeload's shared memory as well as processes).
"""

from __future__ import annotations

import copy
import os
import pickle

import pytest
import torch
from conftest import our_mappings
from faults import ECONOMIC, FORK, MakesTensors, SampleFailed, engine_params, loader_kwargs

from pipeload import DataLoader
from pipeload.engine.lifecycle import wait_for_reaped

pytestmark = [pytest.mark.usefixtures("leak_guard"), pytest.mark.timeout(90)]

BIG = 1 << 16  # floats per item: 256 KiB, batches of 1 MiB, far above what travels inline
ITEMS = 48


class MakesTensorsOrFails(MakesTensors):
    """MakesTensors that raises at ``bad_index``."""

    def __init__(self, length: int, width: int, bad_index: int) -> None:
        super().__init__(length, width)
        self.bad_index = bad_index

    def __getitem__(self, index: int) -> torch.Tensor:
        if index == self.bad_index:
            raise SampleFailed(f"sample {index} is corrupt")
        return super().__getitem__(index)


def run_epoch(loader: DataLoader, stop_after: int | None = None) -> list[bool]:
    """Iterate (all of it, or ``stop_after`` batches); checks every value; returns, per batch,
    whether it came in a slab (a slab view answers ``is_shared()`` with False, a one-shot buffer
    with True)."""
    in_slab = []
    for number, batch in enumerate(loader):
        assert batch[:, 0].tolist() == [float(number * 4 + k) for k in range(4)]
        assert batch[:, -1].tolist() == [float(number * 4 + k) for k in range(4)]
        in_slab.append(not batch.is_shared())
        if stop_after is not None and number + 1 == stop_after:
            break
    return in_slab


def open_descriptors() -> int:
    return len(os.listdir("/proc/self/fd"))


@pytest.mark.parametrize("engine", engine_params(FORK, ECONOMIC))
def test_later_epochs_find_the_slabs_and_the_batch_size(engine):
    loader = DataLoader(MakesTensors(ITEMS, BIG), batch_size=4, num_workers=2, **loader_kwargs(engine))
    run_epoch(loader)
    first = loader._slab_keeper.counts()
    assert 1 <= first.slabs_made <= 6
    for _ in range(3):
        before = loader._slab_keeper.counts()
        later = run_epoch(loader)
        counts = loader._slab_keeper.counts()
        late = counts.late - before.late  # a release slower than the worker (a loaded machine)
        assert later[0]  # the size is known: even the first batch of the new workers is in a slab
        assert sum(later) >= len(later) - late
    # None made again (the new workers are sent the old ones), but for one the first epoch may
    # not have needed (its first batches travelled in one-shot buffers), and for late releases.
    assert counts.slabs_made <= first.slabs_made + 1 + counts.late - first.late
    del loader


def test_a_loader_deleted_between_epochs_leaves_nothing(leak_guard):
    descriptors, mappings = open_descriptors(), our_mappings()
    loader = DataLoader(MakesTensors(ITEMS, BIG), batch_size=4, num_workers=2,
                        multiprocessing_context="fork")
    run_epoch(loader)
    assert loader._slab_keeper.held_bytes > 0 and our_mappings() > mappings  # kept for the next
    del loader  # no cycle holds a loader: its slabs go now, not at the next collection
    # The epoch's workers, idle and asked to stop at its end, are reaped beside the loop
    # (lifecycle.reap_in_background); the loader waits for that as it goes.
    assert open_descriptors() == descriptors and our_mappings() == mappings


def test_a_loader_kept_while_many_iterators_come_and_go():
    loader = DataLoader(MakesTensors(ITEMS, BIG), batch_size=4, num_workers=2,
                        multiprocessing_context="fork")
    run_epoch(loader)
    assert wait_for_reaped(5.0)  # a finished epoch's workers are reaped beside the loop
    descriptors, mappings = open_descriptors(), our_mappings()
    for stop_after in (1, 3, None, 2, None, 1):  # some iterators dropped mid-epoch
        run_epoch(loader, stop_after)
        assert wait_for_reaped(5.0)
        assert open_descriptors() == descriptors  # workers gone, slabs neither lost nor added
        assert our_mappings() == mappings
    assert loader._slab_keeper.counts().slabs_made <= 6
    del loader


def test_two_live_iterators_of_one_loader_each_load_correctly():
    loader = DataLoader(MakesTensors(ITEMS, BIG), batch_size=4, num_workers=2,
                        multiprocessing_context="fork")
    run_epoch(loader)
    first, second = iter(loader), iter(loader)  # the second borrows a pool of its own
    for number, (a, b) in enumerate(zip(first, second)):
        want = [float(number * 4 + k) for k in range(4)]
        assert a[:, -1].tolist() == want and b[:, -1].tolist() == want
    del first, second, a, b
    assert run_epoch(loader)[0]  # the loader's own pool is still there, and known
    del loader


@pytest.mark.parametrize("engine", engine_params(FORK, ECONOMIC))
@pytest.mark.usefixtures("no_gc")
def test_an_error_mid_epoch_releases_the_slabs_even_while_the_error_is_kept(engine):
    loader = DataLoader(MakesTensorsOrFails(ITEMS, BIG, bad_index=21), batch_size=4, num_workers=2,
                        **loader_kwargs(engine))
    descriptors = open_descriptors()
    iterator = iter(loader)
    with pytest.raises(SampleFailed) as caught:
        for batch in iterator:
            del batch  # the error's frame keeps no batch (a kept batch keeps its own slab)
    del iterator  # its workers stop; the error (kept below) keeps this frame and the loader
    assert loader._slab_keeper.held_bytes == 0  # the set that failed gave its slabs up
    assert open_descriptors() == descriptors
    kept = caught.value
    assert "sample 21 is corrupt" in str(kept)
    del loader


class LengthFailsLater(MakesTensors):
    """MakesTensors whose ``__len__`` raises once ``failing`` is set (a file that went away)."""

    failing = False

    def __len__(self) -> int:
        if self.failing:
            raise OSError("the index file went away")
        return super().__len__()


@pytest.mark.usefixtures("no_gc")
def test_an_iter_that_fails_releases_the_slabs_as_a_failed_epoch_does():
    # iter() raised from the dataset's __len__ after an epoch had made the slabs: they stayed
    # with the loader (and the error that may keep it) until the loader went (stop 54).
    dataset = LengthFailsLater(ITEMS, BIG)
    loader = DataLoader(dataset, batch_size=4, num_workers=2, multiprocessing_context="fork")
    run_epoch(loader)
    assert loader._slab_keeper.held_bytes > 0
    dataset.failing = True
    with pytest.raises(OSError, match="went away"):
        iter(loader)
    assert loader._slab_keeper.held_bytes == 0
    del loader


def test_a_new_loaders_first_batches_travel_in_buffers_that_become_its_slabs():
    # A new loader knows no batch size: its first batches travel in buffers their workers make.
    # It takes those over as its first slabs rather than make (and fault in) slabs anew.
    loader = DataLoader(MakesTensors(ITEMS, BIG), batch_size=4, num_workers=2,
                        multiprocessing_context="fork")
    run_epoch(loader)
    counts = loader._slab_keeper.counts()
    assert counts.slabs_adopted >= 1 and counts.batches_in_fresh_memory >= 1, counts
    assert counts.slabs_made + counts.slabs_adopted <= 6, counts
    assert loader._slab_keeper.held_bytes > 0
    run_epoch(loader)  # the next set of workers writes into them
    again = loader._slab_keeper.counts()
    assert again.batches_in_fresh_memory == counts.batches_in_fresh_memory, again
    del loader


def test_a_copied_or_pickled_loader_keeps_slabs_of_its_own():
    loader = DataLoader(MakesTensors(ITEMS, BIG), batch_size=4, num_workers=2,
                        multiprocessing_context="fork")
    run_epoch(loader)
    held = loader._slab_keeper.held_bytes
    for twin in (copy.deepcopy(loader), pickle.loads(pickle.dumps(loader))):
        assert twin._slab_keeper is not loader._slab_keeper
        assert twin._slab_keeper.held_bytes == 0  # starts with none
        run_epoch(twin)
        # It learns the size for itself: its first batches travel in buffers their workers made
        # (which it takes over as its first slabs), not in slabs it had.
        counts = twin._slab_keeper.counts()
        assert counts.batches_in_fresh_memory > 0 and counts.slabs_adopted > 0, counts
        assert twin._slab_keeper.held_bytes > 0
        del twin
    assert loader._slab_keeper.held_bytes == held and run_epoch(loader)[0]
    del loader


def test_release_shared_memory_frees_the_slabs_now_and_the_next_epoch_makes_new_ones():
    descriptors, mappings = open_descriptors(), our_mappings()
    loader = DataLoader(MakesTensors(ITEMS, BIG), batch_size=4, num_workers=2,
                        multiprocessing_context="fork")
    run_epoch(loader)
    made = loader._slab_keeper.counts().slabs_made
    loader.release_shared_memory()
    loader.release_shared_memory()  # idempotent
    assert loader._slab_keeper.held_bytes == 0
    assert open_descriptors() == descriptors and our_mappings() == mappings
    run_epoch(loader)
    assert loader._slab_keeper.counts().slabs_made > made
    del loader


def test_a_persistent_loader_releases_at_once_when_its_workers_stop():
    loader = DataLoader(MakesTensors(ITEMS, BIG), batch_size=4, num_workers=2,
                        persistent_workers=True, multiprocessing_context="fork")
    run_epoch(loader)
    loader.release_shared_memory()  # the running workers keep theirs until they stop
    assert loader._slab_keeper.held_bytes > 0
    run_epoch(loader)
    loader._iterator = None  # how frameworks stop persistent workers
    assert loader._slab_keeper.held_bytes == 0
    del loader


def test_a_smaller_byte_budget_shrinks_the_kept_slabs_before_the_next_epoch():
    loader = DataLoader(MakesTensors(ITEMS, BIG), batch_size=4, num_workers=2,
                        multiprocessing_context="fork")
    run_epoch(loader)
    assert loader._slab_keeper.held_bytes > 2 * (1 << 20)
    loader.max_shm_bytes = 2 * (1 << 20)  # memory is short now: about one batch's slab
    run_epoch(loader)
    # Down to the two slabs a loop needs (the batch it holds and the next), which the budget
    # does not cut: with one, every other batch went to fresh memory (slab_pool.LOOP_FLOOR_SLABS).
    keeper = loader._slab_keeper
    with keeper._lock:
        assert keeper._pool.slab_count <= 2
    del loader


@pytest.mark.filterwarnings("ignore:This DataLoader will create 4 worker processes")
def test_fewer_workers_next_epoch_shrink_the_kept_slabs_to_what_they_may_use():
    loader = DataLoader(MakesTensors(ITEMS, BIG), batch_size=4, num_workers=4, prefetch_factor=2,
                        multiprocessing_context="fork")
    for batch in loader:  # the training loop keeps nothing, and is fast: 8 fly, 9 slabs at most
        del batch
    made = loader._slab_keeper.counts().slabs_made
    assert made > 4
    loader.num_workers = 1  # at most 2 batches in flight from now on: 2, one held, one more
    run_epoch(loader)
    keeper = loader._slab_keeper
    with keeper._lock:
        assert keeper._pool.slab_count <= 4
    del loader
