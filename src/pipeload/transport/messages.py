"""Typed messages between the main process and its workers.

Commands go main -> worker on that worker's own task channel; reports come back worker -> main on
the result channel. No bare tuples, no sentinel objects: the enums say what each message is.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass
from typing import Any

from pipeload.errors import RemoteFailure


class Command(enum.IntEnum):
    """What the main process asks of a worker."""

    FETCH = 1
    """Build batch ``batch_number`` from ``indices`` and report it."""
    START_EPOCH = 2
    """A persistent worker begins epoch ``epoch``: reseed its dataset's random pipes with
    ``shared_seed`` (when given), restart its fetcher and acknowledge."""
    STOP = 3
    """Finish now and exit; nothing more will be asked."""


@dataclass(frozen=True, slots=True)
class WorkerCommand:
    command: Command
    batch_number: int = -1
    indices: Any = None
    epoch: int = 0
    shared_seed: int | None = None


class Report(enum.IntEnum):
    """What a worker tells the main process."""

    BATCH = 1
    """``payload`` is batch ``batch_number``."""
    FAILED = 2
    """Building batch ``batch_number`` raised; ``payload`` is a :class:`RemoteFailure`."""
    EXHAUSTED = 3
    """This worker's iterable replica ran dry at ``batch_number``; it will send no more batches."""
    EPOCH_STARTED = 4
    """Acknowledges ``START_EPOCH`` for epoch ``batch_number``; earlier reports are all sent."""


@dataclass(frozen=True, slots=True)
class WorkerReport:
    report: Report
    worker_id: int
    batch_number: int
    payload: Any = None

    @property
    def failure(self) -> RemoteFailure:
        assert self.report is Report.FAILED
        return self.payload
