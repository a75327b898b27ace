"""The process kind of ``DataLoaderQueue``: two ends in two processes, one Unix socket between.

The queue as made is the *accepting* end: it listens on a fresh Unix socket address (in Linux's
abstract namespace: nothing on disk). A copy of it in another process, by pickling (spawn,
forkserver) or by a fork, is the *joining* end: on first use it connects and introduces itself
with the queue's secret token. So the queue travels as an argument to ``multiprocessing.Process``
under every start method, and the accepting end holds only its end of the connection: when the
far process dies, its end closes with it and the survivor reads that as a death, not a hang.

Large tensors cross in shared-memory slabs that the getting end owns and grants with its
credits (see queue_slabs.py): a queue made by a user makes its pool once large items arrive and
closes it with the queue; a queue boundary lends each run's queue the pool its pipe keeps
(:meth:`ProcessQueue.lend_slabs`).
"""

from __future__ import annotations

import os
import secrets
import select
import socket
import sys
import tempfile
import threading
import time
import weakref
from typing import Any

from pipeload.datapipes.boundary.inbox import WAIT_SLICE_S, Ending, Inbox, InboxQueue, deadline_after, has_died
from pipeload.datapipes.boundary.process_link import ProcessLink, process_name
from pipeload.datapipes.boundary.queue_interface import (
    DEFAULT_MAXSIZE,
    DataLoaderQueue,
    FarEnd,
    Producer,
    QueueError,
    check_blocking,
    check_maxsize,
)
from pipeload.datapipes.protocol import NotAvailable
from pipeload.errors import describe_exit
from pipeload.transport.slab_pool import SlabCounts, SlabPool

REAP_S = 0.5  # how long a dead far end's exit status is waited for, to say how it ended
# How long a put refused by a closed socket waits for the reader to read a close message the far
# end may have sent just before (it is in our socket already: microseconds, unless preempted).
CLOSE_NOTICE_S = 0.05


class ProcessQueue(InboxQueue, kind="process"):
    """A bounded, ordered queue between two processes (``DataLoaderQueue(kind="process")``).

    Make it in one process and pass it to the other (as a ``multiprocessing.Process`` argument,
    or inherited by a fork); the copy there is the far end. Items are pickled on the way; large
    tensors travel in shared-memory slabs that the getting end grants and reuses (a one-shot
    shared buffer before the first large item has shown their size, or when none is free), and
    the slabs go when the queue is closed. A queue joins exactly one far end: a second process
    trying to join is refused.

    Invariants: ``_link`` is None until the ends have met; every call but ``close()`` is made by
    one thread at a time per end; a copy made by a fork notices (``_pid``) and turns into the
    joining end before its first use.

    Example:
        >>> queue = DataLoaderQueue(kind="process", maxsize=16)
        >>> child = multiprocessing.get_context("spawn").Process(target=produce, args=(queue,))
        >>> child.start()
        >>> queue.get()  # produce() called queue.put(...) over there
    """

    def __init__(self, maxsize: int = DEFAULT_MAXSIZE, *, kind: str | None = None) -> None:
        self._maxsize = check_maxsize(maxsize)
        self._token = secrets.token_hex(16)
        self._address = _fresh_address()
        self._accepting = True
        self._listener: socket.socket | None = _listen(self._address)
        self._owner = os.getpid()  # the accepting end's process
        self._fresh_state()
        self._finalizer = weakref.finalize(self, _release, self._state)
        # The ends meet as soon as the far end joins, whatever this end is doing: a producer
        # over there waits for the answer to its HELLO (its first credit), and a consumer here
        # that first joined the producer's process, or built a model, left it waiting for good.
        threading.Thread(target=_accept_when_joined, args=(weakref.ref(self), self._listener),
                         name="pipeload-queue-accept", daemon=True).start()

    def _fresh_state(self) -> None:
        self._pid = os.getpid()
        self._watched: FarEnd | None = None
        # Held weakly: the link and inbox live in the finalizer's state, which must not keep
        # this end alive (it would never be released when dropped unclosed).
        self._inbox = Inbox(self._maxsize, _weakly(self._far_end_name, "the far end"))
        self._link: ProcessLink | None = None
        self._lent_pool: SlabPool | None = None  # see lend_slabs
        self.raised_an_item = False  # an item's error was raised at this end (ended_in_failure)
        self._lock = threading.Lock()  # connecting and closing take turns
        self._state: dict[str, Any] = {"listener": self._listener, "link": None, "address": self._address,
                                       "pid": self._pid}

    # -- the interface --------------------------------------------------------------------------

    def put(self, data: Any, blocking: bool = True, timeout: float | None = None) -> None:
        blocking, deadline = check_blocking(blocking), deadline_after(timeout)
        link = self._connected(blocking, deadline)
        while not link.wait_for_credit(blocking, _time_left(deadline)):
            self._raise_if_over(deadline)
        self._raise_if_over(None)  # the far end may have closed while we waited
        try:
            link.send_item(data)
        except (BrokenPipeError, ConnectionResetError):
            link.read_to_the_end(CLOSE_NOTICE_S)  # a close message may be on its way: CLOSED, not DIED
            self._raise_if_over(None)
            raise QueueError(f"DataLoaderQueue: the far end ({link.far_end}) died", far_end=link.far_end,
                             reason=QueueError.DIED) from None

    def prepare_put(self) -> None:
        """Say that this thread is about to build the item it puts next (``feed()`` does, before
        it takes each item from the upstream pipe): if the far end has room for it, tensors that
        ``default_collate`` stacks in this thread meanwhile are written straight into the shared
        memory the item will travel in (its slab), not copied there by ``put``. Put the item (or
        close the queue) next, from this thread, and keep no reference to it after the put.

        Raises:
            QueueError: the queue is closed or the far end could not be joined.
        """
        self._connected(True, None).prepare_next()

    def get(self, blocking: bool = True, timeout: float | None = None) -> Any:
        blocking, deadline = check_blocking(blocking), deadline_after(timeout)
        link = self._connected(blocking, deadline)
        item = self._inbox.take(blocking, deadline, self._far_end_died)
        link.taken_one()
        return item

    def close(self, error: BaseException | None = None) -> None:
        if self._pid != os.getpid():
            # A forked copy: the original's resources are not ours (and its lock may have been
            # copied held). Nor is it known to be the far end: any process forked while the
            # queue waits for its far end holds such a copy, and joining to say it closes would
            # take the place of the producer. (A producer that may close before its first put
            # gets the queue pickled, as spawn sends it, or is watched: see watch().)
            return
        with self._lock:
            # A closed queue's listener is closed (``_release``): accepting on it again would
            # raise, and close() must be safe to call twice (a boundary's failed start closes
            # the queue, then the stopping of its half-started producer closes it again).
            if self._link is None and self._finalizer.alive:
                # The far end hears of the close: one waiting to be accepted, or, from a joining
                # end that never put (a producer with nothing to send, or failing at once), the
                # owner, which would otherwise wait for it to join for ever.
                self._link = self._accept_now() if self._accepting else self._join_to_close()
            self._inbox.discard(Ending(QueueError.CLOSED, process_name(), here=True, cause=error))
            if self._link is not None:
                self._link.close(error, self._where())
            self._finalizer()

    def lend_slabs(self, pool: SlabPool) -> None:
        """Make this the getting end, decoding against ``pool`` and granting its slabs from the
        first window on. The caller owns the pool: it gives it back after closing this queue
        and stopping the far end (no producer writes into its slabs any more). Call before the
        ends meet.

        Raises:
            RuntimeError: the ends have met already.
        """
        if self._link is not None:
            raise RuntimeError("lend_slabs() comes before the ends of a DataLoaderQueue meet")
        self._lent_pool = pool

    @property
    def ended_in_failure(self) -> bool:
        """Whether the far end died, closed with an error, or an error the far end sent for one
        item was raised here (a queue boundary then lets go of its slabs when the run ends: the
        error may keep the pipe alive for long)."""
        ending = self._inbox.ending
        return self.raised_an_item or (
            ending is not None and (ending.reason == QueueError.DIED or ending.cause is not None))

    @property
    def slab_counts(self) -> SlabCounts | None:
        """What this (getting) end's own slab pool has done so far; None before it has one."""
        pool = self._link.slab_pool if self._link is not None else None
        return None if pool is None else pool.counts

    def name_this_end(self, words: str) -> None:
        """Say what this end is ("the upstream process of a queue boundary (pid 4711)"), for
        the far end's messages about an error this end closes with."""
        self._here = words

    def _where(self) -> str:
        here = getattr(self, "_here", None)
        if here is not None:
            return f"in {here}"
        return f"in {process_name()}, at the far end of a DataLoaderQueue"

    def __len__(self) -> int:
        """Items that have arrived at this end and wait to be taken (meeting the far end first,
        if it is waiting to be met: what it sent is then read)."""
        if self._link is None and self._inbox.ending is None:
            try:
                self._connected(blocking=False, deadline=None)
            except NotAvailable:
                pass
        return len(self._inbox)

    def __reduce__(self) -> Any:
        if self._link is not None and self._pid == os.getpid():
            raise TypeError(
                f"this DataLoaderQueue is already connected to its far end ({self._link.far_end}); "
                "a queue joins exactly two processes"
            )
        return (_joining_end, (self._address, self._token, self._maxsize, self._owner))

    @classmethod
    def start_producer(cls, pipe: Any, queue: DataLoaderQueue, name: str, options: dict[str, Any]) -> Producer:
        from pipeload.datapipes.boundary.process import ProcessProducer

        return ProcessProducer(pipe, queue, name, options.get("multiprocessing_context"),
                               options.get("slab_keeper"), options.get("resume"), bool(options.get("states")),
                               options.get("replica"))

    # -- meeting the far end ------------------------------------------------------------------

    def _connected(self, blocking: bool, deadline: float | None) -> ProcessLink:
        """This end's link, made now if the ends have not met yet."""
        link = self._link
        if link is not None and self._pid == os.getpid():
            return link
        self._check_process()
        with self._lock:
            while self._link is None:
                if self._inbox.ending is not None:
                    raise self._inbox.ending.error(self._far_end_name())
                self._link = self._accept_now() if self._accepting else self._join()
                if self._link is None:
                    if not blocking:
                        # A far end that died before it joined (killed while importing, or its
                        # pipe failed to unpickle): a boundary polls, and waited for ever.
                        problem = self._far_end_died()
                        if problem is not None:
                            raise problem
                        raise NotAvailable
                    self._wait_for_far_end(deadline)
            return self._link

    def _join_to_close(self) -> ProcessLink | None:
        """Join only to say that this end closes; None if the owner has gone or closed."""
        if self._inbox.ending is not None or self._pid != os.getpid():
            return None
        try:
            return self._join()
        except QueueError:
            return None

    def _accept_now(self) -> ProcessLink | None:
        listener = self._listener
        if listener is None:
            return None
        try:
            sock, _ = listener.accept()
        except BlockingIOError:
            return None
        sock.setblocking(True)
        self._stop_listening()
        return self._make_link(sock, "the process that joined", self._token)

    def _join(self) -> ProcessLink:
        sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        try:
            sock.connect(self._address)
        except (ConnectionRefusedError, FileNotFoundError):
            sock.close()
            far_end = process_name(self._owner)
            self._inbox.end(Ending(QueueError.CLOSED, far_end, detail="it closed before this end joined, "
                                   "or another process joined it first"))
            raise self._inbox.ending.error(far_end) from None  # type: ignore[union-attr]
        link = self._make_link(sock, process_name(self._owner), None)
        link.introduce(self._token)
        # The answer (the first window's credit) comes at once from the accepting end's thread:
        # waited for here, so that a first put(blocking=False) finds the room there is.
        deadline = time.monotonic() + HELLO_ANSWER_S
        while not link.wait_for_credit(True, deadline - time.monotonic()) and time.monotonic() < deadline:
            if self._inbox.ending is not None:
                break
        return link

    def _make_link(self, sock: socket.socket, far_end: str, token: str | None) -> ProcessLink:
        link = ProcessLink(sock, self._maxsize, self._inbox, far_end, _weakly(self._describe_death, ""), token,
                           self._lent_pool)
        self._state["link"] = link
        return link

    def _wait_for_far_end(self, deadline: float | None) -> None:
        problem = self._far_end_died()
        if problem is not None:
            raise problem
        left = _time_left(deadline)
        if left <= 0:
            far_end = self._far_end_name()
            raise QueueError(f"DataLoaderQueue: timed out waiting for the far end ({far_end}) to join",
                             far_end=far_end, reason=QueueError.TIMED_OUT)
        poller = select.poll()
        poller.register(self._listener.fileno(), select.POLLIN)  # type: ignore[union-attr]
        poller.poll(int(min(left, WAIT_SLICE_S) * 1000))

    def _stop_listening(self) -> None:
        if self._listener is not None:
            _close_listener(self._listener)
            self._listener = self._state["listener"] = None
            _unlink(self._address)

    # -- a fork's copy ------------------------------------------------------------------------

    def _check_process(self) -> None:
        if self._pid == os.getpid():
            return
        if not self._accepting or self._link is not None:
            raise QueueError(
                f"this DataLoaderQueue end is already in use by process {self._pid}; a forked copy "
                "of it cannot join as well (a queue joins exactly two processes)",
                far_end=self._far_end_name(), reason=QueueError.CLOSED)
        self._finalizer.detach()  # the original's resources are not ours to release
        if self._listener is not None:
            self._listener.close()  # our copy of the original's listener
        self._listener = None
        self._accepting = False
        self._fresh_state()
        self._finalizer = weakref.finalize(self, _release, self._state)

    # -- the far end's health -----------------------------------------------------------------

    def _far_end_name(self) -> str:
        if self._link is not None:
            return self._link.far_end
        if not self._accepting:
            return process_name(self._owner)
        pid = getattr(self._watched, "pid", None)
        return process_name(pid) if pid is not None else "the process that is to join"

    def _far_end_died(self) -> QueueError | None:
        """An error when the watched far end died and the reader cannot say so itself."""
        watched = self._watched
        if watched is None or not has_died(watched) or self._inbox.ending is not None:
            return None
        link = self._link
        if link is not None and link.reading():
            return None  # its end of file is on the way, after whatever it sent before dying
        name = self._far_end_name()
        self._inbox.end(Ending(QueueError.DIED, name, detail=self._describe_death()))
        return self._inbox.ending.error(name)  # type: ignore[union-attr]

    def _describe_death(self) -> str:
        watched = self._watched
        if watched is None or not hasattr(watched, "exitcode"):
            return ""
        if watched.exitcode is None and hasattr(watched, "join"):
            watched.join(REAP_S)  # it is dying: its exit status says how
        return f"it exited with {describe_exit(watched.exitcode)}"

    def _raise_if_over(self, deadline: float | None) -> None:
        ending = self._inbox.ending
        if ending is not None:
            raise ending.error(self._far_end_name())
        problem = self._far_end_died()
        if problem is not None:
            raise problem
        if deadline is not None and _time_left(deadline) <= 0:
            far_end = self._far_end_name()
            raise QueueError(f"DataLoaderQueue: timed out waiting for room at the far end ({far_end})",
                             far_end=far_end, reason=QueueError.TIMED_OUT)


def _accept_when_joined(queue_ref: Any, listener: socket.socket) -> None:
    """Wait for the far end to join ``listener``, and meet it, unless the queue's own calls do
    first, it stops listening (closed, or met), or it is dropped; the queue is held only for a
    moment each time round (a dropped queue must still be released by its finalizer)."""
    poller = select.poll()
    poller.register(listener.fileno(), select.POLLIN)
    while True:
        ready = poller.poll(int(ACCEPT_SLICE_S * 1000))
        if ready and ready[0][1] & (select.POLLHUP | select.POLLNVAL):
            return  # the owner shut the listener (_close_listener): closed, met or dropped
        queue = queue_ref()
        if queue is None or queue._listener is not listener or queue._pid != os.getpid():
            return
        if ready and queue._lock.acquire(blocking=False):  # a call of its own is meeting it
            try:
                if not queue._finalizer.alive:
                    return  # closed meanwhile (under the lock): its listener is closed too
                if queue._link is None and queue._listener is listener:
                    queue._link = queue._accept_now()
            finally:
                queue._lock.release()
        del queue


ACCEPT_SLICE_S = 0.5  # how often the accepting thread looks whether its queue is still there
HELLO_ANSWER_S = 1.0  # the most a joining end waits for its first credit before going on


def _joining_end(address: Any, token: str, maxsize: int, owner: int) -> ProcessQueue:
    """A queue's far end, as unpickled in another process."""
    queue = ProcessQueue.__new__(ProcessQueue)
    queue._maxsize, queue._token, queue._address, queue._owner = maxsize, token, address, owner
    queue._accepting = False
    queue._listener = None
    queue._fresh_state()
    queue._finalizer = weakref.finalize(queue, _release, queue._state)
    return queue


def _release(state: dict[str, Any]) -> None:
    """The backstop when a queue end is dropped unclosed: close its link and listener (in the
    process that made them only: a fork's copy must not speak on the original's connection).

    The far end is not told of a close, only of the connection's end: it reads "died", as it
    does when a forked process leaves without running this. A spawned producer that raised
    mid-stream runs this at its exit, and a word of closing made its cut stream look whole."""
    if state["pid"] != os.getpid():
        return
    link = state.get("link")
    if link is not None:
        link.close(None, f"in {process_name()}", tell=False)
    listener = state.get("listener")
    if listener is not None:
        _close_listener(listener)
        _unlink(state["address"])


def _close_listener(listener: socket.socket) -> None:
    """Close the owner's listener, waking its accepting thread at once: a shut-down listener
    polls as hung up (a closed descriptor would leave the thread asleep to the end of its slice,
    and the number may meanwhile be another file's). Only the owner may: the socket is shared
    with every process forked since, whose copies are merely closed (``_check_process``)."""
    try:
        listener.shutdown(socket.SHUT_RDWR)
    except OSError:
        pass  # not listening any more (a queue made by hand may be closed twice)
    listener.close()


def _weakly(method: Any, default: str) -> Any:
    """``method`` called through a weak reference to its object (``default`` once it is gone)."""
    ref = weakref.WeakMethod(method)

    def call() -> str:
        bound = ref()
        return default if bound is None else bound()

    return call


def _time_left(deadline: float | None) -> float:
    return float("inf") if deadline is None else deadline - time.monotonic()


def _fresh_address() -> Any:
    name = f"pipeload-queue-{os.getpid()}-{secrets.token_hex(8)}"
    if sys.platform.startswith("linux"):
        return "\0" + name  # the abstract namespace: no file, gone with the socket
    return os.path.join(tempfile.gettempdir(), name)


def _listen(address: Any) -> socket.socket:
    listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    listener.bind(address)
    listener.listen(1)
    listener.setblocking(False)
    return listener


def _unlink(address: Any) -> None:
    if isinstance(address, str) and not address.startswith("\0"):
        try:
            os.unlink(address)
        except OSError:
            pass
