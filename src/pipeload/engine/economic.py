"""The economic engine: item workers fetch, batch workers collate, at most ``prefetch_factor``
batches in flight across the whole pool.

Classic loading gives each worker whole batches, so ``num_workers * prefetch_factor`` batches sit
in memory and the first batch is built by one worker alone. Here the main process cuts every batch
into pieces (one item, or a share of a ``__getitems__`` call), gives each piece to the item worker
with the fewest items in hand, and names the batch worker (the least loaded) that gathers the
batch; items travel item worker -> batch worker directly, tensors as shared memory. Once the items
are known to be flat, a batch laid out in its slab is "direct": the item workers write it there
and report its columns here, and the main process names the batch's runs itself
(direct_batches.py), with no batch worker in between. Memory in flight is bounded by
``prefetch_factor`` batches whatever ``num_workers`` is, and every item worker helps build the
first batch. See docs/design/economic.md.

Everything else is the classic engine's: the worker group (start, send, receive, deaths, timeout,
stop), the ledger that yields in sampler order, the persistent epoch restart.
"""

from __future__ import annotations

import math
import multiprocessing
import threading
import time
import weakref
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

from pipeload.collate import collates_as_shipped, default_collate
from pipeload.engine.budget import (
    LARGE_BATCH_BYTES,
    POOL_TOLERATED_WAIT,
    InFlightBudget,
    PoolBuildClock,
    loop_floor_slabs,
    shm_budget_bytes,
)
from pipeload.engine.direct_batches import DirectBatch, DirectBatches
from pipeload.engine.economic_workers import (
    BATCH,
    ITEM,
    run_batch_process,
    run_batch_thread,
    run_item_process,
    run_item_thread,
)
from pipeload.engine.epoch_flow import TaskSupply, hand_out
from pipeload.engine.fetch import fetches_items_one_by_one
from pipeload.engine.item_scheduler import (
    PIECES_IN_HAND,
    ItemPace,
    ItemScheduler,
    Piece,
    item_placement,
    least_items,
    messages_would_busy_main,
)
from pipeload.engine.lifecycle import WorkerLaunch
from pipeload.engine.plan import EconomicSetup, EpochStart
from pipeload.engine.pool import picklable_parts
from pipeload.engine.reorder import BatchLedger
from pipeload.engine.workers import SlabSettings, WorkerGroup, WorkerLabel
from pipeload.errors import LoaderTimeoutError, RemoteFailure
from pipeload.transport.channel import ProcessChannels, ThreadChannels
from pipeload.transport.codec import INLINE_MAX_BYTES
from pipeload.transport.item_links import ItemLinks, ThreadItemOutbox
from pipeload.transport.slab_keeper import SlabKeeper
from pipeload.transport.messages import (
    Command,
    GrantOutcome,
    ItemPlacement,
    ItemRoute,
    Report,
    SlabGrant,
    WorkerCommand,
    WorkerReport,
)


@dataclass(frozen=True)
class EconomicConfig:
    """How to run economic mode.

    Attributes:
        setup: what every worker needs to start (item and batch worker counts included).
        prefetch_factor: batches in flight across all workers together.
        in_order: yield in sampler order (True) or as batches finish (False).
        timeout_s: raise if no batch arrives for this long (0: wait as long as workers live).
        worker_type: "process" or "thread".
        mp_context: a multiprocessing context (process workers), or None for the default.
        stats: the loader's ``StatsRecorder`` (None: stats are off).
        max_shm_bytes: the most shared memory the batch slabs may hold (None: half of what the
            memory backing them can still take).
        pin_slabs: page-lock slabs for CUDA, so batches come out pinned with no copy.
        numbered: with ``in_order=False``, hand each batch out as a ``NumberedBatch`` (and
            attach its number to a failed batch's error): which batches an out-of-order epoch
            has handed out is then a set, which the loader's checkpoints record.
        slab_keeper: the loader's ``SlabKeeper``, which keeps its slab pool and the budget's
            pace between the sets of workers it starts (None: the pool is the engine's own).
        stop_when_done: this engine serves one epoch (no persistent workers): once it has
            handed out the epoch's last batch, its workers are reaped beside the loop.
        forks_as_tasks_go: the sampler's draws change nothing an item worker could see
            (``samplers.draws_unseen_by_workers``): item worker 0 forks first and the others as
            their first pieces go out. Otherwise all item workers fork before the first draw.
    """

    setup: EconomicSetup
    prefetch_factor: int
    in_order: bool
    timeout_s: float
    worker_type: str
    mp_context: Any
    stats: Any = None
    max_shm_bytes: int | None = None
    pin_slabs: bool = False
    numbered: bool = False
    slab_keeper: SlabKeeper | None = None
    stop_when_done: bool = False
    forks_as_tasks_go: bool = False


class EconomicLaunch:
    """What economic workers run. Channel slots: item workers first, then batch workers.

    Owns the item -> batch links (process workers) from the first launch until ``close()``.
    Thread workers lend their stats clocks to ``stats`` (the engine's session), as a classic
    pool's do: the main process reads them when asked, and their reports carry no totals.
    """

    def __init__(self, setup: EconomicSetup, stats: Any = None) -> None:
        self._setup = setup
        self._stats = stats
        self.lends_clocks = stats is not None
        self._links: ItemLinks | None = None
        self.num_item_workers = setup.worker.num_workers
        self.labels = [WorkerLabel(ITEM, i) for i in range(self.num_item_workers)]
        self.labels += [WorkerLabel(BATCH, b) for b in range(setup.num_batch_workers)]

    def picklable_parts(self) -> dict[str, Any]:
        return picklable_parts(self._setup.worker)

    def process_launches(self, ctx: Any, channels: ProcessChannels) -> list[WorkerLaunch]:
        links = self._links = ItemLinks(self.num_item_workers, self._setup.num_batch_workers)
        # A forked child inherits every end of the mesh and must close the ones it does not own;
        # spawn and forkserver children receive only their own.
        inherited = links if ctx.get_start_method() == "fork" else None
        launches = []
        for item_id in range(self.num_item_workers):
            inbox, outbox = channels.worker_ends(item_id)
            deliveries = links.outbox(item_id)
            args = (self._setup, item_id, inbox, outbox, deliveries, inherited)
            launches.append(WorkerLaunch(run_item_process, args, f"pipeload-item-worker-{item_id}",
                                         (inbox, outbox, deliveries)))
        for batch_id in range(self._setup.num_batch_workers):
            tasks, outbox = channels.worker_ends(self.num_item_workers + batch_id)
            inbox = links.inbox(batch_id, tasks)
            args = (self._setup, batch_id, inbox, outbox, inherited)
            launches.append(WorkerLaunch(run_batch_process, args, f"pipeload-batch-worker-{batch_id}",
                                         (inbox, outbox)))
        return launches

    def thread_launches(self, channels: ThreadChannels, stop: threading.Event) -> list[WorkerLaunch]:
        first_batch = self.num_item_workers
        batch_inboxes = [channels.worker_ends(first_batch + b)[0]
                         for b in range(self._setup.num_batch_workers)]
        launches = []
        for item_id in range(self.num_item_workers):
            inbox, outbox = channels.worker_ends(item_id)
            args = (self._setup, item_id, inbox, outbox, ThreadItemOutbox(batch_inboxes), stop,
                    self._lend(ITEM, item_id))
            launches.append(WorkerLaunch(run_item_thread, args, f"pipeload-item-worker-{item_id}"))
        for batch_id, inbox in enumerate(batch_inboxes):
            outbox = channels.worker_ends(first_batch + batch_id)[1]
            args = (self._setup, batch_id, inbox, outbox, stop, self._lend(BATCH, batch_id))
            launches.append(WorkerLaunch(run_batch_thread, args, f"pipeload-batch-worker-{batch_id}"))
        return launches

    def close(self) -> None:
        if self._links is not None:
            self._links.close()

    def _lend(self, kind: str, worker_id: int) -> Any:
        return self._stats.lend_clock(worker_id, kind) if self._stats is not None else None


class EconomicEngine:
    """Schedules items and batches over the two kinds of workers and yields batches in sampler
    order (or as they finish with ``in_order=False``).

    Driven by one thread at a time (the caller of ``next_batch``).
    Invariants, between calls:
      - ``ledger.outstanding <= prefetch_factor``: batches opened and not yet yielded, whether
        waiting for their first piece to go out (their ``COLLATE`` then waits in
        ``_to_collate``), gathering, collating, or waiting their turn;
      - ``_placements`` holds where the items go for batches whose ``COLLATE`` carried an item
        area and that have not answered yet;
      - so the items in flight (waiting in the scheduler, or in an item worker's hands, or on
        their way to a batch worker) never exceed the items of those batches:
        ``prefetch_factor * batch_size`` with a fixed batch size;
      - ``next_position`` is the number of samples in the batches opened this epoch (the next
        batch's first seed position);
      - ``_unopened`` is an empty batch taken from the sampler whose ``COLLATE`` could not be
        sent yet (a full task pipe and a timeout): it is opened first next time.
    """

    def __init__(self, config: EconomicConfig) -> None:
        self._config = config
        self._numbered = config.numbered and not config.in_order
        setup = config.setup
        self._num_item_workers = setup.worker.num_workers
        fetch = setup.worker.fetch
        self._sub_batches = fetch.auto_collation and not fetches_items_one_by_one(fetch.dataset)
        # Item workers write items straight into their batch's slab once their size is known:
        # only for default_collate, whose stack of them is then a view (see ItemPlacement).
        self._places_items = (config.worker_type == "process" and fetch.auto_collation
                              and fetch.collate_fn is default_collate)
        self._item_bytes: tuple[int, ...] | None = None
        self._last_batch_items = 0  # the length of the last batch opened
        self._pace = ItemPace(self._num_item_workers)  # the item workers' time per item, to cut pieces
        self._heard_items = False  # an item worker has reported a piece this session
        self._stats = None
        if config.stats is not None:  # item workers report ITEMS_DONE; batch workers, batches
            kinds = {Report.ITEMS_DONE: ITEM, Report.BATCH: BATCH, Report.FAILED: BATCH}
            self._stats = config.stats.new_session(config.prefetch_factor, kinds)
        # Batches in flight: prefetch_factor at most, fewer when the training loop is slower than
        # the pool builds batches (engine/budget.py, as in classic mode). In order, the first
        # wave is one batch, built by every item worker (a second one would only hold a slab
        # before the first is out); more go out once the consumer's pace is known. Out of order,
        # batches in flight are what lets the others overtake a slow one: all of them fly.
        keeper = self._keeper = config.slab_keeper if config.worker_type == "process" else None
        if keeper is not None and self._places_items:
            # What the last set of workers learnt: this set's first batch is laid out at once.
            self._item_bytes = keeper.item_layout
        if keeper is not None:
            self._pace.item_s = keeper.item_s
        max_bytes = shm_budget_bytes(config.max_shm_bytes, keeper.held_bytes if keeper else 0)
        first_wave = 1 if config.in_order else config.prefetch_factor
        self._budget = InFlightBudget(config.prefetch_factor, first_wave, max_bytes,
                                      tolerated_wait=POOL_TOLERATED_WAIT,
                                      pace=keeper.pace if keeper is not None else None)
        # Batch workers collate into slabs, as classic workers do (item workers fill them): the
        # batches in flight and the one the consumer holds. The batch a ``for`` loop is dropping
        # needs no slab of its own: the next batch is granted its slab, and written once it is
        # released (see slab_pool.py), pinned slabs too (their releases land from a watcher
        # thread once the copies out of them are done). ``_top_up`` follows the budget.
        slab_settings = SlabSettings(config.pin_slabs, max_bytes, config.prefetch_factor + 1,
                                     loop_floor_slabs(config.max_shm_bytes))
        # Item worker 0 starts now; the others as their first pieces go out (the first ones
        # fetch while the rest are forked), all of them by the end of start_epoch, where the
        # sampler's draws change nothing they could see (else all start now, as in a classic
        # pool: see PoolConfig.forks_as_tasks_go). A batch worker starts when the first batch
        # it collates is sent to it: one whose batches the
        # main process assembles (direct_batches.py) never starts. Spawned ones (a second or more
        # each, importing torch) start with the item workers when the loader's last set needed
        # them: in the middle of an epoch their start would hold up the batches routed to them.
        # Otherwise they wait too: spawned up front, on 2 CPUs, they doubled the first batch's
        # wait (2 item workers and 2 batch workers importing torch at once), past a `timeout`
        # torch's two spawned workers met.
        forked = (config.mp_context or multiprocessing.get_context()).get_start_method() == "fork"
        known_needed = keeper is not None and keeper.batch_workers_started
        on_demand = None if known_needed and not forked else self._num_item_workers
        self._workers = WorkerGroup(EconomicLaunch(setup, self._stats), config.worker_type, config.mp_context,
                                    config.timeout_s, slab_settings, self._stats,
                                    start_first=1 if config.forks_as_tasks_go else None,
                                    keeper=keeper, on_demand_from=on_demand,
                                    short_lived=config.stop_when_done)
        self._finalizer = weakref.finalize(self, self._workers.close)
        self._epoch = setup.worker.first_epoch - 1
        self._started = False
        # Whether this loader's samples go as columns, as the last set of workers found: a loader
        # whose samples do not sends its first batch to a batch worker at once.
        self._direct = DirectBatches(refused=keeper is not None and keeper.direct_refused)
        self._reset_epoch_state(TaskSupply())

    @property
    def workers(self) -> list[Any]:
        """Handles of the item workers, then the batch workers."""
        return self._workers.handles

    @property
    def closed(self) -> bool:
        return self._workers.closed

    def start_epoch(self, tasks: Iterator[Any], shared_seed: int | None = None,
                    start: EpochStart = EpochStart()) -> None:
        """Begin an epoch over ``tasks`` (each a list of indices, or one index).

        ``shared_seed`` reseeds the workers' DataPipe graphs for a persistent session's new epoch;
        ``start`` continues an epoch cut short (a resumed checkpoint): batch numbers and item
        positions, which the seeds derive from, go on from where it was.
        """
        if self._started:
            self._workers.start_epoch(self._epoch + 1, shared_seed)
        self._started = True
        self._epoch += 1
        self._reset_epoch_state(TaskSupply(tasks), start)
        self._budget.epoch_started()
        try:
            self._top_up()
        finally:
            # Every item worker, before anything is received (the batch workers: on demand).
            self._workers.start_all()

    def next_batch(self) -> Any:
        """The next batch; raises StopIteration when the epoch is over.

        As in classic mode: a batch whose item or collation failed raises the worker's exception
        when its turn comes, and the next call goes on with the following batch; a timeout leaves
        everything as it was; anything else (a dead worker, Ctrl-C) closes the engine first.
        """
        try:
            return hand_out(self._next_report, self.close, self._supply, self._numbered,
                            self._workers.mark_failed)
        except StopIteration:
            if self._config.stop_when_done:  # this set ends with the epoch: see WorkerGroup
                self._workers.all_answered()
            raise

    def close(self) -> None:
        if self._keeper is not None and not self.closed:
            self._keeper.pace = self._budget.pace() or self._keeper.pace  # for the next set
            self._keeper.item_layout = None if self._direct.refused else self._item_bytes
            self._keeper.direct_refused = self._direct.refused
            self._keeper.batch_workers_started = len(self._workers.handles) > self._num_item_workers
            self._keeper.item_s = self._pace.item_s  # started from the keeper's: never lost
        self._finalizer()
        # A closed engine can live on inside an exception's traceback: drop the batches it holds.
        self._reset_epoch_state(TaskSupply())
        if self._stats is not None:
            self._stats.close()

    def _reset_epoch_state(self, supply: TaskSupply, start: EpochStart = EpochStart()) -> None:
        self._supply = supply
        self._ledger = BatchLedger(self._config.setup.num_batch_workers, self._config.in_order,
                                   least_loaded=True, first_batch=start.first_batch)
        if self._stats is not None:
            self._ledger.count_samples()  # each batch's samples: exact stats with sizes that vary
        self._scheduler = ItemScheduler(self._num_item_workers, self._sub_batches)
        self._pace.forget_epoch()
        self._first_batch = start.first_batch
        self._next_position = start.first_position
        self._unopened: tuple[int, list[Any]] | None = None
        self._placements: dict[int, ItemPlacement] = {}  # batch number -> where its items go
        # Batches the main process assembles (see direct_batches.py); whether the session still
        # makes them outlives the epoch.
        self._direct = self._direct.next_epoch()
        self._to_collate: dict[int, tuple[int, list[Any]]] = {}  # opened, COLLATE not yet sent
        self._build_clock = PoolBuildClock()
        # The batch number at which the stats look at the queue next (see _hand_over), as the
        # classic pool keeps it: an untimed hand-out costs one comparison, stats on or off. The
        # numbers start again each epoch.
        self._next_look = start.first_batch if self._stats is not None else math.inf

    def _next_report(self) -> WorkerReport | None:
        """The next report to hand out, or None once every batch sent has been handed out."""
        # One deadline per batch: item reports keep arriving while a batch is late, and must
        # not keep the loader's timeout from firing.
        deadline = self._workers.deadline()
        self._budget.request_started()
        waited_since = 0.0
        while True:
            report = self._ledger.pop_ready()
            if report is not None:
                waited_s = time.perf_counter() - waited_since if waited_since else 0.0
                self._hand_over(report, waited_since > 0 and report.setup_s == 0, waited_s)
                return report
            if self._ledger.nothing_left():
                return None
            waited_since = waited_since or time.perf_counter()
            # Out of order, the loop takes whichever batch is done first: while it waits, every
            # batch the ceiling allows flies, so that the others overtake a late one. The budget
            # cannot see the need: the pool's build times stop with the late batch, which can
            # leave it at one batch in flight (the one the loop is waiting for) for good.
            if not self._config.in_order:
                self._top_up(loop_waits=True)
            for report in self._workers.receive(deadline):
                self._record(report)
            self._top_up()

    def _hand_over(self, report: WorkerReport, starved: bool, waited_s: float) -> None:
        """Book-keeping as batch ``report`` goes to the consumer; then open what the budget allows."""
        if report.batch_number >= self._next_look:  # sampled: see SessionStats.handing_out
            self._next_look = self._stats.handing_out(  # type: ignore[union-attr]
                len(self._ledger.arrived), self._ledger.outstanding, report.batch_number)
        if self._workers.slabs is not None:
            self._workers.slabs.handed_out(report.batch_number)
        self._budget.request_served(starved, waited_s)
        try:
            self._top_up()
        except LoaderTimeoutError:
            pass  # a task pipe stayed full; what was not sent goes out on the next call
        self._budget.consumer_resumes()  # after sending: the consumer's time starts now

    def _record(self, report: WorkerReport) -> None:
        if report.report is Report.ITEMS_DONE:
            self._scheduler.record_done(report.worker_id)
            self._pace.reported(report.worker_id, report.payload.count, report.finished_at or time.monotonic())
            if self._stats is not None and report.totals is None:
                self._stats.items_reported(report.worker_id, report.payload.count)
            self._heard_items = True
            done = report.payload
            learnt = done.item_bytes is not None and self._item_bytes is None
            if done.item_bytes is not None:
                self._item_bytes = done.item_bytes
            self._direct.learn(done)
            if done.groups is not None:
                samples = self._direct.size_of(report.batch_number) if self._stats is not None else 0
                assembled = self._direct.add(report.batch_number, done, self._workers.slabs)
                if assembled is not None:
                    if self._stats is not None and assembled.report is Report.BATCH:
                        self._stats.assembled(samples)
                    self._record(assembled)
            if learnt and self._may_go_direct():
                self._lay_out_batches_without_slab()
        elif report.report in (Report.BATCH, Report.FAILED):
            self._placements.pop(report.batch_number, None)
            # The worker's own time (one clock machine-wide): a report read only when the
            # training loop comes back for it would make every build look a step long.
            finished_at = report.finished_at or time.monotonic()
            build_s = self._build_clock.arrived(report.batch_number, finished_at)
            if report.report is Report.BATCH:
                self._budget.batch_built(build_s)
            if self._stats is not None:  # in the order the worker built them (see the stats)
                samples = self._ledger.samples_of.get(report.batch_number, 0)  # type: ignore[union-attr]
                self._stats.batch_reported(report.worker_id, samples, report.totals is not None)
            self._ledger.record_report(report)

    def _lay_out_batches_without_slab(self) -> None:
        """Now that the items' size is known, give each direct batch opened without a slab (the
        session's first, which the probe's piece opened: see ``_send_pieces``) one, so that its
        pieces still to go are written at their places instead of travelling as samples."""
        for number, count in self._direct.without_slab():
            area = self._item_area(count)
            if area is None:
                continue  # a batch that would ride inside its message: its samples come as they are
            self._workers.slabs.observe_batch(area.area_bytes)  # as _send_collate sizes the slab
            grant = self._direct_grant(number, count)
            if grant is not None:
                self._direct.give_slab(number, grant.slab_id, grant.items)

    def _top_up(self, loop_waits: bool = False) -> None:
        """Open batches while the budget allows (``loop_waits``: as many as its ceiling allows),
        then give waiting pieces to item workers."""
        slabs = self._workers.slabs
        batch_bytes = slabs.batch_bytes if slabs is not None else 0
        # Until the consumer's pace is known the budget keeps one batch in flight; small batches
        # (a slab of a few MiB each) fly to the ceiling at once instead, as classic mode's inline
        # batches do: one alone leaves the item workers that finish its pieces first idle until
        # it is handed out, twice over at the start of every fresh loader.
        expected = batch_bytes or self._expected_batch_bytes()
        unpaced_small = 0 < expected < LARGE_BATCH_BYTES and not self._budget.knows_pace()
        allowed = (self._budget.most(expected) if loop_waits or unpaced_small
                   else self._budget.allowed(batch_bytes))
        if slabs is not None:
            # In flight, plus the batch the consumer holds, plus (unless its slab can be granted
            # on release) the one it is dropping. Free slabs beyond it are retired. A batch
            # opened while more were allowed is counted in flight: its slab is granted only as
            # its first piece goes out, and with the pace learnt meanwhile (fewer in flight) it
            # found none and went to a batch worker, started for it.
            in_flight = max(allowed, self._ledger.outstanding)
            slabs.set_in_flight(in_flight, grants_ahead=1)  # item workers write at once
        while not self._supply.done and self._ledger.outstanding < allowed:
            if self._unopened is None:
                task = self._supply.take()
                if self._supply.done:
                    break
                try:
                    indices = list(task) if self._config.setup.worker.fetch.auto_collation else [task]
                except TypeError:  # a batch sampler's batch that is no indices (an int, None)
                    self._fail_in_turn(task)
                    continue
                self._unopened = (self._ledger.choose_worker(), indices)
            self._open_batch(*self._unopened)
            self._unopened = None
        self._send_pieces()

    def _fail_in_turn(self, task: Any) -> None:
        """A batch that cannot be cut into items (``task``: what the batch sampler gave, with the
        TypeError being handled) fails when its turn comes, and the epoch goes on: as torch's
        worker fails at such a batch, where ending the epoch here lost the batches around it."""
        failure = RemoteFailure.capture(0, "cutting the batch sampler's batch into items", task,
                                        where="in the main process")
        number = self._ledger.next_to_send
        worker = self._ledger.choose_worker()
        self._ledger.record_sent(worker, 0)
        self._build_clock.opened(number, time.monotonic())
        self._record(WorkerReport(Report.FAILED, worker, number, failure))

    def _expected_batch_bytes(self) -> int:
        """A batch's bytes in its slab, from the items' size and the last batch's length, before
        any slab has been sized (0: not known yet)."""
        if self._item_bytes is None:
            return 0
        return sum(self._item_bytes) * self._last_batch_items

    def _open_batch(self, batch_worker: int, indices: list[Any]) -> None:
        """Count the batch as sent to its batch worker and queue its pieces. Its ``COLLATE``
        goes out with its first piece (see ``_send_collate``); an empty batch's at once, and if
        that send times out, nothing is recorded: ``_unopened`` keeps the batch for next time."""
        number = self._ledger.next_to_send
        self._to_collate[number] = (batch_worker, indices)
        self._last_batch_items = len(indices)
        if not indices:
            try:
                self._send_collate(number)
            except LoaderTimeoutError:
                del self._to_collate[number]
                raise
        self._ledger.record_sent(batch_worker, len(indices))
        self._build_clock.opened(number, time.monotonic())
        self._scheduler.add_batch(number, batch_worker, indices, self._next_position,
                                  least=self._least_piece_items(number, len(indices)))
        self._next_position += len(indices)

    def _least_piece_items(self, number: int, count: int) -> int:
        """The fewest items a piece of batch ``number`` (of ``count`` items) holds: more than one
        only for items so cheap that finely cut pieces would keep this process busy with their
        messages (item_scheduler.py), and never in the epoch's first batch (only how
        soon it is complete counts) or a batch whose slab is known to be large (its items cost
        their workers far more than a piece's messages cost us, and a large batch built by
        fewer workers would hold its slab longer)."""
        item_s = self._pace.item_s
        if number == self._first_batch or item_s is None:
            return 1
        if not messages_would_busy_main(item_s, self._num_item_workers, count):
            return 1
        slabs = self._workers.slabs
        # _open_batch has just made ``count`` the last batch's length, which this reads.
        expected = (slabs.batch_bytes if slabs is not None else 0) or self._expected_batch_bytes()
        if expected >= LARGE_BATCH_BYTES:
            return 1
        return least_items(count, self._num_item_workers, self._config.prefetch_factor)

    def _send_collate(self, number: int, first_piece: bool = False) -> None:
        """Tell a batch worker what batch ``number`` holds, with the slab to collate it into; or,
        for a direct batch (``first_piece``: none of its pieces has gone out yet), keep that for
        the main process to assemble it (direct_batches.py).

        Sent just before the batch's first piece, not when the batch opens: by then the first
        items of the epoch may have told us their size, so the items of all but the first batch
        or two can be written straight into the slab (see ItemPlacement).
        """
        batch_worker, indices = self._to_collate[number]
        slot, slabs = self._num_item_workers + batch_worker, self._workers.slabs
        area = self._item_area(len(indices))
        if area is not None:  # size the slab for the items before the first batch worker's answer does
            slabs.observe_batch(area.area_bytes)
        if first_piece and self._may_go_direct() and self._opened_direct(number, area):
            return
        grant = None
        if slabs is not None:
            grant = self._placed_grant(number, slot, len(indices)) if area is not None else slabs.grant(slot, number)
        collate = WorkerCommand(Command.COLLATE, number, indices, epoch=self._epoch, grant=grant)
        self._workers.send(slot, collate)
        del self._to_collate[number]

    def _item_area(self, count: int) -> ItemPlacement | None:
        """Where ``count`` items of the known size would lie in a batch's slab; None when their
        size is not known yet, when items are not placed (see ``_places_items``), or when their
        whole batch would travel inside its message (not worth a slab)."""
        if not self._places_items or self._item_bytes is None or self._workers.slabs is None:
            return None
        area = item_placement(self._item_bytes, count, 1 << 62)
        return area if area is not None and area.area_bytes > INLINE_MAX_BYTES else None

    def _opened_direct(self, number: int, area: ItemPlacement | None) -> bool:
        """Open batch ``number`` as direct if it can be: laid out in a slab granted to the main
        process when the items' size is known; before that (the session's first batch), with
        no slab, its samples coming with the item workers' reports for the main process to
        collate, once, rather than fork a batch worker for it."""
        batch_worker, indices = self._to_collate[number]
        if self._item_bytes is None:
            batch = DirectBatch(batch_worker, indices)
        elif area is None:
            return False  # items that ride in their messages: a batch worker collates them
        else:
            grant = self._direct_grant(number, len(indices))
            if grant is None:
                return False  # it did not fit: a batch worker's grant
            batch = DirectBatch(batch_worker, indices, grant.slab_id, grant.items)
        self._direct.open(number, batch)
        del self._to_collate[number]
        return True

    def _direct_grant(self, number: int, count: int) -> SlabGrant | None:
        """A slab for direct batch ``number`` granted to the main process, with the places of
        its ``count`` items; None, with nothing held, when none fits them. No batch worker will
        write into it: the slab is announced to item workers alone."""
        grant = self._placed_grant(number, None, count)
        if grant is not None and grant.items is not None:
            return grant
        self._workers.slabs.settle(number, GrantOutcome.UNUSED)
        self._placements.pop(number, None)
        return None

    def _placed_grant(self, number: int, producer: int | None, count: int) -> SlabGrant | None:
        """A slab for batch ``number``, granted to ``producer`` (None: the main process), with
        the place of each of its ``count`` items in it when they fit."""
        slabs = self._workers.slabs
        grant = slabs.grant(producer, number, shared=True)  # item workers write their items there
        if grant is None:
            return None
        placement = item_placement(self._item_bytes, count, slabs.granted_size(number))
        if placement is None:
            return grant
        self._placements[number] = placement
        return SlabGrant(grant.slab_id, grant.releases, grant.controls, placement)

    def _may_go_direct(self) -> bool:
        """Whether the main process may assemble batches now (direct_batches.py): items are
        placed (process workers, ``default_collate``), no piece has shown samples that are not
        flat and alike, and ``default_collate`` (not extended by the user) would only name the
        items' runs. Read at each batch: the map can change between epochs."""
        return self._places_items and self._direct.allowed and collates_as_shipped()

    def _send_pieces(self) -> None:
        # Until the first piece of the session is reported, item sizes are unknown (unless the
        # last set of workers learnt them): each item worker gets one piece, so that the next
        # pieces can be written into their slab, and the first batch's COLLATE, if it has one,
        # waits for that report (or for its last piece).
        learning = self._places_items and self._item_bytes is None and not self._heard_items
        self._scheduler.pieces_in_hand = 1 if learning else PIECES_IN_HAND
        # A first batch that goes direct gives each item worker one item alone instead (a
        # probe), and nothing more until the first answers: the rest of the batch is then
        # written into a slab, where before all of it came as samples with the reports, pickled
        # through the item workers' pipes and stacked again here (a copy of the batch each way:
        # about 50 ms of CPU a fresh loader on pipeload bench's JPEGs). Every item worker gets
        # one, as it warms up (a fresh worker's first item took 30 ms there, its next ones under
        # 1 ms). Not for ``__getitems__`` datasets: their seeds follow the cut of a batch into
        # calls, which must not depend on what a session knew when it began.
        probing = learning and not self._sub_batches and self._may_go_direct()
        while (piece := self._scheduler.next_piece(1 if probing else None)) is not None:
            try:
                number = piece.batch_number
                # Direct only if none of its pieces has gone to the batch worker yet; a batch
                # whose items' size is not known yet goes direct at once, as samples.
                first = piece.slot == 0
                if number in self._to_collate and (
                        not learning or self._scheduler.last_of(number)
                        or (first and self._item_bytes is None and self._may_go_direct())
                        or not self._workers.started(self._num_item_workers + piece.batch_worker)):
                    # A batch worker not started yet (forked on demand) starts with its COLLATE:
                    # held back, an item worker blocked handing it a large item before any report
                    # (a later epoch of items that are not flat, whose batches cannot go direct).
                    self._send_collate(number, first_piece=first)
                route = ItemRoute(piece.batch_worker, piece.slot, piece.position, number in self._direct)
                fetch = WorkerCommand(Command.FETCH_ITEMS, piece.batch_number, piece.indices,
                                      epoch=self._epoch, route=route, grant=self._item_grant(piece))
                self._workers.send(piece.item_worker, fetch)
                self._pace.sent(piece.item_worker, time.monotonic())
            except LoaderTimeoutError:
                self._scheduler.give_back(piece)  # it goes out first next time
                raise

    def _item_grant(self, piece: Piece) -> SlabGrant | None:
        """A share of the batch's slab for ``piece``'s items, at their places; None: fresh memory."""
        placement = self._placements.get(piece.batch_number)
        if placement is None:
            return None
        shared = self._workers.slabs.share_grant(piece.batch_number, piece.item_worker)
        if shared is None:
            return None
        # Built field by field: dataclasses.replace looks every field up again (twice a piece).
        share = shared[0]
        items = ItemPlacement(placement.leaf_offsets, placement.leaf_bytes, placement.area_bytes, piece.slot)
        return SlabGrant(share.slab_id, share.releases, share.controls, items)
