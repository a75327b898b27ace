"""Economic mode's two worker loops: item workers fetch, batch workers gather and collate.

Both are the classic worker loop (worker_main.py) with a different job: the same start-up steps,
``worker_init_fn``, failure reports, epoch restarts and exit; here is only what differs. An item
worker fetches the pieces the main process assigns it and hands them straight to the batch worker
named in the task (or, for a direct batch, writes them into its slab and reports their columns to
the main process: engine/direct_batches.py); a batch worker gathers a batch's pieces from any item
workers, collates them and reports the batch to the main process. Neither decides anything about
order or flow.

Seeding (see docs/design/economic.md): an item worker reseeds its generators before every piece
from (base seed, epoch, position of the piece's first sample in the epoch), and a batch worker
before every collation from (base seed, epoch, batch number), so random draws do not depend on
which worker happened to do the work, nor when.
"""

from __future__ import annotations

import dataclasses
import pickle
import time
from collections.abc import Callable, Iterator, Mapping
from typing import Any

import torch.autograd.profiler as _torch_profiler

from pipeload.collate import collates_as_shipped, default_collate
from pipeload.engine import replica
from pipeload.engine.direct_batches import collate_field
from pipeload.engine.fetch import fetches_items_one_by_one
from pipeload.engine.item_seeds import ItemSeeds
from pipeload.engine.lifecycle import release_free_heap
from pipeload.engine.plan import EconomicSetup, WorkerSetup
from pipeload.engine.worker_info import (
    WorkerInfo,
    WorkerRNG,
    batch_seed,
    item_seed,
    make_thread_rng,
    reseed,
)
from pipeload.engine.worker_main import (
    POLL_INTERVAL_S,
    WorkerLoop,
    describe_failure,
    enter_worker_process,
    prepare_worker,
    serve_in_process,
    serve_in_thread,
)
from pipeload.errors import RemoteFailure
from pipeload.stats.clock import now, profiling, span, tensor_bytes
from pipeload.transport import collate_output
from pipeload.transport.item_columns import (
    ItemColumns,
    collate_columns,
    column_bytes,
    place_as_columns,
    writer_runs,
)
from pipeload.transport.item_links import ItemLinks
from pipeload.transport.messages import (
    Command,
    Delivery,
    GrantOutcome,
    ItemDelivery,
    ItemPlacement,
    ItemsDone,
    Report,
    SlabGrant,
    WorkerCommand,
    WorkerReport,
)

ITEM = "item"
BATCH = "batch"
# An item worker that waits this long for its next piece is ahead of the training loop (the main
# process hands out the next piece within a few milliseconds when the pool is behind), and gives
# its heap back then. A piece takes tens of milliseconds to fetch, so a worker that is never
# kept waiting (a fast loop) never pays for the trim and the page faults after it.
IDLE_TRIM_AFTER_S = 0.02
FAILED_BATCHES_KEPT = 16  # an item worker skips later pieces of this many recently failed batches


class ItemWorkerLoop(WorkerLoop):
    """Serves FETCH_ITEMS: fetch a piece, hand it to its batch worker, tell the main process."""

    # Its pieces go into slabs that the batch's main grantee answers for, and it runs no
    # collate function: nothing of a piece is kept here once sent, so no note follows one.
    confirms_views = False

    kind = ITEM

    def __init__(self, setup: WorkerSetup, worker_id: int, inbox: Any, outbox: Any, deliveries: Any,
                 should_stop: Callable[[], bool], rng: WorkerRNG | None,
                 share_clock: Callable[[Any], None] | None = None) -> None:
        super().__init__(setup, worker_id, inbox, outbox, should_stop, share_clock)
        self._deliveries = deliveries
        # One __getitems__ call a piece (one seed), or item by item (a Subset's passes its
        # indices on: looked through, as the main process cuts the pieces).
        self._sub_batches = setup.fetch.auto_collation and not fetches_items_one_by_one(setup.fetch.dataset)
        # Items are handed over in groups of about ``group_bytes(placed)`` bytes (an outbox that
        # does not say takes each item alone; see item_links.PLACED_GROUP_BYTES).
        self._group_bytes = getattr(deliveries, "group_bytes", lambda placed: 0)
        self._rng = rng
        self._said_item_bytes: tuple[int, ...] | None = None
        self._heap_in_use = False
        # (epoch, batch number) -> (slot, failure): the earliest item this worker saw fail in
        # each of the last batches that failed here.
        self._failed_batches: dict[tuple[int, int], tuple[int, RemoteFailure]] = {}

    def _next_command(self) -> WorkerCommand | None:
        command = super()._next_command()
        if command is None and self._heap_in_use:
            # Idle (the loader is ahead of the training loop): give the heap that held fetched
            # items back to the system, instead of keeping a piece's worth or more per worker
            # until the next batch, when every worker holds its new piece too.
            self._heap_in_use = False
            release_free_heap()
        return command

    def _idle_wait_s(self) -> float:
        return IDLE_TRIM_AFTER_S if self._heap_in_use else POLL_INTERVAL_S

    def _share(self) -> tuple[int, int]:
        # Items are fetched by global index, so no item worker may hold only a shard: each copy
        # is prepared as the main process's would be (sharded by rank alone).
        return 0, 1

    def _serve(self, command: WorkerCommand) -> None:
        self._heap_in_use = True
        route = command.route
        clock = self._clock
        timing = False
        if clock is not None:
            # Count down to the next timed piece, as a classic worker's fetcher does
            # (stats/clock.py).
            clock.left -= 1
            if clock.left <= 0:
                clock.start_timed()
                timing = True
        direct = route.direct and getattr(self._outbox, "writer", None) is not None
        if direct and command.grant is None:
            self._keep_samples_for_main(command, timing)
            return
        sizes: list[int] | None = []
        kept = _KeptForMain() if direct else None
        as_columns = True if command.grant is not None else None
        for delivery in self._deliveries_of(command, timing):
            started = now() if timing else 0.0
            if kept is not None:
                delivery, handed, refused = self._place_for_main(delivery, command, kept)
            else:
                delivery, handed, refused = self._hand_over(route.batch_worker, delivery, command)
            if timing:
                clock.sent(started)  # type: ignore[union-attr]
            # A piece that failed (or was not all handed over) lays out no whole item: no sizes.
            sizes = self._sizes_sent(sizes) if handed else None
            # Items kept out of a slab that was not free, or that failed, say nothing of their shape.
            as_columns = as_columns and (refused or isinstance(delivery.payload, (ItemColumns, RemoteFailure)))
            # The item's memory goes with the message, before the next item is fetched: the
            # next one reuses it, and a worker holds one item of its own, not a whole piece.
            del delivery
        done = self._items_done(len(command.indices), sizes, as_columns)
        if kept is None:
            # When it finished (one clock machine-wide): the main process times items with it.
            self._report(Report.ITEMS_DONE, command.batch_number, done, finished_at=time.monotonic())
        else:
            self._report_to_assembler(command, done, kept)

    def _keep_samples_for_main(self, command: WorkerCommand, timing: bool) -> None:
        """A piece of a direct batch sent with no place for its items (the session's first, sent
        before their size was known): the samples travel with the report as they are, and the
        report says whether they could go as columns (then their sizes, so that later batches
        are laid out: see ``ItemsDone``) or not (the main process stops making batches direct)."""
        kept = _KeptForMain()
        item_bytes: tuple[int, ...] | None = None
        alike = True
        for delivery in self._deliveries_of(command, timing):
            started = now() if timing else 0.0
            kept.add(delivery)
            if delivery.delivery is Delivery.ITEMS:
                sizes = column_bytes(delivery.payload)
                alike = alike and sizes is not None and item_bytes in (None, sizes)
                item_bytes = item_bytes or sizes
            if timing:
                self._clock.sent(started)  # type: ignore[union-attr]
            del delivery
        count = len(command.indices)
        every_size = list(item_bytes) * count if alike and item_bytes is not None else None
        done = self._items_done(count, every_size, None if alike else False)
        self._report_to_assembler(command, done, kept)

    def _place_for_main(self, delivery: ItemDelivery, command: WorkerCommand,
                        kept: _KeptForMain) -> tuple[ItemDelivery, bool, bool]:
        """A group of a batch the main process assembles (``ItemRoute.direct``): its tensors
        written at their places as columns, or, when they cannot go so, the samples as they are
        (they travel with the report, in memory of their own); kept for the report either way.
        Returns the group as kept, whether its items went to their places, and whether the
        slab refused them (see ``SlabWriter.slab_refused``)."""
        if delivery.delivery is not Delivery.ITEMS:
            kept.add(delivery)
            return delivery, False, False
        outbox, writer = self._outbox, self._outbox.writer
        outbox.prepare(command.grant)
        writer.place_items(first=delivery.slot - command.route.slot)
        try:
            columns = place_as_columns(delivery.payload, writer) if writer.placing else None
        finally:
            outcome = writer.finish()[1]  # a message of its own, never sent: the report says it
            outbox.prepare(None)
        if columns is not None:
            delivery = dataclasses.replace(delivery, payload=columns)
        kept.add(delivery, outcome)
        return delivery, columns is not None, outcome in (GrantOutcome.BUSY, GrantOutcome.LATE)

    def _report_to_assembler(self, command: WorkerCommand, done: ItemsDone, kept: _KeptForMain) -> None:
        """``ITEMS_DONE`` with the groups of a direct piece; samples that cannot be sent become
        the failure of their items, as a hand-over to a batch worker does."""
        report = dataclasses.replace(done, groups=tuple(kept.groups), outcome=kept.outcome)
        finished_at = time.monotonic()
        try:
            self._report(Report.ITEMS_DONE, command.batch_number, report, finished_at=finished_at)
        except (BrokenPipeError, ConnectionResetError):
            raise
        except Exception as exc:  # a sample that cannot be pickled, /dev/shm full, ...
            self._outbox.prepare(None)
            offset = command.route.slot
            groups = tuple(
                (slot, count, payload if isinstance(payload, (ItemColumns, RemoteFailure)) else
                 describe_failure(self._id, ITEM, _handing_stage("the main process", exc),
                                  self._named(command.indices[slot - offset:slot - offset + count]), exc))
                for slot, count, payload in kept.groups)
            self._report(Report.ITEMS_DONE, command.batch_number,
                         dataclasses.replace(report, groups=groups), finished_at=finished_at)

    def _sizes_sent(self, sizes: list[int] | None) -> list[int] | None:
        """``sizes`` with the large storage sizes of the message just sent (None: no writer)."""
        writer = getattr(self._outbox, "writer", None)
        return None if writer is None or sizes is None else sizes + writer.last_large_sizes

    def _items_done(self, count: int, sizes: list[int] | None, as_columns: bool | None = None) -> ItemsDone:
        """The report's payload; says the items' sizes when they are new (see ItemPlacement).
        ``sizes``: the piece's large storage sizes, in codec order (None: not known);
        ``as_columns``: see ``ItemsDone``."""
        sizes = None if sizes is None else _item_bytes(sizes, count)
        if sizes is None or sizes == self._said_item_bytes:
            return ItemsDone(count, None, as_columns)
        self._said_item_bytes = sizes
        return ItemsDone(count, sizes, as_columns)

    def _deliveries_of(self, command: WorkerCommand, timing: bool) -> Iterator[ItemDelivery]:
        """``_fetched_deliveries``, except for a piece of a batch that this worker saw fail at an
        earlier slot: torch stops fetching a batch at its first failing item, so the piece is not
        fetched, and one failure delivery (that earlier failure, which is the one raised) fills
        its slots."""
        key = (command.epoch, command.batch_number)
        known = self._failed_batches.get(key)
        if known is not None and command.route.slot > known[0]:
            piece = ItemDelivery(Delivery.ITEMS, self._id, command.epoch, command.batch_number,
                                 command.route.slot, len(command.indices))
            yield _failed(piece, known[1])
            return
        for delivery in self._fetched_deliveries(command, timing):
            if delivery.delivery is Delivery.FAILED and (known is None or delivery.slot < known[0]):
                self._failed_batches[key] = known = (delivery.slot, delivery.payload)
                while len(self._failed_batches) > FAILED_BATCHES_KEPT:
                    del self._failed_batches[next(iter(self._failed_batches))]  # the oldest
            yield delivery
            del delivery  # before the next item is fetched: this worker holds one group at most

    def _fetched_deliveries(self, command: WorkerCommand, timing: bool) -> Iterator[ItemDelivery]:
        """The piece's items as deliveries: consecutive items gathered up to the outbox's
        ``group_bytes`` (one item each when it names none), each group handed over before the
        next item is fetched; a ``__getitems__`` call, or a failure, in one for the rest of the
        piece (the batch worker fills slots by position, whatever the deliveries' sizes).
        ``timing``: the stats clock samples this piece."""
        route, indices = command.route, command.indices
        piece = ItemDelivery(Delivery.ITEMS, self._id, command.epoch, command.batch_number,
                             route.slot, len(indices))
        if self._init_failure is not None:
            yield _failed(piece, self._init_failure)
            return
        if self._sub_batches:
            self._reseed(command.epoch, route.position)  # one call, one seed: its first item's
            fetched = self._fetched(indices, lambda: self._sub_batch(indices), timing)
            yield (_failed(piece, fetched) if isinstance(fetched, RemoteFailure)
                   else _group(piece, route.slot, fetched))
            return
        yield from self._item_groups(piece, command, timing)

    def _item_groups(self, piece: ItemDelivery, command: WorkerCommand, timing: bool) -> Iterator[ItemDelivery]:
        """The per-item path of ``_fetched_deliveries``: each item fetched under its own seed."""
        route, indices = command.route, command.indices
        dataset = self._setup.fetch.dataset
        seeds = ItemSeeds(self._setup.base_seed, command.epoch, route.position, len(indices))
        group_bytes = self._group_bytes(command.grant is not None)
        group: list[Any] = []  # fetched, not yet handed over: consecutive items of the piece
        group_size = 1  # items per group: from the piece's first item's size (one walk a piece)
        for offset, index in enumerate(indices):
            seeds.apply(offset, self._rng)
            fetched = self._fetched([index], lambda: [dataset[index]], timing)
            if isinstance(fetched, RemoteFailure):  # the very item; the rest is not fetched
                if group:
                    yield _group(piece, route.slot + offset - len(group), group)
                yield dataclasses.replace(_failed(piece, fetched), slot=route.slot + offset,
                                          count=len(indices) - offset)
                return
            if offset == 0 and group_bytes:
                group_size = max(1, group_bytes // (tensor_bytes(fetched) + 1))
            group += fetched
            del fetched
            if len(group) >= group_size:
                yield _group(piece, route.slot + offset + 1 - len(group), group)
                # Before the next fetch: this worker holds at most a group's bytes of items.
                group = []
        if group:
            yield _group(piece, route.slot + len(indices) - len(group), group)

    def _sub_batch(self, indices: list[Any]) -> list[Any]:
        """One ``__getitems__`` call; a wrong count raises, as the batch worker fills slots by
        position and would otherwise collate a batch with holes (torch collates what it got).
        So does what is no sequence of samples: a mapping's keys would be taken for samples
        (torch hands a whole batch's mapping of columns to ``collate_fn``, which a batch glued
        from several calls cannot be), and a generator has no length to fill slots by."""
        samples = self._fetcher.samples(indices)
        name = type(self._setup.fetch.dataset).__name__
        if (isinstance(samples, (Mapping, str, bytes)) or not hasattr(samples, "__len__")
                or not hasattr(samples, "__getitem__")):
            raise TypeError(f"{name}.__getitems__ returned a {type(samples).__name__}, not a list of "
                            "samples: mode='economic' joins the calls that make one batch by position "
                            "(mode='classic' hands collate_fn what one call for the whole batch returns)")
        if len(samples) != len(indices):
            raise ValueError(f"{name}.__getitems__ returned {len(samples)} samples for {len(indices)} indices")
        return samples

    def _fetched(self, indices: list[Any], fetch: Callable[[], list[Any]],
                 timing: bool) -> list[Any] | RemoteFailure:
        """The samples ``fetch()`` returns, or the failure, naming ``indices``. The samples are
        counted into the stats clock before they are handed over (a lent clock, read live, then
        has every item of a batch handed out), and timed when ``timing``; under a profiler the
        fetch opens its span either way."""
        clock = self._clock
        started = now() if timing else 0.0
        try:
            # The profiler's flag read as an attribute (as stats.clock.profiling does): no call.
            if clock is not None and _torch_profiler._is_profiler_enabled:
                with span("pipeload.fetch"):
                    samples = fetch()
            else:
                samples = fetch()
        except Exception as exc:
            if timing:  # a call that raised took its time too, as in a classic worker's
                clock.fetch_s += now() - started  # type: ignore[union-attr]
            return describe_failure(self._id, ITEM, "fetching items", self._named(indices), exc)
        if timing:
            clock.fetch_s += now() - started  # type: ignore[union-attr]
            clock.samples += len(samples)  # type: ignore[union-attr]
            clock.bytes_out += tensor_bytes(samples)  # type: ignore[union-attr]
        elif clock is not None:
            clock.untimed_samples += len(samples)
        return samples

    def _reseed(self, epoch: int, position: int) -> None:
        reseed(item_seed(self._setup.base_seed, epoch, position), self._rng)

    def _named(self, indices: list[Any]) -> Any:
        """How messages name these indices: without batching, the single index, as classic does."""
        return indices if self._setup.fetch.auto_collation else indices[0]

    def _hand_over(self, batch_worker: int, delivery: ItemDelivery,
                   command: WorkerCommand) -> tuple[ItemDelivery, bool, bool]:
        """Send ``delivery``, all or part of ``command``'s piece, to ``batch_worker``. Returns
        it as sent (its items as columns or as samples), whether items went (not a failure, in
        place of them or of ``delivery``'s own), and whether its slab refused them."""
        offset = delivery.slot - command.route.slot  # of its first item, inside the piece
        # Process workers place the items with their result channel's slab writer: the grant (a
        # share of the batch's slab) came on that channel, and its slabs are mapped there.
        writer = getattr(self._outbox, "writer", None)
        placing = refused = False
        if writer is not None:
            placing = command.grant is not None and delivery.delivery is Delivery.ITEMS
            self._outbox.prepare(command.grant if placing else None)
            if placing:
                writer.place_items(first=offset)
        try:
            if placing and writer.placing:
                # Flat samples go as columns, their tensors written at their places now.
                columns = place_as_columns(delivery.payload, writer)
                if columns is not None:
                    delivery = dataclasses.replace(delivery, payload=columns)
                refused = writer.slab_refused
            self._deliveries.send(batch_worker, delivery, writer)
        except (BrokenPipeError, ConnectionResetError):
            return delivery, False, refused  # that batch worker is gone: the main process says so
        except Exception as exc:  # a sample that cannot be pickled, /dev/shm full, ...
            stage = _handing_stage(f"batch worker {batch_worker}", exc)
            sent = command.indices[offset:offset + delivery.count]
            failure = describe_failure(self._id, ITEM, stage, self._named(sent), exc)
            if writer is not None:
                self._outbox.prepare(None)
            try:
                self._deliveries.send(batch_worker, _failed(delivery, failure), writer)
            except (BrokenPipeError, ConnectionResetError):
                pass
            return delivery, False, refused
        return delivery, delivery.delivery is Delivery.ITEMS, refused


def _handing_stage(target: str, exc: Exception) -> str:
    """Where an item worker failed to hand items over, for the error; a sample that could not
    be pickled gets why it had to be (torch's loader, and classic mode, never pickle one)."""
    stage = f"handing items to {target}"
    if "pickl" in str(exc).lower() or isinstance(exc, pickle.PicklingError):
        stage += (", which needs them pickled: in economic mode a sample travels from the item "
                  "worker that fetched it to where it is collated (mode='classic' collates "
                  "samples in the worker that fetched them)")
    return stage


def _item_bytes(sizes: list[int], count: int) -> tuple[int, ...] | None:
    """One item's large storage sizes, if ``sizes`` (a piece's, in codec order) repeats them
    for each of its ``count`` items; None otherwise."""
    if not sizes or count <= 0 or len(sizes) % count:
        return None
    per_item = len(sizes) // count
    first = sizes[:per_item]
    return tuple(first) if sizes == first * count else None  # one comparison in C, not a slice an item


class _KeptForMain:
    """What a direct piece's groups were, for its ``ITEMS_DONE`` (see ``ItemsDone.groups``)."""

    def __init__(self) -> None:
        self.groups: list[tuple[int, int, Any]] = []
        self.outcome = GrantOutcome.USED

    def add(self, delivery: ItemDelivery, outcome: GrantOutcome = GrantOutcome.USED) -> None:
        self.groups.append((delivery.slot, delivery.count, delivery.payload))
        if outcome in (GrantOutcome.BUSY, GrantOutcome.LATE):
            self.outcome = outcome


def _group(piece: ItemDelivery, slot: int, samples: list[Any]) -> ItemDelivery:
    """One delivery of consecutive items of ``piece``, the first of them at batch slot ``slot``."""
    return ItemDelivery(piece.delivery, piece.item_worker, piece.epoch, piece.batch_number, slot,
                        len(samples), samples)


def _failed(delivery: ItemDelivery, failure: RemoteFailure) -> ItemDelivery:
    return dataclasses.replace(delivery, delivery=Delivery.FAILED, payload=failure)


@dataclasses.dataclass
class _Gathering:
    """One batch being gathered by a batch worker: what it needs, and what has come so far."""

    indices: list[Any] | None = None  # known once the COLLATE command has arrived
    grant: SlabGrant | None = None  # where to collate it (from the COLLATE command)
    # slot -> the samples that begin there (a list, or an ItemColumns whose tensors are in the slab)
    pieces: dict[int, list[Any] | ItemColumns] = dataclasses.field(default_factory=dict)
    failures: dict[int, RemoteFailure] = dataclasses.field(default_factory=dict)  # slot -> why
    arrived: dict[int, int] = dataclasses.field(default_factory=dict)  # first slot -> slots filled
    filled: int = 0
    failed_early: bool = False  # its failure went out before every piece came: drop the rest

    def add(self, delivery: ItemDelivery) -> None:
        if delivery.delivery is Delivery.FAILED:
            self.failures[delivery.slot] = delivery.payload
        elif not self.failed_early:
            self.pieces[delivery.slot] = delivery.payload
        self.arrived[delivery.slot] = delivery.count
        self.filled += delivery.count

    @property
    def complete(self) -> bool:
        return self.indices is not None and self.filled >= len(self.indices)

    def decided_failure(self) -> RemoteFailure | None:
        """The failure torch would raise for this batch, as soon as it is known: the earliest
        failed slot's, once every slot before it has come (torch fetches a batch's items in order
        and stops at the first that raises; a slot still on its way may yet fail first)."""
        if self.indices is None or not self.failures:
            return None
        first = min(self.failures)
        before = sum(count for slot, count in self.arrived.items() if slot < first)
        return self.failures[first] if before >= first else None

    def take_groups(self) -> list[tuple[int, list[Any] | ItemColumns]]:
        """The pieces in slot order, (first slot, samples); they are forgotten here, so that once
        collated the items' memory goes with the caller's list."""
        groups = sorted(self.pieces.items())
        self.pieces.clear()
        return groups


class BatchWorkerLoop(WorkerLoop):
    """Gathers the pieces of the batches it is given, collates each when whole, reports it.

    Pieces may arrive before the batch's COLLATE command (they travel on other channels); they
    wait in ``_batches`` until it comes. Owned by its thread or process, like every worker loop.
    Invariant: ``_batches`` holds only batches of epoch ``_epoch_floor`` or later.
    """

    kind = BATCH

    def __init__(self, setup: WorkerSetup, worker_id: int, inbox: Any, outbox: Any,
                 should_stop: Callable[[], bool], rng: WorkerRNG | None,
                 share_clock: Callable[[Any], None] | None = None) -> None:
        super().__init__(setup, worker_id, inbox, outbox, should_stop, share_clock)
        self._rng = rng
        self._batches: dict[tuple[int, int], _Gathering] = {}  # (epoch, batch number) -> state
        self._epoch_floor = 0

    def run(self) -> None:
        self._init_failure = prepare_worker(self._setup, self._id, BATCH, self._share())
        while not self._should_stop():
            message = self._inbox.receive(POLL_INTERVAL_S)
            if message is None:
                continue
            if isinstance(message, ItemDelivery):
                self._accept(message)
            elif message.command is Command.STOP:
                return
            elif message.command is Command.START_EPOCH:
                self._start_epoch(message.epoch, message.shared_seed)
            elif message.command is Command.COLLATE:
                key = (message.epoch, message.batch_number)
                gathering = self._batches.setdefault(key, _Gathering())
                gathering.indices, gathering.grant = message.indices, message.grant
                self._finish_if_complete(key)
            del message  # (a delivery's items view the batch's slab)
            # A batch sent is let go of by now: which slabs user code here still views (a
            # collate function keeping its last output), so that no other producer is granted them.
            self._outbox.confirm_views()

    def _share(self) -> tuple[int, int]:
        return 0, 1  # as an item worker's copy (it fetches nothing, but worker_init_fn may look)

    def _start_epoch(self, epoch: int, shared_seed: int | None) -> None:
        # What the abandoned epoch left half-gathered is dropped; its late pieces are too.
        self._epoch_floor = epoch
        self._batches = {key: g for key, g in self._batches.items() if key[0] >= epoch}
        # With its totals, as every worker's answer, and its kind, which the main process cannot
        # tell from an EPOCH_STARTED (item and batch workers share ids).
        totals = self._clock.snapshot() if self._clock is not None and not self._lends_clock else None
        self._outbox.send(WorkerReport(Report.EPOCH_STARTED, self._id, epoch, BATCH, totals))

    def _accept(self, delivery: ItemDelivery) -> None:
        if delivery.epoch < self._epoch_floor:
            return
        key = (delivery.epoch, delivery.batch_number)
        self._batches.setdefault(key, _Gathering()).add(delivery)
        self._finish_if_complete(key)

    def _finish_if_complete(self, key: tuple[int, int]) -> None:
        gathering = self._batches[key]
        if gathering.failed_early:
            if gathering.complete:
                del self._batches[key]  # its last pieces have come: nothing writes for it now
            return
        if not gathering.complete:
            early = gathering.decided_failure()
            if early is not None and self._init_failure is None:
                self._fail_early(key, gathering, early)
            return
        del self._batches[key]
        epoch, number = key
        indices = gathering.indices
        self._count_down_to_timing()
        self._outbox.prepare(gathering.grant)  # collation writes where the batch will travel
        failure = self._init_failure or _first_failure(gathering)
        if failure is not None:
            if self._init_failure is None:  # a worker whose setup failed builds no batch at all
                self._count_failed(gathering)
            self._report_with_totals(Report.FAILED, number, failure)
            return
        started = time.perf_counter()
        try:
            batch = self._collate(gathering, epoch, number)
        except Exception as exc:
            self._count_failed_task(indices)
            self._report_failure(number, "collating a batch", indices, exc)
            return
        setup_s = self._outbox.setup_s
        build_s = max(0.0, time.perf_counter() - started - setup_s)
        self._send_batch(number, batch, indices, build_s, setup_s, time.monotonic())

    def _count_failed(self, gathering: _Gathering) -> None:
        """A batch that failed counts the samples it was to hold, as a classic worker's does
        (counted as none, they took the stats' samples a batch below what the loop received)."""
        clock = self._clock
        if clock is None:
            return
        if clock.timing:
            clock.count_samples(len(gathering.indices))
        else:
            clock.untimed_samples += len(gathering.indices)
        clock.failed(len(gathering.indices))

    def _count_down_to_timing(self) -> None:
        clock = self._clock
        if clock is not None:  # count down to the next timed batch (stats/clock.py)
            clock.left -= 1
            if clock.left <= 0:
                clock.start_timed()

    def _fail_early(self, key: tuple[int, int], gathering: _Gathering, failure: RemoteFailure) -> None:
        """Report the batch's failure now, as torch's worker raises at the first failing item,
        rather than once its other pieces are fetched (0.5 s items: seconds later). Its pieces
        still on their way are dropped as they come; those that item workers write into the
        batch's slab would land after the slab's grant is over, so the slab is given up
        (``leave_to_late_writers``): a failed batch costs a new slab, never a batch written over."""
        gathering.failed_early = True
        gathering.pieces.clear()
        self._count_down_to_timing()
        self._count_failed(gathering)
        self._outbox.prepare(gathering.grant)
        writer = getattr(self._outbox, "writer", None)  # (process workers' outboxes have one)
        if writer is not None and gathering.grant is not None and gathering.grant.items is not None:
            writer.leave_to_late_writers()
        self._report_with_totals(Report.FAILED, key[1], failure)

    def _collate(self, gathering: _Gathering, epoch: int, number: int) -> Any:
        make_batch, count = self._collation(gathering)
        reseed(batch_seed(self._setup.base_seed, epoch, number), self._rng)
        clock = self._clock
        if clock is None:
            return make_batch()
        # A batch worker's samples: those it collated. Only a sampled batch is timed.
        if not clock.timing and not _torch_profiler._is_profiler_enabled:
            clock.untimed_samples += count
            return make_batch()
        return _timed_collate(make_batch, count, clock)

    def _collation(self, gathering: _Gathering) -> tuple[Callable[[], Any], int]:
        """What collates the gathered batch (a call), and how many samples it holds."""
        groups = gathering.take_groups()
        fetch = self._setup.fetch
        count = sum(piece.count if isinstance(piece, ItemColumns) else len(piece) for _, piece in groups)
        writer = collate_output.current_writer()

        def as_samples() -> Any:
            samples = _samples_of(groups, gathering)
            collate_output.note_items(samples)  # what of the slab the items view (ItemPlacement)
            return fetch.collate_fn(samples if fetch.auto_collation else samples[0])

        if (writer is None or not all(isinstance(piece, ItemColumns) for _, piece in groups)
                or fetch.collate_fn is not default_collate or not collates_as_shipped()):
            return as_samples, count
        columns = [piece for _, piece in groups]

        def by_columns() -> Any:
            batch = collate_columns(columns, writer_runs(writer), collate_field)
            return batch if batch is not None else as_samples()
        return by_columns, count


def _samples_of(groups: list[tuple[int, list[Any] | ItemColumns]], gathering: _Gathering) -> list[Any]:
    """The batch's samples in slot order; items that came as columns view their places."""
    samples: list[Any] = []
    for slot, piece in groups:
        if isinstance(piece, ItemColumns):
            slab, items = _item_area(gathering)
            samples += piece.samples(slab, items, slot)
        else:
            samples += piece
    return samples


def _item_area(gathering: _Gathering) -> tuple[memoryview, ItemPlacement]:
    """The batch's slab, as this batch worker maps it, and where its items are laid out.

    Raises:
        RuntimeError: the batch has no such slab here (items were written into a slab that its
            grant does not name: a bug, said rather than read from the wrong place).
    """
    writer, grant = collate_output.current_writer(), gathering.grant
    slab = writer.view(grant.slab_id) if writer is not None and grant is not None else None
    if slab is None or grant is None or grant.items is None:
        raise RuntimeError("items written into a slab arrived without that slab granted for their batch")
    return slab, grant.items


def _timed_collate(make_batch: Callable[[], Any], count: int, clock: StageClock) -> Any:
    """``make_batch()`` (a batch of ``count`` samples) for a sampled batch, or for any batch while
    a profiler records (its span opens; only a sampled batch is timed)."""
    if not clock.timing:
        clock.untimed_samples += count
    else:
        clock.samples += count
    started = now()
    try:
        if profiling():
            with span("pipeload.collate"):
                return make_batch()
        return make_batch()
    finally:
        if clock.timing:
            clock.collate_s += now() - started


def _first_failure(gathering: _Gathering) -> RemoteFailure | None:
    if not gathering.failures:
        return None
    return gathering.failures[min(gathering.failures)]  # the earliest in the batch, as torch's


# -- entry points ------------------------------------------------------------------------------


def run_item_process(setup: EconomicSetup, worker_id: int, inbox: Any, outbox: Any, deliveries: Any,
                     links: ItemLinks | None) -> None:
    """Entry point of an item worker process. ``links`` (fork only) is the inherited mesh."""
    if links is not None:
        links.keep_only(deliveries.links)
    outbox.writer.populate = False  # it writes its own rows of a batch's slab, not the whole slab
    common = setup.worker
    seed = enter_worker_process(common.base_seed, worker_id)
    info = WorkerInfo(worker_id, common.num_workers, seed, common.fetch.dataset, kind=ITEM)
    loop = ItemWorkerLoop(common, worker_id, inbox, outbox, deliveries, lambda: False, None)
    serve_in_process(info, loop)


def run_batch_process(setup: EconomicSetup, worker_id: int, inbox: Any, outbox: Any,
                      links: ItemLinks | None) -> None:
    """Entry point of a batch worker process; its seed comes after the item workers' seeds."""
    if links is not None:
        links.keep_only(inbox.links)
    outbox.writer.populate = False  # it views the rows item workers wrote; writes only the rest
    inbox.read_slabs_with(outbox)
    common = setup.worker
    seed = enter_worker_process(common.base_seed, common.num_workers + worker_id)
    info = WorkerInfo(worker_id, setup.num_batch_workers, seed, common.fetch.dataset, kind=BATCH)
    loop = BatchWorkerLoop(common, worker_id, inbox, outbox, lambda: False, None)
    serve_in_process(info, loop)


def run_item_thread(setup: EconomicSetup, worker_id: int, inbox: Any, outbox: Any, deliveries: Any,
                    stop: Any, share_clock: Callable[[Any], None] | None = None) -> None:
    """Entry point of an item worker thread: its own generators, reseeded for every piece.
    ``share_clock``: where to lend its stats clock (see WorkerLoop)."""
    common = _with_thread_replica(setup.worker)
    rng = make_thread_rng(common.base_seed, worker_id)
    info = WorkerInfo(worker_id, common.num_workers, common.base_seed + worker_id,
                      common.fetch.dataset, rng, "thread", ITEM)
    serve_in_thread(info, ItemWorkerLoop(common, worker_id, inbox, outbox, deliveries, stop.is_set, rng,
                                         share_clock), stop.is_set)


def run_batch_thread(setup: EconomicSetup, worker_id: int, inbox: Any, outbox: Any, stop: Any,
                     share_clock: Callable[[Any], None] | None = None) -> None:
    """Entry point of a batch worker thread (``share_clock``: as an item worker's)."""
    common = _with_thread_replica(setup.worker)
    offset = common.num_workers + worker_id
    rng = make_thread_rng(common.base_seed, offset)
    info = WorkerInfo(worker_id, setup.num_batch_workers, common.base_seed + offset,
                      common.fetch.dataset, rng, "thread", BATCH)
    serve_in_thread(info, BatchWorkerLoop(common, worker_id, inbox, outbox, stop.is_set, rng, share_clock),
                    stop.is_set)


def _with_thread_replica(setup: WorkerSetup) -> WorkerSetup:
    """A thread worker's own copy of the dataset where one is needed (a DataPipe graph)."""
    own_copy = replica.thread_replica(setup.fetch.dataset, setup.fetch.kind)
    return dataclasses.replace(setup, fetch=dataclasses.replace(setup.fetch, dataset=own_copy))
