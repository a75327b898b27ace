"""Channels between the main process and workers; no call here waits without a deadline.

Process workers: each worker gets its own task pipe (main writes, worker reads) and its own result
socket (worker writes batches, main reads; slab controls go the other way, see endpoints.py). The
main process reads all result sockets as one channel with one ``poll``, together with the
workers' exit sentinels, so a worker that dies is seen the moment it dies. One pipe per writer
means a worker killed halfway through a write can never corrupt another worker's messages, and no
lock is shared across processes.

The fixed cost of a batch is a handful of system calls: the task is one non-blocking ``write``
(room is only measured when a pipe is nearly full), the worker wakes in one ``poll`` and reads it,
and the report is one ``sendmsg`` that the main process reads with one ``poll`` and two reads.

Thread workers: the same interface over in-process queues; objects are passed as they are.
"""

from __future__ import annotations

import fcntl
import os
import pickle
import queue
import select
import socket
import struct
import termios
import threading
import time
from collections.abc import Callable
from multiprocessing import connection
from typing import Any

from pipeload.transport.endpoints import Receiver, Sender
from pipeload.transport.messages import (
    Report,
    SlabGrant,
    WorkerCommand,
    WorkerReport,
    command_from_wire,
    command_to_wire,
)

TASK_PIPE_BYTES = 1 << 20
READ_BYTES = 1 << 20
POLL_WHOLE_FRAME_S = 0.1
ROOM_POLL_S = 0.01
FRAME_HEADER = struct.Struct("!i")  # what multiprocessing's Connection expects before a message
FRAME_BYTES = 16  # room to leave beyond the payload when measuring a pipe
_F_SETPIPE_SZ = getattr(fcntl, "F_SETPIPE_SZ", 1031)
_F_GETPIPE_SZ = getattr(fcntl, "F_GETPIPE_SZ", 1032)
_READY = select.POLLIN | select.POLLPRI | select.POLLHUP | select.POLLERR
# Reports that answer a task (and so settle its slab grant); an economic item worker's
# ITEMS_DONE names a batch whose grant belongs to the batch worker.
_ANSWERS = frozenset({Report.BATCH, Report.FAILED, Report.EXHAUSTED})


class PipeEnd:
    """One end of a one-way task pipe, for the single process that owns it (the main process
    writes to its end's descriptor directly, see :meth:`ProcessChannels.send`).

    The reading end takes whatever is waiting in one ``read`` and splits it into frames (the
    4-byte length header ``multiprocessing.connection`` also uses). A read that returned less than
    it asked for emptied the pipe, so asking again at once (``receive(0)``) costs nothing.
    """

    def __init__(self, conn: connection.Connection) -> None:
        self.conn = conn
        self._poller: Any = None
        self._buffer = bytearray()
        self._drained = False

    def __getstate__(self) -> dict[str, Any]:
        return {"conn": self.conn}  # read state stays in its process

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.__init__(state["conn"])

    def receive(self, timeout_s: float) -> Any | None:
        """The next message, or None if none arrives within ``timeout_s``."""
        frame = self._next_frame()
        if frame is None:
            if timeout_s == 0 and self._drained:
                return None
            if not self._read(timeout_s):
                return None
            frame = self._next_frame()
            while frame is None:  # a frame's first bytes are here: the rest is on its way
                self._read(POLL_WHOLE_FRAME_S)
                frame = self._next_frame()
        return command_from_wire(pickle.loads(frame))

    def take_waiting(self) -> list[Any]:
        """Every message waiting now, without waiting; for a reader that polled the pipe itself
        (``receive(0)`` alone trusts the last read to say whether the pipe was emptied)."""
        self._drained = False
        messages = []
        while (message := self.receive(0)) is not None:
            messages.append(message)
        return messages

    def _next_frame(self) -> bytearray | None:
        buffer = self._buffer
        if len(buffer) < FRAME_HEADER.size:
            return None
        (length,) = FRAME_HEADER.unpack_from(buffer)
        end = FRAME_HEADER.size + length
        if len(buffer) < end:
            return None
        frame = buffer[FRAME_HEADER.size:end]
        del buffer[:end]
        return frame

    def _read(self, timeout_s: float) -> bool:
        fd = self.conn.fileno()
        if self._poller is None:
            self._poller = select.poll()
            self._poller.register(fd, _READY)
            os.set_blocking(fd, False)
        try:
            data = os.read(fd, READ_BYTES)
        except BlockingIOError:
            if timeout_s <= 0 or not self._poller.poll(int(timeout_s * 1000)):
                self._drained = True
                return False
            data = os.read(fd, READ_BYTES)
        if not data:
            raise EOFError("the main process closed the task pipe")
        self._buffer += data
        self._drained = len(data) < READ_BYTES
        return True

    def close(self) -> None:
        self.conn.close()


class ProcessChannels:
    """Task pipes and result sockets for ``num_workers`` process workers; owned by the pool.

    Invariant: once a worker has started, the main process holds only its task writer and result
    receiver (the lifecycle closes our copies of the worker's ends right after each start, before
    the next fork can inherit them), so a dead worker shows as EOF / broken pipe, not a stall.
    Task pipes are enlarged so that the prefetch budget's tasks fit without blocking the sender,
    even with large index lists; the main process's write ends are non-blocking.
    """

    def __init__(self, ctx: Any, num_workers: int, pool: Any = None,
                 pool_lock: threading.Lock | None = None) -> None:
        """``pool_lock``: taken while reports are decoded against ``pool``, for a consumer that
        grants slabs on another thread than the one reading reports (a queue boundary)."""
        self.pool = pool
        self._pool_lock = pool_lock
        self._ctx = ctx
        self.task_readers: list[PipeEnd] = []
        self.task_writers: list[PipeEnd] = []
        self.result_readers: list[Receiver] = []
        self.result_writers: list[Sender] = []
        self._live_readers: list[Receiver] = []
        self._readers_by_fd: dict[int, Receiver] | None = None  # rebuilt when the readers change
        self._poller = _Poller()
        self.add_workers(num_workers)

    def add_workers(self, count: int) -> None:
        """Channels for ``count`` more workers, numbered on from the existing ones (a pool
        growing in place); start them, then :meth:`forget_worker_ends` from the first new one."""
        for _ in range(count):
            reader, writer = self._ctx.Pipe(duplex=False)
            _enlarge_pipe(writer.fileno())
            os.set_blocking(writer.fileno(), False)
            result_reader, result_writer = socket.socketpair()
            self.task_readers.append(PipeEnd(reader))
            self.task_writers.append(PipeEnd(writer))
            receiver = Receiver(result_reader, self.pool, len(self.result_readers))
            self.result_readers.append(receiver)
            self._live_readers.append(receiver)
            self.result_writers.append(Sender(result_writer))
        self._readers_by_fd = None

    def drop_workers(self, first: int) -> None:
        """Close and forget the channels of workers ``first`` and up, which have stopped or
        never started (then our copies of their ends are still open too: closed again is a
        no-op)."""
        for end in self.task_writers[first:] + self.task_readers[first:]:
            end.close()
        for reader in self.result_readers[first:]:
            reader.close()
        for writer in self.result_writers[first:]:
            writer.close()
        gone = set(map(id, self.result_readers[first:]))
        self._live_readers = [r for r in self._live_readers if id(r) not in gone]
        self._readers_by_fd = None
        for ends in (self.task_readers, self.task_writers, self.result_readers, self.result_writers):
            del ends[first:]

    def worker_ends(self, worker_id: int) -> tuple[PipeEnd, Sender]:
        """(task inbox, result outbox) to hand to worker ``worker_id``."""
        return self.task_readers[worker_id], self.result_writers[worker_id]

    def forget_worker_ends(self, first: int = 0) -> None:
        """Close the main process's copies of the ends of workers ``first`` and up once they
        have started."""
        for end in self.task_readers[first:] + self.result_writers[first:]:
            end.close()

    def send(
        self, worker_id: int, command: WorkerCommand, while_full: Callable[[], None] | None = None
    ) -> None:
        """Send a command; while the worker's pipe has no room for it, call ``while_full`` every
        slice (it raises to give up: the worker died, the loader timed out, we are closing).

        A command carrying a slab grant is preceded by the slab controls it depends on.
        """
        if command.grant is not None:
            self.result_readers[worker_id].send_controls()
        data = pickle.dumps(command_to_wire(command), pickle.HIGHEST_PROTOCOL)
        frame = FRAME_HEADER.pack(len(data)) + data
        fd = self.task_writers[worker_id].conn.fileno()
        if len(frame) <= select.PIPE_BUF:
            try:
                if os.write(fd, frame) == len(frame):  # atomic: all or nothing
                    return
            except BlockingIOError:
                pass
        frame = memoryview(frame)
        if len(frame) > select.PIPE_BUF:
            while while_full is not None and not _pipe_has_room(fd, len(data)):
                while_full()
                # Polled: the kernel wakes writers when PIPE_BUF bytes are free, not when ours are.
                time.sleep(ROOM_POLL_S)
        while frame:
            try:
                frame = frame[os.write(fd, frame):]
            except BlockingIOError:
                if while_full is None:
                    _wait_writable(fd)
                else:
                    while_full()
                    time.sleep(ROOM_POLL_S)

    def wait(self, timeout_s: float, sentinels: list[int]) -> tuple[list[WorkerReport], list[int]]:
        """Reports ready within ``timeout_s`` and the sentinels that fired (dead workers)."""
        readers = self._readers_by_fd
        if readers is None:  # rebuilt only when a reader is dropped
            readers = self._readers_by_fd = {r.fileno(): r for r in self._live_readers}
        ready = self._poller.poll([*readers, *sentinels], timeout_s)
        reports, fired = [], []
        for fd in ready:
            reader = readers.get(fd)
            if reader is None:
                fired.append(fd)
            elif self._pool_lock is None:
                reports.extend(self._drain(reader))
            else:
                with self._pool_lock:
                    reports.extend(self._drain(reader))
        return reports, fired

    def _drain(self, reader: Receiver) -> list[WorkerReport]:
        """Every report waiting on ``reader`` (at least one: poll said it was readable)."""
        reports = []
        try:
            while (message := reader.receive(block=not reports)) is not None:
                report, info = message
                if self.pool is not None and report.report in _ANSWERS:
                    if report.report is Report.BATCH:  # the others carry no batch to size
                        self.pool.observe_batch(info.shared_bytes)
                    self.pool.settle(report.batch_number, info.outcome)
                    if report.report is Report.EXHAUSTED:  # it skips the tasks it still holds
                        self.pool.cancel_grants_of(report.worker_id)
                reports.append(report)
        except (EOFError, ConnectionResetError):
            # The writer is gone; its sentinel tells the pool how it ended. Stop waiting on an
            # end that would otherwise read as ready forever.
            if reader in self._live_readers:
                self._live_readers.remove(reader)
                self._readers_by_fd = None
        return reports

    def close(self) -> None:
        for end in self.task_writers:
            end.close()
        for reader in self.result_readers:
            reader.close()


class _Poller:
    """One ``select.poll`` object, re-registered only when the set of descriptors changes."""

    def __init__(self) -> None:
        self._poll = select.poll()
        self._fds: tuple[int, ...] = ()

    def poll(self, fds: list[int], timeout_s: float) -> list[int]:
        key = tuple(fds)
        if key != self._fds:
            self._poll = select.poll()
            for fd in key:
                self._poll.register(fd, _READY)
            self._fds = key
        timeout_ms = max(0, int(timeout_s * 1000 + 0.999))
        return [fd for fd, _events in self._poll.poll(timeout_ms)]


def _wait_writable(fd: int) -> None:
    poller = select.poll()
    poller.register(fd, select.POLLOUT)
    poller.poll(int(ROOM_POLL_S * 1000))


def _pipe_has_room(fd: int, nbytes: int) -> bool:
    """Whether a message of ``nbytes`` fits in the pipe now, so writing it cannot block.

    A message larger than the whole pipe can never fit; it is written anyway (the worker reads it
    as it arrives), which only index lists of hundreds of thousands of entries reach.
    """
    try:
        capacity = fcntl.fcntl(fd, _F_GETPIPE_SZ)
        unread = struct.unpack("i", fcntl.ioctl(fd, termios.FIONREAD, b"\0\0\0\0"))[0]
    except OSError:
        return True  # not a Linux pipe: fall back to writing as room appears
    needed = nbytes + FRAME_BYTES
    return needed > capacity or needed <= capacity - unread


def _enlarge_pipe(fd: int) -> None:
    """Ask Linux for a larger pipe buffer (the default is 64 KiB); best effort elsewhere."""
    try:
        fcntl.fcntl(fd, _F_SETPIPE_SZ, TASK_PIPE_BYTES)
    except OSError:
        pass  # capped by /proc/sys/fs/pipe-max-size, or not Linux: the default still works


class QueueEnd:
    """A thread worker's inbox or outbox: the same calls as :class:`PipeEnd`, no pickling."""

    def __init__(self, q: queue.SimpleQueue | queue.Queue) -> None:
        self.queue = q

    def send(self, message: Any) -> None:
        self.queue.put(message)

    setup_s = 0.0  # threads share memory: nothing to set up

    def prepare(self, grant: SlabGrant | None) -> None:
        """Threads share memory: no slab, no shared-memory collation."""

    def confirm_views(self) -> None:
        """No slab was written: nothing to say."""

    def offer_buffers(self) -> None:
        """Threads share memory: no buffer to offer."""

    def receive(self, timeout_s: float) -> Any | None:
        try:
            return self.queue.get(timeout=timeout_s)
        except queue.Empty:
            return None

    def close(self) -> None:
        pass


class ThreadChannels:
    """Per-worker task queues and one shared result queue for thread workers."""

    pool = None

    def __init__(self, num_workers: int) -> None:
        self.task_queues = [QueueEnd(queue.SimpleQueue()) for _ in range(num_workers)]
        self.results = QueueEnd(queue.SimpleQueue())

    def add_workers(self, count: int) -> None:
        self.task_queues += [QueueEnd(queue.SimpleQueue()) for _ in range(count)]

    def drop_workers(self, first: int) -> None:
        del self.task_queues[first:]

    def worker_ends(self, worker_id: int) -> tuple[QueueEnd, QueueEnd]:
        return self.task_queues[worker_id], self.results

    def forget_worker_ends(self, first: int = 0) -> None:
        pass

    def send(
        self, worker_id: int, command: WorkerCommand, while_full: Callable[[], None] | None = None
    ) -> None:
        self.task_queues[worker_id].send(command)  # unbounded: never full

    def wait(self, timeout_s: float, sentinels: list[int]) -> tuple[list[WorkerReport], list[int]]:
        report = self.results.receive(timeout_s)
        return ([report] if report is not None else []), []

    def close(self) -> None:
        pass
