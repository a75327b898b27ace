"""Economic mode's item bookkeeping: cut each batch into pieces, and give each piece to the item
worker with the fewest pieces in hand, as soon as one has room.

Pure state, no I/O, so its rules can be read (and tested) on their own.
"""

from __future__ import annotations

import dataclasses
import math
from collections import deque
from dataclasses import dataclass
from typing import Any

from pipeload.transport.messages import ItemPlacement

ALIGN_BYTES = 64  # as the slab writer aligns what it places
PIECES_IN_HAND = 2  # per item worker: the one it fetches, and the next, so it never waits for us
# A batch is cut into about this many pieces per item worker. One a worker costs fewer messages,
# but with two batches in flight every piece is then in some worker's hands at once: the faster
# worker idled 40-80 ms of a 700 ms pass waiting for the next batch to open on some runs of
# pipeload bench's JPEGs (stop 40). With two, pieces wait here and go to whoever is free first
# (4-11 ms idle).
PIECES_PER_WORKER = 2
# Cheap items go in pieces of at least this many items (see ItemScheduler): each piece costs the
# main process a message each way whatever it holds, so pieces of 64 / (2 x 14) = 3 items cost it
# ~37 us a sample of JPEGs at 14 item workers, against ~7 in classic mode (bench.process_time). On
# a 16-core machine, with items that take a fraction of a millisecond, that makes the main
# process the limit. With 3x32x32 items at 8 and 14 item workers here, pieces of 8 took the main
# process from 10-15 to 6-9 us a sample, and samples/s up by a quarter to a half (stop 41).
MIN_PIECE_ITEMS = 8
# The main process's CPU for one piece, a message each way (bench.process_time's scans put it
# at 25 to 180 us here, 14 workers sharing 2 CPUs; 60 us is taken), and the share of one CPU
# those messages may take before pieces are cut coarser: below it, bigger pieces would save
# little, and a slow item would hold more items behind it.
PIECE_MAIN_S = 60e-6
MESSAGES_SHARE = 0.25
PACE_WEIGHT = 0.25  # weight of the newest piece in the item time's moving average


@dataclass(frozen=True)
class Piece:
    """A run of consecutive items of one batch, fetched by one item worker in one go.

    Attributes:
        batch_number: the batch it belongs to.
        batch_worker: the batch worker that gathers that batch.
        slot: the position of its first item inside the batch.
        position: the position of its first item in the epoch's sample stream (its seed).
        indices: the dataset indices to fetch.
        item_worker: who fetches it (-1 while it waits for a worker with room).
    """

    batch_number: int
    batch_worker: int
    slot: int
    position: int
    indices: list[Any]
    item_worker: int = -1


def messages_would_busy_main(item_s: float, num_item_workers: int, batch_size: int) -> bool:
    """Whether item workers at ``item_s`` an item would keep the main process more than
    ``MESSAGES_SHARE`` busy with the messages of finely cut pieces."""
    pieces = math.ceil(batch_size / piece_size(batch_size, num_item_workers, False))
    items_per_s = num_item_workers / max(item_s, 1e-9)
    return items_per_s * PIECE_MAIN_S * pieces / max(1, batch_size) > MESSAGES_SHARE


def least_items(batch_size: int, num_item_workers: int, batches_in_flight: int) -> int:
    """The fewest items a piece of cheap items holds: ``MIN_PIECE_ITEMS``, or fewer where the
    batches in flight would otherwise hold fewer pieces than there are item workers (at
    ``prefetch_factor`` 2, a batch of 16 in pieces of 8 kept 4 of 8 workers busy, and items
    of 10 ms went at half the speed)."""
    return max(1, min(MIN_PIECE_ITEMS, batches_in_flight * batch_size // max(1, num_item_workers)))


def piece_size(batch_size: int, num_item_workers: int, sub_batches: bool, least: int = 1) -> int:
    """How many items of a batch of ``batch_size`` one piece holds: at least ``least`` (or the
    whole batch, if smaller)."""
    pieces = num_item_workers if sub_batches else num_item_workers * PIECES_PER_WORKER
    return max(1, math.ceil(batch_size / pieces), min(least, batch_size))


class ItemScheduler:
    """Queues the pieces of open batches and hands them out, least loaded first.

    A batch is cut into about ``PIECES_PER_WORKER`` pieces per item worker, so that all of them
    take part in every batch (the first one included) while each message carries several items;
    with ``sub_batches=True`` (datasets with ``__getitems__``) into one piece per item worker, each
    one ``__getitems__`` call. Cheap items are cut coarser (``least`` items a piece, see
    ``least_items``), so that fewer messages carry them, though then not every worker takes
    part in every batch.
    Pieces wait here, in batch order, until an item worker has fewer than ``pieces_in_hand``: a
    worker stuck on a slow item then holds up at most one piece behind it, and the others take
    the rest. Touched only by the thread that drives the epoch.

    Invariants, between calls:
      - ``in_hand[w]`` is the number of pieces sent to item worker ``w`` and not reported done;
      - ``0 <= in_hand[w] <= pieces_in_hand``;
      - ``waiting`` holds unassigned pieces, earliest batch first.
    """

    def __init__(self, num_item_workers: int, sub_batches: bool,
                 pieces_in_hand: int = PIECES_IN_HAND) -> None:
        self.sub_batches = sub_batches
        self.pieces_in_hand = pieces_in_hand
        self.in_hand = [0] * num_item_workers
        self.waiting: deque[Piece] = deque()
        self._next = 0

    def add_batch(self, batch_number: int, batch_worker: int, indices: list[Any],
                  first_position: int, least: int = 1) -> None:
        """Queue the pieces of one batch, of at least ``least`` items each (unless they are
        sub-batches: one per item worker)."""
        size = piece_size(len(indices), len(self.in_hand), self.sub_batches,
                          1 if self.sub_batches else least)
        for slot in range(0, len(indices), max(size, 1)):
            chunk = list(indices[slot : slot + size])
            self.waiting.append(Piece(batch_number, batch_worker, slot, first_position + slot, chunk))

    def assign(self) -> list[Piece]:
        """Give waiting pieces to the item workers with room; returns them, worker filled in."""
        assigned = []
        while (piece := self.next_piece()) is not None:
            assigned.append(piece)
        return assigned

    def next_piece(self, most_items: int | None = None) -> Piece | None:
        """The next waiting piece, given to the least-loaded item worker; None if none waits or
        no worker has room. With ``most_items``, a longer piece is cut: its first ``most_items``
        items go, the rest waits first in line."""
        if not self.waiting:
            return None
        worker = self._least_loaded()
        if self.in_hand[worker] >= self.pieces_in_hand:
            return None
        self.in_hand[worker] += 1
        self._next = (worker + 1) % len(self.in_hand)
        piece = self.waiting.popleft()
        indices = piece.indices
        if most_items is not None and len(indices) > most_items:
            self.waiting.appendleft(Piece(piece.batch_number, piece.batch_worker, piece.slot + most_items,
                                          piece.position + most_items, indices[most_items:]))
            indices = indices[:most_items]
        return Piece(piece.batch_number, piece.batch_worker, piece.slot, piece.position, indices, worker)

    def last_of(self, batch_number: int) -> bool:
        """Whether no piece of batch ``batch_number`` waits any more."""
        return all(piece.batch_number != batch_number for piece in self.waiting)

    def give_back(self, piece: Piece) -> None:
        """A piece that could not be sent: it waits again, first in line."""
        self.in_hand[piece.item_worker] -= 1
        self.waiting.appendleft(dataclasses.replace(piece, item_worker=-1))

    def record_done(self, item_worker: int) -> None:
        """``item_worker`` has handed over (or failed) one more piece."""
        self.in_hand[item_worker] = max(0, self.in_hand[item_worker] - 1)

    def _least_loaded(self) -> int:
        # Ties go to the worker after the last one chosen, so an idle pool spreads a batch wide.
        count = len(self.in_hand)
        return min(range(count), key=lambda w: (self.in_hand[w], (w - self._next) % count))


class ItemPace:
    """An item worker's time per item, as the main process sees its pieces come back: from the
    later of the piece's send and the worker's previous report, to the piece's own report (both
    on ``time.monotonic()``, one clock machine-wide), over the items it held; smoothed.

    Touched only by the thread that drives the epoch.
    """

    def __init__(self, num_item_workers: int) -> None:
        self._sent: list[deque[float]] = [deque() for _ in range(num_item_workers)]
        self._last_report = [0.0] * num_item_workers
        self.item_s: float | None = None  # None until a piece has come back

    def sent(self, item_worker: int, at: float) -> None:
        self._sent[item_worker].append(at)

    def reported(self, item_worker: int, count: int, at: float) -> None:
        """``item_worker`` reported a piece of ``count`` items finished ``at``."""
        last, self._last_report[item_worker] = self._last_report[item_worker], at
        if not self._sent[item_worker]:
            return  # a piece of an epoch cut short, sent before forget_epoch: its start is not known
        began = max(self._sent[item_worker].popleft(), last)
        if count <= 0 or at < began:
            return
        sample = (at - began) / count
        self.item_s = sample if self.item_s is None else self.item_s + PACE_WEIGHT * (sample - self.item_s)

    def forget_epoch(self) -> None:
        """A new epoch: pieces in hand are gone with the last one; the time per item stays."""
        for sent in self._sent:
            sent.clear()


def item_placement(item_bytes: tuple[int, ...], count: int, room: int) -> ItemPlacement | None:
    """Where the ``count`` items of a batch go in a slab of ``room`` bytes, each of whose large
    tensors has the sizes ``item_bytes``: leaf by leaf, as the stacked batch lies (None if they
    do not fit). See ``ItemPlacement``."""
    offsets, end = [], 0
    for size in item_bytes:
        offsets.append(end)
        end = -(-(end + count * size) // ALIGN_BYTES) * ALIGN_BYTES
    if not item_bytes or end > room:
        return None
    return ItemPlacement(tuple(offsets), item_bytes, end)
