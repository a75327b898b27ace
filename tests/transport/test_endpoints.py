"""The sender/receiver pair across a real process boundary, without the pool engine.

A forked producer builds batches as a worker would (collation writes into the granted slab) and
sends them; the consumer owns the slab pool, grants slabs over a command pipe of its own, and
views the batches in place. This is the reuse path for other producer/consumer pairs.
"""

from __future__ import annotations

import multiprocessing
import socket

import pytest
import torch

from pipeload.collate import default_collate
from pipeload.transport.endpoints import Receiver, Sender
from pipeload.transport.messages import GrantOutcome
from pipeload.transport.slab_pool import SlabPool

pytestmark = [pytest.mark.usefixtures("leak_guard"), pytest.mark.timeout(60)]

ITEM = 1 << 16
BATCHES = 12


def _produce(sock: socket.socket, commands) -> None:
    """The producer process: for each (value, grant) command, build a batch and send it."""
    torch.set_num_threads(1)  # as a worker does: the parent's OpenMP threads did not survive fork
    sender = Sender(sock)
    try:
        while (command := commands.recv()) is not None:
            value, grant = command
            sender.prepare(grant)
            batch = default_collate([torch.full((ITEM,), value + k) for k in range(4)])
            sender.send({"batch": batch, "value": value})
            del batch  # a producer must not keep what it sent: the slab would be refused (BUSY)
    finally:
        sender.close()


def test_batches_cross_a_process_boundary_in_reused_slabs():
    ctx = multiprocessing.get_context("fork")
    mine, theirs = socket.socketpair()
    commands_in, commands_out = ctx.Pipe(duplex=False)
    producer = ctx.Process(target=_produce, args=(theirs, commands_in), daemon=True)
    producer.start()
    theirs.close()
    commands_in.close()
    pool = SlabPool(pin=False, max_bytes=1 << 30)
    receiver = Receiver(mine, pool, producer=0)
    outcomes, addresses = [], []
    try:
        for token in range(BATCHES):
            pool.set_slab_limit(2)
            grant = pool.grant(0, token)
            receiver.send_controls()  # the slab's descriptor goes before the grant that needs it
            commands_out.send((float(token * 10), grant))
            message, info = receiver.receive()
            pool.observe_batch(info.shared_bytes)
            pool.settle(token, info.outcome)
            pool.handed_out(token)
            batch = message["batch"]
            assert message["value"] == token * 10
            assert batch[:, 0].tolist() == [token * 10.0 + k for k in range(4)]
            outcomes.append(info.outcome)
            addresses.append(batch.data_ptr())
            del batch, message
    finally:
        commands_out.send(None)
        producer.join(10)
        commands_out.close()
        receiver.close()
        pool.close()
    assert producer.exitcode == 0
    # The first batch could not be granted a slab (its size was unknown); the rest were, and the
    # slabs were reused rather than made anew.
    assert outcomes[0] is GrantOutcome.NO_GRANT
    assert set(outcomes[1:]) == {GrantOutcome.USED}
    assert len(set(addresses[1:])) <= 2
