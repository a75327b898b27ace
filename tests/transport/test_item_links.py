"""The item -> batch links: deliveries cross real socket pairs through the transport's codec
(large tensors as shared memory, small ones inside the message), a batch worker reads commands and deliveries as one channel, a gone writer is dropped, and a forked
worker can keep only its own ends."""

from __future__ import annotations

import pickle

import pytest
import torch

from pipeload.transport.channel import PipeEnd
from pipeload.transport.item_links import ItemLinks
from pipeload.transport.messages import Command, Delivery, ItemDelivery, WorkerCommand

pytestmark = [pytest.mark.usefixtures("leak_guard"), pytest.mark.timeout(30)]


def _pipe():
    import multiprocessing

    reader, writer = multiprocessing.Pipe(duplex=False)
    return PipeEnd(reader), PipeEnd(writer)


def _delivery(worker: int, payload) -> ItemDelivery:
    return ItemDelivery(Delivery.ITEMS, worker, 1, 0, worker, 1, payload)


def test_deliveries_and_commands_arrive_through_one_receive():
    links = ItemLinks(num_item_workers=2, num_batch_workers=1)
    tasks_in, tasks_out = _pipe()
    inbox = links.inbox(0, tasks_in)
    try:
        item, small = torch.arange(float(1 << 15)), torch.arange(6.0)  # 128 KiB, 24 bytes
        links.outbox(1).send(0, _delivery(1, [item, small]))
        tasks_out.conn.send(WorkerCommand(Command.COLLATE, 0, [0, 1], epoch=1))
        received = [inbox.receive(5.0), inbox.receive(5.0)]
        assert inbox.receive(0.05) is None
    finally:
        links.close()
        tasks_in.close()
        tasks_out.close()
    (command,) = [m for m in received if isinstance(m, WorkerCommand)]
    (delivery,) = [m for m in received if isinstance(m, ItemDelivery)]
    assert command.command is Command.COLLATE
    tensor, small_tensor = delivery.payload
    assert torch.equal(tensor, item) and torch.equal(small_tensor, small)
    assert tensor.untyped_storage().is_shared()  # it came as shared memory, not as bytes
    assert not small_tensor.untyped_storage().is_shared()  # inside the message


def test_a_gone_item_worker_is_no_longer_waited_on():
    links = ItemLinks(num_item_workers=2, num_batch_workers=1)
    tasks_in, tasks_out = _pipe()
    inbox = links.inbox(0, tasks_in)
    try:
        links.outbox(0).close()  # item worker 0 is gone
        links.outbox(1).send(0, _delivery(1, ["still here"]))
        assert inbox.receive(5.0).payload == ["still here"]
        assert inbox.receive(0.05) is None
        assert len(inbox._live_items) == 1
    finally:
        links.close()
        tasks_in.close()
        tasks_out.close()


def test_keep_only_closes_every_end_but_ours():
    links = ItemLinks(num_item_workers=2, num_batch_workers=2)
    mine = links.outbox(1).links
    links.keep_only(mine)
    try:
        assert all(end.fileno() >= 0 for end in mine)
        others = [end for end in links._all_ends() if not any(end is m for m in mine)]
        assert len(others) == 6 and all(end.fileno() == -1 for end in others)
    finally:
        links.close()


def test_the_outbox_refuses_what_cannot_be_pickled_before_writing_anything():
    links = ItemLinks(num_item_workers=1, num_batch_workers=1)
    tasks_in, tasks_out = _pipe()
    inbox = links.inbox(0, tasks_in)
    try:
        with pytest.raises((pickle.PicklingError, AttributeError, TypeError)):
            links.outbox(0).send(0, _delivery(0, [lambda: None]))
        links.outbox(0).send(0, _delivery(0, ["next"]))
        assert inbox.receive(5.0).payload == ["next"]  # the stream is still in step
    finally:
        links.close()
        tasks_in.close()
        tasks_out.close()
