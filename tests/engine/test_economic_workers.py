"""Economic mode's worker loops on their own: commands and deliveries in, reports out, through
real in-process queues, or, for an item worker, through the sockets and slab writer a process
worker sends with."""

from __future__ import annotations

import dataclasses
import queue
import socket
import threading
import weakref

import pytest
import torch

from faults import Numbers, RaisesAt

from pipeload.collate import default_collate
from pipeload.engine import economic_workers
from pipeload.engine.economic_workers import BatchWorkerLoop, ItemWorkerLoop
from pipeload.engine.plan import DatasetKind, FetchSpec, WorkerSetup
from pipeload.engine.worker_info import make_thread_rng
from pipeload.errors import RemoteFailure
from pipeload.stats.clock import SAMPLE_EVERY, TIME_ALL_FIRST, WorkerTotals
from pipeload.transport.channel import QueueEnd
from pipeload.transport.endpoints import Receiver, Sender
from pipeload.transport.item_links import INLINE_GROUP_BYTES, ItemOutbox, ThreadItemOutbox
from pipeload.transport.messages import (
    Command,
    Delivery,
    ItemDelivery,
    ItemsDone,
    ItemRoute,
    Report,
    WorkerCommand,
)
from pipeload.transport.slab_pool import SlabPool


def _setup(dataset) -> WorkerSetup:
    fetch = FetchSpec(dataset, DatasetKind.MAP, True, default_collate, False)
    return WorkerSetup(fetch, num_workers=1, base_seed=0, worker_init_fn=None, worker_method="thread")


def _drain(end: QueueEnd) -> list:
    messages = []
    while (message := end.receive(0)) is not None:
        messages.append(message)
    return messages


def _run_batch_worker(messages: list) -> list:
    inbox, outbox = QueueEnd(queue.SimpleQueue()), QueueEnd(queue.SimpleQueue())
    for message in [*messages, WorkerCommand(Command.STOP)]:
        inbox.send(message)
    loop = BatchWorkerLoop(_setup(Numbers(10)), 0, inbox, outbox, lambda: False, make_thread_rng(0, 1))
    loop.run()  # returns at STOP
    return _drain(outbox)


def _items(batch: int, slot: int, samples: list, epoch: int = 1, worker: int = 0) -> ItemDelivery:
    return ItemDelivery(Delivery.ITEMS, worker, epoch, batch, slot, len(samples), samples)


def test_a_batch_worker_collates_once_every_piece_is_in_whatever_the_order():
    reports = _run_batch_worker([
        _items(0, 2, [2, 3], worker=1),  # before the COLLATE command, out of slot order
        WorkerCommand(Command.COLLATE, 0, [0, 1, 2, 3], epoch=1),
        _items(0, 0, [0, 1]),
    ])
    assert [(r.report, r.batch_number, r.payload.tolist()) for r in reports] == [(Report.BATCH, 0, [0, 1, 2, 3])]


def test_a_failed_piece_fails_the_batch_with_the_earliest_failure():
    late, early = (RemoteFailure(KeyError, f"bad {n}", "trace", n, "fetching items", [n], "item") for n in (3, 1))
    reports = _run_batch_worker([
        WorkerCommand(Command.COLLATE, 0, [0, 1, 2, 3], epoch=1),
        ItemDelivery(Delivery.FAILED, 0, 1, 0, 3, 1, late),
        _items(0, 0, [0]),
        ItemDelivery(Delivery.FAILED, 1, 1, 0, 1, 2, early),
    ])
    assert [(r.report, r.batch_number) for r in reports] == [(Report.FAILED, 0)]
    assert reports[0].failure.message == "bad 1"


def test_a_new_epoch_drops_what_the_old_one_left_half_gathered():
    reports = _run_batch_worker([
        WorkerCommand(Command.COLLATE, 0, [0, 1], epoch=1),
        _items(0, 0, [0]),  # batch 0 of epoch 1 never completes
        WorkerCommand(Command.START_EPOCH, epoch=2),
        _items(0, 1, [1], epoch=1),  # a late piece of the abandoned epoch
        WorkerCommand(Command.COLLATE, 0, [5, 6], epoch=2),
        _items(0, 0, [5, 6], epoch=2),
    ])
    assert [(r.report, r.batch_number) for r in reports] == [(Report.EPOCH_STARTED, 2), (Report.BATCH, 0)]
    assert reports[1].payload.tolist() == [5, 6]


def _fetch(batch: int, indices: list[int], slot: int, batch_worker: int = 0) -> WorkerCommand:
    return WorkerCommand(Command.FETCH_ITEMS, batch, indices, epoch=1, route=ItemRoute(batch_worker, slot, slot))


def test_an_item_worker_hands_pieces_to_the_named_batch_worker_and_reports_them_done():
    inbox, outbox = QueueEnd(queue.SimpleQueue()), QueueEnd(queue.SimpleQueue())
    batch_inboxes = [QueueEnd(queue.SimpleQueue()), QueueEnd(queue.SimpleQueue())]
    for command in [_fetch(0, [4, 5], slot=0, batch_worker=1), _fetch(1, [6], slot=2),
                    WorkerCommand(Command.STOP)]:
        inbox.send(command)
    loop = ItemWorkerLoop(_setup(RaisesAt(10, bad_index=6)), 3, inbox, outbox,
                          ThreadItemOutbox(batch_inboxes), lambda: False, make_thread_rng(0, 3))
    loop.run()

    assert [(d.delivery, d.item_worker, d.batch_number, d.slot, d.count, d.payload)
            for d in _drain(batch_inboxes[1])] == [(Delivery.ITEMS, 3, 0, 0, 1, [4]),
                                                   (Delivery.ITEMS, 3, 0, 1, 1, [5])]
    (bad,) = _drain(batch_inboxes[0])
    assert (bad.delivery, bad.batch_number, bad.slot, bad.count) == (Delivery.FAILED, 1, 2, 1)
    assert bad.payload.worker_kind == "item" and bad.payload.indices == [6]
    assert [(r.report, r.worker_id, r.batch_number, r.payload) for r in _drain(outbox)] == [
        (Report.ITEMS_DONE, 3, 0, ItemsDone(2)), (Report.ITEMS_DONE, 3, 1, ItemsDone(1))]


# -- stats: one piece (or batch) in SAMPLE_EVERY timed, every one counted ----------------------

PIECES = 300  # far past TIME_ALL_FIRST: most of them untimed


def _stats_setup(dataset) -> WorkerSetup:
    return dataclasses.replace(_setup(dataset), stats=True)


def _with_totals(reports: list) -> list:
    return [r for r in reports if r.totals is not None]


def test_an_item_worker_times_a_sample_of_its_pieces_and_counts_them_all():
    # Pieces of 1 to 3 items; those holding index 6 fail there (the items before it count). The
    # totals that come now and then, and the answer to START_EPOCH, count every piece done
    # and every item fetched before them, however few pieces were timed.
    inbox, outbox = QueueEnd(queue.SimpleQueue()), QueueEnd(queue.SimpleQueue())
    batch_inbox = QueueEnd(queue.SimpleQueue())
    sizes = [1 + n % 3 for n in range(PIECES)]
    fetched = [0]  # items fetched after each piece
    for number, size in enumerate(sizes):
        indices = [(number + i) % 10 for i in range(size)]
        inbox.send(_fetch(number, indices, slot=0))
        # Items go one at a time: those before a failing one were fetched (and handed over).
        fetched.append(fetched[-1] + (indices.index(6) if 6 in indices else size))
    loop = ItemWorkerLoop(_stats_setup(RaisesAt(10, bad_index=6)), 1, inbox, outbox,
                          ThreadItemOutbox([batch_inbox]), lambda: False, make_thread_rng(0, 1))
    worker = threading.Thread(target=loop.run)
    worker.start()
    # START_EPOCH once every piece is answered (queued behind them, it would drop them).
    reports = [outbox.receive(10.0) for _ in range(PIECES)]
    inbox.send(WorkerCommand(Command.START_EPOCH, epoch=2))
    inbox.send(WorkerCommand(Command.STOP))
    worker.join(10.0)
    assert not worker.is_alive()
    reports += _drain(outbox)
    assert [r.report for r in reports] == [Report.ITEMS_DONE] * PIECES + [Report.EPOCH_STARTED]
    pieces = [r for r in _with_totals(reports) if r.report is Report.ITEMS_DONE]
    assert [r.batch_number for r in pieces[:TIME_ALL_FIRST]] == list(range(TIME_ALL_FIRST))
    assert len(pieces) < TIME_ALL_FIRST + 2 * (PIECES - TIME_ALL_FIRST) // SAMPLE_EVERY + 2
    for report in pieces:
        totals = WorkerTotals._make(report.totals)
        assert (totals.tasks, totals.samples) == (report.batch_number + 1, fetched[report.batch_number + 1])
    answer = reports[-1]
    assert answer.payload == "item"  # its kind: the main process cannot tell it from the id
    assert WorkerTotals._make(answer.totals)[:2] == (PIECES, fetched[-1])


def test_a_batch_worker_times_a_sample_of_its_batches_and_counts_them_all():
    # Batches of 1 to 3 samples; every seventh has a failed piece: it fails with the totals
    # (counted as a task with the samples it was to hold, as a classic worker's failed batch:
    # the stats' samples a batch stay what the loop received).
    failure = RemoteFailure(KeyError, "bad", "trace", 0, "fetching items", [0], "item")
    messages, collated = [], [0]
    for number in range(PIECES):
        samples = list(range(1 + number % 3))
        messages.append(WorkerCommand(Command.COLLATE, number, samples, epoch=1))
        if number % 7 == 3:
            messages.append(ItemDelivery(Delivery.FAILED, 0, 1, number, 0, len(samples), failure))
            collated.append(collated[-1] + len(samples))
        else:
            messages.append(_items(number, 0, samples))
            collated.append(collated[-1] + len(samples))
    messages.append(WorkerCommand(Command.START_EPOCH, epoch=2))
    inbox, outbox = QueueEnd(queue.SimpleQueue()), QueueEnd(queue.SimpleQueue())
    for message in [*messages, WorkerCommand(Command.STOP)]:
        inbox.send(message)
    BatchWorkerLoop(_stats_setup(Numbers(10)), 0, inbox, outbox, lambda: False,
                    make_thread_rng(0, 1)).run()

    reports = _drain(outbox)
    assert len(reports) == PIECES + 1
    failed = [r for r in reports if r.report is Report.FAILED]
    assert len(failed) == len(range(3, PIECES, 7)) and all(r.totals is not None for r in failed)
    built = [r for r in _with_totals(reports) if r.report is Report.BATCH]
    assert len(built) < TIME_ALL_FIRST + 2 * (PIECES - TIME_ALL_FIRST) // SAMPLE_EVERY + 2
    for report in built + failed:
        totals = WorkerTotals._make(report.totals)
        assert (totals.tasks, totals.samples) == (report.batch_number + 1, collated[report.batch_number + 1])
    answer = reports[-1]
    assert (answer.report, answer.payload) == (Report.EPOCH_STARTED, "batch")
    assert WorkerTotals._make(answer.totals)[:2] == (PIECES, collated[-1])


class _TakesItemsAway:
    """An item outbox that, like a socket, keeps nothing of what it sends (only a summary)."""

    def __init__(self) -> None:
        self.sent: list[tuple] = []

    def send(self, batch_worker: int, delivery: ItemDelivery, writer=None) -> None:
        what = (delivery.payload.indices if delivery.delivery is Delivery.FAILED
                else [int(item[0]) for item in delivery.payload])
        self.sent.append((delivery.delivery, delivery.slot, delivery.count, what))


class _CountsLiveItems(RaisesAt):
    """Item i is a tensor of ``numel`` floats of i; notes how many items it made are still alive
    at each fetch."""

    def __init__(self, length: int, bad_index: int = -1, numel: int = 4) -> None:
        super().__init__(length, bad_index)
        self.numel = numel
        self.made: list[weakref.ref] = []
        self.alive_at_fetch: list[int] = []

    def __getitem__(self, index: int) -> torch.Tensor:
        self.alive_at_fetch.append(sum(ref() is not None for ref in self.made))
        item = torch.full((self.numel,), float(super().__getitem__(index)))
        self.made.append(weakref.ref(item))
        return item


def _run_item_worker(dataset, commands: list) -> _TakesItemsAway:
    inbox, outbox = QueueEnd(queue.SimpleQueue()), QueueEnd(queue.SimpleQueue())
    for command in [*commands, WorkerCommand(Command.STOP)]:
        inbox.send(command)
    deliveries = _TakesItemsAway()
    loop = ItemWorkerLoop(_setup(dataset), 0, inbox, outbox, deliveries, lambda: False,
                          make_thread_rng(0, 0))
    loop.run()
    return deliveries


def test_an_item_worker_hands_each_item_over_before_it_fetches_the_next():
    # It holds one item of its own at a time, not a piece's worth (economic mode's memory).
    dataset = _CountsLiveItems(10)
    deliveries = _run_item_worker(dataset, [_fetch(0, [4, 5, 6], slot=3)])
    assert dataset.alive_at_fetch == [0, 0, 0]
    assert deliveries.sent == [(Delivery.ITEMS, 3, 1, [4]), (Delivery.ITEMS, 4, 1, [5]),
                               (Delivery.ITEMS, 5, 1, [6])]


def test_an_item_that_raises_fails_the_rest_of_its_piece_after_the_items_before_it():
    deliveries = _run_item_worker(_CountsLiveItems(10, bad_index=5), [_fetch(0, [4, 5, 6], slot=0)])
    assert deliveries.sent == [(Delivery.ITEMS, 0, 1, [4]), (Delivery.FAILED, 1, 2, [5])]


def test_a_timed_piece_counts_the_time_of_the_item_that_raised(monkeypatch):
    # As a classic worker's timed task does (engine/fetch.py): a failing fetch took its time too.
    ticks = iter(range(1_000_000))
    monkeypatch.setattr(economic_workers, "now", lambda: float(next(ticks)))
    inbox, outbox = QueueEnd(queue.SimpleQueue()), QueueEnd(queue.SimpleQueue())
    for command in [_fetch(0, [6], slot=0), WorkerCommand(Command.STOP)]:
        inbox.send(command)
    loop = ItemWorkerLoop(_stats_setup(_CountsLiveItems(10, bad_index=6)), 0, inbox, outbox,
                          _TakesItemsAway(), lambda: False, make_thread_rng(0, 0))
    loop.run()
    (report,) = _drain(outbox)
    assert WorkerTotals._make(report.totals).fetch_s > 0  # the first piece is timed


# -- an item worker wired as a process worker is: real sockets, slab writer and pool ----------


class _Pairs(RaisesAt):
    """Item i is two tensors, each ``leaf_bytes`` of float i; ``unsendable``: that item also
    holds a function, which the item link cannot pickle."""

    def __init__(self, length: int, leaf_bytes: int, bad_index: int = -1, unsendable: int = -1) -> None:
        super().__init__(length, bad_index)
        self.leaf_bytes, self.unsendable = leaf_bytes, unsendable

    def __getitem__(self, index: int) -> tuple:
        value = float(super().__getitem__(index))
        leaves = tuple(torch.full((self.leaf_bytes // 4,), value) for _ in range(2))
        return (*leaves, lambda: None) if index == self.unsendable else leaves


def _first_value(item) -> int:
    while not isinstance(item, torch.Tensor):
        item = item[0]
    return int(item.flatten()[0])


def _summary(delivery: ItemDelivery) -> tuple:
    what = (delivery.payload.indices if delivery.delivery is Delivery.FAILED
            else [_first_value(item) for item in delivery.payload])
    return delivery.delivery, delivery.slot, delivery.count, what


def _run_item_worker_over_sockets(dataset, commands: list) -> tuple[list[tuple], list]:
    """Run an item worker loop as a process worker's is wired: its reports on a result channel
    (a socket, with that channel's slab writer) read by a main-process end with a slab pool, its
    items on an item link (``ItemOutbox``, a socket) to a batch worker's end. Returns a summary
    of each delivery that reached the batch worker's end, and the payloads of the reports that
    reached the main process's."""
    pool = SlabPool(pin=False, max_bytes=1 << 30)
    result_main, result_worker = socket.socketpair()
    link_out, link_in = socket.socketpair()
    reports_in, outbox = Receiver(result_main, pool, 0), Sender(result_worker)
    items_out, items_in = Sender(link_out), Receiver(link_in, None, 0)
    arrived: list[tuple] = []

    def read_the_link() -> None:
        # Concurrently, as a batch worker would: a piece's messages need not fit a socket's buffer.
        try:
            while True:
                arrived.append(_summary(items_in.receive()[0]))
        except EOFError:
            pass  # the item worker's end is closed: everything it sent has been read

    reader = threading.Thread(target=read_the_link)
    reader.start()
    try:
        inbox = QueueEnd(queue.SimpleQueue())
        for command in [*commands, WorkerCommand(Command.STOP)]:
            inbox.send(command)
        try:
            ItemWorkerLoop(_setup(dataset), 0, inbox, outbox, ItemOutbox([items_out]), lambda: False,
                           make_thread_rng(0, 0)).run()
        finally:
            items_out.close()  # the reader then meets the link's end
            reader.join(10.0)
        assert not reader.is_alive()
        reports = []
        while (message := reports_in.receive(block=False)) is not None:
            reports.append(message[0].payload)
        return arrived, reports
    finally:
        for end in (items_in, outbox, reports_in):
            end.close()
        pool.close()


# Two leaves that together fill a message's group: each item travels in a message of its own.
ALONE_LEAF = INLINE_GROUP_BYTES // 2


@pytest.mark.usefixtures("leak_guard")
@pytest.mark.parametrize("fault", ["bad_index", "unsendable"], ids=["failed-midway", "not-handed-over"])
def test_a_piece_whose_item_failed_or_was_not_handed_over_says_no_item_sizes(fault: str):
    # Item 5 raises in the dataset, or cannot be pickled for its link: the worker sends a failure
    # in its place. The items before it are no item's whole layout (item 4's two leaves, from one
    # item of a piece of two, would read as items of one leaf, and the main process would lay
    # the next batches out so): its piece, though item 4 went, tells no sizes.
    sent, reports = _run_item_worker_over_sockets(
        _Pairs(10, ALONE_LEAF, **{fault: 5}), [_fetch(0, [4, 5], slot=0), _fetch(1, [1, 2], slot=0)])
    assert sent == [(Delivery.ITEMS, 0, 1, [4]), (Delivery.FAILED, 1, 1, [5]),
                    (Delivery.ITEMS, 0, 1, [1]), (Delivery.ITEMS, 1, 1, [2])]
    assert reports == [ItemsDone(2), ItemsDone(2, (ALONE_LEAF, ALONE_LEAF))]


@pytest.mark.usefixtures("leak_guard")
def test_an_item_worker_gathers_small_items_into_groups_of_about_the_bytes_its_outbox_asks():
    # Items of two fifths of the outbox's group for items sent without a grant (its figure for
    # placed ones is far larger: all five would then go as one): two to a group. The worker
    # never holds more than a group of its own items when it fetches the next one.
    dataset = _CountsLiveItems(10, numel=INLINE_GROUP_BYTES // 10)
    sent, _ = _run_item_worker_over_sockets(dataset, [_fetch(0, [4, 5, 6, 7, 8], slot=3)])
    assert sent == [(Delivery.ITEMS, 3, 2, [4, 5]), (Delivery.ITEMS, 5, 2, [6, 7]),
                    (Delivery.ITEMS, 7, 1, [8])]
    assert max(dataset.alive_at_fetch) <= 1


@pytest.mark.usefixtures("leak_guard")
def test_an_item_worker_sends_what_it_gathered_before_an_item_that_raises():
    sent, _ = _run_item_worker_over_sockets(_CountsLiveItems(10, bad_index=7),
                                            [_fetch(0, [4, 5, 6, 7, 8], slot=0)])
    assert sent == [(Delivery.ITEMS, 0, 3, [4, 5, 6]), (Delivery.FAILED, 3, 2, [7])]


@pytest.mark.usefixtures("leak_guard")
def test_an_item_as_large_as_a_group_travels_alone():
    sent, _ = _run_item_worker_over_sockets(_CountsLiveItems(10, numel=INLINE_GROUP_BYTES // 4),
                                            [_fetch(0, [1, 2, 3], slot=0)])
    assert [(count, what) for _, _, count, what in sent] == [(1, [1]), (1, [2]), (1, [3])]
