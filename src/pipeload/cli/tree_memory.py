"""Memory readings of a process tree, for the benchmarks: resident memory summed over the tree, and
the shared-memory segments it maps or holds open, each counted once: ``/dev/shm`` files (torch's
batches) and memfd segments (pipeload's slabs) alike. The growth of ``/dev/shm`` alone would show
pipeload's slabs as nothing, and other programs' files as ours.

Imports nothing of pipeload (nor torch): the sampler process (sampler.py) loads this file on its
own, and starts in a tenth of a second instead of the two an import of torch takes.
"""

from __future__ import annotations

import os
import re
import shutil
from collections.abc import Iterable, Iterator
from typing import Any

SAMPLE_INTERVAL_S = 0.05
# Reading every process's mappings takes milliseconds (~2 a process): every fifth of a second, CPU
# the sampler process takes from the loaders stays near 3% of one core (6% read every 0.1 s with
# five processes). Segments in flight come and go with each batch, but as many are in flight at
# any time: a reading every 0.2 s sees their level.
TREE_SHM_EVERY = 4
SHM_PATH = "/dev/shm"
# A shared mapping of a shared-memory file: /dev/shm/..., /memfd:..., or System V segments. The
# paths are found first and only their lines parsed: a process that imported torch maps some 600
# files, and a regex anchored at every line start took most of a sample's time.
_SHARED_PATH = re.compile(rb"/dev/shm/|/memfd:|/SYSV")
_SHARED_MAPPING = re.compile(
    rb"([0-9a-f]+)-([0-9a-f]+) \S+ \S+ ([0-9a-f]+):([0-9a-f]+) (\d+)\s+(?:/dev/shm/|/memfd:|/SYSV)")
_SHARED_PATH_PREFIXES = ("/dev/shm/", "/memfd:")


def shm_used_bytes() -> int:
    """Bytes in use on ``/dev/shm``; 0 where there is no such file system."""
    try:
        return shutil.disk_usage(SHM_PATH).used
    except OSError:
        return 0


def tree_rss_bytes(root: Any) -> int:
    """Resident memory of ``root`` (a ``psutil.Process``) plus every live descendant, in bytes."""
    return rss_bytes_of(tree_pids(root))


def rss_bytes_of(pids: Iterable[int]) -> int:
    """Resident memory of the processes ``pids`` that still run, summed, in bytes."""
    import psutil  # the `bench` extra

    total = 0
    for pid in pids:
        try:
            total += psutil.Process(pid).memory_info().rss
        except psutil.Error:
            pass  # a worker that exited between listing and reading
    return total


def tree_shared_memory_bytes(root: Any) -> int:
    """Bytes of distinct shared-memory segments mapped or held open by ``root`` (a
    ``psutil.Process``) and its descendants, each counted once however many processes map it.
    Blind to a segment that is only in flight between processes (a descriptor on a socket)."""
    return shared_memory_bytes_of(tree_pids(root))


def shared_memory_bytes_of(pids: Iterable[int]) -> int:
    """``tree_shared_memory_bytes`` of the processes ``pids``."""
    sizes: dict[tuple[int, int], int] = {}
    for pid in pids:
        _add_mapped(pid, sizes)
        _add_held_open(pid, sizes)
    return sum(sizes.values())


def _add_mapped(pid: int, sizes: dict[tuple[int, int], int]) -> None:
    try:
        with open(f"/proc/{pid}/maps", "rb") as maps:
            text = maps.read()
    except OSError:
        return  # it exited meanwhile
    mapped: dict[tuple[int, int], int] = {}
    for start, end, major, minor, inode in _shared_mappings(text):
        key = (os.makedev(int(major, 16), int(minor, 16)), int(inode))
        mapped[key] = mapped.get(key, 0) + int(end, 16) - int(start, 16)
    for key, size in mapped.items():
        sizes[key] = max(sizes.get(key, 0), size)


def _shared_mappings(maps: bytes) -> Iterator[tuple[bytes, ...]]:
    """(start, end, major, minor, inode) of each line of ``maps`` that maps a shared-memory file."""
    for path in _SHARED_PATH.finditer(maps):
        line = _SHARED_MAPPING.match(maps, maps.rfind(b"\n", 0, path.start()) + 1)
        if line is not None and line.end() == path.end():  # the path itself, not a word in a name
            yield line.groups()


def _add_held_open(pid: int, sizes: dict[tuple[int, int], int]) -> None:
    fd_dir = f"/proc/{pid}/fd"
    try:
        fds = os.listdir(fd_dir)
    except OSError:
        return
    for fd in fds:
        path = f"{fd_dir}/{fd}"
        try:
            if not os.readlink(path).startswith(_SHARED_PATH_PREFIXES):
                continue
            status = os.stat(path)
        except OSError:
            continue  # closed meanwhile
        key = (status.st_dev, status.st_ino)
        sizes[key] = max(sizes.get(key, 0), status.st_size)


def tree_pids(root: Any) -> list[int]:
    """``root``'s pid and its live descendants' (none if ``root`` has exited)."""
    import psutil  # the `bench` extra

    try:
        return [root.pid, *(child.pid for child in root.children(recursive=True))]
    except psutil.NoSuchProcess:
        return []


class BasicReadings:
    """What ``pipeload bench`` reads of the tree in the sampler process (see sampler.py): its RSS
    at each tick, its shared memory every ``TREE_SHM_EVERY`` ticks."""

    def __init__(self, root: Any, sampler_pid: int) -> None:
        self._root_pid, self._sampler_pid = root.pid, sampler_pid

    def take(self, tick: int) -> dict[str, int]:
        pids = tree_pids_by_proc(self._root_pid, self._sampler_pid)
        reading = {"rss": rss_bytes_of(pids)}
        if tick % TREE_SHM_EVERY == 0:
            reading["shm"] = shared_memory_bytes_of(pids)
        return reading


def tree_pids_by_proc(root_pid: int, leave_out: int) -> list[int]:
    """``root_pid`` and its live descendants, ``leave_out`` and its descendants excepted.

    Read from each thread's ``/proc/PID/task/TID/children`` (a few small files): psutil's
    ``children(recursive=True)`` reads every process's status on the machine, ~2 ms a call.
    """
    if not os.path.exists(f"/proc/{root_pid}/task/{root_pid}/children"):
        return _tree_pids_by_psutil(root_pid, leave_out)  # a kernel without CONFIG_PROC_CHILDREN
    pids, todo = [], [root_pid]
    while todo:
        pid = todo.pop()
        if pid == leave_out:
            continue
        pids.append(pid)
        try:
            tasks = os.listdir(f"/proc/{pid}/task")
        except OSError:
            continue  # it exited meanwhile
        for task in tasks:
            try:
                with open(f"/proc/{pid}/task/{task}/children", "rb") as children:
                    todo.extend(int(child) for child in children.read().split())
            except OSError:
                continue
    return pids


def _tree_pids_by_psutil(root_pid: int, leave_out: int) -> list[int]:
    import psutil  # the `bench` extra

    def descendants(pid: int) -> set[int]:
        try:
            return {child.pid for child in psutil.Process(pid).children(recursive=True)}
        except psutil.Error:
            return set()

    left_out = {leave_out} | descendants(leave_out)
    return [root_pid, *(pid for pid in descendants(root_pid) if pid not in left_out)]
