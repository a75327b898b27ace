"""Where ``default_collate`` stacks tensors: inside a worker process, straight into the memory the
batch will travel in (the granted slab, or a fresh shared buffer), so sending it copies nothing.
In economic mode the item workers have already written the items where their stack goes (see
``ItemPlacement``): the stack is then a view of the slab, and only items that could not be placed
are copied in.

The worker's sender names the writer for the message it is building; small outputs (that travel
inline anyway) and everything outside a worker process stay in ordinary memory.
"""

from __future__ import annotations

import math
import threading
from collections.abc import Mapping
from typing import Any

import torch

from pipeload.transport.codec import INLINE_MAX_BYTES
from pipeload.transport.lease_holders import keep_lease_with
from pipeload.transport.slab_writer import SlabWriter, in_place


class _Current(threading.local):
    writer: SlabWriter | None = None


_current = _Current()


def set_writer(writer: SlabWriter | None) -> None:
    """Send this thread's collated tensors to ``writer`` (None: ordinary memory)."""
    _current.writer = writer


def current_writer() -> SlabWriter | None:
    """The writer of the message this thread is building (None: not in a process worker)."""
    return _current.writer


def copied_into_message() -> bool:
    """Whether what this thread collates now is copied into a message (a process worker's batch)
    rather than handed to the caller as it is: then any memory will do, even memory that torch
    cannot resize (a numpy array's)."""
    return _current.writer is not None


def shared_output(shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor | None:
    """An uninitialised contiguous tensor in the memory the current message travels in (in
    ordinary memory when it is small enough to go inline), or None when not in a worker."""
    writer = _current.writer
    if writer is None:
        return None
    itemsize = dtype.itemsize
    nbytes = math.prod(shape) * itemsize
    if nbytes <= INLINE_MAX_BYTES:
        # Contiguous all the same: a torch worker stacks every batch into a fresh contiguous
        # tensor, so its strides (channels-last samples) and its refusal of samples that
        # require grad (no out= under autograd) do not depend on the batch's size.
        return torch.empty(shape, dtype=dtype)
    room = writer.allocate(nbytes)
    if room is None:
        storage, offset = writer.one_shot(nbytes), 0
    else:
        storage, offset = room
    return torch.empty((0,), dtype=dtype).set_(storage, offset // itemsize, shape)


def own_memory_output(shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
    """An uninitialised contiguous tensor in memory of its own, as a batch decoded from a worker's
    message has (codec.py): it lives as long as its storage does, ``share_memory_()`` (a
    ``torch.multiprocessing`` queue's put) cannot free it under a numpy array taken before, and
    ``resize_()`` refuses it. Where the main process collates samples itself (economic mode's
    first batch), stacking into it saves copying the batch a second time."""
    buffer = bytearray(math.prod(shape) * dtype.itemsize)
    storage = torch.frombuffer(buffer, dtype=torch.uint8).untyped_storage() if buffer else torch.UntypedStorage(0)
    keep_lease_with(storage, buffer)
    return torch.empty((0,), dtype=dtype).set_(storage, 0, shape)


def stacked_in_place(parts: list[torch.Tensor]) -> torch.Tensor | None:
    """The stack of ``parts`` (one tensor per item, same shape and dtype) as a view of the slab
    where item workers placed them, with any item that is elsewhere copied into its place; None
    when they were not placed (stack them as usual)."""
    writer = _current.writer
    if writer is None or not writer.expects_items:
        return None
    first = parts[0]
    # A part that is no tensor at all (a sample that gave a number where the others gave a
    # tensor) is asked nothing either: torch.stack refuses it with its own TypeError.
    if any(not isinstance(p, torch.Tensor) or p.shape != first.shape or p.dtype != first.dtype
           or p.device != first.device or p.requires_grad for p in parts):
        return None  # torch.stack decides, and says what is wrong
    offset = writer.claim_items(parts)
    storage = writer.slab_storage()
    if offset is None or storage is None:
        return None
    size = first.numel() * first.element_size()
    stacked = torch.empty((0,), dtype=first.dtype).set_(
        storage, offset // first.element_size(), (len(parts), *first.shape))
    base = storage.data_ptr() + offset
    for i, part in enumerate(parts):
        if not in_place(part, base + i * size):
            stacked[i].copy_(part)  # its place is free (claim_items checked)
    return stacked


def note_items(samples: list[Any]) -> None:
    """Tell the current writer which of its slab's bytes the batch's items view, so that
    ``stacked_in_place`` never copies an item over another one's bytes. Items it cannot see
    into (anything but tensors, mappings, sequences and scalars) leave it unknown."""
    writer = _current.writer
    if writer is None or not writer.expects_items:
        return
    storage = writer.slab_storage()
    low, high = storage.data_ptr(), storage.data_ptr() + storage.nbytes()

    def occupied() -> list[tuple[int, int]] | None:
        ranges: list[tuple[int, int]] = []
        return ranges if _walk(samples, low, high, ranges) else None

    # Walked only if an item must be copied into its place: when all are there (the rule once
    # the layout is known), nothing asks, and a walk over every leaf of every item is saved.
    writer.occupied_from(occupied)


_SCALARS = (str, bytes, int, float, bool, complex, type(None))


def _walk(value: Any, low: int, high: int, ranges: list[tuple[int, int]]) -> bool:
    # Called for every leaf of every item of a batch: the common kinds are asked first, and the
    # Mapping check (an ABC, slow to ask) last.
    if isinstance(value, torch.Tensor):
        if value.layout is not torch.strided:
            return False  # sparse, jagged: no one range of bytes to see
        if value.device.type == "cpu" and low <= value.data_ptr() < high:
            storage = value.untyped_storage()
            start = storage.data_ptr()
            ranges.append((start, start + storage.nbytes()))
        return True
    if isinstance(value, (list, tuple)):
        for part in value:
            if not _walk(part, low, high, ranges):
                return False
        return True
    if isinstance(value, _SCALARS):
        return True
    if isinstance(value, Mapping):
        return all(_walk(v, low, high, ranges) for v in value.values())
    return False
