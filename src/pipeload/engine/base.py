"""The one interface every engine offers to the loader."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any, Protocol


class Engine(Protocol):
    """Turns the tasks of an epoch into batches.

    ``start_epoch`` is called once per epoch with that epoch's task iterator (lists of indices,
    or single indices without auto-collation); ``next_batch`` raises StopIteration at the end.
    """

    @property
    def workers(self) -> list[Any]: ...

    @property
    def closed(self) -> bool: ...

    def start_epoch(self, tasks: Iterator[Any]) -> None: ...

    def next_batch(self) -> Any: ...

    def close(self) -> None: ...
