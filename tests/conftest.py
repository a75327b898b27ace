"""Fixtures shared by the whole suite.

``leak_guard`` is the check every multi-process test runs under: whatever the test started
(worker processes, threads, shared-memory segments, file descriptors) must be gone shortly after
it ends. It waits on those conditions with a deadline instead of sleeping, and names what is left.

Some long-lived helpers are not leaks and are left out of the comparison: the multiprocessing
resource tracker and the forkserver (Python starts each once per process, the first time a spawn
or forkserver context needs it, and keeps it and one fd to it until exit), the arenas of
multiprocessing's shared heap, which it keeps mapped for reuse, and what the CUDA runtime opens
for itself (``/dev/nvidia*`` devices, eventfds, epoll and timer descriptors): CUDA keeps them for
the life of the process. Where CUDA is, it is woken before the first test, so that what its start
opens (a pipe among it) is no test's. pipeload's own shared memory
(``/memfd:pipeload-*``) always counts, as descriptors and as mappings.
"""

from __future__ import annotations

import contextlib
import gc
import importlib.util
import os
import signal
import sys
import threading
import time
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass
from typing import Any

import psutil
import pytest

SHM_DIR = "/dev/shm"
OUR_MEMORY = "/memfd:pipeload-"  # every shared buffer pipeload makes has this name
# What the CUDA runtime and driver open for themselves, for the life of the process.
CUDA_OWN_DESCRIPTORS = ("/dev/nvidia", "/dev/dri/", "anon_inode:[eventfd]", "anon_inode:[eventpoll]",
                        "anon_inode:[timerfd]", "anon_inode:[dmabuf]", "/dev/shm/cuda.shm")
LEAK_DEADLINE_S = 5.0  # generous: a loaded 2-core machine may take a while to reap and unmap
POLL_INTERVAL_S = 0.02
_HELPER_MARKERS = ("multiprocessing.resource_tracker", "multiprocessing.forkserver")


def wait_until(condition: Callable[[], bool], deadline_s: float) -> bool:
    """Poll ``condition`` until it holds or ``deadline_s`` passes; returns whether it held."""
    end = time.monotonic() + deadline_s
    while not condition():
        if time.monotonic() >= end:
            return False
        time.sleep(POLL_INTERVAL_S)
    return True


def main_thread_is_in(function_name: str) -> bool:
    """Whether the main thread is running ``function_name`` (anywhere on its stack) right now:
    what a test waits for before it kills or interrupts something "while the main thread waits"."""
    frame = sys._current_frames().get(threading.main_thread().ident)
    while frame is not None:
        if frame.f_code.co_name == function_name:
            return True
        frame = frame.f_back
    return False


@contextlib.contextmanager
def once_the_main_thread_waits(action: Callable[[], None], function_name: str = "receive",
                               deadline_s: float = 20.0) -> Iterator[list[bool]]:
    """Run ``action`` on a thread of its own as soon as the main thread is in ``function_name``
    (at the deadline otherwise, so that nothing hangs); yields a list that holds, once the block
    is left, whether the main thread was seen there."""
    seen: list[bool] = []

    def act() -> None:
        seen.append(wait_until(lambda: main_thread_is_in(function_name), deadline_s))
        action()

    thread = threading.Thread(target=act)
    thread.start()
    try:
        yield seen
    finally:
        thread.join(deadline_s + 10.0)


def run_rank_processes(target: Callable[..., None], args: tuple[Any, ...], world_size: int = 2,
                       start_method: str = "spawn", join_s: float = 100.0) -> None:
    """Run ``target(rank, *args)`` in ``world_size`` real processes (a gloo job's ranks) and
    check that every one exited with 0. ``fork`` starts them in a fraction of spawn's time,
    where the ranks start no process of their own."""
    import multiprocessing

    context = multiprocessing.get_context(start_method)
    ranks = [context.Process(target=target, args=(rank, *args)) for rank in range(world_size)]
    for process in ranks:
        process.start()
    deadline = time.monotonic() + join_s
    for process in ranks:
        process.join(max(0.0, deadline - time.monotonic()))
    stuck = [process.pid for process in ranks if process.exitcode is None]
    for pid in stuck:  # with everything they started: a stuck rank must fail the test, not hang the run
        _kill_tree(pid)
    for process in ranks:
        process.join(10)
    assert not stuck, f"rank processes {stuck} were still running after {join_s} s"
    assert [process.exitcode for process in ranks] == [0] * world_size


def _kill_tree(pid: int) -> None:
    try:
        root = psutil.Process(pid)
        tree = [*root.children(recursive=True), root]
    except psutil.NoSuchProcess:
        return
    for process in tree:
        with contextlib.suppress(psutil.NoSuchProcess):
            process.kill()


def backing_of(tensor) -> str:
    """What holds a tensor's memory: the path of its mapping in /proc/self/maps ('' if anonymous)."""
    address = tensor.data_ptr()
    with open("/proc/self/maps") as maps:
        for line in maps:
            fields = line.split(maxsplit=5)
            start, end = (int(part, 16) for part in fields[0].split("-"))
            if start <= address < end:
                return fields[5].strip() if len(fields) == 6 else ""
    return ""


def in_shared_memory(tensor) -> bool:
    """Whether a tensor's bytes lie in shared memory (a memfd slab or buffer, a /dev/shm file);
    a slab view answers ``is_shared()`` with False, so tests ask the mapping instead."""
    return backing_of(tensor).startswith(("/memfd:", "/dev/shm/"))


def pid_gone(pid: int) -> bool:
    """True once ``pid`` no longer runs: exited and reaped, or a zombie nobody has reaped yet."""
    try:
        return psutil.Process(pid).status() == psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return True


def gone_or_fail(pids: list[int], deadline_s: float, what: str) -> None:
    """Fail unless every pid is gone within ``deadline_s``; those still running are killed first,
    so that they do not outlive the test."""
    if wait_until(lambda: all(pid_gone(pid) for pid in pids), deadline_s):
        return
    alive = [pid for pid in pids if not pid_gone(pid)]
    for pid in alive:
        os.kill(pid, signal.SIGKILL)
    pytest.fail(f"{what} {alive} still running {deadline_s} s after the main process died")


def _is_helper(process: psutil.Process) -> bool:
    try:
        cmdline = " ".join(process.cmdline())
    except psutil.Error:
        return False
    return any(marker in cmdline for marker in _HELPER_MARKERS)


def child_pids(recursive: bool = False) -> list[int]:
    """Pids of this process's children (workers), leaving out multiprocessing's own helpers."""
    return [c.pid for c in psutil.Process().children(recursive=recursive) if not _is_helper(c)]


def _children() -> dict[int, str]:
    """Descendants of this process (zombies included: an unreaped worker is a leak too)."""
    found = {}
    for child in psutil.Process().children(recursive=True):
        if _is_helper(child):
            continue
        try:
            found[child.pid] = f"pid {child.pid} {child.status()} {' '.join(child.cmdline())[:120]}"
        except psutil.Error:
            continue  # it ended while we looked
    return found


def _helper_fds() -> set[str]:
    """The fds this process keeps to the resource tracker and the forkserver, if started."""
    from multiprocessing import forkserver, resource_tracker

    fds = {
        getattr(resource_tracker._resource_tracker, "_fd", None),
        getattr(forkserver._forkserver, "_forkserver_alive_fd", None),
    }
    return {str(fd) for fd in fds if fd is not None}


def _cuda_initialised(targets: Iterable[str] = ()) -> bool:
    # torch's flag misses a driver that pinning alone woke (``Tensor.pin_memory`` allocates page-
    # locked memory without torch's lazy initialisation), so the driver's device files count too.
    torch = sys.modules.get("torch")
    if torch is not None and bool(torch.cuda.is_initialized()):
        return True
    return any(target.startswith("/dev/nvidia") for target in targets)


def _open_fds() -> dict[str, str]:
    fds = {}
    targets = {}
    for fd in os.listdir("/proc/self/fd"):
        try:
            targets[fd] = os.readlink(f"/proc/self/fd/{fd}")
        except OSError:
            continue  # the fd listdir itself used, already closed
    cuda = _cuda_initialised(targets.values())
    for fd, target in targets.items():
        # multiprocessing's heap (Value, Array) keeps small arenas mapped for reuse, for good.
        if target.startswith(f"{SHM_DIR}/pym-"):
            continue
        if cuda and target.startswith(CUDA_OWN_DESCRIPTORS):
            continue  # CUDA's, not ours (ours are memfds named pipeload-*, pipes and sockets)
        fds[fd] = target
    for fd in _helper_fds():
        fds.pop(fd, None)
    return fds


def our_mappings() -> int:
    """How many mappings of pipeload's shared memory this process has (/proc/self/maps)."""
    with open("/proc/self/maps") as maps:
        return sum(OUR_MEMORY in line for line in maps)


def _shm_entries() -> set[str]:
    try:
        return set(os.listdir(SHM_DIR))
    except FileNotFoundError:
        return set()


def _shm_in_use_elsewhere(names: set[str], ours: set[int]) -> set[str]:
    """Of ``names``, those another process (not ours) has open or mapped.

    The machine may run other programs; a segment one of them holds is theirs, not our leak.
    """
    held = set()
    for pid in psutil.pids():
        if pid in ours:
            continue
        try:
            with open(f"/proc/{pid}/maps") as maps:
                text = maps.read()
            links = [os.readlink(f"/proc/{pid}/fd/{fd}") for fd in os.listdir(f"/proc/{pid}/fd")]
        except OSError:
            continue
        for name in names:
            path = f"{SHM_DIR}/{name}"
            if path in text or any(link.startswith(path) for link in links):
                held.add(name)
    return held


@dataclass
class _Snapshot:
    children: dict[int, str]
    threads: set[threading.Thread]
    fds: dict[str, str]
    shm: set[str]
    mappings: int

    @classmethod
    def take(cls) -> _Snapshot:
        return cls(_children(), set(threading.enumerate()), _open_fds(), _shm_entries(),
                   our_mappings())


class LeakGuard:
    """Handed to tests that use the ``leak_guard`` fixture; its checks run after the test."""

    def __init__(self) -> None:
        self.before = _Snapshot.take()

    @staticmethod
    def assert_exited(pids: Iterable[int], within_s: float = 1.0) -> None:
        """Fail unless every pid in ``pids`` has stopped running within ``within_s``."""
        pids = list(pids)
        assert pids, "no worker pids to watch"
        if not wait_until(lambda: all(pid_gone(pid) for pid in pids), within_s):
            alive = [pid for pid in pids if not pid_gone(pid)]
            pytest.fail(f"worker processes {alive} still running {within_s} s later")

    def leftovers(self) -> list[str]:
        """What the test started and has not released, after waiting up to the deadline.

        One deadline for everything, so a test that leaks costs LEAK_DEADLINE_S, not more.
        """
        before = self.before

        def new_children() -> list[str]:
            return sorted(text for pid, text in _children().items() if pid not in before.children)

        def new_threads() -> list[str]:
            return [t.name for t in threading.enumerate() if t not in before.threads and t.is_alive()]

        def new_fds() -> dict[str, str]:
            now = _open_fds()
            if len(now) <= len(before.fds):
                return {}
            return {fd: target for fd, target in now.items() if before.fds.get(fd) != target}

        def new_shm() -> list[str]:
            fresh = _shm_entries() - before.shm
            if fresh:  # the scan of other processes is slow; only pay for it when needed
                fresh -= _shm_in_use_elsewhere(fresh, {os.getpid()})
            return sorted(fresh)

        def new_mappings() -> str:
            extra = our_mappings() - before.mappings
            return f"{extra} more mappings of {OUR_MEMORY}* than before" if extra > 0 else ""

        checks = {
            "child processes outlived the test": new_children,
            "threads outlived the test": new_threads,
            "file descriptors left open": new_fds,
            "/dev/shm entries left behind": new_shm,
            "shared memory still mapped": new_mappings,
        }
        wait_until(lambda: not any(check() for check in checks.values()), LEAK_DEADLINE_S)
        return [f"{what}: {found}" for what, check in checks.items() if (found := check())]


# Subprocess runs (the command line, scripts): every process a run starts inherits this variable,
# set to a fresh value per run, so survivors can be found whoever their parent is now.
RUN_MARKER = "PIPELOAD_TEST_CLI_RUN"
RUN_GRACE_S = 5.0


def processes_marked(marker: str) -> list[psutil.Process]:
    """Live processes whose environment carries ``RUN_MARKER=marker``."""
    found = []
    for process in psutil.process_iter():
        try:
            if process.environ().get(RUN_MARKER) == marker:
                found.append(process)
        except (psutil.NoSuchProcess, psutil.AccessDenied, psutil.ZombieProcess):
            continue
    return found


def assert_run_left_nothing(marker: str, shm_before: set[str]) -> None:
    """Fail if a process of the run marked ``marker``, or a /dev/shm entry made since
    ``shm_before`` (``shm_entries()`` before the run), is still there ``RUN_GRACE_S`` later."""
    survivors: list[psutil.Process] = []
    new_shm: set[str] = set()

    def gone() -> bool:
        nonlocal survivors, new_shm
        survivors, new_shm = processes_marked(marker), _shm_entries() - shm_before
        return not survivors and not new_shm

    wait_until(gone, RUN_GRACE_S)
    assert not survivors, f"processes outlived the run: {survivors}"
    assert not new_shm, f"/dev/shm entries outlived the run: {sorted(new_shm)}"


shm_entries = _shm_entries


def lacks(module: str) -> pytest.MarkDecorator:
    """Skip where ``module`` (a top-level name) is not installed, without importing it: found, not
    loaded, so that collecting the suite leaves the large libraries out of this process (see
    ``pytest_collection_modifyitems``)."""
    return pytest.mark.skipif(importlib.util.find_spec(module) is None, reason=f"needs {module}")


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    """Run the tests marked ``imports_large_libraries`` last, in their order.

    A fork copies the forking process's page tables: this one forks workers thousands of times,
    and Ray, Lightning, accelerate and moto imported into it took a fork from ~14 ms to ~47 ms
    (the whole suite collected: ``os.fork()`` and ``waitpid`` timed in a test); fsspec with
    aiohttp (the remote sources' tests) adds ~4 ms more. Their tests import them when they run,
    so every test before them forks the leaner process.
    """
    items.sort(key=lambda item: item.get_closest_marker("imports_large_libraries") is not None)


def pytest_collection_finish(session: pytest.Session) -> None:
    """Move what collection imported (torch, Lightning, ...) out of the collector's sight.

    Those objects live until the end anyway; left in view, every full collection (``no_gc``
    runs one per test, Python runs them on its own too) walks them all: ~0.2 s each.
    """
    gc.collect()
    gc.freeze()


@pytest.fixture(scope="session", autouse=True)
def _cuda_opened_before_any_test() -> None:
    """Where CUDA is, wake it once before the first test's snapshot of descriptors.

    The driver opens descriptors of its own when it starts (a pipe among them, which cannot be
    told apart from ours by name) and keeps them until the process exits; opened inside a test,
    they would read as that test's leak.
    """
    torch = sys.modules.get("torch")
    if torch is None or not torch.cuda.is_available():
        return
    torch.empty(1, device="cuda")
    torch.empty(1, pin_memory=True)
    torch.cuda.synchronize()


@pytest.fixture(autouse=True)
def _no_sampler_process_outlives_its_test() -> Iterator[None]:
    """The benchmarks' memory sampler process (pipeload.cli.sampler) lives as long as the command
    that measures; here that is one test, not the session, whose later tests count children."""
    yield
    sampler = sys.modules.get("pipeload.cli.sampler")
    if sampler is not None:
        sampler.close_shared()


@pytest.fixture
def leak_guard() -> Iterator[LeakGuard]:
    """Fail the test (at teardown) if it leaves processes, threads, fds or /dev/shm entries."""
    guard = LeakGuard()
    yield guard
    problems = guard.leftovers()
    if problems:
        pytest.fail("resource leak:\n  " + "\n  ".join(problems))


@pytest.fixture
def no_gc() -> Iterator[None]:
    """Run the test with the cyclic garbage collector off, to prove that stopping workers and
    releasing their resources never waits for it."""
    gc.collect()
    gc.disable()
    try:
        yield
    finally:
        gc.enable()


@pytest.fixture
def pretend_accelerator(monkeypatch: pytest.MonkeyPatch) -> Iterator[None]:
    """On a machine without an accelerator, make pipeload's pin stage run anyway.

    ``torch.accelerator.is_available`` answers True and ``Tensor.pin_memory`` returns a copy
    (the real one raises without an accelerator), so the pin thread, its error handling and its
    shutdown are exercised for real; only the page-locking is missing. With an accelerator
    present nothing is replaced. Only pipeload's side may run under it: torch's own loader
    would then try to pin for real.
    """
    import torch

    if not torch.accelerator.is_available():
        monkeypatch.setattr(torch.accelerator, "is_available", lambda: True)
        monkeypatch.setattr(torch.Tensor, "pin_memory", lambda self, *args, **kwargs: self.clone())
    yield


@pytest.fixture
def ctrl_c_raises() -> Iterator[None]:
    """SIGINT raises KeyboardInterrupt here and in the programs a test starts, for this test.

    A shell that runs the suite in the background (``pytest &``) starts it with SIGINT ignored,
    which Python keeps and children inherit; a test of Ctrl-C needs what a terminal gives.
    """
    previous = signal.signal(signal.SIGINT, signal.default_int_handler)
    try:
        yield
    finally:
        signal.signal(signal.SIGINT, previous)


def sizes_past_errors(loader: Iterable[Any], error: type[BaseException]) -> list[int]:
    """The length of each batch the loop received, going on past those that raised ``error``."""
    received, iterator = [], iter(loader)
    while True:
        try:
            received.append(len(next(iterator)))
        except error:
            continue
        except StopIteration:
            return received
