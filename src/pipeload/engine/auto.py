"""The engine behind ``num_workers="auto"``: a classic pool that a bigger one can replace
mid-epoch, with batches still yielded in sampler order.

When the tuner (``stats/tuner.py``) asks for another prefetch depth alone, the running pool takes
it as it is. When it asks for another number of workers, the running pool stops taking tasks
(its task source is closed: to it, the sampler has run out), a new pool starts on the rest of
the sampler's tasks at once, and batches come from the old pool until it has handed out all it
was sent, then from the new one. The old pool is closed as soon as it is drained; for a moment
both are alive, which is what keeps the new workers' start-up off the training loop's clock.

Map-style datasets only: an iterable dataset's replicas cannot be re-split mid-stream.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Iterator
from typing import Any

from pipeload.engine.plan import EpochStart
from pipeload.engine.pool import PoolConfig, PoolEngine
from pipeload.engine.worker_info import derive_seed
from pipeload.stats.tuner import AutoTuner, Settings


AUTO_POOL_STREAM = 5  # apart from the item (1), batch (2) and per-batch (3, 4) seed streams


def pools_like(first: PoolConfig) -> Callable[[Settings, int], PoolEngine]:
    """Builds pools as ``first`` describes, with the settings asked for, starting at the
    session epoch given (a pool that replaces another mid-epoch goes on with its epoch).

    Their base seeds follow from ``first``'s, not from a generator: a pool started whenever
    the tuner decides must not move the loader's or the global generator (what later epochs
    draw from). With per-batch seeding every pool keeps ``first``'s seed, so a batch's random
    values depend on its number alone, whichever pool (and however many workers) built it;
    with torch's seeding each later pool gets a seed of its own, so that its workers do not
    repeat the first pool's workers' streams.
    """
    pools = 0

    def make_pool(settings: Settings, epoch: int) -> PoolEngine:
        nonlocal pools
        seed = first.setup.base_seed
        if pools and not first.setup.fetch.per_batch_seeding:
            seed = derive_seed(seed, AUTO_POOL_STREAM, pools)
        pools += 1
        setup = dataclasses.replace(first.setup, num_workers=settings.num_workers, base_seed=seed,
                                    first_epoch=epoch)
        return PoolEngine(dataclasses.replace(first, setup=setup, prefetch_factor=settings.prefetch_factor))

    return make_pool


class _TaskTap:
    """The sampler's tasks, as one pool sees them, until the tap is shut (then: exhausted).
    ``taken`` counts the tasks it passed on: the next pool numbers its batches on from them."""

    def __init__(self, tasks: Iterator[Any]) -> None:
        self._tasks = tasks
        self.open = True
        self.taken = 0

    def __iter__(self) -> _TaskTap:
        return self

    def __next__(self) -> Any:
        if not self.open:
            raise StopIteration
        task = next(self._tasks)
        self.taken += 1
        return task


class AutoEngine:
    """Runs pools built by ``make_pool(settings)`` and swaps them when the tuner says so.

    Driven by one thread at a time. Invariants: ``_draining`` (if any) was sent only tasks that
    come before every task of ``_current``; its tap is shut; ``_current``'s tap is open.
    """

    def __init__(self, make_pool: Callable[[Settings, int], PoolEngine], tuner: AutoTuner,
                 first_epoch: int = 1) -> None:
        self._make_pool = make_pool
        self._tuner = tuner
        self._current = make_pool(tuner.current, first_epoch)
        self._first_batch = 0  # the number of the current pool's first batch this epoch
        self._draining: PoolEngine | None = None
        self._waiting: Settings | None = None  # asked for while a pool was still draining
        self._tasks: Iterator[Any] = iter(())
        self._tap = _TaskTap(self._tasks)

    @property
    def workers(self) -> list[Any]:
        draining = self._draining.workers if self._draining is not None else []
        return draining + self._current.workers

    @property
    def closed(self) -> bool:
        return self._current.closed

    def start_epoch(self, tasks: Iterator[Any], shared_seed: int | None = None,
                    start: EpochStart = EpochStart()) -> None:
        self._tasks = tasks
        self._tap = _TaskTap(tasks)
        self._first_batch = start.first_batch
        self._current.start_epoch(self._tap, shared_seed, start)

    def next_batch(self) -> Any:
        """The next batch in sampler order; StopIteration at the end of the epoch."""
        if self._draining is not None:
            try:
                return self._from(self._draining)
            except StopIteration:
                self._draining.close()
                self._draining = None
        batch = self._from(self._current)
        wanted = self._tuner.observe(self._current.workers) or self._waiting
        if wanted is not None:
            self._switch(wanted)
        return batch

    def _from(self, engine: PoolEngine) -> Any:
        try:
            return engine.next_batch()
        except StopIteration:
            raise
        except BaseException:
            if engine.closed:  # what ends the epoch for one pool ends it for all
                self.close()
            raise

    def _switch(self, settings: Settings) -> None:
        if self._draining is not None:  # still draining the one before: it finishes first
            self._waiting = settings
            return
        self._waiting = None
        if settings.num_workers == len(self._current.workers):  # the same pool, deeper or not
            self._current.set_prefetch_factor(settings.prefetch_factor)
            return
        self._tap.open = False
        # The new pool takes over the epoch: its batches go on numbering (and seeding) from
        # where the old pool's tasks ended, in the same session epoch.
        self._first_batch += self._tap.taken
        new = self._make_pool(settings, self._current.epoch)
        self._tap = _TaskTap(self._tasks)
        try:
            new.start_epoch(self._tap, start=EpochStart(first_batch=self._first_batch))
        except BaseException:
            new.close()
            raise
        self._draining, self._current = self._current, new

    def close(self) -> None:
        if self._draining is not None:
            self._draining.close()
            self._draining = None
        self._current.close()
