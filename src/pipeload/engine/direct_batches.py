"""Economic batches the main process assembles itself, without a batch worker.

Once the items' layout is known, item workers write each flat sample's tensors at their places in
the batch's slab (transport/item_columns.py). ``default_collate`` then has nothing left to do but
name each field's run of the slab: sending the pieces to a batch worker, waking it for each, and
having it send the batch back costs the machine more than the naming (on ``pipeload bench``'s
small JPEGs a batch worker spent 1.5 ms of CPU a batch on it, and the main process handled two
more messages). So when the loader collates with ``default_collate`` (unextended), a batch laid
out in a slab is "direct": its item workers report their pieces' columns to the main process with
``ITEMS_DONE``, and the main process makes the batch from them here, as the batch worker would
have: the same tensors over the same bytes, each a storage of its own region (the slab released
when the last of them dies), the other fields collated by ``default_collate``'s own handlers.

The session's first batch goes out before any item's size is known, so it has no slab to be laid
out in: it goes direct all the same, each item worker's first piece one item alone (a probe), its
samples coming with the report as they are. The first probe's report tells the items' size: the
batch is given its slab (``give_slab``), its other pieces are written at their places, and the
probes' samples are written at theirs here, as the batch is made. Where the items' size stays
unknown, the batch's samples are ``default_collate``d here (a copy of one batch, once a session,
instead of forking a batch worker for it: a loader whose batches all go direct starts none). The
pieces also say whether the samples are flat and alike; the first piece that is not (or any later piece that does
not come as columns after all: a dataset whose samples change layout mid-session) stops the
session from making batches direct (``DirectBatches.refused``), and batch workers, started then,
collate every batch after it, as they do for a loader that is never direct (a ``collate_fn`` of
its own, thread workers, items so small that a whole batch rides in one message).
"""

from __future__ import annotations

import time
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

import torch

from pipeload.collate import collate, collating_as_a_worker, default_collate, default_collate_fn_map
from pipeload.errors import RemoteFailure
from pipeload.transport.collate_output import own_memory_output
from pipeload.transport.item_columns import ItemColumns, collate_columns, lease_runs, place_in_lease
from pipeload.transport.messages import GrantOutcome, ItemPlacement, ItemsDone, Report, WorkerReport
from pipeload.transport.slab_pool import SlabPool


@dataclass
class DirectBatch:
    """One direct batch being gathered: where its items go, and the groups reported so far.

    Attributes:
        batch_worker: the batch worker it is counted against (the ledger's load balance).
        indices: its dataset indices.
        slab_id: the slab granted for it, where the items are laid out by ``items`` (None: no
            slab yet, as for the session's first batch until its first probe answers; its items
            come as samples meanwhile).
        groups: slot -> (count, payload) as ``ItemsDone.groups`` gives them.
        filled: how many items have been reported.
        outcome: BUSY or LATE if an item worker could not write into the slab, else USED.
    """

    batch_worker: int
    indices: list[Any]
    slab_id: int | None = None
    items: ItemPlacement | None = None
    groups: dict[int, tuple[int, Any]] = field(default_factory=dict)
    filled: int = 0
    outcome: GrantOutcome = GrantOutcome.USED
    failed_early: bool = False  # its failure went out before every piece came
    any_failed: bool = False  # a piece has come as a failure

    @property
    def complete(self) -> bool:
        return self.filled >= len(self.indices)

    def decided_failure(self) -> RemoteFailure | None:
        """The failure torch would raise for this batch, as soon as it is known: the earliest
        failed slot's, once every slot before it has come (torch fetches a batch's items in order
        and stops at the first that raises; a slot still on its way may yet fail first)."""
        failed = [slot for slot, (_, payload) in self.groups.items() if isinstance(payload, RemoteFailure)]
        if not failed:
            return None
        first = min(failed)
        before = sum(count for slot, (count, _) in self.groups.items() if slot < first)
        return self.groups[first][1] if before >= first else None


class DirectBatches:
    """The direct batches of one epoch, and whether the session still makes batches direct.

    Driven by the engine's thread. Invariant: a batch number is here from the moment its first
    piece goes out direct until its last piece is reported (or the epoch is reset).
    """

    def __init__(self, refused: bool = False) -> None:
        self.refused = refused  # a piece's samples were not flat and alike: stop making batches direct
        self._batches: dict[int, DirectBatch] = {}

    @property
    def allowed(self) -> bool:
        """Whether a batch may go direct: no piece has shown samples that cannot."""
        return not self.refused

    def next_epoch(self) -> DirectBatches:
        """The next epoch's book: what the session learned carries over."""
        return DirectBatches(self.refused)

    def __contains__(self, number: int) -> bool:
        return number in self._batches

    def size_of(self, number: int) -> int:
        """How many items direct batch ``number`` holds (0: not a direct batch being gathered)."""
        batch = self._batches.get(number)
        return len(batch.indices) if batch is not None else 0

    def open(self, number: int, batch: DirectBatch) -> None:
        self._batches[number] = batch

    def without_slab(self) -> list[tuple[int, int]]:
        """(number, items) of each batch being gathered with no slab (opened before the items'
        size was known), earliest first."""
        return [(number, len(batch.indices)) for number, batch in self._batches.items() if batch.slab_id is None]

    def give_slab(self, number: int, slab_id: int, items: ItemPlacement) -> None:
        """Batch ``number``'s later pieces go to their places in slab ``slab_id`` (laid out by
        ``items``); those already in came as samples, which are copied in with the rest."""
        batch = self._batches[number]
        batch.slab_id, batch.items = slab_id, items

    def learn(self, done: ItemsDone) -> None:
        """A piece says whether its items went to their places as columns (or, sent with no
        place, could have): one that did not means this loader's samples are not all flat and
        alike."""
        if done.as_columns is False:
            self.refused = True

    def add(self, number: int, done: ItemsDone, pool: SlabPool) -> WorkerReport | None:
        """Record a direct piece's groups; the batch's report once its last piece is in, or
        its failure as soon as it is decided (``DirectBatch.decided_failure``)."""
        batch = self._batches.get(number)
        if batch is None or done.groups is None:
            return None
        for slot, count, payload in done.groups:
            failed = isinstance(payload, RemoteFailure)
            batch.any_failed = batch.any_failed or failed
            # A batch that failed keeps only what decides the failure: its items are not read.
            batch.groups[slot] = (count, payload if failed or not batch.failed_early else None)
        batch.filled += done.count
        if done.outcome in (GrantOutcome.BUSY, GrantOutcome.LATE):
            batch.outcome = done.outcome
        if not batch.complete:
            return self._failure_if_decided(number, batch)
        del self._batches[number]
        if batch.failed_early:
            # Its last piece is in: no item worker writes into its slab any more.
            pool.settle(number, _unviewed(batch.outcome))
            return None
        return assemble(number, batch, pool)

    @staticmethod
    def _failure_if_decided(number: int, batch: DirectBatch) -> WorkerReport | None:
        """The batch's failure report, once, as soon as it is decided, as torch's worker raises
        at the first failing item rather than once the batch's other items are fetched. The
        slab's grant stays open until the last piece is in (item workers may still write there)."""
        if batch.failed_early or not batch.any_failed:
            return None
        failure = batch.decided_failure()
        if failure is None:
            return None
        batch.failed_early = True
        return WorkerReport(Report.FAILED, batch.batch_worker, number, failure)


def assemble(number: int, batch: DirectBatch, pool: SlabPool) -> WorkerReport:
    """Batch ``number``'s report, as its batch worker would have sent it: the batch, or the
    earliest failure among its items, or the failure to collate them. Settles the slab's grant."""
    started = time.perf_counter()
    groups = sorted(batch.groups.items())
    failures = [payload for _, (_, payload) in groups if isinstance(payload, RemoteFailure)]
    if failures:
        pool.settle(number, _unviewed(batch.outcome))
        return WorkerReport(Report.FAILED, batch.batch_worker, number, failures[0])
    try:
        made, viewed = _collated(groups, batch, pool)
    except Exception as exc:
        pool.settle(number, _unviewed(batch.outcome))
        # Said as what it is: the main process collated these samples, no batch worker.
        failure = RemoteFailure.capture(batch.batch_worker, _collating(batch), batch.indices,
                                        where="in the DataLoader's main process")
        return WorkerReport(Report.FAILED, batch.batch_worker, number, failure)
    pool.settle(number, GrantOutcome.USED if viewed else _unviewed(batch.outcome))
    return WorkerReport(Report.BATCH, batch.batch_worker, number, made,
                        build_s=time.perf_counter() - started, finished_at=time.monotonic())


def _collated(groups: list[tuple[int, tuple[int, Any]]], batch: DirectBatch,
              pool: SlabPool) -> tuple[Any, bool]:
    """The batch from its groups, and whether it views the slab (a lease was opened)."""
    payloads = [payload for _, (_, payload) in groups]
    # Columns are written only once the slab's previous batch is released (SlabWriter checks),
    # whatever another item worker of the batch found: they can be read.
    lease = pool.open_lease(batch.slab_id) if any(isinstance(p, ItemColumns) for p in payloads) else None
    if lease is not None and batch.outcome is GrantOutcome.USED and not all(
            isinstance(payload, ItemColumns) for payload in payloads):
        # Items that came as samples (the probes of a session's first batch, sent before the
        # slab was: see EconomicEngine._send_pieces) are written at their places here: the
        # slab is then the batch's whole, as for any other, instead of a copy of all of it.
        payloads = [_placed_here(payload, lease, batch.items, slot) for slot, (_, payload) in groups]
    if lease is not None and all(isinstance(payload, ItemColumns) for payload in payloads):
        made = collate_columns(payloads, lease_runs(lease, batch.items), collate_field)
        if made is not None:
            return made, True
    samples: list[Any] = []
    for slot, (_, payload) in groups:
        if isinstance(payload, ItemColumns):
            if lease is None:
                raise RuntimeError("items written into a slab arrived without that slab readable")
            samples += payload.samples(lease, batch.items, slot)
        else:
            samples += payload
    # The samples' views of the slab die with this frame: the batch is a copy of them, made as
    # a worker makes it (the first sample's dtype: see collating_as_a_worker).
    with collating_as_a_worker():
        made = default_collate(samples)
    return _kept_with_their_bytes(made), False


def _placed_here(payload: Any, lease: memoryview, items: ItemPlacement | None, slot: int) -> Any:
    """``payload`` as columns: as it came, or, for samples, written at their places in ``lease``
    (unchanged when they cannot be: the batch is then a copy)."""
    if isinstance(payload, ItemColumns) or items is None or not isinstance(payload, list):
        return payload
    return place_in_lease(payload, lease, items, slot) or payload


def _kept_with_their_bytes(batch: Any) -> Any:
    """``batch`` with each plain CPU tensor in it moved, in place, to memory of its own that
    lives as long as its storage does, as a batch decoded from a message is (codec.py): then
    ``share_memory_()`` (a ``torch.multiprocessing`` queue's put) cannot free the bytes under a
    numpy array taken before, and ``resize_()`` refuses it as it refuses a worker's batch."""
    if isinstance(batch, torch.Tensor):
        # A stacked field is already in such memory (collate_output.own_memory_output): its
        # storage cannot be resized. Copied again, the first batch cost a second copy of itself.
        if (batch.layout is torch.strided and batch.device.type == "cpu" and not batch.requires_grad
                and batch.is_contiguous() and batch.numel() and batch.untyped_storage().resizable()):
            own = own_memory_output(tuple(batch.shape), batch.dtype).copy_(batch)
            batch.set_(own.untyped_storage(), 0, batch.shape, batch.stride())
    elif isinstance(batch, Mapping):
        for value in batch.values():
            _kept_with_their_bytes(value)
    elif isinstance(batch, (list, tuple)):
        for value in batch:
            _kept_with_their_bytes(value)
    return batch


def _collating(batch: DirectBatch) -> str:
    """What the main process was doing, in the words of a failure's message: torch's loader
    collates in a worker, so say why this batch was not."""
    if batch.slab_id is None:
        return ("collating a batch from item workers' samples (economic mode: the session's first "
                "batch goes out before anything is known of its samples, and the main process "
                "collates it; batch workers collate the later ones of samples that are not flat)")
    return "collating a batch from item workers' samples (economic mode: a batch it assembles itself)"


def collate_field(column: Any) -> Any:
    """One non-tensor field of a batch of columns, as ``default_collate`` collates it (a batch
    worker's and the main process's alike)."""
    return collate(column, collate_fn_map=default_collate_fn_map)


def _unviewed(outcome: GrantOutcome) -> GrantOutcome:
    """How a grant ends when no batch views its slab: BUSY and LATE keep their meaning."""
    return outcome if outcome in (GrantOutcome.BUSY, GrantOutcome.LATE) else GrantOutcome.UNUSED
