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

import os
import threading
from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Any

from pipeload.stats.clock import StageClock, WorkerTotals, now
from pipeload.stats.report import LoaderStats, QueueStats, TuningDecision, WorkerStats


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


@dataclass
class _Consumer:
    """The training loop's side: written by the thread that iterates the loader."""

    batches: int = 0
    wait_s: float = 0.0
    first_wait_s: float = 0.0
    compute_s: float = 0.0
    epochs: int = 0
    first_batch_s: float = 0.0
    epoch_started_at: float | None = None
    last_handed_at: float | None = None


class SessionStats:
    """What one engine session (one pool, or the inline engine) reports into its recorder.

    ``kinds`` names the kind of worker that sends each type of report (economic mode: item
    workers send ITEMS_DONE, batch workers the batches); the others are classic workers ("").
    """

    def __init__(self, recorder: StatsRecorder, session: int, capacity: int,
                 kinds: dict[Any, str] | None = None) -> None:
        self._seen = recorder._seen
        self._queue = recorder._queue
        self._queue.capacity = capacity
        self._session = session
        self._kinds = kinds or {}
        self._default_kind = "batch" if kinds else ""

    def local_clock(self) -> StageClock:
        """A clock for fetching in the main process (no workers); read at every snapshot."""
        clock = StageClock()
        self._seen[(self._session, "main", 0)] = (clock, None)
        return clock

    def record(self, reports: Iterable[Any]) -> None:
        """Keep the latest totals each report carries (reports without any are skipped)."""
        arrived = None
        for report in reports:
            totals = report.totals
            if totals is not None:
                arrived = arrived or now()
                # Hashing an IntEnum member runs Python code: skip it when there is one kind.
                kind = self._kinds.get(report.report, self._default_kind) if self._kinds else ""
                self._seen[(self._session, kind, report.worker_id)] = (totals, arrived)

    def handing_out(self, ready: int, in_flight: int) -> None:
        """A batch is being handed out; ``ready`` more are waiting, ``in_flight`` are sent and
        not yet handed out (this one excluded)."""
        queue = self._queue
        queue.samples += 1
        queue.ready_sum += ready
        queue.in_flight_sum += in_flight
        if ready > queue.ready_max:
            queue.ready_max = ready
        if in_flight > queue.in_flight_max:
            queue.in_flight_max = in_flight


@dataclass(frozen=True)
class LoaderSetup:
    """The settings a snapshot reports and the analysis reasons about."""

    mode: str
    worker_type: str
    num_workers: int
    prefetch_factor: int | None
    batch_size: int | None
    pin_memory: bool
    cpus: int = field(default_factory=usable_cpus)


class StatsRecorder:
    """All the stats of one loader, across its epochs and engine sessions.

    Invariants: ``_seen`` maps (session, kind, worker id) to the latest totals of that worker
    and when they arrived (a main-process clock is kept live, with no arrival time); totals
    only grow, so keeping the latest is keeping everything.
    """

    def __init__(self, setup: LoaderSetup) -> None:
        self.setup = setup
        self._seen: dict[tuple[int, str, int], tuple[Any, float | None]] = {}
        self._queue = _Queue()
        self._consumer = _Consumer()
        self._sessions = 0
        self._pin_s = 0.0
        self._pinned = 0
        self._skipped_samples = 0
        self._decisions: list[TuningDecision] = []
        self._lock = threading.Lock()  # only for the rare writers from several threads

    # -- hooks -------------------------------------------------------------------------------

    def new_session(self, capacity: int, kinds: dict[Any, str] | None = None) -> SessionStats:
        """A new engine session, holding up to ``capacity`` batches in flight (``kinds``: see
        :class:`SessionStats`)."""
        with self._lock:
            self._sessions += 1
            return SessionStats(self, self._sessions, capacity, kinds)

    def epoch_started(self) -> None:
        consumer = self._consumer
        consumer.epochs += 1
        consumer.epoch_started_at = now()
        consumer.last_handed_at = None

    def asking(self) -> float:
        """The training loop asks for a batch: what it did since the last one was its own work."""
        asked = now()
        consumer = self._consumer
        if consumer.last_handed_at is not None:
            consumer.compute_s += asked - consumer.last_handed_at
        return asked

    def handed(self, asked: float) -> None:
        """The batch asked for at ``asked`` is handed over now."""
        handed = now()
        consumer = self._consumer
        consumer.batches += 1
        if consumer.epoch_started_at is None:
            consumer.wait_s += handed - asked
        else:  # an epoch's first batch: start-up, kept apart from the steady waiting
            consumer.first_wait_s += handed - asked
            consumer.first_batch_s = handed - consumer.epoch_started_at
            consumer.epoch_started_at = None
        consumer.last_handed_at = handed

    def ended(self, asked: float) -> None:
        """The epoch ended (or raised) while the loop waited since ``asked``."""
        self._consumer.wait_s += now() - asked
        self._consumer.last_handed_at = None

    def pinned(self, seconds: float) -> None:
        self._pin_s += seconds
        self._pinned += 1

    def skipped(self, samples: int) -> None:
        """Samples skipped by an error policy that reports them itself; the sources' on_error
        pipes are counted by the workers' clocks instead (``stats/skips.py``)."""
        with self._lock:
            self._skipped_samples += samples

    def decided(self, decision: TuningDecision) -> None:
        """The auto-tuner changed (or kept) the settings."""
        with self._lock:
            self._decisions.append(decision)

    # -- reading -----------------------------------------------------------------------------

    def snapshot(self) -> LoaderStats:
        """Everything so far, as a frozen :class:`LoaderStats`."""
        consumer, queue = self._consumer, self._queue
        workers = _per_worker(self._seen.copy(), now())
        samples = queue.samples or 1
        return LoaderStats(
            setup=self.setup,
            batches=consumer.batches,
            epochs=consumer.epochs,
            wait_s=consumer.wait_s,
            compute_s=consumer.compute_s,
            first_wait_s=consumer.first_wait_s,
            first_batch_s=consumer.first_batch_s,
            pin_s=self._pin_s,
            pinned=self._pinned,
            workers=workers,
            queue=QueueStats(queue.ready_sum / samples, queue.ready_max,
                             queue.in_flight_sum / samples, queue.in_flight_max, queue.capacity),
            skipped_samples=self._skipped_samples + _skipped_by_workers(self._seen.copy()),
            decisions=tuple(self._decisions),
        )


def _per_worker(seen: dict[tuple[int, str, int], tuple[Any, float | None]], at: float) -> tuple[WorkerStats, ...]:
    """Sum each worker's totals over the sessions it lived in (a new pool per epoch restarts
    every worker's totals)."""
    merged: dict[tuple[str, int], WorkerStats] = {}
    for (_, kind, worker_id), (raw, arrived) in seen.items():
        totals = WorkerTotals._make(raw.snapshot() if isinstance(raw, StageClock) else raw)
        alive_s = max(0.0, (arrived if arrived is not None else at) - totals.started_at)
        one = _worker_stats(kind, worker_id, totals, alive_s)
        previous = merged.get((kind, worker_id))
        merged[(kind, worker_id)] = one if previous is None else previous.plus(one)
    return tuple(merged[key] for key in sorted(merged))


def _skipped_by_workers(seen: dict[tuple[int, str, int], tuple[Any, float | None]]) -> int:
    """What the workers' (and the main process's) on_error pipes skipped, per their totals."""
    return sum(WorkerTotals._make(raw.snapshot() if isinstance(raw, StageClock) else raw).skipped
               for raw, _ in seen.values())


def _worker_stats(kind: str, worker_id: int, totals: WorkerTotals, alive_s: float) -> WorkerStats:
    return WorkerStats(kind, worker_id, totals.tasks, totals.samples, totals.fetch_s,
                       totals.collate_s, totals.send_s, totals.bytes_out, alive_s, totals.cpu_s, totals.queued_s)
