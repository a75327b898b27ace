"""The pool engine: N workers (processes or threads), each builds whole batches, as torch does.

One instance serves one epoch, or every epoch of a loader with ``persistent_workers=True``.
"""

from __future__ import annotations

import dataclasses
import math
import operator
import threading
import time
import weakref
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

from pipeload.engine.budget import InFlightBudget, loop_floor_slabs, shm_budget_bytes
from pipeload.engine.epoch_flow import TaskSupply, hand_out
from pipeload.engine.lifecycle import WorkerLaunch
from pipeload.engine.plan import DatasetKind, EpochStart, WorkerSetup
from pipeload.engine.reorder import BatchLedger
from pipeload.engine.worker_main import run_process_worker, run_thread_worker
from pipeload.engine.workers import SlabSettings, WorkerGroup, WorkerLabel
from pipeload.errors import LoaderTimeoutError, WorkerDiedError
from pipeload.transport.channel import ProcessChannels, ThreadChannels
from pipeload.transport.messages import Command, Report, WorkerCommand, WorkerReport
from pipeload.transport.slab_keeper import SlabKeeper


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
        stats: the loader's ``StatsRecorder`` (None: stats are off).
        max_shm_bytes: the most shared memory slabs may hold and batches in flight may need
            (None: half of what the memory backing them can still take).
        pin_slabs: page-lock slabs for CUDA, so batches come out pinned with no copy.
        numbered: with ``in_order=False``, hand each batch out as a ``NumberedBatch`` (and
            attach its number to a failed batch's error): which batches an out-of-order epoch
            has handed out is then a set, which the loader's checkpoints record.
        batch_sizes: what each epoch's batches hold (``samplers.batch_sizes``), read as each
            later epoch of a persistent session starts: see ``WorkerSetup.batch_sizes``.
        slab_keeper: the loader's ``SlabKeeper``, which keeps its slab pool and the budget's
            pace between the sets of workers it starts (None: the pool is the engine's own).
        stop_when_done: this engine serves one epoch (no persistent workers): a process worker
            that will get no more tasks is asked to stop as soon as it has answered them all,
            so that it exits while the loop takes the last batches (see ``_let_done_workers_go``).
        forks_as_tasks_go: the sampler's draws change nothing a worker could see
            (``samplers.draws_unseen_by_workers``): process worker 0 forks first and the others
            as their first tasks go out. Otherwise all fork before the first draw, as torch's.
    """

    setup: WorkerSetup
    prefetch_factor: int
    in_order: bool
    timeout_s: float
    worker_type: str
    mp_context: Any
    stats: Any = None
    max_shm_bytes: int | None = None
    pin_slabs: bool = False
    numbered: bool = False
    batch_sizes: Callable[[], tuple[int, int | None] | None] = lambda: None
    slab_keeper: SlabKeeper | None = None
    stop_when_done: bool = False
    forks_as_tasks_go: bool = False


class ClassicLaunch:
    """What the pool's workers run: the classic worker loop, one whole batch per task.

    A :class:`~pipeload.engine.workers.GrowingPlan`: under ``num_workers="auto"`` the pool
    grows and shrinks in place, and workers started later get the setup as it is then.
    """

    def __init__(self, setup: WorkerSetup, stats: Any = None) -> None:
        self._setup = setup
        self._stats = stats  # the pool's SessionStats: thread workers lend it their clocks
        self.lends_clocks = stats is not None
        self.labels = [WorkerLabel("", worker_id) for worker_id in range(setup.num_workers)]

    def resize(self, count: int, epoch: int | None = None) -> None:
        first_epoch = self._setup.first_epoch if epoch is None else epoch
        self._setup = dataclasses.replace(self._setup, num_workers=count, first_epoch=first_epoch)
        self.labels = [WorkerLabel("", worker_id) for worker_id in range(count)]

    def epoch_sizes(self, sizes: tuple[int, int | None] | None) -> None:
        """What the current epoch's batches hold: workers started later (a pool grown in place)
        begin with it."""
        self._setup = dataclasses.replace(self._setup, batch_sizes=sizes)

    def picklable_parts(self) -> dict[str, Any]:
        return picklable_parts(self._setup)

    def process_launches(self, ctx: Any, channels: ProcessChannels, first: int = 0) -> list[WorkerLaunch]:
        launches = []
        for worker_id in range(first, self._setup.num_workers):
            inbox, outbox = channels.worker_ends(worker_id)
            launches.append(WorkerLaunch(run_process_worker, (self._setup, worker_id, inbox, outbox),
                                         f"pipeload-worker-{worker_id}", (inbox, outbox)))
        return launches

    def thread_launches(self, channels: ThreadChannels, stop: threading.Event,
                        first: int = 0) -> list[WorkerLaunch]:
        launches = []
        for worker_id in range(first, self._setup.num_workers):
            inbox, outbox = channels.worker_ends(worker_id)
            lend = self._stats.lend_clock(worker_id) if self._stats is not None else None
            launches.append(WorkerLaunch(run_thread_worker, (self._setup, worker_id, inbox, outbox, stop, lend),
                                         f"pipeload-worker-{worker_id}"))
        return launches

    def close(self) -> None:
        pass  # owns nothing beyond the group's channels


def picklable_parts(setup: WorkerSetup) -> dict[str, Any]:
    """The user's objects a spawned worker receives, by the argument names the user gave them."""
    return {
        "dataset": setup.fetch.dataset,
        "collate_fn": setup.fetch.collate_fn,
        "worker_init_fn": setup.worker_init_fn,
    }


class PoolEngine:
    """Sends tasks round-robin to workers, keeps at most ``prefetch_factor * num_workers`` in
    flight (fewer when the training loop is slower than the workers: see ``engine/budget.py``),
    and yields the results in sampler order (or as they finish with ``in_order=False``).

    Driven by one thread at a time (the caller of ``next_batch``).
    Invariants, between calls: ``_unsent`` is a task taken from the sampler whose send timed out
    (it goes out first next time, to the same worker, with the same slab grant); ``_supply`` keeps
    what the sampler raised until every batch sent before it has been yielded.
    """

    def __init__(self, config: PoolConfig) -> None:
        self._config = config
        self._numbered = config.numbered and not config.in_order
        num_workers = config.setup.num_workers
        max_batches = config.prefetch_factor * num_workers
        keeper = self._keeper = config.slab_keeper if config.worker_type == "process" else None
        max_bytes = shm_budget_bytes(config.max_shm_bytes, keeper.held_bytes if keeper else 0)
        self._budget = InFlightBudget(max_batches, num_workers, max_bytes,
                                      pace=keeper.pace if keeper is not None else None)
        self._stats = config.stats.new_session(max_batches) if config.stats else None
        # The batch number at which the stats look at the queue next (see _hand_over): kept
        # here, not on the stats, so that an untimed hand-out costs one comparison whether stats
        # are on or off.
        self._next_look = 0 if self._stats is not None else math.inf
        slabs = SlabSettings(config.pin_slabs, max_bytes, max_batches + 1, loop_floor_slabs(config.max_shm_bytes))
        # Workers' tasks are counted by the ledger, which counts each worker's answers anyway.
        self._ledger_counts = self._stats is not None
        # A map-style task's samples are known here (its indices): counted as its answer comes,
        # the stats need not guess them from the worker's timed tasks (batch sizes may vary).
        fetch = config.setup.fetch
        self._samples_counted = self._ledger_counts and fetch.kind is DatasetKind.MAP
        self._one_sample_a_task = not fetch.auto_collation
        # Where the sampler's draws change nothing a worker sees, process worker 0 starts now and
        # the others as their first tasks go out (all of them by the end of start_epoch): worker
        # 0 builds its first batch while the main process forks the next. Forked all at once, it
        # waits for its first task until every fork is done (7 to 10 ms a fork with torch
        # imported, one after the other: n workers, n forks before any batch is begun, in every
        # epoch of a loader without persistent workers).
        start_first = 1 if config.worker_type == "process" and config.forks_as_tasks_go else None
        self._workers = WorkerGroup(ClassicLaunch(config.setup, self._stats), config.worker_type,
                                    config.mp_context, config.timeout_s, slabs, self._stats,
                                    start_first=start_first, counted_by_engine=self._ledger_counts,
                                    keeper=keeper, short_lived=self._ends_with_its_sampler(config))
        self._finalizer = weakref.finalize(self, self._workers.close)
        self._epoch = config.setup.first_epoch - 1
        self._started = False
        self._ledger = self._new_ledger(num_workers)
        self._count_answers()
        self._supply = TaskSupply()
        self._unsent: tuple[int, WorkerCommand] | None = None
        self._num_workers = num_workers  # those that take new tasks (see resize)
        self._shrinking = False  # workers beyond them still run, to be stopped once idle
        self._prefetch_factor = config.prefetch_factor
        self._stop_when_done = config.stop_when_done and config.worker_type == "process"

    def _tell_the_last_batch(self) -> None:
        """The first epoch's last batch number, for the workers' stats, where they started
        without it: a length that runs the user's code is asked only once they have started,
        as torch asks it (``samplers/_lengths.py``)."""
        given = self._config.setup.batch_sizes
        if given is None or given[1] is not None:
            return
        sizes = self._config.batch_sizes()
        if sizes is None or sizes[1] is None:
            return
        self._workers.plan.epoch_sizes(sizes)  # type: ignore[attr-defined]
        self._workers.tell_last_batch(sizes[1])

    @staticmethod
    def _ends_with_its_sampler(config: PoolConfig) -> bool:
        """Whether the workers go when a map-style epoch ends (no persistent workers); an
        iterable dataset's epoch may go on for the whole run."""
        return config.stop_when_done and config.setup.fetch.kind is DatasetKind.MAP

    @property
    def workers(self) -> list[Any]:
        return self._workers.handles

    @property
    def closed(self) -> bool:
        return self._workers.closed

    @property
    def epoch(self) -> int:
        """The session's current epoch number (1 for the first)."""
        return self._epoch

    def resize(self, num_workers: int, prefetch_factor: int) -> None:
        """Run ``num_workers`` workers with ``prefetch_factor`` batches each in flight from now
        on (``num_workers="auto"``), in place: the running workers go on with what they hold.

        Growing starts the new workers beside them and hands them tasks as their turn comes
        (the first new ones right away). Shrinking stops handing tasks to the workers beyond
        ``num_workers``; each is stopped once it has handed in what it holds. A lower prefetch
        bound takes effect as the batches in flight are handed out. The in-flight budget may
        still keep fewer for a slow training loop. Batches keep their numbers, and so their
        order and per-batch seeds, whichever worker builds them.
        """
        if num_workers > len(self._workers.handles):
            try:
                self._workers.grow(num_workers, max(self._epoch, self._config.setup.first_epoch))
            except BaseException:
                self.close()  # a worker that could not start (fork failed): as a dead one
                raise
        self._num_workers, self._prefetch_factor = num_workers, prefetch_factor
        self._ledger.resize(num_workers)
        self._budget.set_max_batches(prefetch_factor * num_workers)
        if self._stats is not None:
            self._stats.resized(prefetch_factor * num_workers)
        self._shrink_when_idle()

    def _shrink_when_idle(self) -> None:
        """Stop the workers beyond ``_num_workers`` once they hold nothing (see resize)."""
        count = self._num_workers
        self._shrinking = count < len(self._workers.handles)
        if not self._shrinking or not self._ledger.idle_from(count):
            return
        if self._unsent is not None and self._unsent[0] >= count:
            return  # it goes out to its worker first, and comes back
        self._workers.shrink(count)
        self._ledger.forget_from(count)
        self._shrinking = False

    def start_epoch(self, tasks: Iterator[Any], shared_seed: int | None = None,
                    start: EpochStart = EpochStart()) -> None:
        """Begin an epoch over ``tasks`` (each a list of indices, or one index).

        ``shared_seed`` reseeds the workers' DataPipe graphs for a persistent session's new epoch;
        ``start`` continues an epoch cut short (a resumed checkpoint).
        """
        first = not self._started
        if not first:
            self._send_what_torch_sends_ahead()
            sizes = self._config.batch_sizes()
            last = sizes[1] if sizes is not None and sizes[1] is not None else -1
            self._workers.plan.epoch_sizes(sizes)  # type: ignore[attr-defined]
            self._workers.start_epoch(self._epoch + 1, shared_seed, last)
        self._started = True
        self._epoch += 1
        self._supply = TaskSupply(tasks)
        self._unsent = None
        self._ledger = self._new_ledger(len(self._workers.labels), start)
        self._ledger.resize(self._num_workers)
        self._count_answers()
        self._shrink_when_idle()  # the old epoch's tasks are answered or dropped by now
        self._budget.epoch_started()
        if self._stats is not None:
            self._next_look = start.first_batch  # the numbers start again each epoch
        try:
            if first:
                self._tell_the_last_batch()
            self._top_up()
        except WorkerDiedError:
            if self._workers.start_failed:
                self.close()
                raise
            # A worker died: said by the first next(), as torch's loader says it (the task waits
            # unsent).
        except BaseException:
            if self._workers.start_failed:
                self.close()
            raise
        self._start_the_rest()

    def _start_the_rest(self) -> None:
        """Start the process workers that no task has reached (an epoch of fewer tasks than
        workers): every worker starts with the epoch, as torch's, whether it gets work or not."""
        try:
            self._workers.start_all()
        except BaseException:
            self.close()
            raise

    def _send_what_torch_sends_ahead(self) -> None:
        """Before a persistent session's next epoch: if the last one was left early, send the
        tasks torch would have sent by then (``prefetch_factor * num_workers`` beyond those
        handed out, round-robin), which the workers build and drop before they start the next
        epoch (see ``WorkerLoop._next_command``). The budget may have kept fewer in flight, and
        how many depends on timing; the workers' random values after an epoch left early then
        depend on it too. Their batches travel in fresh memory: no slab is granted for a batch
        nobody will read."""
        if self._config.setup.fetch.per_batch_seeding or not self._config.in_order:
            return
        ledger = self._ledger
        ahead = ledger.next_to_yield + self._prefetch_factor * self._num_workers
        while ledger.next_to_send < ahead and (self._unsent is not None or self._take_task(grant=False)):
            self._send_unsent()

    def next_batch(self) -> Any:
        """The next batch; raises StopIteration when the epoch is over.

        A batch whose building raised (dataset, collate_fn, an iterable's ``__next__``) raises
        that error here and the epoch goes on: the next call returns the next batch, as torch
        does. A timeout also leaves everything as it was (asking again waits again). Anything
        else (a dead worker, a broken channel, Ctrl-C) closes the engine before it propagates:
        the epoch is over, and the next call raises StopIteration.
        """
        try:
            return hand_out(self._next_report, self.close, self._supply, self._numbered,
                            self._workers.mark_failed)
        except StopIteration:
            if self._stop_when_done:
                self._workers.all_answered()  # its workers need not be waited for (workers.py)
            raise

    def close(self) -> None:
        if self._keeper is not None and not self.closed:
            self._keeper.pace = self._budget.pace() or self._keeper.pace  # for the next set
        self._finalizer()
        # A closed engine can live on for a long time (an exception's traceback holds it): drop
        # the batches it still holds, so their shared memory is freed now, and end the epoch.
        self._ledger = self._new_ledger(self._num_workers)
        self._count_answers()
        self._supply = TaskSupply()
        self._unsent = None
        if self._stats is not None:
            self._stats.close()  # after the ledger's last count: its workers' lines are final

    def _new_ledger(self, num_workers: int, start: EpochStart = EpochStart()) -> BatchLedger:
        """The book of an epoch's batches; out of order it spreads them by torch's rule (a
        worker's share of ``prefetch_factor * num_workers``, see ``BatchLedger``)."""
        return BatchLedger(num_workers, self._config.in_order, first_batch=start.first_batch,
                           first_worker=start.first_worker, prefetch_factor=self._config.prefetch_factor)

    def _count_answers(self) -> None:
        """A new ledger: the stats count the workers' tasks from its answers (SessionStats)."""
        if self._ledger_counts:
            ledger = self._ledger
            if self._samples_counted:
                ledger.count_samples()
            self._stats.count_answers(ledger.answered_per_worker,  # type: ignore[union-attr]
                                      ledger.answered_samples_per_worker if self._samples_counted else None)

    def _next_report(self) -> WorkerReport | None:
        """The next report to hand out, or None once every batch sent has been handed out."""
        # No local alias of the ledger: a raised error's traceback keeps this frame, and
        # close() must be able to let go of the batches the ledger holds.
        self._budget.request_started()
        self._top_up_while_full()  # tasks held back when the last batch was handed out
        waited_since = 0.0
        while True:
            report = self._ledger.pop_ready()
            if report is not None:
                # Waiting for a batch that paid a one-off set-up is not a sign of too few in flight.
                waited_s = time.perf_counter() - waited_since if waited_since else 0.0
                self._hand_over(report, waited_since > 0 and report.setup_s == 0, waited_s)
                return report
            if self._ledger.nothing_left():
                return None
            waited_since = waited_since or time.perf_counter()
            for report in self._workers.receive(self._workers.deadline()):
                if report.report is not Report.EPOCH_STARTED:
                    self._budget.batch_built(report.build_s)
                    self._ledger.record_report(report)
                # With stats on, a timed task's report (about one in SAMPLE_EVERY, fewer for
                # tiny tasks), a failure's or a new worker's first; never with stats off, and
                # never from thread workers, which lend their clocks. The one per-report check the
                # stats add, and stats off runs it too: the ledger has counted the task already.
                if report.totals is not None:
                    self._stats.record_answered(report)  # type: ignore[union-attr]
            self._top_up()
            if self._stop_when_done and self._supply.done:
                self._let_done_workers_go()

    def _let_done_workers_go(self) -> None:
        """Ask every worker that has answered all its tasks, now that no task is left to send, to
        stop. A worker's exit tears down its address space (the pages inherited at the fork, its
        heap, its slab mappings: 6 to 12 ms from its last step to reaped for a 38 MiB-batch
        worker on the 2-core box); asked only at ``StopIteration``, the loop waits for that. Asked
        here, a worker exits while the loop still takes the batches it left: all of the wait when
        the training step is the slower side, none when the workers are (their last answers
        come just as the loop needs them)."""
        if self._unsent is not None:
            return  # a task still goes out (to its worker) first
        ledger = self._ledger
        for worker_id in range(len(self._workers.handles)):
            if ledger.in_flight(worker_id) == 0:
                self._workers.retire(worker_id)

    def _hand_over(self, report: WorkerReport, starved: bool, waited_s: float) -> None:
        if report.batch_number >= self._next_look:  # sampled: see SessionStats.handing_out
            self._next_look = self._stats.handing_out(  # type: ignore[union-attr]
                len(self._ledger.arrived), self._ledger.outstanding, report.batch_number)
        slabs = self._workers.slabs
        if slabs is not None:
            slabs.handed_out(report.batch_number)
        self._budget.request_served(starved, waited_s)
        if self._shrinking:
            self._shrink_when_idle()
        self._top_up_while_full(handing_out=True)
        self._budget.consumer_resumes()  # after sending: the consumer's time starts now

    def _top_up_while_full(self, handing_out: bool = False) -> None:
        try:
            self._top_up(handing_out)
        except LoaderTimeoutError:
            pass  # a worker's task pipe stayed full; the task is sent on the next call

    def _top_up(self, handing_out: bool = False) -> None:
        """Send tasks up to the budget.

        ``handing_out``: a batch is about to be returned, and the consumer still holds the one
        before it (a ``for`` loop drops it only afterwards). A large batch that would need fresh
        memory now then waits for the next request instead: its pages would otherwise be filled
        while the dropped batch still holds its own, a third batch's worth at the peak.
        """
        if self._supply.done and self._unsent is None:
            return
        ledger, slabs = self._ledger, self._workers.slabs
        if not self._config.in_order:
            # As torch: every task the ceiling allows flies, so that batches overtake a slow one
            # (the budget cannot see that need: its build times stop with the late batch).
            allowed = self._budget.most(slabs.batch_bytes if slabs is not None else 0)
        elif slabs is not None:
            allowed = self._budget.allowed(slabs.batch_bytes, slabs.inline_only)
        else:
            allowed = self._budget.allowed(0)
        if ledger.outstanding >= allowed:
            return  # the usual case, kept cheap: it runs several times per batch
        if slabs is not None:
            # In flight, plus the batch the consumer holds, plus (unless its slab can be granted
            # on release) the one it is dropping.
            slabs.set_in_flight(allowed)
        while ledger.outstanding < allowed:
            if self._unsent is None:
                if handing_out and slabs is not None and slabs.would_need_fresh_memory():
                    return
                if not self._take_task():
                    return
            self._send_unsent()

    def _send_unsent(self) -> None:
        """Send the task taken into ``_unsent`` to its worker (it stays there if the send times
        out, to go first next time)."""
        worker_id, command = self._unsent  # type: ignore[misc]
        self._workers.send(worker_id, command)
        self._unsent = None
        if self._samples_counted:
            self._ledger.record_sent(worker_id, 1 if self._one_sample_a_task else samples_in(command.indices))
        else:
            self._ledger.record_sent(worker_id)

    def _take_task(self, grant: bool = True) -> bool:
        """Take the sampler's next task into ``_unsent``, with its worker and (if ``grant``) a
        slab grant."""
        worker_id = self._ledger.choose_worker()
        if worker_id is None or self._supply.done:
            return False
        indices = self._supply.take()
        if self._supply.done:
            if self._stop_when_done:
                self._let_done_workers_go()  # those whose answers are all in; the rest as they come
            return False
        number = self._ledger.next_to_send
        slabs = self._workers.slabs
        granted = slabs.grant(worker_id, number) if slabs is not None and grant else None
        self._unsent = (worker_id, WorkerCommand(Command.FETCH, number, indices, grant=granted))
        return True


def samples_in(indices: Any) -> int:
    """The samples a batch sampler's batch names, for the stats: its length, or its length hint
    (torch takes any iterable of indices, an iterator too; a batch that is none, an int, fails
    in its worker at its turn, as torch's does, and counts none here)."""
    return operator.length_hint(indices, 0)
