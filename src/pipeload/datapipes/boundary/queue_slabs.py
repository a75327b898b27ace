"""Slabs for a process ``DataLoaderQueue``: the receiving end grants them with its credits, the
putting end writes its items into them.

A large tensor that crosses a process queue would otherwise travel in a one-shot shared buffer:
a new memory file, a new mapping on each side, and every page faulted in on both sides, item
after item. Here the receiving end owns (or borrows) a :class:`~pipeload.transport.slab_pool.SlabPool`,
the same one the loader's workers send batches through, and grants a slab to each item it gives
credit for. The putting end writes the item's large tensors into the granted slab (the codec
copies them in, or ``default_collate`` upstream stacks straight into it) and the receiving end
views them there: each slab is made, mapped and faulted in once for the queue's life.

Two halves, one per role; an end that both puts and gets has both:

* :class:`ReceivingSlabs` (the end that gets): the pool, the decoding against it, and the grants
  that ride on each credit. A queue made by a user makes its own pool once large items have
  arrived, and closes it with the queue; a queue boundary lends its run's queue the pool its
  pipe keeps between runs (``transport/slab_keeper.py``), and gives it back once the upstream
  process has stopped. No slab is granted before its last item was released: the consumer of a
  queue may hold many items at once (a ``batch`` pipe collecting them), so the pool's deferred
  grants are off (``grants_ahead=0``).
* :class:`GrantedSlabs` (the end that puts): the slab controls (``BOARD``/``MAP``/``FORGET``,
  with their descriptors) and the grants the reader thread received, until the putting thread
  applies them to its slab writer. Controls are written before the credit that carries the
  grant needing them, and one reader reads them in that order, so a grant is never seen before
  its controls.
"""

from __future__ import annotations

import os
import threading
from collections.abc import Callable
from typing import Any

from pipeload.engine.budget import shm_budget_bytes
from pipeload.transport.codec import decode
from pipeload.transport.messages import Report, SlabControl, SlabGrant, WorkerReport
from pipeload.transport.slab_pool import SlabPool
from pipeload.transport.slab_writer import SlabWriter

PRODUCER = 0  # the one producer a queue end's pool serves: the far end
Grants = tuple[tuple[int, SlabGrant], ...]  # (item number, its slab) for each item granted one


class ReceivingSlabs:
    """The getting end's slab pool, the items decoded against it, and the grants it makes.

    The reader thread decodes (:meth:`decode`); the getting thread grants (:meth:`grant_until`),
    and so may the reader thread once, for the first window; :meth:`close` may come from any
    thread. All of them hold ``_lock``, which is taken before the link's send lock, never after.

    Invariants: every item numbered below ``_considered`` has had its one chance at a grant;
    none is granted once it has arrived (``_received``), so each grant is settled exactly once,
    by its item's arrival, or by the pool's owner when the producer is gone. After ``close()``
    there is no pool and none is made.
    """

    def __init__(self, maxsize: int, lent: SlabPool | None = None) -> None:
        """``lent``: a pool the owner keeps after this queue closes (None: make one when large
        items arrive, and close it with the queue)."""
        self._lock = threading.Lock()
        self._maxsize = maxsize
        self._pool = lent
        self._owned = lent is None
        self._closed = False
        self._largest = 0  # the most shared memory an item needed, while there is no pool
        self._received = 0
        self._considered = 0
        if lent is not None:
            self._limit_pool(lent)

    @property
    def pool(self) -> SlabPool | None:
        return self._pool

    def decode(self, payload: bytearray, fds: list[int]) -> Any:
        """The message a codec payload holds, viewed in the slab it was written into, if any."""
        with self._lock:
            message, info = decode(payload, fds, self._pool)
            if type(message) is WorkerReport and message.report is Report.BATCH:
                self._received = message.batch_number + 1
                pool = self._pool
                if pool is None:
                    self._largest = max(self._largest, info.shared_bytes)
                else:
                    pool.observe_batch(info.shared_bytes)
                    pool.settle(message.batch_number, info.outcome)
            return message

    def grant_until(self, end: int, send: Callable[[list[tuple[SlabControl, list[int]]], Grants], None]) -> None:
        """Grant a slab to each item numbered below ``end`` that has had no chance yet, and pass
        the grants, with the controls to apply before them, to ``send`` (called under the lock,
        so grants and their controls leave in the order they were made)."""
        with self._lock:
            first, self._considered = max(self._considered, self._received), max(self._considered, end)
            pool = self._pool_for_grants()
            if pool is None or first >= end:
                return
            grants = tuple((number, grant) for number in range(first, end)
                           if (grant := pool.grant(PRODUCER, number)) is not None)
            if grants:
                send(pool.take_controls(PRODUCER), grants)

    def _pool_for_grants(self) -> SlabPool | None:
        if self._pool is None and self._owned and not self._closed and self._largest > 0:
            pool = SlabPool(pin=False, max_bytes=shm_budget_bytes(None), batches_in_flight=self._maxsize + 1)
            self._limit_pool(pool)
            pool.observe_batch(self._largest)
            self._pool = pool
        return self._pool

    def _limit_pool(self, pool: SlabPool) -> None:
        # A slab for each item in flight or waiting, and one the consumer holds; none granted
        # before it is free (see the module).
        pool.set_in_flight(self._maxsize + 1, grants_ahead=0)

    def close(self) -> None:
        """No more decoding or granting: a pool of this queue's own is closed now (items the
        user still holds keep their own slab until they die); a lent one is left to its owner."""
        with self._lock:
            pool, self._pool, self._closed = self._pool, None, True
        if pool is not None and self._owned:
            pool.close()


class GrantedSlabs:
    """What the far end granted the putting end: slab controls and one grant per item.

    The reader thread adds (:meth:`add_control`, :meth:`add_grants`); the putting thread takes
    (:meth:`grant_for`) and alone applies controls to its writer; :meth:`close` may come from
    any thread. Invariants (under ``_lock``): a control's descriptors are owned here until it
    is taken; a grant is seen only after every control it needs has been added.
    """

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._controls: list[tuple[SlabControl, list[int]]] = []
        self._grants: dict[int, SlabGrant] = {}
        self._closed = False

    def add_control(self, control: SlabControl, fds: list[int]) -> None:
        with self._lock:
            if not self._closed:
                self._controls.append((control, fds))
                return
        _close_all(fds)

    def add_grants(self, grants: Grants) -> None:
        with self._lock:
            self._grants.update(grants)

    def grant_for(self, number: int, writer: SlabWriter, take: bool) -> SlabGrant | None:
        """The slab granted for item ``number`` (None: none, or not usable), with every control
        received so far applied to ``writer`` first. ``take``: the item is being sent now; the
        grant, and any left for earlier items (sent before theirs came), are dropped."""
        if not self._controls and not self._grants:
            # Nothing granted (small items): no lock. A grant added meanwhile for this item is
            # dropped with the next item's; its slab is settled by this item's arrival.
            return None
        with self._lock:
            controls, self._controls = self._controls, []
            if take:
                grant = self._grants.pop(number, None)
                for stale in [n for n in self._grants if n < number]:
                    del self._grants[stale]
            else:
                grant = self._grants.get(number)
        for control, fds in controls:
            writer.apply(control, fds)  # takes the descriptors
        if grant is not None and writer.controls_applied < grant.controls:
            return None  # never expected (see the module); the item goes to fresh memory
        return grant

    def close(self) -> None:
        """Close the descriptors of controls never applied."""
        with self._lock:
            controls, self._controls, self._closed = self._controls, [], True
            self._grants.clear()
        for _control, fds in controls:
            _close_all(fds)


def _close_all(fds: list[int]) -> None:
    for fd in fds:
        os.close(fd)
