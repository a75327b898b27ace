"""Filtering items out."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import Any, TypeVar

from pipeload.datapipes._functions import check_function, raised_by_function
from pipeload.datapipes.base import IterDataPipe
from pipeload.datapipes.iter._columns import apply_to_columns, check_fn_fits_columns
from pipeload.datapipes.protocol import PipeIterator

T_co = TypeVar("T_co", covariant=True)


class Filter(IterDataPipe[T_co]):
    """Keep the items for which a function returns True (functional name: ``filter``).

    Args:
        datapipe: the source pipe.
        filter_fn: item (or its columns) -> bool; anything but a bool is an error.
        input_col: None (the whole item), an index or key, or a list/tuple of them.

    Example:
        >>> list(IterableWrapper(range(5)).filter(lambda n: n % 2 == 0))
        [0, 2, 4]
    """

    _parent_fields = ("datapipe",)

    def __init__(self, datapipe: IterDataPipe, filter_fn: Callable[..., bool], input_col: Any = None) -> None:
        check_function(filter_fn, "filter_fn")
        self.datapipe = datapipe
        self.filter_fn = filter_fn
        self.input_col = input_col
        check_fn_fits_columns(filter_fn, input_col)

    def _keeps(self, data: Any) -> bool:
        try:
            condition = apply_to_columns(self.filter_fn, data, self.input_col)
        except Exception as error:
            raise raised_by_function(error, self, "filter_fn")
        if not isinstance(condition, bool):
            raise ValueError(
                "Boolean output is required for `filter_fn` of FilterIterDataPipe, got",
                type(condition),
            )
        return condition

    def __iter__(self) -> Iterator[T_co]:
        return _FilterIterator(self._keeps, self.datapipe)


class _FilterIterator(PipeIterator[Any]):
    def __init__(self, keeps: Callable[[Any], bool], source: Any) -> None:
        super().__init__(source)
        self._keeps = keeps
        (self._source,) = self.upstream

    def nonblocking_next(self) -> Any:
        while True:
            data = self._source.nonblocking_next()
            if self._keeps(data):
                return data

# torch's long names, for scripts that import them from torch's submodule of this name: the
# same classes (torch's package exports the short names, as ours does).
FilterIterDataPipe = Filter
