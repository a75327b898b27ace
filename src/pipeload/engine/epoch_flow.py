"""What every pooled engine does with an epoch's tasks and errors, by torch's rules.

- The sampler's own error ends the supply of tasks, and is raised where it happened: after every
  batch sent before it has been handed out; then the epoch is over.
- An error raised for one batch (dataset, collate_fn) propagates from ``next_batch`` and the epoch
  goes on. A timeout leaves everything as it was: asking again waits again. Anything else (a dead
  worker, a broken channel, Ctrl-C) closes the engine before it propagates.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import Any, NoReturn

from pipeload.errors import LoaderTimeoutError
from pipeload.transport.messages import Report, WorkerReport


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
    next_report: Callable[[], WorkerReport | None], close: Callable[[], None], supply: TaskSupply
) -> Any:
    """``next_batch`` for a pooled engine: the next report's batch, by the rules above.

    ``next_report`` returns the next report to hand out, or None once every batch sent has been
    handed out.
    """
    try:
        report = next_report()
    except LoaderTimeoutError:
        raise
    except BaseException:
        close()
        raise
    if report is None:
        supply.end_epoch()
    return batch_or_raise(report)


def batch_or_raise(report: WorkerReport) -> Any:
    """The batch a BATCH report carries; a FAILED report raises the worker's exception instead."""
    if report.report is Report.FAILED:
        raise report.failure.to_exception()
    return report.payload
