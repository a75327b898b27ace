"""A worker's clock (stats/clock.py) driven by the fetcher (engine/fetch.py) as a worker drives
it: which tasks are timed, and that tasks and samples are counted exactly all the same."""

from __future__ import annotations

import time
from typing import Any

import pytest

from pipeload.engine.fetch import DatasetExhausted, IterableFetcher, MapFetcher
from pipeload.engine.plan import DatasetKind, FetchSpec
import pipeload.engine.fetch as fetch_module
import pipeload.stats.clock as clock_module
from pipeload.stats.clock import (MAX_STRETCH, SAMPLE_EVERY, SPACING_S, TIME_ALL_FIRST, RecentTimes, StageClock,
                                  WorkerTotals, stretch)


def _worker_run(batch_sizes: list[int], epoch_batches: int = 10**9,
                untimed_size: int | None = None) -> tuple[StageClock, int]:
    """Fetch one batch of each size, as a worker's loop does (batch numbers start again every
    ``epoch_batches``; ``untimed_size``: what the sampler says a batch holds, the last one of an
    epoch excepted); returns the clock and how many of the batches it timed."""
    spec = FetchSpec(list(range(max(batch_sizes))), DatasetKind.MAP, True, list, False)
    clock = StageClock(SAMPLE_EVERY)
    if untimed_size is not None:
        clock.untimed_size, clock.last_timed = untimed_size, epoch_batches - 1
    fetcher = MapFetcher(spec, clock)
    timed = 0
    for task, size in enumerate(batch_sizes):
        number = task % epoch_batches
        batch = fetcher.fetch(list(range(size)), number)
        if clock.timing:  # the worker's report carries the totals only then
            timed += 1
            clock.finished(batch)
        else:
            clock.done(batch)
    return clock, timed


def test_a_worker_times_all_its_first_tasks_then_about_one_in_sample_every(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(clock_module, "SPACING_S", 0.0)  # as tasks long enough not to be stretched
    steady = 2 * SAMPLE_EVERY - 1  # one whole cycle of the shuffled gaps, which average SAMPLE_EVERY
    clock, timed = _worker_run([4] * (TIME_ALL_FIRST + steady * SAMPLE_EVERY))
    assert abs(timed - (TIME_ALL_FIRST + steady)) <= 1


def test_tasks_far_shorter_than_the_spacing_are_timed_up_to_max_stretch_times_less_often() -> None:
    # Tasks of 4 ints take microseconds: timed one in SAMPLE_EVERY * MAX_STRETCH, on average.
    tasks = TIME_ALL_FIRST + (2 * SAMPLE_EVERY - 1) * SAMPLE_EVERY * MAX_STRETCH
    clock, timed = _worker_run([4] * tasks)
    assert TIME_ALL_FIRST + 2 * SAMPLE_EVERY - 1 - 3 <= timed <= TIME_ALL_FIRST + 2 * (2 * SAMPLE_EVERY - 1)
    totals = WorkerTotals._make(clock.snapshot())
    assert totals.tasks == tasks and totals.samples == 4 * tasks  # counted exactly all the same


def test_the_stretch_follows_the_time_a_task_takes() -> None:
    assert stretch(SAMPLE_EVERY, SPACING_S / SAMPLE_EVERY) == 1  # as long as the spacing: never stretched
    assert stretch(SAMPLE_EVERY, 10.0) == 1
    assert stretch(SAMPLE_EVERY, SPACING_S / SAMPLE_EVERY / 4) == 4
    assert stretch(SAMPLE_EVERY, 1e-6) == MAX_STRETCH
    assert stretch(1, 1e-6) == 1  # every task timed (num_workers="auto" times every batch)
    assert stretch(SAMPLE_EVERY, 0.0) == 1  # nothing measured yet


def test_recent_times_forget_a_cold_first_task() -> None:
    recent = RecentTimes()
    assert recent.median() == 0.0
    recent.add(5.0)  # imports, first allocations
    for _ in range(15):
        recent.add(0.001)
    assert recent.median() == 0.001


def test_untimed_tasks_and_a_short_last_one_are_counted_exactly() -> None:
    sizes = ([4] * 299 + [3]) * 3  # three epochs of one worker, each ending short
    clock, _ = _worker_run(sizes)
    totals = WorkerTotals._make(clock.snapshot())
    assert totals.tasks == len(sizes) and totals.samples == sum(sizes)


def test_a_worker_told_the_batch_size_derives_untimed_samples_and_times_each_last_batch() -> None:
    sizes = ([4] * 299 + [3]) * 3
    clock, timed = _worker_run(sizes, epoch_batches=300, untimed_size=4)
    totals = WorkerTotals._make(clock.snapshot())
    assert totals.tasks == len(sizes) and totals.samples == sum(sizes)
    assert clock.untimed_samples == 0  # nothing counted one by one
    assert timed <= TIME_ALL_FIRST + 3 + len(sizes) // SAMPLE_EVERY * 2  # sampled all the same


def test_bytes_of_untimed_tasks_of_other_sizes_than_the_timed_ones_go_with_their_samples() -> None:
    # Economic pieces come in sizes the workers' pace decides: bytes scaled by tasks from the
    # timed ones were off by whatever the untimed pieces' sizes differed (2880 bytes for 3072).
    import torch

    sizes = [1, 9, 2, 7, 3] * 200
    spec = FetchSpec(list(range(9)), DatasetKind.MAP, True, lambda items: torch.zeros(len(items), 4), False)
    clock = StageClock(SAMPLE_EVERY)
    fetcher = MapFetcher(spec, clock)
    timed = 0
    for task, size in enumerate(sizes):
        batch = fetcher.fetch(list(range(size)), task)
        if clock.timing:
            timed += 1
            clock.finished(batch)
        else:
            clock.done(batch)
    totals = WorkerTotals._make(clock.snapshot())
    assert TIME_ALL_FIRST < timed < len(sizes) // 2  # most tasks went untimed
    assert totals.samples == sum(sizes)
    assert totals.bytes_out == 4 * 4 * sum(sizes)


class _Ticking:
    """A clock that moves only when the dataset says its item took time (no real waiting)."""

    def __init__(self) -> None:
        self.seconds = 0.0

    def __call__(self) -> float:
        return self.seconds


def test_a_cold_first_task_is_counted_once_not_for_every_untimed_task(monkeypatch: pytest.MonkeyPatch) -> None:
    # A worker's first task pays for imports and first page faults (an economic item worker's
    # first piece of JPEGs took several times its others). Scaled up with the later timed ones,
    # it stood for dozens of untimed tasks: loader.stats() read item workers' fetch ~35% slow
    # and their busy time half "waiting inside the work". The first tasks, all timed, are
    # measured; only the later timed ones stand for the untimed ones.
    ticking = _Ticking()
    monkeypatch.setattr(fetch_module, "now", ticking)

    class ColdFirst:
        def __getitem__(self, index: int) -> int:
            ticking.seconds += 0.1 if index == 0 else 0.002  # seconds this item "took"
            return index

    tasks = 1000
    spec = FetchSpec(ColdFirst(), DatasetKind.MAP, True, list, False)
    clock = StageClock(SAMPLE_EVERY)
    fetcher = MapFetcher(spec, clock)
    for task in range(tasks):
        fetcher.fetch([task], task)
        clock.done()
    totals = WorkerTotals._make(clock.snapshot())
    assert totals.tasks == tasks
    assert totals.start[0] == TIME_ALL_FIRST - 1  # the first tasks, before the first sampled one
    assert totals.fetch_s == pytest.approx(0.1 + 0.002 * (tasks - 1), rel=1e-6)


def test_totals_never_carry_scheduler_counters_older_than_the_first_tasks(monkeypatch: pytest.MonkeyPatch) -> None:
    # The counters are read at most so often when totals are shipped; the first tasks' own are
    # read as they end. Totals shipped just after, with the counters of an earlier reading,
    # gave the later tasks a negative CPU time, and a worker brought up to the tasks reported
    # since its totals then ran less than its first tasks alone.
    ticking = _Ticking()
    monkeypatch.setattr(clock_module, "now", ticking)
    monkeypatch.setattr(clock_module, "read_sched", lambda: (ticking.seconds, 0.0))  # always on a CPU
    clock = StageClock(SAMPLE_EVERY)
    for task in range(TIME_ALL_FIRST + 4):
        clock.left -= 1
        if clock.left <= 0:
            clock.start_timed()
        took = 10.0 if task == 0 else 0.01  # a long cold first task: the counters are read rarely
        ticking.seconds += took
        if clock.timing:
            clock.fetch_s += took
            totals = WorkerTotals._make(clock.finished())
            assert not totals.start or totals.cpu_s >= totals.start[5], (task, totals)
        else:
            clock.done()
    assert totals.start  # the first tasks were over


def _stream_run(samples: int, batch_size: int | None, drop_last: bool,
                clears_timing: bool) -> tuple[StageClock, list[Any], int, bool]:
    """Fetch from an iterable replica of ``samples`` ints until it runs dry, as a worker's loop
    does (``clears_timing``; the inline engine leaves ``timing`` set), then report as a worker
    does (a dry replica's report carries the totals). Returns the clock, the batches, how many
    of them were timed, and whether the task that found the replica dry was timed."""
    spec = FetchSpec(range(samples), DatasetKind.ITERABLE, batch_size is not None,
                     list if batch_size is not None else _as_list, drop_last)
    clock = StageClock(SAMPLE_EVERY)
    fetcher = IterableFetcher(spec, clock)
    batches: list[Any] = []
    timed_batches = 0
    while True:
        timed = clock.left <= 1  # the countdown reaches this task
        try:
            batch = fetcher.fetch([None] * (batch_size or 1))
        except DatasetExhausted:
            break
        batches.append(batch)
        timed_batches += timed
        if clears_timing:
            clock.finished(batch) if clock.timing else clock.done(batch)
    clock.timing = True  # what WorkerLoop._report_with_totals does
    return clock, batches, timed_batches, timed


def _as_list(sample: int) -> list[int]:
    return [sample]


class _SlowToEnd:
    """``samples`` ints, then ``end_s`` of work before the stream says it has ended (a worker
    with no shard starting its run over a graph and finding nothing, a reader closing its last
    file)."""

    def __init__(self, samples: int, end_s: float) -> None:
        self.samples, self.end_s = samples, end_s

    def __iter__(self) -> Any:
        yield from range(self.samples)
        until = time.perf_counter() + self.end_s
        while time.perf_counter() < until:  # work in the dataset, not a wait in the test
            pass


@pytest.mark.parametrize("clears_timing", [True, False], ids=["worker", "inline"])
def test_the_task_that_finds_an_iterable_replica_dry_adds_no_seconds(clears_timing: bool) -> None:
    # It is no task, but its seconds stayed in the sums, scaled as a timed batch's are (20 ms of
    # ending a stream after 41 batches of 1 ms read 0.56 s of fetching), and a worker beyond the
    # shards, whose only task found nothing, read as busy for it.
    dry_timed = set()
    for batches in range(TIME_ALL_FIRST + 2 * SAMPLE_EVERY):  # from a replica with nothing
        spec = FetchSpec(_SlowToEnd(2 * batches, 0.0005), DatasetKind.ITERABLE, True, list, False)
        clock = StageClock(SAMPLE_EVERY)
        fetcher = IterableFetcher(spec, clock)
        for _ in range(batches):
            batch = fetcher.fetch([None, None])
            if clears_timing:
                clock.finished(batch) if clock.timing else clock.done(batch)
        before = WorkerTotals._make(clock.snapshot())
        dry_timed.add(clock.left <= 1)  # the countdown reaches the task that finds it dry
        with pytest.raises(DatasetExhausted):
            fetcher.fetch([None, None])
        after = WorkerTotals._make(clock.snapshot())
        stages = ("tasks", "samples", "fetch_s", "collate_s", "send_s")
        assert [getattr(after, name) for name in stages] == [getattr(before, name) for name in stages], batches
    assert dry_timed == {True, False}


@pytest.mark.parametrize("clears_timing", [True, False], ids=["worker", "inline"])
@pytest.mark.parametrize("batch_size, drop_last, remainder", [
    (4, False, 0), (4, True, 0), (4, True, 3), (4, False, 3), (None, False, 0),
], ids=["full", "full-drop-last", "short-dropped", "short-kept", "unbatched"])
def test_the_task_that_finds_an_iterable_replica_dry_is_no_task(batch_size: int | None, drop_last: bool,
                                                                remainder: int, clears_timing: bool) -> None:
    # Streams ending on every task of a whole cycle of the gaps past the first TIME_ALL_FIRST
    # tasks: the task that finds the replica dry is timed in some, untimed in the others.
    found_dry = set()
    for tasks in range(1, TIME_ALL_FIRST + 2 * SAMPLE_EVERY):
        clock, batches, timed, dry_timed = _stream_run(tasks * (batch_size or 1) + remainder, batch_size,
                                                       drop_last, clears_timing)
        totals = WorkerTotals._make(clock.finished())
        assert (totals.tasks, totals.samples) == (len(batches), sum(map(len, batches))), tasks
        assert clock._timed == timed, tasks  # the times are scaled by tasks / timed
        found_dry.add(dry_timed)
    # A short batch kept ends its replica: the next task finds it dry before its clock is told.
    assert found_dry == {True, False} or (remainder and not drop_last)
