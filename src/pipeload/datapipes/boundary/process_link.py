"""The connected half of a process ``DataLoaderQueue``: one Unix socket to the far end.

Both directions share the socket, and two kinds of message travel on it:

* **codec messages**: items, as the engine's ``WorkerReport`` messages encoded by the
  transport's codec (small tensors inside the message, large ones in a slab the receiving end
  granted, or else in a one-shot shared buffer; other objects pickled). ``BATCH`` carries item
  ``n``, ``EXHAUSTED`` says the sender closed after ``n`` items, ``FAILED`` that it closed with
  an error (a :class:`~pipeload.errors.RemoteFailure`);
* **link messages** (first byte ``LINK_TAG``, then a plain pickle): the joining end's
  :class:`QueueControl` ``HELLO``; the receiving end's credits, ``CREDIT``, which allow items
  numbered below ``n`` and carry a slab grant for some of the newly allowed items; and the slab
  controls a grant needs (``SlabControl``, whose descriptors ride along), written before it.

The window the accepting end gives the joining end is announced: its answer to the HELLO is
a credit for ``maxsize`` items, with a slab for each when the items' size is known already (a
queue boundary's next run); the other way, the window starts full, unannounced. The receiving
end tops the window up in one message when half of it is used, so at most ``maxsize`` items
are in flight or held. Which end receives is fixed by use: an end that gets
decodes against its slab pool and grants (see queue_slabs.py); an end that puts applies the
controls and grants it was sent to its slab writer before it writes an item.

A reader thread owns the reading side of the socket: it puts arriving items into the inbox,
raises the credit it was granted, keeps slab controls and grants for the putting thread, and
turns the far end's close, or its disappearance (end of file without a close), into the
inbox's ending.
"""

from __future__ import annotations

import enum
import functools
import os
import pickle
import socket
import threading
from collections.abc import Callable, Sequence
from typing import Any, NamedTuple

from pipeload.datapipes.boundary.inbox import Ending, Inbox
from pipeload.datapipes.boundary.queue_interface import QueueError
from pipeload.datapipes.boundary.queue_slabs import GrantedSlabs, Grants, ReceivingSlabs
from pipeload.datapipes.protocol import NotAvailable
from pipeload.errors import RemoteFailure
from pipeload.transport.endpoints import Sender
from pipeload.transport.fd_passing import MessageReader, send_message
from pipeload.transport.messages import Report, SlabControl, WorkerReport
from pipeload.transport.slab_pool import SlabPool

READER_JOIN_S = 1.0
CREDIT_SLICE_S = 0.1  # a put waiting for credit re-checks its deadline and the far end this often
# The first byte of a link message: neither a pickle's (0x80) nor the flat wire's (0xF1), so the
# reader tells the two kinds of message apart without decoding.
LINK_TAG = 0xC7


class Control(enum.IntEnum):
    """What a :class:`QueueControl` message says."""

    HELLO = 1
    """The joining end introduces itself: ``number`` is its pid, ``token`` the queue's secret."""
    CREDIT = 2
    """The receiving end allows items numbered below ``number``; ``grants`` names the slab each
    of some items may travel in."""


class QueueControl(NamedTuple):
    """A control message of a process queue (never an item)."""

    control: Control
    number: int
    token: str = ""
    grants: Grants = ()

    def __reduce__(self) -> Any:
        return (_control, (int(self.control), self.number, self.token, self.grants))


def _control(control: int, number: int, token: str, grants: Grants) -> QueueControl:
    return QueueControl(Control(control), number, token, grants)


class ProcessLink:
    """One end's connection to the far end. Owned by the queue end that made it.

    Invariants: only the reader thread reads the socket; every write holds ``_send_lock``
    (taken after the receiving slabs' lock, never before it); ``sent <= granted`` (items this
    end may send) and ``granted_to_far - taken <= maxsize`` (items the far end may still send
    us); the slab writer is used by the putting thread under ``_send_lock``. After ``close()``
    nothing is sent.
    """

    def __init__(self, sock: socket.socket, maxsize: int, inbox: Inbox, far_end: str,
                 describe_death: Callable[[], str], expected_token: str | None = None,
                 lent_pool: SlabPool | None = None) -> None:
        """``lent_pool``: this end gets, and decodes against this pool, which its owner keeps
        (None: a pool of its own, made once large items arrive)."""
        self.sock = sock
        self.far_end = far_end
        self._describe_death = describe_death
        self._expected_token = expected_token  # the accepting end checks who joined
        self._maxsize = maxsize
        self._inbox = inbox
        self._sender = Sender(sock)
        self._messages = MessageReader(sock)
        self._receiving = ReceivingSlabs(maxsize, lent_pool)
        self._granted_slabs = GrantedSlabs()
        self._prepared: tuple[int, Any] | None = None  # (item number, grant) the writer began
        self._send_lock = threading.Lock()
        self._credit = threading.Condition()
        self.sent = 0
        # The joining end may send items to the accepting one once it has answered the HELLO (a
        # credit with the first window's slabs); the other way, the window starts full, unsaid.
        accepting = expected_token is not None
        self._granted = maxsize if accepting else 0
        self._granted_to_far = maxsize
        self._credit_sent = 0 if accepting else maxsize  # the far end may send items below this
        self._taken = 0
        self._closing = False
        self._reader = threading.Thread(target=self._read, name=f"pipeload-queue-reader-{far_end}", daemon=True)
        self._reader.start()

    @property
    def slab_pool(self) -> SlabPool | None:
        """The pool this end decodes against (None: no large item has needed one yet)."""
        return self._receiving.pool

    # -- sending ------------------------------------------------------------------------------

    def wait_for_credit(self, blocking: bool, wait_s: float) -> bool:
        """Whether this end may send another item now (waiting up to ``wait_s`` for credit)."""
        with self._credit:
            if self.sent < self._granted:
                return True
            if not blocking:
                raise NotAvailable
            self._credit.wait(min(wait_s, CREDIT_SLICE_S))
            return self.sent < self._granted

    def reading(self) -> bool:
        """Whether the reader thread still reads (it stops at the far end's close or death)."""
        return self._reader.is_alive()

    def read_to_the_end(self, timeout_s: float) -> None:
        """Wait until the reader thread has read all the far end sent (at most ``timeout_s``):
        a send refused by a closed socket does not say whether the far end closed the queue
        or died; its last message, if it sent one, is still to be read."""
        if self._reader.ident != threading.get_ident():  # asked by ident: see on_the_main_thread
            self._reader.join(timeout_s)

    def introduce(self, token: str) -> None:
        """The joining end's first message: who it is, and the queue's secret."""
        with self._send_lock:
            self._send_link(QueueControl(Control.HELLO, os.getpid(), token))

    def prepare_next(self) -> None:
        """The calling thread is about to build the item it sends next: if the far end has
        allowed it, collation in this thread writes its outputs where the item will travel
        (the item's granted slab, or fresh shared memory)."""
        with self._send_lock:
            if self._closing:
                return
            number = self.sent
            with self._credit:
                allowed = number < self._granted
            self._prepared = None
            if allowed:
                grant = self._granted_slabs.grant_for(number, self._sender.writer, take=False)
                self._sender.prepare(grant)
                self._prepared = (number, grant)

    def send_item(self, data: Any) -> None:
        with self._send_lock:
            self._check_open()
            number, writer = self.sent, self._sender.writer
            grant = self._granted_slabs.grant_for(number, writer, take=True)
            prepared, self._prepared = self._prepared, None
            # Begun for this item with its grant, the writer may hold what collation wrote: keep
            # it. A grant that came after (for an item built in ordinary memory) takes it over.
            if (prepared is None or prepared[0] != number
                    or (prepared[1] is not grant and not writer.used_bytes and not writer.one_shot_bytes)):
                self._sender.prepare(grant)
            self._sender.send(WorkerReport(Report.BATCH, 0, number, data))
            self.sent += 1

    def taken_one(self) -> None:
        """The consumer took an item: top the far end's window up when half of it is used,
        with a slab for each newly allowed item that the pool can give one."""
        self._taken += 1
        if self._granted_to_far - self._taken <= self._maxsize // 2:
            self._granted_to_far = self._taken + self._maxsize
            self._grant_window()

    def _grant_window(self) -> None:
        if self._inbox.ending is not None:
            return  # the far end has closed (or died), or this end has: nothing more comes
        up_to = self._granted_to_far
        try:
            self._receiving.grant_until(up_to, functools.partial(self._send_credit, up_to))
            self._send_credit(up_to)  # no grant went: the credit alone
        except OSError:
            pass  # the far end is gone: the reader says so through the inbox

    def _send_credit(self, up_to: int, controls: Sequence[tuple[SlabControl, list[int]]] = (),
                     grants: Grants = ()) -> None:
        """Allow items below ``up_to``, with ``grants`` (and the slab controls they need first:
        the pool keeps their descriptors, the kernel passes copies)."""
        with self._send_lock:
            if self._closing or (not grants and self._credit_sent >= up_to):
                return
            for control, fds in controls:
                self._send_link(control, fds)
            self._send_link(QueueControl(Control.CREDIT, up_to, grants=grants))
            self._credit_sent = max(self._credit_sent, up_to)

    def _send_link(self, message: Any, fds: list[int] | None = None) -> None:
        """Write one link message (the caller holds ``_send_lock``)."""
        payload = bytes((LINK_TAG,)) + pickle.dumps(message, pickle.HIGHEST_PROTOCOL)
        send_message(self.sock, payload, fds or [])

    def close(self, error: BaseException | None, where: str, tell: bool = True) -> None:
        """Tell the far end we closed (with ``error``, if any), then release the socket, the
        slab writer's mappings, and a slab pool of this end's own.

        ``where`` says where this end is, for the far end's message about ``error``. ``tell``
        False: no word of closing, only the socket's end, which the far end reads as this end's
        death (an end dropped without ``close()``, whose stream may be cut short).
        """
        with self._send_lock:
            if self._closing:
                return
            self._closing = True
            self._sender.writer.begin(None)  # an item begun and never sent keeps no slab
            try:
                if tell:
                    self._send_closing(error, where)
            except OSError:
                pass  # gone already: it learns nothing more from us
        with self._credit:
            self._credit.notify_all()
        try:
            self.sock.shutdown(socket.SHUT_RDWR)  # wakes the reader with an end of file
        except OSError:
            pass
        if self._reader.ident != threading.get_ident():  # asked by ident: see on_the_main_thread
            self._reader.join(READER_JOIN_S)
        self._receiving.close()
        self._granted_slabs.close()
        self._messages.close()
        self._sender.close()

    def _send_closing(self, error: BaseException | None, where: str) -> None:
        self._sender.send(_closing_report(self.sent, error, where))

    def _check_open(self) -> None:
        if self._closing:
            raise OSError("the queue end is closed")

    # -- the reader thread --------------------------------------------------------------------

    def _read(self) -> None:
        try:
            self._read_until_the_end()
        except (EOFError, OSError) as error:
            if not self._closing:
                self._inbox.end(Ending(QueueError.DIED, self.far_end, detail=self._describe_death()))
        except BaseException as error:  # noqa: BLE001  (whatever it is, the consumer hears of it)
            error.add_note("pipeload: raised while receiving from the far end of a DataLoaderQueue")
            self._inbox.end(Ending(QueueError.CLOSED, self.far_end, cause=error))
        finally:
            with self._credit:
                self._credit.notify_all()  # a put waiting for credit re-checks the inbox's ending

    def _read_until_the_end(self) -> None:
        if self._expected_token is not None:
            self._check_hello(self._next_message())
        self._grant_window()  # the first window (and its slabs, if the items' size is known)
        expected = 0
        while True:
            message = self._next_message()
            if message is None:
                continue  # a link message, dealt with
            if message.report is Report.BATCH:
                if message.batch_number != expected:
                    raise RuntimeError(f"DataLoaderQueue protocol error: expected item {expected}, "
                                       f"got item {message.batch_number}")
                expected += 1
                self._inbox.add_granted(message.payload)
                continue
            cause = message.failure.to_exception() if message.report is Report.FAILED else None
            self._inbox.end(Ending(QueueError.CLOSED, self.far_end, cause=cause))
            return

    def _next_message(self) -> Any:
        """The next codec message (an item or the far end's close), or the HELLO; None after a
        link message it has dealt with."""
        payload, fds = self._messages.next_message(True)  # type: ignore[misc]
        if not payload or payload[0] != LINK_TAG:
            return self._receiving.decode(payload, fds)
        message = pickle.loads(memoryview(payload)[1:])
        if isinstance(message, SlabControl):
            self._granted_slabs.add_control(message, fds)
            return None
        for fd in fds:
            os.close(fd)  # none expected: never let one leak
        if isinstance(message, QueueControl) and message.control is Control.CREDIT:
            self._granted_slabs.add_grants(message.grants)
            with self._credit:
                self._granted = max(self._granted, message.number)
                self._credit.notify_all()
            return None
        return message

    def _check_hello(self, message: Any) -> None:
        if (not isinstance(message, QueueControl) or message.control is not Control.HELLO
                or message.token != self._expected_token):
            raise PermissionError("a process that does not hold this DataLoaderQueue connected to it")
        self.far_end = process_name(message.number)


def _closing_report(sent: int, error: BaseException | None, where: str) -> WorkerReport:
    if error is None:
        return WorkerReport(Report.EXHAUSTED, 0, sent)
    return WorkerReport(Report.FAILED, 0, sent, RemoteFailure.of(error, 0, "producing the items it put", where))


def process_name(pid: int | None = None) -> str:
    """``"process 4711"`` for ``pid`` (this process when None)."""
    return f"process {os.getpid() if pid is None else pid}"
