"""The pin stage: sits after an engine and hands out batches already in pinned memory.

With workers, a thread pins batch N+1 while the training loop uses batch N, as torch's
pin-memory thread does; without workers, pinning happens inline. Only built when an accelerator
is present; otherwise the loader warns once and uses the engine as it is. Batches that process
workers wrote into page-locked slabs are pinned already and pass through without a copy (see
``pin.pin_memory``); custom batch types are still asked to pin themselves.
"""

from __future__ import annotations

import queue
import threading
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import torch

from pipeload._user_frame import UserSite, lend_user_site, user_site
from pipeload.errors import RemoteFailure
from pipeload.pin import pin_memory
from pipeload.stats.clock import now, profiling, span

POLL_INTERVAL_S = 0.1
PINNED_AHEAD = 2
CLOSE_JOIN_S = 2.0


def _timed_pin(batch: Any, device: str | None, stats: Any) -> Any:
    """``pin_memory``, timed into the loader's StatsRecorder when stats are on."""
    if stats is None:
        return pin_memory(batch, device)
    started = now()
    if profiling():
        with span("pipeload.pin"):
            pinned = pin_memory(batch, device)
    else:
        pinned = pin_memory(batch, device)
    stats.pinned(now() - started)
    return pinned


class InlinePinning:
    """Pins each batch in the calling thread."""

    def __init__(self, engine: Any, device: str | None, stats: Any = None) -> None:
        self._engine = engine
        self._device = device
        self._stats = stats

    workers = property(lambda self: self._engine.workers)
    closed = property(lambda self: self._engine.closed)

    def start_epoch(self, tasks: Iterator[Any], shared_seed: int | None = None, **start: Any) -> None:
        self._engine.start_epoch(tasks, shared_seed, **start)

    def next_batch(self) -> Any:
        return _timed_pin(self._engine.next_batch(), self._device, self._stats)

    def close(self) -> None:
        self._engine.close()


@dataclass(frozen=True)
class _Outcome:
    """What the pin thread hands over: a pinned batch, the end of the epoch, or an error.

    ``last`` marks an error after which the thread stops (one that is not an Exception).
    """

    batch: Any = None
    ended: bool = False
    error: BaseException | None = None
    last: bool = False


class ThreadedPinning:
    """A thread drives the engine and pins ahead; ``next_batch`` takes from it.

    An error is handed over in the batch's place and the thread carries on, as torch's pin
    thread does: one batch's error leaves the epoch running; an error that ended the epoch has
    closed the engine, whose next answer is the end of the epoch.

    Invariant: while an epoch's pin thread runs, only that thread touches the engine; the main
    thread touches the engine only after joining it (``start_epoch``), or to close it, which is
    what wakes a pin thread waiting on the workers.
    """

    def __init__(self, engine: Any, device: str | None, stats: Any = None) -> None:
        self._engine = engine
        self._device = device
        self._stats = stats
        self._device_index = _current_device_index()
        self._thread: threading.Thread | None = None
        self._stop = threading.Event()
        self._pinned: queue.Queue[_Outcome] = queue.Queue(maxsize=PINNED_AHEAD)
        self._finished = True  # no epoch is running: next_batch answers StopIteration

    workers = property(lambda self: self._engine.workers)
    closed = property(lambda self: self._engine.closed)

    @property
    def thread(self) -> threading.Thread | None:
        """The pin thread of the current epoch (torch's ``_pin_memory_thread``)."""
        return self._thread

    def start_epoch(self, tasks: Iterator[Any], shared_seed: int | None = None, **start: Any) -> None:
        self._stop_thread()
        self._engine.start_epoch(tasks, shared_seed, **start)
        self._stop = threading.Event()
        self._pinned = queue.Queue(maxsize=PINNED_AHEAD)
        self._finished = False
        self._thread = threading.Thread(
            target=self._pin_ahead, args=(self._stop, self._pinned, user_site()), name="pipeload-pin",
            daemon=True,
        )
        self._thread.start()

    def next_batch(self) -> Any:
        outcome = self._take()
        if outcome.ended:
            raise StopIteration
        if outcome.error is None:
            return outcome.batch
        error = outcome.error
        del outcome
        try:
            raise error
        finally:
            del error  # the traceback holds this frame: no cycle through the local

    def close(self) -> None:
        # Stop the workers first: the pin thread may be waiting on them, and closing the engine
        # is what ends that wait promptly (Ctrl-C, errors), rather than the next batch arriving.
        self._finished = True
        self._stop.set()
        self._engine.close()
        if self._thread is not None:
            self._thread.join(CLOSE_JOIN_S)
            self._thread = None

    def _take(self) -> _Outcome:
        if self._finished:
            return _Outcome(ended=True)
        while True:
            try:
                outcome = self._pinned.get(timeout=POLL_INTERVAL_S)
            except queue.Empty:
                if self._thread is None or not self._thread.is_alive():
                    self.close()
                    raise RuntimeError(
                        "Pin memory thread exited unexpectedly (pipeload: the pin thread ended "
                        "without handing over the end of the epoch)"
                    ) from None
                continue
            self._finished = outcome.ended or outcome.last
            return outcome

    def _pin_ahead(self, stop: threading.Event, pinned: queue.Queue, site: UserSite | None) -> None:
        lend_user_site(site)  # what the engine warns of here points at the user's iter(loader)
        while not stop.is_set():
            outcome = self._pin_next()
            delivered = _put_unless_stopped(pinned, outcome, stop)
            if not delivered or outcome.ended or outcome.last:
                return

    def _pin_next(self) -> _Outcome:
        try:
            batch = self._engine.next_batch()
        except StopIteration:
            return _Outcome(ended=True)
        except Exception as exc:
            return _Outcome(error=exc)
        except BaseException as exc:  # SystemExit from user code, say: nothing sensible follows
            return _Outcome(error=exc, last=True)
        try:
            return _Outcome(batch=_timed_pin(batch, self._device, self._stats))
        except Exception:
            # torch's pin thread wraps the error in its own sentence and carries on.
            where = f"in pin memory thread for device {self._device_index}"
            failure = RemoteFailure.capture(-1, "pinning a batch", where=where)
            return _Outcome(error=failure.to_exception())

    def _stop_thread(self) -> None:
        if self._thread is not None:
            self._stop.set()
            self._thread.join()
            self._thread = None


def _current_device_index() -> int:
    """The accelerator device torch's pin thread would name in its error messages."""
    try:
        return int(torch.accelerator.current_device_index())
    except (AttributeError, RuntimeError):
        return 0


def _put_unless_stopped(pinned: queue.Queue, outcome: _Outcome, stop: threading.Event) -> bool:
    while not stop.is_set():
        try:
            pinned.put(outcome, timeout=POLL_INTERVAL_S)
            return True
        except queue.Full:
            continue
    return False
