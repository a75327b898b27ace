"""Economic mode's item -> batch hop: item workers hand fetched items straight to batch workers.

Process workers: one socket pair per (item worker, batch worker), each with exactly one writer and
one reader, like the result channels (see channel.py), and the same transport on it: a
:class:`~pipeload.transport.endpoints.Sender` / :class:`~pipeload.transport.endpoints.Receiver`
pair and its codec. Small tensors ride inside the message; larger ones travel in shared memory
whose descriptor rides along, so an item's bytes never pass through a socket or the main process.
A worker killed mid-write damages only its own sockets; no lock is shared between processes. A
batch worker waits on its task pipe and its item sockets in one call, so commands and items reach
it through a single ``receive``. Once the main process knows an item's size, item workers write
items straight into the slab of the batch they belong to, each at its place in the stacked batch
(``ItemPlacement``), and the message names the place; the batch worker reads them there through
its own mappings of the slabs it was granted.

Thread workers: an item thread puts its deliveries straight into the batch thread's task queue,
objects as they are.

This module is the one seam between economic mode and the transport: another sender/receiver pair
would replace what is here and nothing else.
"""

from __future__ import annotations

import select
import socket
from collections import deque
from typing import Any

from pipeload.transport.channel import PipeEnd, QueueEnd
from pipeload.transport.endpoints import Receiver, Sender
from pipeload.transport.messages import Delivery, ItemDelivery, WorkerCommand
from pipeload.transport.slab_writer import SlabWriter


# Process workers send the items of a piece in groups of about this many bytes of tensors (an
# item this large or larger, alone): small items then share a message (its encoding, the system
# calls, the batch worker's wake-up) instead of paying one each, while an item worker still
# holds little more than this of fetched items at a time. Items written into their batch's slab
# leave only their places in the message; items whose bytes ride in it are gathered less, so
# that a message fits the socket's buffer (one larger is written over several wake-ups).
PLACED_GROUP_BYTES = 1 << 20
INLINE_GROUP_BYTES = 128 * 1024


class ItemOutbox:
    """An item worker's sockets to every batch worker (process workers)."""

    def __init__(self, sockets: list[Sender]) -> None:
        self._sockets = sockets

    @property
    def links(self) -> list[Sender]:
        """The socket ends this outbox owns."""
        return self._sockets

    @staticmethod
    def group_bytes(placed: bool) -> int:
        """About how many bytes of items one message gathers; ``placed``: they are written into
        their batch's slab (the message carries only their places)."""
        return PLACED_GROUP_BYTES if placed else INLINE_GROUP_BYTES

    def send(self, batch_worker: int, delivery: ItemDelivery, writer: SlabWriter | None = None) -> None:
        """Hand ``delivery`` to ``batch_worker``, its tensors placed by ``writer`` (None: the
        link's own, which has no slabs). Raises BrokenPipeError if that worker is gone."""
        if writer is not None and delivery.delivery is Delivery.ITEMS:
            writer.carry_items()  # small items too go to their places in the batch's slab
        if writer is not None and writer.placing and isinstance(delivery.payload, list):
            # Each item announces itself to the writer as the codec meets it, so that its
            # storages go to its own places (see ItemPlacement); it arrives as the bare item.
            marked = [_ItemStart(writer, index, item) for index, item in enumerate(delivery.payload)]
            delivery = ItemDelivery(delivery.delivery, delivery.item_worker, delivery.epoch,
                                    delivery.batch_number, delivery.slot, delivery.count, marked)
        self._sockets[batch_worker].send(delivery, writer)

    def close(self) -> None:
        for end in self._sockets:
            end.close()


class _ItemStart:
    """Pickles as the bare item, telling the slab writer first that its storages come next."""

    __slots__ = ("writer", "index", "item")

    def __init__(self, writer: SlabWriter, index: int, item: Any) -> None:
        self.writer, self.index, self.item = writer, index, item

    def __reduce__(self) -> Any:
        self.writer.start_item(self.index)
        return (_bare, (self.item,))


def _bare(item: Any) -> Any:
    return item


class BatchInbox:
    """A batch worker's task pipe and its sockets from every item worker, read as one channel.

    Owned by the batch worker. Invariant: ``_pending`` holds messages already read off the
    channels, oldest first; sockets whose writer has gone are no longer waited on.
    """

    def __init__(self, tasks: PipeEnd, items: list[Receiver]) -> None:
        self._tasks = tasks
        self._items = items
        self._live_items = list(items)  # the item sockets still waited on
        self._pending: deque[Any] = deque()
        # One poll object for the worker's life (building a selector per wait cost more than
        # reading a small message): descriptor -> the end it belongs to.
        self._poller: select.poll | None = None
        self._ends: dict[int, Any] = {}

    @property
    def links(self) -> list[Receiver]:
        """The item socket ends this inbox owns."""
        return self._items

    def read_slabs_with(self, outbox: Sender) -> None:
        """Items placed in the slabs granted to this batch worker (on ``outbox``, its result
        channel) are read through that channel's mappings."""
        reader = GrantedSlabs(outbox)
        for end in self._items:
            end.pool = reader

    def receive(self, timeout_s: float) -> WorkerCommand | ItemDelivery | None:
        """The next command or delivery, or None if nothing arrives within ``timeout_s``.

        Raises EOFError when the main process has closed the task pipe.
        """
        if not self._pending:
            if self._poller is None:
                self._watch()
            for fd, _ in self._poller.poll(max(0, int(timeout_s * 1000))):
                if fd in self._ends:  # not one dropped earlier in this round
                    self._drain(fd, self._ends[fd])
        return self._pending.popleft() if self._pending else None

    def _watch(self) -> None:
        self._poller = select.poll()
        for end in (self._tasks.conn, *self._items):
            self._ends[end.fileno()] = end
            self._poller.register(end.fileno(), select.POLLIN)

    def _drain(self, fd: int, ready: Any) -> None:
        # Each end is read until it is empty (a socket's reader may have taken several messages
        # in one read), so a quiet poll means that nothing waits.
        if ready is self._tasks.conn:
            self._pending.extend(self._tasks.take_waiting())
            return
        try:
            while (message := ready.receive(block=False)) is not None:
                self._pending.append(message[0])
        except (EOFError, ConnectionResetError):
            # That item worker is gone; the main process sees its exit and stops the epoch.
            self._poller.unregister(fd)
            del self._ends[fd]
            self._live_items.remove(ready)

    def close(self) -> None:
        self._tasks.close()
        for end in self._items:
            end.close()


class GrantedSlabs:
    """Stands in for a slab pool when a batch worker decodes items: it views the slabs its own
    result channel has mapped (item workers wrote into the batch's slab, see ItemPlacement)."""

    def __init__(self, outbox: Sender) -> None:
        self._outbox = outbox

    def open_lease(self, slab_id: int) -> memoryview:
        # The slab's MAP control was sent before the batch's COLLATE, so before the item workers
        # were even asked: it is waiting on the result channel, maybe behind the FORGET of an
        # older slab with the same id, which this process may still have mapped. Apply every
        # control that is there: none can be about this slab's next use, as it is granted.
        self._outbox.apply_waiting_controls()
        view = self._outbox.writer.view(slab_id)
        if view is None:
            raise ValueError(f"an item refers to slab {slab_id}, which this batch worker has not mapped")
        return view


class ItemLinks:
    """Every item -> batch socket pair of one session; owned by the economic engine.

    The parent hands each worker its own ends and closes its copies right after that worker has
    started. A child started by fork inherits the whole mesh and keeps only its own ends
    (``keep_only``), so each end lives in exactly one process and a dead peer shows as EOF or a
    broken pipe, never as a silent stall.
    """

    def __init__(self, num_item_workers: int, num_batch_workers: int) -> None:
        self._writers: list[list[Sender]] = []
        self._readers: list[list[Receiver]] = []
        for item_worker in range(num_item_workers):
            pairs = [socket.socketpair() for _ in range(num_batch_workers)]
            self._readers.append([Receiver(reader, None, item_worker) for reader, _ in pairs])
            self._writers.append([Sender(writer) for _, writer in pairs])

    def outbox(self, item_worker: int) -> ItemOutbox:
        return ItemOutbox(self._writers[item_worker])

    def inbox(self, batch_worker: int, tasks: PipeEnd) -> BatchInbox:
        return BatchInbox(tasks, [row[batch_worker] for row in self._readers])

    def keep_only(self, own: list[Sender] | list[Receiver]) -> None:
        """In a forked worker: close every inherited end that is not ``own``."""
        for end in self._all_ends():
            if not any(end is mine for mine in own):
                end.close()

    def close(self) -> None:
        for end in self._all_ends():
            end.close()

    def _all_ends(self) -> list[Sender | Receiver]:
        return [end for rows in (self._writers, self._readers) for row in rows for end in row]


class ThreadItemOutbox:
    """An item thread's way to every batch thread: their task queues."""

    @staticmethod
    def group_bytes(placed: bool) -> int:
        """A queue costs nothing per object: each item goes as soon as it is fetched."""
        return 0

    def __init__(self, batch_inboxes: list[QueueEnd]) -> None:
        self._inboxes = batch_inboxes

    def send(self, batch_worker: int, delivery: ItemDelivery, writer: Any = None) -> None:
        self._inboxes[batch_worker].send(delivery)

    def close(self) -> None:
        pass  # the queues belong to the engine's channels

