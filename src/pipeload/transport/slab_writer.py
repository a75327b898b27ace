"""The producer's side of the slab transport: the slabs it has mapped, and the one it may fill now.

A producer (a worker process) maps each slab once, when the owner announces it, and keeps the
mapping until told to forget it, so a reused slab costs no page faults. A producer that writes
whole large batches has the mapping populated on a thread of its own (slab_memory.py) while it
fetches the samples that will fill it. For each message the owner
may grant one slab; tensors are placed in it with a bump allocator (64-byte aligned) until it is
full, and whatever does not fit goes to a fresh one-shot buffer instead.

Before the first write into a granted slab the producer checks two things: that the release board
shows the count the grant names (the batch that viewed the slab before has been freed; waiting at
most ``RELEASE_WAIT_S``), and that no tensor of an earlier message still views the slab in this
process (user code that kept a batch). Either failing, the message goes to fresh memory and the
owner learns why from the grant's outcome.

A producer that runs the user's collate function (a classic worker) may *offer* its fresh memory
as a slab: a large message with no slab to go to, before it has been granted any (a new set of
workers' first batches: the owner does not know how large a batch is yet), is written into one
buffer, sized and laid out as a slab would be, which travels as the message's slab. The owner may
take it over (``SlabPool.adopt``); its views notes then name the buffer, by its inode, for as long
as something here still views it, and the owner grants it to no one meanwhile. Its pages, paid for
by this batch, serve later ones instead of a new slab's. A producer that maps slabs offers nothing:
a batch without a slab then means the owner has no room for another.
"""

from __future__ import annotations

import mmap
import os
import time
from collections.abc import Callable

import numpy as np
import torch

from pipeload.transport.messages import (
    GrantOutcome,
    ItemPlacement,
    SlabControl,
    SlabControlKind,
    SlabGrant,
)
from pipeload.transport.shared_memory import create_buffer
from pipeload.transport.slab_memory import Preparation, batch_slab_size, populate, populate_in_background

OFFER_FROM_BYTES = 1 << 20  # smaller messages go to plain one-shot buffers: a slab costs little
OFFERED_SLAB_ID = -1  # what a message's own buffer is called where a slab id is kept
RELEASE_WAIT_S = 0.1
RELEASE_POLL_S = 0.0002
ALIGN_BYTES = 64
PAGE = mmap.PAGESIZE


class _MappedSlab:
    __slots__ = ("slab_id", "size", "mapping", "storage", "baseline_uses", "populating")

    def __init__(self, slab_id: int, size: int, fd: int, populate: bool) -> None:
        self.slab_id = slab_id
        self.size = size
        self.mapping = mapping = mmap.mmap(fd, size, flags=mmap.MAP_SHARED)
        self.storage = torch.frombuffer(mapping, dtype=torch.uint8).untyped_storage()
        self.baseline_uses = _uses(self.storage)
        # A producer that writes whole large batches gets the slab populated in one kernel loop,
        # cheaper than a fault per page, on a thread while it fetches. One that writes a few rows
        # (an economic item worker) or reads what others wrote (a batch worker) faults in only
        # the pages it touches, or each of them would hold every slab in its resident set. A
        # small slab is not populated either: its faults cost little, and populating would make
        # its headroom (beyond the largest batch so far) resident in every producer for nothing.
        self.populating: Preparation | None = (
            populate_in_background(mapping, self.storage.data_ptr(), size) if populate else None)


def in_place(part: torch.Tensor, address: int) -> bool:
    """Whether ``part`` lies, contiguous, at ``address`` (an item at its place in the slab)."""
    return part.data_ptr() == address and part.is_contiguous()


def one_shot_storage(nbytes: int) -> torch.UntypedStorage:
    """A fresh descriptor-backed shared storage of ``nbytes``, freed when its last user goes.

    Its pages are allocated and mapped at once (the caller is about to write all of them), so the
    cost of fresh memory is paid here, where it is timed as set-up, not in the copy after it.
    """
    fd = create_buffer(nbytes, allocate=True)
    try:
        storage = torch.UntypedStorage._new_shared_fd_cpu(fd, nbytes)  # keeps its own descriptor
    finally:
        os.close(fd)
    if nbytes:
        _touch_pages(storage, nbytes)
    return storage


def _touch_pages(storage: torch.UntypedStorage, nbytes: int) -> None:
    """Fault every page of ``storage`` in, one write per page."""
    pages = torch.empty((0,), dtype=torch.uint8).set_(storage, 0, ((nbytes + PAGE - 1) // PAGE,),
                                                     (PAGE,))
    pages.zero_()


def _uses(storage: torch.UntypedStorage) -> int:
    return torch._C._storage_Use_Count(storage._cdata)


class SlabWriter:
    """Slabs mapped by one producer, and the space it is filling for the current message.

    Owned by the producer's single thread.
    Invariants: bytes are written only into the slab of the current grant, only after the board
    showed the count the grant names and no earlier tensor in this process still viewed it;
    ``used_bytes`` never exceeds that slab's size.
    """

    def __init__(self, populate: bool = True) -> None:
        self.populate = populate  # map slabs with every page faulted in (whole-batch producers)
        self._slabs: dict[int, _MappedSlab] = {}
        self._board: np.ndarray | None = None
        self.controls_applied = 0
        self._grant: SlabGrant | None = None
        self._slab: _MappedSlab | None = None
        self._checked = False
        self._outcome = GrantOutcome.NO_GRANT
        self.used_bytes = 0
        self.one_shot_bytes = 0
        self.setup_s = 0.0
        self._placing: _ItemCursor | None = None
        # The current message carries economic items: every storage asks ``allocate`` for its
        # place, whatever its size (see place_items).
        self.carries_items = False
        self._claimed: set[int] = set()
        # The pieces of the granted slab handed out in this message, (offset, bytes): an output's
        # room, a claimed run of rows. Each arrives as a storage of its own (see region_of).
        self._regions: list[tuple[int, int]] = []
        # A classic worker's samples, written into their rows as they were fetched (take_rows).
        self._rows: ItemPlacement | None = None
        # Batch worker: the slab's byte ranges the batch's decoded items view (None: unknown),
        # worked out on first use (see occupied_from).
        self._occupied: list[tuple[int, int]] | None = None
        self._occupied_source: Callable[[], list[tuple[int, int]] | None] | None = None
        self.large_sizes: list[int] = []  # of the storages the current message asked room for
        self.last_large_sizes: list[int] = []  # the same, for the message finished last
        self.last_outcome = GrantOutcome.NO_GRANT  # what became of the grant of the message finished last
        # Whether a large message with no slab may be written into a buffer of its own, offered
        # to the owner as a slab (see the module): only a producer that sends views notes.
        self.offers_buffers = False
        self._offer: _Offer | None = None  # the current message's
        self._sent_offer: _Offer | None = None  # the last message's, until the views note
        self._kept_offers: list[_Offer] = []  # sent ones user code here still viewed then

    # -- controls from the owner -------------------------------------------------------

    def apply(self, control: SlabControl, fds: list[int]) -> None:
        """Apply one control; takes ownership of (and closes) its descriptors."""
        try:
            if control.kind is SlabControlKind.BOARD:
                board = mmap.mmap(fds[0], control.size, prot=mmap.PROT_READ)
                self._board = np.frombuffer(board, dtype=np.uint64)
            elif control.kind is SlabControlKind.MAP:
                self._slabs[control.slab_id] = (self._own_offer(control.slab_id, fds[0])
                                                or _MappedSlab(control.slab_id, control.size, fds[0],
                                                               self.populate))
            elif control.kind is SlabControlKind.FORGET:
                # Unmapped once no tensor here views it any more (usually at once).
                self._slabs.pop(control.slab_id, None)
        finally:
            for fd in fds:
                os.close(fd)
            self.controls_applied += 1

    # -- one message --------------------------------------------------------------------

    def begin(self, grant: SlabGrant | None, setup_s: float = 0.0) -> None:
        """Start a message that may use ``grant``'s slab (``setup_s`` already spent on it)."""
        self.setup_s = setup_s
        self._grant = grant
        self._slab = None if grant is None else self._slabs.get(grant.slab_id)
        self._checked = False
        self._outcome = GrantOutcome.NO_GRANT if grant is None else GrantOutcome.UNUSED
        # A batch worker's own outputs go after the item area its item workers fill.
        self.used_bytes = 0 if grant is None or grant.items is None else grant.items.area_bytes
        self.one_shot_bytes = 0
        self._placing = None
        self._rows = None
        self.carries_items = False
        if self._claimed:  # left as they are when empty: no allocation per tiny message
            self._claimed = set()
        if self._regions:
            self._regions = []
        self._occupied, self._occupied_source = None, None
        self.large_sizes = []
        if self._offer is not None:  # a message that ended without finish(): never sent
            self._offer.close_fd()
            self._offer = None

    def occupied_from(self, source: Callable[[], list[tuple[int, int]] | None]) -> None:
        """The byte ranges of the slab that this message's items view are ``source()``, asked
        only if they are needed (an item to copy into its place), and once."""
        self._occupied, self._occupied_source = None, source

    @property
    def occupied(self) -> list[tuple[int, int]] | None:
        """The slab's byte ranges the batch's decoded items view; None: unknown."""
        if self._occupied_source is not None:
            self._occupied, self._occupied_source = self._occupied_source(), None
        return self._occupied

    @property
    def placing(self) -> bool:
        """Whether this message's items are being placed (see ``place_items``)."""
        return self._placing is not None

    def start_item(self, index: int) -> None:
        """The codec is about to meet the storages of the piece's ``index``-th item."""
        if self._placing is not None:
            self._placing.start_item(index)

    def carry_items(self) -> None:
        """This message carries economic items: every storage of it, small ones included, asks
        ``allocate`` for its place (and is noted in ``large_sizes``, which is how the main
        process learns the items' layout from the first pieces, sent without a grant)."""
        self.carries_items = True

    def place_items(self, first: int = 0) -> None:
        """This message carries items of a batch (all or part of an economic item worker's
        piece, from its ``first``-th item on): each storage goes to its own place in the item
        area (the grant's ``items``), in codec order."""
        grant = self._grant
        if grant is not None and grant.items is not None:
            self._placing = _ItemCursor(grant.items, first)
            self.used_bytes = 0

    def allocate(self, nbytes: int) -> tuple[torch.UntypedStorage, int] | None:
        """Room for ``nbytes`` in the granted slab, or in the buffer this message offers: (its
        storage, byte offset), or None."""
        self.large_sizes.append(nbytes)
        slab = self._slab
        if slab is None:
            slab = self._make_offer(nbytes)
            if slab is None:
                return None
        if self._placing is not None:
            offset = self._placing.next_offset(nbytes)
            if offset is None or offset + nbytes > slab.size:
                return None
            if not self._checked and not self._may_write(slab):
                self._slab = None
                return None
            self._outcome = GrantOutcome.USED
            self.used_bytes = max(self.used_bytes, offset + nbytes)
            self._regions.append((offset, nbytes))
            return slab.storage, offset
        if not self._checked and not self._may_write(slab):
            self._slab = None
            return None
        offset = -(-self.used_bytes // ALIGN_BYTES) * ALIGN_BYTES
        if offset + nbytes > slab.size:
            return None
        self.used_bytes = offset + nbytes
        if self._offer is None:
            self._outcome = GrantOutcome.USED
        self._regions.append((offset, nbytes))
        return slab.storage, offset

    def _make_offer(self, nbytes: int) -> _MappedSlab | None:
        """A buffer of this message's own, sized as a slab for it, when it may offer one (see
        the module): it is the message's slab from now on; None otherwise."""
        if (not self.offers_buffers or self._slabs or self.carries_items or self._placing is not None
                or self._offer is not None or self.used_bytes or nbytes < OFFER_FROM_BYTES):
            return None
        started = time.perf_counter()
        # Sized for what the last message needed outside it, when that was more: a batch of
        # several large tensors meets its first one here.
        size = batch_slab_size(max(nbytes, sum(self.last_large_sizes)))
        offer = _Offer(size)
        self._offer, self._slab, self._checked = offer, offer.mapped, True
        self.setup_s += time.perf_counter() - started
        return offer.mapped

    def allocate_run(self, leaf: int, count: int, nbytes: int) -> tuple[torch.UntypedStorage, int] | None:
        """Room for leaf ``leaf`` (``nbytes`` each) of this message's ``count`` items at once,
        while placing them (``place_items``): (the slab's storage, the byte offset of the first
        item's), the others following it; None when the layout has no such run or the slab may
        not be written. Their sizes are not noted in ``large_sizes``: the caller notes the
        items' sizes in codec order (``note_item_sizes``)."""
        slab, placing = self._slab, self._placing
        if slab is None or placing is None:
            return None
        offset = placing.run_offset(leaf, count, nbytes)
        if offset is None or offset + count * nbytes > slab.size:
            return None
        if not self._checked and not self._may_write(slab):
            self._slab = None
            return None
        self._outcome = GrantOutcome.USED
        self.used_bytes = max(self.used_bytes, offset + count * nbytes)
        self._regions.append((offset, count * nbytes))
        return slab.storage, offset

    def note_item_sizes(self, item_sizes: tuple[int, ...], count: int) -> None:
        """``count`` items, each with storages of ``item_sizes``, were placed by runs: noted in
        ``large_sizes`` as ``allocate`` would have noted them, item after item."""
        self.large_sizes.extend(item_sizes * count)

    def _may_write(self, slab: _MappedSlab) -> bool:
        self._checked = True
        if _uses(slab.storage) != slab.baseline_uses:
            self._outcome = GrantOutcome.BUSY
            return False
        if not self._await_release(slab.slab_id):
            self._outcome = GrantOutcome.LATE
            return False
        return True

    def _await_release(self, slab_id: int) -> bool:
        board, grant = self._board, self._grant
        if board is None or grant is None:
            return False
        deadline = time.monotonic() + RELEASE_WAIT_S
        while int(board[slab_id]) < grant.releases:
            if time.monotonic() >= deadline:
                return False
            time.sleep(RELEASE_POLL_S)
        return True

    @property
    def expects_items(self) -> bool:
        """Whether item workers (or this worker, see ``take_rows``) may have placed this
        message's items in its slab."""
        return self._slab is not None and self._item_area() is not None

    def _item_area(self) -> ItemPlacement | None:
        grant = self._grant
        if grant is None:
            return None
        return grant.items if grant.items is not None else self._rows

    @property
    def may_place_rows(self) -> bool:
        """Whether this message may take rows (``rows_area``, ``take_rows``): a slab is granted,
        with no economic item area, and nothing has been put in it yet."""
        grant = self._grant
        return (self._slab is not None and grant is not None and grant.items is None
                and self._rows is None and self._placing is None and not self.used_bytes)

    def rows_area(self, leaf_bytes: tuple[int, ...], count: int) -> ItemPlacement | None:
        """An item area for ``count`` samples whose large tensors take ``leaf_bytes`` each, at
        the start of the granted slab, for a classic worker that writes each sample into its
        rows as it fetches it (transport/sample_rows.py); None when there is none to lay out:
        no grant, an economic one, something already in the slab, an area too large for it.
        Nothing may be written there before ``take_rows(area)`` says so."""
        slab = self._slab
        if slab is None or not self.may_place_rows:
            return None
        offsets, end = [], 0
        for nbytes in leaf_bytes:
            start = -(-end // ALIGN_BYTES) * ALIGN_BYTES
            offsets.append(start)
            end = start + count * nbytes
        return ItemPlacement(tuple(offsets), tuple(leaf_bytes), end) if end <= slab.size else None

    def take_rows(self, area: ItemPlacement) -> bool:
        """Whether ``area`` (from ``rows_area``) may be written now: the slab has been released
        by every batch that viewed it. Not waited for: the caller asks again with its next
        sample, and the stack at the end waits as usual. Once it says yes, the batch's other
        outputs go after the area."""
        slab = self._slab
        if slab is None or not self.may_place_rows or not self._released_now(slab):
            return False
        self._checked = True
        self._rows = area
        self.used_bytes = area.area_bytes
        return True

    def _released_now(self, slab: _MappedSlab) -> bool:
        """``_may_write``'s checks, without waiting and without recording an outcome."""
        board, grant = self._board, self._grant
        return (board is not None and grant is not None
                and _uses(slab.storage) == slab.baseline_uses
                and int(board[slab.slab_id]) >= grant.releases)

    def claim_items(self, parts: list[torch.Tensor]) -> int | None:
        """The byte offset of the leaf run in the item area where ``parts`` (one tensor per item
        of the batch, in order) already sit, at least one of them; None if none does, or if a
        part that is elsewhere could not be copied into its place without writing over bytes
        that some item still views (``occupied``). A run is claimed once per message: its
        stacked view is then the batch's tensor."""
        slab, items = self._slab, self._item_area()
        if slab is None or items is None or not parts:
            return None
        nbytes = parts[0].numel() * parts[0].element_size()
        base = slab.storage.data_ptr()
        for leaf, (start, size) in enumerate(zip(items.leaf_offsets, items.leaf_bytes)):
            if (size != nbytes or leaf in self._claimed
                    or start + len(parts) * size > items.area_bytes):
                continue
            missing = [i for i, part in enumerate(parts)
                       if not in_place(part, base + start + i * size)]
            if len(missing) == len(parts):
                continue
            if missing and not self._free(base + start, size, missing):
                return None
            return self._claim(slab, leaf, start, len(parts) * size)
        return None

    def claim_run(self, leaf: int, count: int) -> int | None:
        """The byte offset of leaf ``leaf``'s run of ``count`` items in the item area, claimed
        for this message as ``claim_items`` claims one (its view is the batch's tensor), where
        item workers wrote the items as columns (item_columns.py); None when the area has no
        such run, it was claimed already, or the slab may not be written."""
        slab, items = self._slab, self._item_area()
        if slab is None or items is None or leaf >= len(items.leaf_offsets) or leaf in self._claimed:
            return None
        start, size = items.leaf_offsets[leaf], items.leaf_bytes[leaf]
        if start + count * size > items.area_bytes:
            return None
        return self._claim(slab, leaf, start, count * size)

    def _claim(self, slab: _MappedSlab, leaf: int, start: int, nbytes: int) -> int | None:
        if not self._checked and not self._may_write(slab):
            self._slab = None
            return None
        self._claimed.add(leaf)
        self._outcome = GrantOutcome.USED
        self._regions.append((start, nbytes))
        return start

    def _free(self, run: int, size: int, places: list[int]) -> bool:
        occupied = self.occupied
        if occupied is None:
            return False
        return not any(low < run + (i + 1) * size and run + i * size < high
                       for i in places for low, high in occupied)

    def region_of(self, start: int, end: int) -> tuple[int, int] | None:
        """The piece of the granted slab handed out in this message (``allocate``'s room, a run
        ``claim_items`` claimed) that holds its bytes ``[start, end)``: (offset, bytes), or None
        when no one piece holds them all.

        A tensor the consumer receives gets that piece as its storage, not the whole slab: what
        torch's loader gives (a storage per output, of its size), so that ``torch.save`` writes
        the tensor's bytes alone and ``resize_`` cannot grow it over its neighbours."""
        for offset, nbytes in self._regions:
            if offset <= start and end <= offset + nbytes:
                return offset, nbytes
        return None

    def slab_storage(self) -> torch.UntypedStorage | None:
        """The granted slab's storage while this message may write into it."""
        return self._slab.storage if self._slab is not None else None

    def wait_populated(self) -> None:
        """Block until the granted slab's mapping is populated (when it is being populated)."""
        if self._slab is not None and self._slab.populating is not None:
            self._slab.populating.wait()

    def view(self, slab_id: int) -> memoryview | None:
        """All of mapped slab ``slab_id``, for reading what another producer wrote into it."""
        slab = self._slabs.get(slab_id)
        return None if slab is None else memoryview(slab.mapping)

    def owns(self, storage: torch.UntypedStorage) -> bool:
        """Whether ``storage`` is the slab granted for this message (after a write into it), or
        the buffer it offers."""
        slab = self._slab
        return (slab is not None and (self._outcome is GrantOutcome.USED or self._offer is not None)
                and storage.data_ptr() == slab.storage.data_ptr())

    def maps_other_slab(self, storage: torch.UntypedStorage) -> bool:
        """Whether ``storage`` is a whole slab this producer maps, other than the one granted now
        (what a tensor kept from an earlier message views)."""
        address = storage.data_ptr()
        granted = self._slab
        sent = [offer.mapped for offer in (self._sent_offer, *self._kept_offers) if offer is not None]
        return any(slab.storage.data_ptr() == address for slab in (*self._slabs.values(), *sent)
                   if slab is not granted) and address != 0

    @property
    def slab_id(self) -> int:
        return -1 if self._grant is None else self._grant.slab_id

    @property
    def offering(self) -> bool:
        """Whether this message writes into a buffer of its own, which it offers (not a grant)."""
        return self._offer is not None

    def offered_descriptor(self) -> int:
        """The descriptor of the buffer this message offers (valid until its views note)."""
        assert self._offer is not None
        return self._offer.fd

    def one_shot(self, nbytes: int) -> torch.UntypedStorage:
        """A fresh shared storage of ``nbytes`` for what the slab cannot hold (counted, timed)."""
        started = time.perf_counter()
        storage = one_shot_storage(nbytes)
        self.one_shot_bytes += nbytes
        self.setup_s += time.perf_counter() - started
        return storage

    def leave_to_late_writers(self) -> None:
        """This message ends before others have finished writing into its slab (economic item
        workers filling a batch that failed): the slab is never granted again (``BUSY``)."""
        if self._outcome is not GrantOutcome.NO_GRANT:
            self._outcome = GrantOutcome.BUSY

    @property
    def slab_refused(self) -> bool:
        """Whether this message found its slab not writable (still viewed, or not released in
        time): what it could not place went elsewhere for that reason, not for its shape."""
        return self._outcome in (GrantOutcome.BUSY, GrantOutcome.LATE)

    def finish(self) -> tuple[int, GrantOutcome]:
        """End the message; returns the bytes it put in shared memory and what became of its grant."""
        offer = self._offer
        used = self.used_bytes if self._outcome is GrantOutcome.USED or offer is not None else 0
        result = (used + self.one_shot_bytes, self._outcome)
        sizes = self.large_sizes
        if offer is not None:
            self._settle_sent_offer()  # (a note comes after each message: none is left here)
            self._sent_offer, self._offer = offer, None
        self.begin(None)
        self.last_large_sizes = sizes
        self.last_outcome = result[1]
        return result

    @property
    def owes_offer_note(self) -> bool:
        """Whether a views note must say what became of offered buffers: the message finished
        last offered one, or an earlier one is still viewed here."""
        return self._sent_offer is not None or bool(self._kept_offers)

    def offers_still_viewed(self) -> tuple[tuple[int, int], ...]:
        """The (device, inode) pairs of the buffers this producer offered that something here still views (the
        last message's among them, if so): the owner holds back those it took over as slabs. The
        last message's buffer is forgotten unless still viewed (the owner has its own
        descriptor); one still viewed is watched until it is let go of, so that a kept tensor of
        it is copied into a later message, not sent whole."""
        self._settle_sent_offer()
        self._kept_offers = [offer for offer in self._kept_offers if offer.viewed]
        return tuple((offer.device, offer.inode) for offer in self._kept_offers)

    def _settle_sent_offer(self) -> None:
        offer, self._sent_offer = self._sent_offer, None
        if offer is not None:
            offer.close_fd()
            if offer.viewed:
                self._kept_offers.append(offer)

    def _own_offer(self, slab_id: int, fd: int) -> _MappedSlab | None:
        """The mapping of a buffer this producer offered and still views (a kept batch), when
        the owner took it over as slab ``slab_id`` (``fd``): mapped anew, the check before
        writing could not see those views. One nothing here viewed at its note needs no such
        care: nothing here can view it again."""
        if not self._kept_offers:
            return None
        found = os.fstat(fd)
        for offer in self._kept_offers:
            if (offer.device, offer.inode) == (found.st_dev, found.st_ino):
                self._kept_offers.remove(offer)
                offer.mapped.slab_id = slab_id
                return offer.mapped
        return None

    def slabs_still_viewed(self) -> tuple[int, ...]:
        """The mapped slabs some tensor of this process still views, between messages: user code
        that kept a batch it sent (a collate function keeping its last output). Another producer
        granted such a slab would write over what this one may send again."""
        return tuple(slab_id for slab_id, slab in self._slabs.items()
                     if _uses(slab.storage) != slab.baseline_uses)

    def close(self) -> None:
        for slab in self._slabs.values():
            if slab.populating is not None:
                slab.populating.wait()
        self._slabs.clear()
        self._board = None
        for offer in (self._offer, self._sent_offer):
            if offer is not None:
                offer.close_fd()
        self._offer = self._sent_offer = None
        self._kept_offers = []


class _Offer:
    """A buffer made for one message, mapped here, whose descriptor travels with it (see
    ``SlabWriter.offers_buffers``). Its pages are allocated now (running out of shared memory is
    an error here, not a SIGBUS on first write), as a one-shot buffer's are."""

    __slots__ = ("fd", "mapped", "device", "inode")

    def __init__(self, size: int) -> None:
        self.fd = create_buffer(size, allocate=True)
        try:
            found = os.fstat(self.fd)
            self.device, self.inode = found.st_dev, found.st_ino  # how the owner's MAP names it
            self.mapped = _MappedSlab(OFFERED_SLAB_ID, size, self.fd, populate=False)
        except BaseException:
            os.close(self.fd)
            raise
        # Mapped in one call rather than a fault per page: the batch is about to fill it.
        populate(self.mapped.storage.data_ptr(), size, write=True)

    @property
    def viewed(self) -> bool:
        """Whether a tensor here still views the buffer."""
        return _uses(self.mapped.storage) != self.mapped.baseline_uses

    def close_fd(self) -> None:
        if self.fd >= 0:
            os.close(self.fd)
            self.fd = -1


class _ItemCursor:
    """Where an item worker's next large storage goes. The codec meets a message's items one by
    one (``start_item``, see item_links.py) and each item's storages in order: the k-th one of
    the message's item i is leaf k of the piece's item ``first + i``, placed at
    ``leaf_offsets[k] + (first_item + first + i) * leaf_bytes[k]``. A storage
    the layout has no room for (a size that differs, one leaf too many) stops placing for the
    rest of the message, whose storages go to fresh memory: an item is only ever written into
    its own places, never over another item's."""

    def __init__(self, items: ItemPlacement, first: int = 0) -> None:
        self._items = items
        self._first = items.first_item + first  # the batch slot of the message's first item
        self._item: int | None = None
        self._leaf = 0
        self._stopped = False

    def start_item(self, index: int) -> None:
        self._item, self._leaf = index, 0

    def run_offset(self, leaf: int, count: int, nbytes: int) -> int | None:
        """The place of leaf ``leaf`` of the message's first item, if the message's ``count``
        items have theirs after it, each ``nbytes`` (as ``next_offset`` would give them one by
        one); None otherwise."""
        items = self._items
        if self._stopped or leaf >= len(items.leaf_bytes) or nbytes != items.leaf_bytes[leaf]:
            return None
        offset = items.leaf_offsets[leaf] + self._first * nbytes
        return offset if offset + count * nbytes <= items.area_bytes else None

    def next_offset(self, nbytes: int) -> int | None:
        items, item, leaf = self._items, self._item, self._leaf
        self._leaf += 1
        if (self._stopped or item is None or leaf >= len(items.leaf_bytes)
                or nbytes != items.leaf_bytes[leaf]):
            self._stopped = True
            return None
        offset = items.leaf_offsets[leaf] + (self._first + item) * nbytes
        if offset + nbytes > items.area_bytes:
            self._stopped = True
            return None
        return offset
