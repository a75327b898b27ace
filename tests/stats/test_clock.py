"""A worker's clock (stats/clock.py) driven by the fetcher (engine/fetch.py) as a worker drives
it: which tasks are timed, and that tasks and samples are counted exactly all the same."""

from __future__ import annotations

from pipeload.engine.fetch import MapFetcher
from pipeload.engine.plan import DatasetKind, FetchSpec
from pipeload.stats.clock import SAMPLE_EVERY, TIME_ALL_FIRST, StageClock, WorkerTotals


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


def test_a_worker_times_all_its_first_tasks_then_about_one_in_sample_every() -> None:
    steady = 2 * SAMPLE_EVERY - 1  # one whole cycle of the shuffled gaps, which average SAMPLE_EVERY
    clock, timed = _worker_run([4] * (TIME_ALL_FIRST + steady * SAMPLE_EVERY))
    assert SAMPLE_EVERY == 64  # the rate the per-batch cost was measured at (bench/RESULTS.md)
    assert abs(timed - (TIME_ALL_FIRST + steady)) <= 1


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
