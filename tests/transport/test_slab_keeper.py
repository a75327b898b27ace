"""The keeper of a loader's slab pool, its slabs' memory, and the pinned-release watcher, driven
by hand in one process (real shared memory, real threads)."""

from __future__ import annotations

import gc
import os
import threading

import pytest

from pipeload.transport import slab_memory
from pipeload.transport.host_pinning import ReleaseWatcher
from pipeload.transport.messages import GrantOutcome, SlabControlKind
from pipeload.transport.slab_keeper import SlabKeeper, SlabSettings

MIB = 1 << 20
BATCH_BYTES = 8 * MIB  # large: the pool's slabs are populated on their preparation thread
SETTINGS = SlabSettings(pin=False, max_bytes=1 << 30, batches_in_flight=5)


def fill(pool, slabs: int, producer: int = 0) -> list[int]:
    """Make ``slabs`` slabs, grant each once to ``producer`` and settle it unused."""
    pool.observe_batch(BATCH_BYTES)
    pool.set_slab_limit(slabs)
    grants = [pool.grant(producer, token) for token in range(slabs)]
    for token in range(slabs):
        pool.settle(token, GrantOutcome.UNUSED)
    return [grant.slab_id for grant in grants]


def kinds(controls) -> list[SlabControlKind]:
    return [control.kind for control, _ in controls]


def test_a_pool_given_back_is_lent_again_with_its_producers_forgotten():
    keeper = SlabKeeper()
    pool = keeper.lend(SETTINGS)
    ids = fill(pool, 3)
    assert kinds(pool.take_controls(0)) == [SlabControlKind.BOARD] + [SlabControlKind.MAP] * 3
    keeper.give_back(pool)
    again = keeper.lend(SETTINGS)
    assert again is pool and again.slab_count == 3 and again.batch_bytes == BATCH_BYTES
    grant = again.grant(0, 0)  # a new worker 0: the board and the slab are announced afresh
    assert grant.slab_id in ids
    assert kinds(again.take_controls(0)) == [SlabControlKind.BOARD, SlabControlKind.MAP]
    assert again.counts.slabs_made == 3  # nothing made again
    keeper.give_back(again)
    keeper.close()
    assert keeper.held_bytes == 0


def test_a_second_set_while_the_first_runs_borrows_a_pool_of_its_own():
    keeper = SlabKeeper()
    first = keeper.lend(SETTINGS)
    second = keeper.lend(SETTINGS)
    assert second is not first
    keeper.give_back(second)
    assert second.closed and not first.closed
    keeper.give_back(first)
    assert keeper.lend(SETTINGS) is first
    keeper.close()


def test_release_closes_an_idle_pool_now_and_a_lent_one_when_it_comes_back():
    keeper = SlabKeeper()
    pool = keeper.lend(SETTINGS)
    fill(pool, 2)
    keeper.release()
    assert not pool.closed and keeper.held_bytes > 0  # lent: closed when given back
    keeper.give_back(pool)
    assert pool.closed and keeper.held_bytes == 0
    fresh = keeper.lend(SETTINGS)
    assert fresh is not pool and fresh.slab_count == 0  # the keeper keeps again
    keeper.give_back(fresh)
    keeper.release()
    assert fresh.closed
    keeper.close()


def test_a_set_that_failed_gives_its_pool_up_and_a_closed_keeper_keeps_nothing():
    keeper = SlabKeeper()
    pool = keeper.lend(SETTINGS)
    fill(pool, 2)
    keeper.give_back(pool, release=True)
    assert pool.closed
    keeper.close()
    loose = keeper.lend(SETTINGS)
    keeper.give_back(loose)
    assert loose.closed and keeper.counts().slabs_made == 2  # the closed pools' counts stay


def test_a_pool_is_fitted_to_what_the_next_set_may_use():
    keeper = SlabKeeper()
    pool = keeper.lend(SlabSettings(pin=False, max_bytes=1 << 30, batches_in_flight=9))
    fill(pool, 10)
    keeper.give_back(pool)
    fewer = keeper.lend(SlabSettings(pin=False, max_bytes=1 << 30, batches_in_flight=3))
    assert fewer is pool and pool.slab_count == 4  # 3 in flight (one of them held) and one more
    keeper.give_back(pool)
    short = keeper.lend(SlabSettings(pin=False, max_bytes=2 * BATCH_BYTES + MIB, batches_in_flight=3))
    assert pool.slab_bytes <= 2 * BATCH_BYTES + MIB and pool.slab_count == 2
    keeper.give_back(short)
    keeper.close()


def test_pin_memory_changed_between_sets_makes_a_new_pool():
    keeper = SlabKeeper()
    pool = keeper.lend(SETTINGS)
    keeper.give_back(pool)
    pinned = keeper.lend(SlabSettings(pin=True, max_bytes=1 << 30, batches_in_flight=5))
    assert pinned is not pool and pool.closed
    keeper.give_back(pinned)
    keeper.close()


def test_closing_the_keeper_frees_every_descriptor_and_mapping():
    gc.collect()
    before = len(os.listdir("/proc/self/fd"))
    keeper = SlabKeeper()
    pool = keeper.lend(SETTINGS)
    fill(pool, 3)
    keeper.give_back(pool)
    keeper.close()
    keeper.close()  # idempotent
    del pool
    assert len(os.listdir("/proc/self/fd")) == before
    with open("/proc/self/maps") as maps:
        assert "pipeload-batch" not in maps.read()


# -- the memory behind a slab ------------------------------------------------------------------


def test_the_huge_page_setting_is_read_from_the_kernel():
    try:
        with open(slab_memory.THP_SHMEM_SETTING) as setting:
            text = setting.read()
    except OSError:
        assert slab_memory.huge_page_bytes() == 0
        return
    chosen = text[text.find("[") + 1:text.find("]")]
    allowed = chosen in ("always", "within_size", "advise", "force")
    assert (slab_memory.huge_page_bytes() > 0) == allowed
    size = slab_memory.slab_size_for(5 * MIB + 1, 64 << 10)
    assert size >= 5 * MIB + 1 and (not allowed or size % slab_memory.huge_page_bytes() == 0)


def test_a_writer_populates_a_large_slab_off_its_thread_and_takes_no_fault_writing_it():
    import resource

    from pipeload.transport.slab_writer import SlabWriter

    keeper = SlabKeeper()
    pool = keeper.lend(SETTINGS)
    pool.observe_batch(BATCH_BYTES)
    pool.set_slab_limit(1)
    writer = SlabWriter()  # a whole-batch producer: it populates the slabs it maps
    try:
        grant = pool.grant(0, 0)
        for control, fds in pool.take_controls(0):
            writer.apply(control, [os.dup(fd) for fd in fds])
        writer.begin(grant)
        writer.wait_populated()
        storage = writer.slab_storage()
        before = resource.getrusage(resource.RUSAGE_THREAD).ru_minflt
        import torch

        torch.empty((0,), dtype=torch.uint8).set_(storage, 0, (storage.nbytes(),)).fill_(7)
        faults = resource.getrusage(resource.RUSAGE_THREAD).ru_minflt - before
        if slab_memory.populate(pool._slabs[grant.slab_id].memory.array.ctypes.data, 4096):
            # Every page mapped, writable, by the populating thread: writing 2,048 pages takes
            # none of theirs. A few faults are torch's own (the empty tensor), and the kernel may
            # split a huge page now and then (a CI run read 17): the bound says "not per page".
            assert faults < 64
        writer.finish()
        pool.settle(0, GrantOutcome.UNUSED)
    finally:
        writer.close()
        keeper.give_back(pool)
        keeper.close()


# -- landing pinned releases -------------------------------------------------------------------


class CopyDone:
    """Stands in for a CUDA event: ``synchronize`` waits until the copy is said to be over."""

    def __init__(self) -> None:
        self.over = threading.Event()

    def synchronize(self) -> None:
        assert self.over.wait(5.0)


def test_releases_land_in_order_once_their_copies_are_done_and_close_drains_them():
    watcher = ReleaseWatcher(device=None)
    landed: list[int] = []
    markers = [CopyDone() for _ in range(3)]
    for number, marker in enumerate(markers):
        watcher.submit(marker, lambda number=number: landed.append(number))
    assert landed == []  # no copy is over yet
    markers[0].over.set()
    for marker in markers[1:]:
        marker.over.set()
    watcher.close()  # waits for every submitted release
    assert landed == [0, 1, 2]
    late = CopyDone()
    late.over.set()
    watcher.submit(late, lambda: landed.append(3))  # after close: landed at once, here
    assert landed == [0, 1, 2, 3]
    assert not any(t.name == "pipeload-pinned-release" for t in threading.enumerate())


def test_only_the_most_recently_idle_pools_are_kept_and_a_keeper_let_go_makes_a_new_one():
    from pipeload.transport.slab_keeper import MOST_IDLE_POOLS_KEPT

    keepers = [SlabKeeper() for _ in range(MOST_IDLE_POOLS_KEPT + 2)]
    try:
        for keeper in keepers:  # loaders kept and used once each, as validation loaders are
            pool = keeper.lend(SETTINGS)
            fill(pool, 2)
            keeper.give_back(pool)
        held = [keeper.held_bytes > 0 for keeper in keepers]
        assert held == [False] * 2 + [True] * MOST_IDLE_POOLS_KEPT
        again = keepers[0].lend(SETTINGS)  # comes back to work: a pool anew
        assert again.slab_bytes == 0
        fill(again, 1)
        keepers[0].give_back(again)
        assert keepers[0].held_bytes > 0 and keepers[2].held_bytes == 0  # the least recent went
    finally:
        for keeper in keepers:
            keeper.close()
