"""How many batches the pool keeps in flight: enough to keep the training loop fed, no more.

torch keeps ``prefetch_factor * num_workers`` batches in flight whatever happens. When the training
loop is slower than the workers, the batches beyond what keeps it fed only sit in shared memory.
The budget therefore measures two times: how long a worker takes to build a batch, and how long the
consumer takes between two requests. ``ceil(margin * build / consume)`` batches in flight finish
one batch per request; every request that finds its batch missing adds one more (given back once
the consumer stays fed). A byte budget caps it too.

Two refinements keep the start from deciding the peak:

* Until the consumer's pace is known (two requests), only the first wave (one task per worker) is
  in flight; nothing is sent after the first batch is handed out. Batches that travel inside
  their messages (small ones) skip this and the estimate alike: they hold no shared memory, so
  all ``prefetch_factor * num_workers`` fly as soon as the first has arrived.
* Setting up shared memory (a new slab's pages, a fresh buffer) is a one-off cost of the start,
  reported apart by the worker: it is left out of the build time, and a request that waited for
  a batch that paid it does not count as the consumer being starved.

Large batches (``LARGE_BATCH_BYTES`` and more of shared memory each) are priced differently: each
batch in flight beyond the first holds a whole slab, so the margin goes. One batch flies while a
worker builds a batch in at most ``1 + TOLERATED_WAIT`` consumer steps (the consumer then waits at
most that share of a step), and a wait shorter than that share does not count as starving
(``POOL_TOLERATED_WAIT`` for economic mode's pool, which builds its batches one at a time). With the
slab of the batch being dropped granted ahead (``transport/slab_pool.py``), that is two slabs
in all: the one the training loop holds and the one being filled. A new slab costs its pages
(seconds for hundreds of MB on a loaded machine) and keeps them: for large batches the estimate
raises the count only once it has asked for more on ``GROW_AFTER`` requests in a row, so one slow
build (another program took the CPU for a moment) does not leave a slab behind.

The budget only ever lowers what is in flight: ``prefetch_factor * num_workers`` stays the most,
and one batch the least, so ordering, ``in_order=False`` and persistent workers are unaffected.

What a budget has learnt (its :class:`Pace`) outlives it: a loader keeps the last one with its
slab pool (``transport/slab_keeper.py``), and the budget of its next set of workers (the next
epoch without persistent workers, the next iterator) starts from it: at the depth the last one
ended with, instead of one task per worker and one batch in flight until the pace is known.
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable
from dataclasses import dataclass

from pipeload.transport import shared_memory
from pipeload.transport.slab_pool import LOOP_FLOOR_SLABS

EMA_WEIGHT = 0.5  # weight of the newest sample: recent behaviour decides
MARGIN = 1.25  # build time is stretched by this much before dividing
CALM_REQUESTS = 8  # requests served without waiting before one extra batch is given back
LARGE_BATCH_BYTES = 8 << 20  # from here on, each batch in flight is a slab's worth of memory
TOLERATED_WAIT = 0.2  # large batches: a wait under this share of the consumer's step is jitter
# Economic mode: the pool builds its batches one after another (every item worker fills each), so
# a second large batch in flight does not halve the build time as a second classic worker does; it
# only lets idle item workers start on the next batch while the last pieces of one come in. It pays
# a whole slab for that share of a build, so it is taken only when the consumer would otherwise
# wait more than half a step (from 1.2 steps, the estimate under a loaded machine crossed the line
# now and then, and the third slab showed up in the peak).
POOL_TOLERATED_WAIT = 0.5
GROW_AFTER = 4  # large batches: requests in a row whose estimate asks for more before it is given
DEFAULT_SHM_SHARE = 0.5  # of what the backing memory can still take, when max_shm_bytes is None
UNKNOWN_SHM_BYTES = 1 << 62


def loop_floor_slabs(max_shm_bytes: int | None) -> int:
    """Slabs a pool may hold beyond the byte budget: under a user's ``max_shm_bytes``, the two a
    training loop needs (slab_pool.LOOP_FLOOR_SLABS); under a budget read from the memory, none."""
    return LOOP_FLOOR_SLABS if max_shm_bytes is not None else 0


def shm_budget_bytes(max_shm_bytes: int | None, held_bytes: int = 0) -> int:
    """The byte budget for slabs and batches in flight: ``max_shm_bytes`` when the user gave
    one, else half of what the memory behind shared buffers can still take, counting the
    ``held_bytes`` of slabs the loader keeps already as memory it may use again."""
    if max_shm_bytes is not None:
        return max_shm_bytes
    available = shared_memory.available_bytes()
    if available is None:
        return UNKNOWN_SHM_BYTES
    return max(1, int((available + held_bytes) * DEFAULT_SHM_SHARE))


@dataclass(frozen=True)
class Pace:
    """What a budget learnt about its loader: the smoothed build and consumer times, and the
    batches in flight it ended with (see :meth:`InFlightBudget.pace`)."""

    build_s: float
    consume_s: float
    in_flight: int


class InFlightBudget:
    """The number of batches the pool may have sent and not yet handed out.

    Touched only by the thread that drives the engine.
    Invariant: ``1 <= allowed() <= max_batches``.

    Example:
        >>> budget = InFlightBudget(max_batches=4, num_workers=2, max_bytes=1 << 30)
        >>> budget.allowed(batch_bytes=0)
        2
    """

    def __init__(
        self, max_batches: int, num_workers: int, max_bytes: int,
        clock: Callable[[], float] = time.perf_counter, tolerated_wait: float = TOLERATED_WAIT,
        pace: Pace | None = None,
    ) -> None:
        """``pace``: what an earlier budget of the same loader learnt (None: start afresh)."""
        self.max_batches = max_batches
        self._clock = clock
        self._tolerated_wait = tolerated_wait  # large batches' (see POOL_TOLERATED_WAIT)
        self._first_wave = max(1, min(max_batches, num_workers))
        self._max_bytes = max_bytes
        self._build_s: float | None = None
        self._consume_s: float | None = None
        self._returned_at: float | None = None
        self._served = 0
        self._extra = 0
        self._calm = 0
        self._needed = self._first_wave
        self._large = False
        self._asked_more = 0  # requests in a row whose estimate asked for more than it had
        if pace is not None:
            self._build_s, self._consume_s = pace.build_s, pace.consume_s
            self._needed = max(1, min(max_batches, pace.in_flight))

    def pace(self) -> Pace | None:
        """What this budget has learnt, for the next set of workers (None: nothing yet)."""
        if not self._model_known():
            return None
        return Pace(self._build_s, self._consume_s, self._needed)  # type: ignore[arg-type]

    def knows_pace(self) -> bool:
        """Whether the build and consumer times are known (measured, or from an earlier pace)."""
        return self._model_known()

    def set_max_batches(self, max_batches: int) -> None:
        """A new ceiling (``prefetch_factor="auto"`` deepening or thinning the pool)."""
        self.max_batches = max(1, max_batches)
        self._extra = min(self._extra, self.max_batches)
        self._update()

    def epoch_started(self) -> None:
        """A new epoch: the gap since the last request was not the consumer's work on a batch."""
        self._returned_at = None

    def batch_built(self, build_s: float) -> None:
        """A worker reported how long it took to build one batch (shared-memory set-up excluded)."""
        if build_s > 0:
            old = self._build_s
            self._build_s = build_s if old is None else old + EMA_WEIGHT * (build_s - old)

    def request_started(self) -> None:
        """The consumer asks for the next batch: the time since the last one was its own."""
        if self._returned_at is not None:
            self._consume_s = _blend(self._consume_s, self._clock() - self._returned_at)

    def request_served(self, starved: bool, waited_s: float = 0.0) -> None:
        """The batch is being handed out; ``starved`` if the consumer waited for it for want of
        batches in flight (not for a one-off set-up), for ``waited_s`` seconds."""
        self._served += 1
        if starved and self._large and self._consume_s is not None:
            starved = waited_s > self._tolerated_wait * self._consume_s
        if starved and self._model_known() and self._needed < self.max_batches:
            self._extra += 1
            self._calm = 0
        elif not starved:
            self._calm += 1
            if self._calm >= CALM_REQUESTS and self._extra > 0:
                self._extra -= 1
                self._calm = 0
        self._update(per_request=True)

    def consumer_resumes(self) -> None:
        """The batch is in the consumer's hands: its own time starts now."""
        self._returned_at = self._clock()

    def allowed(self, batch_bytes: int, inline_only: bool = False) -> int:
        """Batches that may be in flight now, for batches of ``batch_bytes`` (0: unknown).

        ``inline_only``: every batch so far travelled inside its message, so one in flight holds
        no shared memory and costs nothing to keep: all ``max_batches`` fly, from the first
        arrival on (not one per worker until the consumer's pace is known).
        The estimate is refreshed once per request (``request_served``), not on every sample.
        """
        if inline_only:
            return self.max_batches
        large = batch_bytes >= LARGE_BATCH_BYTES
        if large is not self._large:
            self._large = large
            self._update()
        needed = self._needed
        if batch_bytes > 0:
            needed = min(needed, max(1, self._max_bytes // batch_bytes))
        return needed

    def most(self, batch_bytes: int) -> int:
        """The ceiling alone: ``max_batches``, or fewer if batches of ``batch_bytes`` (0:
        unknown) would not fit the byte budget; what flies whatever the estimate says."""
        if batch_bytes > 0:
            return max(1, min(self.max_batches, self._max_bytes // batch_bytes))
        return self.max_batches

    def _model_known(self) -> bool:
        return self._build_s is not None and self._consume_s is not None

    def _update(self, per_request: bool = False) -> None:
        if self._model_known():
            ratio = self._build_s / max(self._consume_s, 1e-6)  # type: ignore[operator]
            if self._large:
                wanted = math.ceil(ratio - self._tolerated_wait)
            else:
                wanted = math.ceil(MARGIN * ratio)
            wanted = max(1, min(self.max_batches, wanted + self._extra))
            if self._large and wanted > self._needed and self._extra == 0:
                self._asked_more = self._asked_more + 1 if per_request else self._asked_more
                if self._asked_more < GROW_AFTER:
                    return  # not yet: a single slow build is no reason for another slab
            self._asked_more = 0
            self._needed = wanted
        elif self._served > 0:
            self._needed = 1  # the first wave is out; wait for the consumer's pace
        else:
            self._needed = min(self.max_batches, self._first_wave + self._extra)


def _blend(old: float | None, new: float) -> float:
    return new if old is None else old + EMA_WEIGHT * (new - old)


class PoolBuildClock:
    """How long the pool takes to build one batch, when all workers build batches together.

    In classic mode a worker times its own batch. In economic mode many item workers fill every
    batch, and pieces go out in batch order, so the pool works on its batches one after another,
    like a single server taking them in turn: a batch's build time runs from the moment the pool
    could start on it (it was opened, and the batch before it had arrived) to its own arrival.
    With several batches in flight their pieces overlap a little at the edges; the sum over a run
    is still the pool's busy time. The first batch of an epoch is not timed: it also waited for
    the workers to start (or to begin the epoch). Touched only by the thread that drives the engine.

    Example:
        >>> clock = PoolBuildClock()
        >>> for number in range(3):
        ...     clock.opened(number, at=1.0)
        >>> [round(clock.arrived(number, at), 3) for number, at in enumerate([2.0, 2.3, 2.5])]
        [0.0, 0.3, 0.2]
    """

    def __init__(self) -> None:
        self._opened: dict[int, float] = {}
        self._free_at: float | None = None  # when the pool could start on the next batch

    def opened(self, number: int, at: float) -> None:
        """Batch ``number`` was opened (its pieces may go out) at time ``at``."""
        self._opened[number] = at

    def arrived(self, number: int, at: float) -> float:
        """Batch ``number`` arrived at ``at``: its build time (0.0: not timed)."""
        opened = self._opened.pop(number, None)
        free_at, self._free_at = self._free_at, at if self._free_at is None else max(self._free_at, at)
        if opened is None or free_at is None:
            return 0.0
        return max(0.0, at - max(opened, free_at))
