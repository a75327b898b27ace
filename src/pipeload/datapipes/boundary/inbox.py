"""What has arrived at one end of a queue: a bounded FIFO, then how the queue ended.

Every kind of :class:`~pipeload.datapipes.boundary.queue_interface.DataLoaderQueue` keeps its
received items in an :class:`Inbox`: the thread kind uses it as the whole queue, the process
kind fills it from a reader thread. The consumer takes items without waiting or waits for them
in slices; after the last item it gets the :class:`QueueError` the queue ended with.
"""

from __future__ import annotations

import threading
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from pipeload.datapipes.boundary.queue_interface import DataLoaderQueue, FarEnd, QueueError, check_timeout
from pipeload.datapipes.protocol import NotAvailable, Notifier

WAIT_SLICE_S = 0.1  # a waiter re-checks the far end's liveness and its deadline this often


@dataclass(frozen=True)
class Ending:
    """How a queue ended, kept until every held item is taken.

    Attributes:
        reason: ``QueueError.CLOSED`` or ``QueueError.DIED``.
        closer_name: who closed it, in words ("thread 'MainThread'", "process 4711").
        here: this end closed it (for ends that are a whole process, any of its threads).
        closer_thread: the ident of the thread that closed it, for ends shared by threads
            (the thread kind): that thread is "this end", the others are the far end.
        cause: the error the closer passed on, if any.
        detail: more words for the message (how a process ended, how many items arrived).
    """

    reason: str
    closer_name: str
    here: bool = False
    closer_thread: int | None = None
    cause: BaseException | None = None
    detail: str = ""

    def error(self, far_end: str) -> QueueError:
        """The QueueError for the thread asking now, whose far end is ``far_end``."""
        here = self.here or (self.closer_thread is not None and self.closer_thread == threading.get_ident())
        if self.reason == QueueError.DIED:
            text = f"DataLoaderQueue: the far end ({far_end}) died without closing the queue"
        elif here:
            text = f"DataLoaderQueue: this end ({self.closer_name}) closed the queue"
        else:
            text = f"DataLoaderQueue: the far end ({self.closer_name}) closed the queue"
            far_end = self.closer_name
        if self.cause is not None:
            text += f", with {type(self.cause).__name__}: {self.cause}"
        if self.detail:
            text += f" ({self.detail})"
        return QueueError(text, far_end=far_end, reason=self.reason, by_this_end=here, cause=self.cause)


class Inbox:
    """A bounded FIFO between whoever adds and whoever takes.

    Invariants (under ``_lock``): ``len(_items) <= capacity``; once ``_ending`` is set nothing
    more is added; the taker sees every item added, in order, exactly once, then ``_ending``
    (every time it asks again). ``discard()`` also drops what is held.
    """

    def __init__(self, capacity: int, far_end: Callable[[], str]) -> None:
        self.capacity = capacity
        self.notifier = Notifier()
        self._far_end = far_end  # who the far end is, seen from the calling thread
        self._lock = threading.Condition()
        self._items: deque[Any] = deque()
        self._ending: Ending | None = None

    def add(self, item: Any, blocking: bool, deadline: float | None,
            check: Callable[[], QueueError | None]) -> None:
        """Append ``item`` once there is room.

        ``check`` is asked every slice while waiting and returns an error to raise instead (the
        far end died, this end closed). Raises NotAvailable (not blocking, full) or the error.
        """
        with self._lock:
            while len(self._items) >= self.capacity and self._ending is None:
                if not blocking:
                    _not_now(check)
                self._wait(deadline, check)
            if self._ending is not None:
                raise self._ending.error(self._far_end())
            self._items.append(item)
            self._lock.notify_all()  # a taker waiting in take()
        self.notifier.notify()

    def add_granted(self, item: Any) -> None:
        """Append an item the taker already made room for (a credit it granted)."""
        with self._lock:
            if self._ending is not None:
                return
            if len(self._items) >= self.capacity:
                raise RuntimeError(
                    f"DataLoaderQueue protocol error: an item arrived beyond the {self.capacity} granted"
                )
            self._items.append(item)
            self._lock.notify_all()
        self.notifier.notify()

    def take(self, blocking: bool, deadline: float | None, check: Callable[[], QueueError | None]) -> Any:
        """The next item; NotAvailable (not blocking, none yet); the ending once all are taken."""
        with self._lock:
            while not self._items:
                if self._ending is not None:
                    raise self._ending.error(self._far_end())
                if not blocking:
                    _not_now(check)
                self._wait(deadline, check)
            item = self._items.popleft()
            self._lock.notify_all()  # a producer waiting for room
            return item

    def end(self, ending: Ending) -> None:
        """No more items: after the held ones, every take raises ``ending``. The first wins."""
        with self._lock:
            if self._ending is None:
                self._ending = ending
            self._lock.notify_all()
        self.notifier.notify()

    def discard(self, ending: Ending) -> None:
        """The taker closed: drop what is held, refuse adds, and end with ``ending``."""
        with self._lock:
            self._items.clear()
            if self._ending is None:
                self._ending = ending
            self._lock.notify_all()
        self.notifier.notify()

    @property
    def ending(self) -> Ending | None:
        return self._ending

    def __len__(self) -> int:
        return len(self._items)

    def _wait(self, deadline: float | None, check: Callable[[], QueueError | None]) -> None:
        """One slice of waiting on the condition (held); raises what ``check`` or the deadline says."""
        problem = check()
        if problem is not None:
            raise problem
        slice_s = WAIT_SLICE_S
        if deadline is not None:
            left = deadline - time.monotonic()
            if left <= 0:
                far_end = self._far_end()
                raise QueueError(f"DataLoaderQueue: timed out waiting for the far end ({far_end})",
                                 far_end=far_end, reason=QueueError.TIMED_OUT)
            slice_s = min(slice_s, left)
        self._lock.wait(slice_s)


class InboxQueue(DataLoaderQueue):
    """What the kinds that keep arrivals in an :class:`Inbox` share: its size, its ending, its
    notifier, and the far end they watch. A subclass sets ``_maxsize``, ``_inbox`` and
    ``_watched`` in its ``__init__``."""

    _maxsize: int
    _inbox: Inbox
    _watched: FarEnd | None

    @property
    def maxsize(self) -> int:
        return self._maxsize

    @property
    def closed(self) -> bool:
        return self._inbox.ending is not None

    def notifiers(self) -> list[Notifier]:
        return [self._inbox.notifier]

    def watch(self, far_end: FarEnd) -> None:
        self._watched = far_end


def _not_now(check: Callable[[], QueueError | None]) -> None:
    """Raise NotAvailable to a call that would wait; or what ``check`` says, where the far end
    died without closing (a caller that only polls, a boundary, heard NotAvailable for ever)."""
    problem = check()
    if problem is not None:
        raise problem
    raise NotAvailable


def has_died(far_end: FarEnd) -> bool:
    """Whether a watched thread or process ran and is gone. One not started yet has not died: a
    consumer may poll (or wait) before its producer starts, and was told "died" for good."""
    return getattr(far_end, "ident", None) is not None and not far_end.is_alive()


def deadline_after(timeout: float | None) -> float | None:
    """The monotonic time a wait of ``timeout`` seconds ends (None: never).

    Raises:
        TypeError, ValueError: ``timeout`` is not None or a number of seconds of at least 0.
    """
    seconds = check_timeout(timeout)
    return None if seconds is None else time.monotonic() + seconds
