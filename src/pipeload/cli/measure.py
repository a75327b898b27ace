"""Timing one pass of a loader, with the memory peaks it reaches, for ``pipeload bench``.

A sampler process of its own (sampler.py: a thread here would slow the main process it measures)
reads, every ``SAMPLE_INTERVAL_S``, the resident memory of this process and all its descendants (RSS summed over the tree: pages shared between processes count once
per process, an upper bound that is fair between loaders measured alike) and, every
``TREE_SHM_EVERY`` samples, the shared-memory segments the tree maps or holds open, each counted
once: ``/dev/shm`` files (torch's batches) and memfd segments (pipeload's slabs) alike. The growth
of ``/dev/shm`` alone would show pipeload's slabs as nothing, and other programs' files as ours.
The source checkout's ``bench/measure.py`` goes further (PSS, the kernel's ``Shmem`` count) on the
same readings, which it takes from here.
"""

from __future__ import annotations

import os
import re
import shutil
import time
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass
from typing import Any

SAMPLE_INTERVAL_S = 0.05
# Reading every process's mappings takes milliseconds (~2 a process): every fifth of a second, CPU
# the sampler process takes from the loaders stays near 3% of one core (6% read every 0.1 s with
# five processes). Segments in flight come and go with each batch, but as many are in flight at
# any time: a reading every 0.2 s sees their level.
TREE_SHM_EVERY = 4
BASIC_READINGS = "pipeload.cli.measure:BasicReadings"
SHM_PATH = "/dev/shm"
# A shared mapping of a shared-memory file: /dev/shm/..., /memfd:..., or System V segments. The
# paths are found first and only their lines parsed: a process that imported torch maps some 600
# files, and a regex anchored at every line start took most of a sample's time.
_SHARED_PATH = re.compile(rb"/dev/shm/|/memfd:|/SYSV")
_SHARED_MAPPING = re.compile(
    rb"([0-9a-f]+)-([0-9a-f]+) \S+ \S+ ([0-9a-f]+):([0-9a-f]+) (\d+)\s+(?:/dev/shm/|/memfd:|/SYSV)")
_SHARED_PATH_PREFIXES = ("/dev/shm/", "/memfd:")


@dataclass(frozen=True)
class Run:
    """One loader's pass over the dataset."""

    loader: str
    repeat: int
    samples: int
    seconds: float
    first_batch_s: float
    peak_rss_bytes: int
    peak_shm_bytes: int

    @property
    def samples_per_s(self) -> float:
        return self.samples / self.seconds if self.seconds > 0 else 0.0


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
        from pipeload.cli.sampler import tree_pids_by_proc

        pids = tree_pids_by_proc(self._root_pid, self._sampler_pid)
        reading = {"rss": rss_bytes_of(pids)}
        if tick % TREE_SHM_EVERY == 0:
            reading["shm"] = shared_memory_bytes_of(pids)
        return reading


class PeakSampler:
    """The peak RSS of this process's tree and the peak of its shared memory while open, read
    by the command's sampler process (started on first use, before the clock starts)."""

    def __init__(self) -> None:
        from pipeload.cli.sampler import shared_sampler

        self.peaks = {"rss": 0, "shm": 0}
        self._sampler = shared_sampler(BASIC_READINGS)
        self._sampler.start()
        self._open = True

    def close(self) -> None:
        if self._open:
            self._open = False
            self.peaks.update(self._sampler.stop())

    def __enter__(self) -> PeakSampler:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def time_one_pass(name: str, repeat: int, loader: Iterable[Any], batch_length: Callable[[Any], int],
                  on_batch: Callable[[], None]) -> Run:
    """Iterate ``loader`` once, timing the first batch and the whole pass, sampling memory."""
    samples = 0
    first_batch_s = 0.0
    with PeakSampler() as sampler:
        started = time.perf_counter()
        for batch in loader:
            if samples == 0:
                first_batch_s = time.perf_counter() - started
            samples += batch_length(batch)
            on_batch()
        seconds = time.perf_counter() - started
    return Run(name, repeat, samples, seconds, first_batch_s, sampler.peaks["rss"], sampler.peaks["shm"])
