"""The main process's side of the stats: one :class:`StatsRecorder` per loader.

Fed through a few narrow hooks, each by one thread:

- each engine session (a pool of workers, or the inline engine) gets a :class:`SessionStats`;
  its driving thread (the caller of ``next_batch``, or the pin thread) records every report's
  worker totals and, at each hand-out, how many batches were ready and in flight;
- the epoch iterator (the training loop's thread) times each ``next()``: inside is waiting for
  data, between two calls is the training loop's own work;
- the pin stage adds the time it spends pinning.

No locks on those paths: each field has one writer, and :meth:`StatsRecorder.snapshot` copies
what it reads (a dict copy is one step under the GIL), so a snapshot taken mid-epoch may be a
batch behind in places, never torn.
"""

from __future__ import annotations

import math
import operator
import os
import threading
from collections import _count_elements, defaultdict  # type: ignore[attr-defined]
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from pipeload.stats.clock import (
    SAMPLE_EVERY,
    SUMS_LENGTH,
    TIME_ALL_FIRST,
    RecentTimes,
    StageClock,
    WorkerTotals,
    bytes_moved_by,
    complete_totals,
    estimated_stages,
    gaps,
    now,
    stretch,
)
from pipeload.stats.report import LoaderStats, QueueStats, RayStageStats, TuningDecision, WorkerStats
from pipeload.stats.skips import Counts
from pipeload.transport.messages import Report


# What WorkerGroup.receive does with every burst of reports, in C: finds whether any carries
# totals (then it calls SessionStats.record), else counts them per worker into the session's
# ``lag``: ``count_by_worker(lag, map(worker_of, reports))`` (the session's ``count_key``),
# with ``collections``' counting helper (the one ``Counter`` uses). One step per burst (2 to 4
# reports with tiny batches), where a Python loop cost a dozen bytecodes per report, 1% of a
# tiny batch's trip.
carries_totals = operator.attrgetter("totals")  # of a transport.messages.WorkerReport
worker_of = operator.attrgetter("worker_id")
count_by_worker = _count_elements
# Economic mode's item and batch workers share ids: its reports are counted per (type, worker
# id), still in C (a Report hashes as the int it is).
type_and_worker = operator.attrgetter("report", "worker_id")

# The main process times the training loop's waits (pairs of batches) and looks at the queue
# about once in this many batches: more often than the workers time their tasks, as the waits
# are what the summary's verdict rests on and cost the main process only a few bytecodes.
LOOK_EVERY = 32


def usable_cpus() -> int:
    """The CPUs this process may run on (its affinity), not the machine's count."""
    try:
        return len(os.sched_getaffinity(0))
    except (AttributeError, OSError):
        return os.cpu_count() or 1


@dataclass
class _Queue:
    """Running sums of what each hand-out found: written by the engine's driving thread."""

    samples: int = 0
    ready_sum: int = 0
    ready_max: int = 0
    in_flight_sum: int = 0
    in_flight_max: int = 0
    capacity: int = 0


class EpochCount:
    """Batches one epoch's iterator has handed out, and the count at which it times its next.

    The iterator counts every batch here (it would count them anyway, for the length warning),
    so that an untimed batch costs the stats one comparison: ``handed >= next_timed``. With
    stats off, ``next_timed`` never comes.
    """

    __slots__ = ("handed", "next_timed", "ended")

    def __init__(self, next_timed: float = math.inf) -> None:
        self.handed = 0
        self.next_timed = next_timed
        self.ended = False  # its epoch is over: it counts no more batches


class _Consumer:
    """The training loop's side, written by the thread that iterates the loader.

    Each epoch's iterator counts its batches in the :class:`EpochCount` that
    :meth:`epoch_started` returns, and calls :meth:`asking` and :meth:`handed` only for timed
    batches. Timed are each epoch's first batch (start-up, kept apart), every batch of the
    loader's first ``TIME_ALL_FIRST``, then about one pair of batches in ``2 * every`` (all of
    them with ``every=1``, as ``num_workers="auto"`` asks, to judge each of its windows; up to
    MAX_STRETCH times fewer when batches come fast, ``stretch``, which spaces the queue looks
    too): the
    first of a pair times the wait for it, the second also the loop's own work since the first
    was handed out. Batches are counted exactly.

    The time itself comes from each epoch's wall clock: read at its ``iter()`` and when it ends
    (:meth:`epoch_ended`: its last call, ``close()``, or its iterator dropped after a ``break``),
    two reads an epoch. Less the first batches and the ends, it is split between waiting and
    the loop's own work by the timed batches' shares (:meth:`steady_split`). Scaling the timed
    batches' seconds to all batches read tiny batches' runs up to 20 times too long: the timing's
    own work falls on the timed batches, which then wait longer than the others.
    """

    def __init__(self, every: int = LOOK_EVERY) -> None:
        self.epochs = 0
        self.first_wait_s = 0.0
        self.first_batch_s = 0.0
        self.opening_wait_s = 0.0  # the first epoch's first wait
        self._count: EpochCount | None = None
        self._earlier = 0  # batches of the epochs before the current one that have ended
        # Earlier epochs whose iterators may still hand out batches: without persistent workers
        # each iterator has its own, and torch lets two run at once (their batches went
        # uncounted once the second had started: 12 of 20, a skeptic's probe at stop 53).
        self._still_running: list[EpochCount] = []
        self._firsts = 0
        self._wait_s = 0.0  # over the timed steady batches
        self._waits = 0
        self._compute_s = 0.0  # over the second batches of the timed pairs
        self._computes = 0
        self.end_wait_s = 0.0  # for calls that handed out no batch: an epoch's end, an error
        self._second = False  # the next timed batch is a pair's second
        self._epoch_started_at: float | None = None  # until the epoch's first batch is handed out
        self._running_since: float | None = None  # the current epoch's iter(), until it ends
        self._ended_epochs_s = 0.0  # the wall clock of the epochs that have ended
        self._last_handed_at = 0.0
        self._every = 2 * every - 1  # batches from one timed pair to the next, on average
        self._gaps = gaps(self._every)  # every=1: every batch is timed
        self._last_wait_s = 0.0  # the latest timed batch's wait
        self._recent = RecentTimes()  # the timed pairs' wait and work, per batch
        # How many times longer the gaps between timed pairs (and queue looks) run: batches that
        # come faster than about SPACING_S / every are timed less often (stats/clock.py).
        self.stretch = 1

    @property
    def batches(self) -> int:
        count = self._count
        current = count.handed if count is not None else 0
        return self._earlier + current + sum(other.handed for other in self._still_running)

    @property
    def count(self) -> EpochCount:
        """The current epoch's count (a fresh one before the first epoch)."""
        if self._count is None:
            self._count = EpochCount(0)
        return self._count

    def epoch_started(self, called_at: float | None = None) -> EpochCount:
        started = now() if called_at is None else called_at
        # An epoch still running (its iterator kept, not exhausted) ends where this one starts
        # for the wall clock: one clock runs at a time (a persistent pool abandons the previous
        # epoch). Its batches still count if its iterator goes on (its own workers, without
        # persistent ones: see _still_running).
        self._stop_wall_clock(started)
        self.epochs += 1
        last = self._count
        if last is not None and last.ended:
            self._earlier += last.handed
        elif last is not None:  # its iterator may go on: its batches count, none is timed
            last.next_timed = math.inf
            self._still_running.append(last)
        self._count = EpochCount(0)  # the epoch's first batch is timed
        self._second = False
        self._epoch_started_at = self._running_since = started
        return self._count

    def epoch_ended(self, count: EpochCount) -> None:
        """The epoch counted in ``count`` is over (its last call, ``close()``, or its iterator
        dropped: a ``break``); a later call for it (its iterator's finalizer) does nothing."""
        if count.ended:
            return
        count.ended = True
        if count is self._count:
            self._stop_wall_clock(now())
        elif count in self._still_running:  # (by identity: EpochCount has no __eq__)
            self._still_running.remove(count)
            self._earlier += count.handed

    def _stop_wall_clock(self, at: float) -> None:
        if self._running_since is not None:
            self._ended_epochs_s += max(0.0, at - self._running_since)
            self._running_since = None

    def wall_s(self) -> float:
        """Seconds spent in epochs, from each ``iter()`` to its end (the running one: to now)."""
        running = now() - self._running_since if self._running_since is not None else 0.0
        return self._ended_epochs_s + running

    def steady_split(self) -> tuple[float, float]:
        """The steady time (the epochs' wall clock less their first batches and their ends) as
        (waiting, the loop's own work), split by the timed batches' mean wait and work. With
        nothing timed yet, all of it is the loop's own (after an epoch's only batch)."""
        steady_s = max(0.0, self.wall_s() - self.first_wait_s - self.end_wait_s)
        wait = self._wait_s / self._waits if self._waits else 0.0
        work = self._compute_s / self._computes if self._computes else 0.0
        waiting = wait / (wait + work) if wait + work > 0 else 0.0
        return steady_s * waiting, steady_s * (1 - waiting)

    def asking(self) -> float:
        """The count reached a timed batch; returns when it was asked for."""
        asked = now()
        count = self.count
        if self._second:
            work = asked - self._last_handed_at
            self._compute_s += work
            self._computes += 1
            self._second = False
            self._recent.add(work + self._last_wait_s)
            self.stretch = stretch(self._every, self._recent.median())
            count.next_timed = count.handed + (next(self._gaps) * self.stretch if self.batches >= TIME_ALL_FIRST else 1)
        else:
            self._second = True
            count.next_timed = count.handed + 1
        return asked

    def handed(self, asked: float) -> None:
        """The timed batch asked for at ``asked`` is handed over now."""
        handed = self._last_handed_at = now()
        if self._epoch_started_at is None:
            self._last_wait_s = handed - asked
            self._wait_s += self._last_wait_s
            self._waits += 1
        else:  # an epoch's first batch: start-up, kept apart from the steady waiting
            # From iter(), whose start of the workers the loop waits through as well.
            self.first_batch_s = handed - min(asked, self._epoch_started_at)
            self.first_wait_s += self.first_batch_s
            if not self._firsts:
                self.opening_wait_s = self.first_batch_s
            self._epoch_started_at = None
            self._firsts += 1

    def ended(self, asked: float) -> None:
        """The batch asked for (at ``asked``; 0.0: untimed) ended in StopIteration or an error
        (an epoch's end passes when its workers began to stop, if the ask was untimed)."""
        self._second = False  # no batch was handed out to time the loop's work from
        if asked:
            self.end_wait_s += now() - asked

    def _steady(self) -> int:
        return max(0, self.batches - self._firsts)

    def wait_estimate(self) -> float:
        """Seconds the loop waited for its steady batches, scaled from the timed ones: exact
        when every batch is timed (``num_workers="auto"``, whose tuner reads it per window; the
        snapshot splits the wall clock instead, :meth:`steady_split`). Not the calls that ended
        an epoch: stopping workers that are not persistent is no steady wait, and would turn a
        loop that keeps up into one that waits (``end_wait_s``)."""
        return self._wait_s * self._steady() / self._waits if self._waits else 0.0


class SessionStats:
    """What one engine session (one pool, or the inline engine) reports into its recorder.

    ``count_key`` is what ``WorkerGroup.receive`` counts a report without totals under in
    ``lag``: its worker's id (classic workers; see :class:`KindedSessionStats` for economic).
    """

    count_key: Callable[[Any], Any] = worker_of

    def __init__(self, recorder: StatsRecorder, session: int, capacity: int) -> None:
        self._seen = recorder._seen
        self._queue = recorder._queue
        self._queue.capacity = capacity
        self._session = session
        self.lag: dict[Any, int] = recorder._lags.setdefault(session, defaultdict(int))
        # A classic pool's ledger counts each worker's answers (count_answers): a worker's tasks
        # since its latest totals are then ``lag`` plus its answers since (``_covered``).
        self._answers: list[int] = []
        self._covered: dict[int, int] = {}
        # Where the ledger also counts the samples of the answers (a map-style pool's, whose
        # tasks' indices say them): the samples since a worker's latest totals are exact, not
        # its timed tasks' mean size times its tasks since (batch sizes a batch sampler varies).
        self._answered_samples: list[int] | None = None
        self._covered_samples: dict[int, int] = {}
        self._samples_carried: dict[int, int] = defaultdict(int)  # from earlier ledgers
        self._answering = recorder._answering
        self._gaps = gaps(LOOK_EVERY)
        self._consumer = recorder._consumer  # its stretch spaces the queue looks too
        self._recorder = recorder

    def assembled(self, samples: int) -> None:
        """Economic mode: the main process put together a batch of ``samples`` itself (a direct
        batch, engine/direct_batches.py), which no worker's totals count."""
        self._recorder.assembled(samples)

    def local_clock(self) -> StageClock:
        """A clock for fetching in the main process (no workers); read at every snapshot."""
        clock = StageClock(SAMPLE_EVERY)
        self._seen[(self._session, "main", 0)] = (clock, None)
        return clock

    def record(self, reports: list[Any]) -> None:
        """Keep the latest totals the reports carry; count, per worker, the reports since
        without them (a classic worker sends its totals with one task in SAMPLE_EVERY, and
        with its EPOCH_STARTED answer, the only report that is no task).

        ``WorkerGroup.receive`` calls it only for a burst that carries totals (about one in
        ten with tiny batches): it counts the others itself, in one step per burst
        (``count_by_worker``), as the common case must cost next to nothing.
        """
        lag, key = self.lag, self.count_key
        for report in reports:
            if report.totals is not None:
                self._keep(report)
            elif report.report is not Report.EPOCH_STARTED:  # a lent clock's answer: no task
                lag[key(report)] += 1

    def count_answers(self, answered: list[int], samples: list[int] | None = None) -> None:
        """From now on the engine's ledger counts each worker's answered tasks in ``answered``
        (a classic pool's, a new list each epoch), and, where it knows them, their samples in
        ``samples``, so ``WorkerGroup.receive`` counts nothing and the engine hands the reports
        with totals to :meth:`record_answered`. What the previous lists counted since each
        worker's latest totals moves to ``lag`` (and ``_samples_carried``)."""
        for worker_id, count in enumerate(self._answers):
            self.lag[worker_id] += count - self._covered.get(worker_id, 0)
        for worker_id, count in enumerate(self._answered_samples or ()):
            self._samples_carried[worker_id] += count - self._covered_samples.get(worker_id, 0)
        self._answers, self._covered = answered, {}
        self._answered_samples, self._covered_samples = samples, {}
        self._answering[self._session] = self

    def record_answered(self, report: Any) -> None:
        """Keep the totals ``report`` carries; if it answers a task, the ledger has counted it."""
        self._keep(report, counted=True)

    def samples_since(self) -> dict[int, int] | None:
        """Per worker, the samples of its tasks since its latest totals, where the ledger counts
        them (None where it does not: they are estimated from the tasks)."""
        if self._answered_samples is None:
            return None
        since = dict(self._samples_carried)
        for worker_id, count in enumerate(list(self._answered_samples)):
            since[worker_id] = since.get(worker_id, 0) + count - self._covered_samples.get(worker_id, 0)
        return since

    def lags(self) -> dict[Any, int]:
        """Per worker, the tasks since its latest totals (read by a snapshot, from any thread)."""
        lags = dict(self.lag)
        for worker_id, count in enumerate(list(self._answers)):
            lags[worker_id] = lags.get(worker_id, 0) + count - self._covered.get(worker_id, 0)
        return lags

    def _keep(self, report: Any, counted: bool = False) -> None:
        key = (self._session, "", report.worker_id)
        totals = report.totals
        if len(totals) == SUMS_LENGTH:  # a worker whose tasks are counted here
            totals = complete_totals(totals, self._tasks_of(key, report, counted))
        self._seen[key] = (totals, now())
        self._settle(report.worker_id)

    def _tasks_of(self, key: tuple[int, str, int], report: Any, counted: bool) -> int:
        """The tasks the worker of ``report`` has reported, that one included if it is a task
        (all its reports are but the answer to START_EPOCH): those its previous totals covered,
        and those counted since (in ``lag``, and by the ledger: ``counted`` says whether it
        counted this one)."""
        previous = self._seen.get(key)
        done = previous[0][0] if previous is not None else 0
        this = not counted and report.report is not Report.EPOCH_STARTED
        return done + self._unreported(report.worker_id) + this

    def _unreported(self, worker_id: int) -> int:
        """Tasks of ``worker_id`` its latest totals do not cover."""
        answers = self._answers
        since = answers[worker_id] - self._covered.get(worker_id, 0) if worker_id < len(answers) else 0
        return self.lag[worker_id] + since

    def _settle(self, worker_id: int) -> None:
        """``worker_id``'s latest totals cover every task counted so far."""
        self.lag[worker_id] = 0
        if worker_id < len(self._answers):
            self._covered[worker_id] = self._answers[worker_id]
        self._samples_carried.pop(worker_id, None)
        samples = self._answered_samples
        if samples is not None and worker_id < len(samples):
            self._covered_samples[worker_id] = samples[worker_id]

    def started(self, labels: list[Any]) -> None:
        """The workers of ``labels`` (each with a ``kind`` and an ``id``) have started: each has
        a line from now on, with no task until its own totals come. A worker that never gets a
        task sends none (more workers than an epoch has batches): without this the summary
        left it out, and took its averages over the workers that reported. A line already
        there (a lent clock, totals that came first) is kept."""
        at = now()
        for label in labels:
            self._seen.setdefault((self._session, label.kind, label.id), (_no_task_yet(at), None))

    def lend_clock(self, worker_id: int, kind: str = "") -> Callable[[StageClock], None]:
        """What thread worker ``worker_id`` (of ``kind``) calls with its clock, which is then
        read live at every snapshot (as the main process's own clock is): its reports need
        carry nothing."""

        def lend(clock: StageClock) -> None:
            self._seen[(self._session, kind, worker_id)] = (clock, None)

        return lend

    def close(self) -> None:
        """The session's engine has closed and its workers are gone: what they did is folded
        into the loader's totals (``StatsRecorder.session_ended``)."""
        self._recorder.session_ended(self._session)

    def resized(self, capacity: int) -> None:
        """The pool was resized in place and now holds up to ``capacity`` batches in flight."""
        self._queue.capacity = capacity

    def retire(self, worker_id: int) -> None:
        """Classic worker ``worker_id`` has stopped (a pool shrinking in place). Its totals,
        brought up to the tasks it reported since, join its line among the finished workers'
        (``StatsRecorder._ended``), so that a worker started later under the same id adds to
        them rather than replacing them."""
        lag = self._unreported(worker_id)
        samples = (self.samples_since() or {}).get(worker_id)
        self._settle(worker_id)
        self._recorder.finish((self._session, "", worker_id), lag, samples)

    def handing_out(self, ready: int, in_flight: int, number: int = 0) -> int:
        """Batch ``number`` is being handed out; ``ready`` more are waiting, ``in_flight`` are
        sent and not yet handed out (this one excluded). Returns the batch number at which to
        call again: each engine calls it when its hand-outs reach that number (about one in
        LOOK_EVERY: occupancy is a sampled mean and maximum; the batch number is the
        countdown, kept by the engine, so an untimed hand-out costs one comparison)."""
        look = number + next(self._gaps) * self._consumer.stretch
        queue = self._queue
        queue.samples += 1
        queue.ready_sum += ready
        queue.in_flight_sum += in_flight
        if ready > queue.ready_max:
            queue.ready_max = ready
        if in_flight > queue.in_flight_max:
            queue.in_flight_max = in_flight
        return look


class KindedSessionStats(SessionStats):
    """Economic mode's session: item and batch workers, whose ids overlap.

    ``kinds`` maps each type of report to the kind of worker that sends it, the type its
    untimed tasks report first (item workers: ITEMS_DONE; batch workers: BATCH, then FAILED,
    which always carries totals). ``lag`` counts per (type, worker id); an EPOCH_STARTED answer
    names its sender's kind in its payload (``WorkerLoop._start_epoch``).
    """

    count_key = type_and_worker

    def __init__(self, recorder: StatsRecorder, session: int, capacity: int,
                 kinds: dict[Any, str]) -> None:
        super().__init__(recorder, session, capacity)
        self._kinds = kinds
        self._counted_as: dict[str, Any] = {}  # kind -> the type its untimed tasks report
        for report, kind in kinds.items():
            self._counted_as.setdefault(kind, report)
        recorder._lag_kinds[session] = kinds
        self._item_kind = kinds.get(Report.ITEMS_DONE)
        # Per item worker, the items of its pieces reported since its latest totals: counted
        # exactly, as pieces differ in size (an epoch's first batch is cut finer, cheap items
        # coarser) and a ratio of samples to pieces drifted by a batch's worth over two epochs.
        self.items_since: dict[int, int] = recorder._items_since.setdefault(session, defaultdict(int))
        # The same for batch workers' batches, whose sizes the engine knows (a batch sampler's may
        # vary): counted in the order the engine reads the reports (``batch_reported``).
        self.batch_samples_since: dict[int, int] = recorder._batch_samples_since.setdefault(
            session, defaultdict(int))

    def batch_reported(self, worker_id: int, samples: int, with_totals: bool) -> None:
        """Batch worker ``worker_id`` built a batch of ``samples`` samples; totals that came with
        it cover it and every earlier one."""
        if with_totals:
            self.batch_samples_since[worker_id] = 0
        else:
            self.batch_samples_since[worker_id] += samples

    def items_reported(self, worker_id: int, count: int) -> None:
        """Item worker ``worker_id`` reported a piece of ``count`` items without totals; the
        engine says so for each such report it reads, after :meth:`record` saw their burst."""
        self.items_since[worker_id] += count

    def record(self, reports: list[Any]) -> None:
        super().record(reports)
        # Totals cover their own piece and every earlier one: the engine is about to add the
        # pieces of this burst that came before them (items_reported), so they start below 0.
        item_kind, before = self._item_kind, defaultdict(int)
        for report in reports:
            if report.report is Report.ITEMS_DONE and report.totals is None:
                before[report.worker_id] += report.payload.count
            elif report.totals is not None and (report.report is Report.ITEMS_DONE or (
                    report.report is Report.EPOCH_STARTED and report.payload == item_kind)):
                self.items_since[report.worker_id] = -before[report.worker_id]

    def _keep(self, report: Any, counted: bool = False) -> None:
        kind = report.payload if report.report is Report.EPOCH_STARTED else self._kinds[report.report]
        self._seen[(self._session, kind, report.worker_id)] = (report.totals, now())
        self.lag[(self._counted_as[kind], report.worker_id)] = 0


@dataclass(frozen=True)
class LoaderSetup:
    """The settings a snapshot reports and the analysis reasons about; ``dataset`` says what
    kind it is: "map", "iterable" or "pipe" (a DataPipe graph); ``persistent_workers`` whether
    the workers live across epochs (otherwise each epoch starts and stops its own);
    ``has_worker_init_fn`` whether a ``worker_init_fn`` is set (a set-up the workers may need,
    which a loader without workers never runs)."""

    mode: str
    worker_type: str
    num_workers: int
    prefetch_factor: int | None
    batch_size: int | None
    pin_memory: bool
    cpus: int = field(default_factory=usable_cpus)
    dataset: str = "map"
    persistent_workers: bool = False
    has_worker_init_fn: bool = False


class StatsRecorder:
    """All the stats of one loader, across its epochs and engine sessions.

    Invariants: ``_seen`` maps (session, kind, worker id) to the latest totals of that worker
    and when they arrived (a main-process clock is kept live, with no arrival time); totals
    only grow, so keeping the latest is keeping everything. ``_seen`` holds only live workers:
    a finished one (its session closed, or retired from a shrinking pool) has moved, under the
    lock, into its line in ``_ended``, one per (kind, worker id) however many pools it lived in.
    """

    def __init__(self, setup: LoaderSetup, time_every_batch: bool = False) -> None:
        self.setup = setup
        self._seen: dict[tuple[int, str, int], tuple[Any, float | None]] = {}
        self._queue = _Queue()
        self._consumer = _Consumer(1 if time_every_batch else LOOK_EVERY)
        self._sessions = 0
        self._lags: dict[int, dict[Any, int]] = {}  # per session: tasks reported without totals
        self._lag_kinds: dict[int, dict[Any, str]] = {}  # economic sessions: see KindedSessionStats
        self._items_since: dict[int, dict[int, int]] = {}  # economic sessions' item workers: the same
        self._batch_samples_since: dict[int, dict[int, int]] = {}  # and their batch workers'
        self._answering: dict[int, SessionStats] = {}  # sessions whose engine's ledger counts
        self._pin_s = 0.0
        self._pinned = 0
        self._assembled_batches = 0  # economic direct batches (see SessionStats.assembled)
        self._assembled_samples = 0
        self._separate_processes: tuple[str, ...] = ()
        self._skipped_samples = 0
        # The loader's failure board (stats/skips.py), where its on_error pipes count: read live.
        self.failures: Any = None
        self._decisions: list[TuningDecision] = []
        # Closed sessions' workers, one line per (kind, worker id), and what their Ray stages
        # measured: a loader that makes a new pool every epoch keeps one line per worker, not
        # one per worker and epoch (each a lent clock for thread workers).
        self._ended: dict[tuple[str, int], WorkerStats] = {}
        self._ended_ray: RayStageStats | None = None
        self._lock = threading.Lock()  # only for the rare writers from several threads

    # -- hooks -------------------------------------------------------------------------------

    def new_session(self, capacity: int, kinds: dict[Any, str] | None = None) -> SessionStats:
        """A new engine session, holding up to ``capacity`` batches in flight (``kinds``: see
        :class:`SessionStats`)."""
        with self._lock:
            self._sessions += 1
            if kinds:
                return KindedSessionStats(self, self._sessions, capacity, kinds)
            return SessionStats(self, self._sessions, capacity)

    def time_every_batch(self) -> None:
        """Time the training loop's wait for every batch from now on, not one pair in
        ``LOOK_EVERY`` (``pipeload profile``, which measures rather than trains, and
        ``num_workers="auto"``, which judges short windows). Before the first epoch only."""
        if self._consumer.epochs == 0:
            self._consumer = _Consumer(1)

    @property
    def consumer(self) -> _Consumer:
        """The training loop's side, which the loader's epoch iterator times directly."""
        return self._consumer

    def epoch_started(self, called_at: float | None = None) -> EpochCount:
        """A new epoch, whose ``iter()`` was called at ``called_at`` (None: now); its iterator
        counts its batches in what this returns."""
        return self._consumer.epoch_started(called_at)

    def pinned(self, seconds: float) -> None:
        self._pin_s += seconds
        self._pinned += 1

    def assembled(self, samples: int) -> None:
        self._assembled_batches += 1
        self._assembled_samples += samples

    def skipped(self, samples: int) -> None:
        """Samples skipped by an error policy that reports them itself; the sources' on_error
        pipes count on the loader's failure board instead (``stats/skips.py``)."""
        with self._lock:
            self._skipped_samples += samples

    def decided(self, decision: TuningDecision) -> None:
        """The auto-tuner changed (or kept) the settings."""
        with self._lock:
            self._decisions.append(decision)

    def session_ended(self, session: int) -> None:
        """Fold the closed ``session``'s workers into ``_ended`` and forget the session."""
        lags, items = self._lags_by_kind(), self._items_by_kind()
        for key in [key for key in list(self._seen) if key[0] == session]:
            _, kind, worker_id = key
            self.finish(key, lags.get((session, kind), {}).get(worker_id, 0),
                        items.get((session, kind), {}).get(worker_id))
        with self._lock:
            self._lags.pop(session, None)
            self._items_since.pop(session, None)
            self._batch_samples_since.pop(session, None)
            self._lag_kinds.pop(session, None)
            self._answering.pop(session, None)

    def finish(self, key: tuple[int, str, int], lag: int, items: int | None = None) -> None:
        """Move worker ``key``'s latest totals, brought up to the ``lag`` tasks it reported
        since (of ``items`` samples, where counted), from the live ones to its line in
        ``_ended`` (a lent clock is read now)."""
        with self._lock:  # a snapshot sees them in one place or the other, never both or none
            entry = self._seen.pop(key, None)
            if entry is None:
                return
            raw, arrived = entry
            totals, lag = _read(raw, lag)
            _, kind, worker_id = key
            one = _stats_of(kind, worker_id, totals, lag, arrived, now(), items)
            previous = self._ended.get((kind, worker_id))
            self._ended[(kind, worker_id)] = one if previous is None else previous.plus(one)
            if totals.ray_stage:
                ray = RayStageStats.from_tuple(totals.ray_stage)
                self._ended_ray = ray if self._ended_ray is None else self._ended_ray.plus(ray)

    # -- reading -----------------------------------------------------------------------------

    def _lags_by_kind(self) -> dict[tuple[int, str], dict[int, int]]:
        """Tasks reported without totals, per (session, kind) and worker id."""
        lags: dict[tuple[int, str], dict[int, int]] = defaultdict(dict)
        answering = self._answering.copy()
        for session, lag in self._lags.copy().items():
            if session in answering:
                lag = answering[session].lags()
            kinds = self._lag_kinds.get(session)
            for key, count in lag.copy().items():
                if kinds is None:
                    lags[(session, "")][key] = count
                else:  # (report type, worker id)
                    per_worker = lags[(session, kinds[key[0]])]
                    per_worker[key[1]] = per_worker.get(key[1], 0) + count
        return lags

    def _items_by_kind(self) -> dict[tuple[int, str], dict[int, int]]:
        """Samples reported without totals, per (session, kind) and worker id, where counted:
        economic item workers' items, and a map-style classic pool's tasks' samples."""
        kinds = self._lag_kinds.copy()
        items = {(session, kinds[session][Report.ITEMS_DONE]): dict(items)
                 for session, items in self._items_since.copy().items() if session in kinds}
        for session, samples in self._batch_samples_since.copy().items():
            batch_kind = kinds.get(session, {}).get(Report.BATCH)
            if batch_kind is not None:
                items[(session, batch_kind)] = dict(samples)
        for session, stats in self._answering.copy().items():
            since = stats.samples_since()
            if since is not None:
                items[(session, "")] = since
        return items

    def snapshot(self) -> LoaderStats:
        """Everything so far, as a frozen :class:`LoaderStats`."""
        consumer, queue = self._consumer, self._queue
        with self._lock:  # not halfway through folding a session into _ended
            seen, ended, ended_ray = self._seen.copy(), dict(self._ended), self._ended_ray
            lags, items = self._lags_by_kind(), self._items_by_kind()
        workers = _per_worker(seen, now(), lags, items, ended)
        wait_s, compute_s = consumer.steady_split()
        samples = queue.samples or 1
        failures = self.failures.totals() if self.failures is not None else Counts()
        return LoaderStats(
            setup=self.setup,
            batches=consumer.batches,
            epochs=consumer.epochs,
            wait_s=wait_s,
            compute_s=compute_s,
            first_wait_s=consumer.first_wait_s,
            end_wait_s=consumer.end_wait_s,
            first_batch_s=consumer.first_batch_s,
            opening_wait_s=consumer.opening_wait_s,
            pin_s=self._pin_s,
            pinned=self._pinned,
            workers=workers,
            queue=QueueStats(queue.ready_sum / samples, queue.ready_max,
                             queue.in_flight_sum / samples, queue.in_flight_max, queue.capacity),
            skipped_samples=self._skipped_samples + failures.samples,
            skipped_files=failures.files,
            decisions=tuple(self._decisions),
            ray=_ray_stage_of_workers(seen, ended_ray),
            separate_processes=self._separate_processes,
            assembled_batches=self._assembled_batches,
            assembled_samples=self._assembled_samples,
        )

    def note_separate_processes(self, placements: tuple[str, ...]) -> None:
        """Where the loader answered pipes' ``is_separate_process()`` (latest engine's)."""
        self._separate_processes = placements


def _per_worker(seen: dict[tuple[int, str, int], tuple[Any, float | None]], at: float,
                lags: dict[tuple[int, str], dict[int, int]],
                items: dict[tuple[int, str], dict[int, int]],
                ended: dict[tuple[str, int], WorkerStats]) -> tuple[WorkerStats, ...]:
    """Sum each worker's totals over the sessions it lived in (a new pool per epoch restarts
    every worker's totals), each brought up to the tasks (and, where counted, the ``items``)
    it reported since its latest totals; ``ended``: the closed sessions', already summed."""
    merged = dict(ended)
    for (session, kind, worker_id), (raw, arrived) in seen.items():
        totals, lag = _read(raw, lags.get((session, kind), {}).get(worker_id, 0))
        one = _stats_of(kind, worker_id, totals, lag, arrived, at,
                        items.get((session, kind), {}).get(worker_id))
        previous = merged.get((kind, worker_id))
        merged[(kind, worker_id)] = one if previous is None else previous.plus(one)
    return tuple(merged[key] for key in sorted(merged))


def _extrapolated(totals: WorkerTotals, lag: int, items: int | None = None) -> WorkerTotals:
    """``totals`` plus ``lag`` more tasks like the ones they cover (exact for equal batches):
    like their later tasks, not the first ones (``WorkerTotals.start``); of ``items`` samples
    where they were counted (economic item workers), else of as many per task as before.

    The scheduler's seconds (on a CPU, queued for one) grow with them: with the stages' alone,
    a worker that reported its totals rarely (an economic item worker times about one piece in
    64, and no epoch's last) looked idle on a CPU for the tasks since, and "waiting inside the
    work" for nearly half its busy time."""
    if not lag or not totals.tasks:
        return totals
    tasks = totals.tasks + lag
    fetch_s, collate_s, send_s, bytes_out, cpu_s, queued_s = estimated_stages(
        (totals.fetch_s, totals.collate_s, totals.send_s, totals.bytes_out, totals.cpu_s,
         totals.queued_s), totals.start, totals.tasks, tasks)
    samples = totals.samples + items if items is not None else round(totals.samples * tasks / totals.tasks)
    if totals.samples:
        # Bytes go with samples, not tasks: tasks of different sizes (economic mode cuts an
        # epoch's first batch finer than the rest) would give the two different scales. Those
        # of failed tasks moved nothing; the tasks since the totals did not fail (a failure's
        # report carries them).
        made = totals.samples - totals.failed_samples
        bytes_out = bytes_moved_by(totals.bytes_out, made, made + samples - totals.samples)
    return totals._replace(tasks=tasks, samples=samples,
                           fetch_s=fetch_s, collate_s=collate_s, send_s=send_s,
                           bytes_out=round(bytes_out), cpu_s=cpu_s, queued_s=queued_s)


def _ray_stage_of_workers(seen: dict[tuple[int, str, int], tuple[Any, float | None]],
                          ended: RayStageStats | None = None) -> RayStageStats | None:
    """What the workers' (and the main process's) Ray boundaries measured, ``ended`` (the
    closed sessions') included; None without any."""
    measured = [values for values in (_read(raw, 0)[0].ray_stage for raw, _ in seen.values())
                if values]
    if not measured and ended is None:
        return None
    total = ended if ended is not None else RayStageStats()
    for values in measured:
        total = total.plus(RayStageStats.from_tuple(values))
    return total


def _no_task_yet(started_at: float) -> tuple[Any, ...]:
    """The totals of a worker started at ``started_at`` that has reported nothing: read live
    (no arrival time), its life runs to each snapshot, all of it idle."""
    return tuple(WorkerTotals(0, 0, 0.0, 0.0, 0.0, 0, started_at, 0.0, 0.0))


def _read(raw: Any, lag: int) -> tuple[WorkerTotals, int]:
    """A worker's totals as kept (a tuple, or a lent clock, read now), and the tasks still to
    add to them by extrapolation (``lag``: counted since they were taken). A lent clock is read
    live: one that counts its own tasks needs nothing added, one whose tasks the engine's ledger
    counts (a classic thread worker that goes by batch numbers) is completed with ``lag``, all
    of its tasks."""
    if not isinstance(raw, StageClock):
        return WorkerTotals(*raw), lag
    sums = raw.snapshot()
    if len(sums) == SUMS_LENGTH:
        return WorkerTotals._make(complete_totals(sums, lag)), 0
    return WorkerTotals._make(sums), 0


def _stats_of(kind: str, worker_id: int, totals: WorkerTotals, lag: int, arrived: float | None,
              at: float, items: int | None = None) -> WorkerStats:
    """One session's line for a worker whose latest totals arrived at ``arrived`` (None: a
    live clock, read ``at``), brought up to the ``lag`` tasks (of ``items`` samples, where
    counted) it reported since. Its life is
    stretched with its tasks (their seconds are), up to the time now: a worker's share of its
    life on a CPU, or busy, must compare figures over one stretch of time."""
    alive_s = max(0.0, (arrived if arrived is not None else at) - totals.started_at)
    extrapolated = _extrapolated(totals, lag, items)
    if extrapolated is not totals:
        alive_s = min(max(alive_s, at - totals.started_at), alive_s * extrapolated.tasks / totals.tasks)
    return _worker_stats(kind, worker_id, extrapolated, alive_s)


def _worker_stats(kind: str, worker_id: int, totals: WorkerTotals, alive_s: float) -> WorkerStats:
    return WorkerStats(kind, worker_id, totals.tasks, totals.samples, totals.fetch_s,
                       totals.collate_s, totals.send_s, totals.bytes_out, alive_s, totals.cpu_s, totals.queued_s)
