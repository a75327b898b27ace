"""``num_workers="auto"`` and ``prefetch_factor="auto"``: the decisions, apart from the engine.

The tuner starts from the CPUs this process may use and ``prefetch_factor=2``, watches the
training loop through the loader's stats, and climbs one step at a time:

1. Measure a window (at least ``WINDOW_S`` and ``WINDOW_BATCHES`` batches) once the last change
   has settled, i.e. once the old pool's batches and the new pool's first round (as many
   batches as either keeps in flight) have been handed out: a window over new workers still
   starting up would judge the start-up, not the setting.
2. The loop waited less than ``STOP_WAITING`` of the window: loading keeps up; stop.
3. The last step did not raise throughput by ``MIN_GAIN``: go back to the best settings; stop
   (more workers than CPUs can take, or a bottleneck that workers do not relieve).
4. Otherwise double the workers, up to ``MAX_WORKERS_PER_CPU`` per usable CPU and within the
   memory budget (batches in flight times their measured size); at the cap, double
   ``prefetch_factor`` (when it is "auto"; up to ``MAX_PREFETCH``) while it pays; then stop.

Economic mode takes "auto" as its starting settings and keeps them: it bounds memory by its
own rule, and its two kinds of workers would need a tuner of their own.

Every decision is logged (logger ``pipeload.auto``) and kept in ``loader.stats().decisions``.
The engine (``engine/auto.py``) carries them out. Owned by the thread that drives the epoch.
"""

from __future__ import annotations

import logging
import os
from dataclasses import dataclass

from pipeload.stats.clock import now
from pipeload.stats.report import TuningDecision

LOG = logging.getLogger("pipeload.auto")
WINDOW_S = 0.5
WINDOW_BATCHES = 16
SETTLE_BATCHES = 4  # batches after a change before measuring, beyond both pools' in-flight rounds
STOP_WAITING = 0.05
MIN_GAIN = 0.05
MAX_WORKERS_PER_CPU = 16  # waiting workers (I/O) are cheap in CPU; the memory budget still holds
MAX_WORKERS = 64
MAX_PREFETCH = 8
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
        self._window: tuple[float, int, float] | None = None  # (at, batches, wait_s) at its start
        fixed = "" if tune_workers or tune_prefetch else " (kept: only map-style datasets in classic mode are re-tuned)"
        self._decide(start, 0.0, f"start: {cpus} usable CPUs, prefetch_factor={start.prefetch_factor}{fixed}")

    def observe(self) -> Settings | None:
        """Called after each batch handed out; returns new settings when they should change."""
        if self.done:
            return None
        self._since_change += 1
        if self._since_change < self._settle or self._since_change % CHECK_EVERY:
            return None
        consumer = self._recorder._consumer
        at = now()
        if self._window is None:
            self._window = (at, consumer.batches, consumer.wait_estimate())
            return None
        started, batches, wait_s = self._window
        if at - started < WINDOW_S or consumer.batches - batches < WINDOW_BATCHES:
            return None
        rate = (consumer.batches - batches) / (at - started)
        waited = min(1.0, max(0.0, consumer.wait_estimate() - wait_s) / (at - started))
        return self._step(rate, waited)

    def _step(self, rate: float, waited: float) -> Settings | None:
        if waited < STOP_WAITING:
            return self._finish(None, rate, f"the training loop waits {waited:.0%} of the time: keeping these")
        if self.current != self.best and rate < self.best_rate * (1 + MIN_GAIN):
            return self._finish(self.best, rate, f"{self._describe(self.current)} was no faster "
                                f"({rate:,.1f} vs {self.best_rate:,.1f} batches/s): back to the best")
        if rate > self.best_rate:
            self.best, self.best_rate = self.current, rate
        bigger = self._next_settings()
        if bigger is None:
            return self._finish(None, rate, "no further step fits the CPUs and the memory budget")
        return self._change(bigger, rate, f"the training loop waited {waited:.0%} at {rate:,.1f} batches/s")

    def _next_settings(self) -> Settings | None:
        workers, prefetch = self.current.num_workers, self.current.prefetch_factor
        if self._tune_workers and workers < self._max_workers:
            wanted = Settings(min(self._max_workers, workers * 2), prefetch)
            if self._fits(wanted):
                return wanted
        if self._tune_prefetch and prefetch == self.best.prefetch_factor and prefetch < MAX_PREFETCH:
            wanted = Settings(workers, prefetch * 2)
            if self._fits(wanted):
                return wanted
        return None

    def _fits(self, settings: Settings) -> bool:
        """Batches in flight, at the size measured so far, stay within the memory budget."""
        snapshot = self._recorder.snapshot()
        per_batch = snapshot.bytes_moved / snapshot.batches if snapshot.batches else 0
        needed = settings.num_workers * settings.prefetch_factor * per_batch
        return self._budget is None or needed <= self._budget

    def _change(self, settings: Settings, rate: float, why: str) -> Settings:
        self._settle = SETTLE_BATCHES + _in_flight(self.current) + _in_flight(settings)
        self.current = settings
        self._since_change = 0
        self._window = None
        self._decide(settings, rate, f"{why}: trying {self._describe(settings)}")
        return settings

    def _finish(self, settings: Settings | None, rate: float, why: str) -> Settings | None:
        self.done = True
        if settings is not None:
            self.current = settings
        self._decide(self.current, rate, why)
        return settings

    def _decide(self, settings: Settings, rate: float, reason: str) -> None:
        batches = self._recorder._consumer.batches
        samples_per_s = rate * (self._recorder.setup.batch_size or 1)
        LOG.info("pipeload auto at batch %d: num_workers=%d, prefetch_factor=%d (%s)", batches,
                 settings.num_workers, settings.prefetch_factor, reason)
        self._recorder.decided(TuningDecision(batches, settings.num_workers, settings.prefetch_factor,
                                              samples_per_s, reason))

    @staticmethod
    def _describe(settings: Settings) -> str:
        return f"num_workers={settings.num_workers}, prefetch_factor={settings.prefetch_factor}"
