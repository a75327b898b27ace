"""``DataLoaderQueue``: the one queue between two parts of a pipeline, whatever separates them.

The DataPipes RFC (pytorch#49440) asks for a single queue interface between the pieces of a
graph, so that the DataLoader (or a user) can choose what carries the data: a plain object
hand-over between two threads (or within one), a socket between two processes, an actor on
another machine. Every kind keeps the same promises:

- **between two ends**: one end puts, the other end gets (the direction is fixed by use);
- **delivered, once, in order**: every item put before the end closes reaches the far end,
  exactly once, in the order it was put;
- **bounded**: at most ``maxsize`` items are in flight or waiting at any moment; a put beyond
  that waits for room (or, non-blocking, raises :class:`NotAvailable`);
- **non-blocking when asked**: ``get(blocking=False)`` answers now, with an item or
  :class:`NotAvailable`;
- **ends that say why**: once either end calls :meth:`DataLoaderQueue.close`, or the far end
  dies, or a wait times out, the calls raise :class:`QueueError`, which names the far end and
  the reason; a far end that closed with an error hands that error over as ``cause``.

Each kind also picks its serialisation: the thread kind passes object references, the process
kind pickles (large tensors in shared-memory slabs the getting end reuses), a Ray kind its
object store.

Adding a kind: subclass :class:`DataLoaderQueue` with ``kind="name"`` in the class statement; it
is then made by ``DataLoaderQueue(kind="name", maxsize=N, **options)``. Its ``__init__`` takes
``maxsize``, ``kind`` (the name it was asked by, passed on by the dispatch) and its own keyword
options, and checks ``maxsize`` with :func:`check_maxsize`. To serve
``pipe.queue_boundary("name")`` it also implements :meth:`DataLoaderQueue.start_producer`. A
kind whose module is not imported yet is found through :data:`KIND_MODULES`.
"""

from __future__ import annotations

import abc
import importlib
import math
import numbers
from typing import Any, ClassVar, Protocol

from pipeload.datapipes.protocol import NotAvailable, Notifier

__all__ = [
    "DEFAULT_MAXSIZE",
    "KIND_MODULES",
    "DataLoaderQueue",
    "FarEnd",
    "NotAvailable",
    "Producer",
    "QueueError",
    "check_blocking",
    "check_maxsize",
    "check_timeout",
]

DEFAULT_MAXSIZE = 8
# Where each kind lives, so that ``DataLoaderQueue(kind=...)`` finds a kind whose module has not
# been imported yet. A new kind adds its line here (or is imported before use).
KIND_MODULES: dict[str, str] = {
    "thread": "pipeload.datapipes.boundary.thread_queue",
    "process": "pipeload.datapipes.boundary.process_queue",
    "ray": "pipeload.datapipes.boundary.ray_queue",
}


class QueueError(Exception):
    """A :class:`DataLoaderQueue` can no longer deliver: it was closed, its far end died, or a
    wait timed out.

    Attributes:
        far_end: who is at the other end, in words (``"thread 'prefetch-0'"``,
            ``"process 4711"``, ``"Ray actor 'decode-3'"``).
        reason: one of :attr:`CLOSED`, :attr:`DIED`, :attr:`TIMED_OUT`.
        by_this_end: for :attr:`CLOSED`, whether this end closed it (else the far end did).
        cause: the error the far end closed with, when it closed with one (it is also the
            exception's ``__cause__``). A queue boundary raises it in place of this error.

    Example:
        >>> try:
        ...     item = queue.get()
        ... except QueueError as error:
        ...     print(error.reason, error.far_end)  # e.g. "closed process 4711"
    """

    CLOSED: ClassVar[str] = "closed"
    DIED: ClassVar[str] = "died"
    TIMED_OUT: ClassVar[str] = "timed out"

    def __init__(
        self,
        message: str,
        *,
        far_end: str,
        reason: str,
        by_this_end: bool = False,
        cause: BaseException | None = None,
    ) -> None:
        super().__init__(message)
        self.far_end = far_end
        self.reason = reason
        self.by_this_end = by_this_end
        self.cause = cause
        if cause is not None:
            self.__cause__ = cause

    def __reduce__(self) -> Any:
        return (_rebuild_queue_error, (str(self), self.far_end, self.reason, self.by_this_end, self.cause))


def _rebuild_queue_error(message: str, far_end: str, reason: str, by_this_end: bool,
                         cause: BaseException | None) -> QueueError:
    return QueueError(message, far_end=far_end, reason=reason, by_this_end=by_this_end, cause=cause)


def check_maxsize(maxsize: Any) -> int:
    """``maxsize`` as an int of at least 1.

    Raises:
        ValueError: anything else, named with the value received.
    """
    if isinstance(maxsize, bool) or not isinstance(maxsize, int) or maxsize < 1:
        raise ValueError(f"DataLoaderQueue maxsize should be an int of at least 1, but got maxsize={maxsize!r}")
    return maxsize


def check_blocking(blocking: Any) -> bool:
    """``blocking`` as a bool.

    Raises:
        TypeError: anything but True or False (a string such as "no" would be taken as true,
            and a get meant not to wait would wait), named with the value received.
    """
    if blocking is True or blocking is False:
        return blocking
    kind = type(blocking)
    if kind.__module__ == "numpy" and kind.__name__ in ("bool", "bool_"):  # numpy's, ``is`` neither
        return bool(blocking)
    raise TypeError(f"blocking should be True or False, but got blocking={blocking!r} "
                    f"({type(blocking).__name__})")


def check_timeout(timeout: Any) -> float | None:
    """``timeout`` (seconds) as None or a number of at least 0.

    Raises:
        TypeError: not None and not a real number (a bool included), named with the value.
        ValueError: negative or NaN (a NaN deadline is never reached: the wait would never end).
    """
    if timeout is None:
        return None
    if isinstance(timeout, bool) or not isinstance(timeout, numbers.Real):
        raise TypeError(f"timeout should be None or a number of seconds, but got timeout={timeout!r} "
                        f"({type(timeout).__name__})")
    seconds = float(timeout)
    if math.isnan(seconds) or seconds < 0:
        raise ValueError(f"timeout should be None or at least 0, but got timeout={timeout!r}")
    return seconds


class FarEnd(Protocol):
    """What :meth:`DataLoaderQueue.watch` accepts: the thread, process (or other handle) that runs
    the far end. ``threading.Thread`` and ``multiprocessing.Process`` qualify."""

    name: str

    def is_alive(self) -> bool: ...


class Producer(Protocol):
    """What :meth:`DataLoaderQueue.start_producer` returns: the running far end of a boundary."""

    def close(self) -> None:
        """Stop it now (ask, then insist); safe to call twice."""
        ...


class DataLoaderQueue(abc.ABC):
    """A bounded, ordered, exactly-once queue between two ends (the RFC's DataLoaderQueue).

    ``DataLoaderQueue(kind="thread" | "process", maxsize=N)`` makes one of the built-in kinds:

    - ``"thread"``: both ends in this process (two threads, or one): the same object is used
      at both ends, items pass as references. It cannot be sent to another process.
    - ``"process"``: hand the queue to a ``multiprocessing.Process`` (as an argument: it
      pickles under fork, spawn and forkserver) and use it there; the copy over there is the
      far end of this one. Items are pickled; large tensors travel in shared-memory slabs
      that the getting end owns and reuses, freed when the queue is closed.

    One end puts, the other gets. ``close()`` at either end ends the queue: the far end still
    gets every item put before, then :class:`QueueError`; a put after it raises at once.

    Args:
        kind: which implementation (see :data:`KIND_MODULES` for the known kinds).
        maxsize: the most items in flight or waiting at once (at least 1).
        **options: the kind's own options (see each kind).

    Raises:
        ValueError: an unknown ``kind`` or a ``maxsize`` below 1.

    Example:
        >>> queue = DataLoaderQueue(kind="process", maxsize=4)
        >>> worker = multiprocessing.Process(target=produce, args=(queue,))  # produce() puts
        >>> worker.start()
        >>> first = queue.get()                    # waits for the first item
        >>> try:
        ...     more = queue.get(blocking=False)  # answers now
        ... except NotAvailable:
        ...     more = None
    """

    kind: ClassVar[str] = ""
    _kinds: ClassVar[dict[str, type[DataLoaderQueue]]] = {}

    def __init_subclass__(cls, kind: str | None = None, **kwargs: Any) -> None:
        super().__init_subclass__(**kwargs)
        if kind is not None:
            cls.kind = kind
            DataLoaderQueue._kinds[kind] = cls

    def __new__(cls, *args: Any, kind: str | None = None, **kwargs: Any) -> DataLoaderQueue:
        if cls is DataLoaderQueue:
            cls = DataLoaderQueue.kind_class("thread" if kind is None else kind)
        return super().__new__(cls)

    @staticmethod
    def kind_class(kind: str) -> type[DataLoaderQueue]:
        """The class that implements ``kind`` (importing its module when needed).

        Raises:
            ValueError: no such kind.
        """
        if kind not in DataLoaderQueue._kinds and kind in KIND_MODULES:
            try:
                importlib.import_module(KIND_MODULES[kind])
            except ImportError as error:
                raise ValueError(
                    f"DataLoaderQueue kind={kind!r} needs {KIND_MODULES[kind]}, which cannot be "
                    f"imported here: {error}"
                ) from error
        try:
            return DataLoaderQueue._kinds[kind]
        except KeyError:
            known = sorted(set(DataLoaderQueue._kinds) | set(KIND_MODULES))
            raise ValueError(f"DataLoaderQueue kind should be one of {known}, but got kind={kind!r}") from None

    # -- the RFC's interface ------------------------------------------------------------------

    @abc.abstractmethod
    def put(self, data: Any, blocking: bool = True, timeout: float | None = None) -> None:
        """Send ``data`` to the far end.

        Args:
            data: any object this kind can carry.
            blocking: wait for room when ``maxsize`` items are already in flight (else raise
                :class:`NotAvailable` at once).
            timeout: the most seconds to wait (None: no limit).

        Raises:
            NotAvailable: not blocking, and no room now.
            QueueError: the queue is closed (by either end), the far end died, or ``timeout``
                passed; nothing was sent.
        """

    @abc.abstractmethod
    def get(self, blocking: bool = True, timeout: float | None = None) -> Any:
        """The next item from the far end.

        Args:
            blocking: wait for one (else raise :class:`NotAvailable` at once when none is here).
            timeout: the most seconds to wait (None: no limit).

        Raises:
            NotAvailable: not blocking, and no item has arrived yet.
            QueueError: every item the far end put has been taken and the queue is closed, or
                the far end died, or ``timeout`` passed.
        """

    @abc.abstractmethod
    def close(self, error: BaseException | None = None) -> None:
        """End the queue from this end; idempotent.

        The far end still gets every item put before, then :class:`QueueError` (whose
        ``cause`` is ``error`` when given: a producer that failed passes its exception on).
        Items this end received and did not take are dropped.
        """

    @property
    @abc.abstractmethod
    def closed(self) -> bool:
        """Whether this end has closed (or learnt that the far end closed or died)."""

    @property
    @abc.abstractmethod
    def maxsize(self) -> int:
        """The most items in flight or waiting at once."""

    # -- optional hooks ------------------------------------------------------------------------

    def notifiers(self) -> list[Notifier]:
        """Notifiers set when an item (or the end) arrives at this end, so a consumer waiting on
        several sources sleeps until one has something. Empty: the consumer polls."""
        return []

    def watch(self, far_end: FarEnd) -> None:
        """Name the thread or process that runs the far end, so its death is noticed (and
        described) even while it holds no connection. Optional: kinds that see a death
        without it may ignore it."""

    @classmethod
    def start_producer(cls, pipe: Any, queue: DataLoaderQueue, name: str, options: dict[str, Any]) -> Producer:
        """Start running ``pipe`` at the far end of ``queue`` (a thread, a process, an actor),
        putting its items, then closing (with the error, if it fails). ``queue_boundary``
        calls this for its kind.

        Args:
            pipe: the upstream part of the graph.
            queue: a queue of this kind, made by the boundary; the producer uses its far end.
            name: a name for the thread or process, for messages.
            options: the boundary's options for this kind (e.g. a start method).
        """
        raise NotImplementedError(f"DataLoaderQueue kind {cls.kind!r} cannot run a queue boundary's upstream")

    def __enter__(self) -> DataLoaderQueue:
        return self

    def __exit__(self, *exc_info: Any) -> None:
        self.close()
