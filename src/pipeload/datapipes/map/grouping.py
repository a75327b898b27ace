"""batch on map-style pipes."""

from __future__ import annotations

import operator
from collections.abc import Callable
from typing import Any

from pipeload.datapipes.base import AskEveryOne, MapDataPipe
from pipeload.datapipes.chunk import DataChunk
from pipeload.datapipes.iter._columns import batch_count, check_positive, length_of


class Batcher(MapDataPipe[DataChunk]):
    """Key ``i`` reads the items ``i*batch_size`` up to ``(i+1)*batch_size`` (functional name:
    ``batch``).

    Args:
        datapipe: the map-style pipe.
        batch_size: items per batch.
        drop_last: leave out a last, shorter batch.
        wrapper_class: what a batch is made into (``DataChunk``).

    Example:
        >>> SequenceWrapper(range(5)).batch(2)[2]
        [4]
    """

    _parent_fields = ("datapipe",)

    def __init__(
        self,
        datapipe: MapDataPipe,
        batch_size: int,
        drop_last: bool = False,
        wrapper_class: type[DataChunk] = DataChunk,
    ) -> None:
        check_positive(batch_size, "batch_size", "Batch size")
        self.datapipe = datapipe
        self.batch_size = batch_size
        self.drop_last = drop_last
        self.wrapper_class = wrapper_class

    def __getitem__(self, index: int) -> DataChunk:
        return self._gather(index, operator.getitem)

    def nonblocking_get(self, index: int) -> DataChunk:
        ask = AskEveryOne()
        batch = self._gather(index, ask)
        ask.check()
        return batch

    def _gather(self, index: int, read: Callable[[Any, Any], Any]) -> DataChunk:
        batch: list[Any] = []
        try:
            for key in range(index * self.batch_size, (index + 1) * self.batch_size):
                batch.append(read(self.datapipe, key))
        except IndexError as error:
            if not self.drop_last and batch:
                return self.wrapper_class(batch)
            raise IndexError(f"Index {index} is out of bound.") from error
        return self.wrapper_class(batch)

    def __len__(self) -> int:
        return batch_count(length_of(self.datapipe, self), self.batch_size, self.drop_last)

# torch's long names, for scripts that import them from torch's submodule of this name: the
# same classes (torch's package exports the short names, as ours does).
BatcherMapDataPipe = Batcher
