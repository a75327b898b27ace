"""The item -> batch links: deliveries cross real socket pairs through the transport's codec
(large tensors as shared memory, small ones inside the message), a batch worker reads commands and deliveries as one channel, a gone writer is dropped, and a forked
worker can keep only its own ends."""

from __future__ import annotations

import pickle

import pytest
import torch

from slab_hop import LEAF, SlabHop, flat_item

from pipeload.transport.channel import PipeEnd
from pipeload.transport.collate_output import note_items
from pipeload.transport.item_links import ItemLinks
from pipeload.transport.messages import Command, Delivery, GrantOutcome, ItemDelivery, WorkerCommand

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


# -- items written straight into their batch's slab ------------------------------------------


def test_items_placed_in_the_batch_slab_are_stacked_without_a_copy():
    from pipeload.collate import default_collate

    hop = SlabHop()
    try:
        batch_grant, item_grant = hop.grants(token=0, count=4)
        # Two pieces of two items, placed by the item worker at their rows of the stacked batch.
        samples = hop.hand_over(item_grant(0), [flat_item(0.0), flat_item(1.0)])
        samples += hop.hand_over(item_grant(2), [flat_item(2.0), flat_item(3.0)])
        assert hop.item.writer.last_large_sizes == [LEAF * 4, LEAF * 4]
        hop.batch.prepare(batch_grant)
        batch = default_collate(samples)
        # The stack is a view of where the items already were: not a single byte copied.
        assert [batch["x"][i].data_ptr() for i in range(4)] == [s["x"].data_ptr() for s in samples]
        hop.batch.send(batch)
        del batch, samples
        message, info = hop.batch_main.receive()
        assert message["x"][:, 0].tolist() == [0.0, 1.0, 2.0, 3.0]
        assert message["x"][:, -1].tolist() == [0.0, 1.0, 2.0, 3.0]
        assert message["label"].tolist() == [0, 1, 2, 3]
        assert info.outcome is GrantOutcome.USED
        del message
    finally:
        hop.close()


def test_a_piece_handed_over_item_by_item_lands_at_its_rows_as_a_whole_piece_does():
    from pipeload.collate import default_collate

    hop = SlabHop()
    try:
        batch_grant, item_grant = hop.grants(token=0, count=5)
        # One piece of four items from slot 1 on, each item in a message of its own (an item
        # worker sends each as soon as it is fetched), and item 0 in a piece of its own.
        samples = [sample for j in range(4)
                   for sample in hop.hand_over(item_grant(1), [flat_item(1.0 + j)], j)]
        samples = hop.hand_over(item_grant(0), [flat_item(0.0)]) + samples
        hop.batch.prepare(batch_grant)
        batch = default_collate(samples)
        assert [batch["x"][i].data_ptr() for i in range(5)] == [s["x"].data_ptr() for s in samples]
        assert batch["x"][:, 0].tolist() == [0.0, 1.0, 2.0, 3.0, 4.0]
        assert batch["x"][:, -1].tolist() == [0.0, 1.0, 2.0, 3.0, 4.0]
        del batch, samples
    finally:
        hop.close()


def test_an_item_that_does_not_fit_its_place_is_copied_in_and_overwrites_nothing():
    from pipeload.collate import default_collate

    hop = SlabHop()
    try:
        batch_grant, item_grant = hop.grants(token=0, count=3)
        rest = hop.hand_over(item_grant(2), [flat_item(2.0)])
        # Item 1 is twice as long as its place: written there, it would cover item 2's place.
        # Placing stops at it; it travels in fresh memory.
        piece = hop.hand_over(item_grant(0), [flat_item(0.0), {"x": torch.full((LEAF * 2,), 9.0), "label": 9}])
        assert hop.item.writer.last_large_sizes == [LEAF * 4, LEAF * 8]
        hop.batch.prepare(batch_grant)
        samples = [piece[0], {"x": piece[1]["x"][:LEAF].clone(), "label": 9}, rest[0]]
        note_items(samples)  # as a batch worker does before collating
        batch = default_collate(samples)
        assert batch["x"][0].data_ptr() == piece[0]["x"].data_ptr()  # these two were in place
        assert batch["x"][2].data_ptr() == rest[0]["x"].data_ptr()
        assert batch["x"][:, 0].tolist() == [0.0, 9.0, 2.0]
        hop.batch.send(batch)
        del batch, samples, piece, rest
        message, _ = hop.batch_main.receive()
        assert message["x"].sum(dim=1).tolist() == [0.0, 9.0 * LEAF, 2.0 * LEAF]
        del message
    finally:
        hop.close()


def test_items_whose_structure_differs_are_never_written_over_each_other():
    from pipeload.collate import default_collate

    def pair(value: float, order: str = "ab", extra: bool = False) -> dict:
        item = {key: torch.full((LEAF,), value + (0.5 if key == "b" else 0.0)) for key in order}
        if extra:
            item["z"] = torch.full((LEAF,), -1.0)  # default_collate ignores keys item 0 lacks
        return item

    hop = SlabHop()
    try:
        batch_grant, item_grant = hop.grants(token=0, count=4, item_bytes=(LEAF * 4, LEAF * 4))
        # Item 1 has one large tensor too many, item 2 its keys the other way round: placed by
        # order, item 2's "b" sits where its "a" belongs. Nothing may be copied over it.
        samples = hop.hand_over(item_grant(0), [pair(0.0), pair(1.0, extra=True)])
        samples += hop.hand_over(item_grant(2), [pair(2.0, order="ba"), pair(3.0)])
        hop.batch.prepare(batch_grant)
        note_items(samples)
        batch = default_collate(samples)
        assert batch["a"][:, 0].tolist() == [0.0, 1.0, 2.0, 3.0]
        assert batch["b"][:, 0].tolist() == [0.5, 1.5, 2.5, 3.5]
        assert batch["a"][:, -1].tolist() == [0.0, 1.0, 2.0, 3.0]
        assert batch["b"][:, -1].tolist() == [0.5, 1.5, 2.5, 3.5]
        hop.batch.send(batch)
        del batch, samples
        message, _ = hop.batch_main.receive()
        assert message["a"].sum(dim=1).tolist() == [v * LEAF for v in (0.0, 1.0, 2.0, 3.0)]
        assert message["b"].sum(dim=1).tolist() == [v * LEAF for v in (0.5, 1.5, 2.5, 3.5)]
        del message
    finally:
        hop.close()


def test_small_and_permuted_items_are_written_as_rows_of_the_stack_and_stacked_in_place():
    # Items of a decoded image's usual shape: a small tensor that is a permuted view (channels
    # first over a channels-last buffer). Each is written, once, as its contiguous row of the
    # stacked batch; the message carries only its place, and the stack is a view.
    from pipeload.collate import default_collate

    def image(value: float) -> tuple:
        channels_last = torch.arange(48.0).reshape(4, 4, 3) + value
        return channels_last.permute(2, 0, 1), int(value)

    originals = [image(float(10 * i)) for i in range(4)]
    hop = SlabHop()
    try:
        batch_grant, item_grant = hop.grants(token=0, count=4, item_bytes=(48 * 4,))
        samples = hop.hand_over(item_grant(0), originals[:2]) + hop.hand_over(item_grant(2), originals[2:])
        assert hop.item.writer.last_large_sizes == [48 * 4, 48 * 4]  # asked for, small as they are
        assert all(s[0].is_contiguous() and torch.equal(s[0], o[0]) for s, o in zip(samples, originals))
        hop.batch.prepare(batch_grant)
        note_items(samples)
        batch = default_collate(samples)
        assert [batch[0][i].data_ptr() for i in range(4)] == [s[0].data_ptr() for s in samples]
        assert torch.equal(batch[0], torch.stack([o[0] for o in originals]))
        hop.batch.send(batch)
        del batch, samples
        message, info = hop.batch_main.receive()
        assert torch.equal(message[0], torch.stack([o[0] for o in originals]))
        assert message[1].tolist() == [0, 10, 20, 30] and info.outcome is GrantOutcome.USED
        del message
    finally:
        hop.close()


def test_items_without_a_place_still_say_their_sizes_and_travel_inside_the_message():
    # An epoch's first pieces have no grant: the items' sizes are noted (how the main process
    # learns the layout), small ones ride inline as before, and nothing goes to shared memory.
    from pipeload.transport.item_links import ItemOutbox

    hop = SlabHop()
    try:
        hop.item.prepare(None)
        items = [(torch.arange(12.0).reshape(3, 4).t(), 1), (torch.arange(12.0).reshape(3, 4).t() + 1, 2)]
        ItemOutbox([hop.link_out]).send(0, ItemDelivery(Delivery.ITEMS, 0, 1, 0, 0, 2, items), hop.item.writer)
        received = hop.link_in.receive()[0].payload
        assert hop.item.writer.last_large_sizes == [48, 48]
        assert all(torch.equal(r[0], i[0]) and r[0].stride() == i[0].stride() for r, i in zip(received, items))
        assert not any(r[0].is_shared() for r in received)
    finally:
        hop.close()
