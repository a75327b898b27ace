"""Operations that call a function on every item: map, flatmap, collate."""

from __future__ import annotations

import functools
from collections.abc import Callable, Iterator
from typing import Any, TypeVar

from pipeload._state_fields import StateFields
from pipeload.collate import default_collate
from pipeload.datapipes._functions import check_function, raised_by_function
from pipeload.datapipes.base import IterDataPipe
from pipeload.datapipes.iter._columns import (
    apply_to_columns,
    check_fn_fits_columns,
    length_of,
    place_result,
)
from pipeload.datapipes.protocol import PipeIterator, skipped_ahead
from pipeload.errors import bad_state_field

T_co = TypeVar("T_co", covariant=True)


class Mapper(IterDataPipe[T_co]):
    """Apply a function to every item (functional name: ``map``).

    Args:
        datapipe: the source pipe.
        fn: the function; a named function or ``functools.partial`` pickles, a lambda does not
            (process workers under spawn need pickling).
        input_col: None (the whole item), an index or key, or a list/tuple of them (``fn`` gets
            one argument per column).
        output_col: where the result goes: None replaces the (first) input column, -1 appends,
            any other index or key is set. Only with ``input_col``.

    Example:
        >>> list(IterableWrapper([(1, 2), (3, 4)]).map(lambda a, b: a + b, input_col=[0, 1], output_col=-1))
        [(1, 2, 3), (3, 4, 7)]
    """

    _parent_fields = ("datapipe",)
    _function_argument = "fn"  # the name messages give the function (collate's differ)

    def __init__(
        self,
        datapipe: IterDataPipe,
        fn: Callable[..., Any],
        input_col: Any = None,
        output_col: Any = None,
    ) -> None:
        check_function(fn, self._function_argument)
        self.datapipe = datapipe
        self.fn = fn
        self.input_col = input_col
        if input_col is None and output_col is not None:
            raise ValueError(
                f"`output_col` must be None when `input_col` is None. (got output_col={output_col!r})"
            )
        if isinstance(output_col, (list, tuple)):
            if len(output_col) > 1:
                raise ValueError(
                    f"`output_col` must be a single-element list or tuple (got output_col={output_col!r})"
                )
            output_col = output_col[0]
        self.output_col = output_col
        check_fn_fits_columns(fn, input_col)

    def _apply_fn(self, data: Any) -> Any:
        if self.input_col is None:
            return self.fn(data)
        result = apply_to_columns(self.fn, data, self.input_col)
        return place_result(data, result, self.input_col, self.output_col)

    def __iter__(self) -> Iterator[T_co]:
        apply = self.fn if self.input_col is None else self._apply_fn
        return _MapperIterator(self, apply, self.datapipe)

    def __len__(self) -> int:
        return length_of(self.datapipe, self)


class _MapperIterator(PipeIterator[Any]):
    def __init__(self, pipe: Mapper[Any], apply: Callable[[Any], Any], source: Any) -> None:
        super().__init__(source)
        self._pipe = pipe
        self._apply = apply
        (self._source,) = self.upstream

    def nonblocking_next(self) -> Any:
        item = self._source.nonblocking_next()
        try:
            return self._apply(item)
        except Exception as error:
            raise raised_by_function(error, self._pipe, self._pipe._function_argument)


class Collator(Mapper[T_co]):
    """Turn each item (usually a batch) into tensors (functional name: ``collate``).

    Args:
        datapipe: the source pipe.
        conversion: the collate function (default: ``default_collate``). torch also accepts a
            dict of per-column functions for its DataFrame pipes; that needs TorchArrow and is
            refused here.
        collate_fn: overrides ``conversion`` when given.

    Example:
        >>> list(IterableWrapper(range(6)).batch(3).collate())
        [tensor([0, 1, 2]), tensor([3, 4, 5])]
    """

    def __init__(
        self,
        datapipe: IterDataPipe,
        conversion: Callable[..., Any] | dict[Any, Any] | None = default_collate,
        collate_fn: Callable[..., Any] | None = None,
    ) -> None:
        if collate_fn is None:
            if not callable(conversion) and not isinstance(conversion, dict):
                raise TypeError(
                    "collate: conversion should be the collate function (or, for torch's DataFrame "
                    f"pipes, a dict of per-column functions), but got conversion={conversion!r}"
                )
            if not callable(conversion):
                raise RuntimeError(
                    "unable to import default collation function from the TorchArrow: a dict "
                    f"conversion is for torch's DataFrame pipes (got conversion={conversion!r}); "
                    "pass a function instead"
                )
            collate_fn = conversion
            self._function_argument = "conversion"
        else:
            self._function_argument = "collate_fn"
        super().__init__(datapipe, fn=collate_fn)


class FlatMapper(IterDataPipe[T_co]):
    """Apply a function that returns an iterable and yield its elements (functional name: ``flatmap``).

    Args:
        datapipe: the source pipe.
        fn: item -> iterable; None flattens the items themselves.
        input_col: as for :class:`Mapper` (the result is flattened, never placed back).

    Example:
        >>> list(IterableWrapper(["ab", "c"]).flatmap(list))
        ['a', 'b', 'c']
    """

    _parent_fields = ("datapipe",)

    def __init__(self, datapipe: IterDataPipe, fn: Callable[..., Any] | None = None, input_col: Any = None) -> None:
        self.datapipe = datapipe
        if fn is None:
            fn = _identity
        check_function(fn, "fn")
        self.fn = fn
        self.input_col = input_col
        check_fn_fits_columns(fn, input_col)

    def __iter__(self) -> Iterator[T_co]:
        return _FlatMapperIterator(self, functools.partial(apply_to_columns, self.fn, input_col=self.input_col),
                                   self.datapipe)


def _identity(data: Any) -> Any:
    return data


class _FlatMapperIterator(PipeIterator[Any]):
    """Its checkpoint keeps the source item being expanded and how many of its elements were
    handed out: the upstream has moved past that item, so resuming expands it again and skips
    those (a file path and a count, for the usual flatmap over shards)."""

    _NOTHING = object()

    def __init__(self, pipe: FlatMapper[Any], expand: Callable[[Any], Any], source: Any) -> None:
        super().__init__(source)
        self._pipe = pipe
        self._expand = expand
        (self._source,) = self.upstream
        self._current: Iterator[Any] = iter(())
        self._item: Any = self._NOTHING
        self._taken = 0

    def nonblocking_next(self) -> Any:
        while True:
            try:
                for element in self._current:
                    self._taken += 1
                    return element
            except Exception as error:  # the iterable fn returned failed part-way
                raise raised_by_function(error, self._pipe, "fn")
            item = self._source.nonblocking_next()
            try:
                self._current = iter(self._expand(item))
            except Exception as error:
                raise raised_by_function(error, self._pipe, "fn")
            self._item, self._taken = item, 0

    def _own_state(self) -> Any:
        if self._item is self._NOTHING:
            return None
        return {"item": self._item, "taken": self._taken}

    def _check_own_state(self, fields: StateFields) -> Any:
        # The item is expanded again here, so that a count past its elements is refused unset.
        own = fields.fields("own", none=True)
        if own is None:
            return None  # before the first item
        item, taken = own.raw("item", "the source item being expanded"), own.integer("taken")
        own.finish()
        try:
            current = iter(self._expand(item))
        except Exception as error:  # noqa: BLE001 - the user's function, given what the state holds
            raise bad_state_field(own.name("item"), item, "an item the flatmap function can expand",
                                  f"{type(error).__name__}: {error}") from error
        return item, taken, skipped_ahead(current, taken, own.name("taken"), "that item expands to {} elements")

    def _load_own_state(self, state: Any) -> None:
        if state is not None:
            self._item, self._taken, self._current = state

# torch's long names, for scripts that import them from torch's submodule of this name: the
# same classes (torch's package exports the short names, as ours does).
CollatorIterDataPipe = Collator
MapperIterDataPipe = Mapper
