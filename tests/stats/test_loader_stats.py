"""loader.stats(): counts and times per stage and per worker, on every engine, and the words."""

from __future__ import annotations

import math
import os
import threading
import time
from typing import Any

import pytest
import torch
from conftest import sizes_past_errors
from stats.loops import Busy

import pipeload
from pipeload.engine.item_scheduler import piece_size
from pipeload.stats import LoaderStats
from pipeload.stats.clock import StageClock

ITEMS = 96
BATCH = 8
ENGINES = {
    "inline": {"num_workers": 0},
    "process": {"num_workers": 2, "multiprocessing_context": "fork"},
    "thread": {"num_workers": 2, "worker_type": "thread"},
    "economic": {"num_workers": 2, "mode": "economic", "multiprocessing_context": "fork"},
    "economic-thread": {"num_workers": 2, "mode": "economic", "worker_type": "thread"},
}


class Squares(pipeload.Dataset):
    """Item i: a float32 tensor of 4 values; a little work so that every stage takes time."""

    def __len__(self) -> int:
        return ITEMS

    def __getitem__(self, index: int) -> torch.Tensor:
        return torch.full((4,), float(index * index))


@pytest.mark.timeout(60)
@pytest.mark.parametrize("engine", ENGINES.values(), ids=ENGINES.keys())
def test_every_engine_counts_batches_samples_stages_and_bytes(engine: dict, leak_guard) -> None:
    loader = pipeload.DataLoader(Squares(), batch_size=BATCH, **engine)
    started = time.perf_counter()
    for _ in range(2):
        assert sum(len(batch) for batch in loader) == ITEMS
    measured_s = time.perf_counter() - started
    stats = loader.stats()
    assert isinstance(stats, LoaderStats)
    assert stats.batches == 2 * ITEMS // BATCH
    assert stats.epochs == 2
    stages = stats.stages
    if engine.get("mode") == "economic":
        # An item worker reports its pieces after handing them over: the last ones of an epoch
        # may still be on their way when the epoch ends, and nothing waits for them.
        assert 2 * ITEMS - 2 * BATCH <= stages["fetch"].count <= 2 * ITEMS
    else:
        assert stages["fetch"].count == 2 * ITEMS
    if engine == ENGINES["economic"]:
        # The loader's first batch is the main process's: it went out before anything was known
        # of its items (the next set of workers knows their size, and hands these small ones to
        # batch workers from the first batch on).
        assert stages["collate"].count == 2 * ITEMS // BATCH - 1
    else:
        assert stages["collate"].count == 2 * ITEMS // BATCH
    assert stages["fetch"].seconds > 0 and stages["collate"].seconds > 0
    assert stages["wait"].count == stats.batches and stats.wait_s > 0 and stats.first_wait_s > 0
    assert 0 < stats.opening_wait_s < stats.first_wait_s  # the first epoch's, of both epochs'
    assert stats.samples_per_batch == BATCH
    assert 0 < stats.elapsed_s <= measured_s
    assert stats.samples_per_s == pytest.approx(2 * ITEMS / stats.elapsed_s)  # those handed out
    kinds = {w.kind for w in stats.workers}
    if engine["num_workers"] == 0:
        assert kinds == {"main"} and stats.bytes_moved == 0
        return
    assert kinds == ({"item", "batch"} if engine.get("mode") == "economic" else {""})
    # Economic mode's bytes are its item workers' a sample, for the samples handed out
    # (report.py): not short by the pieces whose reports went unread (fetch, above).
    assert stats.bytes_moved == 2 * ITEMS * 4 * 4  # float32 x 4 per sample, each epoch
    assert stages["transfer"].count >= stats.batches
    assert stats.queue.capacity == 2 * (1 if engine.get("mode") == "economic" else 2)
    assert 0 <= stats.queue.mean_in_flight <= stats.queue.capacity
    assert all(0 <= w.busy_fraction <= 1 and w.alive_s > 0 for w in stats.workers)


class Images(pipeload.Dataset):
    """Item i: a 3x40x40 float image, large enough to be laid out in its batch's slab."""

    def __len__(self) -> int:
        return ITEMS

    def __getitem__(self, index: int) -> torch.Tensor:
        return torch.full((3, 40, 40), float(index))


@pytest.mark.timeout(60)
def test_economic_samples_per_s_counts_the_batches_the_main_process_assembled(leak_guard) -> None:
    # Flat samples: the main process assembles every batch and no batch worker starts; it counts
    # their samples itself. Epochs cut short leave prefetched batches never handed out, whose
    # items the item workers fetched all the same: they must not inflate the figure.
    loader = pipeload.DataLoader(Images(), batch_size=BATCH, **ENGINES["economic"], stats=True,
                                 prefetch_factor=4, persistent_workers=True)
    handed_out = 0
    for _ in range(3):
        for number, batch in enumerate(loader):
            assert len(batch) == BATCH
            handed_out += len(batch)
            if number == 1:
                break
    handed_out += sum(len(batch) for batch in loader)
    stats = loader.stats()
    assert "item" in {w.kind for w in stats.workers}
    assert stats.samples_per_batch == BATCH
    assert stats.elapsed_s > 0
    assert stats.samples_per_s == pytest.approx(handed_out / stats.elapsed_s)


@pytest.mark.timeout(60)
def test_persistent_workers_keep_counting_across_epochs(leak_guard) -> None:
    loader = pipeload.DataLoader(Squares(), batch_size=BATCH, num_workers=2, persistent_workers=True,
                                 multiprocessing_context="fork")
    for _ in range(3):
        list(loader)
    stats = loader.stats()
    assert stats.epochs == 3 and stats.batches == 3 * ITEMS // BATCH
    assert sorted(w.worker_id for w in stats.workers) == [0, 1]
    assert sum(w.tasks for w in stats.workers) == stats.batches
    del loader


class FailsInOddBatches(Squares):
    """Every other batch of BATCH fails at its first item (module level: spawn pickles it)."""

    def __getitem__(self, index: int) -> torch.Tensor:
        if (index // BATCH) % 2 == 1:
            raise ValueError("bad sample")
        return super().__getitem__(index)


@pytest.mark.timeout(60)
@pytest.mark.parametrize("engine", ENGINES.values(), ids=ENGINES.keys())
def test_failed_batches_leave_samples_per_batch_at_what_the_loop_received(engine: dict, leak_guard) -> None:
    # A failed batch counted as a task with no samples took samples a batch (and samples/s)
    # to 6.3 of 8 in classic mode, 4.0 in economic mode (a skeptic's probe at stop 53).
    loader = pipeload.DataLoader(FailsInOddBatches(), batch_size=BATCH, **engine)
    received = sizes_past_errors(loader, ValueError)
    stats = loader.stats()
    assert received == [BATCH] * (ITEMS // BATCH // 2) and stats.batches == len(received)
    assert stats.samples_per_batch == BATCH


class FailsLaterInOddBatches(pipeload.Dataset):
    """4 KiB a sample; from batch 40 on, every other batch fails at its fourth sample: past every
    worker's first tasks (all timed), so that most failures fall on untimed tasks."""

    def __len__(self) -> int:
        return 8 * 400

    def __getitem__(self, index: int) -> torch.Tensor:
        number = index // BATCH
        if number >= 40 and number % 2 and index % BATCH == 3:
            raise ValueError("bad sample")
        return torch.full((1024,), float(index))


@pytest.mark.timeout(60)
@pytest.mark.parametrize("engine", ENGINES.values(), ids=ENGINES.keys())
def test_failed_batches_count_no_bytes_moved(engine: dict, leak_guard) -> None:
    # A failed batch moves no tensors, yet its samples scaled the bytes of the timed batches
    # (classic), or its items' bytes counted (economic): 63.8 MiB received read "moved 92.0 MiB".
    # Inline, the bytes are those a worker would hand over (the hand-over rule's, analysis.py).
    loader = pipeload.DataLoader(FailsLaterInOddBatches(), batch_size=BATCH, **engine)
    received, iterator = 0, iter(loader)
    while True:
        try:
            received += next(iterator).nbytes
        except ValueError:
            continue
        except StopIteration:
            break
    stats = loader.stats()
    moved = stats.bytes_moved if engine["num_workers"] else stats.workers[0].bytes_out
    assert moved == received == (40 + 180) * BATCH * 4096
    del iterator, loader


class _UnpicklableFifth:
    """A collate_fn whose batch 5 (timed: among a worker's first) cannot be sent: 2 MiB of
    tensor beside a lock, which pickling refuses after the clock counted the batch's bytes."""

    def __call__(self, samples: list[torch.Tensor]) -> dict[str, Any]:
        batch = torch.stack(samples)
        if int(batch[0, 0]) // BATCH == 5:
            return {"x": torch.zeros(64, 8192), "lock": threading.Lock()}
        return {"x": batch}


def test_a_batch_that_cannot_be_sent_counts_no_bytes_moved(leak_guard) -> None:
    # Counted when its report was made, the batch's bytes stayed when the send failed, and were
    # scaled to every sample: 1.2 MiB received read "moved 5.7 MiB".
    class Rows(pipeload.Dataset):
        def __len__(self) -> int:
            return 40 * BATCH

        def __getitem__(self, index: int) -> torch.Tensor:
            return torch.full((1024,), float(index))

    loader = pipeload.DataLoader(Rows(), batch_size=BATCH, num_workers=1, collate_fn=_UnpicklableFifth(),
                                 multiprocessing_context="fork")
    received, failed, iterator = 0, 0, iter(loader)
    while True:
        try:
            received += next(iterator)["x"].nbytes
        except StopIteration:
            break
        except Exception:
            failed += 1
    assert failed == 1
    assert loader.stats().bytes_moved == received == 39 * BATCH * 4096
    del iterator, loader


@pytest.mark.timeout(60)
def test_a_failing_batch_is_counted_and_the_epoch_goes_on(leak_guard) -> None:
    class FailsOnFive(Squares):
        def __getitem__(self, index: int) -> torch.Tensor:
            if index == 5:
                raise ValueError("bad sample")
            return super().__getitem__(index)

    loader = pipeload.DataLoader(FailsOnFive(), batch_size=BATCH, num_workers=2, worker_type="thread")
    iterator, good = iter(loader), 0
    while True:
        try:
            next(iterator)
            good += 1
        except ValueError:
            continue
        except StopIteration:
            break
    stats = loader.stats()
    assert good == stats.batches == ITEMS // BATCH - 1
    assert sum(w.tasks for w in stats.workers) == ITEMS // BATCH  # the failed one too


def _fails_in_worker_1(worker_id: int) -> None:
    if worker_id == 1:
        raise RuntimeError("no setup for worker 1")


@pytest.mark.timeout(60)
@pytest.mark.parametrize("engine", [ENGINES["process"], ENGINES["thread"]], ids=["process", "thread"])
def test_a_worker_whose_setup_failed_counts_its_failed_tasks_and_no_samples(engine: dict,
                                                                           leak_guard) -> None:
    # It answers each of its tasks with its setup error: tasks (failed ones count), none of
    # them with a sample, whether its tasks are counted by the main process or by its clock.
    loader = pipeload.DataLoader(list(range(40)), batch_size=4, worker_init_fn=_fails_in_worker_1,
                                 **engine)
    iterator, failed = iter(loader), 0
    while True:
        try:
            next(iterator)
        except RuntimeError:
            failed += 1
        except StopIteration:
            break
    workers = {w.worker_id: (w.tasks, w.samples) for w in loader.stats().workers}
    assert failed == 5 and workers == {0: (5, 20), 1: (5, 0)}
    del iterator, loader


def test_first_batch_time_and_the_loops_own_time() -> None:
    loader = pipeload.DataLoader(Squares(), batch_size=BATCH)
    for _ in loader:
        busy_until = time.perf_counter() + 0.002  # the "training step"
        while time.perf_counter() < busy_until:
            pass
    stats = loader.stats()
    assert stats.compute_s >= 0.002 * (stats.batches - 1)
    assert 0 < stats.first_batch_s < stats.elapsed_s


class _SlowToRunDry(pipeload.IterableDataset):
    """200 items, then ``dry_s`` of work before the stream says it has ended (a reader closing
    its last file, say). Its length says so: the loader expects the end after 100 batches of 2."""

    dry_s = 0.05

    def __len__(self) -> int:
        return 200

    def __iter__(self):
        yield from range(200)
        time.sleep(self.dry_s)  # simulated work in the dataset, not a wait in the test


@pytest.mark.timeout(60)
@pytest.mark.parametrize("num_workers", [0, 1], ids=["inline", "process"])
def test_the_loop_waits_for_the_epochs_end_and_the_call_that_ends_it_is_timed(num_workers, leak_guard) -> None:
    # The call that ends an epoch waits for the stream to run dry (and, without persistent
    # workers, for them to stop): timed always, as it was only when it fell on a timed call.
    loader = pipeload.DataLoader(_SlowToRunDry(), batch_size=2, num_workers=num_workers)
    assert len(loader) == 100  # asked, as a progress bar does: the loader expects the end there
    ending_s = 0.0
    for _ in range(2):
        iterator = iter(loader)
        assert len([batch for _, batch in zip(range(100), iterator)]) == 100  # past the first timed ones
        started = time.perf_counter()
        with pytest.raises(StopIteration):
            next(iterator)
        ending_s += time.perf_counter() - started
    stats = loader.stats()
    assert ending_s >= 2 * _SlowToRunDry.dry_s
    assert 2 * _SlowToRunDry.dry_s * 0.9 <= stats.end_wait_s <= ending_s
    assert stats.stages["wait"].seconds >= stats.end_wait_s + stats.first_wait_s + stats.wait_s - 1e-9


@pytest.mark.timeout(60)
@pytest.mark.parametrize("engine", [ENGINES["thread"], ENGINES["economic-thread"]], ids=["thread", "economic-thread"])
def test_thread_workers_time_on_a_cpu_is_read(engine: dict) -> None:
    # A thread worker's clock is read by the main thread, which refreshed the scheduler
    # counters only for its own thread: thread workers read 0 s on a CPU, and computing ones
    # were told they "mostly wait in it (I/O, sleep, locks)".
    loader = pipeload.DataLoader(Busy(96, 0.005), batch_size=4, **engine)
    assert len(list(loader)) == 24
    fetching = [w for w in loader.stats().workers if w.kind in ("", "item")]
    assert sum(w.cpu_s + w.queued_s for w in fetching) > 0.1 * sum(w.fetch_s for w in fetching)


@pytest.mark.timeout(60)
@pytest.mark.parametrize("engine", [ENGINES["process"], ENGINES["economic"]], ids=["process", "economic"])
def test_short_lived_workers_time_on_a_cpu_is_read(engine: dict, leak_guard) -> None:
    # Workers that live under 0.1 s (short epochs, workers not persistent) never refreshed their
    # scheduler counters: "0% on a CPU, 100% waiting inside the work (I/O, sleeps, locks)" for a
    # dataset that only computes, and a verdict asking for more workers than CPUs.
    loader = pipeload.DataLoader(Busy(8, 0.004), batch_size=2, **engine)
    for _ in range(4):
        assert len(list(loader)) == 4
    fetching = [w for w in loader.stats().workers if w.kind in ("", "item")]
    assert sum(w.cpu_s + w.queued_s for w in fetching) > 0.5 * sum(w.fetch_s for w in fetching)


class ColdStart(Busy):
    """As Busy, and each process's first item costs ``cold_s`` more (imports, first page faults)."""

    def __init__(self, count: int, cost_s: float, cold_s: float) -> None:
        super().__init__(count, cost_s)
        self.cold_s, self.warm_in = cold_s, None

    def __getitem__(self, index: int) -> int:
        if self.warm_in != os.getpid():
            self.warm_in = os.getpid()
            Busy(1, self.cold_s)[0]
        return super().__getitem__(index)


@pytest.mark.timeout(60)
def test_economic_item_workers_that_only_compute_are_seen_computing(leak_guard) -> None:
    # Item workers time all of their first 16 pieces, then about one in 64, and report their
    # totals only then: most pieces of an epoch come after the latest totals. The first piece,
    # cold, stood for many untimed ones; and the pieces since the latest totals were added to
    # the stages' seconds but not to the CPU's. Item workers decoding JPEGs read fetch 35% slow,
    # "53% on a CPU, 42% waiting inside the work (I/O, sleeps, locks)": a 1-epoch loop could be
    # told to add workers.
    cold_s, cost_s, count = 0.2, 0.0005, 1536
    loader = pipeload.DataLoader(ColdStart(count, cost_s, cold_s), batch_size=32,
                                 persistent_workers=True, **ENGINES["economic"])
    assert len(list(loader)) == 48  # the workers live on: no last totals at their end
    items = [w for w in loader.stats().workers if w.kind == "item"]
    assert sum(w.tasks for w in items) >= 96  # pieces of at most 16 items
    # A worker cannot have fetched for longer than it lived (the busy loops' wall time, which a
    # loaded machine stretches, stretches both alike).
    assert sum(w.fetch_s for w in items) <= 1.05 * sum(w.alive_s for w in items), loader.stats().summary()
    running = sum(w.cpu_s + w.queued_s for w in items) / sum(w.busy_s for w in items)
    assert running > 0.75, loader.stats().summary()


def test_stats_before_any_batch_say_no_batch_came_yet() -> None:
    # "first batch after 0.0 ms" read as a loader that started at once.
    loader = pipeload.DataLoader(Squares(), batch_size=BATCH)
    assert loader.stats().summary().splitlines()[0].endswith("; no batch yet")


def test_the_first_batch_figure_says_it_is_the_latest_epochs() -> None:
    # After the first epoch the figure is the latest epoch's first batch, no longer the
    # loader's start-up: said so, the line cannot be read as how long the loader took to start.
    loader = pipeload.DataLoader(Squares(), batch_size=BATCH)
    list(loader)
    assert loader.stats().summary().splitlines()[0].endswith(
        f"; first batch after {loader.stats().first_batch_s * 1e3:,.1f} ms")
    list(loader)
    assert "; the latest epoch's first batch after " in loader.stats().summary().splitlines()[0]


def test_stats_off() -> None:
    loader = pipeload.DataLoader(Squares(), batch_size=BATCH, num_workers=2, worker_type="thread",
                                 stats=False)
    assert len(list(loader)) == ITEMS // BATCH
    with pytest.raises(RuntimeError, match="stats are off"):
        loader.stats()


@pytest.mark.timeout(60)
def test_slow_getitem_is_named_and_more_workers_suggested(leak_guard) -> None:
    # Enough to judge: more than 50 batches and 2 s after the first (analysis.MIN_STEADY_*).
    loader = pipeload.DataLoader(Busy(1200, 0.002), batch_size=4, num_workers=1,
                                 multiprocessing_context="fork")
    list(loader)  # the loop does nothing: it waits for nearly every batch
    stats = loader.stats()
    assert stats.wait_fraction > 0.5
    text = stats.summary()
    assert "verdict: the workers limit loading, in the dataset's `__getitem__`" in text, text
    suggested = stats.suggested_settings()
    if stats.setup.cpus > 1:
        assert list(suggested) == ["num_workers"] and 1 < suggested["num_workers"] <= stats.setup.cpus
    else:
        assert suggested == {} and "CPUs are all in use" in text


@pytest.mark.timeout(60)
@pytest.mark.parametrize("engine", ENGINES.values(), ids=ENGINES.keys())
def test_a_short_last_batch_is_counted_as_what_it_holds_in_a_long_run(engine: dict, leak_guard) -> None:
    # Past the first TIME_ALL_FIRST tasks only one task in ~64 is timed; the samples of the
    # others are counted all the same, so a short last batch every epoch adds no drift. (Process
    # workers send their totals with timed tasks only: the tasks since are scaled, so the count
    # may be off by part of a batch per worker, never by a batch per epoch.)
    loader = pipeload.DataLoader(list(range(10)), batch_size=4, persistent_workers=bool(engine["num_workers"]),
                                 **engine)
    epochs = 60  # 3 batches an epoch: 180 tasks, most of them untimed
    for _ in range(epochs):
        assert [len(batch) for batch in loader] == [4, 4, 2]
    stats = loader.stats()
    assert stats.batches == 3 * epochs
    counted = sum(worker.samples for worker in stats.workers if worker.kind != "batch")
    if engine.get("mode") != "economic":  # tasks are counted exactly, not scaled
        assert sum(worker.tasks for worker in stats.workers) == 3 * epochs
    if engine["num_workers"] and engine.get("worker_type") != "thread":
        assert abs(counted - 10 * epochs) < 4 * engine["num_workers"]
    else:
        assert counted == 10 * epochs


class _NotCheap(pipeload.Dataset):
    """Numbers whose items take long enough that economic mode cuts every batch into pieces
    the same way, whatever the timing (an item's cost, slept: only its length counts here;
    see item_scheduler.messages_would_busy_main)."""

    def __init__(self, count: int) -> None:
        self.count = count

    def __len__(self) -> int:
        return self.count

    def __getitem__(self, index: int) -> int:
        time.sleep(0.002)
        return index


@pytest.mark.timeout(60)
@pytest.mark.parametrize("engine", [ENGINES["economic"], ENGINES["economic-thread"]],
                         ids=["economic", "economic-thread"])
def test_economic_workers_counts_are_exact_at_each_epoch_start_in_a_long_run(engine: dict,
                                                                             leak_guard) -> None:
    # Economic workers time one piece (or batch) in ~64 past their first 64 and send their
    # totals only then; the main process counts the other reports per kind and worker (item
    # and batch workers share ids). Each answer to START_EPOCH carries the totals and says its
    # kind: then every piece and batch counts, as what it held (pieces of 3 and 1 items here,
    # which no scaling from the timed ones would get right).
    loader = pipeload.DataLoader(_NotCheap(23), batch_size=10, persistent_workers=True,
                                 num_batch_workers=1, **engine)
    epochs = 60
    for _ in range(epochs):
        assert [len(batch) for batch in loader] == [10, 10, 3]
    # Process workers: every worker has answered the next epoch's start with its totals. Thread
    # workers' clocks are read live: now, as they would count the next epoch's first pieces.
    threads = engine.get("worker_type") == "thread"
    batches = None if threads else iter(loader)
    workers = {(w.kind, w.worker_id): w for w in loader.stats().workers}
    assert sorted(workers) == [("batch", 0), ("item", 0), ("item", 1)]
    pieces = sum(math.ceil(size / piece_size(size, 2, False)) for size in (10, 10, 3))
    items = [workers[("item", i)] for i in (0, 1)]
    # Process workers: the session's first batch begins with one item alone for each item
    # worker (the probes that tell the items' size, engine/economic.py), two pieces more.
    probes = 0 if threads else 2
    assert sum(w.tasks for w in items) == pieces * epochs + probes
    assert sum(w.samples for w in items) == 23 * epochs
    # Process workers: the session's first batch (10 items) is the main process's.
    first = 0 if threads else 1
    assert (workers[("batch", 0)].tasks, workers[("batch", 0)].samples) == (3 * epochs - first,
                                                                          23 * epochs - 10 * first)
    # Thread workers lend their clocks, as a classic pool's do: their reports carry nothing.
    assert len(_lent_clocks(loader)) == (3 if threads else 0)
    del batches, loader


@pytest.mark.slow  # the verdict's rules run fast in tests/stats/test_analysis.py (~3 s)
@pytest.mark.timeout(60)
def test_a_slow_training_loop_is_named(leak_guard) -> None:
    # The training step is a 50 ms sleep (a step waiting on an accelerator): a busy loop would
    # also compete with the workers for the CPUs, and on a loaded machine the workers could then
    # fall behind for real.
    loader = pipeload.DataLoader(Squares(), batch_size=BATCH, num_workers=2,
                                 multiprocessing_context="fork")
    for _ in range(5):  # 55 batches after each epoch's first, ~2.8 s: enough to judge
        for _ in loader:
            time.sleep(0.05)
    text = str(loader.stats())
    assert "verdict: loading keeps up: the training loop waited only" in text, text


def test_pinning_is_timed(pretend_accelerator) -> None:
    loader = pipeload.DataLoader(Squares(), batch_size=BATCH, num_workers=2, worker_type="thread",
                                 pin_memory=True)
    list(loader)
    stages = loader.stats().stages
    assert stages["pin"].count == ITEMS // BATCH and stages["pin"].seconds > 0


def test_skipped_samples_slot_is_zero_until_a_policy_fills_it() -> None:
    loader = pipeload.DataLoader(Squares(), batch_size=BATCH)
    list(loader)
    assert loader.stats().skipped_samples == 0
    loader._stats.skipped(3)  # the hook an on_error= policy calls
    assert loader.stats().skipped_samples == 3


GOOD_SAMPLE = {"__key__": "good", "json": b"{}"}
BROKEN_SAMPLE = {"__key__": "bad", "json": b"{not json"}


def _keys(batch: list) -> list:
    return [sample["__key__"] for sample in batch]


@pytest.mark.timeout(60)
@pytest.mark.filterwarnings("ignore::UserWarning")
@pytest.mark.parametrize("engine", [ENGINES["inline"], ENGINES["process"], ENGINES["thread"]],
                         ids=["inline", "process", "thread"])
def test_samples_skipped_by_on_error_pipes_are_counted_in_every_worker(engine: dict, leak_guard) -> None:
    from pipeload.datapipes.iter import IterableWrapper

    pipe = (IterableWrapper([GOOD_SAMPLE, BROKEN_SAMPLE] * 10).sharding_filter()
            .decode(on_error="skip"))
    loader = pipeload.DataLoader(pipe, batch_size=2, collate_fn=_keys, **engine)
    assert sum(len(batch) for batch in loader) == 10
    assert loader.stats().skipped_samples == 10
    assert "skipped samples: 10" in loader.stats().summary()


@pytest.mark.timeout(60)
@pytest.mark.filterwarnings("ignore::UserWarning")
@pytest.mark.parametrize("engine", [ENGINES["inline"], ENGINES["process"], ENGINES["thread"]],
                         ids=["inline", "process", "thread"])
def test_skipped_samples_are_counted_once_over_epochs_and_loaders(engine: dict, leak_guard) -> None:
    # A pipe's tally lives as long as the pipe: the main process's copy (inline) runs every
    # epoch, and of every loader built over it, so each epoch's clock counts from where the
    # tally stood when it started (each epoch's skips were counted by every later epoch's clock
    # again: 2 epochs of 10 skips read 40).
    from pipeload.datapipes.iter import IterableWrapper

    pipe = (IterableWrapper([GOOD_SAMPLE, BROKEN_SAMPLE] * 10).sharding_filter()
            .decode(on_error="skip"))
    list(pipeload.DataLoader(pipe, batch_size=2, collate_fn=_keys))  # an earlier loader's skips
    loader = pipeload.DataLoader(pipe, batch_size=2, collate_fn=_keys, **engine)
    for _ in range(2):
        assert sum(len(batch) for batch in loader) == 10
    assert loader.stats().skipped_samples == 20


ODD = 402  # 100 batches of 4 and a short one of 2: past the first TIME_ALL_FIRST, timed all


@pytest.mark.parametrize("loader_args", [
    {"batch_sampler": [list(range(i, i + 1 + i % 5)) for i in range(0, 300, 3)]},  # only counting tells
    {"batch_size": None},  # one sample a task
    {"batch_size": 4, "shuffle": True},  # a short last batch every epoch, its number known
], ids=["own-batch-sampler", "no-batching", "batch-sampler"])
def test_inline_samples_are_exact_however_the_batches_are_made(loader_args: dict) -> None:
    # Each epoch's engine (and clock) is new: its first TIME_ALL_FIRST batches are all timed, the
    # rest about one in 64. Their samples are derived from the sampler where it says them, and
    # counted one by one where it does not (a batch sampler of the user's own).
    loader = pipeload.DataLoader(list(range(ODD)), **loader_args)
    epochs, expected = 3, 0
    for _ in range(epochs):
        for batch in loader:
            expected += len(batch) if isinstance(batch, torch.Tensor) else 1
    (main,) = loader.stats().workers
    assert main.samples == expected and main.tasks == len(loader) * epochs


def test_inline_samples_stay_exact_under_a_profiler() -> None:
    # A profiler makes the fetcher open spans for untimed batches too: their samples are then
    # counted, and must not be counted twice over the derived ones.
    loader = pipeload.DataLoader(list(range(ODD)), batch_size=4)
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]):
        list(loader)
    list(loader)
    (main,) = loader.stats().workers
    assert main.samples == 2 * ODD and main.tasks == 2 * 101


@pytest.mark.timeout(60)
def test_a_persistent_pool_looks_at_its_queue_in_every_epoch(leak_guard) -> None:
    # The batch numbers start again each epoch: so does the sampled look at the queue.
    loader = pipeload.DataLoader(list(range(400)), batch_size=2, num_workers=1, persistent_workers=True,
                                 multiprocessing_context="fork")
    list(loader)
    looked = loader._stats._queue.samples
    list(loader)
    assert loader._stats._queue.samples > looked
    del loader


@pytest.mark.timeout(60)
def test_process_workers_tasks_are_exact_long_past_the_timed_start(leak_guard) -> None:
    # Past its first TIME_ALL_FIRST tasks a worker sends its totals with about one in 64; the
    # main process counts the reports that come without, per worker, a burst at a time.
    loader = pipeload.DataLoader(list(range(1000)), batch_size=4, num_workers=2,
                                 multiprocessing_context="fork")
    assert len(list(loader)) == 250
    workers = loader.stats().workers
    assert sum(worker.tasks for worker in workers) == 250
    assert sum(worker.samples for worker in workers) == 1000  # equal batches: exact


def _lent_clocks(loader: pipeload.DataLoader) -> list[StageClock]:
    """The thread workers' clocks, which the main process reads live."""
    return [raw for raw, _ in loader._stats._seen.values() if isinstance(raw, StageClock)]


@pytest.mark.timeout(60)
@pytest.mark.parametrize("persistent", [True, False], ids=["persistent", "per-epoch"])
@pytest.mark.parametrize("loader_args", [
    {"batch_sampler": [list(range(i, i + 1 + i % 5)) for i in range(0, 300, 3)]},  # only counting tells
    {"batch_size": None},  # one sample a task
    {"batch_size": 4, "shuffle": True},  # a short last batch every epoch, its number known
], ids=["own-batch-sampler", "no-batching", "batch-sampler"])
def test_worker_samples_are_exact_however_the_batches_are_made(loader_args: dict, persistent: bool,
                                                               leak_guard) -> None:
    # Thread workers run the process workers' loop, and the main process reads their clocks
    # live: exact. Where the sampler says what the batches hold, an untimed batch's samples are
    # derived (each epoch's last batch, which may be short, is timed by whichever worker gets it).
    loader = pipeload.DataLoader(list(range(ODD)), num_workers=2, worker_type="thread",
                                 persistent_workers=persistent, **loader_args)
    epochs, expected = 3, 0
    for _ in range(epochs):
        for batch in loader:
            expected += len(batch) if isinstance(batch, torch.Tensor) else 1
    workers = loader.stats().workers
    assert sum(worker.samples for worker in workers) == expected
    assert sum(worker.tasks for worker in workers) == len(loader) * epochs
    derived = "batch_sampler" not in loader_args
    assert all((clock.untimed_size is not None) == derived for clock in _lent_clocks(loader))


@pytest.mark.timeout(60)
def test_process_workers_samples_are_exact_at_each_epoch_start(leak_guard) -> None:
    # A persistent process worker answers each START_EPOCH with its totals: then they cover
    # every batch it built, the short last ones (timed, their numbers sent with START_EPOCH)
    # as what they held, the others derived from the batch size.
    loader = pipeload.DataLoader(list(range(ODD)), batch_size=4, shuffle=True, num_workers=2,
                                 persistent_workers=True, multiprocessing_context="fork")
    epochs = 3
    for _ in range(epochs):
        assert sum(len(batch) for batch in loader) == ODD
    batches = iter(loader)  # the next epoch starts: every worker has answered with its totals
    workers = loader.stats().workers
    assert sum(worker.tasks for worker in workers) == 101 * epochs
    assert sum(worker.samples for worker in workers) == ODD * epochs
    del batches, loader


@pytest.mark.timeout(60)
def test_workers_grown_in_place_count_a_later_epoch_exactly(leak_guard) -> None:
    # Workers started mid-epoch (num_workers="auto" growing the pool) get the epoch's batch
    # sizes as the pool has them then: the second epoch's, one batch longer here.
    data = list(range(ODD))
    loader = pipeload.DataLoader(data, batch_size=4, num_workers=2, worker_type="thread",
                                 persistent_workers=True)
    assert sum(len(batch) for batch in loader) == ODD
    data += range(ODD, ODD + 4)  # 101 batches of 4 and a short one of 2: the last is number 101
    batches = iter(loader)
    held = sum(len(next(batches)) for _ in range(10))
    batches._engine.resize(4, 2)
    held += sum(len(batch) for batch in batches)
    assert held == ODD + 4
    workers = loader.stats().workers
    assert len(workers) == 4
    assert [(clock.untimed_size, clock.last_timed) for clock in _lent_clocks(loader)] == [(4, 101)] * 4
    assert sum(worker.samples for worker in workers) == 2 * ODD + 4
    assert sum(worker.tasks for worker in workers) == 101 + 102
    del batches, loader


class _CountsTasksPerWorker(pipeload.Dataset):
    """Numbers; every batch fetched counts one task for the worker that fetched it, in memory
    shared with the test (fork)."""

    def __init__(self, count: int, workers: int) -> None:
        import multiprocessing

        self._count = count
        self.tasks = multiprocessing.Array("i", workers)

    def __len__(self) -> int:
        return self._count

    def __getitem__(self, index: int) -> int:
        return index

    def __getitems__(self, indices: list[int]) -> list[int]:
        worker = pipeload.get_worker_info()
        with self.tasks.get_lock():
            self.tasks[worker.id] += 1
        return list(indices)


POOLED = {"process": ENGINES["process"], "thread": ENGINES["thread"]}


@pytest.mark.timeout(60)
@pytest.mark.parametrize("engine", POOLED.values(), ids=POOLED.keys())
def test_workers_tasks_are_exact_per_worker_after_an_abandoned_epoch(engine: dict, leak_guard) -> None:
    # The pool's ledger counts each worker's answers; an epoch left early leaves tasks that the
    # workers build and answer before the next epoch starts, outside any epoch's ledger: each
    # still counts, for the worker that built it.
    dataset = _CountsTasksPerWorker(1000, 2)
    loader = pipeload.DataLoader(dataset, batch_size=4, persistent_workers=True, **engine)
    assert len(list(loader)) == 250
    batches = iter(loader)
    for _ in range(30):
        next(batches)
    del batches  # abandoned: the tasks sent ahead are built all the same
    assert len(list(loader)) == 250
    workers = loader.stats().workers
    assert [worker.tasks for worker in workers] == list(dataset.tasks)
    assert sum(worker.samples for worker in workers) == 4 * sum(dataset.tasks)
    del loader


@pytest.mark.timeout(60)
@pytest.mark.parametrize("engine", POOLED.values(), ids=POOLED.keys())
def test_workers_grown_and_shrunk_in_place_count_exactly_per_worker(engine: dict, leak_guard) -> None:
    dataset = _CountsTasksPerWorker(2000, 4)
    loader = pipeload.DataLoader(dataset, batch_size=4, persistent_workers=True, **engine)
    batches = iter(loader)
    handed = sum(1 for _ in zip(range(100), batches))
    batches._engine.resize(4, 2)
    handed += sum(1 for _ in zip(range(200), batches))
    batches._engine.resize(2, 2)  # workers 2 and 3 stop once idle: their counts are kept
    handed += sum(1 for _ in batches)
    assert handed == 500
    workers = loader.stats().workers
    assert sum(worker.tasks for worker in workers) == 500
    assert [worker.tasks for worker in workers] == list(dataset.tasks)
    del batches, loader


def test_epochs_of_one_batch_are_said_to_give_nothing_to_judge(leak_guard) -> None:
    # Each epoch's first batch is start-up and never judged: epochs of one batch leave nothing
    # to judge however many there are, yet the verdict asked for "about 50 more batches".
    loader = pipeload.DataLoader(Squares(), batch_size=ITEMS, num_workers=2, multiprocessing_context="fork")
    for _ in range(3):
        assert len(list(loader)) == 1
    stats = loader.stats()
    verdict = stats.summary().splitlines()[-1]
    assert "none of the 3 epochs handed out more than one batch" in verdict, verdict
    assert "about" not in verdict and stats.suggested_settings() == {}


class _SlowToStartBatches(torch.utils.data.Sampler[list[int]]):
    """Batches of 4 that spend ``seconds`` of CPU in ``iter()`` itself, as starting an epoch's
    workers does."""

    def __init__(self, length: int, seconds: float) -> None:
        self.length, self.seconds = length, seconds

    def __len__(self) -> int:
        return self.length // 4

    def __iter__(self):  # noqa: ANN204  (not a generator: the cost is paid when iter() is called)
        until = time.perf_counter() + self.seconds
        while time.perf_counter() < until:
            pass
        return iter([list(range(start, start + 4)) for start in range(0, self.length, 4)])


def test_the_first_batch_and_the_elapsed_time_include_what_iter_spends() -> None:
    # Starting an epoch (spawn workers receiving a large dataset: seconds) happens inside iter();
    # it was left out, and a loop that waited 4 s an epoch read "first batch after 11 ms".
    loader = pipeload.DataLoader(list(range(16)), batch_sampler=_SlowToStartBatches(16, 0.3))
    started = time.perf_counter()
    for _ in loader:
        pass
    measured = time.perf_counter() - started
    stats = loader.stats()
    assert 0.3 <= stats.first_batch_s <= measured and 0.3 <= stats.first_wait_s
    assert stats.elapsed_s == pytest.approx(measured, rel=0.25)


def test_economic_mode_counts_the_bytes_its_item_workers_moved() -> None:
    # Batches the main process assembles from item workers' rows were left out: 800 MiB moved
    # read "moved 8.0 MiB".
    loader = pipeload.DataLoader([torch.ones(65536) for _ in range(64)], batch_size=8, num_workers=2,
                                 mode="economic")
    received = sum(batch.nbytes for batch in loader)
    assert loader.stats().bytes_moved == received == 64 * 65536 * 4


@pytest.mark.timeout(60)
def test_economic_mode_counts_the_tensors_its_batch_workers_made_from_items_that_are_no_tensors() -> None:
    # NumPy items hold no tensor: the item workers count nothing, and the batch workers'
    # collated tensors went uncounted: 4 MiB handed to the loop read "moved 0 bytes".
    numpy = pytest.importorskip("numpy")
    items = [numpy.ones(16384, dtype=numpy.float32) for _ in range(64)]
    loader = pipeload.DataLoader(items, batch_size=8, num_workers=2, mode="economic", worker_type="thread")
    received = sum(batch.nbytes for batch in loader)
    stats = loader.stats()
    assert stats.assembled_batches == 0  # every batch was collated by a batch worker
    assert stats.bytes_moved == received == 64 * 16384 * 4


TINY = {"inline": {"num_workers": 0},
        "process": {"num_workers": 2, "multiprocessing_context": "fork"}}


def _busy_for(seconds: float) -> None:
    """The loop's own work outside the loader (a busy loop: it occupies the CPU as work does)."""
    until = time.perf_counter() + seconds
    while time.perf_counter() < until:
        pass


@pytest.mark.timeout(60)
@pytest.mark.parametrize("engine", TINY.values(), ids=TINY.keys())
def test_samples_per_s_on_tiny_batches_agrees_with_a_stopwatch(engine: dict, leak_guard) -> None:
    # Batches of tens of us: the timed batches wait longer than the others (the timing's own
    # work falls on them), and scaling their seconds to every batch read samples/s at half a
    # stopwatch's rate and less (once a twentieth), with more seconds than the run took.
    loader = pipeload.DataLoader(list(range(12_000)), batch_size=4, **engine)
    samples, started = 0, time.perf_counter()
    for _ in range(2):
        for batch in loader:
            samples += len(batch)
    measured_s = time.perf_counter() - started
    stats = loader.stats()
    assert stats.elapsed_s <= measured_s, (stats.elapsed_s, measured_s)
    # Generous bounds: what is checked is a clock, not a loaded machine's speed.
    assert 0.5 <= stats.samples_per_s / (samples / measured_s) <= 1.5, stats.summary()
    del loader


@pytest.mark.timeout(60)
@pytest.mark.parametrize("engine", [TINY["inline"], TINY["process"],
                                    {**TINY["process"], "persistent_workers": True}],
                         ids=["inline", "process", "persistent"])
def test_epochs_left_by_break_count_only_their_own_time(engine: dict, leak_guard) -> None:
    # An epoch broken off ends when its iterator goes, not at the next epoch's iter() nor at the
    # stats' reading: what the loop does between epochs (validation, saving) is not loading.
    loader = pipeload.DataLoader(list(range(4_000)), batch_size=4, **engine)
    inside_s = 0.0
    for _ in range(3):
        started = time.perf_counter()
        for handed, _batch in enumerate(loader):
            if handed == 300:
                break
        inside_s += time.perf_counter() - started
        _busy_for(0.3)  # between epochs
    stats = loader.stats()
    assert stats.batches == 3 * 301
    assert stats.elapsed_s <= inside_s, (stats.elapsed_s, inside_s)
    assert stats.elapsed_s >= 0.5 * inside_s, (stats.elapsed_s, inside_s)
    del loader


def _heavy_set_up(worker_id: int) -> None:
    time.sleep(0.8)  # the workload: each new worker's set-up (loading a model, opening stores)


@pytest.mark.timeout(60)
def test_workers_slow_to_start_each_epoch_are_told_to_persist(leak_guard) -> None:
    # Start-up was never judged: each epoch's first batch is left out of the steady verdict,
    # whose 2 s such a loader may never gather, and one that did was told "keep these settings"
    # while persistent_workers=True doubled its throughput.
    loader = pipeload.DataLoader(list(range(400)), batch_size=4, worker_init_fn=_heavy_set_up,
                                 **TINY["process"])
    for _ in range(3):
        assert len(list(loader)) == 100
    stats = loader.stats()
    verdict = stats.summary().splitlines()[-1]
    assert stats.suggested_settings() == {"persistent_workers": True}, verdict
    assert "the workers start anew each epoch" in verdict and "try persistent_workers=True" in verdict
    del loader


@pytest.mark.slow  # ~3.5 s; test_analysis covers the quiet case
@pytest.mark.timeout(60)
def test_workers_quick_to_start_are_not_told_to_persist(leak_guard) -> None:
    loader = pipeload.DataLoader(list(range(320)), batch_size=4, **TINY["process"])
    for _ in range(2):
        for _batch in loader:
            _busy_for(0.02)  # a training step: forked workers start in a small share of an epoch
    stats = loader.stats()
    assert stats.elapsed_s >= 2.0  # enough to judge the start-up
    assert "persistent_workers" not in stats.suggested_settings(), stats.summary()
    del loader


def _growing_batches() -> list[list[int]]:
    """A batch sampler's batches that grow over the epoch (a length-sorted or token-budget
    sampler's shape): 20 of 2 samples, then 60 of 64."""
    sizes, start, batches = [2] * 20 + [64] * 60, 0, []
    for size in sizes:
        batches.append(list(range(start, start + size)))
        start += size
    return batches


@pytest.mark.timeout(90)
@pytest.mark.parametrize("engine", [ENGINES["process"], ENGINES["economic"]], ids=["process", "economic"])
def test_process_workers_samples_are_exact_when_a_batch_samplers_sizes_change_over_the_epoch(
        engine: dict, leak_guard) -> None:
    # Between their timed tasks a process worker's (or batch worker's) samples were estimated
    # from the timed ones, the first batches here: 28x too few samples, and samples/s with them.
    # The main process knows each batch's indices: counted as each answer comes.
    batches = _growing_batches()
    loader = pipeload.DataLoader(list(range(4000)), batch_sampler=batches, **engine)
    expected = sum(len(batch) for batch in loader)
    assert expected == sum(len(batch) for batch in batches)
    stats = loader.stats()
    if engine.get("mode") == "economic":
        # An item worker reports its pieces after handing them over: the last piece of the
        # epoch (at most a batch) may still be on its way when the epoch ends, and nothing waits
        # for it (test_every_engine_counts_batches_samples_stages_and_bytes says the same).
        assert expected - 64 <= stats.stages["fetch"].count <= expected
    else:
        assert stats.stages["fetch"].count == expected
    assert stats.samples_per_batch == pytest.approx(expected / len(batches))
    del loader


class _Counted(pipeload.Dataset):
    """Numbers with a ``__len__`` of the dataset's own: the loader asks it only once the workers
    have started, so they learn where the epoch ends afterwards."""

    def __init__(self, count: int) -> None:
        self.count = count

    def __len__(self) -> int:
        return self.count

    def __getitem__(self, index: int) -> int:
        return index


@pytest.mark.timeout(60)
def test_a_short_last_batch_of_a_first_epoch_is_counted_as_what_it_holds_when_the_length_is_the_datasets_own(
        leak_guard) -> None:
    # Long enough that most tasks go untimed (their samples derived from the batch size): the
    # epoch's short last batch must still be timed, though the workers started before the
    # length (and so the last batch's number) was known.
    count = 4 * 200 + 2
    loader = pipeload.DataLoader(_Counted(count), batch_size=4, num_workers=2, worker_type="thread",
                                 persistent_workers=True)
    assert sum(len(batch) for batch in loader) == count
    stats = loader.stats()
    assert sum(worker.samples for worker in stats.workers) == count


class _LengthUnknown(torch.utils.data.Sampler):
    """A stream of keys that cannot say how many (its ``__len__`` raises, as many do)."""

    def __iter__(self):
        return iter(range(6))

    def __len__(self) -> int:
        raise NotImplementedError("a stream has no length")


@pytest.mark.parametrize("num_workers", [0, 2])
def test_a_sampler_that_cannot_say_its_length_loads_with_stats_on_as_with_torch(num_workers, leak_guard) -> None:
    # torch never asks a sampler's length while iterating; the stats must not either.
    ours = pipeload.DataLoader(list(range(6)), batch_size=2, sampler=_LengthUnknown(), num_workers=num_workers)
    theirs = torch.utils.data.DataLoader(list(range(6)), batch_size=2, sampler=_LengthUnknown(),
                                         num_workers=num_workers)
    assert [batch.tolist() for batch in ours] == [batch.tolist() for batch in theirs]
    assert ours.stats().batches == 3


@pytest.mark.timeout(60)
def test_workers_of_an_epoch_left_early_are_seen_computing(leak_guard) -> None:
    # An epoch left early ends before its workers' next timed task: their latest totals are
    # their first tasks', extrapolated to the tasks since. The last of those tasks came after
    # the scheduler counters were last read, so the stages grew with the extrapolation and the
    # CPU did not: a dataset that only computes, left at batch 40, read "24% waiting inside the
    # work (I/O, sleeps, locks)" (`pipeload profile` leaves its second epoch so).
    # (Process workers: thread workers also wait for the GIL, which reads as waiting.)
    loader = pipeload.DataLoader(Busy(4 * 64, 0.001), batch_size=4, **ENGINES["process"])
    for number, _ in enumerate(loader):
        if number == 40:
            break
    workers = [w for w in loader.stats().workers if w.kind == ""]
    assert sum(w.tasks for w in workers) >= 41
    running = sum(w.cpu_s + w.queued_s for w in workers) / sum(w.busy_s for w in workers)
    assert running > 0.85, loader.stats().summary()


@pytest.mark.timeout(60)
@pytest.mark.parametrize("engine", ENGINES.values(), ids=ENGINES.keys())
def test_two_live_iterators_of_one_loader_count_every_batch_they_hand_out(engine: dict, leak_guard) -> None:
    # Without persistent workers each iterator has its own (torch lets two run at once): the
    # older one's batches after the newer one started went uncounted (12 of 20, stop 53).
    loader = pipeload.DataLoader(Squares(), batch_size=BATCH, **engine)
    first = iter(loader)
    received = [next(first), next(first)]
    second = iter(loader)
    for pair in zip(first, second):
        received += pair
    received += list(first) + list(second)
    stats = loader.stats()
    assert len(received) == 2 * ITEMS // BATCH == stats.batches and stats.epochs == 2
    del first, second
    assert loader.stats().batches == 2 * ITEMS // BATCH  # and once they are gone


@pytest.mark.filterwarnings("ignore:This DataLoader will create:UserWarning")  # 2 CPUs here
@pytest.mark.timeout(60)
def test_item_workers_that_fetch_no_piece_are_said_so_in_their_own_words(leak_guard) -> None:
    # One batch of two items for four item workers: two fetch nothing. "(built no batch)" is a
    # classic worker's words; an economic item worker got none and was shown as a bare "0%".
    loader = pipeload.DataLoader(Squares(), batch_size=2, sampler=[0, 1], num_workers=4,
                                 mode="economic", multiprocessing_context="fork")
    assert len(list(loader)) == 1
    items = [w for w in loader.stats().workers if w.kind == "item"]
    idle = [w for w in items if w.tasks == 0]
    assert len(items) == 4 and len(idle) == 2, [(w.worker_id, w.tasks) for w in items]
    line = next(line for line in loader.stats().summary().splitlines() if "workers busy" in line)
    assert f"item worker {idle[0].worker_id} 0% (fetched no piece)" in line, line
    assert "built no batch" not in line, line
    del loader


def _classic_lines(loader: Any) -> list[Any]:
    return [w for w in loader.stats().workers if w.kind == ""]


@pytest.mark.filterwarnings("ignore:This DataLoader will create:UserWarning")  # 2 CPUs here
@pytest.mark.timeout(60)
@pytest.mark.parametrize("persistent, epochs", [(False, 2), (True, 1)], ids=["pool-per-epoch", "persistent"])
def test_process_workers_that_get_no_batch_are_listed_and_averaged_with_the_others(
        persistent: bool, epochs: int, leak_guard) -> None:
    # 3 batches an epoch for 8 workers: the 5 that never got a task sent no report, and the
    # summary listed 3 workers (and averaged over them) with num_workers=8 in its setup.
    loader = pipeload.DataLoader(Squares(), batch_size=ITEMS // 3, num_workers=8,
                                 persistent_workers=persistent, multiprocessing_context="fork")
    for _ in range(epochs):
        assert len(list(loader)) == 3
    workers = _classic_lines(loader)
    assert [w.worker_id for w in workers] == list(range(8))
    assert sum(w.tasks for w in workers) == 3 * epochs
    idle = [w for w in workers if w.tasks == 0]
    assert len(idle) >= 5 and all(w.busy_fraction == 0 for w in idle)
    line = next(line for line in loader.stats().summary().splitlines() if line.startswith("workers busy"))
    assert f"worker {idle[-1].worker_id} 0% (built no batch)" in line, line
    del loader


@pytest.mark.timeout(60)
def test_workers_grown_in_place_that_get_no_batch_keep_their_lines_once_shrunk_away(leak_guard) -> None:
    loader = pipeload.DataLoader(Squares(), batch_size=BATCH, num_workers=2, prefetch_factor=2,
                                 persistent_workers=True, multiprocessing_context="fork")
    batches = iter(loader)
    handed = sum(1 for _ in zip(range(ITEMS // BATCH - 2), batches))
    batches._engine.resize(6, 2)  # every task is out: the 4 new workers get none
    assert len(_classic_lines(loader)) == 6
    batches._engine.resize(2, 2)  # they stop once idle: their (empty) lines stay
    handed += sum(1 for _ in batches)
    assert handed == ITEMS // BATCH
    workers = _classic_lines(loader)
    assert [w.worker_id for w in workers] == list(range(6))
    assert sum(w.tasks for w in workers) == ITEMS // BATCH
    del batches, loader


@pytest.mark.filterwarnings("ignore:This DataLoader will create:UserWarning")  # 2 CPUs here
@pytest.mark.timeout(60)
def test_economic_item_workers_that_get_no_piece_are_listed(leak_guard) -> None:
    loader = pipeload.DataLoader(Squares(), batch_size=2, num_workers=6, mode="economic",
                                 sampler=range(2), multiprocessing_context="fork")
    assert len(list(loader)) == 1  # one batch of 2 items: 2 pieces at most, for 6 item workers
    items = [w for w in loader.stats().workers if w.kind == "item"]
    assert [w.worker_id for w in items] == list(range(6))
    assert sum(w.samples for w in items) == 2
    del loader
