"""The pipes that cut a graph across threads or processes: ``queue_boundary`` and ``prefetch``."""

from __future__ import annotations

import itertools
import multiprocessing
import weakref
from collections.abc import Iterator
from typing import Any, TypeVar

from pipeload.datapipes.base import IterDataPipe
from pipeload.datapipes.boundary.process import ProcessUpstream
from pipeload.datapipes.boundary.thread import ThreadUpstream
from pipeload.datapipes.iter._columns import check_positive, length_of
from pipeload.datapipes.protocol import NotAvailable, Notifier, PipeIterator
from pipeload.transport.slab_keeper import SlabKeeper

T_co = TypeVar("T_co", covariant=True)
WORKER_TYPES = ("thread", "process")
_names = itertools.count()


class QueueBoundary(IterDataPipe[T_co]):
    """Run everything upstream of this point in another thread or process (functional name:
    ``queue_boundary``).

    Each run starts its own upstream thread or process, which iterates the upstream part of the
    graph and hands items over through a queue: in order, each exactly once, at most
    ``buffer_size`` at a time, between exactly two ends. Downstream, ``nonblocking_next()``
    raises ``NotAvailable`` while the queue is empty, so a ``greedy_join`` can take whichever
    input is ready. An exception upstream arrives downstream with its type and the upstream
    traceback; an upstream process that dies is a ``WorkerDiedError`` naming how it ended.
    Closing (or dropping) the iterator stops the upstream at once.

    Across a process boundary tensors travel in shared memory, not as pickled bytes (in slabs the
    boundary keeps from one run to the next, freed with the pipe or by
    ``release_shared_memory()``); other items are pickled. The upstream process seeds its random generators from one number
    drawn from torch's global generator when the run starts. A process boundary cannot start
    inside a DataLoader process worker (daemon processes may not have children): use threads
    there.

    Args:
        datapipe: the upstream part of the graph.
        worker_type: ``"thread"`` or ``"process"``.
        buffer_size: items the queue holds.
        multiprocessing_context: for ``"process"``: a start method name or context (default:
            multiprocessing's default).

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
    ) -> None:
        if worker_type not in WORKER_TYPES:
            raise ValueError(f"worker_type should be one of {WORKER_TYPES}, but got worker_type={worker_type!r}")
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

    def __iter__(self) -> Iterator[T_co]:
        name = f"pipeload-{type(self).__name__.lower()}-{next(_names)}"
        if self.worker_type == "thread":
            return _BoundaryIterator(ThreadUpstream(self.datapipe, self.buffer_size, name))
        upstream = ProcessUpstream(self.datapipe, self.buffer_size, self.multiprocessing_context, name,
                                   self._slab_keeper())
        return _BoundaryIterator(upstream)

    def _slab_keeper(self) -> SlabKeeper:
        # The process boundary's slabs belong to the pipe (a description), not to one run: each
        # run finds them ready. Transient: a copy or a pickle of the pipe keeps its own.
        keeper = self.__dict__.get("_transient_slabs")
        if keeper is None:
            keeper = self._transient_slabs = SlabKeeper()
            weakref.finalize(self, keeper.close).atexit = False
        return keeper

    def release_shared_memory(self) -> None:
        """Free the shared memory a process boundary keeps between its runs (the slabs large
        tensors cross in). A run in progress keeps them until it ends. See
        ``DataLoader.release_shared_memory``."""
        keeper = self.__dict__.get("_transient_slabs")
        if keeper is not None:
            keeper.release()

    def __len__(self) -> int:
        return length_of(self.datapipe, self)


class Prefetcher(QueueBoundary[T_co]):
    """Keep up to ``buffer_size`` items ready, made ahead by a background thread (functional
    name: ``prefetch``). A thread :class:`QueueBoundary` under torchdata's name.

    Example:
        >>> list(IterableWrapper(range(5)).map(slow_read).prefetch(buffer_size=4))
        [...]
    """

    def __init__(self, source_datapipe: IterDataPipe, buffer_size: int = 10) -> None:
        super().__init__(source_datapipe, "thread", buffer_size)


class _BoundaryIterator(PipeIterator[Any]):
    """The downstream end of one run: takes from the upstream's mailbox, never waits itself."""

    def __init__(self, upstream: Any) -> None:
        super().__init__()
        self._upstream = upstream

    def nonblocking_next(self) -> Any:
        try:
            return self._upstream.take_nowait()
        except NotAvailable:
            raise
        except BaseException:
            # The end, or an error: the upstream has nothing more to give. Release it now, not
            # when the garbage collector frees an exception's traceback that holds this run.
            self._upstream.close()
            raise

    def notifiers(self) -> list[Notifier]:
        return self._upstream.notifiers()

    def close(self) -> None:
        self._upstream.close()

    def state_dict(self) -> dict[str, Any]:
        raise NotImplementedError("a run across a queue boundary cannot be checkpointed yet")
