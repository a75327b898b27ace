"""The built-in operations of map-style pipes, as real methods (see ``_iter_ops.py`` for why)."""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from pipeload.datapipes.chunk import DataChunk

if TYPE_CHECKING:
    from pipeload.datapipes.base import MapDataPipe
    from pipeload.datapipes.map.callable import Mapper
    from pipeload.datapipes.map.combinatorics import Shuffler
    from pipeload.datapipes.map.combining import Concater, Zipper
    from pipeload.datapipes.map.converters import MapToIterConverter
    from pipeload.datapipes.map.grouping import Batcher


def default_fn(data: Any) -> Any:
    """The identity, by name, so a default Mapper stays picklable."""
    return data


class MapOperations:
    """Chainable operations; see each class in ``pipeload.datapipes.map`` for the details."""

    def map(self, fn: Callable[[Any], Any] = default_fn) -> Mapper:
        """Apply ``fn`` to the item read at each key; see :class:`Mapper`."""
        from pipeload.datapipes.map.callable import Mapper

        return Mapper(self, fn)  # type: ignore[arg-type]

    def batch(
        self, batch_size: int, drop_last: bool = False, wrapper_class: type[DataChunk] = DataChunk
    ) -> Batcher:
        """Key ``i`` reads the items ``i*batch_size ...``; see :class:`Batcher`."""
        from pipeload.datapipes.map.grouping import Batcher

        return Batcher(self, batch_size, drop_last, wrapper_class)  # type: ignore[arg-type]

    def shuffle(self, *, indices: list[Any] | None = None) -> Shuffler:
        """An iterable pipe over the items in a random order; see :class:`Shuffler`."""
        from pipeload.datapipes.map.combinatorics import Shuffler

        return Shuffler(self, indices=indices)  # type: ignore[arg-type]

    def concat(self, *datapipes: MapDataPipe) -> Concater:
        """Keys run through this pipe, then each other; see :class:`Concater`."""
        from pipeload.datapipes.map.combining import Concater

        return Concater(self, *datapipes)  # type: ignore[arg-type]

    def zip(self, *datapipes: MapDataPipe) -> Zipper:
        """Key ``i`` reads a tuple of every pipe's item ``i``; see :class:`Zipper`."""
        from pipeload.datapipes.map.combining import Zipper

        return Zipper(self, *datapipes)  # type: ignore[arg-type]

    def to_iter_datapipe(self, indices: list[Any] | None = None) -> MapToIterConverter:
        """An iterable pipe reading ``indices`` (default ``range(len)``); see :class:`MapToIterConverter`."""
        from pipeload.datapipes.map.converters import MapToIterConverter

        return MapToIterConverter(self, indices)  # type: ignore[arg-type]
