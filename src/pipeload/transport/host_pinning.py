"""Page-locking memory we mapped ourselves, so CUDA copies from it run as DMA, without staging.

A slab is registered once with ``cudaHostRegister`` when the main process makes it (on the slab's
preparation thread, see slab_memory.py), and unregistered before it is unmapped. Tensors viewing
it then answer ``is_pinned()`` with True and ``.cuda(non_blocking=True)`` copies from them
asynchronously, as from ``pin_memory()``'s own memory. The thread first makes the main thread's
current device its own, so that no CUDA context is made on another device.

Unlike torch's pinned-memory allocator, nothing here knows when an asynchronous copy has finished
reading a slab; :func:`release_marker` records a CUDA event on the current stream when a batch is
released, and a :class:`ReleaseWatcher` thread lands the release once that event has completed, so
that a worker granted the slab ahead of its release (see slab_pool.py) may write into it.

Only CUDA is handled (the one accelerator whose host-registration API torch exposes); elsewhere
these functions report that they did nothing and batches are pinned by copying, as before.
"""

from __future__ import annotations

import queue
import threading
from collections.abc import Callable
from typing import Any

import torch

WATCHER_JOIN_S = 5.0


def can_register() -> bool:
    """Whether slabs can be page-locked in place here (CUDA present)."""
    try:
        return bool(torch.cuda.is_available())
    except Exception:  # a broken driver install: pin by copying instead
        return False


def current_device() -> int:
    """The calling thread's current CUDA device, without initialising CUDA here: until CUDA is
    initialised no thread has chosen a device, and the first is the one torch will use. (Making
    the CUDA context takes a moment; the slab's preparation thread does it, not the loop's.)"""
    try:
        return int(torch.cuda.current_device()) if torch.cuda.is_initialized() else 0
    except Exception:
        return 0


def _use_device(device: int | None) -> None:
    if device is not None:
        try:
            torch.cuda.set_device(device)
        except Exception:
            pass


def register(address: int, nbytes: int, device: int | None = None) -> bool:
    """Page-lock ``nbytes`` at ``address`` for CUDA (from a thread whose device becomes
    ``device``); returns whether it worked."""
    _use_device(device)
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


def wait_for_marker(marker: Any) -> None:
    """Block until ``marker`` completes; a missing marker waits for the whole device."""
    try:
        if marker is None:
            torch.cuda.synchronize()
        else:
            marker.synchronize()  # releases the GIL while it waits
    except Exception:
        pass


class ReleaseWatcher:
    """Runs each release's callback once the copies before its marker are done, on one thread.

    ``submit`` may be called from any thread (release finalizers); the thread starts with the
    first submission. ``close`` waits for every submitted marker, runs the callbacks and ends the
    thread; submissions after it run inline. Callbacks run in submission order.

    Example:
        >>> watcher = ReleaseWatcher(device=0)  # doctest: +SKIP
        >>> watcher.submit(release_marker(), lambda: print("copies done"))  # doctest: +SKIP
        >>> watcher.close()  # doctest: +SKIP
    """

    def __init__(self, device: int | None) -> None:
        self._device = device
        self._queue: queue.SimpleQueue[tuple[Any, Callable[[], None]] | None] = queue.SimpleQueue()
        self._lock = threading.Lock()
        self._thread: threading.Thread | None = None
        self._closed = False

    def submit(self, marker: Any, done: Callable[[], None]) -> None:
        with self._lock:
            if not self._closed:
                if self._thread is None:
                    self._thread = threading.Thread(target=self._run, name="pipeload-pinned-release",
                                                    daemon=True)
                    self._thread.start()
                self._queue.put((marker, done))
                return
        wait_for_marker(marker)
        done()

    def _run(self) -> None:
        _use_device(self._device)
        while (entry := self._queue.get()) is not None:
            marker, done = entry
            wait_for_marker(marker)
            done()

    def close(self) -> None:
        """Land every submitted release, then stop the thread (idempotent)."""
        with self._lock:
            if self._closed:
                return
            self._closed = True
            thread = self._thread
            if thread is not None:
                self._queue.put(None)
        if thread is not None and thread.ident != threading.get_ident():  # see on_the_main_thread
            thread.join(WATCHER_JOIN_S)
