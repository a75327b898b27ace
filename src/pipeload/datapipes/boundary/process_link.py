"""The connected half of a process ``DataLoaderQueue``: one Unix socket to the far end.

Both directions share the socket. Items travel as the engine's ``WorkerReport`` messages
through the transport's ``Sender``/``Receiver`` pair (small tensors inside the message, large
ones as shared-memory descriptors, other objects pickled): ``BATCH`` carries item ``n``,
``EXHAUSTED`` says the sender closed after ``n`` items, ``FAILED`` that it closed with an error
(a :class:`~pipeload.errors.RemoteFailure`). Credits travel back as :class:`QueueControl`
messages: the receiving end allows items numbered below ``n`` and tops the window up in one
message when half of it is used, so at most ``maxsize`` items are in flight or held.

A reader thread owns the receiving side of the socket: it puts arriving items into the inbox,
raises the credit it was granted, and turns the far end's close, or its disappearance (end of
file without a close), into the inbox's ending.
"""

from __future__ import annotations

import enum
import os
import socket
import threading
import traceback
from collections.abc import Callable
from typing import Any, NamedTuple

from pipeload.datapipes.boundary.inbox import Ending, Inbox
from pipeload.datapipes.boundary.queue_interface import QueueError
from pipeload.datapipes.protocol import NotAvailable
from pipeload.errors import RemoteFailure
from pipeload.transport.endpoints import Receiver, Sender
from pipeload.transport.messages import Report, WorkerReport

READER_JOIN_S = 1.0
CREDIT_SLICE_S = 0.1  # a put waiting for credit re-checks its deadline and the far end this often


class Control(enum.IntEnum):
    """What a :class:`QueueControl` message says."""

    HELLO = 1
    """The joining end introduces itself: ``number`` is its pid, ``token`` the queue's secret."""
    CREDIT = 2
    """The receiving end allows items numbered below ``number``."""


class QueueControl(NamedTuple):
    """A control message of a process queue (never an item)."""

    control: Control
    number: int
    token: str = ""

    def __reduce__(self) -> Any:
        return (_control, (int(self.control), self.number, self.token))


def _control(control: int, number: int, token: str) -> QueueControl:
    return QueueControl(Control(control), number, token)


class ProcessLink:
    """One end's connection to the far end. Owned by the queue end that made it.

    Invariants: only the reader thread reads the socket; every write holds ``_send_lock``;
    ``sent <= granted`` (items this end may send) and ``granted_to_far - taken <= maxsize``
    (items the far end may still send us). After ``close()`` nothing is sent.
    """

    def __init__(self, sock: socket.socket, maxsize: int, inbox: Inbox, far_end: str,
                 describe_death: Callable[[], str], expected_token: str | None = None) -> None:
        self.sock = sock
        self.far_end = far_end
        self._describe_death = describe_death
        self._expected_token = expected_token  # the accepting end checks who joined
        self._maxsize = maxsize
        self._inbox = inbox
        self._sender = Sender(sock)
        self._receiver = Receiver(sock, None, 0)
        self._send_lock = threading.Lock()
        self._credit = threading.Condition()
        self.sent = 0
        self._granted = maxsize  # both ends start from a full window, unannounced
        self._granted_to_far = maxsize
        self._taken = 0
        self._closing = False
        self._reader = threading.Thread(target=self._read, name=f"pipeload-queue-reader-{far_end}", daemon=True)
        self._reader.start()

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

    def introduce(self, token: str) -> None:
        """The joining end's first message: who it is, and the queue's secret."""
        with self._send_lock:
            self._sender.send(QueueControl(Control.HELLO, os.getpid(), token))

    def send_item(self, data: Any) -> None:
        with self._send_lock:
            self._check_open()
            self._sender.send(WorkerReport(Report.BATCH, 0, self.sent, data))
            self.sent += 1

    def taken_one(self) -> None:
        """The consumer took an item: top the far end's window up when half of it is used."""
        self._taken += 1
        if self._granted_to_far - self._taken <= self._maxsize // 2:
            self._granted_to_far = self._taken + self._maxsize
            try:
                with self._send_lock:
                    if not self._closing:
                        self._sender.send(QueueControl(Control.CREDIT, self._granted_to_far))
            except OSError:
                pass  # the far end is gone: the reader says so through the inbox

    def close(self, error: BaseException | None, where: str) -> None:
        """Tell the far end we closed (with ``error``, if any), then release the socket.

        ``where`` says where this end is, for the far end's message about ``error``.
        """
        with self._send_lock:
            if self._closing:
                return
            self._closing = True
            try:
                self._send_closing(error, where)
            except OSError:
                pass  # gone already: it learns nothing more from us
        with self._credit:
            self._credit.notify_all()
        try:
            self.sock.shutdown(socket.SHUT_RDWR)  # wakes the reader with an end of file
        except OSError:
            pass
        if self._reader is not threading.current_thread():
            self._reader.join(READER_JOIN_S)
        self._receiver.close()
        self._sender.writer.close()

    def _send_closing(self, error: BaseException | None, where: str) -> None:
        try:
            self._sender.send(_closing_report(self.sent, error, where))
        except OSError:
            raise
        except Exception:  # the error's type cannot be pickled: send it as a RuntimeError
            assert error is not None
            substitute = RuntimeError(f"{type(error).__qualname__}: {error}")
            substitute.__traceback__ = error.__traceback__
            self._sender.send(_closing_report(self.sent, substitute, where))

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
            self._check_hello(self._receiver.receive(block=True)[0])
        expected = 0
        while True:
            message, _info = self._receiver.receive(block=True)
            if isinstance(message, QueueControl):
                with self._credit:
                    self._granted = max(self._granted, message.number)
                    self._credit.notify_all()
                continue
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


    def _check_hello(self, message: Any) -> None:
        if (not isinstance(message, QueueControl) or message.control is not Control.HELLO
                or message.token != self._expected_token):
            raise PermissionError("a process that does not hold this DataLoaderQueue connected to it")
        self.far_end = process_name(message.number)


def _closing_report(sent: int, error: BaseException | None, where: str) -> WorkerReport:
    if error is None:
        return WorkerReport(Report.EXHAUSTED, 0, sent)
    text = "".join(traceback.format_exception(error))
    failure = RemoteFailure(type(error), str(error), text, 0, "producing the items it put", where=where)
    return WorkerReport(Report.FAILED, 0, sent, failure)


def process_name(pid: int | None = None) -> str:
    """``"process 4711"`` for ``pid`` (this process when None)."""
    return f"process {os.getpid() if pid is None else pid}"
