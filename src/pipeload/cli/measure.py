"""Timing one pass of a loader, with the memory peaks it reaches, for ``pipeload bench``.

The pass reads every batch (one byte of each 4 KiB page, as a training step's copy would) and is
timed until the loader is dropped and its worker processes have exited, so that a loader whose
workers leave beside the loop pays for them as one that joins them does (``time_one_pass``).

A sampler process of its own (sampler.py: a thread here would slow the main process it measures)
reads, every ``SAMPLE_INTERVAL_S``, the resident memory of this process and all its descendants
(RSS summed over the tree: pages shared between processes count once per process, an upper bound
that is fair between loaders measured alike) and, every ``TREE_SHM_EVERY`` samples, the
shared-memory segments the tree maps or holds open, each counted once (tree_memory.py). The source
checkout's ``bench/measure.py`` goes further (PSS, the kernel's ``Shmem`` count) on the same
readings, which it takes from here.
"""

from __future__ import annotations

import os
import sys
import time
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch

from pipeload.cli.sampler import Window

# The readings themselves live in tree_memory.py (the sampler process loads that file alone);
# bench/ and the tests take them from here.
from pipeload.cli.tree_memory import (  # noqa: F401  (re-exported)
    SAMPLE_INTERVAL_S,
    TREE_SHM_EVERY,
    BasicReadings,
    _shared_mappings,
    rss_bytes_of,
    shared_memory_bytes_of,
    shm_used_bytes,
    tree_pids,
    tree_rss_bytes,
    tree_shared_memory_bytes,
)

# Loaded by path in the sampler process: see sampler.py.
BASIC_READINGS = f"{Path(__file__).with_name('tree_memory.py')}:BasicReadings"


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


class PeakSampler(Window):
    """A window on the peak RSS of this process's tree and the peak of its shared memory, read
    by the command's sampler process (started on first use, before the clock starts); its
    ``peaks`` hold ``rss`` and ``shm`` once closed."""

    def __init__(self) -> None:
        import psutil  # noqa: F401  (the `bench` extra: missing, the command says what to install)

        super().__init__(BASIC_READINGS)
        self.peaks.update(rss=0, shm=0)


PAGE_BYTES = 4096
CHILD_EXIT_POLL_S = 0.005  # a pass's time is known to this much (listing /proc costs CPU)
CHILD_EXIT_WAIT_S = 10.0


def read_every_page(batch: Any) -> float:
    """Read one byte of each 4 KiB page of every tensor in ``batch`` (in lists, tuples and dicts), as
    a training step's copy would read them all: a loop that reads nothing of its batches flatters
    a loader whose batches arrive in shared memory, which only a read maps into the process."""
    if isinstance(batch, torch.Tensor):
        if batch.layout is not torch.strided or batch.is_nested or batch.numel() == 0:
            return 0.0
        if batch.is_quantized:
            batch = batch.int_repr()
        # One byte a page, whatever the dtype (float8 and others have no sum); a view that is
        # not contiguous is copied first (none of the benchmarks' loaders yields one).
        data = batch.contiguous().reshape(-1).view(torch.uint8)
        return float(data[::PAGE_BYTES].sum())
    if isinstance(batch, np.ndarray):
        return read_every_page(torch.from_numpy(np.ascontiguousarray(batch)))
    if isinstance(batch, (list, tuple)):
        return sum(read_every_page(item) for item in batch)
    if isinstance(batch, Mapping):
        return sum(read_every_page(item) for item in batch.values())
    return 0.0


def time_one_pass(name: str, repeat: int, make_loader: Callable[[], Iterable[Any]],
                  batch_length: Callable[[Any], int], on_batch: Callable[[], None]) -> Run:
    """Make a loader and iterate it once, reading every batch, sampling memory.

    The clock runs from ``iter()`` until the loader is dropped and its worker processes have
    exited: torch joins its workers as the pass ends, pipeload's leave beside the loop, and a
    script pays for both before its next loader (or its end)."""
    samples = 0
    first_batch_s = 0.0
    with PeakSampler() as sampler:
        children_before = child_pids()
        loader = make_loader()
        batch = None
        started = time.perf_counter()
        for batch in loader:
            if samples == 0:
                first_batch_s = time.perf_counter() - started
            samples += batch_length(batch)
            read_every_page(batch)
            on_batch()
        del batch, loader
        wait_for_workers_gone(children_before)
        seconds = time.perf_counter() - started
    return Run(name, repeat, samples, seconds, first_batch_s, sampler.peaks["rss"], sampler.peaks["shm"])


def child_pids() -> set[int]:
    import psutil  # the `bench` extra

    return {child.pid for child in psutil.Process().children(recursive=True)}


def wait_for_workers_gone(children_before: set[int]) -> None:
    """Wait until the processes started since ``children_before`` have exited (multiprocessing's
    resource tracker and fork server, which stay, excepted; the fork server's own children, the
    workers it forked, included). Says so on stderr if some are still running after
    ``CHILD_EXIT_WAIT_S``."""
    import psutil  # the `bench` extra

    deadline = time.monotonic() + CHILD_EXIT_WAIT_S
    while True:
        started = [child for child in psutil.Process().children(recursive=True)
                   if child.pid not in children_before and not _is_helper(child)]
        running = [child.pid for child in started if _is_running(child)]
        if not running:
            return
        if time.monotonic() >= deadline:
            print(f"warning: worker processes {running} still running {CHILD_EXIT_WAIT_S:.0f} s after "
                  "their loader was dropped; the pass is timed without them", file=sys.stderr)
            return
        time.sleep(CHILD_EXIT_POLL_S)


def _is_helper(child: Any) -> bool:
    """multiprocessing's resource tracker or fork server: started by this process, and staying.
    The fork server's workers carry its command line too, but are its children, not ours."""
    try:
        if child.ppid() != os.getpid():
            return False
        return any("resource_tracker" in part or "forkserver" in part for part in child.cmdline())
    except Exception:  # gone meanwhile
        return True


def _is_running(child: Any) -> bool:
    import psutil  # the `bench` extra

    try:
        return child.status() != psutil.STATUS_ZOMBIE
    except psutil.Error:
        return False
