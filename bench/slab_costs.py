"""What one slab costs a process that maps it, each way it can be faulted in.

    python -m bench.slab_costs [--megabytes 38.75] [--repeats 3]

A slab is a shared memory file (memfd). Before it is written or read, every page must be allocated
(once, by whichever process touches it first: zeroed) and mapped in each process that uses it (a
page-table entry per page, in every process, set up on first touch or all at once, and torn down
when the process unmaps it or exits). This prints, for a slab of the given size (the default is a
batch of 64 float32 3x224x224 items plus the pool's headroom), the time and the minor faults of:

    fresh pages, read-populated      MADV_POPULATE_READ on a new file: allocation and zeroing
    fresh pages, fallocate           posix_fallocate on a new file (pages allocated, zeroed later)
    existing pages, MAP_POPULATE     a new mapping of pages that exist: what workers did before
    existing pages, read-populated   MADV_POPULATE_READ: shared memory read faults map 16 pages
    existing pages, write-populated  MADV_POPULATE_WRITE: one fault per page
    existing pages, write faults     no populate: the first write to each page faults
    unmapping a populated mapping    munmap (what each worker pays again when it exits)

Medians over ``--repeats``. The figures are the kernel's work, so they depend on the machine, not
on pipeload; see docs/design/transport.md for what the slab pool does with them.
"""

from __future__ import annotations

import argparse
import mmap
import os
import resource
import statistics
import sys
import time
from collections.abc import Callable, Sequence

import numpy as np

from pipeload.transport.slab_memory import MADV_POPULATE_READ, MADV_POPULATE_WRITE, madvise

MIB = 1 << 20
PAGE = mmap.PAGESIZE


def _faults() -> int:
    return resource.getrusage(resource.RUSAGE_SELF).ru_minflt


def _new_file(size: int) -> int:
    fd = os.memfd_create("pipeload-bench", os.MFD_CLOEXEC)
    os.ftruncate(fd, size)
    return fd


def _address(mapping: mmap.mmap) -> tuple[np.ndarray, int]:
    array = np.frombuffer(mapping, dtype=np.uint8)
    return array, array.ctypes.data


def _timed(action: Callable[[], object]) -> tuple[float, int]:
    faults = _faults()
    started = time.perf_counter()
    action()
    return time.perf_counter() - started, _faults() - faults


def measure(size: int) -> dict[str, tuple[float, int]]:
    """One round of every way; returns seconds and minor faults by name."""
    results = {}
    fd = _new_file(size)
    fresh = mmap.mmap(fd, size)
    array, address = _address(fresh)
    results["fresh pages, read-populated"] = _timed(lambda: madvise(address, size, MADV_POPULATE_READ))
    other = _new_file(size)
    results["fresh pages, fallocate"] = _timed(lambda: os.posix_fallocate(other, 0, size))
    os.close(other)
    results["existing pages, MAP_POPULATE"] = _timed(
        lambda: mmap.mmap(fd, size, flags=mmap.MAP_SHARED | mmap.MAP_POPULATE))
    for name, advice in (("read-populated", MADV_POPULATE_READ), ("write-populated", MADV_POPULATE_WRITE)):
        mapping = mmap.mmap(fd, size)
        view, where = _address(mapping)
        results[f"existing pages, {name}"] = _timed(lambda: madvise(where, size, advice))
        del view
        results["unmapping a populated mapping"] = _timed(mapping.close)
    mapping = mmap.mmap(fd, size)
    view, _ = _address(mapping)

    def write_each_page() -> None:
        view[::PAGE] = 1

    results["existing pages, write faults"] = _timed(write_each_page)
    del view, array
    mapping.close()
    fresh.close()
    os.close(fd)
    return results


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench.slab_costs", description=__doc__.split("\n")[0])
    parser.add_argument("--megabytes", type=float, default=38.75, help="slab size (default: %(default)s)")
    parser.add_argument("--repeats", type=int, default=3, help="default: %(default)s")
    args = parser.parse_args(argv)
    size = -(-int(args.megabytes * MIB) // PAGE) * PAGE
    rounds = [measure(size) for _ in range(max(1, args.repeats))]
    load = os.getloadavg()[0]
    print(f"slab of {size / MIB:.2f} MiB ({size // PAGE} pages), {os.cpu_count()} CPUs, "
          f"load average {load:.1f}; medians of {len(rounds)}")
    width = max(len(name) for name in rounds[0])
    for name in rounds[0]:
        seconds = statistics.median(r[name][0] for r in rounds)
        faults = statistics.median(r[name][1] for r in rounds)
        print(f"{name:<{width}}  {seconds * 1e3:7.1f} ms  {faults:7.0f} faults")
    return 0


if __name__ == "__main__":
    sys.exit(main())
