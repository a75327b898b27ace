"""Descriptor passing: a batch's tensors cross a real socket pair as shared memory, not bytes."""

from __future__ import annotations

import gc
import json
import os
import socket
import subprocess
import sys
import textwrap
import threading

import pytest
import torch

from pipeload.transport.fd_passing import (
    FDS_PER_SENDMSG,
    dumps_with_fds,
    loads_with_fds,
    receive_message,
    send_message,
)


def _round_trip(obj):
    left, right = socket.socketpair()
    with left, right:
        payload, fds, keep_alive = dumps_with_fds(obj)
        # A writer thread, so a payload larger than the socket buffer cannot deadlock the test.
        writer = threading.Thread(target=send_message, args=(left, payload, fds))
        writer.start()
        received_payload, received_fds = receive_message(right)
        writer.join()
        del keep_alive
        return loads_with_fds(received_payload, received_fds), len(received_fds)


def test_tensors_arrive_in_shared_memory_with_equal_values():
    batch = {"x": torch.arange(12.0).reshape(3, 4), "label": [1, 2, 3], "name": "b0"}
    received, fd_count = _round_trip(batch)
    assert fd_count == 1
    assert torch.equal(received["x"], batch["x"])
    assert received["x"].is_shared()
    assert received["label"] == [1, 2, 3] and received["name"] == "b0"


def test_views_of_one_storage_share_one_descriptor_and_one_mapping():
    base = torch.arange(10)
    received, fd_count = _round_trip((base, base[2:5], base[::2]))
    assert fd_count == 1
    whole, middle, strided = received
    assert torch.equal(middle, torch.tensor([2, 3, 4])) and torch.equal(strided, base[::2])
    whole[3] = 100  # one mapping: a write through one view shows through the others
    assert middle[1].item() == 100


def test_empty_and_many_tensors_more_than_one_sendmsg_carries():
    tensors = [torch.full((2,), float(i)) for i in range(FDS_PER_SENDMSG + 37)]
    received, fd_count = _round_trip({"many": tensors, "empty": torch.zeros(0)})
    assert fd_count == len(tensors)
    assert all(torch.equal(a, b) for a, b in zip(received["many"], tensors))
    assert received["empty"].numel() == 0


def test_no_descriptor_outlives_the_tensors_it_carried():
    before = len(os.listdir("/proc/self/fd"))
    received, _ = _round_trip([torch.ones(1000) for _ in range(5)])
    assert all(t.sum().item() == 1000 for t in received)
    del received  # each storage holds one descriptor of its own while it lives, as in torch
    assert len(os.listdir("/proc/self/fd")) == before


def test_pickling_keeps_no_batch_alive_without_the_garbage_collector():
    gc.disable()
    try:
        tensor = torch.ones(1000)
        storage_ref = tensor.untyped_storage()._weak_ref()
        payload, fds, keep_alive = dumps_with_fds({"t": tensor})
        del payload, fds, keep_alive, tensor
        assert torch.UntypedStorage._expired(storage_ref)
    finally:
        gc.enable()


def test_a_closed_writer_reads_as_end_of_file():
    left, right = socket.socketpair()
    left.close()
    with right, pytest.raises(EOFError):
        receive_message(right)


# Runs with a small descriptor table; prints what happened as JSON.
_FULL_TABLE_SCRIPT = textwrap.dedent(
    """
    import json, os, resource, socket, sys, threading
    import torch
    from pipeload.errors import TooManyOpenFilesError
    from pipeload.transport.fd_passing import dumps_with_fds, loads_with_fds, receive_message, send_message

    resource.setrlimit(resource.RLIMIT_NOFILE, (64, 64))
    left, right = socket.socketpair()

    def send(batch):
        payload, fds, keep_alive = dumps_with_fds(batch)
        send_message(left, payload, fds)

    def fill_table_leaving(free):
        filler = []
        while True:
            try:
                filler.append(os.open(os.devnull, os.O_RDONLY))
            except OSError:
                break
        for _ in range(free):
            os.close(filler.pop())
        return filler

    def receive_and_load():
        try:
            return "ok", loads_with_fds(*receive_message(right))
        except TooManyOpenFilesError as exc:
            return str(exc), None

    result = {}
    # 1. The kernel cannot install all of a message's descriptors (room for 2 of 5).
    send([torch.full((3,), float(i)) for i in range(5)])
    filler = fill_table_leaving(2)
    result["truncated"], _ = receive_and_load()
    for fd in filler:
        os.close(fd)
    send([torch.full((3,), 7.0)])  # the stream must still be in step
    status, batch = receive_and_load()
    result["next"] = [status, batch[0].tolist()]
    del batch
    # 2. The descriptors arrive, but mapping a storage (which keeps a duplicate) finds no room.
    send([torch.full((3,), float(i)) for i in range(5)])
    filler = fill_table_leaving(5)
    result["mapping"], _ = receive_and_load()
    for fd in filler:
        os.close(fd)
    before = len(os.listdir("/proc/self/fd"))
    send([torch.full((3,), 8.0)])
    status, batch = receive_and_load()
    result["after"] = [status, batch[0].tolist()]
    del batch
    result["fds_back_to"] = len(os.listdir("/proc/self/fd")) - before
    print(json.dumps(result))
    """
)


def test_a_full_descriptor_table_is_a_clear_error_and_the_stream_stays_in_step(tmp_path):
    script = tmp_path / "full_table.py"
    script.write_text(_FULL_TABLE_SCRIPT)
    src = os.path.join(os.path.dirname(__file__), "..", "..", "src")
    env = {**os.environ, "PYTHONPATH": os.path.abspath(src)}
    done = subprocess.run([sys.executable, str(script)], capture_output=True, text=True, timeout=60, env=env)
    assert done.returncode == 0, done.stderr
    result = json.loads(done.stdout.strip().splitlines()[-1])
    for case in ("truncated", "mapping"):
        assert result[case].startswith("Too many open files. Communication with the workers is no longer possible.")
        assert "ulimit -n" in result[case] and "one file descriptor" in result[case]
    assert result["next"] == ["ok", [7.0, 7.0, 7.0]]
    assert result["after"] == ["ok", [8.0, 8.0, 8.0]]
    assert result["fds_back_to"] == 0
