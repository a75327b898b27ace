"""The engine behind ``num_workers="auto"``: one classic pool that the tuner resizes in place.

After each batch handed out, the tuner (``stats/tuner.py``) may ask for other settings. The
running pool takes them as they come (``PoolEngine.resize``): a deeper or shallower prefetch
changes its in-flight bound; more workers start beside the running ones, which go on building
what they hold and take their turns with the new ones; fewer stop taking tasks, and each is
stopped once it has handed in what it holds. Batches keep their numbers whichever worker builds
them, so sampler order, exactly-once delivery and per-batch seeds hold across every change; the
pool's lifecycle (start, watch, stop escalation) is the pool's own (``engine/workers.py``).

Map-style datasets only: an iterable dataset's replicas cannot be re-split mid-stream.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import Any

from pipeload.engine.plan import EpochStart
from pipeload.engine.pool import PoolEngine
from pipeload.stats.tuner import AutoTuner, Settings


class AutoEngine:
    """A :class:`PoolEngine` and the tuner that resizes it. Driven by one thread at a time."""

    def __init__(self, pool: PoolEngine, tuner: AutoTuner,
                 on_resize: Callable[[Settings], None] | None = None) -> None:
        """``on_resize``: told each new setting once the pool has taken it (the loader shows it
        in ``num_workers`` and ``prefetch_factor``)."""
        self._pool = pool
        self._tuner = tuner
        self._on_resize = on_resize

    @property
    def workers(self) -> list[Any]:
        return self._pool.workers

    @property
    def closed(self) -> bool:
        return self._pool.closed

    def start_epoch(self, tasks: Iterator[Any], shared_seed: int | None = None,
                    start: EpochStart = EpochStart()) -> None:
        self._pool.start_epoch(tasks, shared_seed, start)

    def next_batch(self) -> Any:
        """The next batch in sampler order; StopIteration at the end of the epoch."""
        batch = self._pool.next_batch()
        wanted = self._tuner.observe(self._pool.workers)
        if wanted is not None:
            self._tuner.workers_leaving(self._pool.workers)  # those a smaller pool stops
            self._pool.resize(wanted.num_workers, wanted.prefetch_factor)
            if self._on_resize is not None:
                self._on_resize(wanted)
        return batch

    def close(self) -> None:
        if not self._pool.closed:
            self._tuner.workers_leaving(self._pool.workers)  # an epoch's workers, stopping now
        self._pool.close()
