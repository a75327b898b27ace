"""Batching and grouping: batch, unbatch, groupby."""

from __future__ import annotations

from collections import defaultdict, deque
from collections.abc import Callable, Iterator
from typing import Any

from pipeload._state_fields import StateFields
from pipeload.datapipes._functions import check_function, raised_by_function
from pipeload.datapipes.base import IterDataPipe
from pipeload.datapipes.chunk import DataChunk
from pipeload.datapipes.iter._columns import batch_count, check_int, check_positive, length_of, no_length
from pipeload.datapipes.protocol import PipeIterator, SkipToResume
from pipeload.errors import bad_state_field


class Batcher(IterDataPipe[DataChunk]):
    """Group consecutive items into batches (functional name: ``batch``).

    Args:
        datapipe: the source pipe.
        batch_size: items per batch.
        drop_last: drop the last batch if it is short.
        wrapper_class: the list type of each batch (default :class:`DataChunk`).

    Example:
        >>> list(IterableWrapper(range(7)).batch(3))
        [[0, 1, 2], [3, 4, 5], [6]]
    """

    _parent_fields = ("datapipe",)

    def __init__(
        self,
        datapipe: IterDataPipe,
        batch_size: int,
        drop_last: bool = False,
        wrapper_class: type[DataChunk] = DataChunk,
    ) -> None:
        check_positive(batch_size, "batch_size", "Batch size")
        self.datapipe = datapipe
        self.batch_size = batch_size
        self.drop_last = drop_last
        self.wrapper_class = wrapper_class

    def __iter__(self) -> Iterator[DataChunk]:
        return _BatcherIterator(self, self.datapipe)

    def __len__(self) -> int:
        return batch_count(length_of(self.datapipe, self), self.batch_size, self.drop_last)


class _BatcherIterator(PipeIterator[DataChunk]):
    """Keeps the batch being filled across NotAvailable, so no item is lost or repeated."""

    def __init__(self, pipe: Batcher, source: Any) -> None:
        super().__init__(source)
        (self._source,) = self.upstream
        self._size = pipe.batch_size
        self._drop_last = pipe.drop_last
        self._wrap = pipe.wrapper_class
        self._filling: list[Any] = []

    def nonblocking_next(self) -> DataChunk:
        filling = self._filling
        while len(filling) < self._size:
            try:
                filling.append(self._source.nonblocking_next())
            except StopIteration:
                if not filling or self._drop_last:
                    raise
                break
        self._filling = []
        return self._wrap(filling)

    def _own_state(self) -> Any:
        return list(self._filling)

    def _settings(self) -> dict[str, Any]:
        return {"batch_size": self._size, "drop_last": self._drop_last}

    def _check_own_state(self, fields: StateFields) -> Any:
        # a full batch is handed out at once: the one being filled is always short of it
        expected = f"a list of fewer than {self._size} items (the batch being filled)"
        filling = fields.sequence("own", expected)
        if len(filling) >= self._size:  # type: ignore[arg-type]
            raise bad_state_field(fields.name("own"), filling, expected)
        return list(filling)  # type: ignore[arg-type]

    def _load_own_state(self, state: Any) -> None:
        self._filling = list(state)


class UnBatcher(IterDataPipe[Any]):
    """Flatten batches (lists) back into items (functional name: ``unbatch``).

    Args:
        datapipe: the source pipe of batches.
        unbatch_level: how many list levels to flatten; -1 flattens every level.

    Example:
        >>> list(IterableWrapper([[[0, 1], [2]], [[3]]]).unbatch(unbatch_level=2))
        [0, 1, 2, 3]
    """

    _parent_fields = ("datapipe",)

    def __init__(self, datapipe: IterDataPipe, unbatch_level: int = 1) -> None:
        check_int(unbatch_level, "unbatch_level")
        if unbatch_level < -1:
            raise ValueError(f"unbatch_level must be -1 or >= 0 (got unbatch_level={unbatch_level!r})")
        self.datapipe = datapipe
        self.unbatch_level = unbatch_level

    def __iter__(self) -> Iterator[Any]:
        return _UnBatcherIterator(self.unbatch_level, self.datapipe)


class _UnBatcherIterator(PipeIterator[Any]):
    def __init__(self, level: int, source: Any) -> None:
        super().__init__(source)
        (self._source,) = self.upstream
        self._level = level
        self._pending: deque[Any] = deque()

    def nonblocking_next(self) -> Any:
        while not self._pending:
            self._pending.extend(_dive(self._source.nonblocking_next(), self._level, self._level))
        return self._pending.popleft()

    def _own_state(self) -> Any:
        return list(self._pending)  # the rest of the batch being unbatched

    def _check_own_state(self, fields: StateFields) -> Any:
        return fields.sequence("own", "a list (the rest of the batch being unbatched)")

    def _load_own_state(self, state: Any) -> None:
        self._pending = deque(state)


def _dive(element: Any, level: int, asked: int) -> Iterator[Any]:
    if level == 0:
        yield element
    elif isinstance(element, list):  # DataChunk is a list
        for item in element:
            yield from _dive(item, level - 1 if level > 0 else -1, asked)
    elif level == -1:
        yield element
    else:
        raise IndexError(
            f"unbatch_level {asked} exceeds the depth of the DataPipe (found {type(element).__name__} "
            f"{element!r} where a list was expected)"
        )


class Grouper(IterDataPipe[DataChunk]):
    """Group items by a key into batches (functional name: ``groupby``).

    Items are read in order into a buffer, one list per key. A key's list is yielded as soon as
    it holds ``group_size`` items; when the buffer is full, the largest list is yielded (or
    dropped, with ``drop_remaining``, if it is below ``guaranteed_group_size``). At the end every
    remaining list is yielded.

    Args:
        datapipe: the source pipe.
        group_key_fn: item -> key.
        keep_key: yield ``(key, batch)`` instead of ``batch``.
        buffer_size: items held across all keys.
        group_size: yield a key's list once it is this long.
        guaranteed_group_size: the smallest list yielded when the buffer is full.
        drop_remaining: drop (instead of failing on) a list below that size when the buffer is full.

    Example:
        >>> list(IterableWrapper(["a.png", "b.png", "a.json"]).groupby(lambda f: f[0]))
        [['a.png', 'a.json'], ['b.png']]
    """

    _parent_fields = ("datapipe",)

    def __init__(
        self,
        datapipe: IterDataPipe,
        group_key_fn: Callable[[Any], Any],
        *,
        keep_key: bool = False,
        buffer_size: int = 10000,
        group_size: int | None = None,
        guaranteed_group_size: int | None = None,
        drop_remaining: bool = False,
    ) -> None:
        check_function(group_key_fn, "group_key_fn")
        for name, value in (("buffer_size", buffer_size), ("group_size", group_size),
                            ("guaranteed_group_size", guaranteed_group_size)):
            if value is not None:
                check_int(value, name)
        self.datapipe = datapipe
        self.group_key_fn = group_key_fn
        self.keep_key = keep_key
        self.max_buffer_size = buffer_size
        self.group_size = group_size
        self.guaranteed_group_size = None
        if group_size is not None and buffer_size is not None:
            if not 0 < group_size <= buffer_size:
                raise AssertionError(
                    f"group_size must be > 0 and <= buffer_size (got group_size={group_size!r}, "
                    f"buffer_size={buffer_size!r})"
                )
            self.guaranteed_group_size = group_size
        if guaranteed_group_size is not None:
            if group_size is None or not 0 < guaranteed_group_size <= group_size:
                raise AssertionError(
                    "guaranteed_group_size must be > 0 and <= group_size and group_size must be set "
                    f"(got guaranteed_group_size={guaranteed_group_size!r}, group_size={group_size!r})"
                )
            self.guaranteed_group_size = guaranteed_group_size
        self.drop_remaining = drop_remaining
        self.wrapper_class = DataChunk

    def __iter__(self) -> Iterator[Any]:
        return _GrouperIterator(self, self.datapipe)

    def __len__(self) -> int:
        raise no_length(self)


class _GrouperIterator(SkipToResume, PipeIterator[Any]):
    def __init__(self, pipe: Grouper, source: Any) -> None:
        super().__init__(source)
        (self._source,) = self.upstream
        self._pipe = pipe
        self._groups: defaultdict[Any, list[Any]] = defaultdict(list)
        self._buffered = 0
        self._ready: deque[Any] = deque()
        self._source_done = False

    def nonblocking_next(self) -> Any:
        while not self._ready:
            if self._source_done:
                if not self._groups:
                    raise StopIteration
                key = next(iter(self._groups))
                self._emit(key, self._groups.pop(key))
                continue
            try:
                item = self._source.nonblocking_next()
            except StopIteration:
                self._source_done = True
                continue
            self._add(item)
        return self._ready.popleft()

    def _add(self, item: Any) -> None:
        pipe = self._pipe
        try:
            key = pipe.group_key_fn(item)
        except Exception as error:
            raise raised_by_function(error, pipe, "group_key_fn")
        group = self._groups[key]
        group.append(item)
        self._buffered += 1
        if pipe.group_size is not None and len(group) == pipe.group_size:
            self._buffered -= len(group)
            self._emit(key, self._groups.pop(key))
        if self._buffered == pipe.max_buffer_size:
            evicted = self._evict_largest()
            if evicted is not None:
                # torch pairs an evicted group with the key of the item just read, not the
                # group's own key; kept so that keep_key=True output matches torch's.
                self._emit(key, evicted)

    def _evict_largest(self) -> list[Any] | None:
        pipe = self._pipe
        largest_key, largest = None, 0
        for key, group in self._groups.items():
            if len(group) > largest:
                largest_key, largest = key, len(group)
        guaranteed = pipe.guaranteed_group_size
        if guaranteed is not None and largest < guaranteed and not pipe.drop_remaining:
            raise RuntimeError("Failed to group items", str(self._groups[largest_key]))
        group = self._groups.pop(largest_key)
        self._buffered -= largest
        return group if guaranteed is None or largest >= guaranteed else None

    def _emit(self, key: Any, group: list[Any]) -> None:
        batch = self._pipe.wrapper_class(group)
        self._ready.append((key, batch) if self._pipe.keep_key else batch)

# torch's long names, for scripts that import them from torch's submodule of this name: the
# same classes (torch's package exports the short names, as ours does).
BatcherIterDataPipe = Batcher
GrouperIterDataPipe = Grouper
UnBatcherIterDataPipe = UnBatcher
