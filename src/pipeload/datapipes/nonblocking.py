"""Pipes written with the RFC's non-blocking calls alone: ``nonblocking_next()`` for iterable
pipes, ``nonblocking_get(index)`` for map-style ones.

Such a pipe answers at once: an item, or :class:`~pipeload.datapipes.NotAvailable` when its
data is not ready yet (a request in flight, a remote read). The base classes here give it the
rest of a pipe: ``__next__`` and ``__getitem__`` wait on top of the non-blocking call, without
spinning, so it chains, crosses boundaries, runs in DataLoader workers and is sharded and seeded
like any other pipe. :func:`EnsureNonBlockingNextDataPipe` gives any iterable pipe the call.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any, TypeVar

from pipeload.datapipes.base import IterDataPipe, MapDataPipe, is_iter_datapipe
from pipeload.datapipes.iter._columns import length_of
from pipeload.datapipes.protocol import RUN_OF, Notifier, as_nonblocking, wait_until_ready
from torch.utils.data import IterableDataset  # ours and torch's plain iterable datasets alike

T_co = TypeVar("T_co", covariant=True)


class NonBlockingIterDataPipe(IterDataPipe[T_co]):
    """An iterable pipe whose subclass writes only ``nonblocking_next()`` (the RFC's base).

    The pipe is its own iterator, as in the RFC: its run state lives on the pipe, and
    ``next(pipe)`` and ``pipe.nonblocking_next()`` read it. ``next()`` asks
    ``nonblocking_next()`` until it answers, sleeping between tries on the notifiers of the pipes
    it reads from (so a waiting consumer wakes as soon as an upstream queue delivers) or, with
    none, backing off from a short poll. ``iter(pipe)`` starts again: the runs its parents keep
    for their ``nonblocking_next()`` are started afresh (so a second epoch reads them from the
    top), then :meth:`reset` is called, which does nothing unless the subclass says how to start
    again. What ``iter(pipe)`` returns reads the pipe's run and is an iterator as Python's are:
    ``iter()`` on it again goes on where it stands (``first = next(it)`` then ``for x in it``
    does not see ``first`` twice), as torch's pipes that are their own iterators do.

    Optional extras a subclass may define: ``reset()`` (start again: called by ``iter()``),
    ``notifiers()`` (what to sleep on), ``close()`` (release what a run holds; by default the
    runs of the pipes it read through their ``nonblocking_next()``), and ``state_dict()`` /
    ``load_state_dict()`` (checkpoints; without them the DataLoader resumes by skipping).

    Example (the RFC's prefetcher, reading ahead from any pipe):
        >>> class Prefetcher(NonBlockingIterDataPipe):
        ...     def __init__(self, source_dp, buffer_size=10):
        ...         self.source_dp, self.buffer_size = source_dp, buffer_size
        ...         self.reset()
        ...     def reset(self):  # iter() starts again: without it an epoch after the first
        ...         self.buffer, self.depleted = [], False  # is empty, or repeats a buffer
        ...     def nonblocking_next(self):
        ...         while not self.depleted and len(self.buffer) < self.buffer_size:
        ...             try:
        ...                 self.buffer.append(self.source_dp.nonblocking_next())
        ...             except NotAvailable:
        ...                 break
        ...             except StopIteration:
        ...                 self.depleted = True
        ...         if self.buffer:
        ...             return self.buffer.pop(0)
        ...         raise StopIteration if self.depleted else NotAvailable
        >>> list(Prefetcher(IterableWrapper(range(5)).map(str)))
        ['0', '1', '2', '3', '4']
    """

    _iter_calls_reset = True

    def __iter__(self) -> Iterator[T_co]:
        self._restart_parents()
        self.reset()
        return _OwnRun(self)

    def _restart_parents(self) -> None:
        """Have the parents this pipe reads through ``nonblocking_next()`` start from the top
        as well, as a blocking pipe's new ``iter()`` would read them: else their runs stay
        ended, and every epoch after the first is silently empty. Before ``reset()``, which
        may read from them."""
        for parent in self.parents():
            if isinstance(parent, NonBlockingIterDataPipe):
                iter(parent)  # its own parents, then its reset()
            elif isinstance(parent, IterDataPipe):
                IterDataPipe.reset(parent)  # the run its nonblocking_next() reads, even when
                # the class has a reset() of its own (torch's per-run hook)

    def __next__(self) -> T_co:
        return wait_until_ready(self.nonblocking_next, self.notifiers())

    def nonblocking_next(self) -> T_co:
        """The next item now; raises NotAvailable if none is ready, StopIteration at the end."""
        raise NotImplementedError(f"{type(self).__name__} must implement nonblocking_next()")

    def reset(self) -> None:
        """Start again (called by ``iter()``): nothing to do unless the subclass keeps state to
        clear."""

    def notifiers(self) -> list[Notifier]:
        """What a waiting ``next()`` sleeps on: the notifiers of the runs this pipe's parents
        started for their own ``nonblocking_next()``."""
        found: list[Notifier] = []
        for parent in self.parents():
            run = getattr(parent, "__dict__", {}).get("_transient_own_run")
            source = run if run is not None else parent
            notifiers = getattr(source, "notifiers", None)
            if callable(notifiers):
                found.extend(notifiers())
        return found

    def close(self) -> None:
        """Release the runs this pipe's parents started for their ``nonblocking_next()``."""
        for parent in self.parents():
            reset = getattr(parent, "reset", None)
            if isinstance(parent, IterDataPipe) and callable(reset):
                reset()


class _OwnRun(Iterator[T_co]):
    """What ``iter()`` gives for a :class:`NonBlockingIterDataPipe`: its run, read through the
    pipe, as an iterator whose own ``iter()`` starts nothing. Anything else asked of it
    (``reset``, ``notifiers``, ``state_dict``, attributes) is the pipe's."""

    __slots__ = (RUN_OF,)

    def __init__(self, pipe: NonBlockingIterDataPipe[T_co]) -> None:
        setattr(self, RUN_OF, pipe)

    def __iter__(self) -> _OwnRun[T_co]:
        return self

    def __next__(self) -> T_co:
        return next(getattr(self, RUN_OF))

    def nonblocking_next(self) -> T_co:
        return getattr(self, RUN_OF).nonblocking_next()

    def __getattr__(self, name: str) -> Any:
        # Not for its own slot, nor for what copy and pickle ask of an object made without
        # __init__ (the slot unset): asking the pipe for those recursed for ever.
        if name == RUN_OF or name.startswith("__"):
            raise AttributeError(name)
        return getattr(getattr(self, RUN_OF), name)

    def __len__(self) -> int:
        return len(getattr(self, RUN_OF))

    def __reduce__(self) -> tuple[Any, ...]:
        return _OwnRun, (getattr(self, RUN_OF),)  # the pipe, its run with it

    def __repr__(self) -> str:
        return f"<the run of {getattr(self, RUN_OF)!r}>"


class NonBlockingMapDataPipe(MapDataPipe[T_co]):
    """A map-style pipe whose subclass writes only ``nonblocking_get(index)`` and ``__len__``.

    ``pipe[index]`` asks ``nonblocking_get(index)`` until it answers, sleeping on
    :meth:`notifiers` between tries (backing off from a short poll when there are none). Built-in
    map pipes over it (``map``, ``batch``, ``zip``, ``concat``) pass NotAvailable on from their
    own ``nonblocking_get``, and iterating them (``shuffle``, ``to_iter_datapipe``) keeps its
    place across it.

    Example:
        >>> class Fetched(NonBlockingMapDataPipe):
        ...     def __init__(self, client, keys):
        ...         self.client, self.keys = client, keys
        ...     def nonblocking_get(self, index):
        ...         return self.client.poll(self.keys[index])  # NotAvailable while in flight
        ...     def __len__(self):
        ...         return len(self.keys)
    """

    def __getitem__(self, index: Any) -> T_co:
        return wait_until_ready(lambda: self.nonblocking_get(index), self.notifiers())

    def nonblocking_get(self, index: Any) -> T_co:
        """The item at ``index`` now; raises NotAvailable if it is not ready yet."""
        raise NotImplementedError(f"{type(self).__name__} must implement nonblocking_get(index)")

    def notifiers(self) -> list[Notifier]:
        """What a waiting ``pipe[index]`` sleeps on (none: it polls, backing off)."""
        return []


class _NonBlockingView(IterDataPipe[T_co]):
    """Any iterable pipe or iterable dataset, as one of ours: with ``nonblocking_next()``."""

    _parent_fields = ("datapipe",)

    def __init__(self, datapipe: Any) -> None:
        self.datapipe = datapipe

    def __iter__(self) -> Iterator[T_co]:
        return as_nonblocking(self.datapipe)

    def __len__(self) -> int:
        return length_of(self.datapipe, self)

    def __repr__(self) -> str:
        return f"EnsureNonBlockingNextDataPipe({self.datapipe!r})"


def EnsureNonBlockingNextDataPipe(validated_datapipe: Any) -> IterDataPipe[Any]:  # noqa: N802  (the RFC's name)
    """An iterable pipe with ``nonblocking_next()``: ``validated_datapipe`` itself when it has it
    (every pipeload pipe does), else a thin pipe of ours over it (torch's pipes, a plain
    ``IterableDataset``), which the graph functions see through.

    Args:
        validated_datapipe: an iterable-style pipe or dataset.

    Raises:
        TypeError: it is not iterable-style (a map-style pipe has ``nonblocking_get(index)``).

    Example:
        >>> dp = EnsureNonBlockingNextDataPipe(torch.utils.data.datapipes.iter.IterableWrapper([1, 2]))
        >>> dp.nonblocking_next()
        1
    """
    if isinstance(validated_datapipe, IterDataPipe):
        return validated_datapipe
    if is_iter_datapipe(validated_datapipe) or isinstance(validated_datapipe, IterableDataset):
        return _NonBlockingView(validated_datapipe)
    raise TypeError(
        "EnsureNonBlockingNextDataPipe expects an iterable-style DataPipe or IterableDataset, but "
        f"got validated_datapipe={validated_datapipe!r} ({type(validated_datapipe).__name__}); a "
        "map-style pipe reads without blocking through nonblocking_get(index)"
    )
