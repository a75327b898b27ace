"""Where ``default_collate`` stacks tensors: inside a worker process, straight into the memory the
batch will travel in (the granted slab, or a fresh shared buffer), so sending it copies nothing.

The worker's sender names the writer for the message it is building; small outputs (that travel
inline anyway) and everything outside a worker process stay in ordinary memory.
"""

from __future__ import annotations

import math
import threading

import torch

from pipeload.transport.codec import INLINE_MAX_BYTES
from pipeload.transport.slab_writer import SlabWriter


class _Current(threading.local):
    writer: SlabWriter | None = None


_current = _Current()


def set_writer(writer: SlabWriter | None) -> None:
    """Send this thread's collated tensors to ``writer`` (None: ordinary memory)."""
    _current.writer = writer


def copied_into_message() -> bool:
    """Whether what this thread collates now is copied into a message (a process worker's batch)
    rather than handed to the caller as it is: then any memory will do, even memory that torch
    cannot resize (a numpy array's)."""
    return _current.writer is not None


def shared_output(shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor | None:
    """An uninitialised contiguous tensor in the memory the current message travels in, or None
    when it should be made in ordinary memory (not in a worker, or small enough to go inline)."""
    writer = _current.writer
    if writer is None:
        return None
    itemsize = dtype.itemsize
    nbytes = math.prod(shape) * itemsize
    if nbytes <= INLINE_MAX_BYTES:
        return None
    room = writer.allocate(nbytes)
    if room is None:
        storage, offset = writer.one_shot(nbytes), 0
    else:
        storage, offset = room
    return torch.empty((0,), dtype=dtype).set_(storage, offset // itemsize, shape)
