"""The flat wire: batch reports of a few small tensors skip the codec's pickle machinery, and
arrive exactly as the codec would deliver them; everything else still takes the codec."""

from __future__ import annotations

import os
import pickle

import pytest
import torch

from pipeload.transport.codec import INLINE_MAX_BYTES, decode, encode
from pipeload.transport.flat_wire import FLAT_TAG
from pipeload.transport.messages import (
    Command,
    GrantOutcome,
    ItemPlacement,
    ItemRoute,
    Report,
    SlabGrant,
    WorkerCommand,
    WorkerReport,
    command_from_wire,
    command_to_wire,
)
from pipeload.transport.slab_writer import SlabWriter

TOTALS = (3, 192, 0.5, 0.25, 0.125, 1536, 12.0, 0.75, 0.0, 0)


def _report(batch, report=Report.BATCH):
    return WorkerReport(report, 1, 7, batch, TOTALS, 0.002, 0.001, 12.5)


def _round_trip(report, writer=None):
    payload, fds, keep_alive = encode(report, writer)
    flat = payload[0] == FLAT_TAG
    received, info = decode(bytearray(payload), [os.dup(fd) for fd in fds], None)
    del keep_alive
    return received, info, flat


@pytest.mark.parametrize("dtype", [torch.bool, torch.uint8, torch.int16, torch.int64,
                                   torch.float16, torch.bfloat16, torch.float64, torch.complex128])
def test_tensors_of_every_dtype_and_shape_arrive_equal_on_the_flat_wire(dtype):
    values = torch.arange(6).reshape(2, 3).to(dtype)
    for batch in (values, [values, values[1].clone(), torch.tensor(5).to(dtype)],
                  (values.clone(), torch.empty((2, 0), dtype=dtype))):
        received, info, flat = _round_trip(_report(batch))
        assert flat and info.outcome is GrantOutcome.NO_GRANT and info.shared_bytes == 0
        assert type(received.payload) is type(batch)
        single = isinstance(batch, torch.Tensor)
        pairs = [(received.payload, batch)] if single else zip(received.payload, batch)
        for got, sent in pairs:
            assert got.dtype == sent.dtype and got.shape == sent.shape and torch.equal(got, sent)
            assert got.is_contiguous() and got.untyped_storage().nbytes() == sent.nbytes
            assert got.data_ptr() % 16 == 0 or got.numel() == 0
        assert (received.report, received.worker_id, received.batch_number) == (Report.BATCH, 1, 7)
        assert (received.totals, received.build_s, received.setup_s, received.finished_at) == \
            (TOTALS, 0.002, 0.001, 12.5)


def test_each_tensor_arrives_writable_in_memory_of_its_own():
    first, second = torch.zeros(4), torch.ones(4)
    received, _, flat = _round_trip(_report([first, second]))
    assert flat
    received.payload[0][0] = 5.0
    assert first[0] == 0.0 and received.payload[1][0] == 1.0  # neither the sender's nor a sibling's


@pytest.mark.parametrize("batch", [
    pytest.param(lambda base: [base, base[1:]], id="views-of-one-storage"),
    pytest.param(lambda base: base[1:], id="part-of-a-storage"),
    pytest.param(lambda base: base.view(2, 3).t(), id="not-contiguous"),
    pytest.param(lambda base: base.clone().requires_grad_(), id="requires-grad"),
    pytest.param(lambda base: torch.nn.Parameter(base.clone()), id="tensor-subclass"),
    pytest.param(lambda base: torch.zeros(INLINE_MAX_BYTES // 4 + 1), id="too-large"),
    pytest.param(lambda base: {"x": base}, id="dict"),
    pytest.param(lambda base: [base, 3], id="not-only-tensors"),
    pytest.param(lambda base: [base.clone() for _ in range(17)], id="too-many"),
    pytest.param(lambda base: base.to(torch.complex64).conj(), id="lazy-conjugate"),
    pytest.param(lambda base: torch._neg_view(base), id="lazy-negation"),
])
def test_what_the_flat_wire_cannot_promise_goes_through_the_codec(batch):
    sent = batch(torch.arange(6.0))
    received, _, flat = _round_trip(_report(sent), SlabWriter())
    assert not flat
    if isinstance(sent, torch.Tensor):
        assert torch.equal(received.payload.detach(), sent.detach())
        assert type(received.payload) is type(sent) and received.payload.stride() == sent.stride()


def test_other_reports_go_through_the_codec():
    _, _, flat = _round_trip(_report(None, Report.EXHAUSTED))
    assert not flat


def test_fetch_tasks_travel_as_plain_tuples_and_other_commands_as_themselves():
    grant = SlabGrant(2, 5, 1)
    fetches = (WorkerCommand(Command.FETCH, 9, [4, 5, 6]), WorkerCommand(Command.FETCH, 10, [1], grant=grant))
    for command in fetches:
        wire = command_to_wire(command)
        assert type(wire) is tuple
        assert command_from_wire(pickle.loads(pickle.dumps(wire))) == command
    for command in (WorkerCommand(Command.START_EPOCH, epoch=2, shared_seed=3), WorkerCommand(Command.STOP)):
        assert command_to_wire(command) is command
        assert command_from_wire(pickle.loads(pickle.dumps(command))) == command


def test_economic_pieces_travel_as_plain_tuples_with_their_route_and_placement():
    # A FETCH_ITEMS pickled four classes by name (command, route, grant, placement) for every
    # piece, two or more per worker and batch, each encoded by the main process.
    placement = ItemPlacement((0, 4096), (48, 16), 8192, first_item=32)
    route = ItemRoute(batch_worker=1, slot=32, position=608, direct=True)
    pieces = (WorkerCommand(Command.FETCH_ITEMS, 9, [4, 5, 6], epoch=2, route=route),
              WorkerCommand(Command.FETCH_ITEMS, 9, [7], epoch=2, route=route, grant=SlabGrant(2, 5, 1)),
              WorkerCommand(Command.FETCH_ITEMS, 9, [8], epoch=0, route=route, grant=SlabGrant(2, 5, 1, placement)))
    for command in pieces:
        wire = command_to_wire(command)
        assert type(wire) is tuple
        assert b"pipeload" not in pickle.dumps(wire)  # no class looked up by name
        assert command_from_wire(pickle.loads(pickle.dumps(wire))) == command
