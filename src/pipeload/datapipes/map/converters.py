"""From map-style to iterable-style."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

from pipeload._state_fields import StateFields
from pipeload.datapipes.base import IterDataPipe, MapDataPipe, get_nowait, is_map_datapipe
from pipeload.datapipes.protocol import PipeIterator


class MapToIterConverter(IterDataPipe[Any]):
    """An iterable pipe reading a map-style pipe at ``indices`` in order (functional name:
    ``to_iter_datapipe``). torchdata's operation.

    Args:
        datapipe: the map-style pipe.
        indices: the keys to read (default ``range(len(datapipe))``).

    Example:
        >>> list(SequenceWrapper("abc").to_iter_datapipe())
        ['a', 'b', 'c']
    """

    _parent_fields = ("datapipe",)

    def __init__(self, datapipe: MapDataPipe, indices: list[Any] | None = None) -> None:
        if not is_map_datapipe(datapipe):
            raise TypeError(f"MapToIterConverter can only apply on MapDataPipe, but found {type(datapipe)}")
        self.datapipe = datapipe
        self.indices = indices

    def _keys(self) -> Any:
        return range(len(self.datapipe)) if self.indices is None else self.indices  # type: ignore[arg-type]

    def __iter__(self) -> Iterator[Any]:
        return _KeysIterator(self.datapipe, self._keys())

    def __len__(self) -> int:
        return len(self._keys())


class _KeysIterator(PipeIterator[Any]):
    def __init__(self, datapipe: Any, keys: Any) -> None:
        super().__init__()
        self._datapipe = datapipe
        self._keys = keys
        self._next_position = 0

    def nonblocking_next(self) -> Any:
        if self._next_position >= len(self._keys):
            raise StopIteration
        item = get_nowait(self._datapipe, self._keys[self._next_position])
        self._next_position += 1
        return item

    def _own_state(self) -> Any:
        return self._next_position

    def _check_own_state(self, fields: StateFields) -> Any:
        return fields.integer("own", 0, len(self._keys))

    def _load_own_state(self, state: Any) -> None:
        self._next_position = state
