"""Stopping is prompt and complete: Ctrl-C, a dead main process, an early ``break``, a dropped
loader or iterator. Every worker is gone within a second (or, orphaned, within a few), without
the garbage collector's help, and nothing is left behind (the ``leak_guard`` fixture).
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import textwrap
import threading
import time
from pathlib import Path

import pytest
from conftest import child_pids, gone_or_fail, main_thread_is_in, pid_gone, wait_until
from faults import (
    ECONOMIC,
    ECONOMIC_SPAWN,
    ECONOMIC_THREAD,
    FORK,
    SPAWN,
    THREAD,
    Numbers,
    Stalls,
    StallsAndSaysSo,
    engine_params,
    loader_kwargs,
    worker_pids,
)

from pipeload import DataLoader

pytestmark = [pytest.mark.usefixtures("leak_guard", "no_gc"), pytest.mark.timeout(60)]

ORPHAN_EXIT_S = 3.0  # workers watch their parent every 0.2 s
INTERRUPTED_EXIT_S = 10.0  # the whole interrupted process, interpreter exit included
STARTUP_S = 45.0  # a spawn worker imports torch: slow on a busy 2-core machine


# -- a loader in a separate Python process -----------------------------------------------

# The script writes its worker pids to a file once every worker is inside __getitem__ (busy) or,
# with "idle", once a whole epoch is done and persistent workers wait for the next one.
_SCRIPT = textwrap.dedent(
    """
    import json, os, signal, sys, time
    from pipeload import DataLoader, get_worker_info

    class Busy:
        def __init__(self, marks, hold_gil): self.marks, self.hold_gil = marks, hold_gil
        def __len__(self): return 100
        def __getitem__(self, index):
            open(os.path.join(self.marks, f"busy.{get_worker_info().id}"), "w").close()
            if self.hold_gil:  # a regex backtracking for ever: C code that never lets the GIL go
                import re
                re.match(r"(a+)+$", "a" * 64 + "b")
            time.sleep(120)  # simulated slow work: the test interrupts it
            return index

    def publish(path, pids):
        with open(path + ".tmp", "w") as out:
            json.dump(pids, out)
        os.replace(path + ".tmp", path)  # the test only ever sees a whole file

    if __name__ == "__main__":
        pid_file, context, mode, loader_mode = sys.argv[1:5]
        marks = os.path.dirname(pid_file)
        dataset = Busy(marks, mode == "gil") if mode in ("busy", "gil") else list(range(100))
        engine = {"worker_type": "thread"} if context == "thread" else {"multiprocessing_context": context}
        loader = DataLoader(dataset, batch_size=2, num_workers=2, persistent_workers=(mode == "idle"),
                            mode=loader_mode, **engine)
        if mode == "idle":
            iterator = iter(loader)
            assert len(list(iterator)) == 50
            publish(pid_file, [w.pid for w in iterator._workers])
            signal.pause()  # persistent workers wait for the next epoch; the test kills us
        iterator = iter(loader)
        pids = [w.pid for w in iterator._workers]
        while len([n for n in os.listdir(marks) if n.startswith("busy.")]) < 2:
            time.sleep(0.01)  # until both (item) workers are inside __getitem__
        publish(pid_file, pids)
        try:
            next(iterator)
        except KeyboardInterrupt:
            # when the loader let the interrupt through (CLOCK_MONOTONIC is machine-wide)
            with open(os.path.join(marks, "interrupted"), "w") as out:
                out.write(repr(time.monotonic()))
            raise
    """
)


def _start_script(
    tmp_path: Path, context: str, mode: str, new_session: bool = False, loader_mode: str = "classic"
) -> tuple[subprocess.Popen, list[int]]:
    script = tmp_path / "run_loader.py"
    script.write_text(_SCRIPT)
    pid_file = tmp_path / "pids.json"
    proc = subprocess.Popen(
        [sys.executable, str(script), str(pid_file), context, mode, loader_mode],
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, start_new_session=new_session,
    )
    if not wait_until(lambda: pid_file.exists() or proc.poll() is not None, STARTUP_S):
        proc.kill()
        proc.communicate()
        pytest.fail("the loader script never got its workers busy")
    if proc.poll() is not None:
        out, err = proc.communicate()
        pytest.fail(f"the loader script exited early ({proc.returncode}):\n{out}\n{err}")
    return proc, json.loads(pid_file.read_text())


def _ctrl_c(tmp_path: Path, context: str, whole_group: bool, loader_mode: str = "classic") -> None:
    proc, pids = _start_script(tmp_path, context, "busy", new_session=whole_group, loader_mode=loader_mode)
    sent = time.monotonic()
    if whole_group:  # what a terminal does: every process in the foreground group gets it
        os.killpg(proc.pid, signal.SIGINT)
    else:
        proc.send_signal(signal.SIGINT)
    _, err = proc.communicate(timeout=INTERRUPTED_EXIT_S)
    answered = float((tmp_path / "interrupted").read_text()) - sent

    assert "KeyboardInterrupt" in err, err
    assert proc.returncode in (-signal.SIGINT, 128 + signal.SIGINT, 1), proc.returncode
    # The loader must let the interrupt through at once; the interpreter's own exit after it
    # (tearing down torch) is not ours to time, and takes seconds on a loaded machine.
    assert answered < 2.0, f"the loader took {answered:.2f} s to raise KeyboardInterrupt"
    assert all(pid_gone(pid) for pid in pids), "workers outlived the interrupted main process"


# economic: slow tests (~2.4 s each); the same worker group stops both modes, and economic
# mode's Ctrl-C is under test in the fast suite with thread workers and during a fork
@pytest.mark.parametrize("loader_mode", ["classic", pytest.param("economic", marks=pytest.mark.slow)])
@pytest.mark.parametrize("whole_group", [False, True], ids=["main-only", "process-group"])
def test_ctrl_c_stops_everything_at_once(tmp_path, whole_group, loader_mode, ctrl_c_raises):
    _ctrl_c(tmp_path, "fork", whole_group, loader_mode)


@pytest.mark.parametrize(
    ("context", "loader_mode"),
    [pytest.param("thread", "classic", marks=pytest.mark.slow), ("thread", "economic"), pytest.param("spawn", "classic", marks=[pytest.mark.timeout(120), pytest.mark.slow]),
     pytest.param("spawn", "economic", marks=[pytest.mark.timeout(120), pytest.mark.slow])],
)
def test_ctrl_c_with_other_workers(tmp_path, context, loader_mode, ctrl_c_raises):
    _ctrl_c(tmp_path, context, whole_group=False, loader_mode=loader_mode)


@pytest.mark.parametrize(
    ("context", "mode", "loader_mode"),
    # idle classic and busy economic: slow tests (~1.3 s each); the other two run fast
    [("fork", "busy", "classic"), pytest.param("fork", "idle", "classic", marks=pytest.mark.slow),
     pytest.param("fork", "busy", "economic", marks=pytest.mark.slow),
     ("fork", "idle", "economic"), pytest.param("spawn", "busy", "classic", marks=[pytest.mark.timeout(120), pytest.mark.slow]),
     pytest.param("spawn", "busy", "economic", marks=[pytest.mark.timeout(120), pytest.mark.slow]),
     # A forkserver worker's parent is the fork server, which lives on while any of its children
     # does: a worker stuck in user code must watch the main process itself.
     pytest.param("forkserver", "busy", "classic", marks=pytest.mark.timeout(120)),
     # A worker whose thread holds the GIL (C code that never lets it go) cannot run its
     # watching thread: the kernel kills it with its parent (forked, or spawned, by the main
     # thread). A spawned one was left running at 100% CPU (stop 50's lifecycle skeptic).
     ("fork", "gil", "classic"), pytest.param("spawn", "gil", "classic", marks=pytest.mark.timeout(120))],
)
def test_workers_exit_when_the_main_process_is_killed(tmp_path, context, mode, loader_mode):
    proc, pids = _start_script(tmp_path, context, mode, loader_mode=loader_mode)
    proc.kill()
    proc.communicate()
    gone_or_fail(pids, ORPHAN_EXIT_S, "orphaned workers")


def _interrupt_main_thread() -> None:
    """Ctrl-C to this process, taken by the main thread (as a terminal's is): the calling thread
    blocks SIGINT for itself, so the kernel wakes the main thread out of its wait."""
    signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGINT})
    os.kill(os.getpid(), signal.SIGINT)


@pytest.mark.parametrize("engine", engine_params(FORK, ECONOMIC))
def test_a_second_ctrl_c_while_the_first_one_stops_the_workers_still_stops_them(
        engine, tmp_path, leak_guard, ctrl_c_raises):
    # A user who presses Ctrl-C twice: the first one stops the workers, and one of them, stuck in
    # user code, is waited for; the second one comes during that wait. It must not cut the
    # stopping short: the workers, their pipes and the slabs would be left for as long as the
    # process lives (an interactive session), since the finalizer that stops them has fired.
    notice = tmp_path / "stalled"
    loader = DataLoader(StallsAndSaysSo(64, stall_index=4, notice=str(notice)), batch_size=2,
                        num_workers=2, **loader_kwargs(engine))
    iterator = iter(loader)
    pids = child_pids()
    sent: list[float] = []

    def press_ctrl_c_twice() -> None:
        if not wait_until(lambda: notice.exists() and main_thread_is_in("receive"), STARTUP_S):
            return  # the test fails below: no KeyboardInterrupt
        sent.append(time.monotonic())
        _interrupt_main_thread()
        if wait_until(lambda: main_thread_is_in("stop_workers"), INTERRUPTED_EXIT_S):
            _interrupt_main_thread()
            sent.append(time.monotonic())

    presser = threading.Thread(target=press_ctrl_c_twice)
    presser.start()
    with pytest.raises(KeyboardInterrupt):
        for _ in iterator:
            pass
    raised_after_s = time.monotonic() - sent[0]
    presser.join(INTERRUPTED_EXIT_S)
    assert len(sent) == 2, "the second Ctrl-C found nothing being stopped"
    assert raised_after_s < 3.0, f"KeyboardInterrupt came {raised_after_s:.2f} s after Ctrl-C"
    leak_guard.assert_exited(pids, within_s=1.0)


@pytest.mark.parametrize("engine", engine_params(FORK, ECONOMIC))
def test_a_ctrl_c_while_a_dropped_iterator_stops_its_workers_reaches_the_users_code(
        engine, tmp_path, leak_guard, ctrl_c_raises):
    # After ``break``, the iterator's finalizer stops the workers, waiting for one stuck in user
    # code; a Ctrl-C then is held until they are stopped. Raised in the finalizer, it was
    # printed as "Exception ignored" and lost: the program went on as if nobody had pressed it.
    notice = tmp_path / "stalled"
    loader = DataLoader(StallsAndSaysSo(64, stall_index=2, notice=str(notice)), batch_size=2,
                        num_workers=2, **loader_kwargs(engine))
    iterator = iter(loader)
    next(iterator)  # batch 0; the worker that took batch 1 is stuck in it (in economic mode, the
    assert wait_until(notice.exists, STARTUP_S)  # item worker that took item 2)
    pids = child_pids()

    def press_ctrl_c_while_stopping() -> None:
        if wait_until(lambda: main_thread_is_in("stop_workers"), INTERRUPTED_EXIT_S):
            _interrupt_main_thread()

    presser = threading.Thread(target=press_ctrl_c_while_stopping)
    presser.start()
    with pytest.raises(KeyboardInterrupt):
        del iterator  # the finalizer runs here, and returns
        deadline = time.monotonic() + INTERRUPTED_EXIT_S
        while time.monotonic() < deadline:  # the user's code after it: where the Ctrl-C belongs
            time.sleep(0.01)
    presser.join(INTERRUPTED_EXIT_S)
    leak_guard.assert_exited(pids, within_s=1.0)


# A Ctrl-C that comes while a worker is forked: the kernel holds the signal until fork() returns,
# and Python raises it at its next chance, inside multiprocessing's start of that worker (or in an
# at-fork hook, where it is printed and dropped). The script makes that happen every time: a
# before-fork hook blocks SIGINT and sends it, an after-fork hook in C unblocks it, so that the
# first Python code to run after the fork raises it.
_FORK_INTERRUPT_SCRIPT = textwrap.dedent(
    """
    import ctypes, functools, json, os, signal, sys, threading, time
    import psutil
    from pipeload import DataLoader

    which_fork, loader_mode = int(sys.argv[1]), sys.argv[2]
    forks = [0]

    def before_fork():
        forks[0] += 1
        if forks[0] == which_fork:
            signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGINT})
            signal.pthread_kill(threading.get_ident(), signal.SIGINT)  # pending until unblocked

    if __name__ == "__main__":
        libc = ctypes.CDLL(None)
        sigint_only = (ctypes.c_ulong * 16)()
        sigint_only[0] = 1 << (signal.SIGINT - 1)
        # A C function called from C: no Python code runs between the unblock and multiprocessing's.
        unblock = functools.partial(libc.pthread_sigmask, signal.SIG_UNBLOCK, ctypes.byref(sigint_only), None)
        if loader_mode == "boundary":  # a pipe's process boundary, in the main process
            from pipeload.datapipes.iter import IterableWrapper

            pipe = IterableWrapper(range(64)).queue_boundary("process", multiprocessing_context="fork")
            loader = DataLoader(pipe, batch_size=2)
        else:
            loader = DataLoader(list(range(64)), batch_size=2, num_workers=2,
                                multiprocessing_context="fork", mode=loader_mode)
        os.register_at_fork(before=before_fork, after_in_parent=unblock)
        try:
            batches = len(list(loader))
            interrupted = False
        except KeyboardInterrupt:
            interrupted = True
        end = time.monotonic() + 3.0
        while psutil.Process().children() and time.monotonic() < end:
            time.sleep(0.02)
        left = [f"{c.pid} {c.status()}" for c in psutil.Process().children()]
        print(json.dumps({"interrupted": interrupted, "forks": forks[0], "children_left": left}))
    """
)


@pytest.mark.parametrize(("loader_mode", "which_fork"), [
    ("classic", 2), ("economic", 1), ("boundary", 1),
    # The same hold around every fork: the first worker's, or the second item worker's.
    pytest.param("classic", 1, marks=pytest.mark.slow), pytest.param("economic", 2, marks=pytest.mark.slow)])
def test_ctrl_c_while_a_worker_is_forked_stops_that_worker_too(tmp_path, which_fork, loader_mode, ctrl_c_raises):
    script = tmp_path / "fork_interrupted.py"
    script.write_text(_FORK_INTERRUPT_SCRIPT)
    run = subprocess.run([sys.executable, str(script), str(which_fork), loader_mode],
                         capture_output=True, text=True, timeout=STARTUP_S)
    assert run.returncode == 0, run.stderr
    outcome = json.loads(run.stdout.splitlines()[-1])
    assert outcome["forks"] >= which_fork
    assert outcome["interrupted"], f"the Ctrl-C was lost:\n{run.stderr}"
    assert outcome["children_left"] == [], "a worker forked as Ctrl-C came outlived it"
    assert "Exception ignored" not in run.stderr, run.stderr


# -- early exits in this process ---------------------------------------------------------


@pytest.mark.parametrize("engine", engine_params(FORK, THREAD, ECONOMIC, ECONOMIC_THREAD))
def test_break_stops_the_workers_within_a_second(engine, leak_guard):
    loader = DataLoader(Numbers(64), batch_size=2, num_workers=2, **loader_kwargs(engine))
    for batch in loader:
        pids = child_pids()
        assert batch.tolist() == [0, 1]
        break
    if not engine.threads:
        assert len(pids) == (4 if engine.economic else 2)  # economic: 2 item + 2 batch workers
        leak_guard.assert_exited(pids, within_s=1.0)
    else:
        assert wait_until(lambda: not _pipeload_threads(), 1.0), _pipeload_threads()


def _pipeload_threads() -> list[str]:
    import threading

    return [t.name for t in threading.enumerate() if t.name.startswith("pipeload-")]


@pytest.mark.parametrize("engine", engine_params(FORK, ECONOMIC))
def test_break_while_a_worker_is_busy_in_user_code(engine, leak_guard):
    # A worker is stuck in batch 2 and never reads its STOP: it must be terminated, promptly.
    loader = DataLoader(Stalls(64, stall_index=4), batch_size=2, num_workers=2, **loader_kwargs(engine))
    started = time.monotonic()
    for _ in loader:
        pids = child_pids()
        break
    assert time.monotonic() - started < 1.5
    leak_guard.assert_exited(pids, within_s=1.0)


@pytest.mark.parametrize("engine", engine_params(FORK, ECONOMIC))
def test_user_error_inside_the_loop_stops_the_workers(engine, leak_guard):
    loader = DataLoader(Numbers(64), batch_size=2, num_workers=2, **loader_kwargs(engine))
    with pytest.raises(ZeroDivisionError):
        for _ in loader:
            pids = child_pids()
            1 / 0  # noqa: B018  (the training step fails)
    leak_guard.assert_exited(pids, within_s=1.0)


@pytest.mark.parametrize("engine", engine_params(FORK, SPAWN, ECONOMIC, ECONOMIC_SPAWN, slow=(SPAWN, ECONOMIC_SPAWN)))
@pytest.mark.timeout(90)
def test_dropping_an_iterator_mid_epoch(engine, leak_guard):
    loader = DataLoader(Numbers(64), batch_size=2, num_workers=2, **loader_kwargs(engine))
    iterator = iter(loader)
    next(iterator)
    pids = worker_pids(iterator)
    del iterator
    leak_guard.assert_exited(pids, within_s=1.0)


@pytest.mark.parametrize("engine", engine_params(FORK, ECONOMIC))
def test_dropping_an_iterator_that_never_yielded(engine, leak_guard):
    iterator = iter(DataLoader(Numbers(64), batch_size=2, num_workers=2, **loader_kwargs(engine)))
    pids = worker_pids(iterator)
    del iterator
    leak_guard.assert_exited(pids, within_s=1.0)


@pytest.mark.parametrize("engine", engine_params(FORK, ECONOMIC))
def test_dropping_a_persistent_loader(engine, leak_guard):
    loader = DataLoader(Numbers(16), batch_size=2, num_workers=2, persistent_workers=True,
                        **loader_kwargs(engine))
    iterator = iter(loader)
    pids = worker_pids(iterator)
    assert len(list(iterator)) == 8
    assert all(not pid_gone(pid) for pid in pids)  # persistent: still there between epochs
    del loader, iterator
    leak_guard.assert_exited(pids, within_s=1.0)


@pytest.mark.parametrize("engine", engine_params(FORK, ECONOMIC))
def test_dropping_a_persistent_loader_mid_epoch(engine, leak_guard):
    loader = DataLoader(Stalls(64, stall_index=6), batch_size=2, num_workers=2, persistent_workers=True,
                        **loader_kwargs(engine))
    iterator = iter(loader)
    next(iterator)
    pids = worker_pids(iterator)
    del loader, iterator
    leak_guard.assert_exited(pids, within_s=1.0)


@pytest.mark.parametrize("engine", engine_params(FORK, THREAD, ECONOMIC, ECONOMIC_THREAD))
def test_persistent_loader_used_as_a_temporary(engine, leak_guard):
    # The epoch iterator keeps the loader (and its workers) alive while it runs; once both are
    # gone, so are the workers.
    batches = [b.tolist() for b in DataLoader(Numbers(8), batch_size=2, num_workers=2,
                                              persistent_workers=True, **loader_kwargs(engine))]
    assert batches == [[0, 1], [2, 3], [4, 5], [6, 7]]


@pytest.mark.parametrize("engine", engine_params(FORK, ECONOMIC))
def test_next_after_the_engine_was_closed_stops_cleanly(engine, leak_guard):
    loader = DataLoader(Numbers(64), batch_size=2, num_workers=2, **loader_kwargs(engine))
    iterator = iter(loader)
    next(iterator)
    pids = worker_pids(iterator)
    iterator.close()
    leak_guard.assert_exited(pids, within_s=1.0)
    with pytest.raises(StopIteration):
        next(iterator)
