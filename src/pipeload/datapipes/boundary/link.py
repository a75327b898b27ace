"""The one seam between a process queue boundary and the transport.

Everything the boundary sends or receives across processes goes through :class:`ProcessLink`:
credits and STOP one way on a task pipe, items, failures and the end the other way on a result
socket, through the transport's Sender/Receiver pair: small tensors inside the message, large ones
as shared-memory descriptors (no pickle of their bytes). It uses the engine's own channels and
typed messages; a faster transport replaces this class, not the boundary.

How the messages are used here: ``FETCH`` with ``batch_number=n`` grants the upstream the right
to send items numbered below ``n`` (a credit window, so at most ``buffer_size`` items are ever
in flight); ``BATCH`` carries item ``batch_number``; ``EXHAUSTED`` says the upstream ended after
``batch_number`` items; ``FAILED`` carries a :class:`~pipeload.errors.RemoteFailure`.
"""

from __future__ import annotations

from typing import Any

from pipeload.transport.channel import ProcessChannels
from pipeload.transport.messages import Command, WorkerCommand, WorkerReport

UPSTREAM_ID = 0  # the one "worker" of a boundary's channels


class _NoRoom(Exception):
    """Stopping never waits for room in the task pipe."""


def _give_up() -> None:
    raise _NoRoom


class ProcessLink:
    """Task pipe and result socket to one upstream process; owned by the process upstream.

    Only the consumer side sends (credits from the consuming thread, STOP when closing; each is
    one small write, atomic on a pipe); only the receiver thread receives.
    """

    def __init__(self, ctx: Any) -> None:
        self._channels = ProcessChannels(ctx, 1)
        self._closed = False

    def upstream_ends(self) -> tuple[Any, Any]:
        """(inbox, outbox) to hand to the upstream process."""
        return self._channels.worker_ends(UPSTREAM_ID)

    def upstream_started(self) -> None:
        """Drop our copies of the upstream's ends, so its death reads as EOF here."""
        self._channels.forget_worker_ends()

    def grant(self, up_to: int) -> None:
        """Allow the upstream to send items numbered below ``up_to``."""
        self._channels.send(UPSTREAM_ID, WorkerCommand(Command.FETCH, batch_number=up_to))

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
