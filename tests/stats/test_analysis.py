"""The summary's verdicts (stats/analysis.py) on stats made to order: no timing involved."""

from __future__ import annotations

import dataclasses

from pipeload.stats.recorder import LoaderSetup
from pipeload.stats.report import LoaderStats, QueueStats, WorkerStats

CPUS = 2


def _worker(kind: str, worker_id: int, *, fetch_s: float = 0.0, collate_s: float = 0.0,
            cpu_s: float = 0.0) -> WorkerStats:
    return WorkerStats(kind, worker_id, tasks=32, samples=256, fetch_s=fetch_s, collate_s=collate_s,
                       transfer_s=0.01, bytes_out=1024, alive_s=1.0, cpu_s=cpu_s)


def _stats(mode: str, workers: tuple[WorkerStats, ...], wait_s: float, compute_s: float,
           worker_type: str = "process") -> LoaderStats:
    setup = LoaderSetup(mode, worker_type, 2, 2, 8, False, CPUS)
    return LoaderStats(setup=setup, batches=32, epochs=1, wait_s=wait_s, compute_s=compute_s,
                       first_batch_s=0.01, pin_s=0.0, pinned=0, workers=workers,
                       queue=QueueStats(0.0, 0, 1.0, 2, 2))


def test_economic_collate_asks_a_bounded_number_of_batch_workers() -> None:
    # The loop waited all the time (it does nothing between batches): n / (1 - wait) workers
    # is unbounded, and it asked for num_batch_workers=1116 in a real run of a sleeping collate.
    # (Item workers that wait on I/O in their little fetching must not turn it into a call for
    # more item workers.)
    items = tuple(_worker("item", i, fetch_s=0.1, cpu_s=0.01) for i in range(2))
    waiting = tuple(_worker("batch", i, collate_s=0.9, cpu_s=0.01) for i in range(2))
    stats = _stats("economic", items + waiting, wait_s=1.0, compute_s=0.0)
    wanted = stats.suggested_settings()["num_batch_workers"]
    assert 3 <= wanted <= 8, stats.summary()
    assert f"num_batch_workers={wanted}" in stats.summary()
    computing = tuple(_worker("batch", i, collate_s=0.9, cpu_s=0.9) for i in range(2))
    stats = _stats("economic", items + computing, wait_s=1.0, compute_s=0.0)
    assert stats.suggested_settings().get("num_batch_workers", CPUS) <= CPUS, stats.summary()


def test_bytes_moved_are_written_in_a_unit_that_shows_them() -> None:
    # 1 KiB per worker read "moved 0.0 MiB": nothing, to a reader.
    stats = _stats("classic", (_worker("", 0, fetch_s=0.9), _worker("", 1, fetch_s=0.9)), 1.0, 0.1)
    assert stats.bytes_moved == 2048
    assert "moved 2.0 KiB of tensors" in stats.summary()
    big = dataclasses.replace(stats, workers=(dataclasses.replace(_worker("", 0), bytes_out=3 * 2**20),))
    assert "moved 3.0 MiB of tensors" in big.summary()


def test_without_workers_nothing_is_said_to_be_moved() -> None:
    stats = _stats("classic", (_worker("main", 0, fetch_s=0.9),), 1.0, 0.1)
    assert "moved" not in stats.summary()
    assert "skipped samples: 0" in stats.summary()


def test_a_loop_that_keeps_workers_waiting_says_they_idle() -> None:
    idle = tuple(_worker("", i, fetch_s=0.05) for i in range(2))
    stats = _stats("classic", idle, wait_s=0.01, compute_s=1.0)
    text = stats.summary()
    assert "bottleneck: the training loop" in text
    assert "workers idle 94% of the time" in text, text
    assert "num_workers" not in stats.suggested_settings() or stats.suggested_settings()["num_workers"] < 2


def _pinning(stats: LoaderStats, pin_s: float) -> LoaderStats:
    return dataclasses.replace(stats, setup=dataclasses.replace(stats.setup, pin_memory=True),
                               pin_s=pin_s, pinned=stats.batches)


def test_pinning_that_takes_most_of_the_time_is_named() -> None:
    # Inline, pinning 50 times longer than collating read "`collate_fn` takes most of it".
    inline = _stats("classic", (_worker("main", 0, fetch_s=0.002, collate_s=0.004),), 1.0, 0.1)
    for stats in (_pinning(inline, 0.2), _pinning(_stats("classic", (_worker("", 0, fetch_s=0.01),), 1.0, 0.1), 0.8)):
        text = stats.summary()
        assert "bottleneck: pinning" in text, text
        assert stats.suggested_settings() == {"pin_memory": False}
    assert "bottleneck: pinning" not in _pinning(inline, 0.001).summary()


def test_pin_memory_without_anything_pinned_says_so() -> None:
    stats = dataclasses.replace(_stats("classic", (_worker("", 0, fetch_s=0.9),), 1.0, 0.1),
                                )
    stats = dataclasses.replace(stats, setup=dataclasses.replace(stats.setup, pin_memory=True))
    assert "pin_memory=True (nothing pinned: no accelerator)" in stats.summary()
    assert "pin_memory=True," in _pinning(stats, 0.1).summary()


def test_economic_collate_held_back_by_prefetch_factor_asks_for_it() -> None:
    # Economic mode collates at most prefetch_factor batches at once: with 2, a 4th batch
    # worker gained nothing in a real run (61 -> 59 batches/s), where the verdict asked for
    # num_batch_workers=8, then (with 4 idling half the time) for a larger batch_size.
    items = tuple(_worker("item", i, fetch_s=0.05, cpu_s=0.05) for i in range(2))
    saturated = tuple(_worker("batch", i, collate_s=0.9, cpu_s=0.01) for i in range(2))
    wanted = _stats("economic", items + saturated, 1.0, 0.0).suggested_settings()
    assert wanted["prefetch_factor"] == wanted["num_batch_workers"] > 2, wanted
    held_back = tuple(_worker("batch", i, collate_s=0.5, cpu_s=0.01) for i in range(4))
    stats = _stats("economic", items + held_back, 1.0, 0.0)
    assert stats.suggested_settings() == {"prefetch_factor": 4}, stats.summary()
    assert "bottleneck: `collate_fn`" in stats.summary()


def test_economic_workers_busy_is_given_per_kind() -> None:
    # One mean over item and batch workers ("workers busy 46%" with item workers at 90% and
    # batch workers at 2%) described neither kind.
    items = tuple(_worker("item", i, fetch_s=0.9) for i in range(2))
    batches = tuple(_worker("batch", i, collate_s=0.02) for i in range(2))
    text = _stats("economic", items + batches, 1.0, 0.0).summary()
    assert "item workers busy 91%, batch workers busy 3% of the time" in text, text


def test_thread_workers_taking_turns_on_the_gil_are_told_to_use_processes() -> None:
    # Two thread workers running Python code ran one CPU's worth between them (0.13 s each of
    # 0.25 s busy in a real run): the GIL lets one run at a time. More threads cannot help.
    turns = tuple(_worker("", i, fetch_s=0.9, cpu_s=0.45) for i in range(2))
    stats = _stats("classic", turns, 1.0, 0.1, worker_type="thread")
    assert "bottleneck: `__getitem__`" in stats.summary()
    assert "GIL" in stats.summary()
    assert stats.suggested_settings() == {"worker_type": "process"}
    sleeping = tuple(_worker("", i, fetch_s=0.9, cpu_s=0.01) for i in range(2))
    assert stats.suggested_settings() != _stats("classic", sleeping, 1.0, 0.1, "thread").suggested_settings()
    assert "GIL" not in _stats("classic", turns, 1.0, 0.1).summary()  # processes have none


def test_the_queue_line_says_its_capacity_as_such() -> None:
    # "(at most 2)" gave the capacity where QueueStats.max_in_flight said 1: a reader took it
    # for the most seen in flight.
    stats = _stats("classic", (_worker("", 0, fetch_s=0.9),), 1.0, 0.1)
    text = stats.summary()
    assert "1.0 in flight (room for 2)" in text and "at most" not in text, text
