"""Checks on the functions pipes are given, made when the pipe is built, as torch makes them.

A function that is not callable fails at once rather than at the first item. A lambda or a
function defined inside another cannot be pickled, so a process worker started with spawn or
forkserver (or a process ``queue_boundary`` under them) could not receive the pipe: torch warns
about it when the pipe is built, and so do we, in torch's words. (torch stays quiet when ``dill``
is installed because it pickles with dill; pipeload pickles with ``pickle`` only, so it warns.)
"""

from __future__ import annotations

import functools
import inspect
import warnings
from typing import Any

from pipeload._user_frame import first_frame_outside_pipeload


def check_function(fn: Any, argument: str) -> None:
    """Raise TypeError unless ``fn`` is callable; warn if pickle could not send it to a worker.

    Args:
        fn: the function given to the pipe.
        argument: its argument's name, for the messages (``"fn"``, ``"filter_fn"``, ...).
    """
    if not callable(fn):
        raise TypeError(
            f"A callable function is expected, but {type(fn)} is provided. (got {argument}={fn!r})"
        )
    kind = _unpicklable_kind(fn.func if isinstance(fn, functools.partial) else fn)
    if kind is not None:
        warnings.warn(
            f"{kind} function is not supported by pickle, please use regular python function or "
            f"functools.partial instead. ({argument}={_name_of(fn)}: a process worker started by "
            "spawn or forkserver could not receive it)",
            stacklevel=first_frame_outside_pipeload(),
        )


def _unpicklable_kind(fn: Any) -> str | None:
    """"Local" or "Lambda" for the functions torch warns about, else None."""
    code = getattr(fn, "__code__", None)
    if code is not None:
        if code.co_flags & inspect.CO_NESTED:
            return "Local"
        return "Lambda" if getattr(fn, "__name__", None) == "<lambda>" else None
    qualname = getattr(fn, "__qualname__", None) or type(fn).__qualname__
    return "Local" if "<locals>" in qualname else None


def _name_of(fn: Any) -> str:
    return getattr(fn, "__qualname__", None) or type(fn).__qualname__


def raised_by_function(error: Exception, pipe: Any, argument: str) -> Exception:
    """What a pipe raises when the function it was given (``argument``) raised ``error``.

    The same exception, with a note naming the pipe and the argument, since a traceback shows
    only pipeload's frames between the loop and the user's function. A ``StopIteration``
    becomes a ``RuntimeError`` (as PEP 479 makes it in a generator, which torch's pipes are):
    leaving ``nonblocking_next()`` as it is, it would end the pipe's run there and silently
    drop the rest of the epoch.

    Example:
        >>> try:
        ...     item = self._fn(data)
        ... except Exception as error:
        ...     raise raised_by_function(error, self._pipe, "fn")
    """
    from pipeload.datapipes.base import describe_pipe  # base imports the pipes that import this

    if isinstance(error, StopIteration):
        replaced = RuntimeError(f"`{argument}` raised StopIteration")
        replaced.__cause__ = error
        replaced.__traceback__ = error.__traceback__
        error = replaced
    note = f"pipeload: raised by `{argument}` of {describe_pipe(pipe, ancestors=1)}"
    if note not in getattr(error, "__notes__", ()):
        error.add_note(note)
    return error
