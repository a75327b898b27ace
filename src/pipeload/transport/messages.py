"""Typed messages between the main process and its workers, and between economic-mode workers.

Commands go main -> worker on that worker's own task channel; reports come back worker -> main on
the result channel. In economic mode, item workers also hand fetched items straight to a batch
worker as :class:`ItemDelivery` messages (never through the main process). No bare tuples, no
sentinel objects: the enums say what each message is.
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
    FETCH_ITEMS = 4
    """Economic mode, to an item worker: fetch ``indices`` (one piece of batch ``batch_number`` of
    epoch ``epoch``), hand them to the batch worker that ``route`` names, report ``ITEMS_DONE``."""
    COLLATE = 5
    """Economic mode, to a batch worker: batch ``batch_number`` of epoch ``epoch`` holds
    ``indices``; gather its items from the item workers, collate them, report the batch."""


@dataclass(frozen=True, slots=True)
class ItemRoute:
    """Where the items of one ``FETCH_ITEMS`` go, and which seed their fetch uses.

    Attributes:
        batch_worker: the id of the batch worker that gathers this batch.
        slot: the position of the piece's first item inside its batch.
        position: the position of the piece's first item in the epoch's sample stream; the
            item's random seed derives from it (see ``worker_info.item_seed``).
    """

    batch_worker: int
    slot: int
    position: int


@dataclass(frozen=True, slots=True)
class WorkerCommand:
    command: Command
    batch_number: int = -1
    indices: Any = None
    epoch: int = 0
    shared_seed: int | None = None
    route: ItemRoute | None = None  # FETCH_ITEMS only


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
    ITEMS_DONE = 5
    """Economic mode: an item worker has handed over (or failed) ``payload`` items of batch
    ``batch_number``; the main process counts them off that worker's load."""


@dataclass(frozen=True, slots=True)
class WorkerReport:
    report: Report
    worker_id: int
    batch_number: int
    payload: Any = None
    totals: Any = None
    """The sending worker's running totals when stats are on: a plain tuple in the order of
    ``pipeload.stats.clock.WorkerTotals``."""

    @property
    def failure(self) -> RemoteFailure:
        assert self.report is Report.FAILED
        return self.payload


class Delivery(enum.IntEnum):
    """What an item worker hands a batch worker (economic mode)."""

    ITEMS = 1
    """``payload`` is the list of fetched samples, in order, for ``count`` slots from ``slot``."""
    FAILED = 2
    """Fetching those ``count`` samples raised; ``payload`` is a :class:`RemoteFailure`."""


@dataclass(frozen=True, slots=True)
class ItemDelivery:
    """Items of one piece of a batch, on their way from an item worker to a batch worker.

    Attributes:
        delivery: whether the items came, or why they did not.
        item_worker: the id of the item worker that fetched them.
        epoch: the epoch they belong to; a batch worker drops deliveries of an earlier epoch
            (left over from an epoch the user broke out of).
        batch_number: the batch they belong to.
        slot: the position of the first of them inside the batch.
        count: how many slots of the batch they fill.
        payload: the samples, or a :class:`RemoteFailure`.
    """

    delivery: Delivery
    item_worker: int
    epoch: int
    batch_number: int
    slot: int
    count: int
    payload: Any = None
