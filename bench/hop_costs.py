"""Economic mode's item hop and classic mode's collation, driven by hand in one process.

One slab pool (the main process's), a batch worker's and an item worker's result channels and
the item link between them: every end a real socket, every slab real shared memory, all in this
process, one step at a time, as ``tests/transport/test_item_links.py`` drives them. Used by
``python -m bench.item_costs --in-process``; each call returns the thread CPU seconds of the
item worker's side, the batch worker's side and the main process's side for one batch.
"""

from __future__ import annotations

import socket
import time
from typing import Any

from pipeload.collate import default_collate
from pipeload.engine.item_scheduler import item_placement
from pipeload.transport import collate_output
from pipeload.transport.endpoints import Receiver, Sender
from pipeload.transport import item_links
from pipeload.transport.item_links import GrantedSlabs, ItemOutbox
from pipeload.transport.messages import Delivery, ItemDelivery, ItemPlacement, SlabGrant
from pipeload.stats.clock import tensor_bytes
from pipeload.transport.slab_pool import SlabPool

SOCKET_BUFFER_BYTES = 1 << 20


class Hop:
    """The pieces of one item hop; ``items`` are one batch's samples, already fetched."""

    def __init__(self, items: list[Any]) -> None:
        self.items = items
        self.pool = SlabPool(pin=False, max_bytes=1 << 30)
        self.pool.set_slab_limit(3)
        pairs = [socket.socketpair() for _ in range(3)]
        for end in (e for pair in pairs for e in pair):
            end.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, SOCKET_BUFFER_BYTES)
        self.batch_main, self.batch = Receiver(pairs[0][0], self.pool, 1), Sender(pairs[0][1])
        self.item_main, self.item = Receiver(pairs[1][0], self.pool, 0), Sender(pairs[1][1])
        self.link_out, self.link_in = Sender(pairs[2][0]), Receiver(pairs[2][1], None, 0)
        self.link_in.pool = GrantedSlabs(self.batch)
        self.outbox = ItemOutbox([self.link_out])
        self.leaf_bytes = items[0][0].numel() * items[0][0].element_size()
        # Before issue 24 every item travelled alone (run against that tree, this measures it).
        group_bytes = getattr(item_links, "PLACED_GROUP_BYTES", 0)
        self.group = max(1, group_bytes // (tensor_bytes(items[0]) + 1))

    def economic(self, token: int) -> tuple[float, float, float]:
        """Items written into the batch's slab in groups, gathered, stacked in place, sent."""
        count = len(self.items)
        placement = item_placement((self.leaf_bytes,), count, 1 << 40)
        self.pool.observe_batch(placement.area_bytes)
        grant = self.pool.grant(1, token)
        placement = item_placement((self.leaf_bytes,), count, self.pool.granted_size(token))
        self.batch_main.send_controls()
        share, _ = self.pool.share_grant(token, 0)
        self.item_main.send_controls()
        item_s = batch_s = 0.0
        samples: list[Any] = []
        for first in range(0, count, self.group):
            started = time.thread_time()
            items = ItemPlacement(placement.leaf_offsets, placement.leaf_bytes, placement.area_bytes, 0)
            self.item.prepare(SlabGrant(share.slab_id, share.releases, share.controls, items))
            self.item.writer.place_items(first=first)
            group = self.items[first:first + self.group]
            delivery = ItemDelivery(Delivery.ITEMS, 0, 1, token, first, len(group), group)
            self.outbox.send(0, delivery, self.item.writer)
            sent = time.thread_time()
            # Read as the batch worker would, before the socket's buffer fills.
            while (message := self.link_in.receive(block=False)) is not None:
                samples += message[0].payload
            item_s, batch_s = item_s + sent - started, batch_s + time.thread_time() - sent
        started = time.thread_time()
        self.batch.prepare(SlabGrant(grant.slab_id, grant.releases, grant.controls, placement))
        collate_output.note_items(samples)
        batch = default_collate(samples)
        self.batch.send(batch)
        del batch, samples
        collated = time.thread_time()
        return item_s, batch_s + collated - started, self._receive(token, collated)

    def classic(self, token: int) -> tuple[float, float, float]:
        """The batch collated straight into its slab and sent, as a classic worker does."""
        self.pool.observe_batch(len(self.items) * self.leaf_bytes + 4096)
        grant = self.pool.grant(1, token)
        self.batch_main.send_controls()
        started = time.thread_time()
        self.batch.prepare(grant)
        batch = default_collate(self.items)
        self.batch.send(batch)
        del batch
        sent = time.thread_time()
        return sent - started, 0.0, self._receive(token, sent)

    def _receive(self, token: int, started: float) -> float:
        message, info = self.batch_main.receive()
        self.pool.settle(token, info.outcome)
        self.pool.handed_out(token)
        elapsed = time.thread_time() - started
        del message
        return elapsed

    def close(self) -> None:
        for end in (self.batch_main, self.batch, self.item_main, self.item, self.link_out, self.link_in):
            end.close()
        self.pool.close()

    def __enter__(self) -> Hop:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
