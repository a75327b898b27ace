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
from pipeload._state_fields import StateFields
from pipeload.datapipes.boundary.feed import RaisedUpstream
from pipeload.datapipes.boundary.positions import START, Carrying, Resume, StateLog, UpstreamState
from pipeload.datapipes.protocol import NotAvailable, Notifier, PipeIterator, StateLoad, as_nonblocking
from pipeload.errors import WorkerDiedError, bad_state_field
from pipeload.transport.slab_keeper import SlabKeeper

T_co = TypeVar("T_co", covariant=True)
_names = itertools.count()


BUILT_IN_KINDS = ("thread", "process")  # they take no options beyond QueueBoundary's own


def _check_start_method(context: Any) -> None:
    """A start method name this system has, a multiprocessing context, or None; refused when the
    pipe is built, not when its first run starts the process."""
    if context is None or isinstance(context, multiprocessing.context.BaseContext):
        return
    methods = multiprocessing.get_all_start_methods()
    if not isinstance(context, str) or context not in methods:
        raise ValueError(f"multiprocessing_context should be None, a context or one of {methods!r}, "
                         f"but got multiprocessing_context={context!r}")


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
    items are pickled. The upstream process seeds its global generators from the seeds of the
    random pipes upstream when they all have one (the DataLoader sets them every epoch: the run
    then draws nothing from torch's global generator, as the same graph without the boundary),
    else from one number drawn from it when the run starts; under a DataLoader each worker's
    and rank's copy of the graph mixes its place into that number (``set_replica``), so their
    upstream processes draw different random values, the same again for the same loader seed.
    A seed given with ``set_seed`` seeds the next run only, as in one process.

    A run keeps a checkpoint (thread and process kinds): ``state_dict()`` of the downstream
    iterator is the latest state of the upstream pipe that crossed the queue and the items handed
    out since; loaded into a fresh iterator, the run starts its upstream there, makes again and
    drops those items. An upstream without a state (a plain generator) makes ``state_dict()``
    raise ``NotImplementedError``, as other pipes do (a loader then resumes by re-reading). A process boundary cannot start
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
        if isinstance(buffer_size, bool):  # an int to Python; refused by the queue, later, in a worker
            raise TypeError(f"buffer_size should be an int of at least 1, but got buffer_size={buffer_size!r}")
        check_positive(buffer_size, "buffer_size", "Buffer size")
        if multiprocessing_context is not None and worker_type != "process":
            raise ValueError(
                "multiprocessing_context only applies to worker_type='process', but got "
                f"multiprocessing_context={multiprocessing_context!r} with worker_type={worker_type!r}"
            )
        _check_start_method(multiprocessing_context)
        if options and worker_type in BUILT_IN_KINDS:  # a misspelt buffer_size would run with 8
            raise TypeError(f"queue_boundary({worker_type!r}) takes no other options, but got "
                            + ", ".join(f"{name}={value!r}" for name, value in options.items()))
        self.datapipe = datapipe
        self.worker_type = worker_type
        self.buffer_size = buffer_size
        # Kept as a start method name: context objects do not pickle.
        if isinstance(multiprocessing_context, multiprocessing.context.BaseContext):
            multiprocessing_context = multiprocessing_context.get_start_method()
        self.multiprocessing_context = multiprocessing_context
        self.options = options

    def __iter__(self) -> Iterator[T_co]:
        # The run starts at its first item (or wait), so that a checkpoint loaded into the
        # fresh iterator first can start its upstream where the checkpoint says.
        return _BoundaryIterator(self, f"the upstream {self.worker_type} of a queue boundary",
                                 checkpoints=self.keeps_checkpoints)

    def _start_run(self, resume: Resume | None) -> tuple[DataLoaderQueue, Producer, StateLog | None]:
        """Start one run's queue and upstream, at ``resume`` (None: the start); the log of the
        upstream's states a thread producer keeps for the consumer (None: other kinds)."""
        name = f"pipeload-{type(self).__name__.lower()}-{next(_names)}"
        kind = DataLoaderQueue.kind_class(self.worker_type)
        queue = kind(maxsize=self.buffer_size)
        options = {"multiprocessing_context": self.multiprocessing_context, **self.options}
        if self.worker_type == "process":
            options["slab_keeper"] = self._slab_keeper()
        if self.worker_type in _KINDS_SEEDED_APART:
            options["replica"] = self.__dict__.get("_replica")
        log = None
        if self.worker_type == "thread":
            # The consumer lags the producer by the queue's items and one in each thread's hands.
            log = StateLog(lag=self.buffer_size + 2)
            options.update(resume=resume, states=log)
        elif self.keeps_checkpoints:
            options.update(resume=resume, states=True)
        try:
            producer = kind.start_producer(self.datapipe, queue, name, options)
        except BaseException:
            queue.close()
            raise
        return queue, producer, log

    def set_replica(self, num_replicas: int, replica_id: int) -> None:
        """Say that this graph is copy ``replica_id`` of ``num_replicas`` (a DataLoader's workers
        x ranks; ``graph.apply_replica`` calls this): a process upstream then seeds its
        generators apart from the other copies' (see ``boundary/seeds.py``).

        Raises:
            ValueError: not 0 <= ``replica_id`` < ``num_replicas`` (naming both).
        """
        from pipeload.datapipes.boundary.seeds import check_replica  # it walks graphs: graph.py imports us

        self._replica = check_replica(num_replicas, replica_id)

    @property
    def keeps_checkpoints(self) -> bool:
        """Whether a run across this boundary keeps a checkpoint (thread and process kinds, when
        the upstream pipe keeps a state; see ``positions.py``)."""
        return self.worker_type in _KINDS_WITH_CHECKPOINTS

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
            origin = self.__dict__.get("_transient_origin")
            original = origin() if origin is not None else None
            if original is not None:
                original._slab_keeper().release_along(keeper)
        return keeper

    def __copy__(self) -> QueueBoundary[T_co]:
        # A copy made in this process (``graph.copy_graph``: a thread worker's copy of the
        # loader's graph) keeps slabs of its own, but whoever owns the original (a DataLoader)
        # can reach the original only: the copy's slabs go when the original's are released
        # (release_shared_memory, the original going). A deep copy or a pickle is not tied.
        fresh = type(self).__new__(type(self))
        fresh.__setstate__(self.__getstate__())
        fresh._transient_origin = weakref.ref(self)
        return fresh

    def release_shared_memory(self) -> None:
        """Free the shared memory a process boundary keeps between its runs (the slabs large
        tensors cross in) now, and those of its copies made in this process (a thread worker's
        copy of the graph); the next run makes new ones. A run in progress keeps its slabs until
        it ends. They also go with the pipe. See ``DataLoader.release_shared_memory``.

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


# The kinds whose far side seeds its own generators (see seeds.py): told the graph's copy.
_KINDS_SEEDED_APART = ("process", "ray")

# The kinds whose producers put the upstream's state into the queue now and then (feed's
# ``states``): a run across them keeps a checkpoint (see positions.py).
_KINDS_WITH_CHECKPOINTS = ("thread", "process")


class _BoundaryIterator(PipeIterator[Any]):
    """The downstream end of one run: takes from the queue, never waits itself.

    The run (queue and upstream) starts at the first item asked for. The end of the run (the
    upstream closed the queue) is StopIteration; an upstream failure is raised as itself; a
    death is a WorkerDiedError. Any of them releases the upstream at once, before the exception
    propagates (a traceback may keep this iterator alive for long).

    Its checkpoint (``checkpoints``) is the latest upstream state the producer put into the
    queue and the items handed downstream since (positions.py); loading one before the first
    item starts the upstream there.
    """

    def __init__(self, boundary: QueueBoundary[Any], upstream: str, checkpoints: bool) -> None:
        super().__init__()
        self._boundary: QueueBoundary[Any] | None = boundary  # until the run starts
        self._kind = boundary.worker_type
        self._queue: DataLoaderQueue | None = None
        self._producer: Producer | None = None
        self._upstream = upstream
        self._checkpoints = checkpoints
        self._resume: Resume | None = None
        # Where the run stands: a process producer's latest state passed and how many items had
        # been handed downstream then (``_taken`` less that: the items since); a thread
        # producer's log, read at ``_taken``. One run per iterator: ``_taken`` counts its items.
        self._position = START
        self._position_at = 0
        self._log: StateLog | None = None
        self._taken = 0
        self._over = False  # the end or an error has been raised: later calls are the end

    def _started(self) -> DataLoaderQueue:
        if self._queue is None:
            self._queue, self._producer, self._log = self._boundary._start_run(self._resume)  # type: ignore[union-attr]
            # A started run no longer needs its pipe: an upstream thread that outlives the
            # consumer for a moment must not keep the pipe (and its kept slabs) alive with it.
            self._boundary = None
        return self._queue

    def nonblocking_next(self) -> Any:
        if self._over:
            raise StopIteration
        queue = self._queue if self._queue is not None else self._started()
        try:
            item = queue.get(blocking=False)
        except NotAvailable:
            raise
        except QueueError as ending:
            self._over = True
            self._producer.close()  # type: ignore[union-attr]
            raise self._translated(ending) from None
        except BaseException:
            self._over = True
            self._producer.close()  # type: ignore[union-attr]
            raise
        self._taken += 1  # an error takes its item's place, as the states count it (feed.py)
        if type(item) is Carrying:  # a process producer's state after this very item
            self._position, self._position_at = item.state, self._taken
            item = item.item
        if type(item) is RaisedUpstream:  # the upstream's error for one item: the run goes on
            if hasattr(queue, "raised_an_item"):
                queue.raised_an_item = True  # its slabs go with the run (the error may keep us)
            error = item.exception()
            # The error's traceback keeps this frame: holding the error (a thread producer hands
            # on the very exception) it would make a cycle that keeps this run, and the graph
            # around it, alive until the collector runs, however soon the error is let go.
            del item
            try:
                raise error
            finally:
                del error
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
        if self._over:
            return []
        return self._started().notifiers()

    def close(self) -> None:
        self._over = self._over or self._queue is None  # never started: nothing to start later
        if self._producer is not None:
            self._producer.close()

    # -- checkpoints ----------------------------------------------------------------------

    def state_dict(self) -> dict[str, Any]:
        """The latest upstream state the producer sent and the items handed out since.

        Raises:
            NotImplementedError: this kind of boundary keeps no checkpoint, or the upstream pipe
                keeps no state (a plain generator): the run can only be re-read from its start.
        """
        if not self._checkpoints:
            raise NotImplementedError(f"a run across a {self._kind!r} queue boundary "
                                      "keeps no checkpoint")
        log = self._log
        unavailable = log.unavailable if log is not None else self._position.unavailable
        if unavailable is not None:
            raise NotImplementedError(f"the pipe upstream of a queue boundary keeps no state: {unavailable}")
        if log is None:
            upstream, skip = self._position.state(), self._taken - self._position_at
        else:
            count, upstream = log.at(self._taken)
            skip = self._taken - count
            if upstream is None and self._resume is not None:  # the run's start was a resume
                upstream, skip = self._resume.upstream_state, self._resume.skip + skip
        return {"own": {"upstream": upstream, "skip": skip}, "upstream": []}

    def check_state(self, state: Any, path: str, load: StateLoad) -> None:
        fields = StateFields(state, path)
        fields.sequence("upstream", "an empty list (the upstream runs beyond the boundary)", length=0)
        own = fields.fields("own")
        skip = own.integer("skip", 0)  # type: ignore[union-attr]
        upstream_state = own.raw("upstream", "the upstream pipe's state, or None")  # type: ignore[union-attr]
        own.finish()  # type: ignore[union-attr]
        fields.finish()
        if not self._checkpoints:
            raise bad_state_field(path or "the state", state, "no state",
                                  f"a {self._kind!r} queue boundary keeps no checkpoint")
        if self._boundary is None:
            raise RuntimeError("load_state_dict() comes before the first item of a run across a queue "
                               "boundary: this run has started; load the state into a new iterator")
        if upstream_state is not None:
            self._check_upstream_state(upstream_state, own.name("upstream"))  # type: ignore[union-attr]

        def apply() -> None:
            self._resume = Resume(upstream_state, skip)
            self._position, self._position_at = UpstreamState.of(upstream_state), -skip
        load.then(apply)

    def _check_upstream_state(self, upstream_state: Any, path: str) -> None:
        """Check the upstream's part of a state on a fresh iterator of the upstream pipe, made
        here only for that and never started (the run will make its own where it runs)."""
        probe = as_nonblocking(self._boundary.datapipe)  # type: ignore[union-attr]
        probing = StateLoad()
        probing.made(probe)
        try:
            probe.check_state(upstream_state, path, probing)
        finally:
            probing.discard()
