"""map on map-style pipes."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, TypeVar

from pipeload.datapipes._functions import check_function, raised_by_function
from pipeload.datapipes._map_ops import default_fn
from pipeload.datapipes.base import MapDataPipe, get_nowait

T_co = TypeVar("T_co", covariant=True)


class Mapper(MapDataPipe[T_co]):
    """Apply a function to the item read at each key (functional name: ``map``).

    Args:
        datapipe: the map-style pipe.
        fn: the function (the identity by default).

    Example:
        >>> SequenceWrapper(range(10)).map(lambda x: x * 2)[3]
        6
    """

    _parent_fields = ("datapipe",)

    def __init__(self, datapipe: MapDataPipe, fn: Callable[[Any], Any] = default_fn) -> None:
        check_function(fn, "fn")
        self.datapipe = datapipe
        self.fn = fn

    def __getitem__(self, index: Any) -> T_co:
        return self._apply(self.datapipe[index])

    def nonblocking_get(self, index: Any) -> T_co:
        return self._apply(get_nowait(self.datapipe, index))

    def _apply(self, item: Any) -> T_co:
        try:
            return self.fn(item)
        except Exception as error:
            raise raised_by_function(error, self, "fn")

    def __len__(self) -> int:
        return len(self.datapipe)  # type: ignore[arg-type]

# torch's long names, for scripts that import them from torch's submodule of this name: the
# same classes (torch's package exports the short names, as ours does).
MapperMapDataPipe = Mapper
