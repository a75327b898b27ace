"""The slab pool and the producer's writer, driven by hand in one process (real shared memory).

A message is built as a worker builds it: the writer is named for collation, ``default_collate``
stacks into the granted slab, the codec encodes, and the owner decodes, views, settles.
"""

from __future__ import annotations

import gc
import os

import pytest
import torch

from pipeload.collate import default_collate
from pipeload.transport import collate_output
from pipeload.transport.codec import decode, encode
from pipeload.transport.messages import GrantOutcome, SlabControlKind
from pipeload.transport.slab_pool import LATE_PAUSE_GRANTS, SlabPool
from pipeload.transport.slab_memory import POPULATE_FROM_BYTES
from pipeload.transport.slab_writer import RELEASE_WAIT_S, SlabWriter

ITEM = 1 << 16  # floats: 256 KiB per item, 1 MiB per batch of 4
BATCH_BYTES = 4 * ITEM * 4


def _deliver_controls(pool: SlabPool, writer: SlabWriter, producer: int = 0) -> list:
    """Pass the pool's controls to the writer (as the socket would: duplicated descriptors)."""
    controls = pool.take_controls(producer)
    for control, fds in controls:
        writer.apply(control, [os.dup(fd) for fd in fds])
    return controls


def _message(pool: SlabPool, writer: SlabWriter, token: int, value: float, producer: int = 0):
    """Grant, build (collating into the slab), encode, decode, settle: the batch as received."""
    grant = pool.grant(producer, token)
    _deliver_controls(pool, writer, producer)
    writer.begin(grant)
    collate_output.set_writer(writer)
    try:
        batch = default_collate([torch.full((ITEM,), value + k) for k in range(4)])
    finally:
        collate_output.set_writer(None)
    payload, fds, keep_alive = encode(batch, writer)
    copies = [os.dup(fd) for fd in fds]  # what the socket would deliver
    del batch, keep_alive
    received, info = decode(bytes(payload), copies, pool)
    pool.settle(token, info.outcome)
    return grant, received, info


@pytest.fixture
def pool():
    pool = SlabPool(pin=False, max_bytes=1 << 30)
    pool.observe_batch(BATCH_BYTES)
    pool.set_slab_limit(3)
    yield pool
    pool.close()


def test_a_freed_slab_is_reused_without_a_new_announcement(pool):
    writer = SlabWriter()
    first, batch, info = _message(pool, writer, token=0, value=0.0)
    assert first is not None and info.outcome is GrantOutcome.USED
    assert batch[:, 0].tolist() == [0.0, 1.0, 2.0, 3.0] and not batch.is_shared()
    address = batch.data_ptr()
    del batch  # the last view goes: the slab is released
    second, batch, _ = _message(pool, writer, token=1, value=10.0)
    assert second.slab_id == first.slab_id and batch.data_ptr() == address
    assert batch[:, -1].tolist() == [10.0, 11.0, 12.0, 13.0]
    assert pool.take_controls(0) == []  # already mapped by this producer


def test_a_slab_with_live_views_is_never_granted_again(pool):
    writer = SlabWriter()
    kept, viewed = [], set()
    for token in range(5):
        grant, batch, info = _message(pool, writer, token=token, value=float(token * 10))
        if grant is not None and grant.slab_id in viewed:
            # Granted ahead of a release that never comes: the producer used fresh memory.
            assert info.outcome is GrantOutcome.LATE
        elif info.outcome is GrantOutcome.USED:
            viewed.add(grant.slab_id)
        kept.append(batch[1:2, :5])  # a view keeps the batch's lease
        pool.handed_out(token)
    assert len(viewed) == 3  # the limit: every later batch travelled in fresh memory
    assert [view[0, 0].item() for view in kept] == [1.0, 11.0, 21.0, 31.0, 41.0]


def test_the_slab_of_the_batch_being_dropped_is_granted_before_it_is_free(pool):
    writer = SlabWriter()
    pool.set_slab_limit(2)
    _, previous, _ = _message(pool, writer, token=0, value=0.0)
    pool.handed_out(0)
    _, latest, _ = _message(pool, writer, token=1, value=1.0)
    pool.handed_out(1)
    grant = pool.grant(0, 2)  # both slabs viewed: the previous batch's slab is granted ahead
    assert grant is not None and grant.releases == 1
    _deliver_controls(pool, writer)
    writer.begin(grant)
    previous_slab = grant.slab_id
    del previous  # the consumer drops it, as a for loop does on taking the next batch
    assert writer.allocate(BATCH_BYTES) is not None
    assert writer.finish() == (BATCH_BYTES, GrantOutcome.USED)
    assert previous_slab in {s.slab_id for s in pool._slabs.values()}
    assert latest[:, 0].tolist() == [1.0, 2.0, 3.0, 4.0]


def test_a_release_that_does_not_come_makes_the_producer_use_fresh_memory(pool):
    writer = SlabWriter()
    pool.set_slab_limit(2)
    _, kept_a, _ = _message(pool, writer, token=0, value=0.0)
    pool.handed_out(0)
    _, kept_b, _ = _message(pool, writer, token=1, value=1.0)
    pool.handed_out(1)
    grant, batch, info = _message(pool, writer, token=2, value=2.0)  # the consumer keeps all
    assert grant is not None and grant.releases == 1
    assert info.outcome is GrantOutcome.LATE and batch.is_shared()  # fresh buffer
    assert pool.grant(0, 3) is None  # no more granting ahead for a while
    assert LATE_PAUSE_GRANTS > 1 and RELEASE_WAIT_S < 1.0
    assert kept_a[:, 0].tolist() == [0.0, 1.0, 2.0, 3.0]


def test_a_producer_still_holding_a_slab_refuses_it_and_the_owner_retires_it(pool):
    writer = SlabWriter()
    grant = pool.grant(0, 0)
    _deliver_controls(pool, writer)
    writer.begin(grant)
    storage, offset = writer.allocate(1024)
    stale = torch.empty((0,), dtype=torch.uint8).set_(storage, offset, (1024,))  # user code kept it
    writer.finish()
    pool.settle(0, GrantOutcome.UNUSED)
    again = pool.grant(0, 1)
    assert again.slab_id == grant.slab_id
    writer.begin(again)
    assert writer.allocate(1024) is None
    _, outcome = writer.finish()
    assert outcome is GrantOutcome.BUSY
    pool.settle(1, outcome)
    forget = [c for c, _ in pool.take_controls(0) if c.kind is SlabControlKind.FORGET]
    assert [c.slab_id for c in forget] == [grant.slab_id]
    del stale


def test_bigger_batches_retire_the_smaller_slabs(pool):
    writer = SlabWriter()
    first, batch, _ = _message(pool, writer, token=0, value=0.0)
    del batch
    pool.observe_batch(4 * BATCH_BYTES)
    bigger = pool.grant(0, 1)
    kinds = [(c.kind, c.slab_id, c.size) for c, _ in pool.take_controls(0)]
    assert kinds[0] == (SlabControlKind.FORGET, first.slab_id, 0)  # forgotten before remapped
    assert kinds[1][:2] == (SlabControlKind.MAP, bigger.slab_id) and kinds[1][2] > 4 * BATCH_BYTES


def test_closing_leaves_live_batches_intact_and_frees_everything_after_them():
    gc.collect()  # earlier tests' leftovers must not be freed in the middle of this one
    fds_before = len(os.listdir("/proc/self/fd"))
    pool = SlabPool(pin=False, max_bytes=1 << 30)
    pool.observe_batch(BATCH_BYTES)
    pool.set_slab_limit(2)
    writer = SlabWriter()
    _, batch, _ = _message(pool, writer, token=0, value=5.0)
    pool.close()

    pool.close()  # idempotent
    writer.close()
    assert batch[:, 0].tolist() == [5.0, 6.0, 7.0, 8.0]
    del batch
    gc.collect()
    assert len(os.listdir("/proc/self/fd")) == fds_before


def test_a_byte_budget_stops_the_pool_from_growing(pool):
    small = SlabPool(pin=False, max_bytes=BATCH_BYTES)
    small.observe_batch(BATCH_BYTES)
    small.set_slab_limit(4)
    try:
        assert small.grant(0, 0) is None  # one slab (with headroom) exceeds the budget
    finally:
        small.close()


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the CUDA-less fallback")
def test_a_pool_asked_to_pin_without_cuda_works_as_an_unpinned_one():
    pool = SlabPool(pin=True, max_bytes=1 << 30)
    pool.observe_batch(BATCH_BYTES)
    pool.set_slab_limit(2)
    writer = SlabWriter()
    try:
        assert not pool.pinned and pool.defers_releases  # no events to wait for: grants ahead
        _, batch, _ = _message(pool, writer, token=0, value=1.0)
        assert not batch.is_pinned()
        first_slab = batch.untyped_storage().data_ptr()
        del batch  # released through the board, as in an unpinned pool
        _, again, _ = _message(pool, writer, token=1, value=2.0)
        assert again.untyped_storage().data_ptr() == first_slab  # the same slab, reused
        assert again[:, 0].tolist() == [2.0, 3.0, 4.0, 5.0]
    finally:
        pool.close()
        writer.close()


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA to page-lock slabs")
def test_pinned_slabs_hand_out_pinned_batches():
    pool = SlabPool(pin=True, max_bytes=1 << 30)
    pool.observe_batch(BATCH_BYTES)
    pool.set_slab_limit(2)
    writer = SlabWriter()
    try:
        assert pool.pinned
        _, batch, _ = _message(pool, writer, token=0, value=1.0)
        assert batch.is_pinned()
        on_gpu = batch.cuda(non_blocking=True)
        del batch  # released: reused only once the copy is done
        _, again, _ = _message(pool, writer, token=1, value=2.0)
        assert torch.equal(on_gpu.cpu()[:, 0], torch.tensor([1.0, 2.0, 3.0, 4.0]))
        assert again.is_pinned()
    finally:
        pool.close()
        writer.close()



def test_the_pool_knows_when_every_batch_so_far_travelled_inline():
    pool = SlabPool(pin=False, max_bytes=1 << 30)
    try:
        assert not pool.inline_only  # nothing has arrived: the size is unknown
        pool.observe_batch(0)
        pool.observe_batch(0)
        assert pool.inline_only and pool.batch_bytes == 0
        pool.observe_batch(BATCH_BYTES)
        assert not pool.inline_only  # one batch needed shared memory: the budget prices them again
        pool.observe_batch(0)
        assert not pool.inline_only
    finally:
        pool.close()


def _resident_bytes(address: int) -> int:
    """Resident bytes of this process's mapping that contains ``address`` (/proc/self/smaps)."""
    inside = False
    with open("/proc/self/smaps") as smaps:
        for line in smaps:
            head = line.split()[0]
            if "-" in head and not head.endswith(":"):
                low, high = (int(part, 16) for part in head.split("-"))
                inside = low <= address < high
            elif inside and head == "Rss:":
                return int(line.split()[1]) * 1024
    raise AssertionError(f"no mapping holds address {address:#x}")


@pytest.mark.skipif(not os.path.exists("/proc/self/smaps"), reason="needs Linux's /proc/self/smaps")
@pytest.mark.parametrize(("populate", "batch_bytes", "faulted_in"), [
    (True, POPULATE_FROM_BYTES, True),  # whole large batches: every page at map time
    (True, BATCH_BYTES, False),  # a small slab: its headroom would stay resident for nothing
    (False, POPULATE_FROM_BYTES, False),  # an economic item worker writes only its own rows
], ids=["large-whole-batches", "small-whole-batches", "rows"])
def test_a_writer_that_fills_rows_maps_slabs_without_faulting_them_all_in(pool, populate, batch_bytes,
                                                                          faulted_in):
    # An economic item worker, which writes its own rows of each slab, must not hold every slab
    # in its resident set; nor may a small slab's unused headroom sit in every producer's.
    pool.observe_batch(batch_bytes)
    writer = SlabWriter(populate=populate)
    grant = pool.grant(0, 0)
    _deliver_controls(pool, writer, 0)
    writer.begin(grant)
    storage = writer.slab_storage()
    assert storage is not None
    if faulted_in:
        writer.wait_populated()  # a helper thread faults the pages in (as the first write would wait)
        assert _resident_bytes(storage.data_ptr()) >= storage.nbytes()
    else:
        resident = _resident_bytes(storage.data_ptr())
        assert resident < storage.nbytes() // 4
        row = torch.empty((0,), dtype=torch.uint8).set_(storage, 0, (ITEM * 4,))
        row.fill_(1)  # one item's bytes
        assert resident < _resident_bytes(storage.data_ptr()) <= resident + ITEM * 4 + (1 << 16)
    pool.settle(0, GrantOutcome.UNUSED)
