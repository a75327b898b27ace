"""One pipe into several branches: fork (every branch sees every item) and demux (each item
goes to one branch).

The branches of one fork share a single pass over the source: a *run* holds the source's
iterator and the items some branches have read and others not yet. As in torch, the branch
iterators made one after the other (``iter(a)``, ``iter(b)``) join the same run, even when
``a``'s iterator has ended and been dropped before ``b``'s is made (``list(a); list(b)``, or
``a.concat(b)``): ``b`` reads the items kept for it instead of a second pass over the source.
Making a second iterator for a branch that already joined starts a new run for all, with torch's
warning unless every branch has ended or been closed. The hidden source node holds a run
strongly only while some branch has not joined it yet (that branch will need it); after that,
only the branch iterators hold it, and the node keeps a weak reference.
"""

from __future__ import annotations

import copy as copy_module
import threading
import warnings
import weakref
from collections import deque
from collections.abc import Callable, Iterator
from typing import Any, Literal

from pipeload._user_frame import first_frame_outside_pipeload
from pipeload.datapipes._functions import check_function, raised_by_function
from pipeload.datapipes.base import IterDataPipe
from pipeload.datapipes.iter._columns import check_int, length_of
from pipeload.datapipes.protocol import Notifier, PipeIterator, SkipToResume, as_nonblocking

_JOIN_LOCK = threading.Lock()  # joining runs is rare; one lock for every fork keeps pipes picklable


def _check_instances(num_instances: int) -> None:
    check_int(num_instances, "num_instances")
    if num_instances < 1:
        raise ValueError(f"Expected `num_instances` larger than 0, but {num_instances} is found")


def _warn_if_unlimited(buffer_size: int, name: str) -> None:
    if buffer_size < 0:
        warnings.warn(
            f"Unlimited buffer size is set for `{name}`, please be aware of OOM at random places",
            UserWarning,
            stacklevel=first_frame_outside_pipeload(),
        )


class _SharedSource(IterDataPipe[Any]):
    """The hidden node the branches read through; it makes and hands out runs."""

    _parent_fields = ("main_datapipe",)
    main_datapipe: IterDataPipe
    num_instances: int

    def join_run(self, instance_id: int) -> Any:
        with _JOIN_LOCK:
            run = self._current_run()
            if run is None or instance_id in run.joined:
                if run is not None and not run.finished():
                    warnings.warn(
                        "Some child DataPipes are not exhausted when __iter__ is called. We are "
                        "resetting the buffer and each child DataPipe will read from the start "
                        "again.",
                        UserWarning,
                        stacklevel=first_frame_outside_pipeload(),
                    )
                run = self._new_run()
                self._transient_run = weakref.ref(run)
            run.joined.add(instance_id)
            self._hold_until_all_joined(run)
            return run

    def _current_run(self) -> Any:
        waiting = self.__dict__.get("_transient_run_waiting")
        if waiting is not None:
            return waiting
        ref = self.__dict__.get("_transient_run")
        return ref() if ref is not None else None

    def _hold_until_all_joined(self, run: Any) -> None:
        """Keep ``run`` alive for the branches that have not joined it: the iterators of those
        that did may all be gone (read to the end, dropped) before the next one is made, and
        that one must read the items kept for it, not start a second pass over the source."""
        if len(run.joined) < self.num_instances:
            self._transient_run_waiting = run
        else:
            self.__dict__.pop("_transient_run_waiting", None)

    def _new_run(self) -> Any:
        raise NotImplementedError

    def __iter__(self) -> Iterator[Any]:
        raise TypeError(f"{type(self).__name__} is read through its branches, not iterated itself")


class _Run:
    """What the branches of one pass share. Branch iterators may run in different threads."""

    def __init__(self, source_pipe: Any, num_instances: int) -> None:
        self._source_pipe = source_pipe
        self._source: PipeIterator[Any] | None = None
        # Reentrant: a dropped branch iterator leaves through a finalizer, which the garbage
        # collector may run in a thread that holds the lock already (inside next_for).
        self.lock = threading.RLock()
        self.joined: set[int] = set()
        self._left: set[int] = set()
        self.num_instances = num_instances

    def source(self) -> PipeIterator[Any]:
        if self._source is None:  # made at the first read, as torch does
            self._source = as_nonblocking(self._source_pipe)
        return self._source

    def notifiers(self) -> list[Notifier]:
        return [] if self._source is None else self._source.notifiers()

    def leave(self, instance_id: int) -> None:
        with self.lock:
            self._left.add(instance_id)
            if len(self._left) == self.num_instances and self._source is not None:
                self._source.close()

    def source_ended(self) -> None:
        """Called under ``lock`` when the source says StopIteration: release what it holds
        now, as a run may wait a long time for a branch that has not joined."""
        assert self._source is not None
        self._source.close()

    def finished(self) -> bool:
        """torch's test before a new run: the source has ended and every branch has read to
        the end or closed its iterator (a branch that never started counts as unfinished)."""
        return self.source_done() and len(self._left) == self.num_instances

    def source_done(self) -> bool:
        raise NotImplementedError


class _Branch(IterDataPipe[Any]):
    """One branch of a fork or demux."""

    _parent_fields = ("main_datapipe",)

    def __init__(self, main_datapipe: _SharedSource, instance_id: int) -> None:
        self.main_datapipe = main_datapipe
        self.instance_id = instance_id

    def __iter__(self) -> Iterator[Any]:
        return _BranchIterator(self.main_datapipe.join_run(self.instance_id), self.instance_id)

    def __len__(self) -> int:
        return self.main_datapipe.length_for(self.instance_id)  # type: ignore[attr-defined]


class _BranchIterator(SkipToResume, PipeIterator[Any]):
    """A branch's run. It keeps no checkpoint (the shared run's buffer and the other branches'
    positions are not written down yet), so it says so and refuses any state given to it: the
    loader resumes a graph with a fork or demux by skipping. Without the mixin it took the
    stateless ``{"own": None, "upstream": []}`` and silently read from the start again."""

    def __init__(self, run: Any, instance_id: int) -> None:
        super().__init__()
        self._run = run
        self._id = instance_id
        # A dropped iterator leaves the run as a closed one does (torch's generator does so
        # in its finally block), so that iterating the branch again starts a new run quietly.
        self._leave = weakref.finalize(self, run.leave, instance_id)
        self._leave.atexit = False  # at exit the source's own finalizers release it

    def nonblocking_next(self) -> Any:
        try:
            return self._run.next_for(self._id)
        except StopIteration:
            self.close()
            raise

    def notifiers(self) -> list[Notifier]:
        return self._run.notifiers()

    def close(self) -> None:
        self._leave()  # a finalize runs once


# -- fork --------------------------------------------------------------------------------------


class Forker(IterDataPipe[Any]):
    """``num_instances`` branches that each yield every item of the source (functional name:
    ``fork``).

    Args:
        datapipe: the source pipe.
        num_instances: how many branches (1 returns ``datapipe`` itself).
        buffer_size: how far (in items) the leading branch may run ahead of the slowest one; past
            that, a clear BufferError. -1: no limit.
        copy: None (branches get the same object), ``"shallow"`` or ``"deep"`` copies.

    Returns:
        A list of branch pipes.

    Example:
        >>> images, labels = IterableWrapper([(1, "a"), (2, "b")]).fork(2)
        >>> list(images.map(first).zip(labels.map(second)))
        [(1, 'a'), (2, 'b')]
    """

    def __new__(  # type: ignore[misc]
        cls,
        datapipe: IterDataPipe,
        num_instances: int,
        buffer_size: int = 1000,
        copy: Literal["shallow", "deep"] | None = None,
    ) -> Any:
        _check_instances(num_instances)
        if num_instances == 1:
            return datapipe
        source = _ForkSource(datapipe, num_instances, buffer_size, copy)
        return [_Branch(source, i) for i in range(num_instances)]


_COPIES: dict[Any, Callable[[Any], Any] | None] = {
    None: None, "shallow": copy_module.copy, "deep": copy_module.deepcopy,
}


class _ForkSource(_SharedSource):
    def __init__(self, datapipe: IterDataPipe, num_instances: int, buffer_size: int, copy: Any) -> None:
        if copy not in _COPIES:
            raise ValueError(
                f"Unknown copy method `{copy}` requested, choose one of None, `shallow` or `deep`."
            )
        check_int(buffer_size, "buffer_size")
        _warn_if_unlimited(buffer_size, "fork")
        self.main_datapipe = datapipe
        self.num_instances = num_instances
        self.buffer_size = buffer_size
        self.copy = copy

    def _new_run(self) -> _ForkRun:
        return _ForkRun(self.main_datapipe, self.num_instances, self.buffer_size, _COPIES[self.copy])

    def length_for(self, instance_id: int) -> int:
        return length_of(self.main_datapipe, self)


class _ForkRun(_Run):
    """Items read from the source and not yet read by every branch.

    Invariant (under ``lock``): ``buffer[k]`` is item number ``offset + k``; ``positions[i]`` is
    the number of items branch ``i`` has read; ``offset == min(positions)`` once trimmed.
    """

    def __init__(self, source: Any, num_instances: int, buffer_size: int, copy_fn: Any) -> None:
        super().__init__(source, num_instances)
        self._limit = buffer_size
        self._copy = copy_fn
        self._buffer: deque[Any] = deque()
        self._offset = 0
        self._positions = [0] * num_instances
        self._end: int | None = None

    def next_for(self, instance_id: int) -> Any:
        with self.lock:
            position = self._positions[instance_id]
            if position < self._offset + len(self._buffer):
                value = self._buffer[position - self._offset]
            else:
                if self._end is not None:
                    raise StopIteration
                try:
                    value = self.source().nonblocking_next()
                except StopIteration:
                    self._end = position
                    self.source_ended()
                    raise
                self._buffer.append(value)
                # Checked once an item was read, as torch checks: a source of exactly
                # buffer_size items read branch by branch is within the limit.
                self._check_room(instance_id, position)
            self._positions[instance_id] = position + 1
            self._trim()
        return value if self._copy is None else self._copy(value)

    def _check_room(self, instance_id: int, position: int) -> None:
        if self._limit < 0:
            return
        others = [p for i, p in enumerate(self._positions) if i != instance_id]
        slowest = min(others + [position + 1])
        if position + 1 - slowest > self._limit:
            behind = [i for i, p in enumerate(self._positions) if p == slowest]
            raise BufferError(
                f"ForkerIterDataPipe buffer overflow,buffer size {self._limit} is insufficient. "
                f"Branch {instance_id} is about to read item {position} while branch "
                f"{behind[0]} has read {slowest}: read the branches in step (zip them, for "
                "example), or raise buffer_size (-1: no limit)."
            )

    def _trim(self) -> None:
        slowest = min(self._positions)
        while self._buffer and self._offset < slowest:
            self._buffer.popleft()
            self._offset += 1

    def source_done(self) -> bool:
        return self._end is not None


# -- demux -------------------------------------------------------------------------------------


class Demultiplexer(IterDataPipe[Any]):
    """Split items into ``num_instances`` branches by a classifier (functional name: ``demux``).

    Args:
        datapipe: the source pipe.
        num_instances: how many branches.
        classifier_fn: item -> branch number in ``range(num_instances)``, or None.
        drop_none: skip items classified None (otherwise None is an error).
        buffer_size: items held for branches that are behind, across all branches; past that,
            a clear BufferError. -1: no limit.

    Returns:
        A list of branch pipes.

    Example:
        >>> evens, odds = IterableWrapper(range(5)).demux(2, lambda n: n % 2)
        >>> list(evens), list(odds)
        ([0, 2, 4], [1, 3])
    """

    def __new__(  # type: ignore[misc]
        cls,
        datapipe: IterDataPipe,
        num_instances: int,
        classifier_fn: Callable[[Any], int | None],
        drop_none: bool = False,
        buffer_size: int = 1000,
    ) -> Any:
        _check_instances(num_instances)
        check_function(classifier_fn, "classifier_fn")
        source = _DemuxSource(datapipe, num_instances, classifier_fn, drop_none, buffer_size)
        return [_Branch(source, i) for i in range(num_instances)]


class _DemuxSource(_SharedSource):
    def __init__(
        self, datapipe: IterDataPipe, num_instances: int, classifier_fn: Any, drop_none: bool, buffer_size: int
    ) -> None:
        check_int(buffer_size, "buffer_size")
        _warn_if_unlimited(buffer_size, "demux")
        self.main_datapipe = datapipe
        self.num_instances = num_instances
        self.classifier_fn = classifier_fn
        self.drop_none = drop_none
        self.buffer_size = buffer_size

    def _new_run(self) -> _DemuxRun:
        return _DemuxRun(self)

    def length_for(self, instance_id: int) -> int:
        # torch raises an empty TypeError here; ours says why.
        raise TypeError(f"demux branch {instance_id} has no length: how many items each branch "
                        "gets is known only by classifying the whole source")


class _DemuxRun(_Run):
    """Items read for branches that have not asked for them yet.

    Invariant (under ``lock``): ``buffered == sum(len(b) for b in buffers)``.
    """

    def __init__(self, pipe: _DemuxSource) -> None:
        super().__init__(pipe.main_datapipe, pipe.num_instances)
        self._pipe = pipe
        self._classify = pipe.classifier_fn
        self._drop_none = pipe.drop_none
        self._limit = pipe.buffer_size
        self._buffers: list[deque[Any]] = [deque() for _ in range(pipe.num_instances)]
        self._buffered = 0
        self._source_done = False

    def next_for(self, instance_id: int) -> Any:
        with self.lock:
            if self._buffers[instance_id]:
                self._buffered -= 1
                return self._buffers[instance_id].popleft()
            while True:
                if self._source_done:
                    raise StopIteration
                try:
                    value = self.source().nonblocking_next()
                except StopIteration:
                    self._source_done = True
                    self.source_ended()
                    raise
                try:
                    branch = self._classify(value)
                except Exception as error:
                    raise raised_by_function(error, self._pipe, "classifier_fn")
                if branch is None and self._drop_none:
                    continue
                if branch is None or not 0 <= branch < self.num_instances:
                    raise ValueError(
                        f"Output of the classification fn should be between 0 and "
                        f"{self.num_instances - 1}. {branch} is returned."
                    )
                if branch == instance_id:
                    return value
                self._keep(branch, value)

    def _keep(self, branch: int, value: Any) -> None:
        self._buffers[branch].append(value)
        self._buffered += 1
        if 0 <= self._limit < self._buffered:
            waiting = max(range(self.num_instances), key=lambda i: len(self._buffers[i]))
            raise BufferError(
                f"DemultiplexerIterDataPipe buffer overflow, buffer size {self._limit} is "
                f"insufficient. Branch {waiting} has {len(self._buffers[waiting])} items waiting "
                "to be read: read the branches in step, or raise buffer_size (-1: no limit)."
            )

    def source_done(self) -> bool:
        return self._source_done

# torch's long names, for scripts that import them from torch's submodule of this name: the
# same classes (torch's package exports the short names, as ours does).
DemultiplexerIterDataPipe = Demultiplexer
ForkerIterDataPipe = Forker
