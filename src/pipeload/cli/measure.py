"""Timing one pass of a loader, with the memory peaks it reaches, for ``pipeload bench``.

A sampler process of its own (sampler.py: a thread here would slow the main process it measures)
reads, every ``SAMPLE_INTERVAL_S``, the resident memory of this process and all its descendants
(RSS summed over the tree: pages shared between processes count once per process, an upper bound
that is fair between loaders measured alike) and, every ``TREE_SHM_EVERY`` samples, the
shared-memory segments the tree maps or holds open, each counted once (tree_memory.py). The source
checkout's ``bench/measure.py`` goes further (PSS, the kernel's ``Shmem`` count) on the same
readings, which it takes from here.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

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
