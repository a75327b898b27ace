"""num_workers="auto" / prefetch_factor="auto": the decisions, and the engine that carries them
out mid-epoch without losing, repeating or reordering a batch."""

from __future__ import annotations

import threading
import time

import pytest
import torch

from conftest import wait_until
from stats.loops import Busy

import pipeload
from pipeload.engine.lifecycle import ThreadWorkerHandle
from pipeload.stats.clock import running_s
from pipeload.stats.recorder import LoaderSetup, StatsRecorder
from pipeload.stats.tuner import COMPUTING, AutoTuner, Settings, _sched_between


class RemoteReads(pipeload.Dataset):
    """Each item waits ``wait_s`` as a remote read would: workers wait, CPUs stay free."""

    def __init__(self, count: int, wait_s: float = 0.004) -> None:
        self.count, self.wait_s = count, wait_s

    def __len__(self) -> int:
        return self.count

    def __getitem__(self, index: int) -> int:
        time.sleep(self.wait_s)  # the workload itself (network latency), not a synchronisation
        return index


def _tuner(cpus: int = 2, budget: int | None = None, prefetch: bool = False) -> AutoTuner:
    recorder = StatsRecorder(LoaderSetup("classic", "process", cpus, 2, 8, False, cpus))
    return AutoTuner(recorder, cpus, True, prefetch, Settings(cpus, 2), budget)


def test_the_tuner_doubles_while_it_pays_then_goes_back_to_the_best() -> None:
    tuner = _tuner()
    assert tuner._step(rate=10.0, waited=0.5) == Settings(4, 2)  # 2 / (1 - 0.5) workers
    assert tuner._step(rate=19.0, waited=0.5) == Settings(8, 2)
    assert tuner._step(rate=19.5, waited=0.5) == Settings(4, 2)  # no faster: back, and stop
    assert tuner.done and tuner.current == Settings(4, 2)
    reasons = [d.reason for d in tuner._recorder.snapshot().decisions]
    assert reasons[0].startswith("start: 2 usable CPUs") and "back to those" in reasons[-1]


def test_the_tuner_stops_once_the_loop_no_longer_waits() -> None:
    tuner = _tuner()
    assert tuner._step(rate=10.0, waited=0.01) is None
    assert tuner.done and tuner.current == Settings(2, 2)


def test_the_tuner_stops_at_the_cap_and_within_the_memory_budget() -> None:
    tuner = _tuner(cpus=1)  # at most 32 workers for 1 CPU, when they wait rather than compute
    for expected in (2, 4, 8, 16, 32):
        assert tuner._step(rate=10.0 * expected, waited=0.5) == Settings(expected, 2)
    assert tuner._step(rate=400.0, waited=0.5) is None and tuner.done
    recorder = StatsRecorder(LoaderSetup("classic", "process", 2, 2, 8, False, 2))
    recorder._consumer.count.handed = 10  # ten batches handed out
    recorder._seen[(1, "", 0)] = ((10, 80, 0.1, 0.1, 0.0, 10 * 1024, 0.0, 0.0, 0.0), 1.0)
    squeezed = AutoTuner(recorder, 2, True, False, Settings(2, 2), budget_bytes=4 * 1024 + 1)
    assert squeezed._step(rate=10.0, waited=0.9) is None  # 3 x 2 batches of 1 KiB would not fit
    # A step the budget cannot take whole is taken as far as it fits: 6 x 2 of 1 KiB, not 8 x 2
    # (the tuning stopped there, at 2, where 6 workers would have paid).
    roomier = AutoTuner(recorder, 2, True, False, Settings(2, 2), budget_bytes=12 * 1024 + 1)
    assert roomier._step(rate=10.0, waited=0.9) == Settings(6, 2)


def test_workers_that_compute_are_tried_up_to_twice_the_cpus_and_kept_only_if_they_pay() -> None:
    tuner = _tuner(cpus=2)  # starts at 2 workers: as many as CPUs
    assert tuner._step(rate=10.0, waited=0.9, share=0.95) == Settings(4, 2)  # not 2 / 0.1
    assert tuner._step(rate=10.2, waited=0.9, share=0.95) == Settings(2, 2)  # no faster: back
    assert tuner.done
    paying = _tuner(cpus=2)
    assert paying._step(rate=10.0, waited=0.9, share=0.95) == Settings(4, 2)
    assert paying._step(rate=14.0, waited=0.9, share=0.95) is None and paying.done
    assert paying.current == Settings(4, 2)
    reason = paying._recorder.snapshot().decisions[-1].reason
    assert "the workers compute: no more of them than 2x the 2 usable CPUs" in reason
    crowded = _tuner(cpus=2)  # queued for a CPU half the time: other jobs share the CPUs
    assert crowded._step(rate=10.0, waited=0.9, share=0.95, queued=0.5) == Settings(4, 2)
    assert crowded._step(rate=9.8, waited=0.9, share=0.95, queued=0.5) is None  # kept: not slower
    assert crowded.current == Settings(4, 2)
    slower = _tuner(cpus=2)
    slower._step(rate=10.0, waited=0.9, share=0.95, queued=0.5)
    assert slower._step(rate=9.0, waited=0.9, share=0.95, queued=0.5) == Settings(2, 2)

    waiting = _tuner(cpus=2)  # the same loop, with workers that mostly wait: more of them
    assert waiting._step(rate=10.0, waited=0.9, share=0.1) == Settings(8, 2)  # 2 / 0.1, at most 4x


def test_going_back_names_the_settings_and_their_own_rate() -> None:
    # A crowded step kept a little slower (9.8 after 10.0 batches/s) kept the faster rate as the
    # best's: "back to the best" then compared with 10.0, a rate the settings it went back to
    # never reached.
    tuner = _tuner(cpus=2, prefetch=True)
    assert tuner._step(rate=10.0, waited=0.9, share=0.95, queued=0.5) == Settings(4, 2)
    assert tuner._step(rate=9.8, waited=0.9, share=0.95, queued=0.5) == Settings(4, 4)
    assert tuner._step(rate=9.7, waited=0.9, share=0.95, queued=0.5) == Settings(4, 2)
    reason = tuner._recorder.snapshot().decisions[-1].reason
    assert "(9.7 vs 9.8 batches/s with num_workers=4, prefetch_factor=2): back to those" in reason


def test_prefetch_doubles_while_it_pays_when_workers_are_capped() -> None:
    tuner = _tuner(cpus=1, prefetch=True)
    tuner._max_workers = 1
    assert tuner._step(rate=10.0, waited=0.9) == Settings(1, 4)
    assert tuner._step(rate=20.0, waited=0.9) == Settings(1, 8)
    assert tuner._step(rate=30.0, waited=0.9) is None and tuner.done  # 8 is the most it tries


@pytest.mark.timeout(90)
def test_auto_grows_the_pool_for_waiting_workers_and_keeps_sampler_order(leak_guard) -> None:
    loader = pipeload.DataLoader(RemoteReads(1200), batch_size=8, num_workers="auto",
                                 prefetch_factor="auto", multiprocessing_context="fork")
    assert loader.num_workers == len(__import__("os").sched_getaffinity(0))
    got, running = [], []
    for batch in loader:
        got += [int(i) for i in batch]
        running.append(loader.num_workers)
    assert got == list(range(1200))  # every batch once, in order, across the pool swaps
    decisions = loader.stats().decisions
    assert len(decisions) >= 2, decisions
    assert decisions[1].num_workers >= 2 * decisions[0].num_workers
    assert "auto (now" in loader.stats().summary()
    # loader.num_workers reads the count running now (it stayed at the starting count)
    assert loader.num_workers == decisions[-1].num_workers == loader._tuner.current.num_workers
    assert loader.prefetch_factor == loader._tuner.current.prefetch_factor
    assert running[0] == decisions[0].num_workers and running[-1] == decisions[-1].num_workers


@pytest.mark.timeout(90)
def test_auto_with_shuffle_and_persistent_workers(leak_guard) -> None:
    loader = pipeload.DataLoader(RemoteReads(600, 0.002), batch_size=8, num_workers="auto",
                                 shuffle=True, generator=torch.Generator().manual_seed(0),
                                 persistent_workers=True, worker_type="thread")
    for _ in range(2):
        got = sorted(int(i) for batch in loader for i in batch)
        assert got == list(range(600))
    assert loader.stats().epochs == 2
    del loader


@pytest.mark.timeout(60)
def test_auto_over_an_iterable_dataset_keeps_its_starting_count(leak_guard) -> None:
    class Stream(pipeload.IterableDataset):
        def __iter__(self):
            info = pipeload.get_worker_info()
            return iter(range(info.id, 64, info.num_workers))

    loader = pipeload.DataLoader(Stream(), batch_size=4, num_workers="auto", worker_type="thread")
    assert sorted(int(i) for batch in loader for i in batch) == list(range(64))
    decisions = loader.stats().decisions
    assert len(decisions) == 1 and "kept: only map-style datasets in classic mode" in decisions[0].reason


@pytest.mark.timeout(60)
def test_auto_in_economic_mode_keeps_its_starting_count(leak_guard) -> None:
    loader = pipeload.DataLoader(RemoteReads(64, 0.0), batch_size=4, num_workers="auto",
                                 mode="economic", worker_type="thread")
    assert [int(i) for batch in loader for i in batch] == list(range(64))
    (decision,) = loader.stats().decisions
    assert decision.num_workers == loader.num_workers and "kept" in decision.reason


def test_auto_gives_no_warning_about_a_worker_count_nobody_chose() -> None:
    # torch's "This DataLoader will create N worker processes" tells the user to lower a count
    # they chose; "auto" in economic mode starts its item workers and 2 batch workers itself.
    import warnings

    with warnings.catch_warnings():
        warnings.simplefilter("error")
        loader = pipeload.DataLoader(RemoteReads(8, 0.0), batch_size=4, num_workers="auto", mode="economic")
    assert loader.num_workers + loader.num_batch_workers > 0
    with pytest.warns(UserWarning, match="This DataLoader will create"):
        pipeload.DataLoader(RemoteReads(8, 0.0), batch_size=4, num_workers=64, mode="economic")


def test_auto_needs_stats_and_prefetch_auto_needs_workers() -> None:
    with pytest.raises(ValueError, match="num_workers='auto' tunes itself from the loader's stats"):
        pipeload.DataLoader(range(4), num_workers="auto", stats=False)
    with pytest.raises(ValueError, match="prefetch_factor option could only be specified in multiprocessing"):
        pipeload.DataLoader(range(4), prefetch_factor="auto")
    with pytest.raises(TypeError, match="num_workers should be an int \\(or 'auto'\\)"):
        pipeload.DataLoader(range(4), num_workers="many")


class RandomReads(RemoteReads):
    """A remote read and a random augmentation drawn from torch's generator."""

    def __getitem__(self, index: int) -> tuple[int, float]:
        return super().__getitem__(index), torch.rand(()).item()


def _random_reads_loader(num_workers: int | str) -> pipeload.DataLoader:
    return pipeload.DataLoader(RandomReads(800), batch_size=8, num_workers=num_workers,
                               generator=torch.Generator().manual_seed(5), worker_seeding="per_batch",
                               multiprocessing_context="fork")


def _as_lists(batches: list) -> list:
    return [[column.tolist() for column in batch] for batch in batches]


@pytest.mark.slow  # ~5.5 s; per-batch values across worker counts and modes: test_resume_mid_epoch.py runs fast
@pytest.mark.timeout(120)
def test_per_batch_random_values_do_not_depend_on_the_pool_swaps(leak_guard) -> None:
    # A batch's seed is (base seed, epoch, batch number): the pools the tuner starts mid-epoch
    # keep the base seed and number on, so the values equal a fixed pool's, and resume.
    fixed = _as_lists(list(_random_reads_loader(2)))
    auto = _random_reads_loader("auto")
    assert _as_lists(list(auto)) == fixed
    assert len({d.num_workers for d in auto.stats().decisions}) >= 2  # it did swap pools
    interrupted = _random_reads_loader("auto")
    iterator = iter(interrupted)
    head = _as_lists([next(iterator) for _ in range(60)])
    state = interrupted.state_dict()
    del iterator
    resumed = _random_reads_loader("auto")
    resumed.load_state_dict(state)
    assert head + _as_lists(list(resumed)) == fixed


def test_only_the_decision_the_tuner_stops_at_is_settled() -> None:
    tuner = _tuner()
    tuner._step(rate=10.0, waited=0.5)
    tuner._step(rate=19.0, waited=0.5)
    assert not any(d.settled for d in tuner._recorder.snapshot().decisions)
    tuner._step(rate=19.5, waited=0.5)  # no faster: back to the best, and stop
    assert [d.settled for d in tuner._recorder.snapshot().decisions] == [False, False, False, True]
    fixed = AutoTuner(StatsRecorder(LoaderSetup("classic", "process", 2, 2, 8, False, 2)), 2, False,
                      False, Settings(2, 2), None)  # nothing to tune (economic mode, iterables)
    assert [d.settled for d in fixed._recorder.snapshot().decisions] == [True]


def test_a_windows_cpu_time_counts_workers_that_left_or_came_in_it() -> None:
    # A pool of one short epoch starts and stops inside a window: its workers' time read as
    # gone, and computing workers read -1% on a CPU (a skeptic's probe at stop 53).
    start = {("process", 1): (1.0, 0.5), ("process", 2): (2.0, 0.0)}
    left = {("process", 1): (1.5, 0.5), ("process", 3): (0.25, 0.125)}  # 1 left; 3 came and left
    end = {("process", 2): (2.5, 0.25), ("process", 4): (0.5, 0.0)}  # 2 stayed; 4 came
    assert _sched_between(start, end, left) == (0.5 + 0.5 + 0.25 + 0.5, 0.25 + 0.125)
    assert _sched_between(start, {}, {}) == (0.0, 0.0)  # gone unread: nothing, never below


def _slow_start(worker_id: int) -> None:
    time.sleep(0.3)  # the workload: a worker's setup (opening files, connecting) before its first item


@pytest.mark.timeout(90)
def test_the_tuner_reads_a_loop_that_only_waits_as_waiting_when_workers_start_each_epoch(leak_guard) -> None:
    # A loop that does nothing but ask for batches waits all of its steady time. Its windows
    # held the epochs' starts (0.3 s each here) in their seconds but not in their waits: the
    # tuner's decision read "the training loop waited 32%" where the stats read 100%.
    loader = pipeload.DataLoader(RemoteReads(64, 0.002), batch_size=8, num_workers="auto",
                                 worker_init_fn=_slow_start, multiprocessing_context="fork")
    for _ in range(100):  # epochs of 8 batches: every window holds an epoch's start
        if len(loader.stats().decisions) >= 2:
            break
        for _ in loader:
            pass
    reason = loader.stats().decisions[1].reason
    waited = int(reason.split("the training loop waited ")[1].split("%")[0])
    assert waited >= 90, reason


@pytest.mark.timeout(90)
def test_workers_started_each_epoch_are_seen_computing_by_the_tuner(leak_guard) -> None:
    loader = pipeload.DataLoader(Busy(96, 0.001), batch_size=8, num_workers="auto", multiprocessing_context="fork")
    for _ in range(200):  # epochs of 12 batches: the tuner's first window takes about 30
        if len(loader.stats().decisions) >= 2:
            break
        for _ in loader:
            pass
    reason = loader.stats().decisions[1].reason
    share = int(reason.split("workers on or queued for a CPU ")[1].split("%")[0])
    assert share >= 100 * COMPUTING, reason
