"""The consumer half of every queue boundary: a bounded, ordered mailbox with one producer.

The producer (a thread running the upstream pipe, or the thread receiving from an upstream
process) puts items, then either ends it or fails it; the consumer takes items without waiting
and learns the end or the error only after every item put before it.
"""

from __future__ import annotations

import threading
from collections import deque
from collections.abc import Callable
from typing import Any

from pipeload.datapipes.protocol import NotAvailable, Notifier

PUT_SLICE_S = 0.1  # a producer waiting for room re-checks whether it should stop this often


class Mailbox:
    """A bounded FIFO between exactly one producer and one consumer.

    Invariants (under ``_room``): ``len(_items) <= capacity``; once ``finish`` or ``fail`` is
    called nothing more is put; the consumer sees every item, in order, exactly once, and then
    the end or the error (once). After ``close`` every put is refused and held items are dropped.
    """

    def __init__(self, capacity: int) -> None:
        self.capacity = capacity
        self.notifier = Notifier()
        self._room = threading.Condition()
        self._items: deque[Any] = deque()
        self._ended = False
        self._error: BaseException | None = None
        self.failed = False  # fail() was called (the error itself goes to the consumer once)
        self._closed = False

    def put(self, item: Any, should_stop: Callable[[], bool]) -> bool:
        """Add ``item``, waiting for room in slices; False if the mailbox closed or we must stop."""
        with self._room:
            while len(self._items) >= self.capacity and not self._closed:
                if should_stop():
                    return False
                self._room.wait(PUT_SLICE_S)
            if self._closed:
                return False
            self._items.append(item)
        self.notifier.notify()
        return True

    def put_granted(self, item: Any) -> None:
        """Add an item the consumer already made room for (a process boundary's credit)."""
        with self._room:
            if self._closed:
                return
            if len(self._items) >= self.capacity:
                raise RuntimeError(
                    f"queue boundary protocol error: an item arrived beyond the {self.capacity} "
                    "granted"
                )
            self._items.append(item)
        self.notifier.notify()

    def finish(self) -> None:
        """No more items: the consumer gets StopIteration after the ones held."""
        with self._room:
            self._ended = True
        self.notifier.notify()

    def fail(self, error: BaseException) -> None:
        """The upstream failed: the consumer gets ``error`` after the items held."""
        with self._room:
            if not self._ended:
                self._error, self._ended = error, True
                self.failed = True
        self.notifier.notify()

    def take_nowait(self) -> Any:
        """The next item; NotAvailable if none yet; StopIteration at the end; the error once."""
        with self._room:
            if self._items:
                item = self._items.popleft()
                self._room.notify()
                return item
            error, self._error = self._error, None
            ended = self._ended
        if error is not None:
            raise error
        if ended:
            raise StopIteration
        raise NotAvailable

    def __len__(self) -> int:
        return len(self._items)

    def close(self) -> None:
        """Refuse further puts, wake a waiting producer and drop what is held. Idempotent."""
        with self._room:
            self._closed = True
            self._items.clear()
            self._room.notify_all()
