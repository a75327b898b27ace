"""Economic items handed over as columns: each tensor written at its place in the batch's slab,
the rest (labels, paths) as one list per field.

Handing a group of items to a batch worker one pickled sample at a time costs, for small items,
as much as a tenth of fetching them: every tensor is reduced and rebuilt on the other side as a
view of its place, and ``default_collate`` then walks the samples to find that the stack of those
views is the run of the slab they sit in. When the samples are flat (a tensor, or a tuple, list
or dict of tensors, ints, floats, bools and strings, alike from item to item), the item worker
writes each tensor straight into its place and sends the group as an ``ItemColumns``; the batch
worker makes each tensor field of the batch as one view of its run, and hands every other field to
``default_collate``'s own handler. The batch is the one ``default_collate`` gives for the samples
(``tests/transport/test_item_columns.py`` compares them). Anything else goes sample by sample, as
before, and so does a batch one of whose groups did.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import torch

from pipeload.transport.lease_holders import keep_lease_with
from pipeload.transport.messages import ItemPlacement
from pipeload.transport.slab_writer import SlabWriter

TUPLE, LIST, DICT, TENSOR = "tuple", "list", "dict", "tensor"
_CONTAINERS = {tuple: TUPLE, list: LIST, dict: DICT}
_SCALARS = (int, float, bool, str)


@dataclass(frozen=True)
class TensorField:
    """A tensor field: every item's is this shape and dtype, written at its place in the slab."""

    dtype: torch.dtype
    shape: tuple[int, ...]

    def __reduce__(self) -> Any:  # one call to rebuild, not a dict of state (a report a piece)
        return (TensorField, (self.dtype, self.shape))


# A field's description: a TensorField, or the exact type of a scalar field (int, float, ...).
Field = TensorField | type


@dataclass(frozen=True)
class ItemColumns:
    """A group of consecutive items of a batch, as columns.

    Attributes:
        kind: the samples' container: ``"tuple"``, ``"list"``, ``"dict"``, or ``"tensor"`` (each
            sample is one tensor).
        keys: a dict's keys, in order (None otherwise).
        fields: one description per field, in the container's order.
        values: per field, the items' values (None for a tensor field: they are in the slab).
        count: how many items.
    """

    kind: str
    keys: tuple[str, ...] | None
    fields: tuple[Field, ...]
    values: tuple[list[Any] | None, ...]
    count: int

    def __reduce__(self) -> Any:  # as TensorField's
        return (ItemColumns, (self.kind, self.keys, self.fields, self.values, self.count))

    @property
    def layout(self) -> tuple[Any, ...]:
        """What two groups must share to be collated together."""
        return self.kind, self.keys, self.fields

    def samples(self, slab: memoryview, items: ItemPlacement, first_slot: int) -> list[Any]:
        """The items as samples, each tensor over its own place in ``slab`` (laid out by
        ``items``), as a decoded item's is (the bytes the items view are then known, see
        ``collate_output.note_items``); ``first_slot``: the batch slot of the group's first item."""
        columns = []
        leaf = 0
        for field, values in zip(self.fields, self.values):
            if values is not None:
                columns.append(values)
                continue
            start, size = items.leaf_offsets[leaf], items.leaf_bytes[leaf]
            columns.append([_over(slab, start + (first_slot + i) * size, size, field)
                             for i in range(self.count)])
            leaf += 1
        rows = list(zip(*columns))
        if self.kind == TENSOR:
            return [row[0] for row in rows]
        if self.kind == DICT:
            return [dict(zip(self.keys, row)) for row in rows]  # type: ignore[arg-type]
        return [tuple(row) if self.kind == TUPLE else list(row) for row in rows]


def place_as_columns(samples: Sequence[Any], writer: SlabWriter) -> ItemColumns | None:
    """Write ``samples``' tensors at their places (the writer is placing a group, see
    ``SlabWriter.place_items``) and describe the group as columns; None, with nothing recorded
    in the writer, when they are not flat and alike, or a tensor field has no place: send them
    as samples then (a tensor already written sits at its own place, where they put it again).

    The samples are checked first; then each tensor field of the whole group is written in one
    ``torch.stack`` into its run of the slab (the group's items are consecutive slots, so each
    field's places follow one another): one call a field instead of a view and a copy an item,
    which cost item workers about as much again as the copying itself."""
    checked = _checked_rows(samples)
    if checked is None:
        return None
    kind, keys, fields, rows = checked
    count = len(rows)
    values: list[list[Any] | None] = []
    item_sizes = []
    leaf = 0
    for position, field in enumerate(fields):
        if not isinstance(field, TensorField):
            values.append([row[position] for row in rows])
            continue
        values.append(None)
        nbytes = _field_bytes(field)
        room = writer.allocate_run(leaf, count, nbytes)
        if room is None:
            return None
        storage, offset = room
        torch.stack([row[position] for row in rows], out=_view(storage, offset, field.dtype, (count, *field.shape)))
        item_sizes.append(nbytes)
        leaf += 1
    writer.note_item_sizes(tuple(item_sizes), count)
    return ItemColumns(kind, keys, fields, tuple(values), count)


def _checked_rows(samples: Sequence[Any]) -> tuple[str, tuple[str, ...] | None, tuple[Field, ...],
                                                     list[Sequence[Any]]] | None:
    """(kind, keys, fields, each sample's fields) if ``samples`` are flat and alike (laid out
    as the first one, every tensor a plain one of its field's shape and dtype); None otherwise."""
    layout = _layout_of(samples[0]) if samples else None
    if layout is None:
        return None
    kind, keys, fields = layout
    sample_type = type(samples[0])
    tensors = [(position, field) for position, field in enumerate(fields) if isinstance(field, TensorField)]
    scalars = [(position, field) for position, field in enumerate(fields) if not isinstance(field, TensorField)]
    rows = []
    for sample in samples:
        row = _row(sample, sample_type, kind, keys, len(fields))
        if (row is None or any(type(row[position]) is not field for position, field in scalars)
                or not all(_fits(row[position], field) for position, field in tensors)):
            return None
        rows.append(row)
    return kind, keys, fields, rows


def column_bytes(samples: Sequence[Any]) -> tuple[int, ...] | None:
    """What one item's tensors would take at their places, in field order (the sizes
    ``place_as_columns`` asks for, item after item), if ``samples`` could go as columns; None
    when they are not flat and alike. For items sent before any place is known."""
    checked = _checked_rows(samples)
    if checked is None:
        return None
    return tuple(_field_bytes(field) for field in checked[2] if isinstance(field, TensorField))


def _field_bytes(field: TensorField) -> int:
    """One item's bytes of a tensor field, at its place."""
    return math.prod(field.shape) * field.dtype.itemsize


# Where a batch's tensor field comes from: (leaf, item count, field) -> the view of its run, or
# None when it has none (the batch is then collated as samples).
TensorRuns = Callable[[int, int, TensorField], "torch.Tensor | None"]


def collate_columns(groups: Sequence[ItemColumns], tensor_run: TensorRuns,
                    collate_field: Callable[[Sequence[Any]], Any]) -> Any:
    """The batch of ``groups`` (every item of it, in slot order), as ``default_collate`` makes
    it: each tensor field the view ``tensor_run`` gives of its run in the batch's slab
    (``writer_runs``, ``lease_runs``), each other field given to ``collate_field``
    (default_collate's handlers) as ``default_collate`` gives it. None when the groups' layouts
    differ, or a run cannot be had: collate them as samples then."""
    first = groups[0]
    if any(group.layout != first.layout for group in groups):
        return None
    count = sum(group.count for group in groups)
    collated: list[Any] = []
    leaf = 0
    for position, field in enumerate(first.fields):
        if isinstance(field, TensorField):
            run = tensor_run(leaf, count, field)
            if run is None:
                return None
            collated.append(run)
            leaf += 1
            continue
        column = [value for group in groups for value in group.values[position]]  # type: ignore[union-attr]
        # As default_collate hands a field over: a sequence's as a tuple (zip's), else a list.
        collated.append(collate_field(tuple(column) if first.kind in (TUPLE, LIST) else column))
    if first.kind == TENSOR:
        return collated[0]
    if first.kind == DICT:
        return dict(zip(first.keys, collated))  # type: ignore[arg-type]
    return collated  # a tuple's batch is a list, as torch's; a list's too


def writer_runs(writer: SlabWriter) -> TensorRuns:
    """A batch worker's runs: claimed in the slab its writer was granted for the batch, so that
    the batch's message refers to them."""
    storage = writer.slab_storage()

    def run(leaf: int, count: int, field: TensorField) -> torch.Tensor | None:
        offset = None if storage is None else writer.claim_run(leaf, count)
        return None if offset is None else _view(storage, offset, field.dtype, (count, *field.shape))  # type: ignore[arg-type]
    return run


def lease_runs(lease: memoryview, items: ItemPlacement) -> TensorRuns:
    """The main process's runs (engine/direct_batches.py): over ``lease``, its view of the
    batch's slab, laid out by ``items``; each run a storage of its own bytes, as a batch
    decoded from a slab gets."""

    def run(leaf: int, count: int, field: TensorField) -> torch.Tensor | None:
        if leaf >= len(items.leaf_offsets):
            return None
        start, size = items.leaf_offsets[leaf], items.leaf_bytes[leaf]
        if size != math.prod(field.shape) * field.dtype.itemsize or start + count * size > min(items.area_bytes, len(lease)):
            return None
        tensor = torch.frombuffer(lease[start:start + count * size], dtype=field.dtype)
        keep_lease_with(tensor.untyped_storage(), lease)  # see lease_holders.py
        return tensor.view(count, *field.shape)
    return run


def place_in_lease(samples: Sequence[Any], lease: memoryview, items: ItemPlacement,
                   first_slot: int) -> ItemColumns | None:
    """``place_as_columns`` done by the main process (engine/direct_batches.py): ``samples``,
    the items of slots ``first_slot`` on that came as samples, written at their places in
    ``lease`` (its view of the batch's slab, laid out by ``items``) and described as columns;
    None, with nothing written, when they are not flat and alike or do not fit the layout.

    The caller writes only into a slab that the batch's item workers found released (they
    wrote columns there): their places are this batch's, and no batch views them."""
    if not samples:
        return None
    storage = torch.frombuffer(lease, dtype=torch.uint8).untyped_storage()
    return place_as_columns(samples, _LeasePlaces(storage, len(lease), items, first_slot))  # type: ignore[arg-type]


class _LeasePlaces:
    """The part of a ``SlabWriter`` that ``place_as_columns`` uses, over the main process's lease."""

    def __init__(self, storage: torch.UntypedStorage, size: int, items: ItemPlacement, first_slot: int) -> None:
        self._storage, self._end = storage, min(size, items.area_bytes)
        self._items, self._first_slot = items, first_slot

    def allocate_run(self, leaf: int, count: int, nbytes: int) -> tuple[torch.UntypedStorage, int] | None:
        items = self._items
        if leaf >= len(items.leaf_offsets) or items.leaf_bytes[leaf] != nbytes:
            return None
        offset = items.leaf_offsets[leaf] + self._first_slot * nbytes
        return (self._storage, offset) if offset + count * nbytes <= self._end else None

    def note_item_sizes(self, item_sizes: tuple[int, ...], count: int) -> None:
        pass  # the layout is the batch's own: nothing to tell anyone


def _layout_of(sample: Any) -> tuple[str, tuple[str, ...] | None, tuple[Field, ...]] | None:
    """(kind, keys, fields) of a flat sample, or None when it is not one."""
    kind = TENSOR if type(sample) is torch.Tensor else _CONTAINERS.get(type(sample))
    if kind is None:
        return None
    keys = None
    if kind == DICT:
        keys = tuple(sample)
        if not all(type(key) is str for key in keys):
            return None
    row = _row(sample, type(sample), kind, keys, None)
    fields = tuple(_field(value) for value in row)  # type: ignore[union-attr]
    if not fields or any(field is None for field in fields):
        return None
    return kind, keys, fields  # type: ignore[return-value]


def _row(sample: Any, sample_type: type, kind: str, keys: tuple[str, ...] | None,
         length: int | None) -> Sequence[Any] | None:
    """The sample's fields in the layout's order; None when it is not laid out so (another
    type, another length, a key missing: default_collate reads every sample by the first one's
    keys, and ignores any other key, as this does)."""
    if type(sample) is not sample_type:
        return None
    if kind == TENSOR:
        return (sample,)
    if kind == DICT:
        try:
            return [sample[key] for key in keys]  # type: ignore[union-attr]
        except KeyError:
            return None
    return sample if length is None or len(sample) == length else None


def _fits(value: Any, field: TensorField) -> bool:
    """Whether ``value`` is a tensor laid out as ``field`` says, that can be written as it is."""
    return (type(value) is torch.Tensor and value.dtype is field.dtype and value.shape == field.shape
            and _plain_tensor(value))


def _plain_tensor(value: torch.Tensor) -> bool:
    """A CPU tensor whose values are its bytes: strided, not requiring grad, nothing lazy."""
    return not (value.is_nested or value.layout is not torch.strided or not value.is_cpu
                or value.requires_grad or value.is_quantized or value.is_conj() or value.is_neg()
                or value._is_zerotensor())


def _field(value: Any) -> Field | None:
    """A value's field description; None for anything but a plain CPU tensor with bytes or a
    plain scalar."""
    kind = type(value)
    if kind is torch.Tensor:
        return TensorField(value.dtype, tuple(value.shape)) if value.numel() and _plain_tensor(value) else None
    return kind if kind in _SCALARS else None


def _over(slab: memoryview, offset: int, nbytes: int, field: TensorField) -> torch.Tensor:
    """The tensor ``field`` describes, over ``nbytes`` of ``slab`` from ``offset`` (a storage
    of those bytes alone)."""
    return torch.frombuffer(slab[offset:offset + nbytes], dtype=field.dtype).view(field.shape)


def _view(storage: torch.UntypedStorage, offset: int, dtype: torch.dtype, shape: tuple[int, ...]) -> torch.Tensor:
    """The contiguous tensor of ``shape`` at byte ``offset`` of ``storage``."""
    return torch.empty((0,), dtype=dtype).set_(storage, offset // dtype.itemsize, shape)
