"""The pool engine: N workers (processes or threads), each builds whole batches, as torch does.

One instance serves one epoch, or every epoch of a loader with ``persistent_workers=True``.
"""

from __future__ import annotations

import multiprocessing
import time
import weakref
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

from pipeload.engine.lifecycle import (
    ThreadWorkerHandle,
    check_picklable,
    release_finished,
    start_process_workers,
    start_thread_workers,
    stop_workers,
)
from pipeload.engine.plan import WorkerSetup
from pipeload.engine.reorder import BatchLedger
from pipeload.errors import LoaderTimeoutError, WorkerDiedError, worker_died_message
from pipeload.transport.channel import ProcessChannels, ThreadChannels
from pipeload.transport.messages import Command, Report, WorkerCommand, WorkerReport

WAIT_SLICE_S = 1.0
EXIT_STATUS_WAIT_S = 1.0
THREAD_CHECK_INTERVAL_S = 0.1


@dataclass(frozen=True)
class PoolConfig:
    """How to run the pool.

    Attributes:
        setup: what every worker needs to start.
        prefetch_factor: batches in flight per worker.
        in_order: yield in sampler order (True) or as batches finish (False).
        timeout_s: raise if no batch arrives for this long (0: wait as long as workers live);
            kept as the user gave it, since the timeout message prints it as torch does.
        worker_type: "process" or "thread".
        mp_context: a multiprocessing context (process workers), or None for the default.
    """

    setup: WorkerSetup
    prefetch_factor: int
    in_order: bool
    timeout_s: float
    worker_type: str
    mp_context: Any


class _Workers:
    """Owns the worker handles and channels; closing it stops and releases everything.

    Kept apart from the engine so the engine's finalizer can hold it without holding the engine.
    """

    def __init__(self, config: PoolConfig) -> None:
        setup = config.setup
        self.stop_event = None
        if config.worker_type == "thread":
            self.channels: Any = ThreadChannels(setup.num_workers)
            self.handles, self.stop_event = start_thread_workers(setup, self.channels)
        else:
            ctx = config.mp_context or multiprocessing.get_context()
            if ctx.get_start_method() != "fork":
                check_picklable(_picklable_parts(setup), ctx.get_start_method())
            self.channels = ProcessChannels(ctx, setup.num_workers)
            try:
                self.handles = start_process_workers(ctx, setup, self.channels)
            except BaseException:
                self.channels.close()
                raise
        self.closed = False

    @property
    def wait_slice_s(self) -> float:
        # Process deaths wake the wait through their sentinels; threads have none, so look often.
        return THREAD_CHECK_INTERVAL_S if self.stop_event is not None else WAIT_SLICE_S

    def sentinels(self) -> list[int]:
        """Exit sentinels of the process workers (empty for threads)."""
        return [h.sentinel for h in self.handles if getattr(h, "sentinel", None) is not None]

    def all_alive(self) -> bool:
        if self.stop_event is None:
            return True  # process deaths are reported by their sentinels, without a syscall each
        return all(handle.is_alive() for handle in self.handles)

    def close(self) -> None:
        if self.closed:
            return
        self.closed = True
        if self.stop_event is not None:
            self.stop_event.set()
        stop_workers(self.handles, self._ask_to_stop, force=self.stop_event is None)
        self.channels.close()
        release_finished(self.handles)

    def _ask_to_stop(self, worker_id: int) -> None:
        try:
            self.channels.send(worker_id, WorkerCommand(Command.STOP), while_full=_give_up)
        except _PipeFull:
            pass  # a worker that is not reading is stopped by the escalation instead


class _PipeFull(Exception):
    """Closing never waits for room in a task pipe."""


def _give_up() -> None:
    raise _PipeFull


def _picklable_parts(setup: WorkerSetup) -> dict[str, Any]:
    return {
        "dataset": setup.fetch.dataset,
        "collate_fn": setup.fetch.collate_fn,
        "worker_init_fn": setup.worker_init_fn,
    }


class PoolEngine:
    """Sends tasks round-robin to workers, keeps ``prefetch_factor * num_workers`` in flight,
    and yields the results in sampler order (or as they finish with ``in_order=False``).

    Driven by one thread at a time (the caller of ``next_batch``).
    Invariants, between calls: ``_unsent`` is a task taken from the sampler whose send timed out
    (it goes out first next time, to the same worker); ``_sampler_error`` is what the sampler
    raised, kept until every batch sent before it has been yielded.
    """

    def __init__(self, config: PoolConfig) -> None:
        self._config = config
        self._max_outstanding = config.prefetch_factor * config.setup.num_workers
        self._workers = _Workers(config)
        self._finalizer = weakref.finalize(self, self._workers.close)
        self._epoch = 0
        self._ledger = BatchLedger(config.setup.num_workers, config.in_order)
        self._tasks: Iterator[Any] = iter(())
        self._sampler_done = True
        self._unsent: tuple[int, Any] | None = None
        self._sampler_error: Exception | None = None

    @property
    def workers(self) -> list[Any]:
        return self._workers.handles

    @property
    def closed(self) -> bool:
        return self._workers.closed

    def start_epoch(self, tasks: Iterator[Any], shared_seed: int | None = None) -> None:
        """Begin an epoch over ``tasks`` (each a list of indices, or one index).

        ``shared_seed`` reseeds the workers' DataPipe graphs for a persistent session's new epoch.
        """
        if self._epoch > 0:
            self._restart_workers_epoch(shared_seed)
        self._epoch += 1
        self._tasks = tasks
        self._sampler_done = False
        self._unsent = None
        self._sampler_error = None
        self._ledger = BatchLedger(self._config.setup.num_workers, self._config.in_order)
        self._top_up()

    def next_batch(self) -> Any:
        """The next batch; raises StopIteration when the epoch is over.

        A batch whose building raised (dataset, collate_fn, an iterable's ``__next__``) raises
        that error here and the epoch goes on: the next call returns the next batch, as torch
        does. A timeout also leaves everything as it was (asking again waits again). Anything
        else (a dead worker, a broken channel, Ctrl-C) closes the engine before it propagates:
        the epoch is over, and the next call raises StopIteration.
        """
        try:
            report = self._next_report()
        except LoaderTimeoutError:
            raise
        except BaseException:
            self.close()
            raise
        if report is None:
            self._end_epoch()
        return _unwrap(report)

    def close(self) -> None:
        self._finalizer()
        # A closed engine can live on for a long time (an exception's traceback holds it): drop
        # the batches it still holds, so their shared memory is freed now, and end the epoch.
        self._ledger = BatchLedger(self._config.setup.num_workers, self._config.in_order)
        self._tasks = iter(())
        self._sampler_done = True
        self._unsent = None
        self._sampler_error = None

    def _next_report(self) -> WorkerReport | None:
        """The next report to hand out, or None once every batch sent has been handed out."""
        # No local alias of the ledger: a raised error's traceback keeps this frame, and
        # close() must be able to let go of the batches the ledger holds.
        while True:
            report = self._ledger.pop_ready()
            if report is not None:
                try:
                    self._top_up()
                except LoaderTimeoutError:
                    pass  # a worker's task pipe stayed full; the task is sent on the next call
                return report
            if self._ledger.nothing_left():
                return None
            for report in self._receive():
                if report.report is not Report.EPOCH_STARTED:
                    self._ledger.record_report(report)
            self._top_up()

    def _end_epoch(self) -> None:
        """Raise StopIteration, or first the sampler's error if it failed: it comes where the
        sampler failed, after every batch sent before it, and the epoch ends there."""
        error, self._sampler_error = self._sampler_error, None
        if error is None:
            raise StopIteration
        try:
            raise error
        finally:
            del error  # the traceback holds this frame: no cycle through the local

    def _top_up(self) -> None:
        ledger = self._ledger
        while not self._sampler_done and ledger.outstanding < self._max_outstanding:
            if self._unsent is None:
                worker_id = ledger.choose_worker()
                if worker_id is None:
                    return
                indices = self._next_task()
                if self._sampler_done:
                    return
                self._unsent = (worker_id, indices)
            worker_id, indices = self._unsent
            self._send(worker_id, WorkerCommand(Command.FETCH, ledger.next_to_send, indices))
            self._unsent = None
            ledger.record_sent(worker_id)

    def _next_task(self) -> Any:
        try:
            return next(self._tasks)
        except StopIteration:
            self._sampler_done = True
        except Exception as error:  # the sampler's own failure ends the supply of tasks
            self._sampler_done = True
            self._sampler_error = error
        return None

    def _send(self, worker_id: int, command: WorkerCommand) -> None:
        try:
            self._workers.channels.send(worker_id, command, self._while_pipe_full(worker_id))
        except (BrokenPipeError, ConnectionResetError, EOFError):
            # The worker's end closed because it is dying; its exit status comes a moment later.
            handle = self._workers.handles[worker_id]
            handle.join(EXIT_STATUS_WAIT_S)
            self._raise_for_dead_workers()
            raise WorkerDiedError(
                f"DataLoader worker (pid(s) {handle.pid}) exited unexpectedly: worker {worker_id} "
                "stopped reading its tasks"
            ) from None

    def _while_pipe_full(self, worker_id: int) -> Callable[[], None]:
        """What to check while a worker's task pipe is full: that it lives, and the timeout."""
        timeout_s = self._config.timeout_s
        deadline = time.monotonic() + timeout_s if timeout_s > 0 else None
        handle = self._workers.handles[worker_id]

        def check() -> None:
            if not handle.is_alive():
                self._raise_for_dead_workers()
            if deadline is not None and time.monotonic() >= deadline:
                raise LoaderTimeoutError(
                    f"DataLoader timed out after {timeout_s} seconds: worker {worker_id} "
                    "is not taking new tasks"
                )

        return check

    def _receive(self) -> list[WorkerReport]:
        """Wait for reports; raise on timeout or as soon as any worker has died."""
        timeout_s = self._config.timeout_s
        deadline = time.monotonic() + timeout_s if timeout_s > 0 else None
        while True:
            slice_s = self._workers.wait_slice_s
            if deadline is not None:
                slice_s = min(slice_s, max(0.0, deadline - time.monotonic()))
            reports, fired = self._workers.channels.wait(slice_s, self._workers.sentinels())
            if fired or not self._workers.all_alive():
                reports.clear()  # about to raise: the traceback keeps this frame and its batches
                self._raise_for_dead_workers()
            if reports:
                return reports
            if deadline is not None and time.monotonic() >= deadline:
                raise LoaderTimeoutError(f"DataLoader timed out after {timeout_s} seconds")

    def _raise_for_dead_workers(self) -> None:
        dead = []
        for worker_id, handle in enumerate(self._workers.handles):
            if not handle.is_alive():
                handle.join(0.1)  # reap it, so its exit code is known
                dead.append((worker_id, handle))
        if not dead:
            return
        if isinstance(dead[0][1], ThreadWorkerHandle):
            raise WorkerDiedError("DataLoader " + "; ".join(_how_thread_ended(w) for w, _ in dead))
        raise WorkerDiedError(worker_died_message([(w, h.pid, h.exitcode) for w, h in dead]))

    def _restart_workers_epoch(self, shared_seed: int | None) -> None:
        """Persistent workers: finish the old epoch's leftovers, then start a fresh one."""
        epoch = self._epoch + 1
        start = WorkerCommand(Command.START_EPOCH, epoch=epoch, shared_seed=shared_seed)
        for worker_id in range(self._config.setup.num_workers):
            self._send(worker_id, start)
        waiting = set(range(self._config.setup.num_workers))
        while waiting:
            for report in self._receive():
                if report.report is Report.EPOCH_STARTED and report.batch_number == epoch:
                    waiting.discard(report.worker_id)


def _how_thread_ended(worker_id: int) -> str:
    return (f"worker thread {worker_id} ended unexpectedly: something that is not an "
            "Exception (SystemExit, for example) escaped the dataset or collate code")


def _unwrap(report: WorkerReport) -> Any:
    if report.report is Report.FAILED:
        raise report.failure.to_exception()
    return report.payload
