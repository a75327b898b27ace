"""The one interface every engine offers to the loader."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any, Protocol

from pipeload.engine.plan import EpochStart


class Engine(Protocol):
    """Turns the tasks of an epoch into batches.

    ``start_epoch`` is called once per epoch with that epoch's task iterator (lists of indices,
    or single indices without auto-collation); ``next_batch`` raises StopIteration at the end.

    Errors, as in torch: an error raised for one batch (dataset, collate_fn, pinning) propagates
    from ``next_batch`` and the epoch goes on; so does a timeout. What ends the epoch (a dead
    worker, a broken channel) closes the engine before it propagates; after ``close`` (which the
    iterator calls on Ctrl-C) ``next_batch`` raises StopIteration.

    ``shared_seed`` is given only when a persistent session's later epoch must reseed the
    dataset's random pipes (a DataPipe graph: see ``engine/replica.py``). ``start`` is given only
    when the epoch continues one cut short (a resumed checkpoint: see ``pipeload/resume``).
    """

    @property
    def workers(self) -> list[Any]: ...

    @property
    def closed(self) -> bool: ...

    def start_epoch(self, tasks: Iterator[Any], shared_seed: int | None = None,
                    start: EpochStart = EpochStart()) -> None: ...

    def next_batch(self) -> Any: ...

    def close(self) -> None: ...
