"""What every pooled engine does with an epoch's tasks and errors, by torch's rules.

- The sampler's own error ends the supply of tasks, and is raised where it happened: after every
  batch sent before it has been handed out; then the epoch is over.
- An error raised for one batch (dataset, collate_fn) propagates from ``next_batch`` and the epoch
  goes on. A timeout leaves everything as it was: asking again waits again. Anything else (a dead
  worker, a broken channel, Ctrl-C) closes the engine before it propagates.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import Any, NamedTuple, NoReturn

from pipeload.errors import LoaderTimeoutError
from pipeload.transport.messages import Report, WorkerReport


class NumberedBatch(NamedTuple):
    """A batch handed out out of order (``in_order=False``, map-style), with its number: which
    batches an epoch has handed out is then a set, not a count (``pipeload/resume``)."""

    batch: Any
    number: int


_BATCH_NUMBER = "_pipeload_batch_number"
_WORKER_ID = "_pipeload_worker_id"


def batch_number_of(error: BaseException) -> int | None:
    """The number of the batch whose building raised ``error``, when it was handed out out of
    order (None otherwise)."""
    return getattr(error, _BATCH_NUMBER, None)


def worker_of(error: BaseException) -> int | None:
    """The worker (0 without workers) whose building of a batch raised ``error``; None for an
    error that is not one batch's (a pin thread's, a dead worker)."""
    return getattr(error, _WORKER_ID, None)


def mark_worker(error: BaseException, worker_id: int) -> None:
    """Note that worker ``worker_id``'s building of a batch raised ``error``: an iterable
    replica's position counts the batch (``pipeload/resume``)."""
    setattr(error, _WORKER_ID, worker_id)


class TaskSupply:
    """An epoch's tasks, taken one at a time, with the sampler's error kept for its turn.

    Owned by the engine's driving thread. ``done`` turns True when the sampler is exhausted or
    has raised; a task may be None (an iterable dataset's placeholder), so check ``done``.
    """

    def __init__(self, tasks: Iterator[Any] | None = None) -> None:
        self._tasks: Iterator[Any] = tasks if tasks is not None else iter(())
        self.done = tasks is None
        self._error: Exception | None = None

    def take(self) -> Any:
        """The next task; None with ``done`` set once there are no more."""
        try:
            return next(self._tasks)
        except StopIteration:
            self.done = True
        except Exception as error:  # the sampler's own failure ends the supply of tasks
            self.done = True
            self._error = error
        return None

    @property
    def failed(self) -> bool:
        """Whether the sampler raised (and the error waits for its turn)."""
        return self._error is not None

    def end_epoch(self) -> NoReturn:
        """Raise StopIteration, or first the sampler's error if it failed."""
        error, self._error = self._error, None
        if error is None:
            raise StopIteration
        try:
            raise error
        finally:
            del error  # the traceback holds this frame: no cycle through the local


def hand_out(
    next_report: Callable[[], WorkerReport | None], close: Callable[[], None], supply: TaskSupply,
    numbered: bool = False, errored: Callable[[], None] = lambda: None,
) -> Any:
    """``next_batch`` for a pooled engine: the next report's batch, by the rules above.

    ``next_report`` returns the next report to hand out, or None once every batch sent has been
    handed out. ``numbered``: batches come out of order; each says its number (a
    :class:`NumberedBatch`, or the number attached to the error a failed one raises).
    ``errored`` is called before any error but the end of the epoch is raised (before ``close``
    when it closes): the error's traceback may keep the loader alive for as long as it is kept,
    so its workers' set must not leave shared memory behind for a next one.
    """
    try:
        report = next_report()
    except LoaderTimeoutError:
        errored()
        raise
    except BaseException:
        errored()
        close()
        raise
    if report is None:
        if supply.failed:
            errored()
        supply.end_epoch()
    if report.report is Report.FAILED:
        errored()
    if not numbered:
        return batch_or_raise(report)
    return NumberedBatch(batch_or_raise(report, numbered), report.batch_number)


def batch_or_raise(report: WorkerReport, numbered: bool = False) -> Any:
    """The batch a BATCH report carries; a FAILED report raises the worker's exception instead
    (carrying the batch's number when ``numbered``)."""
    if report.report is Report.FAILED:
        error = report.failure.to_exception()
        mark_worker(error, report.worker_id)
        if numbered:
            setattr(error, _BATCH_NUMBER, report.batch_number)
        try:
            raise error
        finally:
            del error  # the traceback holds this frame: no cycle through the local
    return report.payload
