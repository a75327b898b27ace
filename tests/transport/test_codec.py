"""Encoding batches: small tensors inside the message, large ones in shared memory, views kept."""

from __future__ import annotations

import gc
import os
import socket
import threading

import numpy as np
import pytest
import torch

from pipeload.transport.codec import INLINE_BUDGET_BYTES, INLINE_MAX_BYTES, decode, encode
from pipeload.transport.fd_passing import receive_message, send_message
from pipeload.transport.messages import GrantOutcome
from pipeload.transport.slab_writer import SlabWriter


def _round_trip(obj, writer=None):
    left, right = socket.socketpair()
    with left, right:
        payload, fds, keep_alive = encode(obj, writer)
        writer_thread = threading.Thread(target=send_message, args=(left, payload, fds))
        writer_thread.start()
        received, received_fds = receive_message(right)
        writer_thread.join()
        del keep_alive
        count = len(received_fds)
        decoded, info = decode(received, received_fds, None)
        return decoded, count, info


def test_small_tensors_travel_inside_the_message():
    batch = {"x": torch.arange(12.0).reshape(3, 4), "label": [1, 2, 3], "name": "b0"}
    received, fd_count, info = _round_trip(batch)
    assert fd_count == 0 and info.shared_bytes == 0
    assert torch.equal(received["x"], batch["x"]) and not received["x"].is_shared()
    assert received["label"] == [1, 2, 3] and received["name"] == "b0"
    received["x"][0, 0] = 100.0  # writable, and its own memory
    assert batch["x"][0, 0] == 0.0


def test_large_tensors_travel_as_descriptors_of_fresh_shared_memory():
    big = torch.arange(INLINE_MAX_BYTES // 4 + 1, dtype=torch.float32)
    received, fd_count, info = _round_trip({"big": big}, SlabWriter())
    assert fd_count == 1 and info.shared_bytes == big.nbytes
    assert torch.equal(received["big"], big) and received["big"].is_shared()


def test_views_of_one_storage_arrive_as_views_of_one_storage():
    for base in (torch.arange(10), torch.arange(INLINE_MAX_BYTES)):
        received, _, _ = _round_trip((base, base[2:5], base[::2], base.view(2, -1).t()))
        whole, middle, strided, transposed = received
        assert torch.equal(middle, base[2:5]) and torch.equal(strided, base[::2])
        assert torch.equal(transposed, base.view(2, -1).t())
        assert transposed.stride() == base.view(2, -1).t().stride()
        whole[3] = -1  # one storage: a write through one view shows through the others
        assert middle[1].item() == -1


def test_the_inline_budget_sends_the_rest_as_descriptors():
    count = INLINE_BUDGET_BYTES // INLINE_MAX_BYTES + 3
    tensors = [torch.full((INLINE_MAX_BYTES // 4,), float(i)) for i in range(count)]
    received, fd_count, _ = _round_trip(tensors)
    assert fd_count == 3
    assert all(torch.equal(a, b) for a, b in zip(received, tensors))


@pytest.mark.parametrize("dtype", [torch.bool, torch.uint8, torch.int16, torch.int64,
                                   torch.float16, torch.bfloat16, torch.float64,
                                   torch.complex64])
def test_every_dtype_and_empty_and_scalar_tensors(dtype):
    values = torch.arange(6).reshape(2, 3).to(dtype)
    received, _, _ = _round_trip([values, values[:, :0], values[1, 2]])
    assert torch.equal(received[0], values) and received[0].dtype == dtype
    assert received[1].shape == (2, 0) and received[2].shape == ()
    assert torch.equal(received[2], values[1, 2])


def test_tensors_needing_torchs_own_path_keep_their_properties():
    leaf = torch.ones(3, requires_grad=True)
    conjugated = torch.tensor([1 + 2j, 3 - 1j]).conj()
    received, _, _ = _round_trip({"leaf": leaf, "conj": conjugated,
                                  "param": torch.nn.Parameter(torch.zeros(2))})
    assert received["leaf"].requires_grad and torch.equal(received["leaf"], leaf.detach())
    assert torch.equal(received["conj"], conjugated)
    assert isinstance(received["param"], torch.nn.Parameter)


def test_numpy_and_plain_objects_are_pickled():
    batch = {"array": np.arange(5), "nested": [(1, "a"), {"k": None}], "bytes": b"\x00\x01"}
    received, _, _ = _round_trip(batch)
    assert np.array_equal(received["array"], batch["array"])
    assert received["nested"] == batch["nested"] and received["bytes"] == batch["bytes"]


def test_no_descriptor_outlives_the_tensors_it_carried():
    before = len(os.listdir("/proc/self/fd"))
    received, _, _ = _round_trip([torch.ones(INLINE_MAX_BYTES) for _ in range(5)], SlabWriter())
    assert all(t.sum().item() == INLINE_MAX_BYTES for t in received)
    del received  # each storage holds one descriptor of its own while it lives, as in torch
    assert len(os.listdir("/proc/self/fd")) == before


def test_encoding_keeps_no_batch_alive_without_the_garbage_collector():
    gc.disable()
    try:
        tensor = torch.ones(INLINE_MAX_BYTES)
        storage_ref = tensor.untyped_storage()._weak_ref()
        payload, fds, keep_alive = encode({"t": tensor}, SlabWriter())
        del payload, fds, keep_alive, tensor
        assert torch.UntypedStorage._expired(storage_ref)
    finally:
        gc.enable()


def test_a_message_without_a_grant_reports_no_grant():
    _, _, info = _round_trip(torch.ones(3), SlabWriter())
    assert info.outcome is GrantOutcome.NO_GRANT
