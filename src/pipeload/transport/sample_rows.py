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

torch stacks what the samples hold when ``collate_fn`` runs, not when they were fetched: a
dataset that returns one buffer refilled for every index, or that changes a tensor it returned
earlier, gets that buffer's last contents in every row. So that the rows hold the same,
``settle`` copies again, just before collation, every placed tensor changed in place since it
was placed (its version counter moved), and any whose memory is still held where no counter can
be read. Not caught: writes that leave the counter alone (through numpy or ``.data``) into a
tensor still held, a tensor changed and then let go before the batch is complete, a container
filled anew with other tensors.
"""

from __future__ import annotations

import weakref
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
        rows.settle()
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
    shape; the first ``placed`` samples are in their rows; ``_sources`` holds, for each tensor
    written into a row, what ``settle`` needs to copy it again.
    """

    __slots__ = ("_writer", "_count", "_area", "_kinds", "_runs", "_placed", "_stopped",
                 "_sources")

    def __init__(self, writer: SlabWriter, count: int) -> None:
        self._writer = writer
        self._count = count
        self._area: ItemPlacement | None = None
        self._kinds: list[tuple[torch.dtype, torch.Size]] = []  # each leaf's, from the first sample
        self._runs: list[torch.Tensor] | None = None  # each leaf's rows, once they may be written
        self._placed = 0
        self._stopped = False
        self._sources: list[_Source] = []

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

    def settle(self) -> None:
        """Copy again into its row each placed tensor that may have changed since it was placed
        (see the module's notes), so that the rows hold what the samples hold now, as torch's
        stack at collation reads them.
        Call it once every sample of the batch is fetched, before ``collate_fn``."""
        for source in self._sources:
            source.copy_if_changed()
        self._sources.clear()

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
            self._sources.append(_Source(leaf, row))
        return _rebuilt(sample, self._count, iter(rows))


class _Source:
    """Where a placed tensor came from, all held weakly: its memory (the storage), the tensor
    whose version counter it shares (its base when it is a view), where in the memory and as
    what dtype, and the version it was copied at."""

    __slots__ = ("_storage", "_owner", "_version", "_dtype", "_size", "_stride", "_offset", "_row")

    def __init__(self, leaf: torch.Tensor, row: torch.Tensor) -> None:
        # torch keeps one storage object per storage while any tensor uses it, so this weak
        # reference lives exactly as long as the memory does.
        self._storage = weakref.ref(leaf.untyped_storage())
        owner = leaf if leaf._base is None else leaf._base
        self._owner = weakref.ref(owner)
        # An inference tensor keeps no version counter: see copy_if_changed.
        self._version = None if owner.is_inference() else owner._version
        # The base may be of another dtype (``.real``): the leaf's own, in its own units.
        self._dtype, self._size, self._stride = leaf.dtype, leaf.shape, leaf.stride()
        self._offset = leaf.storage_offset()
        self._row = row

    def copy_if_changed(self) -> None:
        owner = self._owner()
        if owner is not None:
            if self._version is not None and owner._version == self._version:
                return
            storage = owner.untyped_storage()  # changed (or an inference tensor: unknown)
        else:
            # Its memory may still be held through a tensor that cannot be asked (a
            # ``view(dtype)`` shares the counter but names no base): copied again if it is.
            storage = self._storage()
            if storage is None:
                return  # gone: nothing can change it now (a change before it went is missed)
        now = torch.empty((0,), dtype=self._dtype).set_(storage, self._offset, self._size,
                                                         self._stride)
        self._row.copy_(now)


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
