"""Messages over a Unix stream socket, with file descriptors passed alongside (SCM_RIGHTS).

One message is a fixed header (payload length, descriptor count), the payload, then, only when
there are more descriptors than one ``sendmsg`` may carry, one byte per extra chunk of
descriptors. :class:`MessageReader` reads whatever is waiting in one ``recvmsg`` and splits it
into messages, so a reader woken for one message pays one system call for it, or less. The
descriptors of a batch's shared-memory buffers ride on the same ``sendmsg`` as its bytes, so a
batch is one message however many buffers it has: no side channel, no handshake per tensor (torch
hands each descriptor over through a separate connection). When this process's descriptor table
is full, the kernel drops descriptors; the reader notices (see :class:`MessageReader`) and raises
:class:`~pipeload.errors.TooManyOpenFilesError` for that message only.
"""

from __future__ import annotations

import array
import collections
import errno
import os
import socket
import struct
from typing import Any

from pipeload.errors import TooManyOpenFilesError, too_many_open_files

_HEADER = struct.Struct("<QI")
FDS_PER_SENDMSG = 200  # the kernel caps one message at 253 descriptors (SCM_MAX_FD)
_FD_SIZE = array.array("i").itemsize
_ANCILLARY_SPACE = socket.CMSG_SPACE(FDS_PER_SENDMSG * _FD_SIZE)
_BLOCKING = int(socket.MSG_CMSG_CLOEXEC)  # plain ints: flag enums cost a Python call to combine
_NON_BLOCKING = int(socket.MSG_CMSG_CLOEXEC | socket.MSG_DONTWAIT)
_TRUNCATED = int(socket.MSG_CTRUNC)

# What a kept batch costs in this process's descriptor table (said when the table is full).
DESCRIPTORS_PER_KEPT_BATCH = (
    "A batch from a worker process that finds no reusable shared-memory slab free (kept batches "
    "hold theirs) travels in fresh shared memory, and every tensor storage of it larger than "
    "64 KiB keeps one file descriptor open here for as long as any tensor of that batch is "
    "alive, so keeping N such batches of k tensors holds N*k descriptors. "
)


def send_message(sock: socket.socket, payload: memoryview | bytes, fds: list[int]) -> None:
    """Write one message: header and payload, with the descriptors riding on the first byte."""
    chunks = [fds[i : i + FDS_PER_SENDMSG] for i in range(0, len(fds), FDS_PER_SENDMSG)]
    header = _HEADER.pack(len(payload), len(fds))
    sent = sock.sendmsg([header, payload], _rights(chunks[0] if chunks else []))
    if sent < len(header):
        sock.sendall(header[sent:])
        sent = len(header)
    if sent < len(header) + len(payload):
        sock.sendall(memoryview(payload)[sent - len(header) :])
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


def descriptor_table_full() -> bool:
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
    while got < size:
        nbytes, ancillary, _flags, _addr = sock.recvmsg_into(
            [view[got:]], _ANCILLARY_SPACE, _BLOCKING
        )
        fds.extend(_descriptors_in(ancillary))
        if nbytes == 0:
            raise EOFError("the other end closed the channel")
        got += nbytes
    return data


def _descriptors_in(ancillary: list[tuple[int, int, bytes]]) -> list[int]:
    found: list[int] = []
    for level, kind, data in ancillary:
        if level == socket.SOL_SOCKET and kind == socket.SCM_RIGHTS:
            usable = len(data) - len(data) % _FD_SIZE
            found.extend(array.array("i", data[:usable]))
    return found


READ_CHUNK_BYTES = 256 * 1024
MIN_READ_BYTES = 64 * 1024


class MessageReader:
    """Reads :func:`send_message` messages from one socket, many per ``recvmsg`` when available.

    Owned by one thread. Which message received descriptors belong to follows from where the
    ``recvmsg`` that brought them ended: the kernel hands a write's descriptors to the first read
    that touches the write's bytes and ends that read within the write, so a batch of descriptors
    belongs to the message whose bytes contain the end of its read. That holds even when the
    kernel drops descriptors (a full table: ``MSG_CTRUNC``), so the stream stays in step and only
    the message that lost some is refused.

    Invariant: ``_buffer[_start:_end]`` holds the bytes received but not yet returned, the first
    of them at stream offset ``_offset``; ``_arrivals`` holds, oldest first, the descriptors of
    reads not yet matched to a message, with the stream offset where each read ended and whether
    the kernel dropped some.
    """

    def __init__(self, sock: socket.socket) -> None:
        self.sock = sock
        self._buffer = bytearray(READ_CHUNK_BYTES)
        self._start = self._end = 0
        self._offset = 0
        self._arrivals: collections.deque[tuple[int, list[int], bool]] = collections.deque()
        self._drained = False

    # A reader sent to a 'spawn' or 'forkserver' worker (a batch worker's sockets from item
    # workers) travels without its buffer: nothing was read yet, and two 256 KiB buffers made a
    # batch worker's start-up data 526 KB. Past a pipe's 64 KiB, a 'spawn' worker that died
    # before reading it all (a script without a main guard) left the main process blocked in
    # its write for good.
    def __getstate__(self) -> dict[str, Any]:
        if self._end != self._start or self._arrivals:
            raise TypeError("a MessageReader holding bytes or descriptors it has read cannot be "
                            "sent to another process: they would be lost")
        return {"sock": self.sock}

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.__init__(state["sock"])

    def next_message(self, block: bool) -> tuple[bytearray, list[int]] | None:
        """The next whole message; None when ``block`` is False and none is complete yet.

        A non-blocking call right after a read that emptied the socket answers None without
        reading again (once: the call after it reads), which saves a failing system call at the
        end of every burst; a reader woken by ``poll`` misses nothing by it.

        A message whose first bytes have arrived is always read to its end (its writer sends it
        whole, or dies and closes the socket).

        Raises:
            EOFError: the writer is gone.
            TooManyOpenFilesError: the kernel could not give this process all the message's
                descriptors; the message is consumed, later ones stay readable.
        """
        while self._end - self._start < _HEADER.size:
            if not block and self._drained:
                self._drained = False  # answered once from the last read; the next call reads
                return None  # that read was short: the socket was empty a moment ago
            if not self._fill(block):
                return None
        length, count = _HEADER.unpack_from(self._buffer, self._start)
        markers = max(0, -(-count // FDS_PER_SENDMSG) - 1)
        total = _HEADER.size + length + markers
        while self._end - self._start < total:
            self._fill(True, room=total)
        begin = self._start + _HEADER.size
        payload = self._buffer[begin:begin + length]
        self._start += total
        self._offset += total
        fds, dropped = self._descriptors_until(self._offset)
        if dropped or len(fds) != count:
            _close_all(fds)
            raise TooManyOpenFilesError(too_many_open_files(DESCRIPTORS_PER_KEPT_BATCH))
        return payload, fds

    def _descriptors_until(self, end: int) -> tuple[list[int], bool]:
        """Descriptors of the reads that ended at or before stream offset ``end``."""
        fds: list[int] = []
        dropped = False
        arrivals = self._arrivals
        while arrivals and arrivals[0][0] <= end:
            _, more, truncated = arrivals.popleft()
            fds.extend(more)
            dropped = dropped or truncated
        return fds, dropped

    def _fill(self, block: bool, room: int = 0) -> bool:
        """Receive more bytes; False if none were waiting (non-blocking). Raises EOFError."""
        if self._start == self._end:
            self._start = self._end = 0
            if len(self._buffer) > 4 * READ_CHUNK_BYTES:  # a huge message passed: shrink back
                self._buffer = bytearray(READ_CHUNK_BYTES)
        if room or len(self._buffer) - self._end < MIN_READ_BYTES:
            self._make_room(room)
        flags = _BLOCKING if block else _NON_BLOCKING
        try:
            nbytes, ancillary, msg_flags, _addr = self.sock.recvmsg_into(
                [memoryview(self._buffer)[self._end:]], _ANCILLARY_SPACE, flags)
        except BlockingIOError:
            return False
        self._end += nbytes
        # A stream socket's read that did not fill the room offered emptied it; a caller asking
        # "anything else?" right after is answered without a system call (poll sees anything new).
        self._drained = nbytes < len(self._buffer) - self._end + nbytes
        if ancillary or msg_flags & _TRUNCATED:
            read_end = self._offset + self._end - self._start
            self._arrivals.append((read_end, _descriptors_in(ancillary), bool(msg_flags & _TRUNCATED)))
        if nbytes == 0:
            raise EOFError("the other end closed the channel")
        return True

    def _make_room(self, room: int) -> None:
        """Keep at least ``room`` bytes (and a useful read's worth) free after ``_start``."""
        unread = self._end - self._start
        wanted = max(room, unread + MIN_READ_BYTES)
        if len(self._buffer) - self._start < wanted and self._start:
            self._buffer[:unread] = self._buffer[self._start:self._end]
            self._start, self._end = 0, unread
        if len(self._buffer) < wanted:
            self._buffer.extend(bytearray(wanted - len(self._buffer)))

    def close(self) -> None:
        """Close descriptors received but never handed out."""
        while self._arrivals:
            _close_all(self._arrivals.popleft()[1])


def _close_all(fds: list[int]) -> None:
    for fd in fds:
        os.close(fd)
