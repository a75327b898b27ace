"""``num_workers="auto"`` and ``prefetch_factor="auto"``: the decisions, apart from the engine.

The tuner starts from the CPUs this process may use (its affinity) and ``prefetch_factor=2``,
watches the training loop through the loader's stats, and climbs one step at a time:

1. Measure ``WINDOWS`` windows (each at least ``WINDOW_S`` and ``WINDOW_BATCHES`` batches) once
   the last change has settled, i.e. once the old pool's batches and the new pool's first round
   (as many batches as either keeps in flight) have been handed out: a window over new workers
   still starting up would judge the start-up, not the setting. Each window gives the batches/s,
   the share of the time the loop waited (of its steady time, less epochs' first batches and
   ends, as the stats summary says it), and the share of the wall time the workers' threads
   were on a CPU or queued for one (the kernel's counters). The step takes their medians, so
   one disturbed window (another job's burst on a shared machine) does not decide.
2. The loop waited less than ``STOP_WAITING`` of the time: loading keeps up; stop.
3. The last step did not raise throughput by ``MIN_GAIN``: go back to the best settings; stop.
   (A step that added computing workers beyond the CPUs of a crowded machine, whose workers
   were queued for a CPU at least ``CROWDED`` of the time, is kept unless it was slower by
   ``MIN_GAIN``: there more processes win a bigger share of the CPUs from the other jobs, which
   a 0.3 s window measures poorly.)
4. Otherwise grow the pool: to ``n / (1 - waited)`` workers, what would stop the waiting if
   workers were the only limit, but at least double and at most ``MAX_STEP`` times; up to
   ``COMPUTING_PER_CPU`` per usable CPU when the workers compute (on or queued for a CPU at
   least ``COMPUTING`` of the time: beyond the CPUs they only take turns on them, which pays
   only where other jobs share the CPUs, and step 3 keeps them only if it did pay; the pool
   shrinks back in place when not),
   up to ``MAX_WORKERS_PER_CPU`` per usable CPU when they mostly wait (I/O, remote reads); in
   both cases within the memory budget (batches in flight times their measured size). At the
   cap, double ``prefetch_factor`` (when it is "auto"; up to ``MAX_PREFETCH``) while it pays;
   then stop.

Economic mode takes "auto" as its starting settings and keeps them: its two kinds of workers
would need a tuner of their own (which kind limits, and a swap of either pool mid-epoch without
losing a piece in flight), more than its fixed rule for memory leaves to gain.

Every decision is logged (logger ``pipeload.auto``) and kept in ``loader.stats().decisions``.
The engine (``engine/auto.py``) carries them out. Owned by the thread that drives the epoch.
"""

from __future__ import annotations

import logging
import math
import os
import statistics
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from pipeload.stats.clock import now, sched_by_worker
from pipeload.stats.report import TuningDecision

LOG = logging.getLogger("pipeload.auto")
WINDOW_S = 0.3
WINDOW_BATCHES = 12
WINDOWS = 3  # per setting: decisions take their medians
COMPUTING = 0.5  # of the wall time on (or queued for) a CPU, per worker: they compute
SETTLE_BATCHES = 4  # batches after a change before measuring, beyond both pools' in-flight rounds
STOP_WAITING = 0.05
MIN_GAIN = 0.05
MAX_WORKERS_PER_CPU = 32  # waiting workers (I/O) are cheap in CPU; the memory budget still holds
COMPUTING_PER_CPU = 2  # computing workers: tried up to this many per usable CPU, kept if they pay
CROWDED = 0.25  # of the wall time queued for a CPU, per computing worker: other jobs share them
MAX_WORKERS = 64
MAX_PREFETCH = 8
MAX_STEP = 4  # the most a pool grows in one step
SHM_SHARE = 0.5  # of /dev/shm's free space, without a loader budget
CHECK_EVERY = 8  # batches between looks at the clock: observing must cost next to nothing


def memory_budget_bytes(loader_budget: int | None) -> int | None:
    """The loader's own budget (``max_shm_bytes``, where the loader has one), else half of what
    /dev/shm has free; None when neither can be known."""
    if loader_budget is not None:
        return loader_budget
    try:
        stat = os.statvfs("/dev/shm")
    except OSError:
        return None
    return int(stat.f_bavail * stat.f_frsize * SHM_SHARE)


@dataclass(frozen=True)
class Settings:
    num_workers: int
    prefetch_factor: int


def _in_flight(settings: Settings) -> int:
    return settings.num_workers * settings.prefetch_factor


class AutoTuner:
    """Decides the pool's size and prefetch from what the loader's stats show.

    Invariants: ``current`` is what the engine runs; ``best`` the fastest measured so far, with
    ``best_rate``; once ``done``, nothing changes any more.
    """

    def __init__(self, recorder: object, cpus: int, tune_workers: bool, tune_prefetch: bool,
                 start: Settings, budget_bytes: int | None) -> None:
        self._recorder = recorder
        self.cpus = cpus
        self.current = start
        self.best = start
        self.best_rate = 0.0
        self.done = not (tune_workers or tune_prefetch)
        self._tune_workers = tune_workers
        self._tune_prefetch = tune_prefetch
        self._budget = budget_bytes
        self._max_workers = min(MAX_WORKERS, MAX_WORKERS_PER_CPU * cpus)
        self._since_change = 0
        self._settle = SETTLE_BATCHES + _in_flight(start)
        # The window being measured, at its start: (at, batches, wait_s, each worker's sched_s,
        # the seconds of epochs' first batches and ends).
        self._window: tuple[float, int, float, dict[Any, tuple[float, float]], float] | None = None
        # The last readings of workers that left since (a pool of one epoch stopped, workers
        # stopped by a resize): without them, a window across an epoch of workers started anew
        # read their time as gone, and computing workers read -1% on a CPU (stop 53's skeptic).
        self._left: dict[Any, tuple[float, float]] = {}
        # (batches/s, waited, share on or queued for a CPU, share queued), per window
        self._measured: list[tuple[float, float, float, float]] = []
        self._crowded_step = False  # the last step added computing workers to a crowded machine
        fixed = "" if tune_workers or tune_prefetch else " (kept: only map-style datasets in classic mode are re-tuned)"
        self._decide(start, 0.0, f"start: {cpus} usable CPUs, prefetch_factor={start.prefetch_factor}{fixed}")

    def observe(self, workers: Sequence[Any] = ()) -> Settings | None:
        """Called after each batch handed out, with the running pool's worker handles; returns
        new settings when they should change."""
        if self.done:
            return None
        self._since_change += 1
        if self._since_change < self._settle or self._since_change % CHECK_EVERY:
            return None
        consumer = self._recorder.consumer
        at = now()
        if self._window is None:
            self._window = (at, consumer.batches, consumer.wait_estimate(), sched_by_worker(list(workers)),
                            _set_aside(consumer))
            self._left = {}
            return None
        started, batches, wait_s, running, aside_s = self._window
        elapsed = at - started
        if elapsed < WINDOW_S or consumer.batches - batches < WINDOW_BATCHES:
            return None
        window = self._window = (at, consumer.batches, consumer.wait_estimate(), sched_by_worker(list(workers)),
                                 _set_aside(consumer))
        per_worker_s = elapsed * max(1, len(workers))
        on_cpu, queued = _sched_between(running, window[3], self._left)
        self._left = {}
        # The waits are the steady batches' (wait_estimate leaves out each epoch's first batch
        # and end), so they are a share of the window less those: over its whole seconds, a loop
        # that only waited, fed by workers started anew each epoch, read "waited 32%" where the
        # stats read 100%, and the step grew the pool by less than the waiting asked.
        steady_s = max(elapsed - (window[4] - aside_s), 1e-9)
        self._measured.append(((window[1] - batches) / elapsed,
                               min(1.0, max(0.0, window[2] - wait_s) / steady_s),
                               (on_cpu + queued) / per_worker_s, queued / per_worker_s))
        if len(self._measured) < WINDOWS:
            return None
        rate, waited, share, queued_share = (statistics.median(m[i] for m in self._measured) for i in range(4))
        self._measured = []
        return self._step(rate, waited, share, queued_share)

    def workers_leaving(self, workers: Sequence[Any]) -> None:
        """``workers`` are about to stop (or may: a pool's workers as it closes): keep their
        scheduler counters for the window being measured."""
        if not self.done and self._window is not None:
            self._left.update(sched_by_worker(list(workers)))

    def _step(self, rate: float, waited: float, share: float = 0.0, queued: float = 0.0) -> Settings | None:
        if waited < STOP_WAITING:
            return self._finish(None, rate, f"the training loop waits {waited:.0%} of the time: keeping these")
        if self.current != self.best:
            # A step must pay MIN_GAIN to be kept; more computing workers on a crowded machine
            # are kept unless they were slower by as much (see COMPUTING_PER_CPU).
            floor = self.best_rate * ((1 - MIN_GAIN) if self._crowded_step else (1 + MIN_GAIN))
            if rate < floor:
                return self._finish(self.best, rate, f"{self._describe(self.current)} was no faster "
                                    f"({rate:,.1f} vs {self.best_rate:,.1f} batches/s with "
                                    f"{self._describe(self.best)}): back to those")
            # The rate kept is the kept settings' own: a crowded step kept a little slower must
            # not inherit the faster rate of the settings before it (the log read as if it had).
            self.best, self.best_rate = self.current, rate
        elif rate > self.best_rate:
            self.best, self.best_rate = self.current, rate
        computing = share >= COMPUTING
        seen = (f"the training loop waited {waited:.0%} at {rate:,.1f} batches/s, workers on or "
                f"queued for a CPU {share:.0%} of the time (queued {queued:.0%})")
        bigger = self._next_settings(computing, waited)
        if bigger is None:
            why = (f"the workers compute: no more of them than {COMPUTING_PER_CPU}x the {self.cpus} usable CPUs"
                   if computing and self.current.num_workers >= COMPUTING_PER_CPU * self.cpus else
                   "no further step fits the CPUs and the memory budget")
            return self._finish(None, rate, f"{seen}; {why}")
        # Other jobs share the CPUs when computing workers spend this much of their time queued:
        # more processes then win a bigger share of them.
        self._crowded_step = (computing and queued >= CROWDED and bigger.num_workers > self.cpus
                              and bigger.num_workers > self.current.num_workers)
        return self._change(bigger, rate, seen)

    @staticmethod
    def _grown(workers: int, waited: float) -> int:
        """The next pool size: as many workers as would stop the waiting if the workers were
        the only limit (``n / (1 - waited)``), at least twice and at most four times as many."""
        wanted = math.ceil(workers / max(1e-3, 1 - waited))
        return max(2 * workers, min(MAX_STEP * workers, wanted))

    def _next_settings(self, computing: bool = False, waited: float = 0.0) -> Settings | None:
        workers, prefetch = self.current.num_workers, self.current.prefetch_factor
        most = min(self._max_workers, COMPUTING_PER_CPU * self.cpus) if computing else self._max_workers
        if self._tune_workers and workers < most:
            # As far as the step asks, or as far as the memory budget lets it, if that is less
            # (a step that did not fit stopped the tuning, where a smaller one would have paid).
            count = min(most, self._grown(workers, waited), self._most_workers_fitting(prefetch))
            if count > workers:
                return Settings(count, prefetch)
        if self._tune_prefetch and prefetch == self.best.prefetch_factor and prefetch < MAX_PREFETCH:
            wanted = Settings(workers, prefetch * 2)
            if self._fits(wanted):
                return wanted
        return None

    def _most_workers_fitting(self, prefetch: int) -> int | float:
        """The most workers whose batches in flight, at the size measured so far, fit the memory
        budget."""
        snapshot = self._recorder.snapshot()
        per_batch = snapshot.bytes_moved / snapshot.batches if snapshot.batches else 0
        if self._budget is None or per_batch <= 0:
            return math.inf
        return int(self._budget // (prefetch * per_batch))

    def _fits(self, settings: Settings) -> bool:
        """Batches in flight, at the size measured so far, stay within the memory budget."""
        return settings.num_workers <= self._most_workers_fitting(settings.prefetch_factor)

    def _change(self, settings: Settings, rate: float, why: str) -> Settings:
        self._settle = SETTLE_BATCHES + _in_flight(self.current) + _in_flight(settings)
        self.current = settings
        self._since_change = 0
        self._window = None
        self._measured = []
        self._decide(settings, rate, f"{why}: trying {self._describe(settings)}")
        return settings

    def _finish(self, settings: Settings | None, rate: float, why: str) -> Settings | None:
        self.done = True
        if settings is not None:
            self.current = settings
        self._decide(self.current, rate, why)
        return settings

    def _decide(self, settings: Settings, rate: float, reason: str) -> None:
        batches = self._recorder.consumer.batches
        samples_per_s = rate * (self._recorder.setup.batch_size or 1)
        LOG.info("pipeload auto at batch %d: num_workers=%d, prefetch_factor=%d (%s)", batches,
                 settings.num_workers, settings.prefetch_factor, reason)
        self._recorder.decided(TuningDecision(batches, settings.num_workers, settings.prefetch_factor,
                                              samples_per_s, reason, settled=self.done))

    @staticmethod
    def _describe(settings: Settings) -> str:
        return f"num_workers={settings.num_workers}, prefetch_factor={settings.prefetch_factor}"


def _set_aside(consumer: Any) -> float:
    """Seconds the loop spent on its epochs' first batches (from ``iter()``) and ends: start-up
    and stopping, not the steady waiting a window's share of waiting is about."""
    return consumer.first_wait_s + consumer.end_wait_s


def _sched_between(start: dict[Any, tuple[float, float]], end: dict[Any, tuple[float, float]],
                   left: dict[Any, tuple[float, float]]) -> tuple[float, float]:
    """Seconds on a CPU and queued for one between two readings of each worker: a worker that
    left in between counts to its last reading (``left``; nothing where none was taken), one
    started in between from its start (a pool of one short epoch can start and stop inside a
    window)."""
    on_cpu = queued = 0.0
    for key, (ran, waited) in start.items():
        ended = end.get(key) or left.get(key) or (ran, waited)
        on_cpu += max(0.0, ended[0] - ran)
        queued += max(0.0, ended[1] - waited)
    for key, (ran, waited) in {**left, **end}.items():
        if key not in start:
            on_cpu += ran
            queued += waited
    return on_cpu, queued
