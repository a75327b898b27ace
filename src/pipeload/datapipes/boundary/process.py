"""A queue boundary's upstream in another process.

The upstream process iterates the upstream part of the graph and sends each item as soon as the
consumer's credit allows; a receiver thread in this process moves arriving items into the same
kind of mailbox a thread boundary fills. Large tensors travel in slabs of a pool borrowed from
the boundary pipe's ``SlabKeeper`` (see link.py), given back when the run ends. The process is started, watched and stopped by the
engine's lifecycle helpers, like a DataLoader worker: it leaves when its parent dies, ignores
Ctrl-C, and is stopped by asking, then terminating, then killing.
"""

from __future__ import annotations

import multiprocessing
import os
import signal
import threading
import weakref
from typing import Any

import torch

from pipeload.datapipes.boundary.link import UPSTREAM_ID, ProcessLink
from pipeload.datapipes.boundary.mailbox import Mailbox
from pipeload.datapipes.protocol import as_nonblocking
from pipeload.engine.budget import shm_budget_bytes
from pipeload.engine.lifecycle import (
    check_picklable,
    exit_now,
    exit_when_parent_dies,
    release_finished,
    schedule_as_batch_work,
    start_process,
    steady_heap,
    stop_workers,
)
from pipeload.engine.worker_info import seed_process_worker
from pipeload.errors import RemoteFailure, WorkerDiedError, describe_exit
from pipeload.transport.messages import Command, Report, SlabGrant, WorkerReport
from pipeload.transport.slab_keeper import SlabKeeper, SlabSettings

RECEIVE_SLICE_S = 0.1
COMMAND_POLL_S = 0.1
RECEIVER_JOIN_S = 1.0


class ProcessUpstream:
    """Owns the upstream process, its link and the receiver thread.

    Invariants: ``granted - taken <= capacity`` items are ever in flight or held; the receiver
    thread is the only reader of the link and the only producer of the mailbox; the consuming
    thread is the only caller of :meth:`take_nowait`.
    """

    def __init__(self, upstream_pipe: Any, capacity: int, context: Any, name: str,
                 keeper: SlabKeeper | None = None) -> None:
        """``keeper``: where the run borrows its slab pool (None: one of its own)."""
        ctx = multiprocessing.get_context(context) if isinstance(context, str) or context is None else context
        if ctx.get_start_method() != "fork":
            check_picklable({"datapipe": upstream_pipe}, ctx.get_start_method(), sender="A queue boundary")
        self.mailbox = Mailbox(capacity)
        self._capacity = capacity
        keeper = keeper if keeper is not None else SlabKeeper(keep=False)
        settings = SlabSettings(False, shm_budget_bytes(None, keeper.held_bytes), capacity + 2)
        pool = keeper.lend(settings)
        self._link = ProcessLink(ctx, pool, capacity)
        seed = int(torch.empty((), dtype=torch.int64).random_().item())
        inbox, outbox = self._link.upstream_ends()
        try:
            self._process = start_process(ctx, run_upstream_process, (upstream_pipe, seed, inbox, outbox), name)
        except BaseException:
            self._link.close()
            keeper.give_back(pool)
            raise
        self._link.upstream_started()
        self._granted = capacity
        self._taken = 0
        self._link.grant(capacity)
        self._stop = threading.Event()
        self._receiver = threading.Thread(
            target=_receive, args=(self._link, self._process, self.mailbox, self._stop),
            name=f"{name}-receiver", daemon=True,
        )
        self._receiver.start()
        self._finalizer = weakref.finalize(self, _shut_down, self._link, self._process, self._receiver,
                                           self._stop, self.mailbox, (keeper, pool))

    @property
    def pid(self) -> int:
        return self._process.pid

    def notifiers(self) -> list[Any]:
        return [self.mailbox.notifier]

    def take_nowait(self) -> Any:
        item = self.mailbox.take_nowait()
        self._link.handed_out(self._taken)
        self._taken += 1
        if self._granted - self._taken <= self._capacity // 2:  # top the window up in one message
            self._granted = self._taken + self._capacity
            self._link.grant(self._granted)
        return item

    def close(self) -> None:
        """Stop the receiver and the process, close the link. Idempotent."""
        self._finalizer()


def _shut_down(link: ProcessLink, process: Any, receiver: threading.Thread, stop: threading.Event,
               mailbox: Mailbox, slabs: tuple[SlabKeeper, Any]) -> None:
    stop.set()
    failed = mailbox.failed  # an error's traceback may keep the boundary alive: keep no slabs
    mailbox.close()
    receiver.join(RECEIVER_JOIN_S)  # it wakes every RECEIVE_SLICE_S; it must be off the link first
    stop_workers([process], ask=link.ask_to_stop)
    link.close()
    keeper, pool = slabs
    keeper.give_back(pool, release=failed)
    release_finished([process])


def _receive(link: ProcessLink, process: Any, mailbox: Mailbox, stop: threading.Event) -> None:
    """The receiver thread: whatever goes wrong here reaches the consumer, never a silent hang."""
    try:
        _move_reports(link, process, mailbox, stop)
    except BaseException as exc:  # noqa: BLE001
        exc.add_note("pipeload: raised while receiving from the upstream process of a queue boundary")
        mailbox.fail(exc)


def _move_reports(link: ProcessLink, process: Any, mailbox: Mailbox, stop: threading.Event) -> None:
    """Move reports into the mailbox, checking order, until the end, a failure, a death or stop."""
    expected = 0
    while not stop.is_set():
        reports, died = link.receive(RECEIVE_SLICE_S, process.sentinel)
        for report in reports:
            if report.report is Report.BATCH:
                if report.batch_number != expected:
                    mailbox.fail(RuntimeError(
                        f"queue boundary protocol error: expected item {expected} from the "
                        f"upstream process, got item {report.batch_number}"
                    ))
                    return
                expected += 1
                mailbox.put_granted(report.payload)
            elif report.report is Report.FAILED:
                mailbox.fail(report.failure.to_exception())
                return
            elif report.report is Report.EXHAUSTED:
                mailbox.finish()
                return
        if died:
            process.join(RECEIVE_SLICE_S)  # reap it, so its exit status is known
            mailbox.fail(WorkerDiedError(
                f"the upstream process of a queue boundary (pid {process.pid}) exited "
                f"unexpectedly with {describe_exit(process.exitcode)} after {expected} items"
            ))
            return


# -- in the upstream process -------------------------------------------------------------------


def run_upstream_process(upstream_pipe: Any, seed: int, inbox: Any, outbox: Any) -> None:
    """Entry point of a boundary's upstream process."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C is the main process's to handle
    exit_when_parent_dies(os.getppid())
    schedule_as_batch_work()  # woken by the consumer, it must not preempt it
    steady_heap()
    torch.set_num_threads(1)
    seed_process_worker(seed, 0)  # its own random streams, fixed by the parent's generator
    try:
        _UpstreamLoop(upstream_pipe, inbox, outbox).run()
    except (BrokenPipeError, EOFError, ConnectionResetError):
        pass  # the consumer closed the link: nobody wants our items any more
    finally:
        outbox.close()
        inbox.close()
    exit_now()


class _UpstreamLoop:
    """Sends items while credit lasts; after the end or a failure, waits for STOP."""

    def __init__(self, upstream_pipe: Any, inbox: Any, outbox: Any) -> None:
        self._pipe = upstream_pipe
        self._inbox = inbox
        self._outbox = outbox
        self._iterator: Any = None
        self._allowed = 0
        self._grants: dict[int, SlabGrant] = {}  # item number -> the slab it may travel in
        self._sent = 0
        self._done = False
        self._place = f"in the upstream process of a queue boundary (pid {os.getpid()})"

    def run(self) -> None:
        while True:
            can_send = not self._done and self._sent < self._allowed
            command = self._inbox.receive(0 if can_send else COMMAND_POLL_S)
            if command is not None:
                if command.command is Command.STOP:
                    return
                self._allowed = max(self._allowed, command.batch_number)
                if command.grant is not None:  # credit for one item, with its slab
                    self._grants[command.batch_number - 1] = command.grant
            elif can_send:
                self._send_next()

    def _send_next(self) -> None:
        stage = "iterating the upstream pipe"
        try:
            if self._iterator is None:
                self._iterator = as_nonblocking(self._pipe)
            self._outbox.prepare(self._grants.pop(self._sent, None))  # collation may write there
            item = next(self._iterator)
            stage = "sending an item to the consumer"
            self._outbox.send(WorkerReport(Report.BATCH, UPSTREAM_ID, self._sent, item))
        except StopIteration:
            self._finish(WorkerReport(Report.EXHAUSTED, UPSTREAM_ID, self._sent))
            return
        except (BrokenPipeError, ConnectionResetError):
            raise
        except Exception:
            failure = RemoteFailure.capture(UPSTREAM_ID, stage, where=self._place)
            self._finish(WorkerReport(Report.FAILED, UPSTREAM_ID, self._sent, failure))
            return
        self._sent += 1

    def _finish(self, report: WorkerReport) -> None:
        self._done = True
        self._outbox.send(report)
        if self._iterator is not None:
            self._iterator.close()
