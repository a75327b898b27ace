"""Datasets and probes for the shared-container tests.

They live in an importable module (not inside a test) so that spawn and forkserver workers can
unpickle them by reference.
"""

from __future__ import annotations

import os
import subprocess
from typing import Any

MEMFD_PREFIX = "/memfd:pipeload-shared:"


def memfd_names(pid: int) -> set[str]:
    """Names of the pipeload segments that process ``pid`` maps or holds a descriptor to."""
    names = set()
    try:
        with open(f"/proc/{pid}/maps") as maps:
            for line in maps:
                if MEMFD_PREFIX in line:
                    names.add(line[line.index(MEMFD_PREFIX) :].split(" (deleted)")[0].strip())
        for fd in os.listdir(f"/proc/{pid}/fd"):
            try:
                target = os.readlink(f"/proc/{pid}/fd/{fd}")
            except OSError:
                continue
            if target.startswith(MEMFD_PREFIX):
                names.add(target.split(" (deleted)")[0])
    except (FileNotFoundError, ProcessLookupError, PermissionError):
        pass  # the process has ended
    return names


def holders_of(name: str) -> list[int]:
    """Every process on the machine that still maps or holds the segment called ``name``."""
    pids = [int(entry) for entry in os.listdir("/proc") if entry.isdigit()]
    return [pid for pid in pids if name in memfd_names(pid)]


def private_dirty_bytes() -> int:
    """This process's private, written memory (what copy-on-write copies add to)."""
    with open("/proc/self/smaps_rollup") as rollup:
        for line in rollup:
            if line.startswith("Private_Dirty:"):
                return int(line.split()[1]) * 1024
    raise RuntimeError("no Private_Dirty in smaps_rollup")


class PathsAndLabels:
    """Item i: (path i, its label, the pid that read it, the segments that process maps)."""

    def __init__(self, paths: Any, labels: Any) -> None:
        self.paths = paths
        self.labels = labels

    def __len__(self) -> int:
        return len(self.paths)

    def __getitem__(self, index: int) -> tuple[str, int, int, list[str]]:
        path = self.paths[index]
        return path, self.labels[path], os.getpid(), sorted(memfd_names(os.getpid()))


class ReadsEverything:
    """Item 0 reads every item of ``table`` and returns how much private memory that wrote."""

    def __init__(self, table: Any) -> None:
        self.table = table

    def __len__(self) -> int:
        return 1

    def __getitem__(self, index: int) -> int:
        before = private_dirty_bytes()
        for item in self.table:
            pass
        return private_dirty_bytes() - before


class HoldsTable:
    """A dataset of four items that carries a large ``table`` attribute along."""

    def __init__(self, table: Any) -> None:
        self.table = table

    def __len__(self) -> int:
        return 4

    def __getitem__(self, index: int) -> int:
        return index


class Windows:
    """Item i: a slice (a view) of four tokens of one large shared sequence."""

    def __init__(self, tokens: Any) -> None:
        self.tokens = tokens

    def __len__(self) -> int:
        return 6

    def __getitem__(self, index: int) -> Any:
        return self.tokens[index * 4 : index * 4 + 4]


def as_is(batch: Any) -> Any:
    """A collate_fn that hands the worker's item over untouched."""
    return batch


class ShellsOut:
    """Item 0: the shared segments a program that the worker execs (as ``os.system`` would, keeping
    every inheritable descriptor) finds open."""

    def __init__(self, paths: Any) -> None:
        self.paths = paths

    def __len__(self) -> int:
        return 1

    def __getitem__(self, index: int) -> list[str]:
        listing = subprocess.run(["ls", "-l", "/proc/self/fd"], close_fds=False, capture_output=True, text=True)
        return [line for line in listing.stdout.splitlines() if MEMFD_PREFIX in line]
