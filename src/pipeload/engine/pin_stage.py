"""The pin stage: sits after an engine and hands out batches already in pinned memory.

With workers, a thread pins batch N+1 while the training loop uses batch N, as torch's
pin-memory thread does; without workers, pinning happens inline. Only built when an accelerator
is present; otherwise the loader warns once and uses the engine as it is.
"""

from __future__ import annotations

import queue
import threading
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

from pipeload.pin import pin_memory

POLL_INTERVAL_S = 0.1
PINNED_AHEAD = 2
CLOSE_JOIN_S = 2.0


class InlinePinning:
    """Pins each batch in the calling thread."""

    def __init__(self, engine: Any, device: str | None) -> None:
        self._engine = engine
        self._device = device

    workers = property(lambda self: self._engine.workers)
    closed = property(lambda self: self._engine.closed)

    def start_epoch(self, tasks: Iterator[Any]) -> None:
        self._engine.start_epoch(tasks)

    def next_batch(self) -> Any:
        return pin_memory(self._engine.next_batch(), self._device)

    def close(self) -> None:
        self._engine.close()


@dataclass(frozen=True)
class _Outcome:
    """What the pin thread hands over: a pinned batch, the end of the epoch, or an error."""

    batch: Any = None
    ended: bool = False
    error: BaseException | None = None


class ThreadedPinning:
    """A thread drives the engine and pins ahead; ``next_batch`` takes from it.

    Invariant: while an epoch's pin thread runs, only that thread touches the engine; the main
    thread touches the engine only after joining it (``start_epoch``, ``close``).
    """

    def __init__(self, engine: Any, device: str | None) -> None:
        self._engine = engine
        self._device = device
        self._thread: threading.Thread | None = None
        self._stop = threading.Event()
        self._pinned: queue.Queue[_Outcome] = queue.Queue(maxsize=PINNED_AHEAD)

    workers = property(lambda self: self._engine.workers)
    closed = property(lambda self: self._engine.closed)

    def start_epoch(self, tasks: Iterator[Any]) -> None:
        self._stop_thread()
        self._engine.start_epoch(tasks)
        self._stop = threading.Event()
        self._pinned = queue.Queue(maxsize=PINNED_AHEAD)
        self._thread = threading.Thread(
            target=self._pin_ahead, args=(self._stop, self._pinned), name="pipeload-pin", daemon=True
        )
        self._thread.start()

    def next_batch(self) -> Any:
        while True:
            try:
                outcome = self._pinned.get(timeout=POLL_INTERVAL_S)
            except queue.Empty:
                if self._thread is None or not self._thread.is_alive():
                    raise RuntimeError("pin memory thread exited unexpectedly") from None
                continue
            if outcome.error is not None:
                raise outcome.error
            if outcome.ended:
                raise StopIteration
            return outcome.batch

    def close(self) -> None:
        # Stop the workers first: the pin thread may be waiting on them, and closing the engine
        # is what ends that wait promptly (Ctrl-C, errors), rather than the next batch arriving.
        self._stop.set()
        self._engine.close()
        if self._thread is not None:
            self._thread.join(CLOSE_JOIN_S)
            self._thread = None

    def _pin_ahead(self, stop: threading.Event, pinned: queue.Queue) -> None:
        while not stop.is_set():
            try:
                outcome = _Outcome(batch=pin_memory(self._engine.next_batch(), self._device))
            except StopIteration:
                outcome = _Outcome(ended=True)
            except BaseException as exc:  # handed to the main thread, which raises it
                outcome = _Outcome(error=exc)
            delivered = _put_unless_stopped(pinned, outcome, stop)
            if not delivered or outcome.ended or outcome.error is not None:
                return

    def _stop_thread(self) -> None:
        if self._thread is not None:
            self._stop.set()
            self._thread.join()
            self._thread = None


def _put_unless_stopped(pinned: queue.Queue, outcome: _Outcome, stop: threading.Event) -> bool:
    while not stop.is_set():
        try:
            pinned.put(outcome, timeout=POLL_INTERVAL_S)
            return True
        except queue.Full:
            continue
    return False
