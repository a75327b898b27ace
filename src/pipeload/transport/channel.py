"""Channels between the main process and workers; no call here waits without a deadline.

Process workers: each worker gets its own task pipe (main writes, worker reads) and its own result
pipe (worker writes, main reads). The main process reads all result pipes as one channel through
``multiprocessing.connection.wait``, together with the workers' exit sentinels, so a worker that
dies is seen the moment it dies. One pipe per writer means a worker killed halfway through a write
can never corrupt another worker's messages, and no lock is shared across processes.

Result channels are Unix socket pairs, so that the shared-memory file descriptors of a batch's
tensors travel with the batch's pickle in one message (see fd_passing.py): the bytes of a tensor
are never copied through the channel.

Thread workers: the same interface over in-process queues; objects are passed as they are.
"""

from __future__ import annotations

import fcntl
import pickle
import queue
import socket
import struct
import termios
import time
from collections.abc import Callable
from multiprocessing import connection
from typing import Any

from pipeload.transport.fd_passing import (
    dumps_with_fds,
    loads_with_fds,
    receive_message,
    send_message,
)
from pipeload.transport.messages import WorkerCommand, WorkerReport

TASK_PIPE_BYTES = 1 << 20
ROOM_POLL_S = 0.01
FRAME_BYTES = 16  # Connection.send_bytes adds a small length header
_F_SETPIPE_SZ = getattr(fcntl, "F_SETPIPE_SZ", 1031)
_F_GETPIPE_SZ = getattr(fcntl, "F_GETPIPE_SZ", 1032)


class ResultSocket:
    """One end of a worker's result socket: the worker sends on it, the main process receives."""

    def __init__(self, sock: socket.socket) -> None:
        self.sock = sock

    def fileno(self) -> int:
        return self.sock.fileno()

    def send(self, message: Any) -> None:
        payload, fds, keep_alive = dumps_with_fds(message)
        send_message(self.sock, payload, fds)
        del keep_alive  # the descriptors are in the kernel's hands now

    def ready(self) -> bool:
        return bool(connection.wait([self.sock], 0))

    def receive(self) -> Any:
        payload, fds = receive_message(self.sock)
        return loads_with_fds(payload, fds)

    def close(self) -> None:
        self.sock.close()


class PipeEnd:
    """One end of a one-way task pipe, for the single process that owns it."""

    def __init__(self, conn: connection.Connection) -> None:
        self.conn = conn

    def send(self, message: Any) -> None:
        self.conn.send_bytes(pickle.dumps(message, pickle.HIGHEST_PROTOCOL))

    def receive(self, timeout_s: float) -> Any | None:
        """The next message, or None if none arrives within ``timeout_s``."""
        if not self.conn.poll(timeout_s):
            return None
        return pickle.loads(self.conn.recv_bytes())

    def close(self) -> None:
        self.conn.close()


class ProcessChannels:
    """Task and result pipes for ``num_workers`` process workers; owned by the pool.

    Invariant: once a worker has started, the main process holds only its task writer and result
    reader (the lifecycle closes our copies of the worker's ends right after each start, before
    the next fork can inherit them), so a dead worker shows as EOF / broken pipe, not a stall.
    Task pipes are enlarged so that the prefetch budget's tasks fit without blocking the sender,
    even with large index lists.
    """

    def __init__(self, ctx: Any, num_workers: int) -> None:
        task_pipes = [ctx.Pipe(duplex=False) for _ in range(num_workers)]
        for _, writer in task_pipes:
            _enlarge_pipe(writer.fileno())
        result_pairs = [socket.socketpair() for _ in range(num_workers)]
        self.task_readers = [PipeEnd(reader) for reader, _ in task_pipes]
        self.task_writers = [PipeEnd(writer) for _, writer in task_pipes]
        self.result_readers = [ResultSocket(reader) for reader, _ in result_pairs]
        self.result_writers = [ResultSocket(writer) for _, writer in result_pairs]
        self._live_readers = list(self.result_readers)

    def worker_ends(self, worker_id: int) -> tuple[PipeEnd, ResultSocket]:
        """(task inbox, result outbox) to hand to worker ``worker_id``."""
        return self.task_readers[worker_id], self.result_writers[worker_id]

    def forget_worker_ends(self) -> None:
        """Close the main process's copies of the workers' ends once they have started."""
        for end in self.task_readers + self.result_writers:
            end.close()

    def send(
        self, worker_id: int, command: WorkerCommand, while_full: Callable[[], None] | None = None
    ) -> None:
        """Send a command; while the worker's pipe has no room for it, call ``while_full`` every
        slice (it raises to give up: the worker died, the loader timed out, we are closing)."""
        data = pickle.dumps(command, pickle.HIGHEST_PROTOCOL)
        conn = self.task_writers[worker_id].conn
        while while_full is not None and not _pipe_has_room(conn.fileno(), len(data)):
            while_full()
            # Polled: the kernel wakes writers when PIPE_BUF bytes are free, not when ours are.
            time.sleep(ROOM_POLL_S)
        conn.send_bytes(data)

    def wait(self, timeout_s: float, sentinels: list[int]) -> tuple[list[WorkerReport], list[int]]:
        """Reports ready within ``timeout_s`` and the sentinels that fired (dead workers)."""
        ready = connection.wait(self._live_readers + sentinels, timeout_s)
        reports, fired = [], []
        for item in ready:
            if isinstance(item, int):
                fired.append(item)
            else:
                reports.extend(self._drain(item))
        return reports, fired

    def _drain(self, conn: ResultSocket) -> list[WorkerReport]:
        reports = []
        try:
            while conn.ready():
                reports.append(conn.receive())
        except (EOFError, ConnectionResetError):
            # The writer is gone; its sentinel tells the pool how it ended. Stop waiting on an
            # end that would otherwise read as ready forever.
            if conn in self._live_readers:
                self._live_readers.remove(conn)
        return reports

    def close(self) -> None:
        for end in self.task_writers:
            end.close()
        for conn in self.result_readers:
            conn.close()


def _pipe_has_room(fd: int, nbytes: int) -> bool:
    """Whether a message of ``nbytes`` fits in the pipe now, so writing it cannot block.

    A message larger than the whole pipe can never fit; it is written anyway (the worker reads it
    as it arrives), which only index lists of hundreds of thousands of entries reach.
    """
    try:
        capacity = fcntl.fcntl(fd, _F_GETPIPE_SZ)
        unread = struct.unpack("i", fcntl.ioctl(fd, termios.FIONREAD, b"\0\0\0\0"))[0]
    except OSError:
        return True  # not a Linux pipe: fall back to a plain (possibly blocking) write
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

    def receive(self, timeout_s: float) -> Any | None:
        try:
            return self.queue.get(timeout=timeout_s)
        except queue.Empty:
            return None

    def close(self) -> None:
        pass


class ThreadChannels:
    """Per-worker task queues and one shared result queue for thread workers."""

    def __init__(self, num_workers: int) -> None:
        self.task_queues = [QueueEnd(queue.SimpleQueue()) for _ in range(num_workers)]
        self.results = QueueEnd(queue.SimpleQueue())

    def worker_ends(self, worker_id: int) -> tuple[QueueEnd, QueueEnd]:
        return self.task_queues[worker_id], self.results

    def forget_worker_ends(self) -> None:
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
