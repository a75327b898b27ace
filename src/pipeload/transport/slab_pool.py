"""The owner's side of the slab transport: reusable shared-memory slabs, granted one message at a time.

The process that consumes batches (the loader's main process) owns the pool. It makes each slab
(a nameless shared file, see shared_memory.py), maps it once, announces it to a producer with a
``MAP`` control (the descriptor travels with it), and grants it for one message at a time. The
producer writes that message's tensors into the slab; the owner views them there without a copy,
through a per-batch *lease*: a numpy view of the slab whose ``weakref.finalize`` fires when the
last tensor viewing the batch dies (views and slices a user keeps keep the lease, and so the slab,
alive).

Releases are counted on a *release board*: one 64-bit counter per slab id in a small shared
file every producer maps read-only. A slab is free when its counter has caught up with the number
of leases made on it. A grant names the count the producer must see before writing, which lets
the owner grant a slab whose previous batch is about to be freed (the batch a ``for`` loop drops
when it takes the next one): the producer starts fetching at once and waits, at the moment it
first writes, for the release to land. Pinned slabs are released by the owner instead, once a CUDA
event recorded at release time shows that asynchronous copies out of the slab are done.
"""

from __future__ import annotations

import collections
import mmap
import os
import threading
import weakref
from typing import Any

import numpy as np

from pipeload.transport import host_pinning
from pipeload.transport.messages import GrantOutcome, SlabControl, SlabControlKind, SlabGrant
from pipeload.transport.shared_memory import (
    Backing,
    create_buffer,
    current_backing,
    note_received,
    warn_if_dev_shm_too_small,
)

MAX_SLABS = 4096
BOARD_BYTES = MAX_SLABS * 8
SLAB_HEADROOM_BYTES = 256 * 1024  # alignment padding and small extras beyond the largest batch
SIZE_STEP_BYTES = 64 * 1024
LATE_PAUSE_GRANTS = 64  # after a deferred grant came too late, grant only free slabs this long
LARGE_BATCH_BYTES = 8 << 20  # from here on, when fresh pages are mapped matters for the peak


class _Slab:
    """One slab as the owner sees it.

    Written only on the owner's thread, except ``retired``/``pinned_address`` teardown, which
    release finalizers on other threads do under the pool's ``pin_lock``.
    """

    __slots__ = ("slab_id", "size", "fd", "mapping", "array", "pinned_address", "leases_made",
                 "granted_to", "granted_producer", "granted_releases", "lease_token", "mapped_by",
                 "retired", "__weakref__")

    def __init__(self, slab_id: int, size: int) -> None:
        self.slab_id = slab_id
        self.size = size
        self.fd = create_buffer(size, allocate=current_backing() is not Backing.MEMFD)
        note_received(self.fd)
        self.mapping = mmap.mmap(self.fd, size)
        self.array = np.frombuffer(self.mapping, dtype=np.uint8)
        self.pinned_address = 0
        self.leases_made = 0
        self.granted_to: int | None = None  # the token (batch number) of the outstanding grant
        self.granted_producer = -1
        self.granted_releases = 0  # the board count its outstanding grant names
        self.lease_token: int | None = None  # the token of the batch that last viewed it
        self.mapped_by: set[int] = set()
        self.retired = False


class SlabPool:
    """Slabs owned by one consumer, granted to its producers one message at a time.

    Driven by one thread (the engine's); release finalizers may run on any thread and touch only
    the board (unpinned) or the pinned-release queue.

    Invariants between calls:
      - a slab is free exactly when ``granted_to is None`` and its board count equals
        ``leases_made``;
      - a slab has at most one grant outstanding, and a producer writes into it only after the
        board shows the count its grant names;
      - ``controls_queued[p]`` counts every control ever queued for producer ``p``; a grant tells
        the producer how many it must have applied before writing.

    Example:
        >>> pool = SlabPool(pin=False, max_bytes=1 << 30)
        >>> pool.observe_batch(4 << 20)
        >>> pool.set_slab_limit(3)
        >>> grant = pool.grant(producer=0, token=0)   # a new slab, announced to producer 0
        >>> controls = pool.take_controls(0)           # send these before the grant
    """

    def __init__(self, *, pin: bool, max_bytes: int, batches_in_flight: int = 1) -> None:
        self._pin = pin and host_pinning.can_register()
        self._batches_in_flight = batches_in_flight  # at most, for the /dev/shm comparison
        self._max_bytes = max_bytes
        self._slab_limit = 0
        self._wanted_size = 0
        self._largest_batch = 0
        self._batches_seen = False
        self._slabs: dict[int, _Slab] = {}
        self._retired_in_use: dict[int, _Slab] = {}  # ids not reused until their views are gone
        self._grants: dict[int, _Slab] = {}  # token -> slab
        self._controls: dict[int, list[tuple[SlabControl, list[int]]]] = {}
        self.controls_queued: dict[int, int] = {}
        self._handed_out: collections.deque[int] = collections.deque(maxlen=2)
        self._late_pause = 0
        self._board_fd = create_buffer(BOARD_BYTES, allocate=True)
        self._board_mapping = mmap.mmap(self._board_fd, BOARD_BYTES)
        self._board = np.frombuffer(self._board_mapping, dtype=np.uint64)
        self._pinned_releases: collections.deque[tuple[_Slab, Any]] | None = (
            collections.deque() if self._pin else None)
        self.pin_lock = threading.Lock()
        self._closed = False

    @property
    def pinned(self) -> bool:
        """Whether slabs are page-locked for CUDA (so their batches come out pinned)."""
        return self._pin

    @property
    def defers_releases(self) -> bool:
        """Whether a slab may be granted before its previous batch is freed (see the module)."""
        return not self._pin and self._late_pause == 0

    @property
    def slab_count(self) -> int:
        """How many slabs the pool holds now (not counting retired ones still viewed)."""
        return len(self._slabs)

    @property
    def slab_bytes(self) -> int:
        """Bytes of all slabs the pool holds now."""
        return sum(slab.size for slab in self._slabs.values())

    def set_slab_limit(self, slabs: int) -> None:
        """How many slabs the pool may hold (the engine keeps it at batches in flight + 2)."""
        self._slab_limit = max(0, slabs)

    @property
    def batch_bytes(self) -> int:
        """The most shared memory one batch has needed so far (0: none yet)."""
        return self._largest_batch

    @property
    def inline_only(self) -> bool:
        """Whether batches have arrived and every one travelled inside its message: then a batch
        in flight holds no shared memory at all."""
        return self._batches_seen and self._largest_batch == 0

    def observe_batch(self, shared_bytes: int) -> None:
        """A batch needed ``shared_bytes`` outside its message; slabs are sized to fit the largest."""
        self._batches_seen = True
        if shared_bytes <= self._largest_batch:
            return
        if self._largest_batch == 0:
            warn_if_dev_shm_too_small(shared_bytes, self._batches_in_flight)
        self._largest_batch = shared_bytes
        wanted = _round_up(shared_bytes + SLAB_HEADROOM_BYTES, SIZE_STEP_BYTES)
        self._wanted_size = max(self._wanted_size, wanted)

    # -- granting ------------------------------------------------------------------------

    def grant(self, producer: int, token: int) -> SlabGrant | None:
        """A slab for the message ``token`` that ``producer`` builds next, or None (fresh memory)."""
        if self._closed or self._wanted_size == 0:
            return None
        self._apply_pinned_releases()
        self._retire_surplus()
        slab, releases = self._choose(producer)
        if slab is None:
            return None
        self.settle(token, GrantOutcome.UNUSED)  # a token is granted once; never leak a slab
        slab.granted_to = token
        slab.granted_producer = producer
        slab.granted_releases = releases
        self._grants[token] = slab
        if producer not in slab.mapped_by:
            self._announce(producer, slab)
        return SlabGrant(slab.slab_id, releases, self.controls_queued.get(producer, 0))

    def share_grant(self, token: int, producer: int) -> tuple[SlabGrant, int] | None:
        """Let ``producer`` write into the slab granted for message ``token`` too, and its size;
        None if ``token`` holds no grant.

        Economic mode's item workers write their items straight into the batch's slab, each in
        its own place (see ``ItemPlacement``); only the first grantee's answer settles the grant.
        """
        slab = self._grants.get(token)
        if slab is None or self._closed:
            return None
        if producer not in slab.mapped_by:
            self._announce(producer, slab)
        controls = self.controls_queued.get(producer, 0)
        return SlabGrant(slab.slab_id, slab.granted_releases, controls), slab.size

    def granted_size(self, token: int) -> int:
        """The size of the slab granted for message ``token`` (0: none)."""
        slab = self._grants.get(token)
        return 0 if slab is None else slab.size

    def would_need_fresh_memory(self) -> bool:
        """Whether the next grant would have to map new pages for a large batch (a new slab, or
        none at all): true unless a free slab, or one about to be released, can take it."""
        if self._closed or self._largest_batch < LARGE_BATCH_BYTES:
            return False
        if any(self._is_free(s) and s.size >= self._wanted_size for s in self._slabs.values()):
            return False
        return self._about_to_be_released(peek=True) is None

    def _choose(self, producer: int) -> tuple[_Slab | None, int]:
        free = [s for s in self._slabs.values() if self._is_free(s) and s.size >= self._wanted_size]
        if free:
            # Prefer one the producer has mapped already: no control message, no page faults.
            slab = max(free, key=lambda s: producer in s.mapped_by)
            return slab, slab.leases_made
        if self._may_grow():
            slab = _Slab(self._next_id(), self._wanted_size)
            if self._pin:
                self._pin_slab(slab)
            self._board[slab.slab_id] = 0
            self._slabs[slab.slab_id] = slab
            return slab, 0
        deferred = self._about_to_be_released()
        if deferred is not None:
            return deferred, deferred.leases_made
        return None, 0

    def _about_to_be_released(self, peek: bool = False) -> _Slab | None:
        """The slab of the batch handed out before the latest one, which a ``for`` loop is about
        to drop: granted now, written once its release lands (never with pinned slabs, whose
        release waits for the owner's thread)."""
        if self._pin or self._late_pause > 0 or len(self._handed_out) < 2:
            if not peek:
                self._late_pause = max(0, self._late_pause - 1)
            return None
        previous = self._handed_out[0]
        for slab in self._slabs.values():
            if (slab.lease_token == previous and slab.granted_to is None
                    and slab.size >= self._wanted_size and not self._is_free(slab)):
                return slab
        return None

    def _may_grow(self) -> bool:
        return (len(self._slabs) < self._slab_limit
                and len(self._slabs) + len(self._retired_in_use) < MAX_SLABS
                and self.slab_bytes + self._wanted_size <= self._max_bytes)

    def _next_id(self) -> int:
        # A retired slab's id is reused only once its last batch is released: a late release
        # must never count towards the slab that took its place.
        for slab_id, slab in list(self._retired_in_use.items()):
            if int(self._board[slab_id]) == slab.leases_made:
                del self._retired_in_use[slab_id]
        taken = self._slabs.keys() | self._retired_in_use.keys()
        return next(i for i in range(MAX_SLABS) if i not in taken)

    def _is_free(self, slab: _Slab) -> bool:
        return slab.granted_to is None and int(self._board[slab.slab_id]) == slab.leases_made

    def settle(self, token: int, outcome: GrantOutcome) -> None:
        """The message ``token`` has arrived (or failed): its grant is over."""
        slab = self._grants.pop(token, None)
        if slab is None:
            return
        slab.granted_to = None
        if outcome is GrantOutcome.USED:
            slab.lease_token = token
        elif outcome is GrantOutcome.BUSY:
            self._retire(slab)  # the producer still views it: never write into it again
        elif outcome is GrantOutcome.LATE:
            self._late_pause = LATE_PAUSE_GRANTS  # the consumer keeps batches: stop deferring

    def cancel_all_grants(self) -> None:
        """Every producer has answered for all it was sent (an epoch restart): grants still open
        belong to tasks it dropped, and their slabs are free again. Tokens start afresh."""
        for token in list(self._grants):
            self.settle(token, GrantOutcome.UNUSED)
        self._handed_out.clear()
        for slab in self._slabs.values():
            slab.lease_token = None

    def cancel_grants_of(self, producer: int) -> None:
        """``producer`` will build nothing more it was sent (its iterable ran dry)."""
        for token, slab in list(self._grants.items()):
            if slab.granted_producer == producer:
                self.settle(token, GrantOutcome.UNUSED)

    def forget_producer(self, producer: int) -> None:
        """``producer`` has stopped (a pool shrinking in place): a later producer that takes its
        number starts with nothing mapped, so the board and every slab are announced afresh."""
        self.cancel_grants_of(producer)
        self._controls.pop(producer, None)
        self.controls_queued.pop(producer, None)
        for slab in (*self._slabs.values(), *self._retired_in_use.values()):
            slab.mapped_by.discard(producer)

    def handed_out(self, token: int) -> None:
        """Batch ``token`` was just given to the consumer (feeds the choice of deferred grants)."""
        self._handed_out.append(token)

    # -- controls to producers ---------------------------------------------------------

    def _announce(self, producer: int, slab: _Slab) -> None:
        if producer not in self.controls_queued:
            self._queue(producer, SlabControl(SlabControlKind.BOARD, size=BOARD_BYTES),
                        [self._board_fd])
        self._queue(producer, SlabControl(SlabControlKind.MAP, slab.slab_id, slab.size), [slab.fd])
        slab.mapped_by.add(producer)

    def _queue(self, producer: int, control: SlabControl, fds: list[int]) -> None:
        self._controls.setdefault(producer, []).append((control, fds))
        self.controls_queued[producer] = self.controls_queued.get(producer, 0) + 1

    def take_controls(self, producer: int) -> list[tuple[SlabControl, list[int]]]:
        """Controls to send to ``producer`` now, before the command carrying its next grant.

        The descriptors stay owned by the pool; the sender only passes copies through the socket.
        """
        return self._controls.pop(producer, [])

    # -- leases (decoding side) ------------------------------------------------------------

    def open_lease(self, slab_id: int) -> memoryview:
        """A fresh per-batch view of slab ``slab_id``; the slab is released when it dies.

        Raises:
            ValueError: if the slab is unknown or not granted (a corrupt or stale message).
        """
        slab = self._slabs.get(slab_id)
        if slab is None or slab.granted_to is None:
            raise ValueError(f"a message refers to slab {slab_id}, which was not granted")
        lease = slab.array[:]
        slab.leases_made += 1
        finalizer = weakref.finalize(lease, _released, slab, self._board, self._pinned_releases,
                                     self.pin_lock)
        finalizer.atexit = False
        return memoryview(lease)

    # -- pinning ------------------------------------------------------------------------

    def _pin_slab(self, slab: _Slab) -> None:
        address = slab.array.ctypes.data
        if host_pinning.register(address, slab.size):
            slab.pinned_address = address

    def _apply_pinned_releases(self) -> None:
        queue = self._pinned_releases
        if not queue:
            return
        waiting = []
        while queue:
            slab, marker = queue.popleft()
            if host_pinning.marker_done(marker):
                self._board[slab.slab_id] += 1
            else:
                waiting.append((slab, marker))
        queue.extend(waiting)

    def _wait_for_pinned_releases(self) -> None:
        # Tearing down: copies still reading a pinned slab must end before it is unregistered.
        queue = self._pinned_releases
        while queue:
            slab, marker = queue.popleft()
            host_pinning.wait_for_marker(marker)
            self._board[slab.slab_id] += 1

    # -- retiring ---------------------------------------------------------------------------

    def _retire_surplus(self) -> None:
        """Retire free slabs that are too small now, or more than the limit allows."""
        free = [s for s in self._slabs.values() if self._is_free(s)]
        for slab in free:
            if slab.size < self._wanted_size:
                self._retire(slab)
        excess = len(self._slabs) - self._slab_limit
        for slab in [s for s in free if not s.retired][:max(0, excess)]:
            self._retire(slab)

    def _retire(self, slab: _Slab) -> None:
        """Stop using ``slab``: producers forget it; it is unmapped when its last view dies."""
        self._slabs.pop(slab.slab_id, None)
        if int(self._board[slab.slab_id]) != slab.leases_made:
            self._retired_in_use[slab.slab_id] = slab
        for producer in sorted(slab.mapped_by):
            self._queue(producer, SlabControl(SlabControlKind.FORGET, slab.slab_id), [])
        _close_fd(slab)
        with self.pin_lock:
            slab.retired = True
            if slab.pinned_address and int(self._board[slab.slab_id]) == slab.leases_made:
                _unpin(slab)

    def close(self) -> None:
        """Retire every slab; slabs still viewed by batches are unmapped when those die."""
        if self._closed:
            return
        self._closed = True
        self._wait_for_pinned_releases()
        for slab in list(self._slabs.values()):
            self._retire(slab)
        self._grants.clear()
        self._controls.clear()
        self._retired_in_use.clear()
        if self._board_fd >= 0:
            os.close(self._board_fd)
            self._board_fd = -1
        # A closed pool may live on (an exception's traceback holds the engine): let go of the
        # mappings now; batches still alive keep theirs through their leases.
        self._board = self._board_mapping = None  # type: ignore[assignment]


def _released(slab: _Slab, board: np.ndarray, pinned: collections.deque | None,
              pin_lock: threading.Lock) -> None:
    """The last view of one batch on ``slab`` died (any thread): count the release."""
    if pinned is None:
        board[slab.slab_id] += 1
        return
    marker = host_pinning.release_marker()
    with pin_lock:
        if not slab.retired:
            pinned.append((slab, marker))
            return
    host_pinning.wait_for_marker(marker)  # torn down: nobody will reuse it, just unpin it safely
    with pin_lock:
        _unpin(slab)


def _unpin(slab: _Slab) -> None:
    if slab.pinned_address:
        host_pinning.unregister(slab.pinned_address)
        slab.pinned_address = 0


def _close_fd(slab: _Slab) -> None:
    if slab.fd >= 0:
        os.close(slab.fd)
        slab.fd = -1


def _round_up(value: int, step: int) -> int:
    return -(-value // step) * step
