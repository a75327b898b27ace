"""A worker that dies gives a RuntimeError naming the worker, its pid and how it ended: every time,
whatever it was doing, never a ConnectionResetError or a hang. Also: the ``_workers`` handles.
"""

from __future__ import annotations

import array
import fcntl
import os
import signal
import termios
import threading
import time

import pytest
from conftest import once_the_main_thread_waits, pid_gone, wait_until
from faults import (
    FORK,
    SPAWN,
    THREAD,
    DiesAt,
    Numbers,
    Stalls,
    die,
    engine_params,
    loader_kwargs,
    record_worker_pid,
    worker_pids,
)

from pipeload import DataLoader
from pipeload.errors import WorkerDiedError

pytestmark = [pytest.mark.usefixtures("leak_guard", "no_gc"), pytest.mark.timeout(60)]

HOW_IT_ENDS = {
    "sigkill": "signal 9 (SIGKILL)",
    "segfault": "signal 11 (SIGSEGV)",
    "exit3": "exit code 3",
    "sigbus": "signal 7 (SIGBUS); a bus error in a DataLoader worker usually means shared memory (/dev/shm) ran out",
}
REPEATS = 4  # "every time": the same crash, several times over


def _crash_error(loader: DataLoader) -> tuple[BaseException, list[int]]:
    iterator = iter(loader)
    pids = worker_pids(iterator)
    with pytest.raises(BaseException) as caught:
        while True:
            next(iterator)
    return caught.value, pids


def _assert_names_the_dead_worker(error: BaseException, worker_id: int, pid: int, how: str) -> None:
    assert isinstance(error, RuntimeError), f"{type(error).__name__}: {error}"
    assert isinstance(error, WorkerDiedError)
    text = str(error)
    assert f"worker {worker_id} (pid {pid})" in text, text
    assert HOW_IT_ENDS[how] in text, text


@pytest.mark.parametrize("how", sorted(HOW_IT_ENDS))
def test_worker_dying_in_getitem_is_a_runtime_error_every_time(how, leak_guard):
    for attempt in range(REPEATS):
        # With batch_size=2 and round-robin over 2 workers, index 4 (batch 2) is worker 0's
        # and index 2 (batch 1) is worker 1's: alternate which worker dies.
        bad_index = 4 if attempt % 2 == 0 else 2
        dead_worker = 0 if attempt % 2 == 0 else 1
        loader = DataLoader(DiesAt(12, bad_index, how), batch_size=2, num_workers=2,
                            multiprocessing_context="fork")
        error, pids = _crash_error(loader)
        _assert_names_the_dead_worker(error, dead_worker, pids[dead_worker], how)
        leak_guard.assert_exited(pids, within_s=1.0)


@pytest.mark.timeout(90)
def test_worker_dying_under_spawn(leak_guard):
    loader = DataLoader(DiesAt(8, 2, "exit3"), batch_size=2, num_workers=2, multiprocessing_context="spawn")
    error, pids = _crash_error(loader)
    _assert_names_the_dead_worker(error, 1, pids[1], "exit3")
    leak_guard.assert_exited(pids, within_s=1.0)


def test_worker_dying_in_worker_init_fn(leak_guard):
    loader = DataLoader(Numbers(8), batch_size=2, num_workers=2, multiprocessing_context="fork",
                        worker_init_fn=_exit3)
    error, pids = _crash_error(loader)
    assert isinstance(error, WorkerDiedError)
    assert "exit code 3" in str(error) and "pid" in str(error)
    leak_guard.assert_exited(pids, within_s=1.0)


def _exit3(worker_id: int) -> None:
    die("exit3")


class _FirstBatchAfterWorkersDied:
    """A batch sampler whose first batch comes only once every worker of this process has
    exited: the loader's first task then goes to a dead worker."""

    def __iter__(self):
        import multiprocessing

        assert wait_until(lambda: not multiprocessing.active_children(), deadline_s=30)
        yield from ([0, 1], [2, 3])

    def __len__(self) -> int:
        return 2


def test_a_worker_dead_before_its_first_task_is_reported_by_next_not_iter(leak_guard):
    # As torch's: iter() starts the epoch, the first next() says which worker died and how.
    loader = DataLoader(Numbers(8), batch_sampler=_FirstBatchAfterWorkersDied(), num_workers=2,
                        multiprocessing_context="fork", worker_init_fn=_exit3)
    iterator = iter(loader)
    with pytest.raises(WorkerDiedError, match="exit code 3"):
        next(iterator)


@pytest.mark.parametrize("signum", [signal.SIGKILL, signal.SIGTERM])
def test_idle_worker_killed_from_outside(signum, leak_guard):
    # Batches 0..3 are prefetched; kill worker 1 once it is dead and unreaped (a zombie), then
    # keep reading: whatever was already built may come out, then the death is reported.
    for _ in range(REPEATS):
        loader = DataLoader(Numbers(40), batch_size=2, num_workers=2, multiprocessing_context="fork")
        iterator = iter(loader)
        pids = worker_pids(iterator)
        assert next(iterator).tolist() == [0, 1]
        os.kill(pids[1], signum)
        assert wait_until(lambda: pid_gone(pids[1]), 5.0)
        with pytest.raises(WorkerDiedError) as caught:
            for _ in range(25):
                next(iterator)
        name = signal.Signals(signum).name
        text = str(caught.value)
        assert text.startswith(f"DataLoader worker (pid {pids[1]}) is killed by signal: {signal.strsignal(signum)}. ")
        assert f"DataLoader worker (pid(s) {pids[1]}) exited unexpectedly" in text
        assert f"worker 1 (pid {pids[1]}) ended with signal {signum} ({name})" in text
        leak_guard.assert_exited(pids, within_s=1.0)


def test_worker_killed_while_main_waits_on_it(leak_guard):
    # Worker 0 is stuck building batch 0, so the main process blocks waiting for it; the kill
    # comes once the main thread is in that wait (the pool's receive), which it cannot leave
    # before batch 0 or worker 0's death.
    loader = DataLoader(Stalls(8, stall_index=0), batch_size=2, num_workers=2, multiprocessing_context="fork")
    iterator = iter(loader)
    pids = worker_pids(iterator)
    with once_the_main_thread_waits(lambda: os.kill(pids[0], signal.SIGKILL)) as seen:
        with pytest.raises(WorkerDiedError, match=rf"worker 0 \(pid {pids[0]}\).*SIGKILL"):
            next(iterator)
    assert seen == [True], "the main thread was never seen waiting for worker 0"
    leak_guard.assert_exited(pids, within_s=1.0)


def test_worker_dies_while_the_main_process_is_blocked_sending_it_tasks(tmp_path, monkeypatch, leak_guard):
    # Each task carries 20000 indices (~60 KB pickled). Worker 0 is stuck in its first batch, so
    # its next two tasks overflow the pipe and the main process blocks in the send, inside
    # iter(). Killing worker 0 must turn that into a WorkerDiedError, not a hang.
    monkeypatch.setenv("PIPELOAD_TEST_PID_DIR", str(tmp_path))
    loader = DataLoader(Stalls(200_000, stall_index=0), batch_size=20_000, num_workers=2, prefetch_factor=3,
                        worker_init_fn=record_worker_pid, multiprocessing_context="fork")
    pid_file = tmp_path / "0"

    def kill_worker_0() -> None:
        if wait_until(pid_file.exists, 20.0):
            os.kill(int(pid_file.read_text()), signal.SIGKILL)

    killer = threading.Thread(target=kill_worker_0, daemon=True)
    killer.start()
    with pytest.raises(WorkerDiedError, match=r"worker 0 \(pid \d+\).*SIGKILL"):
        list(loader)
    killer.join()
    leak_guard.assert_exited([int(pid_file.read_text())], within_s=1.0)


class _OneHugeItem(Numbers):
    """Item 0 is 64 MiB of bytes, far more than a socket's buffer holds; the others are small."""

    def __getitem__(self, index: int) -> bytes:
        return b"x" * (64 << 20) if index == 0 else b"small"


def _most_unread_socket_bytes() -> int:
    """The most bytes waiting, unread, on any one socket this process holds."""
    most = 0
    for name in os.listdir("/proc/self/fd"):
        try:
            if not os.readlink(f"/proc/self/fd/{name}").startswith("socket:"):
                continue
            waiting = array.array("i", [0])
            fcntl.ioctl(int(name), termios.FIONREAD, waiting)
        except OSError:
            continue  # closed meanwhile
        most = max(most, waiting[0])
    return most


def test_worker_dying_halfway_through_a_message(leak_guard):
    loader = DataLoader(_OneHugeItem(3), batch_size=None, num_workers=1, multiprocessing_context="fork")
    iterator = iter(loader)
    pids = worker_pids(iterator)
    # Nothing reads the worker's channel until next(): once part of the 64 MiB message lies
    # unread on it (far more than any other message the worker sends), the worker is blocked
    # with the rest of it still to write. It is killed there.
    assert wait_until(lambda: _most_unread_socket_bytes() > 16 << 10, 30.0)
    os.kill(pids[0], signal.SIGKILL)
    with pytest.raises(BaseException) as caught:
        while True:
            next(iterator)
    _assert_names_the_dead_worker(caught.value, 0, pids[0], "sigkill")
    leak_guard.assert_exited(pids, within_s=1.0)


class _ThreadExits(Numbers):
    def __getitem__(self, index: int) -> int:
        if index == 3:
            raise SystemExit(3)  # ends a worker thread without an ordinary exception
        return index


@pytest.mark.filterwarnings("ignore::pytest.PytestUnhandledThreadExceptionWarning")
def test_thread_worker_that_ends_is_reported():
    loader = DataLoader(_ThreadExits(8), batch_size=2, num_workers=2, worker_type="thread")
    with pytest.raises(WorkerDiedError, match=r"worker thread 1 ended unexpectedly.*SystemExit"):
        list(loader)


# -- the handles an epoch iterator exposes -------------------------------------------------


@pytest.mark.parametrize("engine", engine_params(FORK, SPAWN))
@pytest.mark.timeout(90)
def test_process_worker_handles(engine, leak_guard):
    loader = DataLoader(Numbers(8), batch_size=2, num_workers=2, **loader_kwargs(engine))
    iterator = iter(loader)
    handles = iterator._workers
    assert len(handles) == 2
    pids = [h.pid for h in handles]
    assert all(isinstance(pid, int) and pid != os.getpid() for pid in pids)
    assert len(set(pids)) == 2
    assert all(h.is_alive() and h.exitcode is None for h in handles)

    assert [b.tolist() for b in iterator] == [[0, 1], [2, 3], [4, 5], [6, 7]]
    for handle in handles:  # the epoch is over: the workers were asked to stop, and did
        handle.join(1.0)
        assert not handle.is_alive()
        assert handle.exitcode == 0
    leak_guard.assert_exited(pids, within_s=1.0)


def test_terminating_a_worker_through_its_handle(leak_guard):
    loader = DataLoader(Numbers(40), batch_size=2, num_workers=2, multiprocessing_context="fork")
    iterator = iter(loader)
    handle = iterator._workers[0]
    next(iterator)
    handle.terminate()
    handle.join(5.0)
    assert handle.exitcode == -signal.SIGTERM
    with pytest.raises(WorkerDiedError, match=rf"worker 0 \(pid {handle.pid}\).*SIGTERM"):
        for _ in range(25):
            next(iterator)
    leak_guard.assert_exited([handle.pid], within_s=1.0)


def test_thread_worker_handles():
    loader = DataLoader(Numbers(8), batch_size=2, num_workers=2, **loader_kwargs(THREAD))
    iterator = iter(loader)
    handles = iterator._workers
    assert [h.pid for h in handles] == [os.getpid(), os.getpid()]
    assert all(h.is_alive() and h.exitcode is None for h in handles)
    assert len(list(iterator)) == 4
    for handle in handles:
        handle.join(1.0)
        assert not handle.is_alive() and handle.exitcode == 0


def _stuck_at_exit(_worker_id: int) -> None:
    """Makes this worker stay when asked to stop (as a C extension's teardown can)."""
    import pipeload.engine.worker_main as worker_main

    worker_main.exit_now = lambda: time.sleep(60)


@pytest.mark.timeout(60)
def test_joining_the_handles_of_a_worker_stuck_at_exit_ends_in_its_termination(leak_guard):
    # The finished epoch's workers are reaped beside the loop; a blocking join() of the
    # handles held their status reads' turn and kept the reaper from terminating the worker.
    loader = DataLoader(Numbers(8), batch_size=2, num_workers=2, multiprocessing_context="fork",
                        worker_init_fn=_stuck_at_exit)
    iterator = iter(loader)
    assert len(list(iterator)) == 4
    started = time.monotonic()
    for handle in iterator._workers:
        handle.join()
    assert [h.exitcode for h in iterator._workers] == [-signal.SIGTERM] * 2
    assert time.monotonic() - started < 10
    del iterator, loader  # the loader keeps its slabs until it goes
