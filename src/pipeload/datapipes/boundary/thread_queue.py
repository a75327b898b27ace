"""The thread kind of ``DataLoaderQueue``: both ends in this process, items passed by reference.

One object serves both ends: the threads that put are the producing end, the threads that get
the consuming end (they may be one thread). Nothing is pickled, so an exception a producer
closes with reaches the consumer as the very same object, traceback and all.
"""

from __future__ import annotations

import os
import threading
from typing import Any

from pipeload.datapipes.boundary.inbox import Ending, Inbox, InboxQueue, deadline_after, has_died
from pipeload.datapipes.boundary.queue_interface import (
    DEFAULT_MAXSIZE,
    DataLoaderQueue,
    FarEnd,
    Producer,
    QueueError,
    check_blocking,
    check_maxsize,
)


def _thread_name(thread: threading.Thread | None = None) -> str:
    return f"thread {(thread or threading.current_thread()).name!r}"


class ThreadQueue(InboxQueue, kind="thread"):
    """A bounded FIFO between threads of this process (``DataLoaderQueue(kind="thread")``).

    Closing: the producer's ``close()`` keeps what it put for the consumer; the consumer's
    (a thread that has taken items and put none) drops what is held and makes the producer's
    next ``put`` raise. It cannot be pickled or used in another process.

    Invariants: ``_putter``/``_taker`` are the idents and names of the latest threads that put
    and took (read for messages and for who is closing); everything else is the inbox's.

    Example:
        >>> queue = DataLoaderQueue(kind="thread", maxsize=2)
        >>> queue.put("a"); queue.get()
        'a'
    """

    def __init__(self, maxsize: int = DEFAULT_MAXSIZE, *, kind: str | None = None) -> None:
        self._maxsize = check_maxsize(maxsize)
        self._inbox = Inbox(self._maxsize, self._far_end_name)
        self._putter: tuple[int, str] | None = None
        self._taker: tuple[int, str] | None = None
        self._watched: FarEnd | None = None
        # The one thread that puts, watched as if watch() had been called with it: a producer
        # thread that ended without close() left its consumer waiting for good. None once a
        # second thread has put (which of them is the far end, only watch() can say).
        self._producer: threading.Thread | None = None
        self._producers_known = True
        self._pid = os.getpid()

    def put(self, data: Any, blocking: bool = True, timeout: float | None = None) -> None:
        self._check_process()
        me = threading.current_thread()
        self._putter = (me.ident, _thread_name(me))  # type: ignore[assignment]
        if self._producer is not me and self._producers_known:
            self._producers_known = self._producer is None
            self._producer = me if self._producers_known else None
        self._inbox.add(data, check_blocking(blocking), deadline_after(timeout), self._far_end_died)

    def get(self, blocking: bool = True, timeout: float | None = None) -> Any:
        self._check_process()
        self._taker = (threading.get_ident(), _thread_name())
        return self._inbox.take(check_blocking(blocking), deadline_after(timeout), self._far_end_died)

    def close(self, error: BaseException | None = None) -> None:
        ending = Ending(QueueError.CLOSED, _thread_name(), closer_thread=threading.get_ident(), cause=error)
        me = threading.get_ident()
        consumer = self._taker is not None and self._taker[0] == me and (self._putter is None or self._putter[0] != me)
        if consumer:
            self._inbox.discard(ending)  # nobody will take them: release them now
        else:
            self._inbox.end(ending)

    def __len__(self) -> int:
        return len(self._inbox)

    def __reduce__(self) -> Any:
        raise TypeError(
            "a DataLoaderQueue of kind='thread' cannot be pickled or sent to another process: "
            "make it with kind='process' to hand it to a multiprocessing.Process"
        )

    # -- queue_boundary -----------------------------------------------------------------------

    @classmethod
    def start_producer(cls, pipe: Any, queue: DataLoaderQueue, name: str, options: dict[str, Any]) -> Producer:
        from pipeload.datapipes.boundary.thread import ThreadProducer

        return ThreadProducer(pipe, queue, name, options.get("resume"), options.get("states"))

    # -- helpers ------------------------------------------------------------------------------

    def _far_end_name(self) -> str:
        me = threading.get_ident()
        for party in (self._putter, self._taker):
            if party is not None and party[0] != me:
                return party[1]
        if self._watched is not None:
            return _thread_name(self._watched) if isinstance(self._watched, threading.Thread) else str(self._watched.name)
        return "another thread"

    def _far_end_died(self) -> QueueError | None:
        watched = self._watched
        if watched is None and self._producer is not threading.current_thread():
            watched = self._producer  # the only thread that put (a consumer's own puts: not)
        if watched is None or not has_died(watched) or self._inbox.ending is not None:
            return None
        name = self._far_end_name()
        self._inbox.end(Ending(QueueError.DIED, name))
        return self._inbox.ending.error(name)  # type: ignore[union-attr]

    def _check_process(self) -> None:
        if os.getpid() != self._pid:
            raise TypeError(
                "a DataLoaderQueue of kind='thread' was used in another process (a forked child "
                f"of process {self._pid}); it only works between threads of one process: make "
                "it with kind='process' to hand it to a multiprocessing.Process"
            )
