"""Timing one pass of a loader, with the memory peaks it reaches, for ``pipeload bench``.

A background thread samples, every ``SAMPLE_INTERVAL_S``, the resident memory of this process
and all its descendants (RSS summed over the tree: pages shared between processes count once
per process, an upper bound that is fair between loaders measured alike) and how much of
``/dev/shm`` is in use (machine-wide: others writing there show up as noise). The source
checkout's ``bench/measure.py`` goes further (PSS, memfd segments) on the same readings, which
it takes from here.
"""

from __future__ import annotations

import os
import shutil
import threading
import time
import weakref
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import Any

SAMPLE_INTERVAL_S = 0.05
SHM_PATH = "/dev/shm"


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


class PeakSampler:
    """Keeps the peak RSS of the process tree and the peak growth of /dev/shm while open.

    Invariant: only the sampling thread writes ``peaks`` until ``close()`` has joined it.
    """

    def __init__(self) -> None:
        import psutil  # the `bench` extra

        self.peaks = {"rss": 0, "shm": 0}
        self._stop = threading.Event()
        baseline = shm_used_bytes()
        self._thread = threading.Thread(target=_sample, name="pipeload-bench-sampler", daemon=True,
                                        args=(psutil.Process(os.getpid()), baseline, self.peaks,
                                              self._stop))
        self._thread.start()
        self._finalizer = weakref.finalize(self, self._stop.set)

    def close(self) -> None:
        self._stop.set()
        self._thread.join()

    def __enter__(self) -> PeakSampler:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def _sample(root: Any, shm_baseline: int, peaks: dict[str, int], stop: threading.Event) -> None:
    while True:
        peaks["rss"] = max(peaks["rss"], tree_rss_bytes(root))
        peaks["shm"] = max(peaks["shm"], shm_used_bytes() - shm_baseline)
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
    return Run(name, repeat, samples, seconds, first_batch_s, sampler.peaks["rss"],
               max(0, sampler.peaks["shm"]))
