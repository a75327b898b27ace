"""Typed messages between the main process and its workers, and between economic-mode workers.

Commands go main -> worker on that worker's own task channel; reports come back worker -> main on
the result channel. In economic mode, item workers also hand fetched items straight to a batch
worker as :class:`ItemDelivery` messages (never through the main process). No bare tuples, no
sentinel objects: the enums say what each message is. Slab controls go the other way on a
result channel (main -> worker), and on an item link (batch worker -> item worker). The two
messages of every batch (:class:`WorkerCommand`, :class:`WorkerReport`) are named tuples, the
rest frozen dataclasses.

Every message pickles as one call with positional arguments, its enums as plain ints
(``__reduce__``): the default for slotted dataclasses goes through ``copyreg`` and
``__setstate__``, and each enum member through ``EnumType.__call__``, which together cost more
than the rest of a tiny batch's trip.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass
from typing import Any, NamedTuple

from pipeload.errors import RemoteFailure


class Command(enum.IntEnum):
    """What the main process asks of a worker."""

    FETCH = 1
    """Build batch ``batch_number`` from ``indices`` and report it."""
    START_EPOCH = 2
    """A persistent worker begins epoch ``epoch``: reseed its dataset's random pipes with
    ``shared_seed`` (when given), restart its fetcher and acknowledge. ``batch_number``: the
    epoch's last batch number where the sampler tells it (-1 otherwise), which a classic
    worker's stats time (it may be short: see ``WorkerSetup.batch_sizes``)."""
    STOP = 3
    """Finish now and exit; nothing more will be asked."""
    FETCH_ITEMS = 4
    """Economic mode, to an item worker: fetch ``indices`` (one piece of batch ``batch_number`` of
    epoch ``epoch``), hand them to the batch worker that ``route`` names, report ``ITEMS_DONE``."""
    COLLATE = 5
    """Economic mode, to a batch worker: batch ``batch_number`` of epoch ``epoch`` holds
    ``indices``; gather its items from the item workers, collate them, report the batch."""
    LAST_BATCH = 6
    """A classic worker's first epoch ends with batch ``batch_number``, which its stats time:
    the workers started before the sampler's length was asked (``samplers/_lengths.py``)."""


@dataclass(frozen=True, slots=True)
class ItemRoute:
    """Where the items of one ``FETCH_ITEMS`` go, and which seed their fetch uses.

    Attributes:
        batch_worker: the id of the batch worker that gathers this batch.
        slot: the position of the piece's first item inside its batch.
        position: the position of the piece's first item in the epoch's sample stream; the
            item's random seed derives from it (see ``worker_info.item_seed``).
        direct: the main process assembles this batch itself (engine/direct_batches.py): the
            items go into the batch's slab and their description back with ``ITEMS_DONE``, not
            to a batch worker.
    """

    batch_worker: int
    slot: int
    position: int
    direct: bool = False

    def __reduce__(self) -> Any:
        return (ItemRoute, (self.batch_worker, self.slot, self.position, self.direct))


@dataclass(frozen=True, slots=True)
class ItemPlacement:
    """Where each item of one batch goes inside the batch's slab (economic mode).

    The items' large tensors ("leaves", in the order the codec meets them) are laid out leaf by
    leaf, as the stacked batch will be: item ``i``'s leaf ``k`` sits at
    ``leaf_offsets[k] + i * leaf_bytes[k]``, so a batch worker's stack of them is a view, not a
    copy. The item area ends at ``area_bytes``; a batch worker puts anything else after it.

    Attributes:
        leaf_offsets: where each leaf's run of items starts in the slab.
        leaf_bytes: the size of one item's leaf (items whose sizes differ are not placed).
        area_bytes: the end of the item area.
        first_item: for an item worker, the place in the batch of its piece's first item.
    """

    leaf_offsets: tuple[int, ...]
    leaf_bytes: tuple[int, ...]
    area_bytes: int
    first_item: int = 0

    def __reduce__(self) -> Any:
        return (ItemPlacement, (self.leaf_offsets, self.leaf_bytes, self.area_bytes, self.first_item))


@dataclass(frozen=True, slots=True)
class SlabGrant:
    """Permission to write one message's tensors into slab ``slab_id``.

    Attributes:
        slab_id: the slab (already announced to this producer by a ``MAP`` control).
        releases: write only once the release board shows at least this count for the slab, i.e.
            once every batch that viewed it before has been freed by the consumer.
        controls: how many slab controls the producer must have applied first (they travel on
            another channel and may still be in flight when the grant arrives).
        items: economic mode: where the batch's items go in the slab (None: nowhere special).
    """

    slab_id: int
    releases: int
    controls: int
    items: ItemPlacement | None = None

    def __reduce__(self) -> Any:
        return (SlabGrant, (self.slab_id, self.releases, self.controls, self.items))


class WorkerCommand(NamedTuple):
    """One command to a worker (see :class:`Command` for what each field means per command).

    A named tuple rather than a frozen dataclass, like :class:`WorkerReport`: one is built on
    each side of the task pipe for every batch, and a frozen dataclass's ``__init__`` (one
    ``object.__setattr__`` per field) costs three times as much.
    """

    command: Command
    batch_number: int = -1
    indices: Any = None
    epoch: int = 0
    shared_seed: int | None = None
    route: ItemRoute | None = None  # FETCH_ITEMS only
    grant: SlabGrant | None = None

    def __reduce__(self) -> Any:
        return (_command, (int(self.command), self.batch_number, self.indices, self.epoch,
                           self.shared_seed, self.route, self.grant))


def command_to_wire(command: WorkerCommand) -> Any:
    """What the task pipe carries for ``command``: the two commonest as plain tuples, which
    pickle (and unpickle) without looking up a single global; any other command as itself.

    - a ``FETCH`` (classic mode, once per batch): ``(batch_number, indices, grant fields or
      None)``;
    - a ``FETCH_ITEMS`` (economic mode, once per piece: two or more per worker and batch, each
      handled by the main process, which every batch waits for): ``(batch_number, indices,
      epoch, route fields, grant fields or None)``, the grant's item placement as its fields.
    """
    kind = command.command
    if kind is Command.FETCH_ITEMS and command.shared_seed is None and command.route is not None:
        route, grant = command.route, command.grant
        return (command.batch_number, command.indices, command.epoch,
                (route.batch_worker, route.slot, route.position, route.direct),
                None if grant is None else _grant_fields(grant))
    if kind is not Command.FETCH or command.epoch or command.shared_seed is not None or command.route is not None:
        return command
    grant = command.grant
    fields = None if grant is None else (grant.slab_id, grant.releases, grant.controls)
    return (command.batch_number, command.indices, fields)


def _grant_fields(grant: SlabGrant) -> tuple[Any, ...]:
    items = grant.items
    placement = None if items is None else (items.leaf_offsets, items.leaf_bytes, items.area_bytes,
                                            items.first_item)
    return (grant.slab_id, grant.releases, grant.controls, placement)


def command_from_wire(message: Any) -> WorkerCommand:
    """The command :func:`command_to_wire` sent."""
    if type(message) is not tuple:
        return message
    if len(message) == 3:
        number, indices, fields = message
        return WorkerCommand(Command.FETCH, number, indices,
                             grant=None if fields is None else SlabGrant(*fields))
    number, indices, epoch, route, fields = message
    grant = None
    if fields is not None:
        slab_id, releases, controls, placement = fields
        grant = SlabGrant(slab_id, releases, controls, None if placement is None else ItemPlacement(*placement))
    return WorkerCommand(Command.FETCH_ITEMS, number, indices, epoch, None, ItemRoute(*route), grant)


def _command(command: int, batch_number: int, indices: Any, epoch: int, shared_seed: int | None,
             route: ItemRoute | None, grant: SlabGrant | None) -> WorkerCommand:
    return WorkerCommand(_COMMANDS[command], batch_number, indices, epoch, shared_seed, route, grant)


class GrantOutcome(enum.IntEnum):
    """What a producer did with the slab it was granted for a message."""

    NO_GRANT = 0
    """No slab was granted."""
    USED = 1
    """Some of the message's tensors are in the slab."""
    UNUSED = 2
    """Nothing needed it (small or no tensors); the slab is free again."""
    BUSY = 3
    """The producer itself still holds tensors viewing the slab (user code kept a batch): it must
    not be granted again."""
    LATE = 4
    """The batch that viewed the slab before was not freed in time; the producer used fresh memory."""


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
    """Economic mode: an item worker has handed over (or failed) a piece of batch
    ``batch_number``; the main process counts it off that worker's load. ``payload`` is an
    :class:`ItemsDone`."""


class WorkerReport(NamedTuple):
    """What a worker says about one task (see :class:`Report`).

    A named tuple (immutable, fields by name) rather than a frozen dataclass: every batch builds
    one in the worker and one in the main process, and a frozen dataclass costs about 1 us
    more each time, a measurable share of a tiny batch's whole trip.
    """

    report: Report
    worker_id: int
    batch_number: int
    payload: Any = None
    totals: Any = None
    """The sending worker's running totals when stats are on: a plain tuple in the order of
    ``pipeload.stats.clock.WorkerTotals``."""
    build_s: float = 0.0
    """Seconds the worker spent fetching and collating the batch, set-up excluded."""
    setup_s: float = 0.0
    """Seconds it spent setting up shared memory for it (a new slab's pages, fresh buffers)."""
    finished_at: float = 0.0
    """When the batch was ready to send, on ``time.monotonic()``'s clock (one clock for every
    process of a machine), 0.0 if not said: economic mode times the pool's builds with it."""

    def __reduce__(self) -> Any:
        return (_report, (int(self.report), self.worker_id, self.batch_number, self.payload,
                          self.totals, self.build_s, self.setup_s, self.finished_at))

    @property
    def failure(self) -> RemoteFailure:
        assert self.report is Report.FAILED
        return self.payload


def _report(report: int, worker_id: int, batch_number: int, payload: Any, totals: Any,
            build_s: float, setup_s: float, finished_at: float) -> WorkerReport:
    return WorkerReport(_REPORTS[report], worker_id, batch_number, payload, totals, build_s, setup_s,
                        finished_at)


@dataclass(frozen=True, slots=True)
class ItemsDone:
    """What an item worker says about a piece it handed over (economic mode).

    Attributes:
        count: how many items the piece held.
        item_bytes: the sizes of one item's large tensors, in the order the codec met them,
            when every item of the piece had the same ones (None otherwise, or unchanged since
            this worker last said): the main process lays out later batches' slabs from it.
        as_columns: for a piece given a place in its batch's slab, whether every item of it
            went there as columns (``transport/item_columns.py``); for a piece of a direct batch
            sent without one (the session's first), False when its samples could not have (not
            flat and alike), else None; None for any other piece.
        groups: for a piece of a batch the main process assembles (``ItemRoute.direct``), what
            it holds, in slot order: ``(slot, count, payload)`` with an ``ItemColumns`` (the
            tensors already at their places), a list of samples (items that could not go as
            columns), or a ``RemoteFailure`` standing for ``count`` items from ``slot`` on.
        outcome: what became of the slab for a direct piece's items (``GrantOutcome``: USED,
            or BUSY/LATE when the slab could not be written and the items came as samples).
    """

    count: int
    item_bytes: tuple[int, ...] | None = None
    as_columns: bool | None = None
    groups: tuple[tuple[int, int, Any], ...] | None = None
    outcome: GrantOutcome | None = None

    def __reduce__(self) -> Any:
        return (ItemsDone, (self.count, self.item_bytes, self.as_columns, self.groups, self.outcome))


class SlabControlKind(enum.IntEnum):
    """What the owner of a slab pool tells a producer about its slabs."""

    BOARD = 1
    """Map the release board (its descriptor rides along): one counter per slab id."""
    MAP = 2
    """Map slab ``slab_id`` of ``size`` bytes (its descriptor rides along)."""
    FORGET = 3
    """Unmap slab ``slab_id``: it is retired and will not be granted again under this mapping."""


@dataclass(frozen=True, slots=True)
class SlabControl:
    kind: SlabControlKind
    slab_id: int = -1
    size: int = 0

    def __reduce__(self) -> Any:
        return (SlabControl, (self.kind, self.slab_id, self.size))


class Delivery(enum.IntEnum):
    """What an item worker hands a batch worker (economic mode)."""

    ITEMS = 1
    """``payload`` is the list of fetched samples, in order, for ``count`` slots from ``slot``."""
    FAILED = 2
    """Fetching those ``count`` samples raised; ``payload`` is a :class:`RemoteFailure`."""


@dataclass(frozen=True, slots=True)
class ItemDelivery:
    """Items of a piece of a batch (one item, or a ``__getitems__`` call's, or the rest of the
    piece in a failure), on their way from an item worker to a batch worker.

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

    def __reduce__(self) -> Any:
        # One call with plain fields: a slotted dataclass otherwise pickles through copyreg and
        # unpickles through ``dataclasses.fields`` (a message per group of items).
        return (_item_delivery, (int(self.delivery), self.item_worker, self.epoch, self.batch_number,
                                 self.slot, self.count, self.payload))


def _item_delivery(delivery: int, *fields: Any) -> ItemDelivery:
    return ItemDelivery(_DELIVERIES[delivery], *fields)


# Member lookups by value for the unpickling helpers above (a tuple index, not EnumType.__call__).
_COMMANDS = (None, *Command)
_REPORTS = (None, *Report)
GRANT_OUTCOMES = tuple(GrantOutcome)
_DELIVERIES = {int(kind): kind for kind in Delivery}
