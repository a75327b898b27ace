"""Where a worker (or the main process, without workers) times its own stages.

A :class:`StageClock` belongs to the one thread that fetches and collates: no locks. It keeps
running totals; it times about one task in ``SAMPLE_EVERY`` (after all of the first
``TIME_ALL_FIRST``), and that task's report carries :meth:`StageClock.snapshot`, a plain tuple
of the totals (a few dozen bytes to pickle), so the main process keeps only the latest one per
worker and counts the reports that came without (docs/design/stats.md).

Spans for ``torch.profiler`` (``record_function``) are entered only while a profiler runs:
torch keeps a module flag for exactly this cheap check, and entering a span costs tens of
microseconds, more than a tiny batch's whole trip.
"""

from __future__ import annotations

import contextlib
import itertools
import math
import os
import random
import threading
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
        samples: samples it fetched (a batch worker: samples it collated), those of failed
            tasks included (``failed_samples``).
        fetch_s: seconds in the dataset (``__getitem__``, ``__getitems__``, ``__next__``).
        collate_s: seconds in ``collate_fn``.
        send_s: seconds handing results over (pickling, writing to the channel); lags one report,
            as a report cannot carry the time it takes to send itself.
        bytes_out: bytes of tensor data in what it handed over (a failed task hands none over).
        started_at: when the worker's clock started (``time.perf_counter``).
        cpu_s: CPU seconds its thread ran since then.
        queued_s: seconds its thread was ready to run but waited for a CPU (others had them).
            With ``cpu_s``, set beside the busy time, it tells computing (or being crowded out)
            from waiting (I/O, sleep, locks). Both are read from the kernel's scheduler counters
            at most every ``SCHED_READ_EVERY_S`` (sooner early in a worker's life: see
            ``SCHED_LAG_SHARE``), so they may lag a little.
        ray_stage: what its copy of the dataset's Ray queue boundaries measured, as
            :meth:`~pipeload.stats.report.RayStageStats.as_tuple` gives it; () without one.
        start: ``(tasks, fetch_s, collate_s, send_s, bytes_out, cpu_s, queued_s)`` of its
            first tasks, all timed (``TIME_ALL_FIRST``), once they are over; () before. Those
            are measured, not estimated: only the later tasks stand for the untimed ones and
            for those reported since the totals (a cold first task, imports and first page
            faults, would otherwise count dozens of times over).
        failed_samples: of ``samples``, those of tasks that raised: they count as samples (the
            batch they were to make was one of the epoch's), but they moved no tensor, so the
            bytes are scaled by the others.
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
    ray_stage: tuple[float, ...] = ()  # the last three defaulted: totals written before them still read
    start: tuple[float, ...] = ()
    failed_samples: int = 0


SCHED_READ_EVERY_S = 0.1
# ... or sooner, once the unread stretch is this share of the clock's life: a worker that lives
# under SCHED_READ_EVERY_S (short epochs, workers not persistent) read its counters never, and
# a dataset that only computes read "0% on a CPU, 100% waiting (I/O, sleeps, locks)". Its
# reads come at its timed tasks, each at least 1.1 times the life of the last: a few dozen
# at most before SCHED_READ_EVERY_S takes over.
SCHED_LAG_SHARE = 0.1
SCHEDSTAT = "/proc/thread-self/schedstat"  # ns on a CPU, ns waiting for one, timeslices


# In a worker process, the CPU its work takes is the whole process's and its children's, not the
# worker thread's alone: a dataset whose decoder runs threads of its own, or that pipes items
# through a program (ffmpeg, a hashing tool), computes while its thread waits, and read by the
# thread alone it looked like I/O ("try more workers") on CPUs that were all in use.
_WHOLE_PROCESS = [False]


def count_the_whole_process() -> None:
    """This process is a worker: its clocks count every thread's CPU and its children's."""
    _WHOLE_PROCESS[0] = True


def read_sched() -> tuple[float, float]:
    """(seconds on a CPU, seconds waiting for one) of the calling thread; in a worker process
    (``count_the_whole_process``), the seconds on a CPU are those of every thread of the process
    and of the children it has waited for, where that is more."""
    read = _schedstat(SCHEDSTAT)
    on_cpu, queued = read if read is not None else (time.thread_time(), 0.0)  # no counters: CPU time alone
    if _WHOLE_PROCESS[0]:
        times = os.times()
        on_cpu = max(on_cpu, time.process_time() + times.children_user + times.children_system)
    return on_cpu, queued


def _schedstat(path: str) -> tuple[float, float] | None:
    """(seconds on a CPU, seconds waiting for one) from a schedstat file; None if unreadable
    (a thread that ended, or no scheduler counters)."""
    try:
        with open(path, "rb") as file:
            on_cpu, queued, _ = file.read().split()
        return int(on_cpu) / 1e9, int(queued) / 1e9
    except (OSError, ValueError):
        return None


def running_s(workers: list[Any]) -> float:
    """Seconds the workers' threads were on a CPU or ready and queued for one (a crowded
    machine queues computing threads; threads that wait for I/O are in neither), summed."""
    on_cpu, queued = sched_s(workers)
    return on_cpu + queued


def sched_s(workers: list[Any]) -> tuple[float, float]:
    """(seconds on a CPU, seconds ready and queued for one) of the workers' threads, summed.
    ``workers``: process handles (every thread of the process), or thread handles with a
    ``thread_id``. Workers that are gone count nothing."""
    readings = sched_by_worker(workers).values()
    return sum(ran for ran, _ in readings), sum(waited for _, waited in readings)


def sched_by_worker(workers: list[Any]) -> dict[tuple[str, int], tuple[float, float]]:
    """``sched_s`` of each worker apart, keyed ``("thread", id)`` or ``("process", pid)``;
    workers that are gone are left out."""
    readings = {}
    for handle in workers:
        thread_id = getattr(handle, "thread_id", None)
        key = ("thread", thread_id) if thread_id is not None else ("process", handle.pid)
        paths = ([f"/proc/self/task/{thread_id}/schedstat"] if thread_id is not None else
                 [f"{task}/schedstat" for task in _tasks(handle.pid)])
        on_cpu = queued = 0
        found = False
        for path in paths:
            try:
                with open(path, "rb") as file:
                    ran, waited, _ = file.read().split()
                on_cpu += int(ran)
                queued += int(waited)
                found = True
            except (OSError, ValueError):
                pass  # ended meanwhile, or no scheduler counters
        if found:
            readings[key] = (on_cpu / 1e9, queued / 1e9)
    return readings


def _tasks(pid: int | None) -> list[str]:
    try:
        return [f"/proc/{pid}/task/{tid}" for tid in os.listdir(f"/proc/{pid}/task")]
    except (OSError, TypeError):
        return []


def profiling() -> bool:
    """True while a torch profiler records in this process (a module flag: no dispatcher call)."""
    return _torch_profiler._is_profiler_enabled  # torch keeps it for exactly this kind of check


@contextlib.contextmanager
def span(name: str) -> Iterator[None]:
    """A ``record_function`` span named ``name``; call only when :func:`profiling` is True."""
    with torch.autograd.profiler.record_function(name):
        yield


# A worker (or the inline engine) times one task in this many, on average: see StageClock. 64,
# not 32: an untimed task costs next to nothing, so the timed ones (~250 bytecodes each, spread
# over the gap) were a quarter of a tiny batch's stats cost in a worker.
SAMPLE_EVERY = 64
# ... after timing all of its first ones. 16, not 64: workers that are not persistent start
# afresh every epoch, and pay this start each time; a timed task costs a worker ~5 us (timed one
# after another, its code runs hot; a lone one costs ~100 us, see SPACING_S) and the
# main process ~15 us (recording the totals its report carries), so 64 per worker cost ~0.5% of
# the CPU of an epoch of 3,125 tiny batches (bench/RESULTS.md, stop 20). Counts stay exact
# whatever is timed; times of a shorter run are estimated from its timed tasks.
TIME_ALL_FIRST = 16


# ... but no more often than about once per SPACING_S of the owner's own time on its tasks. A
# lone timed task among untimed ones costs a worker process ~100 us of CPU more (its rarely run
# code runs cold; the scheduler counters' read is 20 us), where a tiny task (64 Python ints) is
# ~70 us all told: one in 64 was ~1.5% of such a worker's CPU (bench/RESULTS.md, stop 22;
# python -m bench.stats_parts --serve-times).
# Tasks shorter than SPACING_S / every (~1.6 ms) are timed up to MAX_STRETCH times less often:
# a worker of tiny batches still times several tasks a second. The owner's time per task is
# the median of its latest RECENT timed tasks (a cold first task cannot hold the rate down).
SPACING_S = 0.1
MAX_STRETCH = 16
RECENT = 9


def stretch(every: int, per_task_s: float) -> int:
    """How many times longer than ``every`` the gaps between timed tasks run, for tasks that
    take ``per_task_s`` each: so that timed ones come about once per SPACING_S (1 to
    MAX_STRETCH; always 1 when every task is timed, ``every`` 1, or nothing was measured)."""
    if every <= 1 or per_task_s <= 0.0:
        return 1
    return max(1, min(MAX_STRETCH, int(SPACING_S / (every * per_task_s))))


class RecentTimes:
    """The median of the latest ``RECENT`` timed tasks' times (what ``stretch`` goes by): a
    cold first task (imports, first allocations) or an odd slow one cannot hold the rate down.
    Written only by its owner's thread, at timed tasks."""

    __slots__ = ("_times", "_next")

    def __init__(self) -> None:
        self._times: list[float] = []
        self._next = 0

    def add(self, seconds: float) -> None:
        if len(self._times) < RECENT:
            self._times.append(seconds)
        else:
            self._times[self._next] = seconds
            self._next = (self._next + 1) % RECENT

    def median(self) -> float:
        """0.0 before anything was added."""
        return sorted(self._times)[len(self._times) // 2] if self._times else 0.0



def gaps(every: int) -> Iterator[int]:
    """Tasks from one timed task to the next: 1 to ``2 * every - 1`` in a shuffled, repeating
    order, so they average ``every`` and no periodic pattern of the work (round robin over
    workers, a dataset's period) lines up with the sampling."""
    order = list(range(1, 2 * every)) or [1]
    random.Random(0x5A5A).shuffle(order)
    return itertools.cycle(order)


class StageClock:
    """Running totals of one fetching thread; see the module docstring.

    Every owner (every worker, economic ones included, and the inline engine) times about one
    task in ``every``: the fetcher (``engine/fetch.py``; economic workers count their pieces
    and batches down themselves, ``engine/economic_workers.py``) counts tasks down
    ``left`` and calls :meth:`start_timed` for each of its first ``TIME_ALL_FIRST`` tasks, then
    for about one task in ``every``, which it then times and whose samples it counts; the others cost
    it a subtraction and two comparisons (the countdown, the profiler's flag). ``timing`` says
    whether the task in hand is timed: only its tensor bytes are counted and only its report
    carries the totals (the main process counts the reports that come without,
    ``stats/recorder.py``). :meth:`snapshot` scales the timed tasks' sums to all tasks. Tasks
    and samples are counted exactly: where the sampler tells what the batches hold
    (``untimed_size``), an untimed task's samples are derived and the epoch's last batch
    (``last_timed``), which may be short, is always timed; elsewhere the fetcher adds an
    untimed task's samples to ``untimed_samples`` (one addition). Either way a short last batch
    counts as what it holds in every epoch, however long the run. Numbered clocks go by batch
    numbers instead of a countdown (``next_timed``): the inline engine's, which counts its tasks
    itself (``count_tasks``), and a process worker's, whose tasks the main process counts
    (:meth:`counted_by_receiver`).

    Invariant: only the thread that owns the worker loop (or the inline engine) calls it.
    """

    __slots__ = ("started_at", "samples", "fetch_s", "collate_s", "send_s", "bytes_out", "timing",
                 "failed_samples", "timed_failed_samples",
                 "left", "untimed_samples", "next_timed", "count_tasks", "untimed_size", "last_timed",
                 "_stride", "_counted_by_receiver", "_counted", "_gap", "_timed", "_gaps", "_every",
                 "_busy_seen", "_timed_seen", "_recent", "on_timed",
                 "_sched_at_start", "_sched", "_sched_read_at", "_owner", "_start",
                 "_owner_schedstat", "count_ray_stage", "_ray_stage")

    def __init__(self, every: int = SAMPLE_EVERY) -> None:
        self._owner = threading.get_ident()  # the scheduler counters read are its thread's
        self._owner_schedstat = f"/proc/self/task/{threading.get_native_id()}/schedstat"
        self._sched_at_start = self._sched = read_sched()
        self.started_at = self._sched_read_at = now()
        self.count_ray_stage: Any = None  # () -> tuple: its dataset's Ray boundaries' totals
        self._ray_stage: tuple[float, ...] = ()
        self.samples = 0  # of the timed tasks only (see snapshot)
        self.untimed_samples = 0  # of the others, added by the fetcher
        self.fetch_s = 0.0  # these four: sums over the timed tasks only
        self.collate_s = 0.0
        self.send_s = 0.0
        self.bytes_out = 0
        # Samples of the tasks that raised, all of them and the timed ones: counted as samples,
        # left out of the bytes (see failed()).
        self.failed_samples = 0
        self.timed_failed_samples = 0
        self.timing = False
        self.left = 0  # tasks until the next timed one: the first task is timed
        # Numbered instead (the inline engine, whose batch numbers run 0, 1, 2, ... each epoch):
        # the task numbered ``next_timed`` is timed, and ``count_tasks()`` counts the tasks.
        self.next_timed = 0
        self.count_tasks: Any = None
        # A clock whose batches' sizes the sampler tells (samplers.batch_sizes; numbered, or a
        # classic worker's countdown): an untimed task holds ``untimed_size`` samples and is not
        # counted one by one; the task numbered ``last_timed`` (an epoch's last batch, which may
        # be shorter) is always timed.
        self.untimed_size: int | None = None
        self.last_timed: float = math.inf
        # Numbered, with the tasks counted by whoever receives the reports (a process worker:
        # see counted_by_receiver); ``_stride``: about how many batch numbers apart its tasks are.
        self._stride = 1
        self._counted_by_receiver = False
        self._counted = 0  # tasks up to the latest timed one, that one included
        self._gap = 0
        self._timed = 0
        self._gaps = gaps(every)
        self._every = every
        self._busy_seen = 0.0  # fetch, collate and send seconds as of the latest _next_gap
        self._timed_seen = 0  # timed tasks finished by then
        self._recent = RecentTimes()  # the timed tasks' own times: see SPACING_S
        self._start: tuple[float, ...] = ()  # WorkerTotals.start, set as the first gap opens
        # Called when a task is to be timed: a worker arms the report that carries the totals.
        self.on_timed: Any = None

    def counted_by_receiver(self, stride: int) -> None:
        """Drive this clock by batch numbers, for a worker that gets about one number in
        ``stride`` (a classic process worker among ``stride``), and leave the counting of its
        tasks to the process that receives its reports, which counts them anyway: an untimed
        task then costs one comparison, no countdown. Needs ``untimed_size`` (the untimed tasks'
        samples are derived). :meth:`snapshot` then returns sums that
        :func:`complete_totals` turns into totals, given the task count."""
        self._stride = max(1, stride)
        self._counted_by_receiver = True

    @property
    def numbered(self) -> bool:
        """Whether batch numbers drive this clock (``next_timed``) rather than a countdown."""
        return self.count_tasks is not None or self._counted_by_receiver

    def restart_numbers(self) -> None:
        """A new epoch: its batch numbers start again, and its first task is timed."""
        self.next_timed = 0

    @property
    def tasks(self) -> int:
        """Tasks finished (or failed) so far."""
        if self.count_tasks is not None:
            return self.count_tasks()
        return self._counted - self.left + self._gap

    def count_samples(self, samples: int) -> None:
        """A timed task had ``samples`` samples."""
        self.samples += samples

    def count_untimed(self, samples: int) -> None:
        """An untimed task had ``samples`` samples (on the fetchers' rare paths: their common
        one adds to ``untimed_samples`` itself, or counts nothing when ``untimed_size`` says)."""
        self.untimed_samples += samples - (self.untimed_size or 0)

    def failed(self, samples: int) -> None:
        """The task in hand raised; its ``samples`` (the samples it was to hold, counted already
        as a failed task's are) moved no tensor. Called on the failure's own path, before its
        report: ``timing`` still says whether the task was timed. Without this, the timed tasks'
        bytes a sample, scaled to every sample, counted failed batches as moved (63.8 MiB handed
        to the loop read "moved 92.0 MiB" with every other batch failing)."""
        self.failed_samples += samples
        if self.timing:
            self.timed_failed_samples += samples

    def start_timed(self) -> None:
        """The fetcher's countdown reached this task: time it."""
        self._counted += self._gap - self.left  # this task included (left: 0, -1 at first, or
        # more for an epoch's last batch, timed ahead of its turn)
        self._gap = self.left = self._next_gap(self._timed, self._counted < TIME_ALL_FIRST)
        self._timed += 1
        self.timing = True
        if self.on_timed is not None:
            self.on_timed()

    def uncount(self) -> None:
        """The task in hand, counted down already, built nothing (an iterable replica found
        dry): it is no task. Undone on this rare path, so the common one stays a subtraction.
        Its timing too, if it was timed; the fetcher leaves the seconds spent finding out out of
        the sums (``fetch._traced``). Kept, they were scaled as a timed batch's are (41 batches
        of 1 ms, then 20 ms to end the stream, read 0.56 s of fetching), and a worker beyond
        its shards, whose one task an epoch only started its run over the dataset and found
        nothing, read 30% to 77% busy without building a batch. Countdown clocks only
        (iterable datasets' all are)."""
        # Timed: start_timed has just set ``left`` to the new gap; an untimed task has counted
        # it down since. (``timing`` cannot tell: the inline engine never clears it.)
        if self.left == self._gap:
            self._counted -= 1
            self._timed -= 1
        else:
            self.left += 1

    def start_timed_at(self, number: int) -> None:
        """A numbered clock: task ``number`` reached ``next_timed``: time it (see start_timed)."""
        self._timed += 1
        starting = self._timed < TIME_ALL_FIRST
        gap = self._next_gap(self._timed - 1, starting)
        upcoming = number + (1 if starting else gap * self._stride)
        last = self.last_timed
        self.next_timed = last if number < last < upcoming else upcoming  # type: ignore[assignment]
        self.timing = True
        if self.on_timed is not None:
            self.on_timed()

    def _next_gap(self, finished: int, starting: bool) -> int:
        """Tasks to the next timed one: 1 while ``starting`` (all of the first TIME_ALL_FIRST
        are timed), then from ``gaps``, stretched for short tasks (``SPACING_S``). ``finished``
        timed tasks have added their fetch, collate and (a report behind) send seconds to the
        sums."""
        busy = self.fetch_s + self.collate_s + self.send_s
        if finished > self._timed_seen:
            self._recent.add((busy - self._busy_seen) / (finished - self._timed_seen))
            self._busy_seen, self._timed_seen = busy, finished
        if starting:
            return 1
        if not self._start:  # the first tasks, all timed, are over: measured, kept apart
            # Read now (this is the owner's thread), and kept as the latest reading too: a
            # later snapshot must never carry older counters than the first tasks' own.
            self._sched, self._sched_read_at = read_sched(), now()
            on_cpu, queued = self._sched
            self._start = (finished, self.fetch_s, self.collate_s, self.send_s, self.bytes_out,
                           on_cpu - self._sched_at_start[0], queued - self._sched_at_start[1])
        return next(self._gaps) * stretch(self._every, self._recent.median())

    def snapshot(self) -> tuple[Any, ...]:
        """The totals as a plain tuple, in :class:`WorkerTotals`' order; a clock whose tasks the
        receiver counts returns the sums :func:`complete_totals` takes instead."""
        at = now()
        # Another thread reads a lent clock (stats/recorder.py), whose owner never takes a
        # snapshot: it reads the owner's counters by its thread id (kept as they were once the
        # thread has ended).
        unread_s = at - self._sched_read_at
        # Past its first tasks a clock is snapshot once a timed task (rarely), and the stages'
        # seconds since its first tasks stand for every task after them (estimated_stages): the
        # counters must cover the same tasks, or an epoch left before the next timed task read
        # its CPU seconds still where the first tasks left them (24% "waiting inside the work"
        # for a dataset that only computes).
        if (unread_s >= SCHED_READ_EVERY_S or unread_s >= SCHED_LAG_SHARE * (at - self.started_at)
                or self._start):
            read = read_sched() if threading.get_ident() == self._owner else _schedstat(self._owner_schedstat)
            if read is not None:
                self._sched, self._sched_read_at = read, at
        if self.count_ray_stage is not None:  # only graphs with a Ray boundary
            self._ray_stage = self.count_ray_stage()
        sums = (self._timed, self.samples + self.untimed_samples, self.fetch_s, self.collate_s,
                self.send_s, self.bytes_out, self.started_at,
                self._sched[0] - self._sched_at_start[0], self._sched[1] - self._sched_at_start[1],
                self._ray_stage, self._start, self.failed_samples, self.untimed_size or 0, self.samples,
                self.timed_failed_samples)
        return sums if self._counted_by_receiver else complete_totals(sums, self.tasks)

    def read_sched_now(self) -> None:
        """The owning thread is about to end: read its scheduler counters while they exist (a
        lent clock is read by another thread, through the thread's file, gone once it ended)."""
        self._sched, self._sched_read_at = read_sched(), now()

    @property
    def ray_stage(self) -> tuple[float, ...]:
        """Its dataset's Ray boundaries' totals, as last read."""
        return self._ray_stage

    def stop_counting_ray_stage(self) -> None:
        """Its owner is done with the dataset (the inline engine's epoch ended): keep what the
        Ray boundaries measured so far. The main process's dataset goes on counting for later
        epochs' clocks, which this one, still read live, must not count too."""
        if self.count_ray_stage is not None:
            self._ray_stage = self.count_ray_stage()
            self.count_ray_stage = None

    def finished(self, result: Any = None) -> tuple[Any, ...]:
        """The task in hand is done and its report carries the totals (returned): see
        :meth:`done`."""
        self.done(result)
        return self.snapshot()

    def done(self, result: Any = None) -> None:
        """The task in hand is done: count its tensor bytes (``result``: the batch, if any)
        when it was timed. (A lent clock's report carries no totals: it need not take a
        snapshot.)"""
        if self.timing and result is not None:
            self.bytes_out += tensor_bytes(result)
        self.timing = False

    def unsent(self, result: Any) -> None:
        """The report of the timed task just ``done``, whose result was ``result``, could not be
        sent (a batch that cannot be pickled): it moved no tensor after all. Its bytes are taken
        back, and it is timed again as far as ``failed``, which comes next, is concerned
        (counted, they were scaled to every sample: 1.2 MiB received read "moved 5.7 MiB")."""
        self.bytes_out -= tensor_bytes(result)
        self.timing = True

    def sent(self, started: float) -> None:
        """The report that carried the last totals took from ``started`` until now to send."""
        self.send_s += now() - started


SUMS_LENGTH = len(WorkerTotals._fields) + 3  # what StageClock.snapshot gives before completion


def complete_totals(sums: tuple[Any, ...], tasks: int) -> tuple[Any, ...]:
    """A clock's sums over its timed tasks (see :meth:`StageClock.snapshot`), made totals over
    all ``tasks``: the stage times and bytes estimated (see :func:`estimated_stages`), the
    untimed tasks' samples derived (each holds ``untimed_size``; a clock without one counted
    them into ``samples``). Bytes go with samples, not tasks: the timed tasks' bytes a sample
    (``timed_samples``: theirs), times all samples. Scaled by tasks, pieces of other sizes than
    the timed ones (economic mode cuts pieces as the workers' pace allows) were counted wrong.
    Failed tasks' samples (``failed_samples``, all; ``timed_failed``, the timed ones') are left
    out of both: they moved nothing."""
    (timed, samples, fetch_s, collate_s, send_s, bytes_out, *kept, start, failed_samples, untimed_size,
     timed_samples, timed_failed) = sums
    fetch_s, collate_s, send_s, estimated_bytes = estimated_stages(
        (fetch_s, collate_s, send_s, bytes_out), start, timed, tasks)
    samples += (tasks - timed) * untimed_size
    if timed_samples:
        estimated_bytes = bytes_moved_by(bytes_out, timed_samples - timed_failed, samples - failed_samples)
    return (tasks, samples, fetch_s, collate_s, send_s, round(estimated_bytes), *kept, start, failed_samples)


def bytes_moved_by(measured: float, measured_samples: int, samples: int) -> float:
    """The bytes of ``samples`` samples that made batches, at the bytes a sample of the
    ``measured_samples`` that ``measured`` bytes came with (all of them, where none was
    measured: none of the timed ones made a batch)."""
    return measured * samples / measured_samples if measured_samples > 0 else measured


def estimated_stages(stages: tuple[float, ...], start: tuple[float, ...], timed: int,
                     tasks: int) -> tuple[float, ...]:
    """``stages`` (fetch, collate and send seconds, bytes out, ...), summed over ``timed``
    tasks, brought to ``tasks``: the first tasks' (``start``: their count, then their sums in
    the same order, see ``WorkerTotals``) as measured, the later timed ones standing for the
    others. Before the first tasks are over (or without a later timed task) all timed tasks
    stand for the others alike."""
    if start and timed > start[0]:
        first = start[0]
        scale = (tasks - first) / (timed - first)
        return tuple(before + (total - before) * scale for total, before in zip(stages, start[1:]))
    scale = tasks / timed if timed else 1.0
    return tuple(total * scale for total in stages)


def tensor_bytes(batch: Any, depth: int = 0) -> int:
    """Bytes of tensor data in ``batch`` (tensors inside lists, tuples and dicts, a few levels
    deep); other objects count nothing."""
    if isinstance(batch, torch.Tensor):
        try:
            return batch.nbytes
        except RuntimeError:  # sparse and nested tensors have no one byte count: not counted
            return 0
    if depth > 3:
        return 0
    if isinstance(batch, (list, tuple)):
        return sum(tensor_bytes(item, depth + 1) for item in batch) if len(batch) <= MAX_ITEMS_WALKED else 0
    if isinstance(batch, dict) and len(batch) <= MAX_ITEMS_WALKED:
        return sum(tensor_bytes(item, depth + 1) for item in batch.values())
    return 0
