"""Where a worker (or the main process, without workers) times its own stages.

A :class:`StageClock` belongs to the one thread that fetches and collates: no locks. It keeps
running totals, and every report a worker sends carries :meth:`StageClock.snapshot`, a plain
tuple of those totals (a few dozen bytes to pickle), so the main process only ever keeps the
latest one per worker and a lost or reordered report cannot make a count wrong.

Spans for ``torch.profiler`` (``record_function``) are entered only while a profiler runs:
torch keeps a module flag for exactly this cheap check, and entering a span costs tens of
microseconds, more than a tiny batch's whole trip.
"""

from __future__ import annotations

import contextlib
import itertools
import random
import time
from collections.abc import Iterator
from typing import Any, NamedTuple

import torch
import torch.autograd.profiler as _torch_profiler

MAX_ITEMS_WALKED = 256  # a bigger container is not a batch's structure: counting it would cost
now = time.perf_counter  # CLOCK_MONOTONIC on Linux: comparable between processes of one machine


class WorkerTotals(NamedTuple):
    """One worker's running totals, as its reports carry them (as a plain tuple: a named one
    costs several microseconds more to pickle, a visible share of a tiny batch's trip).

    Attributes:
        tasks: batches (or economic pieces) it has finished, failed ones included.
        samples: samples it fetched (a batch worker: samples it collated).
        fetch_s: seconds in the dataset (``__getitem__``, ``__getitems__``, ``__next__``).
        collate_s: seconds in ``collate_fn``.
        send_s: seconds handing results over (pickling, writing to the channel); lags one report,
            as a report cannot carry the time it takes to send itself.
        bytes_out: bytes of tensor data in what it handed over.
        started_at: when the worker's clock started (``time.perf_counter``).
        cpu_s: CPU seconds its thread ran since then.
        queued_s: seconds its thread was ready to run but waited for a CPU (others had them).
            With ``cpu_s``, set beside the busy time, it tells computing (or being crowded out)
            from waiting (I/O, sleep, locks). Both are read from the kernel's scheduler counters
            at most every ``SCHED_READ_EVERY_S``, so they may lag a little.
        skipped: samples its copy of the dataset's on_error pipes skipped.
    """

    tasks: int
    samples: int
    fetch_s: float
    collate_s: float
    send_s: float
    bytes_out: int
    started_at: float
    cpu_s: float
    queued_s: float
    skipped: int


SCHED_READ_EVERY_S = 0.1
SCHEDSTAT = "/proc/thread-self/schedstat"  # ns on a CPU, ns waiting for one, timeslices


def read_sched() -> tuple[float, float]:
    """(seconds on a CPU, seconds waiting for one) of the calling thread."""
    try:
        with open(SCHEDSTAT, "rb") as file:
            on_cpu, queued, _ = file.read().split()
        return int(on_cpu) / 1e9, int(queued) / 1e9
    except (OSError, ValueError):
        return time.thread_time(), 0.0  # no scheduler counters: CPU time alone


def profiling() -> bool:
    """True while a torch profiler records in this process (a module flag: no dispatcher call)."""
    return _torch_profiler._is_profiler_enabled  # torch keeps it for exactly this kind of check


@contextlib.contextmanager
def span(name: str) -> Iterator[None]:
    """A ``record_function`` span named ``name``; call only when :func:`profiling` is True."""
    with torch.autograd.profiler.record_function(name):
        yield


SAMPLE_EVERY = 8  # a worker times one task in this many, on average: see StageClock


def gaps(every: int) -> Iterator[int]:
    """Tasks from one timed task to the next: 1 to ``2 * every - 1`` in a shuffled, repeating
    order, so they average ``every`` and no periodic pattern of the work (round robin over
    workers, a dataset's period) lines up with the sampling."""
    order = list(range(1, 2 * every))
    random.Random(0x5A5A).shuffle(order)
    return itertools.cycle(order)


class StageClock:
    """Running totals of one fetching thread; see the module docstring.

    With ``every=1`` every task is timed and every report carries the totals. With ``every=N``
    (classic workers, the inline engine) one task in N on average is: ``timing`` says whether
    the task in hand is, the fetcher reads it (one attribute) and times the dataset and
    ``collate_fn`` only then, only such a task's tensor bytes are counted and only its report
    carries the totals. :meth:`snapshot` scales the timed tasks' sums to all tasks. Counts
    (tasks, samples) are exact; the main process counts the reports that came without totals
    (``stats/recorder.py``), so nothing is lost at the end of an epoch.

    Invariant: only the thread that owns the worker loop (or the inline engine) calls it.
    """

    __slots__ = ("started_at", "tasks", "samples", "fetch_s", "collate_s", "send_s", "bytes_out",
                 "timing", "timed", "_gaps", "_left", "_sched_at_start", "_sched",
                 "_sched_read_at", "count_skipped", "_skipped")

    def __init__(self, every: int = 1) -> None:
        self._sched_at_start = self._sched = read_sched()
        self.started_at = self._sched_read_at = now()
        self.count_skipped: Any = None  # () -> int: the on_error skips of this worker's dataset
        self._skipped = 0
        self.tasks = 0
        self.samples = 0
        self.fetch_s = 0.0  # these four: sums over the timed tasks only
        self.collate_s = 0.0
        self.send_s = 0.0
        self.bytes_out = 0
        self.timing = True  # the first task is always timed
        self.timed = 0
        self._gaps = gaps(every) if every > 1 else None
        self._left = 0

    def snapshot(self) -> tuple[Any, ...]:
        """The totals as a plain tuple, in :class:`WorkerTotals`' order."""
        at = now()
        if at - self._sched_read_at >= SCHED_READ_EVERY_S:
            self._sched, self._sched_read_at = read_sched(), at
        if self.count_skipped is not None:  # only graphs with on_error pipes: exact, not sampled
            self._skipped = self.count_skipped()
        scale = self.tasks / self.timed if self._gaps is not None and self.timed else 1.0
        return (self.tasks, self.samples, self.fetch_s * scale, self.collate_s * scale,
                self.send_s * scale, round(self.bytes_out * scale), self.started_at,
                self._sched[0] - self._sched_at_start[0], self._sched[1] - self._sched_at_start[1],
                self._skipped)

    def task_done(self, result: Any = None, report_anyway: bool = False) -> bool:
        """Count a finished task (and, if it was timed, the tensor bytes of ``result``); True
        when its report should carry the totals: it was timed, or ``report_anyway``."""
        self.tasks += 1
        if not self.timing:  # the usual case, kept to a few steps
            self._left -= 1
            if self._left <= 0:
                self.timing = True
            return report_anyway
        self.timed += 1
        if result is not None:
            self.bytes_out += tensor_bytes(result)
        if self._gaps is not None:
            self._left = next(self._gaps) - 1
            self.timing = self._left <= 0
        return True

    def finished(self, result: Any = None) -> tuple[Any, ...]:
        """Count a finished task (see :meth:`task_done`); returns the totals, whether or not its
        report would carry them (economic mode's workers time every task and always send)."""
        self.task_done(result)
        return self.snapshot()

    def sent(self, started: float) -> None:
        """The report that carried the last totals took from ``started`` until now to send."""
        self.send_s += now() - started


def tensor_bytes(batch: Any, depth: int = 0) -> int:
    """Bytes of tensor data in ``batch`` (tensors inside lists, tuples and dicts, a few levels
    deep); other objects count nothing."""
    if isinstance(batch, torch.Tensor):
        return batch.nbytes
    if depth > 3:
        return 0
    if isinstance(batch, (list, tuple)):
        return sum(tensor_bytes(item, depth + 1) for item in batch) if len(batch) <= MAX_ITEMS_WALKED else 0
    if isinstance(batch, dict) and len(batch) <= MAX_ITEMS_WALKED:
        return sum(tensor_bytes(item, depth + 1) for item in batch.values())
    return 0
