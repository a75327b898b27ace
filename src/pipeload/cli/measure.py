"""Timing one pass of a loader, with the memory peaks it reaches, for ``pipeload bench``.

A background thread samples, every ``SAMPLE_INTERVAL_S``, the resident memory of this process
and all its descendants (RSS summed over the tree: pages shared between processes count once
per process, an upper bound that is fair between loaders measured alike) and, every
``TREE_SHM_EVERY`` samples, the shared-memory segments the tree maps or holds open, each counted
once: ``/dev/shm`` files (torch's batches) and memfd segments (pipeload's slabs) alike. The growth
of ``/dev/shm`` alone would show pipeload's slabs as nothing, and other programs' files as ours.
The source checkout's ``bench/measure.py`` goes further (PSS, the kernel's ``Shmem`` count) on the
same readings, which it takes from here.
"""

from __future__ import annotations

import itertools
import os
import re
import shutil
import threading
import time
import weakref
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass
from typing import Any

SAMPLE_INTERVAL_S = 0.05
TREE_SHM_EVERY = 2  # reading every process's mappings takes milliseconds: not on every sample
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
    import psutil  # the `bench` extra

    try:
        processes = [root, *root.children(recursive=True)]
    except psutil.Error:
        return 0
    total = 0
    for process in processes:
        try:
            total += process.memory_info().rss
        except psutil.Error:
            pass  # a worker that exited between listing and reading
    return total


def tree_shared_memory_bytes(root: Any) -> int:
    """Bytes of distinct shared-memory segments mapped or held open by ``root`` (a
    ``psutil.Process``) and its descendants, each counted once however many processes map it.
    Blind to a segment that is only in flight between processes (a descriptor on a socket)."""
    sizes: dict[tuple[int, int], int] = {}
    for pid in tree_pids(root):
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


class PeakSampler:
    """Keeps the peak RSS of the process tree and the peak of its shared memory while open.

    Invariant: only the sampling thread writes ``peaks`` until ``close()`` has joined it.
    """

    def __init__(self) -> None:
        import psutil  # the `bench` extra

        self.peaks = {"rss": 0, "shm": 0}
        self._stop = threading.Event()
        self._thread = threading.Thread(target=_sample, name="pipeload-bench-sampler", daemon=True,
                                        args=(psutil.Process(os.getpid()), self.peaks, self._stop))
        self._thread.start()
        self._finalizer = weakref.finalize(self, self._stop.set)

    def close(self) -> None:
        self._stop.set()
        self._thread.join()

    def __enter__(self) -> PeakSampler:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def _sample(root: Any, peaks: dict[str, int], stop: threading.Event) -> None:
    for sample in itertools.count():
        peaks["rss"] = max(peaks["rss"], tree_rss_bytes(root))
        if sample % TREE_SHM_EVERY == 0:
            peaks["shm"] = max(peaks["shm"], tree_shared_memory_bytes(root))
        if stop.wait(SAMPLE_INTERVAL_S):
            return


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
