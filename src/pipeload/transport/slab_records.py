"""What a slab pool keeps about its slabs and shares with its producers.

Each slab's record (its memory and book-keeping), the counts of what the pool did, the release
board, and the controls queued for each producer.

The **release board** is a small shared file with one 64-bit counter per slab id: how many of the
slab's batches have been released. Every producer maps it read-only; release finalizers in the
owner increment it from whatever thread drops a batch's last view, with no lock (one batch per slab
at a time). A pinned slab's release is counted only once the copies out of it are done: the
finalizer hands it to a :class:`~pipeload.transport.host_pinning.ReleaseWatcher`, whose thread
counts it (and unpins a slab that was retired meanwhile) under the pool's ``pin_lock``.

The **control queues** hold, per producer, the ``BOARD``/``MAP``/``FORGET`` controls to send before
its next grant, and count every control ever queued for it, so that a grant can name how many the
producer must have applied before it writes.
"""

from __future__ import annotations

import functools
import mmap
import os
import threading

from dataclasses import dataclass

import numpy as np

from pipeload._interrupts import ctrl_c_kept
from pipeload.transport import host_pinning
from pipeload.transport.messages import SlabControl, SlabControlKind
from pipeload.transport.shared_memory import create_buffer
from pipeload.transport.slab_memory import SlabMemory

MAX_SLABS = 4096
BOARD_BYTES = MAX_SLABS * 8


@dataclass
class SlabCounts:
    """What the pool has done so far (for benchmarks and tests; cheap to keep).

    Attributes:
        slabs_made: slabs created (each costs its pages once, and page-locking when pinned).
        slabs_adopted: buffers a producer made for one batch, taken over as slabs (not in
            ``slabs_made``: their pages were paid for with that batch).
        slabs_retired: slabs retired (surplus, too small, refused, or the pool closed).
        slab_mappings: slabs announced to a producer, which maps it (page-table entries for every
            page, in that producer, for as long as it lives).
        batches_in_shared_memory: messages that needed shared memory outside the message.
        batches_in_slabs: ... of which were written into their granted slab.
        late: grants whose slab was not released in time (the batch used fresh memory).
        busy: grants refused because the producer still viewed the slab.
    """

    slabs_made: int = 0
    slabs_adopted: int = 0
    slabs_retired: int = 0
    slab_mappings: int = 0
    batches_in_shared_memory: int = 0
    batches_in_slabs: int = 0
    late: int = 0
    busy: int = 0

    @property
    def batches_in_fresh_memory(self) -> int:
        """Messages that needed shared memory and travelled in one-shot buffers."""
        return self.batches_in_shared_memory - self.batches_in_slabs


class SlabRecord:
    """One slab as the owner sees it: its memory (see slab_memory.py) and its book-keeping.

    Written only on the owner's thread, except ``retired`` and unpinning, which release callbacks
    on other threads do under the pool's ``pin_lock``.
    """

    __slots__ = ("slab_id", "size", "memory", "leases_made", "granted_to", "granted_producer",
                 "granted_releases", "lease_token", "mapped_by", "retired", "unconfirmed_by", "still_viewed",
                 "buffer", "__weakref__")

    def __init__(self, slab_id: int, size: int, pin_device: int | None, fd: int | None = None) -> None:
        """``fd``: the slab is a buffer a producer made and offered (see SlabPool.adopt)."""
        self.slab_id = slab_id
        self.size = size
        self.memory = SlabMemory(size, pin_device, fd)
        self.leases_made = 0
        self.granted_to: int | None = None  # the token (batch number) of the outstanding grant
        self.granted_producer = -1
        self.granted_releases = 0  # the board count its outstanding grant names
        self.lease_token: int | None = None  # the token of the batch that last viewed it
        self.mapped_by: set[int] = set()
        self.retired = False
        # The producer that wrote the last batch into it, until it has said that nothing of its
        # own still views the slab (see SlabPool.producer_views); None: nobody may still view it.
        self.unconfirmed_by: int | None = None
        # That producer's last note said it still views the slab: held back from everyone, itself
        # included, until a note says otherwise (a second note saying so retires it).
        self.still_viewed = False
        # A buffer a producer made and offered: its (device, inode), by which that producer's
        # views notes name it (it knows no slab id for it). None for a slab the pool made.
        self.buffer: tuple[int, int] | None = None

    @property
    def fd(self) -> int:
        return self.memory.fd


class ReleaseBoard:
    """The owner's mapping of the release board. ``counts[slab_id]`` is the release count.

    Owned by the pool; ``close`` lets go of the descriptor and the pool's reference to the
    mapping, which lives on while release finalizers of live batches still hold ``counts``.
    """

    def __init__(self) -> None:
        self.fd = create_buffer(BOARD_BYTES, allocate=True)
        self._mapping = mmap.mmap(self.fd, BOARD_BYTES)
        self.counts = np.frombuffer(self._mapping, dtype=np.uint64)

    def released(self, slab_id: int) -> int:
        return int(self.counts[slab_id])

    def announce(self) -> tuple[SlabControl, list[int]]:
        """The control that tells a producer to map the board (its descriptor rides along)."""
        return SlabControl(SlabControlKind.BOARD, size=BOARD_BYTES), [self.fd]

    def close(self) -> None:
        if self.fd >= 0:
            os.close(self.fd)
            self.fd = -1
        self.counts = self._mapping = None  # type: ignore[assignment]


class ControlQueues:
    """Controls waiting for each producer; owned by the pool's thread.

    Invariant: ``sent(p)`` counts every control queued for ``p`` since it was last forgotten.
    """

    def __init__(self) -> None:
        self._waiting: dict[int, list[tuple[SlabControl, list[int]]]] = {}
        self._queued: dict[int, int] = {}

    def knows(self, producer: int) -> bool:
        """Whether ``producer`` has been sent anything (the board first of all)."""
        return producer in self._queued

    def sent(self, producer: int) -> int:
        return self._queued.get(producer, 0)

    def queue(self, producer: int, control: SlabControl, fds: list[int]) -> None:
        self._waiting.setdefault(producer, []).append((control, fds))
        self._queued[producer] = self._queued.get(producer, 0) + 1

    def take(self, producer: int) -> list[tuple[SlabControl, list[int]]]:
        return self._waiting.pop(producer, [])

    def forget(self, producer: int) -> None:
        self._waiting.pop(producer, None)
        self._queued.pop(producer, None)

    def clear(self) -> None:
        self._waiting.clear()
        self._queued.clear()


def release_callback(slab: SlabRecord, board: ReleaseBoard, watcher: host_pinning.ReleaseWatcher | None,
                     pin_lock: threading.Lock) -> tuple[object, ...]:
    """What a lease's finalizer calls when its batch's last view dies, and with what: it holds
    the board's counters, not the board, so that a closed pool's board can go."""
    return (_RELEASED, slab, board.counts, watcher, pin_lock)


def _released(slab: SlabRecord, counts: np.ndarray, watcher: host_pinning.ReleaseWatcher | None,
              pin_lock: threading.Lock) -> None:
    """The last view of one batch on ``slab`` died (any thread): count the release, at once, or
    (pinned) once the copies queued before now are done."""
    if watcher is None:
        counts[slab.slab_id] += 1
        return
    watcher.submit(host_pinning.release_marker(), functools.partial(_land_pinned, slab, counts, pin_lock))


# Run as batches die: a Ctrl-C that lands in it reaches the loop rather than being dropped.
_RELEASED = ctrl_c_kept(_released)


def _land_pinned(slab: SlabRecord, counts: np.ndarray, pin_lock: threading.Lock) -> None:
    with pin_lock:
        counts[slab.slab_id] += 1
        if slab.retired and int(counts[slab.slab_id]) == slab.leases_made:
            slab.memory.unpin()  # torn down: nobody will reuse it
