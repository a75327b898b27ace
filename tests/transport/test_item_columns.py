"""Economic items sent as columns: each tensor written at its place in the batch's slab by the
item worker, the batch made of one view per tensor field and default_collate's own handlers for
the rest, equal to default_collate's batch of the same samples; samples that are not flat and
alike go as samples, with nothing left recorded in the writer."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import pytest
import torch
from slab_hop import LEAF, SlabHop

from pipeload.collate import collate, default_collate, default_collate_fn_map
from pipeload.transport.item_columns import ItemColumns, collate_columns, writer_runs
from pipeload.transport.messages import GrantOutcome

pytestmark = [pytest.mark.usefixtures("leak_guard"), pytest.mark.timeout(30)]


def _field(column: Any) -> Any:
    return collate(column, collate_fn_map=default_collate_fn_map)


# name -> (one item from a value, its tensors' bytes in order)
FLAT: dict[str, tuple[Callable[[int], Any], tuple[int, ...]]] = {
    "image and label": (lambda v: (torch.full((LEAF,), float(v)), v), (LEAF * 4,)),
    "a bare tensor": (lambda v: torch.full((4, LEAF // 4), float(v)), (LEAF * 4,)),
    "a list of every scalar kind": (
        lambda v: [torch.full((LEAF,), v, dtype=torch.int16), v / 2, f"path/{v}", v % 2 == 0, v],
        (LEAF * 2,)),
    "a dict of two tensors": (
        lambda v: {"image": torch.full((2, LEAF), float(v)), "mask": torch.full((LEAF,), v, dtype=torch.uint8),
                   "name": f"n{v}", "weight": float(v)},
        (LEAF * 8, LEAF)),
}


def _assert_same_batch(ours: Any, theirs: Any) -> None:
    assert type(ours) is type(theirs), (type(ours), type(theirs))
    if isinstance(theirs, torch.Tensor):
        assert ours.dtype == theirs.dtype and ours.shape == theirs.shape and torch.equal(ours, theirs)
        assert ours.is_contiguous()
    elif isinstance(theirs, dict):
        assert list(ours) == list(theirs)
        for key in theirs:
            _assert_same_batch(ours[key], theirs[key])
    elif isinstance(theirs, (list, tuple)):
        assert len(ours) == len(theirs)
        for mine, other in zip(ours, theirs):
            _assert_same_batch(mine, other)
    else:
        assert ours == theirs


@pytest.mark.parametrize("case", list(FLAT))
def test_a_batch_sent_as_columns_is_default_collates_batch_viewing_the_slab(case: str) -> None:
    make, item_bytes = FLAT[case]
    hop = SlabHop()
    try:
        batch_grant, item_grant = hop.grants(token=0, count=5, item_bytes=item_bytes)
        groups = [hop.hand_over_as_columns(item_grant(0), [make(0), make(1)]),
                  hop.hand_over_as_columns(item_grant(2), [make(2), make(3), make(4)])]
        assert all(isinstance(group, ItemColumns) for group in groups)
        assert hop.item.writer.last_large_sizes == list(item_bytes) * 3  # what ITEMS_DONE reports
        hop.batch.prepare(batch_grant)
        batch = collate_columns(groups, writer_runs(hop.batch.writer), _field)
        expected = default_collate([make(v) for v in range(5)])
        _assert_same_batch(batch, expected)
        storage = hop.batch.writer.slab_storage()
        tensors = [batch] if isinstance(batch, torch.Tensor) else [
            value for value in (batch.values() if isinstance(batch, dict) else batch)
            if isinstance(value, torch.Tensor) and value.dtype is not torch.float64 and value.dtype is not torch.int64
            and value.dtype is not torch.bool]
        for tensor, offset in zip(tensors, batch_grant.items.leaf_offsets):
            assert tensor.data_ptr() == storage.data_ptr() + offset  # written once, by the item worker
        hop.batch.send(batch)
        del batch, tensors, storage
        message, info = hop.batch_main.receive()
        _assert_same_batch(message, expected)
        assert info.outcome is GrantOutcome.USED
        del message
    finally:
        hop.close()


def test_columns_arrived_as_samples_are_the_items_at_their_places() -> None:
    make, item_bytes = FLAT["a dict of two tensors"]
    hop = SlabHop()
    try:
        batch_grant, item_grant = hop.grants(token=0, count=3, item_bytes=item_bytes)
        group = hop.hand_over_as_columns(item_grant(1), [make(1), make(2)])
        hop.batch.prepare(batch_grant)
        samples = group.samples(hop.batch.writer.view(batch_grant.slab_id), batch_grant.items, 1)
        for value, sample in zip((1, 2), samples):
            _assert_same_batch(sample, make(value))
        del samples
    finally:
        hop.close()


def _two(make: Callable[[int], Any]) -> Callable[[], list]:
    return lambda: [make(0), make(1)]


@pytest.mark.parametrize("items", [
    pytest.param(_two(lambda v: {"x": torch.ones(LEAF), "meta": {"id": v}}), id="a nested field"),
    pytest.param(_two(lambda v: (torch.ones(LEAF), [1, 1.5][v])), id="a field whose type changes"),
    pytest.param(_two(lambda v: (torch.ones(LEAF >> v), v)), id="a tensor whose shape changes"),
    pytest.param(_two(lambda v: (torch.ones(LEAF, requires_grad=True), v)), id="a tensor requiring grad"),
    pytest.param(_two(lambda v: {v: torch.ones(LEAF)}), id="a key that is no string"),
    pytest.param(_two(lambda v: (torch.ones(LEAF * 2), v)), id="a tensor larger than its place"),
])
def test_samples_that_are_not_flat_and_alike_go_as_samples(items: Callable[[], list]) -> None:
    hops = SlabHop(), SlabHop()
    try:
        grants = [hop.grants(token=0, count=2)[1](0) for hop in hops]
        arrived = hops[0].hand_over_as_columns(grants[0], items())
        as_samples = hops[1].hand_over(grants[1], items())
        assert isinstance(arrived, list) and len(arrived) == 2
        # the sizes the item worker reports are the samples' message's alone: the attempt at
        # columns left nothing behind in the writer
        assert hops[0].item.writer.last_large_sizes == hops[1].item.writer.last_large_sizes
        del arrived, as_samples
    finally:
        for hop in hops:
            hop.close()


def test_groups_laid_out_differently_are_not_collated_as_columns() -> None:
    hop = SlabHop()
    try:
        batch_grant, item_grant = hop.grants(token=0, count=2)
        first = hop.hand_over_as_columns(item_grant(0), [(torch.ones(LEAF), 1)])
        second = hop.hand_over_as_columns(item_grant(1), [(torch.ones(LEAF), "one")])
        hop.batch.prepare(batch_grant)
        assert collate_columns([first, second], writer_runs(hop.batch.writer), _field) is None
    finally:
        hop.close()
