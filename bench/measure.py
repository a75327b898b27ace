"""Timing one loader over one workload, and the memory peaks it reaches while doing so.

A :class:`PeakSampler` has the command's sampler process (``pipeload.cli.sampler``: a thread here
would hold the measured main process's GIL while it parses ``/proc``, slowing loaders with more
processes more) add up, every ``SAMPLE_INTERVAL_S``, the resident memory of this process and all
its descendants (the loader's workers) and read how much of ``/dev/shm`` is in use.
:func:`measure` builds a fresh loader, iterates it, and returns a :class:`Measurement`.

What the numbers mean:
  * RSS of the tree counts a page once per process that maps it, so memory shared between the
    main process and its workers (fork's copy-on-write pages, shared-memory batches) is counted
    more than once. It is an upper bound, and fair between loaders measured the same way.
  * ``/dev/shm`` use is read from the file system (``shutil.disk_usage``), so segments that were
    unlinked but are still mapped count too. It covers the whole machine: other programs writing
    there during a run show up as noise.
  * shared memory, honestly (see memory.py): the growth of the kernel's ``Shmem`` count (memfd
    segments included), and the distinct segments the loader's process tree maps or holds; the
    latter is read every ``TREE_SHM_EVERY`` samples, as reading every process's mappings costs
    a few milliseconds each; the tree's proportional set size (PSS), which counts a page
    shared by n processes once in all where the RSS sum counts it n times, every ``PSS_EVERY``;
    and, as often, the tree's memory with every page once whether mapped or not (PSS without
    shared memory, plus the tree's segments whole: see ``memory.tree_memory_bytes``).
"""

from __future__ import annotations

import gc
import os
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import Any

import psutil

from bench.memory import machine_shmem_bytes, memory_bytes_of, pss_bytes_of
# The readings `pipeload bench` takes too, from the package (bench/ builds on it, not the reverse).
from pipeload.cli.measure import (
    child_pids,
    read_every_page,
    rss_bytes_of,
    shared_memory_bytes_of,
    shm_used_bytes,
    wait_for_workers_gone,
)
from pipeload.cli.sampler import Window, shared_sampler
from pipeload.cli.tree_memory import tree_pids_by_proc

TREE_SHM_EVERY = 2  # often enough to see a batch that lives for a 200 ms training step
PSS_EVERY = 10
FULL_READINGS = "bench.measure:FullReadings"


@dataclass(frozen=True)
class Measurement:
    """One loader's run over one workload."""

    workload: str
    loader: str
    samples: int
    total_s: float
    first_batch_s: float
    peak_rss_bytes: int
    peak_shm_bytes: int
    peak_shmem_bytes: int = 0  # growth of the kernel's Shmem (memfd included), machine-wide
    peak_tree_shm_bytes: int = 0  # distinct segments the loader's process tree maps or holds
    peak_pss_bytes: int = 0  # proportional set size of the tree (shared pages split, not repeated)
    peak_tree_memory_bytes: int = 0  # PSS without shared memory, plus the tree's segments whole
    cpu_s: float = 0.0  # CPU seconds of the tree (workers reaped by then), the sampler left out

    @property
    def cpu_us_per_sample(self) -> float:
        return self.cpu_s / self.samples * 1e6 if self.samples else 0.0

    @property
    def samples_per_s(self) -> float:
        return self.samples / self.total_s if self.total_s > 0 else float("inf")


class FullReadings:
    """What the benchmarks read of the tree, in the sampler process (see pipeload.cli.sampler):
    growths are counted from the window's start."""

    def __init__(self, root: psutil.Process, sampler_pid: int) -> None:
        self._root_pid, self._sampler_pid = root.pid, sampler_pid
        self._shm_baseline = shm_used_bytes()
        self._shmem_baseline = machine_shmem_bytes()

    def take(self, tick: int) -> dict[str, int]:
        pids = tree_pids_by_proc(self._root_pid, self._sampler_pid)
        reading = {"rss": rss_bytes_of(pids), "shm": shm_used_bytes() - self._shm_baseline,
                   "shmem": machine_shmem_bytes() - self._shmem_baseline}
        if tick % TREE_SHM_EVERY == 0:
            reading["tree_shm"] = shared_memory_bytes_of(pids)
        if tick % PSS_EVERY == 0:
            reading["pss"] = pss_bytes_of(pids)
            reading["tree_memory"] = memory_bytes_of(pids)
        return reading


class PeakSampler(Window):
    """The peaks of the process tree's memory while open (read after ``close()``), taken by the
    command's sampler process (pipeload.cli.sampler.Window), started on first use (before the
    caller's clock starts when it is made first) and reused by every window after it.

    Example:
        >>> with PeakSampler() as sampler:
        ...     data = bytearray(10**7)
        >>> sampler.peak_rss_bytes > 0
        True
    """

    def __init__(self) -> None:
        super().__init__(FULL_READINGS)

    @property
    def peak_rss_bytes(self) -> int:
        return self.peaks.get("rss", 0)

    @property
    def peak_shm_bytes(self) -> int:
        return self.peaks.get("shm", 0)

    @property
    def peak_shmem_bytes(self) -> int:
        return self.peaks.get("shmem", 0)

    @property
    def peak_tree_shm_bytes(self) -> int:
        return self.peaks.get("tree_shm", 0)

    @property
    def peak_pss_bytes(self) -> int:
        return self.peaks.get("pss", 0)

    @property
    def peak_tree_memory_bytes(self) -> int:
        return self.peaks.get("tree_memory", 0)


def start_sampler() -> None:
    """Start the command's sampler process now (it imports torch: ~2 s), before anything is
    timed or any child process is counted."""
    shared_sampler(FULL_READINGS)


def measure(
    make_loader: Callable[[], Iterable[Any]],
    count_samples: Callable[[Any], int],
    *,
    workload: str,
    loader: str,
    epochs: int = 1,
    step: Callable[[Any], None] | None = None,
) -> Measurement:
    """Build a fresh loader, iterate it ``epochs`` times, and time it.

    The clock starts before the loader is built, so ``first_batch_s`` includes construction and
    worker start-up; every batch is read (one byte of each 4 KiB page); ``total_s`` ends once the
    loader is dropped and its worker processes have exited (torch joins them as an epoch ends,
    pipeload's leave beside the loop: either way a script pays before its next loader), so one
    measurement does not spill into the next.

    Args:
        make_loader: returns a new loader each call.
        count_samples: how many samples a batch holds.
        workload, loader: names recorded in the result.
        epochs: passes over the loader.
        step: the "training step" run on every batch (a slow loop sleeps here); None: none.

    Returns:
        The measurement.

    Raises:
        RuntimeError: if the loader yielded no batch at all.
    """
    start_sampler()  # first: a child of this process that outlives the measurement
    children_before = child_pids()
    cpu_before = _tree_cpu_s()
    with PeakSampler() as sampler:
        samples, first_batch_s, total_s = _iterate(make_loader, count_samples, epochs, step)
        gc.collect()  # drop the loader and any iterator cycles while still sampling
        wait_for_workers_gone(children_before)
    # The sampler process is not reaped until the command ends: its CPU is not in the tree's.
    cpu_s = _tree_cpu_s() - cpu_before
    if first_batch_s is None:
        raise RuntimeError(f"loader {loader!r} yielded no batch for workload {workload!r}")
    return Measurement(workload, loader, samples, total_s, first_batch_s,
                       sampler.peak_rss_bytes, sampler.peak_shm_bytes, sampler.peak_shmem_bytes,
                       sampler.peak_tree_shm_bytes, sampler.peak_pss_bytes,
                       sampler.peak_tree_memory_bytes, cpu_s)


def _tree_cpu_s() -> float:
    """CPU seconds of this process and of its children that have been waited for (both loaders
    join their workers when an epoch ends). On a shared machine this, unlike wall time, does not
    depend on how much of the CPUs other programs took."""
    times = os.times()
    return times.user + times.system + times.children_user + times.children_system


def warm_up(make_loader: Callable[[], Iterable[Any]], batches: int) -> None:
    """Take a few batches from a fresh loader, untimed, then drop it and await its workers.

    Pays for imports, worker start-up paths, allocators and file caches before anything is timed.
    """
    start_sampler()
    children_before = child_pids()
    iterator = iter(make_loader())
    for _ in zip(range(batches), iterator):
        pass
    del iterator
    gc.collect()
    wait_for_workers_gone(children_before)


def _iterate(
    make_loader: Callable[[], Iterable[Any]], count_samples: Callable[[Any], int], epochs: int,
    step: Callable[[Any], None] | None = None,
) -> tuple[int, float | None, float]:
    """Samples, first-batch and total seconds of ``epochs`` passes over a new loader, each batch
    read (one byte of each 4 KiB page, as a copy would read them all: a loop that reads nothing
    flatters batches in shared memory). The clock stops once the loader is dropped and its workers have exited:
    torch joins them as each epoch ends, pipeload's leave beside the loop."""
    samples = 0
    first_batch_s = None
    children_before = child_pids()
    started = time.perf_counter()
    loader = make_loader()
    batch = None
    for _ in range(epochs):
        for batch in loader:
            if first_batch_s is None:
                first_batch_s = time.perf_counter() - started
            samples += count_samples(batch)
            read_every_page(batch)
            if step is not None:
                step(batch)
    del batch, loader
    wait_for_workers_gone(children_before)
    return samples, first_batch_s, time.perf_counter() - started
