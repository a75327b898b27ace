"""Page-locking memory we mapped ourselves, so CUDA copies from it run as DMA, without staging.

A slab is registered once with ``cudaHostRegister`` when the main process maps it, and unregistered
before it is unmapped. Tensors viewing it then answer ``is_pinned()`` with True and
``.cuda(non_blocking=True)`` copies from them asynchronously, as from ``pin_memory()``'s own memory.

Unlike torch's pinned-memory allocator, nothing here knows when an asynchronous copy has finished
reading a slab; :func:`release_marker` records a CUDA event on the current stream when a batch is
released, and the slab is reused only once that event has completed.

Only CUDA is handled (the one accelerator whose host-registration API torch exposes); elsewhere
these functions report that they did nothing and batches are pinned by copying, as before.
"""

from __future__ import annotations

from typing import Any

import torch


def can_register() -> bool:
    """Whether slabs can be page-locked in place here (CUDA present)."""
    try:
        return bool(torch.cuda.is_available())
    except Exception:  # a broken driver install: pin by copying instead
        return False


def register(address: int, nbytes: int) -> bool:
    """Page-lock ``nbytes`` at ``address`` for CUDA; returns whether it worked."""
    try:
        error = torch.cuda.cudart().cudaHostRegister(address, nbytes, 0)
    except Exception:
        return False
    return int(error) == 0


def unregister(address: int) -> None:
    """Undo :func:`register`; errors (CUDA already torn down at exit) are ignored."""
    try:
        torch.cuda.cudart().cudaHostUnregister(address)
    except Exception:
        pass


def release_marker() -> Any:
    """A CUDA event recorded on the calling thread's current stream, or None if that failed.

    Called when the last tensor of a pinned batch dies, on whichever thread dropped it: copies the
    training loop queued on its stream before then are ordered before the event.
    """
    try:
        event = torch.cuda.Event()
        event.record(torch.cuda.current_stream())
        return event
    except Exception:
        return None


def marker_done(marker: Any) -> bool:
    """Whether the work before ``marker`` has finished; a missing marker waits for the device."""
    if marker is None:
        try:
            torch.cuda.synchronize()
        except Exception:
            pass
        return True
    try:
        return bool(marker.query())
    except Exception:
        return True


def wait_for_marker(marker: Any) -> None:
    """Block until ``marker`` completes (used only when tearing a pinned slab down)."""
    if marker is None:
        marker_done(None)
        return
    try:
        marker.synchronize()
    except Exception:
        pass
