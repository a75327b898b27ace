"""Launches: what the parent does before a fork."""

from __future__ import annotations

import multiprocessing
import multiprocessing.util
import os
import platform
import re
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import psutil
import pytest
import torch.utils.data
from conftest import wait_until

import pipeload
from pipeload.engine import lifecycle

SRC = str(Path(__file__).resolve().parents[2] / "src")


def _anonymous_mib() -> float:
    with open("/proc/self/smaps_rollup") as rollup:
        return int(re.search(r"^Anonymous:\s+(\d+) kB", rollup.read(), re.M).group(1)) / 1024


@pytest.mark.skipif(platform.libc_ver()[0] != "glibc", reason="malloc_trim is glibc's")
def test_release_free_heap_gives_freed_heap_pages_back():
    # Blocks under glibc's mmap threshold live in the heap; every other one kept stops glibc
    # from trimming the freed ones by itself (small Python objects would not: they live in
    # Python's own arenas), so only the trim asked for gives their ~25 MiB back.
    blocks = [bytearray(100_000) for _ in range(512)]  # written: resident
    del blocks[::2]
    freed = _anonymous_mib()
    lifecycle.release_free_heap()
    assert _anonymous_mib() < freed - 18
    del blocks


@pytest.mark.skipif(platform.libc_ver()[0] != "glibc", reason="malloc_trim is glibc's")
@pytest.mark.parametrize("method", ["fork", "spawn", "forkserver"])
def test_only_a_fork_gives_the_free_heap_back_first(method):
    # A forked worker would map the free pages too; a spawned one inherits nothing.
    # Every other 100 KB block (under glibc's mmap threshold: heap, not pages of its own) is
    # freed: the ones kept between them stop glibc from trimming the freed ones by itself, so
    # only a trim asked for gives their ~50 MiB back.
    blocks = [bytearray(100_000) for _ in range(1024)]  # written: resident
    del blocks[::2]
    before = _anonymous_mib()
    process = lifecycle.start_process(multiprocessing.get_context(method), time.sleep, (0,), "w")
    after = _anonymous_mib()
    # Only the parent's heap at the start matters: a spawned child need not finish starting up.
    if method != "fork":
        process.terminate()
    process.join(30)
    assert process.exitcode is not None
    del blocks
    if method == "fork":
        assert after < before - 24, (before, after)
    else:
        assert after > before - 24, (before, after)


def test_a_forked_worker_still_starts_and_ends():
    process = lifecycle.start_process(multiprocessing.get_context("fork"), time.sleep, (0,), "w")
    process.join(10)
    assert process.exitcode == 0


def _faults_of_the_third_round(_index: int) -> int:
    """In a worker: take and free a batch's worth of 600 KB samples three times; the minor page
    faults of the third round (the memory of the first two is there to be reused)."""
    import resource

    import numpy as np

    faults = 0
    for _ in range(3):
        before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
        samples = [np.ones(150_000, dtype=np.float32) for _ in range(16)]
        del samples
        faults = resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before
    return faults


class _ThirdRoundFaults:
    def __len__(self) -> int:
        return 2

    def __getitem__(self, index: int) -> int:
        return _faults_of_the_third_round(index)


@pytest.mark.skipif(platform.libc_ver()[0] != "glibc", reason="mallopt is glibc's")
@pytest.mark.usefixtures("leak_guard")
def test_a_worker_reuses_the_heap_its_samples_freed():
    from pipeload import DataLoader

    # 16 samples of 600 KB are 2,400 pages: faulted in again every round if glibc trims them.
    faults = list(DataLoader(_ThirdRoundFaults(), batch_size=None, num_workers=1,
                             multiprocessing_context="fork"))
    assert max(faults) < 200, faults


def test_the_heap_thresholds_are_left_alone_when_asked(monkeypatch):
    monkeypatch.setenv(lifecycle.WORKER_HEAP_ENV, "dynamic")
    assert lifecycle.steady_heap() is False
    monkeypatch.delenv(lifecycle.WORKER_HEAP_ENV)
    monkeypatch.setenv("MALLOC_TRIM_THRESHOLD_", "131072")
    assert lifecycle.steady_heap() is False


def _main_thread_writes_to_a_child() -> bool:
    frame = sys._current_frames().get(threading.main_thread().ident)
    while frame is not None:
        # multiprocessing's spawn launch, or ours (engine/spawn_launch.py, since stop 42)
        if frame.f_code.co_name == "_launch" and ("popen_spawn" in frame.f_code.co_filename
                                                  or "spawn_launch" in frame.f_code.co_filename):
            return frame.f_locals.get("self") is not None and getattr(frame.f_locals["self"], "pid", None) is not None
        frame = frame.f_back
    return False


@pytest.mark.slow  # a spawn child's start-up: ~2 s
@pytest.mark.timeout(60)
def test_a_ctrl_c_while_a_spawn_start_writes_the_child_its_arguments_leaves_no_zombie(ctrl_c_raises):
    # The child exists once its arguments are being written (4 MB here: the pipe fills, and the
    # write waits for the child to read), but Process has not recorded it: it was left, a zombie
    # for as long as this process lived (torch's loader leaves it too).
    ctx = multiprocessing.get_context("spawn")
    before = {child.pid for child in psutil.Process().children()}

    def press_ctrl_c() -> None:
        if wait_until(_main_thread_writes_to_a_child, 30):
            signal.pthread_kill(threading.main_thread().ident, signal.SIGINT)

    presser = threading.Thread(target=press_ctrl_c)
    presser.start()
    with pytest.raises(KeyboardInterrupt):
        lifecycle.start_process(ctx, time.sleep, (bytes(4 << 20),), "w")
    presser.join(30)
    left = [child for child in psutil.Process().children() if child.pid not in before
            and "resource_tracker" not in " ".join(child.cmdline())]
    assert left == [], [(child.pid, child.status()) for child in left]


CTRL_C_DURING_NUMPY_RANDOM = """
import os, signal, sys
from pipeload.engine import lifecycle

class PressCtrlC:  # a Ctrl-C that comes while numpy.random is being imported
    def find_spec(self, name, path=None, target=None):
        if name == "numpy.random":
            sys.meta_path.remove(self)
            os.kill(os.getpid(), signal.SIGINT)
        return None

assert "numpy.random" not in sys.modules
sys.meta_path.insert(0, PressCtrlC())
try:
    lifecycle._import_what_workers_seed()
except KeyboardInterrupt:
    print("interrupted after the import:", "numpy.random" in sys.modules)
"""


def test_a_ctrl_c_while_workers_import_numpy_random_is_raised_once_it_is_imported(ctrl_c_raises: None) -> None:
    # numpy's compiled modules drop a KeyboardInterrupt raised while they are set up: a Ctrl-C
    # pressed as spawn workers started was lost, and the loop trained on.
    done = subprocess.run([sys.executable, "-c", CTRL_C_DURING_NUMPY_RANDOM], capture_output=True,
                          text=True, timeout=60, env={**os.environ, "PYTHONPATH": SRC})
    assert done.stdout.split(":") == ["interrupted after the import", " True\n"], done.stderr[-2000:]


TWO_THREADS_ITERATE_ONE_LOADER = """
import threading, time, torch
from pipeload import DataLoader

class Rows(torch.utils.data.Dataset):
    def __len__(self): return 64
    def __getitem__(self, i): time.sleep(0.002); return torch.full((4,), float(i))

loader = DataLoader(Rows(), batch_size=4, num_workers=1, multiprocessing_context="fork")
done = []
def run():
    done.append([int(row[0]) for batch in loader for row in batch] == list(range(64)))
threads = [threading.Thread(target=run, daemon=True) for _ in range(2)]
for thread in threads: thread.start()
for thread in threads: thread.join(60)
print("done:", done)
"""


@pytest.mark.timeout(180)
def test_two_threads_iterating_one_loader_with_forked_workers_both_finish() -> None:
    # Both threads started workers at once, each process's first: one worker was forked while
    # the other thread imported numpy.random, found it half made and waited for ever on its
    # lock (a thread it does not have); its thread waited for ever on it (stop 54, 4 runs in 4).
    # A fresh process each time: the race is on the first import.
    for _ in range(2):
        ran = subprocess.run([sys.executable, "-c", TWO_THREADS_ITERATE_ONE_LOADER], capture_output=True,
                             text=True, timeout=120, env={**os.environ, "PYTHONPATH": SRC})
        assert ran.stdout.strip() == "done: [True, True]", (ran.stdout, ran.stderr[-2000:])


class _ProgramsSigint(torch.utils.data.Dataset):
    """Each item: whether a program started from the worker ignores Ctrl-C (SIGINT)."""

    def __len__(self) -> int:
        return 2

    def __getitem__(self, index: int) -> bool:
        asked = "import signal; print(signal.getsignal(signal.SIGINT) is signal.SIG_IGN)"
        answer = subprocess.run([sys.executable, "-c", asked], capture_output=True, text=True, check=True)
        return answer.stdout.strip() == "True"


def test_a_program_a_worker_starts_stops_on_ctrl_c_as_under_torchs_workers(ctrl_c_raises: None) -> None:
    # Workers leave Ctrl-C to the main process; an ignored SIGINT would stay ignored across exec,
    # and an ffmpeg the dataset runs would outlive the Ctrl-C that stopped everything else.
    def ignored(module) -> list[bool]:
        loader = module.DataLoader(_ProgramsSigint(), batch_size=None, num_workers=1,
                                   multiprocessing_context="fork")
        return [bool(answer) for answer in loader]

    assert ignored(pipeload) == ignored(torch.utils.data) == [False, False]


_FORKED_HELPER_SCRIPT = """
import os, sys
import pipeload

if __name__ == "__main__":
    loader = pipeload.DataLoader(list(range(64)), batch_size=8, num_workers=2, persistent_workers=True,
                                 multiprocessing_context="fork")
    print(sum(1 for _ in loader))
    helper = os.fork()
    if helper == 0:
        sys.exit(0)  # a helper (a checkpoint writer, say) that does its job and exits normally
    os.waitpid(helper, 0)
    print(sum(1 for _ in loader))
"""


def test_a_plain_fork_child_exiting_normally_leaves_the_parents_persistent_workers_alone(tmp_path):
    # Its exit ran multiprocessing's hook, which terminated them as its own daemonic children,
    # and our finalizers, which asked them to stop: the parent's next epoch found them dead.
    script = tmp_path / "helper_fork.py"
    script.write_text(_FORKED_HELPER_SCRIPT)
    done = subprocess.run([sys.executable, str(script)], capture_output=True, text=True, timeout=100,
                          env={**os.environ, "PYTHONPATH": SRC})
    assert done.returncode == 0, done.stderr[-2000:]
    assert done.stdout.split() == ["8", "8"]
    assert "Traceback" not in done.stderr, done.stderr[-2000:]


def _write_later(path: str) -> None:
    time.sleep(0.2)  # the user's slow background write: it outlasts the worker's last task
    Path(path).write_text("done")


class _StartsBackgroundWork:
    """``worker_init_fn`` that leaves work running in the worker: a non-daemon thread and a
    multiprocessing finalizer, each writing one file per worker into ``folder``."""

    def __init__(self, folder: str) -> None:
        self.folder = folder

    def __call__(self, worker_id: int) -> None:
        threading.Thread(target=_write_later, args=(os.path.join(self.folder, f"thread-{worker_id}"),)).start()
        multiprocessing.util.Finalize(None, _write_later, args=(os.path.join(self.folder, f"finalizer-{worker_id}"),),
                                      exitpriority=0)


@pytest.mark.parametrize("persistent", [False, True], ids=["per-epoch", "persistent"])
def test_a_worker_finishes_what_the_users_code_started_before_it_exits_as_torchs(tmp_path, persistent):
    # torch's workers end through multiprocessing, which joins non-daemon threads and runs its
    # finalizers before the process exits; a worker ended at once lost a cache writer's writes.
    loader = pipeload.DataLoader(list(range(4)), batch_size=2, num_workers=2, multiprocessing_context="fork",
                                 worker_init_fn=_StartsBackgroundWork(str(tmp_path)), persistent_workers=persistent)
    iterator = iter(loader)
    assert [batch.tolist() for batch in iterator] == [[0, 1], [2, 3]]
    workers = iterator._workers
    del iterator, loader  # persistent workers stop with their loader
    for worker in workers:
        worker.join(10)
    assert all(worker.exitcode == 0 for worker in workers)
    assert sorted(os.listdir(tmp_path)) == ["finalizer-0", "finalizer-1", "thread-0", "thread-1"]


class _LingersAtExit:
    """A worker_init_fn whose worker leaves only once released: a non-daemon thread of the
    user's, which the worker finishes before it exits, as torch's do, reads a byte the test
    writes (a pipe: a multiprocessing Event's set() hangs once a waiter was terminated)."""

    def __init__(self) -> None:
        self._read, self._write = os.pipe()

    def __call__(self, worker_id: int) -> None:
        threading.Thread(target=os.read, args=(self._read, 1)).start()

    def release(self) -> None:
        os.write(self._write, b"x")
        os.close(self._write)
        os.close(self._read)


def test_a_process_forked_while_workers_are_reaped_does_not_wait_for_them(no_gc) -> None:
    # A child forked while the parent reaped a finished epoch's workers inherited the count of
    # workers being reaped, but not the threads reaping them: a loader dropped in a reference
    # cycle, collected in the next epoch's new worker, waited there ~6.8 s for reaping that
    # would never end before it let go of its slabs. Seen as a worker silent for 7 s at start.
    linger = _LingersAtExit()
    loader = pipeload.DataLoader(list(range(8)), batch_size=2, num_workers=1, worker_init_fn=linger,
                                 multiprocessing_context="fork")
    assert len(list(loader)) == 4  # the epoch's worker is now reaped beside us, and lingers
    assert not lifecycle.wait_for_reaped(0)
    dropped = pipeload.DataLoader(list(range(8)), batch_size=2)
    dropped.itself = dropped  # collected by the collector alone
    del dropped
    # What a collection inside Python's own after-fork hooks finds, before ours gave the child a
    # count of its own (the worker's stack, stop 55: threading._after_fork, then the finalizer).
    inherited = lifecycle._REAPING
    pid = os.fork()
    if pid == 0:  # the child: collect the dropped loader (its finalizer runs here), then say
        started = time.monotonic()
        import gc

        gc.collect()
        quick = time.monotonic() - started < 1.0 and lifecycle.wait_for_reaped(0) and inherited.wait(0)
        os._exit(0 if quick else 1)
    try:
        _, status = os.waitpid(pid, 0)
        assert os.waitstatus_to_exitcode(status) == 0, "the child waited for the parent's reaping"
    finally:
        linger.release()
        assert lifecycle.wait_for_reaped(10)
