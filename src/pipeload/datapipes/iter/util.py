"""Length and repetition: cycle, header, enumerate, in_memory_cache."""

from __future__ import annotations

import math
import numbers
import operator
import sys
from collections import deque
from collections.abc import Iterator
from typing import Any, TypeVar

import numpy as np
import torch

from pipeload._state_fields import StateFields, join
from pipeload.datapipes.base import IterDataPipe
from pipeload.datapipes.iter._columns import check_int, length_of
from pipeload.datapipes.protocol import PipeIterator, SkipToResume, StateLoad, as_nonblocking
from pipeload.errors import bad_state_field

T_co = TypeVar("T_co", covariant=True)
MEGABYTE = 1024 * 1024


class Cycler(IterDataPipe[T_co]):
    """Repeat the source ``count`` times, or for ever (functional name: ``cycle``).

    Args:
        source_datapipe: the pipe to repeat (iterated afresh each time round).
        count: how many times; None repeats until the consumer stops. An empty source ends the
            cycle rather than spin.

    Example:
        >>> list(IterableWrapper(range(2)).cycle(3))
        [0, 1, 0, 1, 0, 1]
    """

    _parent_fields = ("source_datapipe",)

    def __init__(self, source_datapipe: IterDataPipe, count: int | None = None) -> None:
        if count is not None:
            check_int(count, "count")
            if count < 0:
                raise ValueError(f"Expected non-negative count, got {count}")
        self.source_datapipe = source_datapipe
        self.count = count

    def __iter__(self) -> Iterator[T_co]:
        return _CyclerIterator(self.source_datapipe, self.count)

    def __len__(self) -> int:
        if self.count is None:
            raise TypeError(
                f"This {type(self).__name__} instance cycles forever, and therefore doesn't have valid length"
            )
        return self.count * length_of(self.source_datapipe, self)


class _CyclerIterator(PipeIterator[Any]):
    def __init__(self, source_pipe: Any, count: int | None) -> None:
        super().__init__()
        self._source_pipe = source_pipe
        self._count = count
        self._rounds_done = 0
        self._yielded_this_round = 0

    def nonblocking_next(self) -> Any:
        while self._count is None or self._rounds_done < self._count:
            if not self.upstream:
                self.upstream = (as_nonblocking(self._source_pipe),)
            try:
                item = self.upstream[0].nonblocking_next()
            except StopIteration:
                empty_round = self._yielded_this_round == 0
                self.upstream[0].close()
                self.upstream = ()
                self._rounds_done += 1
                self._yielded_this_round = 0
                if empty_round:
                    break  # nothing to repeat: stop instead of spinning for ever
                continue
            self._yielded_this_round += 1
            return item
        raise StopIteration

    def state_dict(self) -> dict[str, Any]:
        upstream = [source.state_dict() for source in self.upstream]
        return {"own": [self._rounds_done, self._yielded_this_round], "upstream": upstream}

    def check_state(self, state: Any, path: str, load: StateLoad) -> None:
        fields = StateFields(state, path)
        own = fields.listed("own", "[rounds done, items of this round handed out]", length=2)
        assert own is not None
        rounds, taken = own.integer(0, 0, self._count), own.integer(1)
        upstream = fields.sequence("upstream", "a list of at most one state (the round's)")
        if len(upstream) > 1:  # type: ignore[arg-type]
            raise bad_state_field(fields.name("upstream"), upstream, "a list of at most one state")
        fields.finish()
        source = None
        if upstream:
            source = as_nonblocking(self._source_pipe)
            load.made(source)
            source.check_state(upstream[0], join(fields.name("upstream"), 0), load)  # type: ignore[index]

        def apply() -> None:
            self._rounds_done, self._yielded_this_round = rounds, taken
            if source is not None:
                self.upstream = (source,)
        load.then(apply)


class Header(IterDataPipe[T_co]):
    """Yield at most the first ``limit`` items (functional name: ``header``).

    Args:
        source_datapipe: the source pipe.
        limit: how many items; None yields them all.

    Example:
        >>> list(IterableWrapper(range(10)).header(3))
        [0, 1, 2]
    """

    _parent_fields = ("source_datapipe",)

    def __init__(self, source_datapipe: IterDataPipe, limit: int | None = 10) -> None:
        if limit is not None:
            check_int(limit, "limit")
            if limit < 0:
                raise ValueError(f"limit should be None (no limit) or at least 0, but got limit={limit!r}")
        self.source_datapipe = source_datapipe
        self.limit = limit

    def __iter__(self) -> Iterator[T_co]:
        return _HeaderIterator(self.source_datapipe, self.limit)

    def __len__(self) -> int:
        try:
            length = len(self.source_datapipe)  # type: ignore[arg-type]
        except TypeError as error:
            if self.limit is None:
                raise TypeError(f"The length of this {type(self).__name__} cannot be determined.") from error
            return self.limit
        return length if self.limit is None else min(length, self.limit)


class _HeaderIterator(PipeIterator[Any]):
    def __init__(self, source: Any, limit: int | None) -> None:
        super().__init__(source)
        (self._source,) = self.upstream
        limit = None if limit is None else operator.index(limit)  # never counts the caller's tensor down
        self._left = limit  # None: no limit
        self._limit = limit

    def nonblocking_next(self) -> Any:
        if self._left is not None:
            if self._left <= 0:
                raise StopIteration  # the source is not read past the limit
            item = self._source.nonblocking_next()
            self._left -= 1
            if self._left == 0:
                self._source.close()  # release a boundary or prefetcher upstream now
            return item
        return self._source.nonblocking_next()

    def _own_state(self) -> Any:
        return self._left

    def _settings(self) -> dict[str, Any]:
        return {"limit": self._limit}

    def _check_own_state(self, fields: StateFields) -> Any:
        if self._left is None:
            return fields.choice("own", [None])  # no limit: nothing to count
        return fields.integer("own", 0, self._left)  # items left before the limit

    def _load_own_state(self, state: Any) -> None:
        self._left = state


class Enumerator(IterDataPipe[tuple[int, Any]]):
    """Yield ``(index, item)`` pairs (functional name: ``enumerate``).

    Args:
        source_datapipe: the pipe to number.
        starting_index: the first item's index.

    Example:
        >>> list(IterableWrapper("ab").enumerate(starting_index=1))
        [(1, 'a'), (2, 'b')]
    """

    _parent_fields = ("source_datapipe",)

    def __init__(self, source_datapipe: IterDataPipe, starting_index: int = 0) -> None:
        check_int(starting_index, "starting_index")
        self.source_datapipe = source_datapipe
        self.starting_index = starting_index

    def __iter__(self) -> Iterator[tuple[int, Any]]:
        return _EnumeratorIterator(self.source_datapipe, self.starting_index)

    def __len__(self) -> int:
        return length_of(self.source_datapipe, self)


class _EnumeratorIterator(PipeIterator[tuple[int, Any]]):
    def __init__(self, source: Any, start: int) -> None:
        super().__init__(source)
        (self._source,) = self.upstream
        # As Python's enumerate takes it: a numpy or 0-d tensor integer becomes an int, so
        # counting never changes the caller's object (a tensor counted in place was every index).
        self._index = self._start = operator.index(start)

    def nonblocking_next(self) -> tuple[int, Any]:
        item = self._source.nonblocking_next()
        index = self._index
        self._index += 1
        return index, item

    def _own_state(self) -> Any:
        return self._index

    def _settings(self) -> dict[str, Any]:
        return {"starting_index": self._start}

    def _check_own_state(self, fields: StateFields) -> Any:
        return fields.integer("own", self._index)  # the next index: never below the first

    def _load_own_state(self, state: Any) -> None:
        self._index = state


class InMemoryCacheHolder(IterDataPipe[T_co]):
    """Keep the items of the first complete pass and replay them afterwards (functional name:
    ``in_memory_cache``).

    The cache belongs to this process's copy of the pipe (each DataLoader worker keeps its own;
    with ``persistent_workers`` it lasts across epochs). With ``size``, only the last items
    that fit are kept; later passes read the rest from the source again.

    Args:
        source_dp: the source pipe.
        size: the cache budget in megabytes (None: no limit). Tensor and array sizes are their
            bytes; other items count as ``sys.getsizeof`` says.

    Example:
        >>> dp = IterableWrapper(range(3)).map(expensive).in_memory_cache()
        >>> list(dp) == list(dp)  # the second pass calls expensive() no more
        True
    """

    _parent_fields = ("source_dp",)

    def __init__(self, source_dp: IterDataPipe, size: int | None = None) -> None:
        if size is not None and (isinstance(size, bool) or not isinstance(size, numbers.Real)):
            raise TypeError(f"size should be None or a number of megabytes, but got size={size!r} "
                            f"({type(size).__name__})")
        if size is not None and not 0 < size < math.inf:
            raise ValueError(f"size should be None or a positive number of megabytes, but got size={size!r}")
        self.source_dp = source_dp
        self.size = None if size is None else size * MEGABYTE

    def __iter__(self) -> Iterator[T_co]:
        cached = self.__dict__.get("_transient_cache")
        if cached is not None:
            return _ReplayIterator(self.source_dp, *cached)
        return _CachingIterator(self)

    def __len__(self) -> int:
        return length_of(self.source_dp, self)


def _size_of(item: Any) -> int:
    if isinstance(item, torch.Tensor):
        return item.element_size() * item.nelement()
    if isinstance(item, np.ndarray):
        return int(item.nbytes)
    return sys.getsizeof(item)


class _CachingIterator(SkipToResume, PipeIterator[Any]):
    def __init__(self, pipe: InMemoryCacheHolder[Any]) -> None:
        super().__init__(pipe.source_dp)
        (self._source,) = self.upstream
        self._pipe = pipe
        self._cache: deque[Any] = deque()
        self._cached_bytes = 0
        self._dropped = 0  # items at the head that did not fit

    def nonblocking_next(self) -> Any:
        try:
            item = self._source.nonblocking_next()
        except StopIteration:
            self._pipe._transient_cache = (tuple(self._cache), self._dropped)
            raise
        self._cache.append(item)
        self._cached_bytes += _size_of(item)
        budget = self._pipe.size
        while budget is not None and self._cache and self._cached_bytes > budget:
            self._cached_bytes -= _size_of(self._cache.popleft())
            self._dropped += 1
        return item


class _ReplayIterator(SkipToResume, PipeIterator[Any]):
    """The items that did not fit come from the source again, then the cached tail."""

    def __init__(self, source_pipe: Any, cached: tuple[Any, ...], dropped: int) -> None:
        super().__init__(*([source_pipe] if dropped else []))
        self._from_source = dropped
        self._cached = iter(cached)

    def nonblocking_next(self) -> Any:
        if self._from_source:
            item = self.upstream[0].nonblocking_next()
            self._from_source -= 1
            if not self._from_source:
                self.upstream[0].close()
                self.upstream = ()
            return item
        return next(self._cached)
