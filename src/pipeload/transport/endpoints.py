"""A reusable sender/receiver pair over one Unix socket: batches one way, slab controls the other.

The pair knows nothing of workers, epochs or tasks, so every process boundary in pipeload can use
it: the pool's workers sending batches to the main process, and any other producer/consumer
pair (item workers feeding batch workers, a pipe's process boundary) the same way.

* The :class:`Receiver` (consumer side) owns its end of the socket and decodes messages against a
  :class:`~pipeload.transport.slab_pool.SlabPool`, which decides the grants. Before a command that
  carries a grant goes to the producer (on whatever channel commands travel), the consumer calls
  :meth:`Receiver.send_controls` so the producer can learn about new slabs first.
* The :class:`Sender` (producer side) applies those controls when a grant needs them
  (:meth:`Sender.prepare`), lets collation write into the granted slab, and sends the message.
  A producer that may keep what it sent (a worker running user code) calls
  :meth:`Sender.confirm_views` once it has let go of a message's objects: a short note of the
  slabs it still views, which the receiver hands to the pool and never returns as a message.

Example (two threads standing in for two processes)::

    left, right = socket.socketpair()
    pool = SlabPool(pin=False, max_bytes=1 << 30)
    sender, receiver = Sender(left), Receiver(right, pool, producer=0)
    sender.prepare(None)
    sender.send({"x": torch.ones(4)})
    batch, info = receiver.receive()
"""

from __future__ import annotations

import pickle
import select
import socket
import time
from typing import Any

from pipeload.transport import collate_output
from pipeload.transport.codec import MessageInfo, decode, encode
from pipeload.transport.fd_passing import MessageReader, receive_message, send_message
from pipeload.transport.messages import GrantOutcome, SlabControl, SlabGrant
from pipeload.transport.slab_writer import SlabWriter

CONTROL_WAIT_S = 5.0  # controls are written before the grant that needs them: they are there
# The first byte of a views note (see Sender.confirm_views). A pickle starts with 0x80, and the
# short wires with 0xF1 and 0xF2 (codec.py).
VIEWS_TAG = 0xF3


class Sender:
    """The producing end. Owned by one thread of the producer process."""

    def __init__(self, sock: socket.socket, populate: bool = True) -> None:
        self.sock = sock
        self.writer = SlabWriter(populate)
        self._control_poll: select.poll | None = None

    def fileno(self) -> int:
        return self.sock.fileno()

    def prepare(self, grant: SlabGrant | None) -> None:
        """Start the next message, which may use ``grant``'s slab; collation in this thread
        writes its outputs where the message will travel."""
        if grant is None:
            self.writer.begin(None)
        else:
            started = time.perf_counter()
            if not self._apply_controls(grant.controls):
                grant = None
            self.writer.begin(grant, setup_s=time.perf_counter() - started)
        collate_output.set_writer(self.writer)

    @property
    def setup_s(self) -> float:
        """Seconds the current message has spent setting up shared memory so far."""
        return self.writer.setup_s

    def _apply_controls(self, wanted: int) -> bool:
        writer = self.writer
        if writer.controls_applied >= wanted:
            return True
        self.sock.settimeout(CONTROL_WAIT_S)
        try:
            while writer.controls_applied < wanted:
                payload, fds = receive_message(self.sock)
                writer.apply(pickle.loads(payload), fds)
        except TimeoutError:
            return False  # never expected; the message then goes to fresh memory
        finally:
            self.sock.settimeout(None)
        return True

    def apply_waiting_controls(self) -> None:
        """Apply the slab controls already waiting on the socket, without waiting for more.

        For a producer that reads what other producers wrote into a slab it was granted (an
        economic batch worker reading items): the owner sends the controls before the commands
        that lead to those writes, so they are here by the time such a message arrives.
        """
        if self._control_poll is None:  # one poll object for the sender's life: asked per item
            self._control_poll = select.poll()
            self._control_poll.register(self.sock, select.POLLIN)
        if not self._control_poll.poll(0):
            return
        self.sock.settimeout(CONTROL_WAIT_S)
        try:
            while self._control_poll.poll(0):
                payload, fds = receive_message(self.sock)
                self.writer.apply(pickle.loads(payload), fds)
        finally:
            self.sock.settimeout(None)

    def send(self, obj: Any, writer: SlabWriter | None = None) -> None:
        """Encode and send ``obj`` as one message (ends the message begun by :meth:`prepare`).

        ``writer``: place its tensors with another sender's writer (economic item workers send
        items on an item link into a slab granted on their result channel)."""
        collate_output.set_writer(None)
        payload, fds, keep_alive = encode(obj, self.writer if writer is None else writer)
        send_message(self.sock, payload, fds)
        del keep_alive  # the descriptors are in the kernel's hands now

    def confirm_views(self) -> None:
        """After a message written into its granted slab, once the caller holds nothing of it:
        tell the receiver which mapped slabs something here still views (usually none).

        Until the pool hears this, it grants the slab to no other producer: user code that kept
        the batch (a collate function returning its last output again) would read what another
        producer wrote there. A slab still viewed waits for a later note (retired if that one
        names it too); any other may go to anyone.
        """
        writer = self.writer
        if writer.last_outcome is not GrantOutcome.USED and not writer.owes_offer_note:
            return
        writer.last_outcome = GrantOutcome.NO_GRANT
        note = (writer.slabs_still_viewed(), writer.offers_still_viewed())
        send_message(self.sock, memoryview(bytes((VIEWS_TAG,)) + pickle.dumps(note, pickle.HIGHEST_PROTOCOL)), [])

    def offer_buffers(self) -> None:
        """Let a large message with no slab offer the buffer it is written into as a slab (see
        slab_writer.py): for a producer that calls ``confirm_views`` after each message."""
        self.writer.offers_buffers = True

    def close(self) -> None:
        collate_output.set_writer(None)
        self.writer.close()
        self.sock.close()


class Receiver:
    """The consuming end. Owned by the consumer's thread that drives it."""

    def __init__(self, sock: socket.socket, pool: Any, producer: int) -> None:
        self.sock = sock
        self.pool = pool
        self.producer = producer
        self._reader = MessageReader(sock)

    def fileno(self) -> int:
        return self.sock.fileno()

    def receive(self, block: bool = True) -> tuple[Any, MessageInfo] | None:
        """The next message, or None if ``block`` is False and none is waiting (or, however
        ``block`` is, when what was waiting was only a views note: see ``confirm_views``).

        Raises EOFError if the producer is gone.
        """
        while True:
            message = self._reader.next_message(block)
            if message is None:
                return None
            payload, fds = message
            if not (payload and payload[0] == VIEWS_TAG and not fds):
                return decode(payload, fds, self.pool, self.producer)
            # A views note (Sender.confirm_views): the pool's, then the next message if one waits.
            if self.pool is not None:
                self.pool.producer_views(self.producer, *pickle.loads(memoryview(payload)[1:]))
            block = False

    def send_controls(self) -> None:
        """Pass the pool's pending slab controls for this producer (call before a grant)."""
        if self.pool is None:
            return
        for control, fds in self.pool.take_controls(self.producer):
            send_message(self.sock, memoryview(_dumps(control)), fds)

    def close(self) -> None:
        self._reader.close()
        self.sock.close()


def _dumps(control: SlabControl) -> bytes:
    return pickle.dumps(control, pickle.HIGHEST_PROTOCOL)
