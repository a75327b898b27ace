"""A classic worker's samples, each written into its rows of the batch's slab as it is fetched.

``default_collate`` stacks each large tensor of a batch's samples into the slab the batch travels
in. Done once every sample is in hand, that stack reads the samples back from the worker's heap,
which holds the whole batch at once: a worker forked for a new epoch faults all of it in (64
float images of 600 KB: 38 MB, some 9,400 page faults), and the copy reads memory long gone from
the caches. Written into its rows as soon as it is fetched, a sample is copied while it is still
in the cache and its memory is free for the next one: the heap holds one sample, not a batch.
``default_collate`` then finds every row in place (``collate_output.stacked_in_place``) and its
stack is a view of the slab.

Only samples holding at least ``ROW_MIN_BYTES`` of such tensors are placed, and of them only
what ``default_collate`` would stack into the slab: plain dense CPU tensors (no
subclass, nothing that requires grad, no conjugate or negative view) whose batch is too large to
travel inline, found in the sample itself or inside plain tuples, lists and dicts, which are
rebuilt around the rows (same types, same order). Anything else stays as the dataset returned
it, and so does every sample from the first one whose large tensors differ from the first
sample's: ``default_collate`` then stacks as usual, and says what is wrong if anything is.
"""

from __future__ import annotations

from typing import Any

import torch

from pipeload.transport import collate_output
from pipeload.transport.codec import INLINE_MAX_BYTES
from pipeload.transport.messages import ItemPlacement
from pipeload.transport.slab_writer import SlabWriter

# Below this many bytes of tensors a sample, placing it costs more than it saves: its batch is
# small enough to stack from the caches, and the Python work per sample (~5 us) outweighs the
# copy (measured: rows as fast as a stack at 256 KiB a sample, 1.6x faster at 600 KiB).
ROW_MIN_BYTES = 256 << 10


def rows_for(count: int) -> SampleRows | None:
    """Where the ``count`` samples of the batch this thread is building go, or None when it
    builds no batch in a slab (not a process worker, no grant yet, an economic item area):
    fetch the usual way. Give each sample to ``place`` as it comes::

        rows = rows_for(len(indices))
        samples = []
        for index in indices:
            samples.append(dataset[index])
            rows.place(samples)
    """
    writer = collate_output.current_writer()
    if writer is None or not writer.may_place_rows:
        return None
    return SampleRows(writer, count)


class SampleRows:
    """Where one batch's samples go: the layout is learnt from the first sample. The slab may
    still hold a batch the training loop has not let go of: the samples fetched meanwhile wait
    in the heap, and are written into their rows once it is free.

    Owned by the fetching thread for one batch. Invariants: rows are written only into the area
    the writer laid out and only once it let them be (``take_rows``), sample ``i``'s leaf ``k``
    at ``leaf_offsets[k] + i * leaf_bytes[k]``, and only a leaf of the first sample's dtype and
    shape; the first ``placed`` samples are in their rows.
    """

    __slots__ = ("_writer", "_count", "_area", "_kinds", "_runs", "_placed", "_stopped")

    def __init__(self, writer: SlabWriter, count: int) -> None:
        self._writer = writer
        self._count = count
        self._area: ItemPlacement | None = None
        self._kinds: list[tuple[torch.dtype, torch.Size]] = []  # each leaf's, from the first sample
        self._runs: list[torch.Tensor] | None = None  # each leaf's rows, once they may be written
        self._placed = 0
        self._stopped = False

    def place(self, samples: list[Any]) -> None:
        """Write the samples not yet in their rows into them, replacing each in ``samples`` by
        itself rebuilt around its rows, as far as the slab lets it now."""
        if self._stopped:
            return
        if self._area is None and not self._lay_out(samples[0]):
            return
        if self._runs is None and not self._take():
            return  # the slab is not free yet: these samples wait in the heap
        while self._placed < len(samples):
            placed = self._in_rows(self._placed, samples[self._placed])
            if placed is None:
                self._stopped = True  # its tensors differ from the first sample's
                return
            samples[self._placed] = placed
            self._placed += 1

    def _lay_out(self, first: Any) -> bool:
        leaves: list[torch.Tensor] = []
        _large_leaves(first, self._count, leaves)
        area = None
        if sum(leaf.nbytes for leaf in leaves) >= ROW_MIN_BYTES:
            area = self._writer.rows_area(tuple(leaf.nbytes for leaf in leaves), self._count)
        if area is None:
            self._stopped = True
            return False
        self._area = area
        self._kinds = [(leaf.dtype, leaf.shape) for leaf in leaves]
        return True

    def _take(self) -> bool:
        area = self._area
        if not self._writer.take_rows(area):  # type: ignore[arg-type]
            return False
        storage = self._writer.slab_storage()
        self._runs = [
            torch.empty((0,), dtype=dtype).set_(storage, offset // dtype.itemsize,  # type: ignore[arg-type]
                                                (self._count, *shape))
            for (dtype, shape), offset in zip(self._kinds, area.leaf_offsets)  # type: ignore[union-attr]
        ]
        return True

    def _in_rows(self, position: int, sample: Any) -> Any:
        leaves: list[torch.Tensor] = []
        _large_leaves(sample, self._count, leaves)
        if len(leaves) != len(self._kinds) or any(
                leaf.dtype != dtype or leaf.shape != shape
                for leaf, (dtype, shape) in zip(leaves, self._kinds)):
            return None
        rows = []
        for leaf, run in zip(leaves, self._runs):  # type: ignore[arg-type]
            row = run[position]
            row.copy_(leaf)
            rows.append(row)
        return _rebuilt(sample, self._count, iter(rows))


def _placeable(value: Any, count: int) -> bool:
    # A nested tensor is a plain Tensor with a strided layout too, but has no one shape.
    return (type(value) is torch.Tensor and value.layout is torch.strided
            and not value.is_nested and value.device.type == "cpu" and not value.requires_grad
            and not value.is_conj() and not value.is_neg() and not value.is_quantized
            and value.nbytes * count > INLINE_MAX_BYTES)


def _large_leaves(value: Any, count: int, leaves: list[torch.Tensor]) -> None:
    """The tensors of ``value`` to place, in the order ``_rebuilt`` meets them."""
    kind = type(value)
    if kind is torch.Tensor:
        if _placeable(value, count):
            leaves.append(value)
    elif kind is tuple or kind is list:
        for part in value:
            _large_leaves(part, count, leaves)
    elif kind is dict:
        for part in value.values():
            _large_leaves(part, count, leaves)


def _rebuilt(value: Any, count: int, rows: Any) -> Any:
    """``value`` with each tensor ``_large_leaves`` found replaced by the next of ``rows``."""
    kind = type(value)
    if kind is torch.Tensor:
        return next(rows) if _placeable(value, count) else value
    if kind is tuple:
        return tuple(_rebuilt(part, count, rows) for part in value)
    if kind is list:
        return [_rebuilt(part, count, rows) for part in value]
    if kind is dict:
        return {key: _rebuilt(part, count, rows) for key, part in value.items()}
    return value
