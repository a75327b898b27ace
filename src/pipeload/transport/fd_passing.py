"""Batches over a Unix socket, with every tensor's shared-memory file descriptor passed alongside.

torch's own multiprocessing pickling hands each storage's descriptor over through a separate
"resource sharer" connection: a connect and an authentication handshake per tensor. Here the
worker pickles the batch once, collects the descriptors of all its CPU storages, and sends the
pickle and the descriptors together in one ``sendmsg`` (SCM_RIGHTS). The main process maps each
storage once, however many tensors view it.

Message layout on the stream: a fixed header (payload length, descriptor count), the pickle,
then, only when there are more descriptors than one ``sendmsg`` may carry, one byte per extra
chunk of descriptors.
"""

from __future__ import annotations

import array
import errno
import io
import os
import pickle
import socket
import struct
import threading
from multiprocessing.reduction import ForkingPickler
from typing import Any

import torch
import torch.multiprocessing  # noqa: F401  (registers tensor and storage reductions)
from torch.multiprocessing.reductions import reduce_storage

from pipeload.errors import TooManyOpenFilesError, too_many_open_files

_HEADER = struct.Struct("<QI")
FDS_PER_SENDMSG = 200  # the kernel caps one message at 253 descriptors (SCM_MAX_FD)
_FD_SIZE = array.array("i").itemsize

# What a kept batch costs in this process's descriptor table (said when the table is full).
DESCRIPTORS_PER_KEPT_BATCH = (
    "Every tensor storage of a batch from a worker process keeps one file descriptor open here "
    "for as long as any tensor of that batch is alive, so keeping N batches of k tensors holds "
    "N*k descriptors. "
)


class _DescriptorCollector:
    """Turns CPU storages into slot numbers while a report is pickled, collecting their fds.

    Deliberately not the pickler itself: a pickler whose dispatch table holds its own bound
    method is a reference cycle, and the cycle would keep every pickled batch (and its shared
    memory) alive until the garbage collector happened to run.
    """

    def __init__(self) -> None:
        self.fds: list[int] = []
        self.keep_alive: list[torch.UntypedStorage] = []  # their fds stay valid until sent
        self._slot_of: dict[int, int] = {}

    def reduce_storage(self, storage: torch.UntypedStorage) -> Any:
        if storage.device.type != "cpu":
            return reduce_storage(storage)  # torch's own path for accelerator storages
        nbytes = storage.nbytes()
        if nbytes == 0:
            return (_empty_storage, ())
        slot = self._slot_of.get(storage.data_ptr())
        if slot is None:
            fd, _ = storage._share_fd_cpu_()  # moves it into shared memory if it is not there
            slot = len(self.fds)
            self.fds.append(fd)
            self._slot_of[storage.data_ptr()] = slot
            self.keep_alive.append(storage)
        return (_storage_from_slot, (slot, nbytes))


class _Incoming(threading.local):
    fds: list[int] = []
    storages: dict[int, torch.UntypedStorage] = {}


_incoming = _Incoming()


def _storage_from_slot(slot: int, nbytes: int) -> torch.UntypedStorage:
    storage = _incoming.storages.get(slot)
    if storage is None:
        storage = torch.UntypedStorage._new_shared_fd_cpu(_incoming.fds[slot], nbytes)
        _incoming.storages[slot] = storage
    return storage


def _empty_storage() -> torch.UntypedStorage:
    return torch.UntypedStorage(0)


def dumps_with_fds(obj: Any) -> tuple[memoryview, list[int], list[Any]]:
    """Pickle ``obj``; returns the bytes, the descriptors to send, and what keeps them valid."""
    buffer = io.BytesIO()
    collector = _DescriptorCollector()
    pickler = ForkingPickler(buffer, pickle.HIGHEST_PROTOCOL)
    pickler.dispatch_table[torch.UntypedStorage] = collector.reduce_storage
    pickler.dump(obj)
    return buffer.getbuffer(), collector.fds, collector.keep_alive


def loads_with_fds(payload: bytes | bytearray, fds: list[int]) -> Any:
    """Unpickle a message; closes every received descriptor (storages hold their own).

    Raises:
        TooManyOpenFilesError: mapping a storage failed because this process is out of file
            descriptors (each storage duplicates its descriptor to keep it).
    """
    _incoming.fds, _incoming.storages = fds, {}
    try:
        return pickle.loads(payload)
    except RuntimeError as exc:
        if _descriptor_table_full():  # checked before ours are closed: they count against it
            raise TooManyOpenFilesError(too_many_open_files(DESCRIPTORS_PER_KEPT_BATCH)) from exc
        raise
    finally:
        _incoming.fds, _incoming.storages = [], {}
        for fd in fds:
            os.close(fd)


def send_message(sock: socket.socket, payload: memoryview, fds: list[int]) -> None:
    """Write one message: header and payload, with the descriptors riding on the first byte."""
    chunks = [fds[i : i + FDS_PER_SENDMSG] for i in range(0, len(fds), FDS_PER_SENDMSG)]
    header = _HEADER.pack(len(payload), len(fds))
    sent = sock.sendmsg([header, payload], _rights(chunks[0] if chunks else []))
    if sent < len(header):
        sock.sendall(header[sent:])
        sent = len(header)
    if sent < len(header) + len(payload):
        sock.sendall(payload[sent - len(header) :])
    for chunk in chunks[1:]:
        sock.sendmsg([b"\0"], _rights(chunk))


def receive_message(sock: socket.socket) -> tuple[bytearray, list[int]]:
    """Read one message written by :func:`send_message`.

    Raises:
        EOFError: the writer is gone.
        TooManyOpenFilesError: the kernel could not give this process all the message's
            descriptors (its table is full); the message is consumed whole, so the stream
            stays readable, but this message's batch cannot be rebuilt.
    """
    fds: list[int] = []
    try:
        length, count = _HEADER.unpack(_receive_exactly(sock, _HEADER.size, fds))
        payload = _receive_exactly(sock, length, fds)
        # Extra chunks are counted from the header, not from what arrived: descriptors the
        # kernel dropped must not make us read into the next message.
        for _ in range(max(0, -(-count // FDS_PER_SENDMSG) - 1)):
            _receive_exactly(sock, 1, fds)
        if len(fds) != count:
            raise TooManyOpenFilesError(too_many_open_files(DESCRIPTORS_PER_KEPT_BATCH))
    except BaseException:
        for fd in fds:
            os.close(fd)
        raise
    return payload, fds


def _descriptor_table_full() -> bool:
    """Whether this process can open no more file descriptors (as torch checks, by trying)."""
    try:
        probe = os.open(os.devnull, os.O_RDONLY | os.O_CLOEXEC)
    except OSError as exc:
        return exc.errno == errno.EMFILE
    os.close(probe)
    return False


def _rights(fds: list[int]) -> list[tuple[int, int, bytes]]:
    if not fds:
        return []
    return [(socket.SOL_SOCKET, socket.SCM_RIGHTS, array.array("i", fds).tobytes())]


def _receive_exactly(sock: socket.socket, size: int, fds: list[int]) -> bytearray:
    data = bytearray(size)
    view = memoryview(data)
    got = 0
    ancillary_space = socket.CMSG_SPACE(FDS_PER_SENDMSG * _FD_SIZE)
    while got < size:
        nbytes, ancillary, _flags, _addr = sock.recvmsg_into(
            [view[got:]], ancillary_space, socket.MSG_CMSG_CLOEXEC
        )
        fds.extend(_descriptors_in(ancillary))
        if nbytes == 0:
            raise EOFError("the worker closed its result channel")
        got += nbytes
    return data


def _descriptors_in(ancillary: list[tuple[int, int, bytes]]) -> list[int]:
    found: list[int] = []
    for level, kind, data in ancillary:
        if level == socket.SOL_SOCKET and kind == socket.SCM_RIGHTS:
            usable = len(data) - len(data) % _FD_SIZE
            found.extend(array.array("i", data[:usable]))
    return found
