"""Messages over a real socket pair: framing, descriptors riding along, reading many at once."""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import textwrap
import threading

import pytest

from pipeload.transport.fd_passing import (
    FDS_PER_SENDMSG,
    READ_CHUNK_BYTES,
    MessageReader,
    receive_message,
    send_message,
)


def _pipe_fds(count: int) -> list[int]:
    fds = []
    for _ in range(count):
        fds.extend(os.pipe())
    return fds


def _send_in_thread(sock, messages):
    # A writer thread, so payloads larger than the socket buffer cannot deadlock the test.
    writer = threading.Thread(target=lambda: [send_message(sock, p, f) for p, f in messages])
    writer.start()
    return writer


def _same_file(a: int, b: int) -> bool:
    return os.fstat(a).st_ino == os.fstat(b).st_ino


def test_payload_and_descriptors_arrive_together():
    left, right = socket.socketpair()
    read_end, write_end = os.pipe()
    with left, right:
        send_message(left, b"hello", [read_end])
        payload, fds = receive_message(right)
        assert payload == b"hello" and len(fds) == 1 and _same_file(fds[0], read_end)
        for fd in (*fds, read_end, write_end):
            os.close(fd)


@pytest.mark.parametrize("how", ["one at a time", "reader"])
def test_more_descriptors_than_one_sendmsg_carries(how):
    left, right = socket.socketpair()
    fds = _pipe_fds((FDS_PER_SENDMSG + 37) // 2 + 1)
    with left, right:
        writer = _send_in_thread(left, [(b"x" * 10, fds), (b"second", fds[:3])])
        reader = MessageReader(right)
        first = receive_message(right) if how == "one at a time" else reader.next_message(True)
        second = receive_message(right) if how == "one at a time" else reader.next_message(True)
        writer.join()
        assert first[0] == b"x" * 10 and len(first[1]) == len(fds)
        assert all(_same_file(a, b) for a, b in zip(first[1], fds))
        assert second[0] == b"second" and all(_same_file(a, b) for a, b in zip(second[1], fds))
        for fd in fds + first[1] + second[1]:
            os.close(fd)


def test_the_reader_splits_a_burst_and_says_when_nothing_is_waiting():
    left, right = socket.socketpair()
    with left, right:
        reader = MessageReader(right)
        assert reader.next_message(block=False) is None
        for index in range(50):
            send_message(left, str(index).encode(), [])
        got = []
        while (message := reader.next_message(block=False)) is not None:
            got.append(bytes(message[0]))
        assert got == [str(index).encode() for index in range(50)]


def test_a_message_after_the_end_of_a_burst_is_read_by_the_next_call():
    left, right = socket.socketpair()
    with left, right:
        reader = MessageReader(right)
        send_message(left, b"first", [])
        assert bytes(reader.next_message(block=True)[0]) == b"first"
        assert reader.next_message(block=False) is None  # the short read emptied the socket
        send_message(left, b"later", [])
        assert bytes(reader.next_message(block=False)[0]) == b"later"


def test_the_reader_takes_a_message_larger_than_its_buffer():
    left, right = socket.socketpair()
    big = os.urandom(3 * READ_CHUNK_BYTES + 17)
    with left, right:
        writer = _send_in_thread(left, [(b"small", []), (big, []), (b"after", [])])
        reader = MessageReader(right)
        got = [bytes(reader.next_message(True)[0]) for _ in range(3)]
        writer.join()
        assert got == [b"small", big, b"after"]


def test_a_reader_sent_to_a_spawned_worker_travels_without_its_buffer():
    # A batch worker's readers go to it pickled ('spawn', 'forkserver'): two 256 KiB buffers
    # made its start-up data larger than a pipe holds (see MessageReader.__getstate__).
    from multiprocessing.context import set_spawning_popen
    from multiprocessing.reduction import ForkingPickler

    from pipeload.engine.lifecycle import _StartingProcess

    left, right = socket.socketpair()
    with left, right:
        reader = MessageReader(right)
        set_spawning_popen(_StartingProcess())
        try:
            sent = ForkingPickler.dumps(reader)
        finally:
            set_spawning_popen(None)
        assert len(sent) < 1024
        rebuilt = MessageReader.__new__(MessageReader)
        rebuilt.__setstate__(reader.__getstate__())
        send_message(left, b"after the trip", [])
        assert bytes(rebuilt.next_message(True)[0]) == b"after the trip"


def test_a_closed_writer_reads_as_end_of_file():
    left, right = socket.socketpair()
    left.close()
    with right, pytest.raises(EOFError):
        receive_message(right)
    left, right = socket.socketpair()
    send_message(left, b"last", [])
    left.close()
    reader = MessageReader(right)
    with right:
        assert bytes(reader.next_message(True)[0]) == b"last"
        with pytest.raises(EOFError):
            reader.next_message(True)


# Runs with a small descriptor table; prints what happened as JSON.
_FULL_TABLE_SCRIPT = textwrap.dedent(
    """
    import json, os, resource, socket
    import torch
    from pipeload.errors import TooManyOpenFilesError
    from pipeload.transport.codec import decode, encode
    from pipeload.transport.fd_passing import MessageReader, receive_message, send_message

    BIG = 1 << 15  # floats: 128 KiB, so each tensor travels by descriptor
    resource.setrlimit(resource.RLIMIT_NOFILE, (64, 64))
    left, right = socket.socketpair()
    reader = MessageReader(right)

    def send(*values):
        payload, fds, keep_alive = encode([torch.full((BIG,), float(v)) for v in values], None)
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

    def load(receive):
        try:
            batch, _ = decode(*receive(), None)
            return ["ok", [t[0].item() for t in batch]]
        except TooManyOpenFilesError as exc:
            return [str(exc), None]

    def one():
        return receive_message(right)

    def next_of_reader():
        return reader.next_message(True)

    result = {}
    # 1. The kernel cannot install all of a message's descriptors (room for 2 of 5).
    send(0, 1, 2, 3, 4)
    filler = fill_table_leaving(2)
    result["truncated"] = load(one)[0]
    for fd in filler:
        os.close(fd)
    send(7)  # the stream must still be in step
    result["next"] = load(one)
    # 2. The same through the reader, which reads several messages per call: a message without
    # descriptors before the damaged one, and one after it, arrive intact.
    send()
    send(0, 1, 2, 3, 4)
    filler = fill_table_leaving(2)
    result["reader"] = [load(next_of_reader), load(next_of_reader)[0]]
    for fd in filler:
        os.close(fd)
    send(9)
    result["reader_next"] = load(next_of_reader)
    # 3. The descriptors arrive, but mapping a storage (which keeps a duplicate) finds no room.
    send(0, 1, 2, 3, 4)
    filler = fill_table_leaving(5)
    result["mapping"] = load(one)[0]
    for fd in filler:
        os.close(fd)
    before = len(os.listdir("/proc/self/fd"))
    send(8)
    result["after"] = load(one)
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
    for message in (result["truncated"], result["reader"][1], result["mapping"]):
        assert message.startswith("Too many open files. Communication with the workers is no longer possible.")
        assert "ulimit -n" in message and "one file descriptor" in message
    assert result["next"] == ["ok", [7.0]]
    assert result["reader"][0] == ["ok", []]
    assert result["reader_next"] == ["ok", [9.0]]
    assert result["after"] == ["ok", [8.0]]
    assert result["fds_back_to"] == 0
