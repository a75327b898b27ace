"""Column selection for operations with ``input_col``/``output_col``, and small shared checks.

An item is a list, a tuple or a dict; ``input_col`` names one column (an index or a key) or
several (a list or tuple of them); the function receives one argument per column.
"""

from __future__ import annotations

import functools
import inspect
import operator
from collections.abc import Callable, Sized
from typing import Any


def no_length(pipe: object) -> TypeError:
    """torch's error for ``len()`` of a pipe whose source has no length."""
    return TypeError(f"{type(pipe).__name__} instance doesn't have valid length")


def length_of(source: object, pipe: object) -> int:
    """``len(source)``, or the TypeError torch raises for ``pipe`` when the source has none."""
    if isinstance(source, Sized):
        return len(source)
    raise no_length(pipe)


def batch_count(length: int, batch_size: int, drop_last: bool) -> int:
    """How many batches ``length`` items make: a short last batch counts unless ``drop_last``."""
    return length // batch_size if drop_last else -(-length // batch_size)


def apply_to_columns(fn: Callable[..., Any], data: Any, input_col: Any) -> Any:
    """Call ``fn`` on the whole item, one column, or several columns as separate arguments."""
    if input_col is None:
        return fn(data)
    if isinstance(input_col, (list, tuple)):
        return fn(*(data[col] for col in input_col))
    return fn(data[input_col])


def place_result(data: Any, result: Any, input_col: Any, output_col: Any) -> Any:
    """Put ``result`` back into a copy-on-write version of the item, as torch's Mapper does.

    ``output_col=None`` replaces the (first) input column and drops the others; ``-1`` appends;
    any other index or key is set. Tuples come back as tuples.
    """
    was_tuple = isinstance(data, tuple)
    if was_tuple:
        data = list(data)
    if output_col is None:
        if isinstance(input_col, (list, tuple)):
            data[input_col[0]] = result
            for col in sorted(input_col[1:], reverse=True):
                del data[col]
        else:
            data[input_col] = result
    elif output_col == -1:
        data.append(result)
    else:
        data[output_col] = result
    return tuple(data) if was_tuple else data


def check_fn_fits_columns(fn: Callable[..., Any], input_col: Any) -> None:
    """Refuse a function that cannot take one positional argument per input column.

    Raises:
        ValueError: with torch's wording, naming the function and the counts.
    """
    try:
        signature = inspect.signature(fn)
    except (ValueError, TypeError):
        return  # a builtin or C function: nothing to inspect
    wanted = len(input_col) if isinstance(input_col, (list, tuple)) else 1
    kinds = inspect.Parameter
    positional = [p for p in signature.parameters.values()
                  if p.kind in (kinds.POSITIONAL_ONLY, kinds.POSITIONAL_OR_KEYWORD)]
    var_positional = any(p.kind is kinds.VAR_POSITIONAL for p in signature.parameters.values())
    required_keywords = [p for p in signature.parameters.values()
                         if p.kind is kinds.KEYWORD_ONLY and p.default is p.empty]
    name = _name_of(fn)
    if required_keywords:
        raise ValueError(
            f"The function {name} takes {len(required_keywords)} non-default keyword-only "
            f"parameters, which is not allowed. ({', '.join(p.name for p in required_keywords)}; "
            "give them defaults or bind them with functools.partial)"
        )
    if len(signature.parameters) < wanted and not var_positional:
        raise ValueError(
            f"The function {name} takes {len(signature.parameters)} parameters, but {wanted} are "
            f"required. (input_col={input_col!r})"
        )
    if len(positional) > wanted and any(p.default is p.empty for p in positional[wanted:]):
        raise ValueError(
            f"The function {name} takes {len(positional)} positional parameters, but {wanted} are "
            f"required. (input_col={input_col!r})"
        )
    if len(positional) < wanted and not var_positional and len(signature.parameters) >= wanted:
        raise ValueError(
            f"The function {name} takes {len(positional)} positional parameters, but {wanted} are "
            f"required. (input_col={input_col!r})"
        )


def _name_of(fn: Callable[..., Any]) -> str:
    if isinstance(fn, functools.partial):
        return getattr(fn.func, "__name__", repr(fn.func))
    return getattr(fn, "__name__", repr(fn))


def check_positive(value: Any, name: str, what: str) -> None:
    """AssertionError (torch's type for these) unless ``value`` > 0; TypeError unless it is an
    integer (see :func:`check_int`)."""
    check_int(value, name)
    if value <= 0:
        raise AssertionError(f"{what} is required to be larger than 0! (got {name}={value!r})")


def check_int(value: Any, name: str) -> None:
    """TypeError unless ``value`` is an integer (an int, a numpy or 0-d tensor integer).

    torch's pipes take a float count and silently make something else of it (``batch(2.5)``
    one batch of everything, ours batches of 3; ``header(2.5)`` three items), so it is refused
    where the pipe is built, by name.
    """
    try:
        operator.index(value)
    except TypeError:
        raise TypeError(f"{name} should be an int, but got {name}={value!r} ({type(value).__name__})") from None
