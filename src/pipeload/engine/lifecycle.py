"""Starting and stopping workers. Stopping escalates in one place: ask, join, terminate, kill."""

from __future__ import annotations

import io
import os
import pickle
import threading
import time
from collections.abc import Callable, Sequence
from typing import Any, Protocol

import torch

from pipeload.engine.plan import WorkerSetup
from pipeload.engine.worker_main import run_process_worker, run_thread_worker

JOIN_GRACE_S = 0.5
TERMINATE_GRACE_S = 0.3
KILL_GRACE_S = 1.0


class WorkerHandle(Protocol):
    """What the pool (and users' tools, through ``iterator._workers``) see of a worker."""

    pid: int | None
    exitcode: int | None

    def is_alive(self) -> bool: ...
    def join(self, timeout: float | None = None) -> None: ...
    def terminate(self) -> None: ...


class ThreadWorkerHandle:
    """A worker thread dressed as a process handle. ``pid`` is this process's pid."""

    def __init__(self, thread: threading.Thread, stop: threading.Event) -> None:
        self._thread = thread
        self._stop = stop
        self.pid = os.getpid()
        self.sentinel = None

    @property
    def exitcode(self) -> int | None:
        return None if self._thread.is_alive() else 0

    def is_alive(self) -> bool:
        return self._thread.is_alive()

    def join(self, timeout: float | None = None) -> None:
        self._thread.join(timeout)

    def terminate(self) -> None:
        self._stop.set()

    kill = terminate


def start_process_workers(ctx: Any, setup: WorkerSetup, channels: Any) -> list[Any]:
    """Start one process per worker. Already started ones are stopped if a later start fails."""
    workers: list[Any] = []
    try:
        for worker_id in range(setup.num_workers):
            inbox, outbox = channels.worker_ends(worker_id)
            process = ctx.Process(
                target=run_process_worker,
                args=(setup, worker_id, inbox, outbox),
                name=f"pipeload-worker-{worker_id}",
                daemon=True,
            )
            process.start()
            workers.append(process)
    except BaseException:
        stop_workers(workers)
        raise
    finally:
        channels.forget_worker_ends()
    return workers


def start_thread_workers(setup: WorkerSetup, channels: Any) -> tuple[list[Any], threading.Event]:
    """Start one daemon thread per worker; they all stop when the returned event is set."""
    stop = threading.Event()
    handles = []
    for worker_id in range(setup.num_workers):
        inbox, outbox = channels.worker_ends(worker_id)
        thread = threading.Thread(
            target=run_thread_worker,
            args=(setup, worker_id, inbox, outbox, stop),
            name=f"pipeload-worker-{worker_id}",
            daemon=True,
        )
        thread.start()
        handles.append(ThreadWorkerHandle(thread, stop))
    return handles, stop


def stop_workers(workers: Sequence[Any], ask: Callable[[int], None] | None = None) -> None:
    """Stop every worker: ask (if given), join with a deadline, then terminate, then kill."""
    if ask is not None:
        for worker_id, worker in enumerate(workers):
            if worker.is_alive():
                _quietly(ask, worker_id)
    _join_all(workers, JOIN_GRACE_S)
    for step, grace in (("terminate", TERMINATE_GRACE_S), ("kill", KILL_GRACE_S)):
        alive = [w for w in workers if w.is_alive()]
        if not alive:
            return
        for worker in alive:
            _quietly(getattr(worker, step))
        _join_all(alive, grace)


def _join_all(workers: Sequence[Any], grace_s: float) -> None:
    deadline = time.monotonic() + grace_s
    for worker in workers:
        worker.join(max(0.0, deadline - time.monotonic()))


def _quietly(action: Callable[..., Any], *args: Any) -> None:
    try:
        action(*args)
    except (OSError, ValueError):
        pass  # the worker or its channel is already gone


class _Discard(io.RawIOBase):
    def writable(self) -> bool:
        return True

    def write(self, data: Any) -> int:
        return len(memoryview(data))


class _PicklabilityProbe(pickle.Pickler):
    """Pickles everything except tensors, which torch moves through shared memory anyway."""

    def persistent_id(self, obj: Any) -> Any:
        if isinstance(obj, (torch.Tensor, torch.UntypedStorage, torch.TypedStorage)):
            return id(obj)
        return None


def check_picklable(named_objects: dict[str, Any], start_method: str) -> None:
    """Fail before any worker starts if spawn/forkserver could not send these objects to it."""
    for name, obj in named_objects.items():
        try:
            _PicklabilityProbe(_Discard(), pickle.HIGHEST_PROTOCOL).dump(obj)
        except Exception as exc:
            raise type(exc)(
                f"DataLoader cannot send {name}={obj!r} to its '{start_method}' worker processes "
                f"because it cannot be pickled: {exc}. Define it at module level (not as a lambda "
                f"or local function/class), or use multiprocessing_context='fork'."
            ) from exc
