"""Economic mode's worker loops on their own: commands and deliveries in, reports out, through
real in-process queues."""

from __future__ import annotations

import queue

from faults import Numbers, RaisesAt

from pipeload.collate import default_collate
from pipeload.engine.economic_workers import BatchWorkerLoop, ItemWorkerLoop
from pipeload.engine.plan import DatasetKind, FetchSpec, WorkerSetup
from pipeload.engine.worker_info import make_thread_rng
from pipeload.errors import RemoteFailure
from pipeload.transport.channel import QueueEnd
from pipeload.transport.item_links import ThreadItemOutbox
from pipeload.transport.messages import (
    Command,
    Delivery,
    ItemDelivery,
    ItemsDone,
    ItemRoute,
    Report,
    WorkerCommand,
)


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

    (good,) = _drain(batch_inboxes[1])
    assert (good.delivery, good.item_worker, good.batch_number, good.slot, good.payload) == (
        Delivery.ITEMS, 3, 0, 0, [4, 5])
    (bad,) = _drain(batch_inboxes[0])
    assert (bad.delivery, bad.batch_number, bad.slot, bad.count) == (Delivery.FAILED, 1, 2, 1)
    assert bad.payload.worker_kind == "item" and bad.payload.indices == [6]
    assert [(r.report, r.worker_id, r.batch_number, r.payload) for r in _drain(outbox)] == [
        (Report.ITEMS_DONE, 3, 0, ItemsDone(2)), (Report.ITEMS_DONE, 3, 1, ItemsDone(1))]
