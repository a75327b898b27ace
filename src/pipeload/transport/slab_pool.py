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
first writes, for the release to land. A pinned slab's release lands once a CUDA event recorded
at release time shows that asynchronous copies out of the slab are done (a watcher thread waits
for it, see host_pinning.py), so pinned slabs are granted ahead the same way.

A producer with no slab to write a large message into (a new set of workers' first batches, before
the pool knows how large a batch is) may write it into a buffer of its own, sized as a slab, and
offer it (see slab_writer.py). The pool takes it over (``adopt``) when it has room for another
slab: the batch is leased from it as from any slab, and once the producer's views note says its
code keeps nothing of it, it is granted like the others. A new loader's first slabs are then the
buffers its first batches travelled in, whose pages were paid for once, not made again.

The pool may outlive the producers it serves: a loader keeps one pool for the worker sets it
starts one after another (see slab_keeper.py). ``detach_producers`` forgets the producers of a set
that has stopped, and the next set is announced the slabs it is granted, mapped and page-locked
already; ``fit`` shrinks the pool to what the next set may use.
"""

from __future__ import annotations

import collections
import errno
import os
import threading
import weakref

from pipeload.transport import host_pinning
from pipeload.transport.messages import GrantOutcome, SlabControl, SlabControlKind, SlabGrant
from pipeload.transport.shared_memory import warn_if_dev_shm_too_small
from pipeload.transport.slab_memory import batch_slab_size
from pipeload.transport.slab_records import (
    MAX_SLABS,
    ControlQueues,
    ReleaseBoard,
    SlabCounts,
    SlabRecord,
    release_callback,
)

__all__ = ["SlabCounts", "SlabPool"]
LATE_PAUSE_GRANTS = 64  # after a deferred grant came too late, grant only free slabs this long
LARGE_BATCH_BYTES = 8 << 20  # from here on, when fresh pages are mapped matters for the peak
# A free slab beyond the limit is retired only once the pool has held more than its limit for
# this many grants in a row: the in-flight budget moves by one now and then (a slow build on a
# busy machine), and a slab retired on one grant and made again a few later costs its pages twice.
SURPLUS_PATIENCE_GRANTS = 16
# The batch a training loop holds while it asks for the next, and that next one: the fewest
# slabs that keep batches off fresh memory. A user's byte budget below two slabs does not lower
# the pool under them: with one slab, held by the loop, every other batch went to a fresh
# buffer, uncounted, and the budget took 1.5 times the memory no budget took (stop 54's
# transport skeptic: 48.8 MiB under a 24 MiB budget, 32.5 MiB with none). A budget read from
# what the memory can still take is kept to the byte: there, a second slab may not fit at all.
LOOP_FLOOR_SLABS = 2


CARRIED_TOKEN = -1  # the last batch handed out before tokens started afresh (cancel_all_grants)


class SlabPool:
    """Slabs owned by one consumer, granted to its producers one message at a time.

    Driven by one thread (the engine's); release finalizers may run on any thread and touch only
    the board (unpinned) or hand the release to the watcher (pinned), whose thread touches the
    board and unpins under ``pin_lock``.

    Invariants between calls:
      - a slab is free exactly when ``granted_to is None`` and its board count equals
        ``leases_made``;
      - a slab has at most one grant outstanding, and a producer writes into it only after the
        board shows the count its grant names;
      - a grant tells the producer how many controls it must have applied before writing (see
        ``ControlQueues`` in slab_records.py);
      - never more than ``max_bytes`` of slabs, or ``floor_slabs`` slabs where fewer would not
        fit it (a user's budget: ``LOOP_FLOOR_SLABS``); more than the slab limit only while the surplus
        is younger than ``SURPLUS_PATIENCE_GRANTS`` grants.

    Example:
        >>> pool = SlabPool(pin=False, max_bytes=1 << 30)
        >>> pool.observe_batch(4 << 20)
        >>> pool.set_slab_limit(3)
        >>> grant = pool.grant(producer=0, token=0)   # a new slab, announced to producer 0
        >>> controls = pool.take_controls(0)           # send these before the grant
    """

    def __init__(self, *, pin: bool, max_bytes: int, batches_in_flight: int = 1, floor_slabs: int = 0) -> None:
        self._pin = pin and host_pinning.can_register()
        self._pin_device: int | None = None  # the main thread's device, read at the first slab
        self._batches_in_flight = batches_in_flight  # at most, for the /dev/shm comparison
        self._max_bytes = max_bytes
        self._floor_slabs = floor_slabs  # slabs the pool may hold beyond max_bytes (LOOP_FLOOR_SLABS)
        self._slab_limit = 0
        self._in_flight = 0  # batches the engine keeps in flight (see set_in_flight)
        self._grants_ahead = 2
        self._surplus_grants = 0  # grants in a row made while the pool held more than its limit
        self._wanted_size = 0
        self._largest_batch = 0
        self._batches_seen = False
        self._slabs: dict[int, SlabRecord] = {}
        self._retired_in_use: dict[int, SlabRecord] = {}  # ids not reused until their views are gone
        self._grants: dict[int, SlabRecord] = {}  # token -> slab
        self._controls = ControlQueues()
        self._handed_out: collections.deque[int] = collections.deque(maxlen=2)
        self._late_pause = 0
        self._adopted_unsettled: SlabRecord | None = None  # taken over by the message being read
        self._board = ReleaseBoard()
        self._watcher: host_pinning.ReleaseWatcher | None = None  # made with the first pinned slab
        self.pin_lock = threading.Lock()
        self.counts = SlabCounts()
        self._closed = False

    @property
    def pinned(self) -> bool:
        """Whether slabs are page-locked for CUDA (so their batches come out pinned)."""
        return self._pin

    @property
    def closed(self) -> bool:
        return self._closed

    @property
    def defers_releases(self) -> bool:
        """Whether a slab may be granted before its previous batch is freed (see the module)."""
        return self._late_pause == 0

    @property
    def slab_count(self) -> int:
        """How many slabs the pool holds now (not counting retired ones still viewed)."""
        return len(self._slabs)

    @property
    def slab_bytes(self) -> int:
        """Bytes of all slabs the pool holds now."""
        return sum(slab.size for slab in self._slabs.values())

    def set_slab_limit(self, slabs: int) -> None:
        """How many slabs the pool may hold (see ``set_in_flight``)."""
        self._slab_limit = max(0, slabs)

    def set_in_flight(self, batches: int, grants_ahead: int = 2) -> None:
        """The engine keeps ``batches`` in flight now: the pool may hold a slab for each, one for
        the batch the consumer holds and (unless grants ahead work) one for the batch it drops.

        ``grants_ahead``: which slabs may be granted before they are free (see
        ``_about_to_be_released``): 2, the dropped batch's and the latest's; 1, the dropped
        batch's only (producers that write as soon as they start, as economic item workers
        do); 0, none (a consumer that may hold many messages at once, as a pipe downstream of a
        queue boundary batching them).
        """
        self._grants_ahead = grants_ahead
        self._in_flight = batches
        ahead = self.defers_releases and grants_ahead > 0
        self.set_slab_limit(batches + (1 if ahead else 2))

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
        if shared_bytes > 0:
            self.counts.batches_in_shared_memory += 1
        if shared_bytes <= self._largest_batch:
            return
        if self._largest_batch == 0:
            warn_if_dev_shm_too_small(shared_bytes, self._batches_in_flight)
        self._largest_batch = shared_bytes
        self._wanted_size = max(self._wanted_size, batch_slab_size(shared_bytes))

    # -- between worker sets -------------------------------------------------------------

    def fit(self, max_bytes: int, batches_in_flight: int, floor_slabs: int = 0) -> None:
        """Serve a new set of producers that may keep ``batches_in_flight`` batches in flight
        (plus one held) within ``max_bytes`` (or ``floor_slabs`` slabs, see ``LOOP_FLOOR_SLABS``):
        free slabs beyond what it can use go now."""
        self._max_bytes = max_bytes
        self._floor_slabs = floor_slabs
        self._batches_in_flight = batches_in_flight
        most = batches_in_flight + 1  # in flight, held, and (until grants ahead work) one more
        for slab in sorted(self._slabs.values(), key=lambda s: -s.slab_id):
            if len(self._slabs) <= most and (self.slab_bytes <= max_bytes or len(self._slabs) <= floor_slabs):
                break
            if self._is_free(slab):
                self._retire(slab)
        self._surplus_grants = 0

    def trim_to_budget(self) -> None:
        """Retire free slabs until the pool holds no more than ``max_bytes``, its floor dropped
        (no set of producers uses it now: an idle loader under a budget of a batch and a half
        kept two slabs, and four such loaders held eight)."""
        self._floor_slabs = 0
        for slab in sorted(self._slabs.values(), key=lambda s: -s.slab_id):
            if self.slab_bytes <= self._max_bytes:
                break
            if self._is_free(slab):
                self._retire(slab)

    def detach_producers(self) -> None:
        """Every producer has stopped (a worker set's end): open grants are settled as unused,
        and a later producer with the same number starts with nothing mapped (the board and each
        slab it is granted are announced afresh). Slabs, their pages and page-locking stay."""
        self.cancel_all_grants()
        self._controls.clear()
        for slab in (*self._slabs.values(), *self._retired_in_use.values()):
            slab.mapped_by.clear()
            slab.unconfirmed_by, slab.still_viewed = None, False  # its producer stopped: nothing of it is sent again

    # -- granting ------------------------------------------------------------------------

    def grant(self, producer: int | None, token: int, shared: bool = False) -> SlabGrant | None:
        """A slab for the message ``token`` that ``producer`` builds next, or None (fresh memory).
        ``producer`` None: the consumer builds it itself from what producers write into the slab
        by ``share_grant`` (economic mode's direct batches); nobody is announced the slab here.
        ``shared``: other producers will write into it too (``share_grant``)."""
        if self._closed or self._wanted_size == 0:
            return None
        self._retire_surplus()
        slab, releases = self._choose(producer, shared or producer is None)
        if slab is None:
            return None
        self.settle(token, GrantOutcome.UNUSED)  # a token is granted once; never leak a slab
        slab.granted_to = token
        slab.granted_producer = producer
        slab.granted_releases = releases
        self._grants[token] = slab
        if producer is None:
            return SlabGrant(slab.slab_id, releases, 0)
        if producer not in slab.mapped_by:
            self._announce(producer, slab)
        return SlabGrant(slab.slab_id, releases, self._controls.sent(producer))

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
        controls = self._controls.sent(producer)
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
        return not self._about_to_be_released(peek=True)  # (the latest's counts: its wait is short)

    def _choose(self, producer: int | None, shared: bool = False) -> tuple[SlabRecord | None, int]:
        """The slab for ``producer``'s next message, and the board count it must wait for.

        A slab the producer has mapped already costs it nothing; any other costs it a mapping (a
        page-table entry per page, set up now and torn down when it exits, which a new set of
        workers pays for each slab it touches); a new slab costs its pages, zeroed, and memory
        for as long as the pool lives. So: the producer's own slab, free or about to be released;
        then anyone's free slab; then the slab of the batch being dropped; then a new one.
        """
        free = [s for s in self._slabs.values()
                if self._is_free(s) and s.size >= self._wanted_size and self._may_take(s, producer, shared)]
        deferred = [s for s in self._about_to_be_released() if self._may_take(s, producer, shared)]
        for slab in (*free, *deferred):
            if producer in slab.mapped_by:
                return slab, slab.leases_made
        if free:
            return free[0], free[0].leases_made
        dropped = [s for s in deferred if len(self._handed_out) == 2
                   and s.lease_token == self._handed_out[0]]
        if dropped:
            return dropped[0], dropped[0].leases_made
        if self._may_grow():
            try:
                return self._make_slab(), 0
            except OSError as error:
                # No room to map another slab: memory ran short since the budget was read (a
                # lowered ``ulimit -v``, other allocations). As when the budget says so, the
                # message goes to fresh memory, whose own failure is a clear error where it is
                # made; raised here, a process queue took it for its far end's death and sent
                # no credit, and both ends waited for good.
                if error.errno != errno.ENOMEM:
                    raise
        return None, 0

    @staticmethod
    def _may_take(slab: SlabRecord, producer: int | None, shared: bool) -> bool:
        """Whether ``producer`` may write into ``slab``: yes unless the producer that wrote its
        last batch may still view it (it has not said otherwise since, see ``producer_views``).
        That producer alone may, when it writes alone: it checks its own views before writing."""
        if slab.unconfirmed_by is None:
            return True
        return slab.unconfirmed_by == producer and not shared and not slab.still_viewed

    def producer_views(self, producer: int, still_viewed: tuple[int, ...],
                       offers_viewed: tuple[tuple[int, int], ...] = ()) -> None:
        """``producer`` holds nothing of what it sent but views of ``still_viewed`` (slab ids):
        its other slabs may go to anyone now. One it still views is held back from everyone,
        itself included: a collate function that keeps its last output lets go of it with its
        next batch, and the next note frees the slab; one still viewed at the next note too (a
        batch kept for longer) is retired, so that the pool makes another rather than wait.

        ``offers_viewed``: the buffers it offered (``adopt``) that it still views, by (device,
        inode): each is dealt with as a slab named in ``still_viewed``, from the note that follows
        the batch it came with on."""
        for slab in list(self._slabs.values()):
            if slab.unconfirmed_by != producer:
                continue
            if slab.slab_id not in still_viewed and (slab.buffer is None or slab.buffer not in offers_viewed):
                slab.unconfirmed_by, slab.still_viewed = None, False
            elif not slab.still_viewed:
                slab.still_viewed = True
            elif slab.granted_to is None:  # (granted again to it: its own check refuses it, BUSY)
                self.counts.busy += 1
                self._retire(slab)

    def _make_slab(self) -> SlabRecord:
        slab = self._new_record(self._wanted_size)
        self.counts.slabs_made += 1
        return slab

    def _new_record(self, size: int, fd: int | None = None) -> SlabRecord:
        if self._pin and self._pin_device is None:
            self._pin_device = host_pinning.current_device()
        slab = SlabRecord(self._next_id(), size, self._pin_device if self._pin else None, fd)
        self._board.counts[slab.slab_id] = 0
        self._slabs[slab.slab_id] = slab
        return slab

    def adopt(self, fd: int, size: int, shared_bytes: int, producer: int) -> memoryview | None:
        """A lease on the buffer of ``size`` bytes (descriptor ``fd``, which stays the caller's)
        that ``producer`` wrote the message being decoded into, taken over as a slab; None when
        the pool has no use for it: closed, the buffer smaller than a slab for these batches
        (``shared_bytes``, what the message needed, counts), or no room for another slab under
        the slab limit or the byte budget. The caller then maps it for this batch alone.

        Until ``producer``'s next views note, the slab is granted to ``producer`` alone: user code
        there (a collate function keeping its output) may still view the buffer, which that
        producer's check before writing sees (it maps the slab through its own mapping of the
        buffer, see ``SlabWriter.apply``) and another producer's would not.
        """
        if self._closed or size < batch_slab_size(max(self._largest_batch, shared_bytes)):
            return None
        if not self._may_grow(size):
            return None
        owned = os.dup(fd)
        try:
            slab = self._new_record(size, owned)
        except OSError:
            os.close(owned)
            return None  # (cannot be mapped: the caller's own attempt says so, and why)
        except BaseException:
            os.close(owned)
            raise
        found = os.fstat(fd)
        # As a slab it has just written: its producer alone may have it until its note says it
        # views it no more (producer_views), and its notes name it by (device, inode).
        slab.unconfirmed_by, slab.buffer = producer, (found.st_dev, found.st_ino)
        self._adopted_unsettled = slab
        self.counts.slabs_adopted += 1
        return self._lease_on(slab)

    def _about_to_be_released(self, peek: bool = False) -> list[SlabRecord]:
        """Slabs that may be granted before they are free, best first: the one of the batch
        handed out before the latest, which a ``for`` loop drops as it takes the next (released
        a moment from now); and, while three or more batches are in flight, the latest's, which
        it drops one step later (by the time a worker has fetched a batch's samples, which takes
        several steps then). With round-robin workers and ``prefetch_factor * num_workers`` in
        flight, the latest batch came from the worker the next task goes to: it writes again
        into its own slab, which it has mapped."""
        if self._late_pause > 0 or not self._handed_out or self._grants_ahead == 0:
            if not peek:
                self._late_pause = max(0, self._late_pause - 1)
            return []
        tokens = [self._handed_out[0]] if len(self._handed_out) == 2 else []
        if self._in_flight >= 3 and self._grants_ahead >= 2:
            tokens.append(self._handed_out[-1])
        found = []
        for token in tokens:
            for slab in self._slabs.values():
                if (slab.lease_token == token and slab.granted_to is None
                        and slab.size >= self._wanted_size and not self._is_free(slab)):
                    found.append(slab)
        return found

    def _may_grow(self, size: int | None = None) -> bool:
        """Whether the pool may hold one more slab (of ``size``, else of the wanted size)."""
        return (len(self._slabs) - self._held_back() < self._slab_limit
                and len(self._slabs) + len(self._retired_in_use) < MAX_SLABS
                and (len(self._slabs) < self._floor_slabs
                     or self.slab_bytes + (self._wanted_size if size is None else size) <= self._max_bytes))

    def _held_back(self) -> int:
        """Slabs a worker's note said it still views: out of use until a later note (a collate
        function keeping its last output holds one at a time). They count against the byte
        budget, not against the slab limit, which is for the batches in flight."""
        return sum(1 for slab in self._slabs.values() if slab.still_viewed)

    def _next_id(self) -> int:
        # A retired slab's id is reused only once its last batch is released: a late release
        # must never count towards the slab that took its place.
        for slab_id, slab in list(self._retired_in_use.items()):
            if self._board.released(slab_id) == slab.leases_made:
                del self._retired_in_use[slab_id]
        taken = self._slabs.keys() | self._retired_in_use.keys()
        return next(i for i in range(MAX_SLABS) if i not in taken)

    def _is_free(self, slab: SlabRecord) -> bool:
        return slab.granted_to is None and self._board.released(slab.slab_id) == slab.leases_made

    def settle(self, token: int, outcome: GrantOutcome) -> None:
        """The message ``token`` has arrived (or failed): its grant is over. A slab just taken
        over from it (``adopt``) learns whose batch it holds, as a granted one does."""
        adopted, self._adopted_unsettled = self._adopted_unsettled, None
        if adopted is not None:
            adopted.lease_token = token  # (its slab may be granted ahead once the batch is dropped)
        slab = self._grants.pop(token, None)
        if slab is None:
            return
        slab.granted_to = None
        if outcome is GrantOutcome.USED:
            slab.lease_token = token
            self.counts.batches_in_slabs += 1
            if slab.granted_producer is not None and slab.granted_producer >= 0:
                slab.unconfirmed_by, slab.still_viewed = slab.granted_producer, False
        elif outcome is GrantOutcome.BUSY:
            self.counts.busy += 1
            self._retire(slab)  # the producer still views it: never write into it again
        elif outcome is GrantOutcome.LATE:
            self.counts.late += 1
            self._late_pause = LATE_PAUSE_GRANTS  # the consumer keeps batches: stop deferring

    def cancel_all_grants(self) -> None:
        """Every producer has answered for all it was sent (an epoch restart, or a set of
        workers' end): grants still open belong to tasks it dropped, and their slabs are free
        again. Tokens start afresh, but the last batch handed out stays known under
        ``CARRIED_TOKEN``: a ``for`` loop still holds it as the next epoch starts and drops it
        when it takes that epoch's first batch, so its slab can be granted ahead then, as within
        an epoch (without it, the next epoch's third batch found no slab whenever the loop kept
        the last one alive)."""
        for token in list(self._grants):
            self.settle(token, GrantOutcome.UNUSED)
        last = self._handed_out[-1] if self._handed_out else None
        self._handed_out.clear()
        for slab in self._slabs.values():
            held = last is not None and slab.lease_token == last and not self._is_free(slab)
            slab.lease_token = CARRIED_TOKEN if held else None
            if held:
                self._handed_out.append(CARRIED_TOKEN)

    def cancel_grants_of(self, producer: int) -> None:
        """``producer`` will build nothing more it was sent (its iterable ran dry)."""
        for token, slab in list(self._grants.items()):
            if slab.granted_producer == producer:
                self.settle(token, GrantOutcome.UNUSED)

    def forget_producer(self, producer: int) -> None:
        """``producer`` has stopped (a pool shrinking in place): a later producer that takes its
        number starts with nothing mapped, so the board and every slab are announced afresh."""
        self.cancel_grants_of(producer)
        self._controls.forget(producer)
        for slab in (*self._slabs.values(), *self._retired_in_use.values()):
            slab.mapped_by.discard(producer)
            if slab.unconfirmed_by == producer:
                slab.unconfirmed_by, slab.still_viewed = None, False

    def handed_out(self, token: int) -> None:
        """Batch ``token`` was just given to the consumer (feeds the choice of deferred grants)."""
        self._handed_out.append(token)

    # -- controls to producers ---------------------------------------------------------

    def _announce(self, producer: int, slab: SlabRecord) -> None:
        if not self._controls.knows(producer):
            self._controls.queue(producer, *self._board.announce())
        self._controls.queue(producer, SlabControl(SlabControlKind.MAP, slab.slab_id, slab.size),
                             [slab.fd])
        slab.mapped_by.add(producer)
        self.counts.slab_mappings += 1

    def take_controls(self, producer: int) -> list[tuple[SlabControl, list[int]]]:
        """Controls to send to ``producer`` now, before the command carrying its next grant.

        The descriptors stay owned by the pool; the sender only passes copies through the socket.
        """
        return self._controls.take(producer)

    # -- leases (decoding side) ------------------------------------------------------------

    def open_lease(self, slab_id: int) -> memoryview:
        """A fresh per-batch view of slab ``slab_id``; the slab is released when it dies.

        A pinned slab's batch waits here until the slab's page-locking is done (it usually is
        long before: it runs while the producer builds the batch), so that it answers
        ``is_pinned()`` as the training loop expects.

        Raises:
            ValueError: if the slab is unknown or not granted (a corrupt or stale message).
        """
        slab = self._slabs.get(slab_id)
        if slab is None or slab.granted_to is None:
            raise ValueError(f"a message refers to slab {slab_id}, which was not granted")
        if self._pin:
            slab.memory.wait_prepared()
        return self._lease_on(slab)

    def _lease_on(self, slab: SlabRecord) -> memoryview:
        """A per-batch view of ``slab``, counted as one of its leases."""
        if self._pin and self._watcher is None:
            self._watcher = host_pinning.ReleaseWatcher(self._pin_device)
        lease = slab.memory.array[:]
        slab.leases_made += 1
        finalizer = weakref.finalize(lease, *release_callback(slab, self._board, self._watcher,
                                                              self.pin_lock))
        finalizer.atexit = False
        return memoryview(lease)

    # -- retiring ---------------------------------------------------------------------------

    def _retire_surplus(self) -> None:
        """Retire free slabs that are too small now, and the free ones beyond the limit once the
        pool has held more than its limit for ``SURPLUS_PATIENCE_GRANTS`` grants in a row."""
        free = [s for s in self._slabs.values() if self._is_free(s)]
        for slab in free:
            if slab.size < self._wanted_size:
                self._retire(slab)
        excess = len(self._slabs) - self._held_back() - self._slab_limit
        self._surplus_grants = self._surplus_grants + 1 if excess > 0 else 0
        if self._surplus_grants < SURPLUS_PATIENCE_GRANTS:
            return
        for slab in [s for s in free if not s.retired][:max(0, excess)]:
            self._retire(slab)
        self._surplus_grants = 0

    def _retire(self, slab: SlabRecord) -> None:
        """Stop using ``slab``: producers forget it; it is unmapped when its last view dies."""
        self._slabs.pop(slab.slab_id, None)
        self.counts.slabs_retired += 1
        if self._board.released(slab.slab_id) != slab.leases_made:
            self._retired_in_use[slab.slab_id] = slab
        for producer in sorted(slab.mapped_by):
            self._controls.queue(producer, SlabControl(SlabControlKind.FORGET, slab.slab_id), [])
        slab.memory.close_fd()
        slab.memory.wait_prepared()  # no preparation thread outlives its slab's pool
        with self.pin_lock:
            slab.retired = True
            if self._pin and self._board.released(slab.slab_id) == slab.leases_made:
                slab.memory.unpin()

    def close(self) -> None:
        """Retire every slab; slabs still viewed by batches are unmapped when those die."""
        if self._closed:
            return
        self._closed = True
        if self._watcher is not None:
            self._watcher.close()  # copies still reading a pinned slab end before it is unpinned
        for slab in list(self._slabs.values()):
            self._retire(slab)
        self._grants.clear()
        self._controls.clear()
        self._retired_in_use.clear()
        # A closed pool may live on (an exception's traceback holds the engine): let go of the
        # mappings now; batches still alive keep theirs through their leases.
        self._board.close()

