"""A slab pool and the three result channels of one economic hop (main process, batch worker,
item worker), every end a real socket, all in one process: the tests of items written into their
batch's slab drive it one step at a time."""

from __future__ import annotations

import dataclasses
import socket
from typing import Any

import torch

from pipeload.engine.item_scheduler import item_placement
from pipeload.transport.endpoints import Receiver, Sender
from pipeload.transport.item_columns import place_as_columns
from pipeload.transport.item_links import GrantedSlabs, ItemOutbox
from pipeload.transport.messages import Delivery, ItemDelivery
from pipeload.transport.slab_pool import SlabPool

LEAF = 1 << 16  # floats in one item's large tensor: 256 KiB, well above the inline limit


def flat_item(value: float, leaf: int = LEAF) -> dict:
    return {"x": torch.full((leaf,), value), "label": int(value)}


class SlabHop:
    """One slab pool (the main process), a batch worker's and an item worker's result channels,
    and the link between them: every end a real socket, all in this process, one step at a time."""

    def __init__(self) -> None:
        self.pool = SlabPool(pin=False, max_bytes=1 << 30)
        self.pool.set_slab_limit(2)
        pairs = [socket.socketpair() for _ in range(3)]
        self.batch_main, self.batch = Receiver(pairs[0][0], self.pool, 1), Sender(pairs[0][1])
        self.item_main, self.item = Receiver(pairs[1][0], self.pool, 0), Sender(pairs[1][1])
        self.link_out, self.link_in = Sender(pairs[2][0]), Receiver(pairs[2][1], None, 0)
        self.link_in.pool = GrantedSlabs(self.batch)

    def grants(self, token: int, count: int, item_bytes: tuple[int, ...] = (LEAF * 4,)):
        placement = item_placement(item_bytes, count, 1 << 30)
        self.pool.observe_batch(placement.area_bytes)
        batch_grant = self.pool.grant(1, token)
        placement = item_placement(item_bytes, count, self.pool.granted_size(token))
        self.batch_main.send_controls()
        share, _ = self.pool.share_grant(token, 0)
        self.item_main.send_controls()
        return (dataclasses.replace(batch_grant, items=placement),
                lambda first: dataclasses.replace(share, items=dataclasses.replace(placement, first_item=first)))

    def direct_grants(self, token: int, count: int, item_bytes: tuple[int, ...] = (LEAF * 4,)):
        """As ``grants`` for a batch the main process assembles: the slab granted to no producer
        (engine/direct_batches.py), shared with the item worker; (placement, item grant)."""
        placement = item_placement(item_bytes, count, 1 << 30)
        self.pool.observe_batch(placement.area_bytes)
        grant = self.pool.grant(None, token)
        placement = item_placement(item_bytes, count, self.pool.granted_size(token))
        share, _ = self.pool.share_grant(token, 0)
        self.item_main.send_controls()
        return (dataclasses.replace(grant, items=placement),
                lambda first: dataclasses.replace(share, items=dataclasses.replace(placement, first_item=first)))

    def place_for_main(self, grant, items: list, first: int = 0) -> Any:
        """What an item worker keeps for the main process of ``items`` (a direct piece's group):
        an ``ItemColumns``, its tensors written at their places, or the samples."""
        self.item.prepare(grant)
        self.item.writer.place_items(first=first)
        columns = place_as_columns(items, self.item.writer)
        self.item.writer.finish()
        self.item.prepare(None)
        return items if columns is None else columns

    def hand_over(self, grant, items: list, first: int = 0) -> list:
        """Send ``items``, the piece's from its ``first``-th on, as one message."""
        self.item.prepare(grant)
        self.item.writer.place_items(first=first)
        slot = grant.items.first_item + first
        delivery = ItemDelivery(Delivery.ITEMS, 0, 1, 0, slot, len(items), items)
        ItemOutbox([self.link_out]).send(0, delivery, self.item.writer)
        return self.link_in.receive()[0].payload

    def hand_over_as_columns(self, grant, items: list, first: int = 0) -> Any:
        """As ``hand_over``, with the items sent as columns where they can be (an item worker's
        way): the payload that arrives, an ``ItemColumns`` or the samples."""
        self.item.prepare(grant)
        self.item.writer.place_items(first=first)
        columns = place_as_columns(items, self.item.writer)
        slot = grant.items.first_item + first
        delivery = ItemDelivery(Delivery.ITEMS, 0, 1, 0, slot, len(items), items if columns is None else columns)
        ItemOutbox([self.link_out]).send(0, delivery, self.item.writer)
        return self.link_in.receive()[0].payload

    def close(self) -> None:
        for end in (self.batch_main, self.batch, self.item_main, self.item, self.link_out, self.link_in):
            end.close()
        self.pool.close()
