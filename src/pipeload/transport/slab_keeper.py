"""A loader's slab pool, kept between the sets of workers it starts one after another.

Each epoch of a loader without persistent workers (torch's default), each new iterator, starts a
new set of worker processes. If the slab pool belonged to the set, every set would start with no
slabs and no idea how large a batch is: its first batches would travel in one-shot buffers, and
its slabs would be made, faulted in and page-locked again. The :class:`SlabKeeper` is the one
place a loader's pool lives instead. A set of workers borrows it when it starts (``lend``) and
gives it back when it stops (``give_back``); the next set finds the slabs mapped, faulted in and
page-locked, and the batch size known. The classic pool, economic mode and the DataPipes process
boundary all borrow through it (``engine/workers.py``'s group, and ``datapipes/boundary``).

The pool goes:

* when its owner goes: the loader is collected or deleted (a ``weakref.finalize`` calls
  :meth:`close`), or is pickled or deep-copied (the copy gets a keeper of its own, with no pool);
* on request (:meth:`release`, ``DataLoader.release_shared_memory()``), and when a set of workers
  ends in a failure (a dead worker, Ctrl-C: the error may keep the loader alive for long);
* when more than ``MOST_IDLE_POOLS_KEPT`` loaders with no workers running keep a pool: the least
  recently used lets its pool go (loaders kept and unused would hold theirs for good);
* in part when memory runs short: a set that may use fewer slabs, or fewer bytes (``max_shm_bytes``,
  or half of what memory can still take, counting the pool's own slabs), than the pool holds gets
  it trimmed to what it can use before it starts (``SlabPool.fit``).

A pool lent to a running set is never closed under it: a release or close that comes meanwhile
takes effect when the set gives it back. A second set that starts while the first still runs
(two live iterators of one loader) borrows a pool of its own, closed when it stops.

It also keeps what the last set's in-flight budget learnt about the batches' pace (``pace``,
``engine/budget.py``), so that the next set starts at the depth the last one ended with instead of
finding it again, and, for economic mode, the size of the items' tensors (``item_layout``), so
that the next set lays out its first batch in a slab instead of learning it again, or that they
cannot be laid out so (``direct_refused``: the next set's batches go to batch workers at once),
and their time per item (``item_s``, which decides how finely batches are cut into pieces).

Example:
    >>> keeper = SlabKeeper()
    >>> pool = keeper.lend(SlabSettings(pin=False, max_bytes=1 << 30, batches_in_flight=5))
    >>> keeper.give_back(pool)   # kept: the next lend returns it, producers forgotten
    >>> keeper.close()           # the pool goes now
"""

from __future__ import annotations

import collections
import threading
import weakref
from dataclasses import dataclass
from typing import Any

from pipeload.transport.slab_pool import SlabCounts, SlabPool


MOST_IDLE_POOLS_KEPT = 4  # loaders with no workers running that keep their slabs, most recent first


class _IdleKeepers:
    """The keepers holding a pool no set of workers uses now, least recently idle first.

    A pool kept between epochs saves the next set its slabs; a loader that stays referenced and
    unused (one validation loader per task, say) would hold its slabs, and their descriptors, for
    as long as it lives. Beyond ``most`` idle pools, the least recently used go: a loader that
    comes back to work starts a pool anew, as its first epoch did.
    """

    def __init__(self, most: int) -> None:
        self._lock = threading.Lock()
        self._order: collections.OrderedDict[int, weakref.ref[SlabKeeper]] = collections.OrderedDict()
        self._most = most

    def became_idle(self, keeper: SlabKeeper) -> None:
        with self._lock:
            self._order.pop(id(keeper), None)
            self._order[id(keeper)] = weakref.ref(keeper)
            surplus = [self._order.popitem(last=False)[1] for _ in range(len(self._order) - self._most)]
        for gone in surplus:  # released outside the lock: each takes its own keeper's lock
            victim = gone()
            if victim is not None:
                victim.release()

    def not_idle(self, keeper: SlabKeeper) -> None:
        """``keeper``'s pool is lent, or gone."""
        with self._lock:
            self._order.pop(id(keeper), None)


_IDLE = _IdleKeepers(MOST_IDLE_POOLS_KEPT)


@dataclass(frozen=True)
class SlabSettings:
    """What a set of workers asks of the slab pool behind their result channels.

    Attributes:
        pin: page-lock slabs for CUDA, so batches come out pinned with no copy.
        max_bytes: the most shared memory the slabs may hold.
        batches_in_flight: the most batches ever in flight, plus one; bounds the number of slabs.
        floor_slabs: slabs the pool may hold even beyond ``max_bytes`` (slab_pool.LOOP_FLOOR_SLABS
            under a user's ``max_shm_bytes``; 0 under a budget read from the memory).
    """

    pin: bool
    max_bytes: int
    batches_in_flight: int
    floor_slabs: int = 0


class SlabKeeper:
    """Owns one slab pool between the worker sets that borrow it, one set at a time.

    Any thread may call any method (a loader's finalizer runs on whichever thread dropped it);
    a lock guards the fields. Invariants: ``_pool`` is None or open; while ``_lent``, only the
    borrowing set's engine thread uses it; a closed keeper keeps no pool (each lend makes one
    that is closed when given back).
    """

    def __init__(self, keep: bool = True) -> None:
        self._lock = threading.Lock()
        self._pool: SlabPool | None = None
        self._pin = False  # what the kept pool was made for
        self._lent = False
        self._release_when_returned = False
        self._keeping = keep
        self.pace: Any = None  # the last set's budget estimates (engine/budget.py's Pace)
        # Economic mode: one item's tensor sizes, as the last set learnt them (None: unknown, or
        # its samples could not go as columns). A guess: a set that finds it wrong says so.
        self.item_layout: tuple[int, ...] | None = None
        # ... and whether its samples could not go as columns: the next set then leaves every
        # batch to batch workers from the first on (engine/direct_batches.py).
        self.direct_refused = False
        # ... and an item worker's time per item (engine/item_scheduler.py's ItemPace): the next
        # set cuts its second batch by it instead of waiting for its first pieces' reports.
        self.item_s: float | None = None
        # ... and whether it started batch workers: a next set spawned ('spawn', 'forkserver')
        # then starts them with its item workers, not in the middle of its first epoch.
        self.batch_workers_started = False
        self._counts = SlabCounts()  # of pools closed so far; the kept one adds its own
        # The keepers of copies of this keeper's owner made in this process (a thread worker's
        # copy of a DataPipe graph), whose pools go whenever this one's does (``release_along``).
        self._copies: weakref.WeakSet[SlabKeeper] = weakref.WeakSet()

    @property
    def held_bytes(self) -> int:
        """Bytes of the slabs kept now (counted as memory the pool may use again)."""
        with self._lock:
            return self._pool.slab_bytes if self._pool is not None else 0

    def counts(self) -> SlabCounts:
        """What every pool this keeper lent has done so far (see ``SlabCounts``)."""
        with self._lock:
            total = SlabCounts(**vars(self._counts))
            if self._pool is not None:
                for name, value in vars(self._pool.counts).items():
                    setattr(total, name, getattr(total, name) + value)
            return total

    def lend(self, settings: SlabSettings) -> SlabPool:
        """The pool for a set of workers about to start, fitted to what it may use."""
        with self._lock:
            if self._pool is not None and not self._lent and self._pin != settings.pin:
                self._close_kept()  # pin_memory changed: slabs are page-locked, or not, for good
            if self._lent or not self._keeping:
                return self._new_pool(settings)  # a set of its own, closed when it stops
            if self._pool is None:
                self._pool, self._pin = self._new_pool(settings), settings.pin
            self._lent = True
            _IDLE.not_idle(self)
            self._pool.fit(settings.max_bytes, settings.batches_in_flight, settings.floor_slabs)
            return self._pool

    def give_back(self, pool: SlabPool, release: bool = False) -> None:
        """The set that borrowed ``pool`` has stopped (its workers are gone). ``release``: it
        ended in a failure (a dead worker, Ctrl-C): the pool goes too, as when released; the
        error that ended it may keep the loader alive for a long time, and a worker killed
        mid-batch may have left a slab half-written."""
        with self._lock:
            if pool is not self._pool:
                self._absorb(pool)
                return
            self._lent = False
            if release or self._release_when_returned or not self._keeping:
                self._close_kept()
                return
            pool.detach_producers()
            pool.trim_to_budget()  # the loop's two slabs are for a loop that runs (LOOP_FLOOR_SLABS)
        _IDLE.became_idle(self)

    def release_along(self, copy: SlabKeeper) -> None:
        """Release ``copy``'s pool too whenever this keeper's is released (or closed).

        For the keeper of a copy of this keeper's owner made in this process, which only this
        owner is known to: a thread worker's copy of a DataPipe graph keeps slabs of its own, but
        its loader reaches the original pipe alone. Held weakly: the copy's keeper goes with it.
        """
        with self._lock:
            self._copies.add(copy)

    def release(self) -> None:
        """Let go of the kept pool, and of those of the copies' keepers (``release_along``): now
        if no set uses it, else when that set stops. The next set starts a new one. Idempotent."""
        with self._lock:
            if self._lent:
                self._release_when_returned = True
            elif self._pool is not None:
                self._close_kept()
            copies = list(self._copies)
        for copy in copies:  # outside the lock: each takes its own
            copy.release()

    def close(self) -> None:
        """Release the pool and keep none from now on (the owner is gone). Idempotent."""
        with self._lock:
            self._keeping = False
        self.release()

    def _new_pool(self, settings: SlabSettings) -> SlabPool:
        return SlabPool(pin=settings.pin, max_bytes=settings.max_bytes,
                        batches_in_flight=settings.batches_in_flight, floor_slabs=settings.floor_slabs)

    def _close_kept(self) -> None:
        _IDLE.not_idle(self)
        pool, self._pool = self._pool, None
        self._release_when_returned = False
        if pool is not None:
            self._absorb(pool)

    def _absorb(self, pool: SlabPool) -> None:
        """Close ``pool`` and add what it did to the counts."""
        pool.close()
        for name, value in vars(pool.counts).items():
            setattr(self._counts, name, getattr(self._counts, name) + value)
