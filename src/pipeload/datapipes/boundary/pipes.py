"""The pipes that cut a graph across threads or processes: ``queue_boundary`` and ``prefetch``."""

from __future__ import annotations

import itertools
import multiprocessing
import os
import weakref
from collections.abc import Iterator
from typing import Any, TypeVar

from pipeload.datapipes.base import IterDataPipe
from pipeload.datapipes.boundary.queue_interface import KIND_MODULES, DataLoaderQueue, Producer, QueueError
from pipeload.datapipes.iter._columns import check_positive, length_of
from pipeload.datapipes.protocol import NotAvailable, Notifier, PipeIterator
from pipeload.errors import WorkerDiedError
from pipeload.transport.slab_keeper import SlabKeeper

T_co = TypeVar("T_co", covariant=True)
_names = itertools.count()


class QueueBoundary(IterDataPipe[T_co]):
    """Run everything upstream of this point in another thread or process (functional name:
    ``queue_boundary``).

    Each run starts its own upstream thread or process, which iterates the upstream part of the
    graph and puts its items into a :class:`~pipeload.datapipes.DataLoaderQueue` of the same
    kind: in order, each exactly once, at most ``buffer_size`` at a time, between exactly two
    ends. Downstream, ``nonblocking_next()`` raises ``NotAvailable`` while the queue is empty,
    so a ``greedy_join`` can take whichever input is ready. An exception upstream arrives
    downstream with its type and the upstream traceback; an upstream process that dies is a
    ``WorkerDiedError`` naming how it ended. Closing (or dropping) the iterator stops the
    upstream at once.

    Across a process boundary large tensors travel in shared memory, not as pickled bytes: in
    slabs the pipe keeps from one run to the next (a copy or a pickle of the pipe keeps none),
    freed with the pipe, after a run that fails, or by :meth:`release_shared_memory`; other
    items are pickled. The upstream process seeds its random generators from one number
    drawn from torch's global generator when the run starts. A process boundary cannot start
    inside a DataLoader process worker (daemon processes may not have children): use threads
    there.

    Args:
        datapipe: the upstream part of the graph.
        worker_type: the queue's kind: ``"thread"``, ``"process"``, or another registered
            ``DataLoaderQueue`` kind.
        buffer_size: items the queue holds (its ``maxsize``).
        multiprocessing_context: for ``"process"``: a start method name or context (default:
            multiprocessing's default).
        **options: options of another kind's upstream (see that kind).

    Example:
        >>> decoded = IterableWrapper(paths).map(decode_jpeg).queue_boundary("process", buffer_size=16)
        >>> batches = decoded.batch(32).collate()
    """

    _parent_fields = ("datapipe",)

    def __init__(
        self,
        datapipe: IterDataPipe,
        worker_type: str = "thread",
        buffer_size: int = 8,
        multiprocessing_context: Any = None,
        **options: Any,
    ) -> None:
        known = sorted(KIND_MODULES)
        if worker_type not in known and worker_type not in DataLoaderQueue._kinds:
            raise ValueError(f"worker_type should be one of {known}, but got worker_type={worker_type!r}")
        check_positive(buffer_size, "buffer_size", "Buffer size")
        if multiprocessing_context is not None and worker_type != "process":
            raise ValueError(
                "multiprocessing_context only applies to worker_type='process', but got "
                f"multiprocessing_context={multiprocessing_context!r} with worker_type={worker_type!r}"
            )
        self.datapipe = datapipe
        self.worker_type = worker_type
        self.buffer_size = buffer_size
        # Kept as a start method name: context objects do not pickle.
        if isinstance(multiprocessing_context, multiprocessing.context.BaseContext):
            multiprocessing_context = multiprocessing_context.get_start_method()
        self.multiprocessing_context = multiprocessing_context
        self.options = options

    def __iter__(self) -> Iterator[T_co]:
        name = f"pipeload-{type(self).__name__.lower()}-{next(_names)}"
        kind = DataLoaderQueue.kind_class(self.worker_type)
        queue = kind(maxsize=self.buffer_size)
        options = {"multiprocessing_context": self.multiprocessing_context, **self.options}
        if self.worker_type == "process":
            options["slab_keeper"] = self._slab_keeper()
        try:
            producer = kind.start_producer(self.datapipe, queue, name, options)
        except BaseException:
            queue.close()
            raise
        return _BoundaryIterator(queue, producer, f"the upstream {self.worker_type} of a queue boundary")

    def _slab_keeper(self) -> SlabKeeper:
        # The slabs belong to the pipe (a description), not to one run: each run finds them
        # mapped and the items' size known. Transient: a copy or a pickle keeps its own; a
        # fork's copy (a process that inherited this pipe) must not grant slabs the original
        # grants too, so it makes its own as well.
        keeper = self.__dict__.get("_transient_slabs")
        if keeper is None or self.__dict__.get("_transient_slabs_pid") != os.getpid():
            keeper = self._transient_slabs = SlabKeeper()
            self._transient_slabs_pid = os.getpid()
            weakref.finalize(self, keeper.close).atexit = False
        return keeper

    def release_shared_memory(self) -> None:
        """Free the shared memory a process boundary keeps between its runs (the slabs large
        tensors cross in) now; the next run makes new ones. A run in progress keeps its slabs
        until it ends. They also go with the pipe. See ``DataLoader.release_shared_memory``.

        Example:
            >>> pipe = IterableWrapper(paths).map(decode).queue_boundary("process")
            >>> images = list(pipe)                # the slabs stay for the next run
            >>> pipe.release_shared_memory()       # ...unless you let them go
        """
        keeper = self.__dict__.get("_transient_slabs")
        if keeper is not None and self.__dict__.get("_transient_slabs_pid") == os.getpid():
            keeper.release()

    def __len__(self) -> int:
        return length_of(self.datapipe, self)


class Prefetcher(QueueBoundary[T_co]):
    """Keep up to ``buffer_size`` items ready, made ahead by a background thread (functional
    name: ``prefetch``). A thread :class:`QueueBoundary` under torchdata's name.

    Args:
        source_datapipe: the pipe to read ahead.
        buffer_size: items kept ready.

    Example:
        >>> list(IterableWrapper(range(5)).map(slow_read).prefetch(buffer_size=4))
        [...]
    """

    def __init__(self, source_datapipe: IterDataPipe, buffer_size: int = 10) -> None:
        super().__init__(source_datapipe, "thread", buffer_size)


class _BoundaryIterator(PipeIterator[Any]):
    """The downstream end of one run: takes from the queue, never waits itself.

    The end of the run (the upstream closed the queue) is StopIteration; an upstream failure is
    raised as itself; a death is a WorkerDiedError. Any of them releases the upstream at once,
    before the exception propagates (a traceback may keep this iterator alive for long).
    """

    def __init__(self, queue: DataLoaderQueue, producer: Producer, upstream: str) -> None:
        super().__init__()
        self._queue = queue
        self._producer = producer
        self._upstream = upstream
        self._taken = 0
        self._over = False  # the end or an error has been raised: later calls are the end

    def nonblocking_next(self) -> Any:
        if self._over:
            raise StopIteration
        try:
            item = self._queue.get(blocking=False)
        except NotAvailable:
            raise
        except QueueError as ending:
            self._over = True
            self._producer.close()
            raise self._translated(ending) from None
        except BaseException:
            self._over = True
            self._producer.close()
            raise
        self._taken += 1
        return item

    def _translated(self, ending: QueueError) -> BaseException:
        if ending.cause is not None:
            return ending.cause
        if ending.reason == QueueError.DIED:
            died = WorkerDiedError(
                f"{self._upstream} ({ending.far_end}) exited unexpectedly after {self._taken} items: {ending}"
            )
            died.__cause__ = ending
            return died
        if ending.reason == QueueError.CLOSED:
            return StopIteration()  # the upstream ended (or this run was closed)
        return ending

    def notifiers(self) -> list[Notifier]:
        return self._queue.notifiers()

    def close(self) -> None:
        self._producer.close()

    def state_dict(self) -> dict[str, Any]:
        raise NotImplementedError("a run across a queue boundary cannot be checkpointed yet")
