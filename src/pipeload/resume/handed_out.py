"""Dropping the batches an out-of-order epoch had handed out past its watermark.

With ``in_order=False`` the batches handed out before a checkpoint are every batch below a
watermark plus a few beyond it (those that finished early). Resuming skips the tasks below the
watermark without loading them; the few beyond are made again (their numbers, hence their
per-batch seeds, unchanged) and dropped here, right after the engine, so that neither the pin
stage nor the equal-batches stage ever sees them. Costs at most the batches that were in flight.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

from pipeload.engine.epoch_flow import NumberedBatch, batch_number_of
from pipeload.engine.plan import EpochStart
from pipeload.errors import LoaderTimeoutError


class DropHandedOut:
    """Wraps an engine; in an epoch started with ``start.handed_out``, drops those batches.

    Driven by the training thread (or the pin thread) only. Invariant between calls: ``_next``
    is the number of the next batch an in-order engine hands out; ``_drop`` holds the numbers
    still to drop this epoch.
    """

    def __init__(self, engine: Any) -> None:
        self._engine = engine
        self._drop: set[int] = set()
        self._next = 0

    workers = property(lambda self: self._engine.workers)
    closed = property(lambda self: self._engine.closed)
    inner = property(lambda self: self._engine)

    def start_epoch(self, tasks: Iterator[Any], shared_seed: int | None = None,
                    start: EpochStart = EpochStart()) -> None:
        self._drop = set(start.handed_out)
        self._next = start.first_batch
        self._engine.start_epoch(tasks, shared_seed, start=start)

    def next_batch(self) -> Any:
        while self._drop:
            try:
                batch = self._engine.next_batch()
            except (StopIteration, LoaderTimeoutError):
                raise
            except Exception as error:
                if not self._dropped(batch_number_of(error)):
                    raise
                continue
            if not self._dropped(batch.number if isinstance(batch, NumberedBatch) else None):
                return batch
        return self._engine.next_batch()

    def _dropped(self, number: int | None) -> bool:
        if number is None:  # an in-order engine: batches come by number
            number, self._next = self._next, self._next + 1
        if number in self._drop:
            self._drop.discard(number)
            return True
        return False

    def close(self) -> None:
        self._drop = set()
        self._engine.close()
