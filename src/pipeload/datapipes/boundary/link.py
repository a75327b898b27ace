"""The one seam between a process queue boundary and the transport.

Everything the boundary sends or receives across processes goes through :class:`ProcessLink`:
credits and STOP one way on a task pipe, items, failures and the end the other way on a result
socket, through the transport's Sender/Receiver pair: small tensors inside the message, large ones
in shared memory (no pickle of their bytes): in a slab of the boundary's pool when one is free,
else in a one-shot buffer. It uses the engine's own channels and typed messages; a faster
transport replaces this class, not the boundary.

The slab pool is borrowed from the boundary pipe's ``SlabKeeper`` (the same owner a loader keeps
for its workers), so each run of the boundary finds the slabs of the run before it. Each item
the consumer credits gets its own grant; none is granted ahead of its release (the consumer
downstream may hold many items at once, a ``batch`` pipe collecting them).

How the messages are used here: ``FETCH`` with ``batch_number=n`` grants the upstream the right
to send items numbered below ``n`` (a credit window, so at most ``buffer_size`` items are ever
in flight); ``BATCH`` carries item ``batch_number``; ``EXHAUSTED`` says the upstream ended after
``batch_number`` items; ``FAILED`` carries a :class:`~pipeload.errors.RemoteFailure`.
"""

from __future__ import annotations

import threading
from typing import Any

from pipeload.transport.channel import ProcessChannels
from pipeload.transport.messages import Command, WorkerCommand, WorkerReport
from pipeload.transport.slab_pool import SlabPool

UPSTREAM_ID = 0  # the one "worker" of a boundary's channels


class _NoRoom(Exception):
    """Stopping never waits for room in the task pipe."""


def _give_up() -> None:
    raise _NoRoom


class ProcessLink:
    """Task pipe and result socket to one upstream process; owned by the process upstream.

    Only the consumer side sends (credits from the consuming thread, STOP when closing; each is
    one small write, atomic on a pipe); only the receiver thread receives. The consuming thread
    grants slabs and the receiver thread decodes against them, each under ``_pool_lock``.
    """

    def __init__(self, ctx: Any, pool: SlabPool | None = None, capacity: int = 1) -> None:
        self._pool = pool
        self._pool_lock = threading.Lock()
        self._channels = ProcessChannels(ctx, 1, pool, self._pool_lock)
        self._credited = 0  # items the upstream may send: those numbered below this
        self._closed = False
        if pool is not None:
            # The credited items, plus the one being taken (credit is topped up as it is).
            pool.set_in_flight(capacity + 1, grants_ahead=0)

    def upstream_ends(self) -> tuple[Any, Any]:
        """(inbox, outbox) to hand to the upstream process."""
        return self._channels.worker_ends(UPSTREAM_ID)

    def upstream_started(self) -> None:
        """Drop our copies of the upstream's ends, so its death reads as EOF here."""
        self._channels.forget_worker_ends()

    def grant(self, up_to: int) -> None:
        """Allow the upstream to send items numbered below ``up_to`` (each with a slab, when
        the pool has one free and the item's size is known)."""
        if self._pool is None:
            self._channels.send(UPSTREAM_ID, WorkerCommand(Command.FETCH, batch_number=up_to))
            self._credited = up_to
            return
        with self._pool_lock:
            while self._credited < up_to:
                number = self._credited
                slab = self._pool.grant(UPSTREAM_ID, number)
                self._channels.send(UPSTREAM_ID, WorkerCommand(Command.FETCH, batch_number=number + 1,
                                                               grant=slab))
                self._credited = number + 1

    def handed_out(self, number: int) -> None:
        """Item ``number`` went to the consumer."""
        if self._pool is not None:
            with self._pool_lock:
                self._pool.handed_out(number)

    def ask_to_stop(self, _worker_id: int = UPSTREAM_ID) -> None:
        try:
            self._channels.send(UPSTREAM_ID, WorkerCommand(Command.STOP), while_full=_give_up)
        except (_NoRoom, OSError):
            pass  # not reading, or gone: the stop escalation takes over

    def receive(self, timeout_s: float, sentinel: int) -> tuple[list[WorkerReport], bool]:
        """Reports that arrive within ``timeout_s``, and whether the upstream process died."""
        reports, fired = self._channels.wait(timeout_s, [sentinel])
        return reports, bool(fired)

    def close(self) -> None:
        if not self._closed:
            self._closed = True
            self._channels.close()
