"""Two honest readings of shared memory, for the peak sampler in measure.py.

``/dev/shm`` usage alone misses memory that lives in ``memfd`` segments (or in segments unlinked
from ``/dev/shm`` on other mounts), so two other readings are taken:

  * ``machine_shmem_bytes``: the kernel's ``Shmem`` line in ``/proc/meminfo``: every page of
    tmpfs, memfd and System V shared memory on the machine, including segments that no process
    maps right now (a descriptor in flight on a socket, say). Exact, but machine-wide: other
    programs' shared memory moves it too.
  * ``tree_shared_memory_bytes``: the shared-memory segments that a process tree maps or holds
    open, each counted once however many processes map it (by device and inode). Blind to
    segments that are only in flight between processes, but deaf to other programs.
"""

from __future__ import annotations

import re

import psutil

# The tree's segments are `pipeload bench`'s reading too: kept in the package, read from there.
from pipeload.cli.measure import shared_memory_bytes_of, tree_pids

MEMINFO_PATH = "/proc/meminfo"
_SHMEM_LINE = re.compile(rb"^Shmem:\s+(\d+) kB", re.MULTILINE)
_PSS_LINE = re.compile(rb"^Pss:\s+(\d+) kB", re.MULTILINE)
_PSS_SHMEM_LINE = re.compile(rb"^Pss_Shmem:\s+(\d+) kB", re.MULTILINE)


def machine_shmem_bytes() -> int:
    """The kernel's count of shared-memory pages, machine-wide, in bytes (0 if unreadable)."""
    try:
        with open(MEMINFO_PATH, "rb") as meminfo:
            match = _SHMEM_LINE.search(meminfo.read())
    except OSError:
        return 0
    return int(match.group(1)) * 1024 if match else 0


def tree_pss_bytes(root: psutil.Process) -> int:
    """Sum of the proportional set sizes of ``root`` and its descendants, in bytes."""
    return pss_bytes_of(tree_pids(root))


def pss_bytes_of(pids: list[int]) -> int:
    """Sum of the proportional set sizes of the processes ``pids``, in bytes."""
    return sum(_kib(_PSS_LINE, text) * 1024 for text in _rollups(pids))


def tree_memory_bytes(root: psutil.Process) -> int:
    """What the process tree holds, each page once: its PSS without shared memory, plus its
    distinct shared-memory segments whole (``tree_shared_memory_bytes``), mapped or not.

    PSS alone counts a shared-memory page only while some process has it in its page tables:
    a segment that is held but whose pages nobody has touched lately (a batch waiting in the
    main process, a slab between batches, a descriptor in flight) drops out of it, and a loader
    that keeps its batches there looks smaller than it is. Segments are counted at their size,
    which is what they hold once written (batches and slabs are written whole).
    """
    return memory_bytes_of(tree_pids(root))


def memory_bytes_of(pids: list[int]) -> int:
    """``tree_memory_bytes`` of the processes ``pids``."""
    private = sum((_kib(_PSS_LINE, text) - _kib(_PSS_SHMEM_LINE, text)) * 1024 for text in _rollups(pids))
    return private + shared_memory_bytes_of(pids)


def _rollups(pids: list[int]) -> list[bytes]:
    """``/proc/PID/smaps_rollup`` of each of ``pids`` still running."""
    texts = []
    for pid in pids:
        try:
            with open(f"/proc/{pid}/smaps_rollup", "rb") as rollup:
                texts.append(rollup.read())
        except OSError:
            continue  # it exited meanwhile
    return texts


def _kib(line: re.Pattern[bytes], text: bytes) -> int:
    match = line.search(text)
    return int(match.group(1)) if match else 0
