"""concat and zip on map-style pipes."""

from __future__ import annotations

import operator
from collections.abc import Callable, Sized
from typing import Any

from pipeload.datapipes.base import AskEveryOne, MapDataPipe, get_nowait, is_map_datapipe


def _check_inputs(datapipes: tuple[Any, ...]) -> None:
    if not datapipes:
        raise ValueError("Expected at least one DataPipe, but got nothing")
    refused = [dp for dp in datapipes if not is_map_datapipe(dp)]
    if refused:
        raise TypeError(
            f"Expected all inputs to be `MapDataPipe` (got {', '.join(type(dp).__name__ for dp in refused)})"
        )
    unsized = [dp for dp in datapipes if not isinstance(dp, Sized)]
    if unsized:
        raise TypeError(f"Expected all inputs to be `Sized` (got {', '.join(map(repr, unsized))})")


class Concater(MapDataPipe[Any]):
    """Keys ``0..len(a)-1`` read ``a``, the next ``len(b)`` keys read ``b``, ... (functional name:
    ``concat``).

    Args:
        *datapipes: the map-style pipes, in order (sized; at least one).

    Example:
        >>> SequenceWrapper("ab").concat(SequenceWrapper("cd"))[2]
        'c'
    """

    _parent_fields = ("datapipes",)

    def __init__(self, *datapipes: MapDataPipe) -> None:
        _check_inputs(datapipes)
        self.datapipes = datapipes

    def __getitem__(self, index: Any) -> Any:
        return self._read(index, operator.getitem)

    def nonblocking_get(self, index: Any) -> Any:
        return self._read(index, get_nowait)

    def _read(self, index: Any, read: Callable[[Any, Any], Any]) -> Any:
        offset = 0
        for dp in self.datapipes:
            if index - offset < len(dp):  # type: ignore[arg-type]
                return read(dp, index - offset)
            offset += len(dp)  # type: ignore[arg-type]
        raise IndexError(f"Index {index} is out of range.")

    def __len__(self) -> int:
        return sum(len(dp) for dp in self.datapipes)  # type: ignore[arg-type]


class Zipper(MapDataPipe[tuple[Any, ...]]):
    """Key ``i`` reads a tuple of every pipe's item ``i``; as long as the shortest (functional
    name: ``zip``).

    Args:
        *datapipes: the map-style pipes (sized; at least one).

    Example:
        >>> SequenceWrapper("ab").zip(SequenceWrapper([1, 2]))[1]
        ('b', 2)
    """

    _parent_fields = ("datapipes",)

    def __init__(self, *datapipes: MapDataPipe) -> None:
        _check_inputs(datapipes)
        self.datapipes = datapipes

    def __getitem__(self, index: Any) -> tuple[Any, ...]:
        return self._read(index, operator.getitem)

    def nonblocking_get(self, index: Any) -> tuple[Any, ...]:
        ask = AskEveryOne()
        items = self._read(index, ask)
        ask.check()
        return items

    def _read(self, index: Any, read: Callable[[Any, Any], Any]) -> tuple[Any, ...]:
        items = []
        for dp in self.datapipes:
            try:
                items.append(read(dp, index))
            except IndexError as error:
                raise IndexError(f"Index {index} is out of range for one of the input MapDataPipes {dp}.") from error
        return tuple(items)

    def __len__(self) -> int:
        return min(len(dp) for dp in self.datapipes)  # type: ignore[arg-type]

# torch's long names, for scripts that import them from torch's submodule of this name: the
# same classes (torch's package exports the short names, as ours does).
ConcaterMapDataPipe = Concater
ZipperMapDataPipe = Zipper
