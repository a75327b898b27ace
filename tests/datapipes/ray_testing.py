"""A real local Ray cluster for the Ray boundary tests, and the checks that nothing of it is left.

Ray reads its settings from the environment when it is imported, so they are set here before
any test imports it: every address on the loopback (this machine's other interface is not the
tests' to use), no token authentication (a local test cluster), no usage reports.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import socket
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from typing import Any

import psutil

RAY_ENV = {
    "RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER": "0",  # Ray's switch for "everything on 127.0.0.1"
    "RAY_AUTH_MODE": "disabled",
    "RAY_USAGE_STATS_ENABLED": "0",
}
os.environ.update(RAY_ENV)
# The actors import the tests' functions by name, as a deployed job's would be installed: a
# cluster's processes get these on their PYTHONPATH (see python_path()).
HERE = os.path.dirname(os.path.abspath(__file__))
SRC = os.path.join(os.path.dirname(os.path.dirname(HERE)), "src")


def python_path() -> str:
    return os.pathsep.join([SRC, HERE] + [p for p in os.environ.get("PYTHONPATH", "").split(os.pathsep) if p])


@contextlib.contextmanager
def cluster_python_path() -> Iterator[None]:
    """PYTHONPATH as the cluster's processes need it, while they are started here."""
    saved = os.environ.get("PYTHONPATH")
    os.environ["PYTHONPATH"] = python_path()
    try:
        yield
    finally:
        if saved is None:
            os.environ.pop("PYTHONPATH", None)
        else:
            os.environ["PYTHONPATH"] = saved

DEADLINE_S = 20.0  # a loaded 2-core machine takes a while to end a Ray worker process
ACTOR_MARK = "ShardRunner"


def wait_for(condition: Callable[[], bool], deadline_s: float = DEADLINE_S) -> bool:
    end = time.monotonic() + deadline_s
    while not condition():
        if time.monotonic() >= end:
            return False
        time.sleep(0.05)
    return True


def actor_processes() -> list[psutil.Process]:
    """Processes of this machine that run a boundary actor (Ray titles them ``ray::ShardRunner``)."""
    found = []
    for process in psutil.process_iter(["cmdline"]):
        try:
            if any(ACTOR_MARK in part for part in process.info["cmdline"] or ()):
                found.append(process)
        except psutil.Error:
            continue
    return found


def objects_held() -> int:
    """Objects this process still holds a reference to in Ray's object store."""
    import gc

    import ray

    if not ray.is_initialized():
        return 0
    gc.collect()  # a reference held by garbage is none the less held: count what survives it
    return len(ray._private.worker.global_worker.core_worker.get_all_reference_counts())


def assert_nothing_left() -> None:
    """No boundary actor process alive, no object of ours left in the store (within a deadline)."""
    import gc

    gc.collect()
    assert wait_for(lambda: not actor_processes()), f"actor processes left: {actor_processes()}"
    assert wait_for(lambda: objects_held() == 0), f"objects left in the store: {_refs()}"


def in_process_cluster() -> Iterator[Any]:
    """``ray.init(num_cpus=2)`` for a module of tests; shut down after, and checked gone: no
    process, thread, /dev/shm entry or descriptor of ours left (Ray's library keeps its event
    loops, a socket and its log files open in the process for good once it was connected)."""
    import threading

    import ray

    before = {child.pid for child in psutil.Process().children(recursive=True)}
    threads, shm, fds = set(threading.enumerate()), _shm(), _fds()
    with cluster_python_path():
        ray.init(num_cpus=2, include_dashboard=False, log_to_driver=False)
    try:
        yield ray
    finally:
        ray.shutdown()
        left = lambda: [c for c in psutil.Process().children(recursive=True) if c.pid not in before]  # noqa: E731
        assert wait_for(lambda: not left()), f"Ray processes outlived ray.shutdown(): {left()}"
        assert not [t.name for t in threading.enumerate() if t not in threads and t.is_alive()]
        assert wait_for(lambda: not _new_shm(shm)), f"/dev/shm entries left: {_new_shm(shm)}"
        ours = {fd: target for fd, target in _fds().items() if fds.get(fd) != target
                and not target.startswith(RAYS_OWN_FDS)}
        assert not ours, f"descriptors left: {ours}"


RAYS_OWN_FDS = ("anon_inode:", "socket:", "/tmp/ray/")


def _shm() -> set[str]:
    return set(os.listdir("/dev/shm"))


def _new_shm(before: set[str]) -> set[str]:
    """Entries made since ``before`` and held by no other process (the machine runs others)."""
    from conftest import _shm_in_use_elsewhere

    fresh = _shm() - before
    return fresh - _shm_in_use_elsewhere(fresh, {os.getpid()}) if fresh else fresh


def _fds() -> dict[str, str]:
    found = {}
    for fd in os.listdir("/proc/self/fd"):
        try:
            found[fd] = os.readlink(f"/proc/self/fd/{fd}")
        except OSError:
            continue
    return found


def free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


def head_node() -> Iterator[str]:
    """``ray start --head`` in a subprocess (its own temp dir); yields its address; ``ray stop``s
    it after, and checks that none of its processes is left."""
    port = free_port()
    temp_dir = f"/tmp/pipeload-ray-{os.getpid()}"
    env = {**os.environ, **RAY_ENV, "PYTHONPATH": python_path()}
    ray_cli = os.path.join(os.path.dirname(sys.executable), "ray")
    started = subprocess.run(
        [ray_cli, "start", "--head", f"--port={port}", "--num-cpus=2", "--include-dashboard=false",
         "--disable-usage-stats", f"--temp-dir={temp_dir}"],
        env=env, capture_output=True, text=True, timeout=120,
    )
    assert started.returncode == 0, started.stdout + started.stderr
    address = f"127.0.0.1:{port}"
    try:
        yield address
    finally:
        stop_head_node(temp_dir)


def stop_head_node(temp_dir: str) -> None:
    """End the processes of the node started with ``temp_dir`` (and theirs), by pid: not
    ``ray stop``, which ends every Ray of the machine."""
    tops = [p for p in psutil.process_iter(["cmdline"]) if temp_dir in " ".join(p.info["cmdline"] or ())]
    everything = set(tops)
    for process in tops:
        try:
            everything.update(process.children(recursive=True))
        except psutil.Error:
            continue
    for process in everything:
        try:
            process.terminate()
        except psutil.Error:
            pass
    _, alive = psutil.wait_procs(list(everything), timeout=10)
    for process in alive:
        try:
            process.kill()
        except psutil.Error:
            pass
    shutil.rmtree(temp_dir, ignore_errors=True)
    assert wait_for(lambda: not actor_processes()), f"actor processes left: {actor_processes()}"


def _refs() -> object:
    import ray

    return ray._private.worker.global_worker.core_worker.get_all_reference_counts()
