"""The summary's verdicts (stats/analysis.py) and words (stats/summary.py) on stats made to
order: no timing involved."""

from __future__ import annotations

import dataclasses
import itertools

import pytest

from pipeload.stats import analysis
from pipeload.stats.recorder import LoaderSetup
from pipeload.stats.report import LoaderStats, QueueStats, TuningDecision, WorkerStats

CPUS = 2
ALIVE_S = 4.0  # every made-up worker's life, and the loop's steady time: enough to judge
BATCHES = 200
# What a loading verdict may suggest: never what is trained (batch_size, drop_last, sampler).
LOADING_SETTINGS = {"num_workers", "worker_type", "prefetch_factor", "num_batch_workers", "pin_memory"}


def _worker(kind: str, worker_id: int, *, fetch_s: float = 0.0, collate_s: float = 0.0,
            cpu_s: float = 0.0, queued_s: float = 0.0, tasks: int = 100,
            bytes_out: int = 1024) -> WorkerStats:
    """A worker of ALIVE_S seconds; the seconds given are fractions of it, scaled."""
    return WorkerStats(kind, worker_id, tasks=tasks, samples=8 * tasks, fetch_s=fetch_s * ALIVE_S,
                       collate_s=collate_s * ALIVE_S, transfer_s=0.01 * ALIVE_S, bytes_out=bytes_out,
                       alive_s=ALIVE_S, cpu_s=cpu_s * ALIVE_S, queued_s=queued_s * ALIVE_S)


def _stats(mode: str, workers: tuple[WorkerStats, ...], wait: float, *, worker_type: str = "process",
           cpus: int = CPUS, dataset: str = "map", batches: int = BATCHES, steady_s: float = ALIVE_S,
           num_workers: int | None = None) -> LoaderStats:
    """Stats whose loop waited a fraction ``wait`` of its ``steady_s`` seconds."""
    count = num_workers if num_workers is not None else sum(1 for w in workers if w.kind in ("", "item"))
    setup = LoaderSetup(mode, worker_type, count, 2 if count else None, 8, False, cpus, dataset)
    return LoaderStats(setup=setup, batches=batches, epochs=1, wait_s=wait * steady_s,
                       compute_s=(1 - wait) * steady_s, first_batch_s=0.01, pin_s=0.0, pinned=0,
                       workers=workers, queue=QueueStats(0.0, 0, 1.0, 2, 2))


def _busy(count: int, fetch: float, cpu: float, queued: float = 0.0, kind: str = "") -> tuple[WorkerStats, ...]:
    return tuple(_worker(kind, i, fetch_s=fetch, cpu_s=cpu, queued_s=queued) for i in range(count))


def _verdict(stats: LoaderStats) -> str:
    return stats.summary().splitlines()[-1]


# -- evidence ----------------------------------------------------------------------------


def test_too_few_batches_or_seconds_give_no_verdict_and_say_how_many_more() -> None:
    # 7 batches read "workers busy 84%, on a CPU 0% ... try num_workers=8", which was slower.
    for short in (_stats("classic", _busy(2, 0.84, 0.0), 0.9, batches=8, steady_s=0.4),
                  _stats("classic", _busy(2, 0.84, 0.0), 0.9, batches=500, steady_s=1.0)):
        assert short.suggested_settings() == {}
        verdict = _verdict(short)
        assert verdict.startswith("verdict: too little to judge yet"), verdict
        assert "about" in verdict and "more batches" in verdict
    few = _stats("classic", _busy(2, 0.84, 0.0), 0.9, batches=8, steady_s=0.4)
    assert "7 batches after each epoch's first, in 0.4 s" in _verdict(few)
    assert "about 43 more batches" in _verdict(few)  # 50 needed; 2 s at 17.5 batches/s is 35 more
    slow = _stats("classic", _busy(2, 0.84, 0.0), 0.9, batches=500, steady_s=1.0)
    assert "about 499 more batches, or 1.0 s more of them" in _verdict(slow)  # 1 s more at 499 batches/s
    nearly = _stats("classic", _busy(2, 0.84, 0.0), 0.9, batches=500, steady_s=1.999)
    assert _verdict(nearly).endswith("about 1 more batch"), _verdict(nearly)  # 1 ms at 499 batches/s


def test_enough_evidence_gives_a_verdict() -> None:
    stats = _stats("classic", _busy(2, 0.95, 0.9), 0.8, batches=analysis.MIN_STEADY_BATCHES + 1,
                   steady_s=analysis.MIN_STEADY_S)
    assert "too little" not in _verdict(stats)


# -- margins: the same verdict for runs that differ by noise --------------------------------


@pytest.mark.parametrize("waits", [(0.02, 0.045, 0.06, 0.24), (0.3, 0.9)])
def test_waits_within_one_band_get_one_verdict(waits: tuple[float, float]) -> None:
    workers = _busy(2, 0.95, 0.95)
    verdicts = {(analysis.diagnose(s).bottleneck, tuple(sorted(s.suggested_settings().items())))
                for s in (_stats("classic", workers, wait) for wait in waits)}
    assert len(verdicts) == 1, verdicts


def test_a_loop_that_nearly_keeps_up_is_told_the_training_loop_limits() -> None:
    stats = _stats("classic", _busy(2, 0.5, 0.5), 0.1)
    assert analysis.diagnose(stats).bottleneck == "the training loop"
    assert "nearly keeps up" in analysis.diagnose(stats).advice
    assert stats.suggested_settings() == {}


@pytest.mark.parametrize("wait", [0.04, 0.06, 0.15, 0.24])
def test_saturated_workers_feeding_a_loop_that_nearly_keeps_up_are_said_not_named(wait: float) -> None:
    # The README's stats example on an idle 2-core box: the loop waited 5% to 15% over identical
    # runs, the workers busy ~90% on both CPUs; lines at 5% and 15% flipped the name between runs.
    stats = _stats("classic", _busy(2, 0.9, 0.9), wait)
    diagnosis = analysis.diagnose(stats)
    assert diagnosis.bottleneck == "the training loop"
    assert f"waited {'only ' if wait < 0.05 else ''}{wait:.0%}" in diagnosis.advice
    if wait < 0.05:
        return
    assert "the workers were occupied 91%" in diagnosis.advice
    assert "2 usable CPUs all in use" in diagnosis.advice
    assert stats.suggested_settings() == {}


@pytest.mark.parametrize("busy", [0.55, 0.6, 0.65])
def test_workers_neither_idle_nor_saturated_are_no_single_bottleneck(busy: float) -> None:
    # Two identical runs named "the main process" once and "__getitem__" once: 60% was one edge.
    stats = _stats("classic", _busy(2, busy, busy), 0.5)
    assert analysis.diagnose(stats).bottleneck == "no single bottleneck"
    assert stats.suggested_settings() == {}


def test_a_stage_is_named_only_when_it_stands_out() -> None:
    even = tuple(_worker("", i, fetch_s=0.5, collate_s=0.45, cpu_s=0.9) for i in range(2))
    assert "the workers limit loading (the dataset's `__getitem__` 52%, `collate_fn` 47%)" in \
        _verdict(_stats("classic", even, 0.5))
    lopsided = tuple(_worker("", i, fetch_s=0.8, collate_s=0.15, cpu_s=0.9) for i in range(2))
    assert "the workers limit loading, in the dataset's `__getitem__`" in _verdict(_stats("classic", lopsided, 0.5))


def test_suggested_worker_counts_follow_a_coarse_ladder() -> None:
    # n / (1 - wait) moved by one with every few percent of noise: 5 and 6 are one suggestion.
    counts = {_stats("classic", _busy(2, 0.95, 0.05), wait, cpus=16).suggested_settings()["num_workers"]
              for wait in (0.61, 0.63, 0.65)}
    assert counts == {6}


def test_no_made_up_stats_suggest_a_setting_that_changes_what_is_trained() -> None:
    # "try a larger batch_size" changes the training, not the loading.
    for wait, busy, cpu, mode, kind in itertools.product((0.0, 0.1, 0.3, 0.9), (0.1, 0.6, 0.95),
                                                        (0.0, 0.5, 1.0), ("classic", "economic"),
                                                        ("", "item")):
        if (mode == "economic") != (kind == "item"):
            continue
        workers = _busy(2, busy, cpu, kind=kind)
        if mode == "economic":
            workers += tuple(_worker("batch", i, collate_s=busy, cpu_s=cpu) for i in range(2))
        stats = _stats(mode, workers, wait)
        assert set(stats.suggested_settings()) <= LOADING_SETTINGS, stats.summary()
        assert "batch_size=" not in _verdict(stats)


# -- the rules --------------------------------------------------------------------------


def test_economic_collate_asks_a_bounded_number_of_batch_workers() -> None:
    # The loop waited all the time (it does nothing between batches): n / (1 - wait) workers
    # is unbounded, and it asked for num_batch_workers=1116 in a real run of a sleeping collate.
    # (Item workers that wait on I/O in their little fetching must not turn it into a call for
    # more item workers.)
    items = tuple(_worker("item", i, fetch_s=0.1, cpu_s=0.01) for i in range(2))
    waiting = tuple(_worker("batch", i, collate_s=0.9, cpu_s=0.01) for i in range(2))
    stats = _stats("economic", items + waiting, 1.0)
    wanted = stats.suggested_settings()["num_batch_workers"]
    assert 3 <= wanted <= 8, stats.summary()
    assert f"num_batch_workers={wanted}" in stats.summary()
    computing = tuple(_worker("batch", i, collate_s=0.9, cpu_s=0.9) for i in range(2))
    stats = _stats("economic", items + computing, 1.0)
    assert stats.suggested_settings().get("num_batch_workers", CPUS) <= CPUS, stats.summary()


def test_bytes_moved_are_written_in_a_unit_that_shows_them() -> None:
    # 1 KiB per worker read "moved 0.0 MiB": nothing, to a reader.
    stats = _stats("classic", _busy(2, 0.9, 0.9), 0.9)
    assert stats.bytes_moved == 2048
    assert "moved 2.0 KiB of tensors" in stats.summary()
    big = dataclasses.replace(stats, workers=(dataclasses.replace(_worker("", 0), bytes_out=3 * 2**20),))
    assert "moved 3.0 MiB of tensors" in big.summary()


def test_without_workers_nothing_is_said_to_be_moved_and_no_worker_type() -> None:
    # num_workers=0 reported worker_type=process: nothing ran in a process of its own.
    stats = _stats("classic", (_worker("main", 0, fetch_s=0.9),), 0.9)
    text = stats.summary()
    assert "moved" not in text and "skipped samples: 0" in text
    assert "num_workers=0 (loading in the main process)" in text
    assert "worker_type" not in text and "prefetch_factor" not in text
    assert stats.suggested_settings() == {"num_workers": 2}


def test_thread_workers_are_not_said_to_move_tensors_to_the_main_process() -> None:
    # Thread workers run inside the main process: "moved 3.2 KiB of tensors to the main
    # process" told of a move between processes that never happened.
    threads = _stats("classic", tuple(dataclasses.replace(w, bytes_out=2048) for w in _busy(2, 0.5, 0.5)), 0.5,
                     worker_type="thread")
    text = threads.summary()
    assert "to the main process" not in text
    assert "thread workers handed 4.0 KiB of tensors to the loop within the main process" in text
    processes = _stats("classic", tuple(dataclasses.replace(w, bytes_out=2048) for w in _busy(2, 0.5, 0.5)), 0.5)
    assert "moved 4.0 KiB of tensors to the main process" in processes.summary()


def test_more_waiting_workers_than_cpus_are_said_to_warn_only_where_the_loader_warns() -> None:
    # Thread workers start no process and get no warning for outnumbering the CPUs, yet the
    # verdict told them "the DataLoader then warns that 8 workers exceed the suggested 2".
    for worker_type, warns in (("process", True), ("thread", False)):
        stats = _stats("classic", _busy(2, 0.95, 0.02), 0.9, worker_type=worker_type)
        assert stats.suggested_settings() == {"num_workers": 8}
        assert ("then warns that 8 workers exceed the suggested 2" in _verdict(stats)) is warns, _verdict(stats)


def test_a_loop_that_keeps_workers_waiting_says_they_idle_once() -> None:
    # "bottleneck: the training loop: the training loop waited only 4%" said it twice.
    stats = _stats("classic", _busy(2, 0.05, 0.05), 0.01)
    verdict = _verdict(stats)
    assert verdict.startswith("verdict: loading keeps up: the training loop waited only 1% of the time")
    assert verdict.count("the training loop") == 1
    assert "workers idle 94% of the time" in verdict, verdict
    assert stats.suggested_settings() == {"num_workers": 1}


def test_workers_busy_and_on_a_cpu_are_explained_side_by_side() -> None:
    # "busy 87%, on a CPU 0%" side by side, with no word of what the rest was.
    waiting = _stats("classic", _busy(2, 0.87, 0.0), 0.5)
    line = next(line for line in waiting.summary().splitlines() if line.startswith("workers busy"))
    assert "workers busy 88% of the time" in line
    assert "of that busy time, 0% on a CPU, 0% ready but queued for one" in line
    assert "100% waiting inside the work (I/O, sleeps, locks)" in line
    crowded = _stats("classic", _busy(2, 0.9, 0.2, queued=0.7), 0.5)
    assert "ready but queued for one (other work had the CPUs)" in crowded.summary()


def _pinning(stats: LoaderStats, pin_s: float) -> LoaderStats:
    return dataclasses.replace(stats, setup=dataclasses.replace(stats.setup, pin_memory=True),
                               pin_s=pin_s, pinned=stats.batches)


def test_pinning_that_takes_most_of_the_time_is_named() -> None:
    # Inline, pinning 50 times longer than collating read "`collate_fn` takes most of it".
    inline = _stats("classic", (_worker("main", 0, fetch_s=0.002, collate_s=0.004),), 0.9)
    for stats in (_pinning(inline, 0.2 * ALIVE_S), _pinning(_stats("classic", _busy(1, 0.01, 0.01), 0.9), 0.8 * ALIVE_S)):
        assert _verdict(stats).startswith("verdict: pinning limits"), stats.summary()
        assert stats.suggested_settings() == {"pin_memory": False}
    assert "pinning" not in _verdict(_pinning(inline, 0.001))


def test_pin_memory_without_anything_pinned_says_so() -> None:
    stats = _stats("classic", _busy(1, 0.9, 0.9), 0.9)
    stats = dataclasses.replace(stats, setup=dataclasses.replace(stats.setup, pin_memory=True))
    assert "pin_memory=True (nothing pinned: no accelerator)" in stats.summary()
    assert "pin_memory=True," in _pinning(stats, 0.1).summary()


def test_economic_collate_held_back_by_prefetch_factor_asks_for_it() -> None:
    # Economic mode collates at most prefetch_factor batches at once: with 2, a 4th batch
    # worker gained nothing in a real run (61 -> 59 batches/s), where the verdict asked for
    # num_batch_workers=8, then (with 4 idling half the time) for a larger batch_size.
    items = tuple(_worker("item", i, fetch_s=0.05, cpu_s=0.05) for i in range(2))
    saturated = tuple(_worker("batch", i, collate_s=0.9, cpu_s=0.01) for i in range(2))
    wanted = _stats("economic", items + saturated, 1.0).suggested_settings()
    assert wanted["prefetch_factor"] == wanted["num_batch_workers"] > 2, wanted
    held_back = tuple(_worker("batch", i, collate_s=0.5, cpu_s=0.01) for i in range(4))
    stats = _stats("economic", items + held_back, 1.0)
    assert stats.suggested_settings() == {"prefetch_factor": 4}, stats.summary()
    assert "verdict: the batch workers limit loading, in `collate_fn`" in stats.summary()


def test_economic_workers_busy_is_given_per_kind() -> None:
    # One mean over item and batch workers ("workers busy 46%" with item workers at 90% and
    # batch workers at 2%) described neither kind.
    items = tuple(_worker("item", i, fetch_s=0.9) for i in range(2))
    batches = tuple(_worker("batch", i, collate_s=0.02) for i in range(2))
    text = _stats("economic", items + batches, 1.0).summary()
    assert "item workers busy 91%, batch workers busy 3% of the time" in text, text


def test_thread_workers_taking_turns_on_the_gil_are_told_to_use_processes() -> None:
    # Two thread workers running Python code ran one CPU's worth between them (0.13 s each of
    # 0.25 s busy in a real run): the GIL lets one run at a time. More threads cannot help.
    turns = _busy(2, 0.9, 0.45)
    stats = _stats("classic", turns, 0.9, worker_type="thread", cpus=4)
    assert "GIL" in stats.summary()
    assert stats.suggested_settings() == {"worker_type": "process"}
    sleeping = _busy(2, 0.9, 0.01)
    assert "GIL" not in _stats("classic", sleeping, 0.9, worker_type="thread", cpus=4).summary()
    assert "GIL" not in _stats("classic", turns, 0.9, cpus=4).summary()  # processes have none


def test_thread_workers_are_not_sent_to_processes_where_the_gil_cannot_be_told_apart() -> None:
    # Process mode said "try worker_type='thread'" and thread mode (faster there) "try
    # worker_type='process'". On 2 CPUs the main thread's own share keeps threads near one
    # CPU whatever the GIL does; crowded out by other jobs is no GIL either.
    two_cpus = _stats("classic", _busy(2, 0.9, 0.45), 0.9, worker_type="thread", cpus=2)
    crowded = _stats("classic", _busy(2, 0.9, 0.45, queued=0.4), 0.9, worker_type="thread", cpus=4)
    for stats in (two_cpus, crowded):
        assert "worker_type" not in stats.suggested_settings(), stats.summary()
    # Nor to more threads: a thread waiting for the GIL reads as waiting, as on I/O.
    assert "num_workers" not in two_cpus.suggested_settings(), two_cpus.summary()
    io_threads = _stats("classic", _busy(2, 0.9, 0.05), 0.9, worker_type="thread")
    assert io_threads.suggested_settings()["num_workers"] > 2  # under half a CPU: truly waiting
    idle = _stats("classic", _busy(2, 0.2, 0.2), 0.5)  # the main process limits
    assert "worker_type" not in idle.suggested_settings() and "worker_type" not in _verdict(idle)


def test_the_queue_line_says_its_capacity_as_such() -> None:
    # "(at most 2)" gave the capacity where QueueStats.max_in_flight said 1: a reader took it
    # for the most seen in flight.
    text = _stats("classic", _busy(1, 0.9, 0.9), 0.9).summary()
    assert "room for 2 in flight" in text and "at most" not in text, text


def _queue_line(stats: LoaderStats) -> str:
    return next(line for line in stats.summary().splitlines() if line.startswith("when a batch was handed out"))


def test_the_queue_line_says_what_its_figures_count() -> None:
    # "1.1 more were ready on average and 3.0 in flight (room for 4)" (2 workers, a slow loop)
    # read as 4.1 batches against room for 4: the ready ones are in flight too, the batch handed
    # out is in neither, and the room counts it; nor did it say what the room is made of.
    classic = dataclasses.replace(_stats("classic", _busy(2, 0.9, 0.9), 0.1), queue=QueueStats(1.1, 3, 3.0, 3, 4))
    line = _queue_line(classic)
    assert line.startswith("when a batch was handed out, 3.0 others were in flight on average (sent to "
                           "workers, not yet handed out), 1.1 of them ready (built, waiting in the main "
                           "process for their turn); room for 4 in flight, the batch handed out included "
                           "(prefetch_factor=2 x 2 workers;"), line
    pools = _busy(4, 0.9, 0.9, kind="item") + _busy(2, 0.5, 0.5, kind="batch")
    economic = dataclasses.replace(_stats("economic", pools, 0.1), queue=QueueStats(0.5, 1, 0.9, 1, 2))
    assert "room for 2 in flight, the batch handed out included (prefetch_factor=2, whatever the number of " \
        "workers;" in _queue_line(economic), _queue_line(economic)
    # Under "auto" the room is the settings' now; the means span the settings it ran.
    auto = dataclasses.replace(_under_auto(classic, (2, False), (4, True)), queue=QueueStats(1.1, 3, 3.0, 7, 8))
    assert "room for 8 in flight, the batch handed out included (prefetch_factor=2 x 4 workers now, " \
        "after other settings num_workers='auto' tried;" in _queue_line(auto), _queue_line(auto)


def test_the_queue_line_names_no_settings_that_do_not_make_its_room() -> None:
    # The setup is read at construction; prefetch_factor=4 set afterwards (as torch allows) ran
    # a room of 8, which the line explained as "prefetch_factor=2 x 2 workers" (the review's probe).
    later = dataclasses.replace(_stats("classic", _busy(2, 0.9, 0.9), 0.1), queue=QueueStats(1.1, 3, 3.0, 7, 8))
    line = _queue_line(later)
    assert "room for 8 in flight, the batch handed out included (the pool keeps fewer" in line, line
    assert "prefetch_factor=2" not in line, line


# -- kinds of dataset, and loaders that cannot re-tune ----------------------------------------


def test_datapipes_and_iterable_datasets_are_not_said_to_have_getitem() -> None:
    for dataset, words in (("pipe", "the DataPipe graph"), ("iterable", "the dataset's `__iter__`")):
        stats = _stats("classic", _busy(2, 0.95, 0.02), 0.9, dataset=dataset)
        assert "__getitem__" not in stats.summary(), stats.summary()
        assert f"verdict: the workers limit loading, in {words}" in _verdict(stats)


def test_auto_is_offered_only_where_the_loader_re_tunes() -> None:
    # A pipe under num_workers="auto" said only map-style datasets are re-tuned, then advised
    # "try num_workers=8 (or 'auto')".
    waiting = _busy(2, 0.95, 0.02)
    assert "(or 'auto')" in _verdict(_stats("classic", waiting, 0.9))
    for dataset in ("pipe", "iterable"):
        stats = _stats("classic", waiting, 0.9, dataset=dataset)
        assert "num_workers" in stats.suggested_settings() and "auto" not in _verdict(stats)


def test_workers_that_outnumber_shards_are_named() -> None:
    # 8 workers over 4 shards left 4 workers 1% busy with no word about it.
    working = tuple(_worker("", i, fetch_s=0.95, cpu_s=0.02) for i in range(4))
    idle = tuple(_worker("", i, tasks=0) for i in range(4, 8))
    stats = _stats("classic", working + idle, 0.9, dataset="pipe")
    verdict = _verdict(stats)
    assert "4 of the 8 workers built no batch (workers 4, 5, 6 and 7)" in verdict, verdict
    assert "fewer shards than workers" in verdict and "num_workers=4 does the same work" in verdict
    assert stats.suggested_settings() == {"num_workers": 4}
    map_style = _stats("classic", working + idle, 0.9)  # a map-style dataset has no shards
    assert "shards" not in _verdict(map_style)


def _started_only(worker_id: int, running: float, queued: float) -> WorkerStats:
    """A classic worker that finished no task, ``running`` of its life on a CPU and ``queued``
    ready for one: it started (sharded its copy, started its iterator) and answered epochs'
    starts and the end of its replica, which take no stage's seconds."""
    return dataclasses.replace(_worker("", worker_id, cpu_s=running, queued_s=queued, tasks=0), transfer_s=0.0)


def _busy_line(stats: LoaderStats) -> str:
    return next(line for line in stats.summary().splitlines() if line.startswith("workers busy"))


def test_workers_that_built_no_batch_are_marked_before_there_is_enough_to_judge() -> None:
    # The README's 4 shards read by 8 workers: one epoch is 4 batches, never enough for a verdict,
    # and the worker line gave the 4 idle workers a busy share like the others and no other word.
    working = tuple(_worker("", i, fetch_s=0.9, tasks=1) for i in range(4))
    idle = tuple(_started_only(i, 0.05, 0.3) for i in range(4, 12))
    stats = _stats("classic", working + idle, 0.9, dataset="pipe", batches=4)
    line = _busy_line(stats)
    assert "worker 3 91%, worker 4 0% (built no batch)," in line, line
    assert line.count("(built no batch)") == 4 and "and 4 more (4 of them built no batch)" in line, line
    assert _verdict(stats).startswith("verdict: too little to judge yet")
    assert "built no batch" not in _stats("classic", working, 0.9, dataset="pipe").summary()


def test_the_busy_time_split_leaves_out_workers_that_built_no_batch() -> None:
    # 4 shards among 8 process workers on 2 CPUs: the 4 with no shard queued for a CPU while
    # they started, and the line split the others' busy time "19% on a CPU, 81% ready but
    # queued for one".
    working = tuple(_worker("", i, fetch_s=0.49, cpu_s=0.1) for i in range(4))
    idle = tuple(_started_only(i, 0.05, 0.3) for i in range(4, 8))
    stats = _stats("classic", working + idle, 0.9, dataset="pipe", batches=4)
    line = _busy_line(stats)
    assert "of that busy time, 20% on a CPU, 0% ready but queued for one" in line, line


def test_workers_that_never_had_a_task_read_as_idle_in_the_verdict() -> None:
    # A map-style dataset of 3 batches an epoch among 8 workers: 5 never get a task. Their
    # start-up ran or queued for a CPU a share of their lives, which the verdict read as the
    # pool at work ("workers idle 70%", and num_workers=4 suggested for 3 workers' work).
    working = tuple(_worker("", i, fetch_s=0.3, cpu_s=0.3) for i in range(3))
    started = tuple(_started_only(i, 0.05, 0.25) for i in range(3, 8))
    stats = _stats("classic", working + started, 0.01)
    verdict = _verdict(stats)
    assert "workers idle 88% of the time" in verdict, verdict  # 3 workers 31% occupied, of 8
    assert stats.suggested_settings() == {"num_workers": 2}


def test_the_setup_line_says_prefetch_factor_once_under_auto() -> None:
    stats = dataclasses.replace(_stats("classic", _busy(2, 0.9, 0.9), 0.9), decisions=(
        TuningDecision(0, 2, 2, 0.0, "start"), TuningDecision(40, 4, 2, 100.0, "faster")))
    setup = stats.summary().splitlines()[1]
    assert setup.count("prefetch_factor") == 1, setup
    assert "num_workers=auto (now 4), worker_type=process, prefetch_factor=2" in setup


def test_idle_thread_workers_do_not_blame_the_main_process() -> None:
    # Thread workers hand batches over without pickling; the demo's read 31% to 47% busy over
    # five runs, and "the main process" was named in three of them.
    threads = _stats("classic", _busy(2, 0.35, 0.35), 0.9, worker_type="thread")
    assert analysis.diagnose(threads).bottleneck == "no single bottleneck"
    assert threads.suggested_settings() == {}
    processes = _stats("classic", _busy(2, 0.35, 0.35), 0.9)
    assert analysis.diagnose(processes).bottleneck == "the main process"


def test_workers_running_outside_their_stages_are_not_idle() -> None:
    # The README's ten lines: the stages read 26% to 40% busy for workers that were on a CPU or
    # queued for one 60% to 70% of their life (per-task work outside the timed stages), and the
    # verdict flipped between "the main process" and "no single bottleneck".
    stats = _stats("classic", _busy(2, 0.3, 0.55, queued=0.1), 0.98)
    assert analysis.occupancy(stats.workers[0]) == pytest.approx(0.65)
    assert analysis.diagnose(stats).bottleneck == "no single bottleneck"
    assert "occupied 65%" in _verdict(stats)


def test_waiting_in_the_hand_over_is_not_read_as_io() -> None:
    # Economic item workers wait for the batch workers while handing items over: more item
    # workers would only wait too. Only a wait inside the dataset asks for more workers.
    handing = tuple(WorkerStats("item", i, tasks=100, samples=800, fetch_s=0.5 * ALIVE_S, collate_s=0.0,
                                transfer_s=0.45 * ALIVE_S, bytes_out=1024, alive_s=ALIVE_S,
                                cpu_s=0.3 * ALIVE_S) for i in range(2))
    batch_workers = tuple(_worker("batch", i, collate_s=0.05, cpu_s=0.05) for i in range(2))
    stats = _stats("economic", handing + batch_workers, 1.0)
    assert stats.suggested_settings() == {}, stats.summary()
    fetching = _busy(2, 0.95, 0.1)
    assert "num_workers" in _stats("classic", fetching, 1.0).suggested_settings()


def test_batches_the_main_process_loads_faster_than_a_worker_hands_one_over_stay_there() -> None:
    # Tiny items inline (15 us a batch) were told "try num_workers=2", 16 times slower when followed.
    def inline(batches: int) -> LoaderStats:
        return _stats("classic", (_worker("main", 0, fetch_s=0.3, collate_s=0.6, tasks=batches),), 0.9,
                      batches=batches)
    fast = inline(100_000)  # 3.6 s of waiting over 100,000 batches: 36 us each
    assert _verdict(fast).endswith("a batch takes 36 us to load, less than a worker process adds to "
                                   "each batch it hands over: keep num_workers=0"), _verdict(fast)
    assert fast.suggested_settings() == {}
    assert inline(BATCHES).suggested_settings() == {"num_workers": 2}  # 18 ms a batch: workers help


def test_large_batches_the_main_process_loads_in_less_than_their_hand_over_stay_there() -> None:
    # 1.5 MiB batches of cheap items, 160 us each inline, were told "try num_workers=2": 1.7x
    # slower when followed (a skeptic's probe at stop 53); handing one over costs more the
    # larger it is.
    def inline(batches: int, batch_bytes: int) -> LoaderStats:
        return _stats("classic", (_worker("main", 0, fetch_s=0.3, collate_s=0.6, tasks=batches,
                                          bytes_out=batch_bytes * batches),), 0.9, batches=batches)
    mib = 1 << 20
    large = inline(20_000, 3 * mib // 2)  # 180 us a batch
    assert large.suggested_settings() == {}
    assert _verdict(large).endswith("less than a worker process adds to each batch it hands over "
                                    "(about 412 us for a batch of 1.5 MiB): keep num_workers=0"), _verdict(large)
    between = inline(7_000, 3 * mib // 2)  # 514 us: above one hand-over, short of paying off
    assert between.suggested_settings() == {} and "for workers to pay off" in _verdict(between)
    assert inline(20_000, 16 * 1024).suggested_settings() == {}  # small, 180 us: still too little
    assert inline(3_000, 16 * 1024).suggested_settings() == {"num_workers": 2}  # 1.2 ms pays
    assert inline(BATCHES, 3 * mib // 2).suggested_settings() == {"num_workers": 2}  # 18 ms a batch


def test_workers_whose_batches_take_less_than_their_measured_hand_over_are_sent_back_to_none() -> None:
    # A stream of 8 us samples: 2 persistent workers at 575 us a batch, 255 us of work each, and
    # 600 us of each worker's time writing each batch over, read "keep these settings" where
    # num_workers=0 loaded 2.2x as fast (a newcomer's probe at stop 53).
    tasks = 2000
    def worker(worker_id: int) -> WorkerStats:
        return WorkerStats("", worker_id, tasks=tasks, samples=16 * tasks, fetch_s=tasks * 200e-6,
                           collate_s=tasks * 55e-6, transfer_s=tasks * 600e-6, bytes_out=tasks * 2048,
                           alive_s=2.4, cpu_s=2.2)
    waits = _stats("classic", (worker(0), worker(1)), 0.95, batches=2 * tasks, steady_s=2 * tasks * 575e-6 / 0.95)
    assert analysis._work_per_batch(waits) < analysis.hand_over_s(waits)  # ~255 us against ~300
    assert waits.suggested_settings() == {"num_workers": 0}, _verdict(waits)
    assert "try num_workers=0" in _verdict(waits)
    fed = _stats("classic", (worker(0), worker(1)), 0.95, batches=2 * tasks, steady_s=2 * tasks * 300e-6 / 0.95)
    assert fed.suggested_settings() != {"num_workers": 0}, _verdict(fed)  # waits under twice the work


# -- workers started anew each epoch ----------------------------------------------------------


def _restarting(first_wait_s: float, *, epochs: int = 4, persistent: bool = False, wait: float = 0.1,
                end_wait_s: float = 0.0, workers: tuple[WorkerStats, ...] | None = None) -> LoaderStats:
    """Stats of ``epochs`` epochs whose first batches took ``first_wait_s`` in all, beside the
    made-up steady ALIVE_S seconds."""
    workers = workers if workers is not None else _busy(2, 0.5, 0.5)
    stats = _stats("classic", workers, wait)
    setup = dataclasses.replace(stats.setup, persistent_workers=persistent)
    return dataclasses.replace(stats, setup=setup, epochs=epochs, first_wait_s=first_wait_s,
                               end_wait_s=end_wait_s)


def test_workers_started_anew_each_epoch_that_take_much_of_it_are_told_to_persist() -> None:
    # Workers slow to start (a heavy worker_init_fn, spawn re-importing a large main module)
    # were told "keep these settings", where persistent_workers=True doubled the throughput.
    stats = _restarting(first_wait_s=4 * 1.0, end_wait_s=4 * 0.05)  # 1 s start, 50 ms stop an epoch
    diagnosis = analysis.diagnose(stats)
    assert diagnosis.bottleneck == "worker start-up"
    assert stats.suggested_settings() == {"persistent_workers": True}
    # Per epoch (8.2 s over 4 epochs): the 1 s start less a batch's work in the workers (2
    # workers busy 0.51 of 4 s, over 200 batches: 20.4 ms), and the 50 ms stop.
    assert "1.03 s of each epoch's 2.05 s (50%)" in diagnosis.advice, diagnosis.advice
    assert "beyond a batch's own 20.4 ms of work" in diagnosis.advice, diagnosis.advice


def test_start_up_is_judged_even_where_the_steady_seconds_are_too_few() -> None:
    # Epochs that are mostly start-up may never gather the 2 s of steady time a verdict needs.
    short = dataclasses.replace(_restarting(first_wait_s=4 * 1.0), wait_s=0.1, compute_s=0.1)
    assert analysis.diagnose(short).bottleneck == "worker start-up"
    assert short.suggested_settings() == {"persistent_workers": True}


def test_start_up_suggestion_comes_with_the_steady_verdicts_own() -> None:
    saturated = _restarting(first_wait_s=4 * 2.0, wait=0.6, workers=_busy(2, 0.95, 0.05))
    diagnosis = analysis.diagnose(saturated)
    assert diagnosis.suggestions["persistent_workers"] is True
    assert diagnosis.suggestions["num_workers"] > 2
    assert "Between the starts, the workers limit loading" in diagnosis.advice, diagnosis.advice


def test_start_up_of_workers_for_batches_lighter_than_a_hand_over_suggests_no_workers() -> None:
    # A trivially cheap dataset, 2 workers started each epoch: told to persist, where
    # num_workers=0 (which the steady verdict would name) loaded it faster than either. 200
    # batches, each worker fetching 8 ms of its 4 s: 2 x 8 ms / 200 = 80 us a batch.
    cheap = _restarting(first_wait_s=4 * 1.0, end_wait_s=4 * 0.05,
                        workers=tuple(_worker("", i, fetch_s=0.002, cpu_s=0.002) for i in range(2)))
    diagnosis = analysis.diagnose(cheap)
    assert diagnosis.bottleneck == "worker start-up"
    assert cheap.suggested_settings() == {"num_workers": 0}
    assert "try num_workers=0, which loads them in the main process" in diagnosis.advice, diagnosis.advice
    assert "persistent_workers=True" not in diagnosis.advice
    # A worker_init_fn sets up what a loader without workers would not have: persist instead.
    setup = dataclasses.replace(cheap.setup, has_worker_init_fn=True)
    assert dataclasses.replace(cheap, setup=setup).suggested_settings() == {"persistent_workers": True}


@pytest.mark.parametrize("stats", [
    pytest.param(_restarting(first_wait_s=4 * 0.2), id="a small share"),
    pytest.param(_restarting(first_wait_s=4 * 1.0, persistent=True), id="persistent already"),
    pytest.param(_restarting(first_wait_s=1.0, epochs=1), id="one epoch"),
    pytest.param(dataclasses.replace(_restarting(first_wait_s=4 * 1.0), batches=20), id="few batches"),
])
def test_start_up_is_not_named_where_persistent_workers_would_gain_little(stats: LoaderStats) -> None:
    assert analysis.diagnose(stats).bottleneck != "worker start-up"
    assert "persistent_workers" not in stats.suggested_settings()


def test_epochs_of_few_batches_whose_first_batches_take_much_of_the_time_are_named() -> None:
    # Four shards, four batches an epoch, persistent workers: the loop waited 52% of the run for
    # each epoch's first batch, and the verdict said "keeps up, waited only 4%" (the steady
    # share alone), which a newcomer read as the whole run.
    stats = dataclasses.replace(_restarting(first_wait_s=0.5 + 50 * 0.08, epochs=51, persistent=True,
                                            wait=0.04),
                                batches=204, opening_wait_s=0.5)
    diagnosis = analysis.diagnose(stats)
    assert diagnosis.bottleneck == "epoch start", diagnosis
    # After the first epoch: 4.0 s of the 8.0 s (the steady 4 s and the first waits), 80 ms an epoch.
    assert "4.00 s of 8.00 s (50%) after the first epoch, 80 ms an epoch" in diagnosis.advice
    assert "with 4 batches an epoch" in diagnosis.advice, diagnosis.advice
    assert "Between the first batches, loading keeps up" in diagnosis.advice, diagnosis.advice
    assert stats.suggested_settings() == {}  # nothing a setting changes


def test_a_loop_that_keeps_up_between_first_batches_says_what_they_took() -> None:
    # Workers started anew each epoch, under the share that names their start: the loop waited
    # 3% after each epoch's first batch and 17% of the run for the first batches, and the
    # verdict read "loading keeps up: the training loop waited only 3% of the time".
    stats = _restarting(first_wait_s=4 * 0.2, wait=0.03)  # 0.8 s beside the steady 4 s
    diagnosis = analysis.diagnose(stats)
    assert diagnosis.bottleneck == "the training loop", diagnosis
    assert ("loading keeps up: the training loop waited only 3% of the time after each epoch's first "
            "batch (") in diagnosis.advice, diagnosis.advice
    assert ("; it waited 0.80 s more for the epochs' first batches and at their ends, 17% of the "
            "4.80 s run") in diagnosis.advice, diagnosis.advice
    assert diagnosis.advice.count("the training loop") == 1
    nearly = analysis.diagnose(_restarting(first_wait_s=4 * 0.2, end_wait_s=0.2, wait=0.1))
    assert "loading nearly keeps up: the training loop waited 10% of the time after each epoch's first batch" \
        in nearly.advice, nearly.advice
    assert "; it waited 1.00 s more for the epochs' first batches and at their ends, 20% of the 5.00 s run" \
        in nearly.advice, nearly.advice
    # Under KEEPS_UP of the run, as a steady wait would be, they need no words.
    quick = analysis.diagnose(_restarting(first_wait_s=4 * 0.05, wait=0.03))
    assert "it waited" not in quick.advice and "after each epoch's first batch" in quick.advice, quick.advice


@pytest.mark.parametrize("opening_wait_s, first_wait_s, workers", [
    (4.0, 4.0 + 3 * 0.05, None), (0.0, 4 * 0.2, None), (0.0, 4 * 1.0, ())],
    ids=["the first epoch's start alone", "a small share", "no workers"])
def test_first_batches_are_not_named_where_they_take_little_after_the_first_epoch(
        opening_wait_s: float, first_wait_s: float, workers: tuple | None) -> None:
    # Without workers every batch is loaded while the loop waits, the first no more than others.
    stats = dataclasses.replace(_restarting(first_wait_s=first_wait_s, persistent=workers is None,
                                            wait=0.04, workers=workers),
                                opening_wait_s=opening_wait_s)
    assert analysis.diagnose(stats).bottleneck == "the training loop"


# -- num_workers="auto" ---------------------------------------------------------------------


def _under_auto(stats: LoaderStats, *decisions: tuple[int, bool]) -> LoaderStats:
    """``stats`` with the tuner's decisions: (num_workers, settled) each."""
    made = tuple(TuningDecision(40 * at, workers, 2, 100.0, "made up", settled)
                 for at, (workers, settled) in enumerate(decisions))
    return dataclasses.replace(stats, decisions=made)


def test_auto_still_trying_settings_is_not_judged() -> None:
    # `pipeload profile --num-workers auto` judged figures that mixed the settings being tried,
    # and could advise a count the tuner was about to try or had just left.
    waiting = _stats("classic", _busy(2, 0.95, 0.02), 0.9)
    trying = _under_auto(waiting, (2, False), (8, False))
    diagnosis = analysis.diagnose(trying)
    assert diagnosis.bottleneck == "still tuning" and trying.suggested_settings() == {}
    assert "still tuning (trying num_workers=8, prefetch_factor=2 since batch 40)" in diagnosis.advice
    settled = _under_auto(waiting, (2, False), (8, True))
    assert analysis.diagnose(settled).bottleneck == "the workers"


def test_start_up_under_auto_says_where_the_tuner_stands() -> None:
    # Workers started anew each epoch under num_workers="auto": the verdict named the start-up
    # alone, while the tuner listed above it was still trying settings, or had settled.
    slow_starts = _restarting(first_wait_s=4 * 1.0, end_wait_s=4 * 0.05)
    trying = _under_auto(slow_starts, (2, False), (4, False))
    diagnosis = analysis.diagnose(trying)
    assert diagnosis.bottleneck == "worker start-up" and trying.suggested_settings() == {"persistent_workers": True}
    assert "try persistent_workers=True, which starts them once. Between the starts, num_workers='auto' is " \
        "still tuning (trying num_workers=4, prefetch_factor=2 since batch 40)" in diagnosis.advice, diagnosis.advice
    settled = analysis.diagnose(_under_auto(slow_starts, (2, False), (4, True)))
    assert "try persistent_workers=True, which starts them once. Between the starts, num_workers='auto' " \
        "settled on num_workers=4, prefetch_factor=2 at batch 40" in settled.advice, settled.advice
    # Too few steady batches yet for a verdict of their own: the tuner's state is still said.
    short = _under_auto(dataclasses.replace(slow_starts, wait_s=0.1, compute_s=0.1), (2, False), (4, False))
    assert "Between the starts, num_workers='auto' is still tuning" in analysis.diagnose(short).advice
    # Epochs whose first batches take the time, with workers kept: the same.
    first_batches = dataclasses.replace(_restarting(first_wait_s=0.5 + 50 * 0.08, epochs=51, persistent=True,
                                                    wait=0.04), batches=204, opening_wait_s=0.5)
    epoch_start = analysis.diagnose(_under_auto(first_batches, (2, False), (4, False)))
    assert epoch_start.bottleneck == "epoch start", epoch_start
    assert "Between the first batches, num_workers='auto' is still tuning" in epoch_start.advice, epoch_start.advice


@pytest.mark.parametrize("decisions", [(), ((8, False), (32, False), (64, True))], ids=["fixed", "auto"])
def test_workers_at_the_most_suggested_count_are_not_told_to_use_it(decisions: tuple) -> None:
    # A tuner at its cap of 64 waiting workers was advised "try num_workers=64".
    waiting = _under_auto(_stats("classic", _busy(64, 0.95, 0.02), 0.9, cpus=4), *decisions)
    verdict = _verdict(waiting)
    assert "num_workers" not in waiting.suggested_settings(), verdict
    assert "try num_workers" not in verdict and "with 64 workers already, the most suggested" in verdict


def test_auto_is_not_told_to_try_a_count_it_went_back_from() -> None:
    waiting = _under_auto(_stats("classic", _busy(16, 0.95, 0.02), 0.9, cpus=1),
                          (1, False), (4, False), (16, False), (64, False), (16, True))
    verdict = _verdict(waiting)
    assert waiting.suggested_settings() == {}, verdict
    assert "num_workers='auto' tried 64 workers and kept 16" in verdict, verdict
    idle = _under_auto(_stats("classic", _busy(8, 0.1, 0.1), 0.01), (2, False), (8, True))
    assert "num_workers" not in idle.suggested_settings(), _verdict(idle)  # 2 was tried: it waited


def test_workers_whose_batches_are_lighter_than_a_hand_over_are_told_to_load_in_the_main_process() -> None:
    # Tiny items with 2 process workers: 33 us of work a batch, 200 us of waiting for each;
    # told "keep these settings", where num_workers=0 loaded 8-10x faster.
    def tiny(collate_s: float) -> LoaderStats:
        workers = tuple(_worker("", i, fetch_s=0.005, collate_s=collate_s, cpu_s=0.6, tasks=50_000)
                        for i in range(2))
        return _stats("classic", workers, 0.97, batches=100_000, steady_s=10.0)  # 97 us of wait each
    light = tiny(0.35)  # (0.02 + 1.4) s of work in each of 2 workers, over 100,000 batches: 28 us
    assert light.suggested_settings() == {"num_workers": 0}, _verdict(light)
    assert "for batches that take 28 us of work each" in _verdict(light), _verdict(light)
    # 72 us of work: more than 1/1.5 of the 97 us wait (WORKERS_PAY_OFF, the line the rule at
    # num_workers=0 draws too; it was 1/2 before stop 53, when 56 us stayed with the workers).
    heavy = tiny(0.9)
    assert heavy.suggested_settings() != {"num_workers": 0}, _verdict(heavy)
