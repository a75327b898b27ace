"""Economic batches the main process assembles from its item workers' columns: the batch
``default_collate`` makes of the same samples, its tensors viewing the slab the items were
written into, the slab free again once the batch is gone; a group that came as samples makes a
copy; the earliest failed item fails the batch; a piece of samples stops the session's direct
batches."""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Any

import pytest
import torch

sys.path.insert(0, str(Path(__file__).parents[1] / "transport"))
from slab_hop import LEAF, SlabHop, flat_item  # noqa: E402

from pipeload.collate import default_collate  # noqa: E402
from pipeload.engine.direct_batches import DirectBatch, DirectBatches  # noqa: E402
from pipeload.errors import RemoteFailure  # noqa: E402
from pipeload.transport.item_columns import ItemColumns  # noqa: E402
from pipeload.transport.messages import GrantOutcome, ItemsDone, Report  # noqa: E402

pytestmark = [pytest.mark.usefixtures("leak_guard"), pytest.mark.timeout(30)]


@pytest.fixture
def hop():
    hop = SlabHop()
    yield hop
    hop.close()


def _failure(slot: int) -> RemoteFailure:
    try:
        raise KeyError(f"item at slot {slot}")
    except KeyError:
        return RemoteFailure.capture(0, "fetching items", [slot], worker_kind="item")


def _open(hop: SlabHop, token: int, count: int) -> tuple[DirectBatches, Any]:
    grant, item_grant = hop.direct_grants(token, count)
    batches = DirectBatches()
    batches.open(token, DirectBatch(0, list(range(count)), grant.slab_id, grant.items))
    return batches, item_grant


def _slab_free_again(hop: SlabHop, slab_id: int, token: int) -> bool:
    grant = hop.pool.grant(None, token)
    return grant is not None and grant.slab_id == slab_id


def test_a_direct_batch_is_default_collates_viewing_the_slab_and_frees_it_when_gone(hop: SlabHop) -> None:
    batches, item_grant = _open(hop, token=0, count=5)
    first = hop.place_for_main(item_grant(0), [flat_item(float(v)) for v in (0, 1)])
    second = hop.place_for_main(item_grant(2), [flat_item(float(v)) for v in (2, 3, 4)], first=0)
    assert isinstance(first, ItemColumns) and isinstance(second, ItemColumns)
    # pieces report in any order; the batch is made when the last item is in
    assert batches.add(0, ItemsDone(3, groups=((2, 3, second),)), hop.pool) is None
    report = batches.add(0, ItemsDone(2, groups=((0, 2, first),)), hop.pool)
    assert report.report is Report.BATCH and 0 not in batches
    batch = report.payload
    expected = default_collate([flat_item(float(v)) for v in range(5)])
    assert batch.keys() == expected.keys()
    assert torch.equal(batch["x"], expected["x"]) and torch.equal(batch["label"], expected["label"])
    assert batch["x"].untyped_storage().nbytes() == 5 * LEAF * 4  # a storage of its own bytes
    other = hop.pool.grant(None, 99)  # the slab is held while the batch lives
    assert other is None or other.slab_id != 0
    hop.pool.settle(99, GrantOutcome.UNUSED)
    del batch, report
    assert _slab_free_again(hop, 0, token=1)


def test_samples_kept_out_of_a_slab_an_item_worker_found_busy_make_a_copy_of_the_same_batch(hop: SlabHop) -> None:
    batches, item_grant = _open(hop, token=0, count=4)
    columns = hop.place_for_main(item_grant(0), [flat_item(float(v)) for v in (0, 1)])
    samples = [flat_item(float(v)) for v in (2, 3)]
    batches.add(0, ItemsDone(2, groups=((2, 2, samples),), outcome=GrantOutcome.BUSY), hop.pool)
    report = batches.add(0, ItemsDone(2, groups=((0, 2, columns),)), hop.pool)
    expected = default_collate([flat_item(float(v)) for v in range(4)])
    assert torch.equal(report.payload["x"], expected["x"])
    assert report.payload["label"].tolist() == [0, 1, 2, 3]
    assert _slab_free_again(hop, 0, token=1)  # the copy views nothing of it


def test_a_batch_given_its_slab_after_its_first_samples_came_writes_them_at_their_places(hop: SlabHop) -> None:
    # A session's first batch: its probes come as samples before any slab; the rest is laid out.
    batches = DirectBatches()
    batches.open(0, DirectBatch(0, list(range(4))))
    probes = [flat_item(float(v)) for v in (0, 1)]
    assert batches.add(0, ItemsDone(2, groups=((0, 2, probes),)), hop.pool) is None
    assert batches.without_slab() == [(0, 4)]
    grant, item_grant = hop.direct_grants(0, 4)
    batches.give_slab(0, grant.slab_id, grant.items)
    assert batches.without_slab() == []
    columns = hop.place_for_main(item_grant(2), [flat_item(float(v)) for v in (2, 3)], first=0)
    report = batches.add(0, ItemsDone(2, groups=((2, 2, columns),)), hop.pool)
    expected = default_collate([flat_item(float(v)) for v in range(4)])
    assert torch.equal(report.payload["x"], expected["x"])
    assert report.payload["label"].tolist() == [0, 1, 2, 3]
    assert not _slab_free_again(hop, 0, token=1)  # the batch views it: no copy was made
    hop.pool.settle(1, GrantOutcome.UNUSED)
    del report
    assert _slab_free_again(hop, 0, token=2)


def test_the_earliest_failed_item_fails_the_batch_and_frees_its_slab(hop: SlabHop) -> None:
    batches, item_grant = _open(hop, token=0, count=6)
    columns = hop.place_for_main(item_grant(0), [flat_item(float(v)) for v in (0, 1)])
    batches.add(0, ItemsDone(2, groups=((4, 2, _failure(4)),)), hop.pool)
    batches.add(0, ItemsDone(2, groups=((2, 2, _failure(2)),)), hop.pool)
    report = batches.add(0, ItemsDone(2, groups=((0, 2, columns),)), hop.pool)
    assert report.report is Report.FAILED
    assert "slot 2" in report.payload.message
    assert _slab_free_again(hop, 0, token=1)


def test_batches_go_direct_until_a_piece_of_samples_that_cannot_go_as_columns() -> None:
    batches = DirectBatches()
    assert batches.allowed  # the session's first batch goes direct, as samples
    batches.learn(ItemsDone(4, as_columns=None))  # nothing against it
    batches.learn(ItemsDone(4, as_columns=True))
    assert batches.allowed and batches.next_epoch().allowed
    batches.learn(ItemsDone(4, as_columns=False))
    assert not batches.allowed and not batches.next_epoch().allowed  # for the whole session
    batches.learn(ItemsDone(4, as_columns=True))
    assert not batches.allowed


def test_samples_the_main_process_cannot_collate_fail_the_batch_naming_it(hop: SlabHop) -> None:
    batches, item_grant = _open(hop, token=0, count=4)
    columns = hop.place_for_main(item_grant(0), [flat_item(float(v)) for v in (0, 1)])
    odd = [{"x": torch.zeros(3), "label": 2}, {"x": torch.zeros(3), "label": 3}]  # other shapes
    batches.add(0, ItemsDone(2, groups=((2, 2, odd),)), hop.pool)
    report = batches.add(0, ItemsDone(2, groups=((0, 2, columns),)), hop.pool)
    assert report.report is Report.FAILED
    assert report.payload.exc_type is RuntimeError
    assert "in the DataLoader's main process" in report.payload.headline()
    assert "collating a batch" in report.payload.headline()
    assert _slab_free_again(hop, 0, token=1)
