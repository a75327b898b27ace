"""Economic mode's item bookkeeping: cut each batch into pieces, give each piece to the item worker
with the fewest items in hand.

Pure state, no I/O, so its rules can be read (and tested) on their own.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any


@dataclass(frozen=True)
class Piece:
    """A run of consecutive items of one batch, fetched by one item worker in one go.

    Attributes:
        item_worker: who fetches it.
        slot: the position of its first item inside the batch.
        position: the position of its first item in the epoch's sample stream (its seed).
        indices: the dataset indices to fetch.
    """

    item_worker: int
    slot: int
    position: int
    indices: list[Any]


class ItemScheduler:
    """Hands out pieces to item workers, least loaded first.

    A piece is one item, or with ``sub_batches=True`` (datasets with ``__getitems__``) a share of
    about ``len(batch) / num_item_workers`` items, so that every item worker takes part in every
    batch. Touched only by the thread that drives the epoch.

    Invariants, between calls:
      - ``load[w]`` is the number of items sent to worker ``w`` and not yet reported done by it;
      - ties in load go to the worker after the last one chosen, so an idle pool spreads a batch
        over all workers.
    """

    def __init__(self, num_item_workers: int, sub_batches: bool) -> None:
        self.sub_batches = sub_batches
        self.load = [0] * num_item_workers
        self._next = 0

    @property
    def items_in_flight(self) -> int:
        return sum(self.load)

    def split(self, indices: list[Any], first_position: int) -> list[Piece]:
        """Cut one batch into pieces and assign each one; the loads count them at once."""
        count = len(self.load)
        size = math.ceil(len(indices) / count) if self.sub_batches else 1
        pieces = []
        for slot in range(0, len(indices), max(size, 1)):
            chunk = list(indices[slot : slot + size])
            worker = self._least_loaded()
            self.load[worker] += len(chunk)
            pieces.append(Piece(worker, slot, first_position + slot, chunk))
        return pieces

    def record_done(self, item_worker: int, count: int) -> None:
        """``item_worker`` has handed over (or failed) ``count`` more items."""
        self.load[item_worker] = max(0, self.load[item_worker] - count)

    def _least_loaded(self) -> int:
        count = len(self.load)
        chosen = min(range(count), key=lambda w: (self.load[w], (w - self._next) % count))
        self._next = (chosen + 1) % count
        return chosen
