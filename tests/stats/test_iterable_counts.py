"""loader.stats() over iterable datasets: the tasks and samples of every worker are the batches
and samples it handed out, on every engine. The task that finds its replica dry builds no
batch, and is no task (before, each replica's last task was counted, whatever the engine)."""

from __future__ import annotations

import io
import tarfile
from collections import Counter
from pathlib import Path
from typing import Any

import pytest
from conftest import sizes_past_errors

import pipeload

BATCH = 4
EPOCHS = 2
ENGINES = {
    "inline": {"num_workers": 0},
    "process": {"num_workers": 2, "multiprocessing_context": "fork"},
    "thread": {"num_workers": 2, "worker_type": "thread"},
    "process-persistent": {"num_workers": 2, "multiprocessing_context": "fork", "persistent_workers": True},
    "thread-persistent": {"num_workers": 2, "worker_type": "thread", "persistent_workers": True},
}
# Samples per replica: full batches only (the dry replica is found by a task that takes nothing),
# a short last batch (kept, or dropped: then the task that took it finds the replica dry), and a
# long stream, whose last task comes past the first TIME_ALL_FIRST tasks (all timed).
PER_REPLICA = {"full": 16, "short": 14, "long": 403}
POOLED = ["process", "thread", "process-persistent", "thread-persistent"]


class Stream(pipeload.IterableDataset):
    """Each replica (one per worker) yields ``per_replica`` ints, ``i * replicas + replica``:
    a sample's remainder names the worker that yielded it."""

    def __init__(self, per_replica: int) -> None:
        self.per_replica = per_replica

    def __iter__(self) -> Any:
        info = pipeload.get_worker_info()
        replica, replicas = (info.id, info.num_workers) if info is not None else (0, 1)
        return iter(range(replica, self.per_replica * replicas, replicas))


def _pipe(per_replica: int, replicas: int) -> Any:
    """A DataPipe graph sharded round robin: the same samples as ``Stream``, per worker."""
    from pipeload.datapipes.iter import IterableWrapper

    return IterableWrapper(range(per_replica * replicas)).sharding_filter()


def _handed_out(loader: pipeload.DataLoader, replicas: int) -> tuple[Counter, Counter]:
    """(batches, samples) per worker id that the loader handed out over EPOCHS epochs."""
    batches: Counter = Counter()
    samples: Counter = Counter()
    for _ in range(EPOCHS):
        for batch in loader:
            worker = int(batch[0]) % replicas
            batches[worker] += 1
            samples[worker] += len(batch)
    return batches, samples


def _check_counts(loader: pipeload.DataLoader, replicas: int) -> None:
    batches, samples = _handed_out(loader, replicas)
    stats = loader.stats()
    workers = {worker.worker_id: worker for worker in stats.workers}
    assert {w: workers[w].tasks for w in workers} == dict(batches)
    assert {w: workers[w].samples for w in workers} == dict(samples)
    assert stats.batches == stats.stages["collate"].count == sum(batches.values())
    assert stats.stages["fetch"].count == sum(samples.values())
    assert stats.samples_per_batch == pytest.approx(sum(samples.values()) / sum(batches.values()))


@pytest.mark.timeout(60)
@pytest.mark.parametrize("drop_last", [False, True], ids=["keep-last", "drop-last"])
@pytest.mark.parametrize("per_replica", PER_REPLICA.values(), ids=PER_REPLICA.keys())
@pytest.mark.parametrize("engine", ENGINES.values(), ids=ENGINES.keys())
def test_an_iterable_datasets_tasks_and_samples_are_the_batches_handed_out(
        engine: dict, per_replica: int, drop_last: bool, leak_guard) -> None:
    loader = pipeload.DataLoader(Stream(per_replica), batch_size=BATCH, drop_last=drop_last, **engine)
    _check_counts(loader, max(1, engine["num_workers"]))


@pytest.mark.timeout(60)
@pytest.mark.parametrize("drop_last", [False, True], ids=["keep-last", "drop-last"])
@pytest.mark.parametrize("engine", [ENGINES["inline"], ENGINES["process"], ENGINES["thread-persistent"]],
                         ids=["inline", "process", "thread-persistent"])
def test_a_datapipe_graphs_tasks_and_samples_are_the_batches_handed_out(
        engine: dict, drop_last: bool, leak_guard) -> None:
    replicas = max(1, engine["num_workers"])
    loader = pipeload.DataLoader(_pipe(PER_REPLICA["short"], replicas), batch_size=BATCH,
                                 drop_last=drop_last, **engine)
    _check_counts(loader, replicas)


@pytest.mark.timeout(60)
@pytest.mark.parametrize("engine", [ENGINES["inline"], ENGINES["process"], ENGINES["thread"]],
                         ids=["inline", "process", "thread"])
def test_unbatched_samples_of_an_iterable_dataset_are_one_task_each(engine: dict, leak_guard) -> None:
    replicas = max(1, engine["num_workers"])
    loader = pipeload.DataLoader(Stream(PER_REPLICA["short"]), batch_size=None,
                                 collate_fn=_as_list, **engine)
    _check_counts(loader, replicas)


def _as_list(sample: int) -> list[int]:
    return [sample]


def _write_shards(directory: Path, shards: int, samples: int) -> list[str]:
    """``shards`` tar files of ``samples`` samples each, a sample one ``.cls`` member."""
    paths = []
    for shard in range(shards):
        path = directory / f"shard-{shard}.tar"
        with tarfile.open(path, "w") as tar:
            for index in range(samples):
                data = str(index).encode()
                member = tarfile.TarInfo(f"s{shard}_{index:03d}.cls")
                member.size = len(data)
                tar.addfile(member, io.BytesIO(data))
        paths.append(str(path))
    return paths


def _label(sample: dict[str, Any]) -> Any:
    return sample["cls"]


@pytest.mark.timeout(60)
@pytest.mark.filterwarnings("ignore:This DataLoader will create 4 worker processes")  # 2 CPUs here
@pytest.mark.parametrize("engine", [ENGINES[name] for name in POOLED], ids=POOLED)
def test_workers_beyond_the_shards_have_no_busy_time(tmp_path: Path, engine: dict, leak_guard) -> None:
    # The README's tar shards, fewer than workers: those with no shard build no batch. Their one
    # task each epoch only started their run over the graph and found it empty, and they
    # answered that they had nothing: 4 shards among 8 process workers read "worker 5 77%
    # (built no batch)", over an epoch in which it never had a sample.
    from pipeload.datapipes import webdataset_pipeline

    pipe = webdataset_pipeline(_write_shards(tmp_path, 2, 10)).map(_label)
    loader = pipeload.DataLoader(pipe, batch_size=64, **{**engine, "num_workers": 4})
    for _ in range(EPOCHS):
        assert sorted(len(batch) for batch in loader) == [10, 10]
    stats = loader.stats()
    idle = [w for w in stats.workers if w.tasks == 0]
    assert len(idle) == 2 and all(w.alive_s > 0 for w in idle), stats.workers
    assert [(w.fetch_s, w.collate_s, w.transfer_s) for w in idle] == [(0.0, 0.0, 0.0)] * 2, stats.workers
    line = next(line for line in stats.summary().splitlines() if line.startswith("workers busy"))
    for worker in idle:
        assert f"worker {worker.worker_id} 0% (built no batch)" in line, line
    assert all(w.busy_s > 0 for w in stats.workers if w.tasks), stats.workers



class FailsInOddBatches(pipeload.IterableDataset):
    """A stream of 48 samples whose iterator raises at the first sample of every other batch
    of BATCH and goes on after it (a class-based iterator is asked again, as torch does)."""

    def __iter__(self) -> Any:
        return _OddBatchesFail()


class _OddBatchesFail:
    def __init__(self) -> None:
        self.next = 0

    def __iter__(self) -> Any:
        return self

    def __next__(self) -> int:
        if self.next >= 48:
            raise StopIteration
        index, self.next = self.next, self.next + 1
        if (index // BATCH) % 2 == 1 and index % BATCH == 0:
            self.next += BATCH - 1  # the rest of this batch is lost with it
            raise ValueError("bad sample")
        return index


@pytest.mark.timeout(60)
@pytest.mark.parametrize("engine", [ENGINES["inline"], ENGINES["process"], ENGINES["thread"]],
                         ids=["inline", "process", "thread"])
def test_an_iterable_datasets_failed_batches_leave_samples_per_batch_at_what_the_loop_received(engine: dict) -> None:
    # A failed batch counted as a task with no samples read 4.0 samples a batch where the loop
    # received 7.6 (stop 53's review).
    loader = pipeload.DataLoader(FailsInOddBatches(), batch_size=BATCH, **engine)
    received = sizes_past_errors(loader, ValueError)
    assert set(received) == {BATCH}
    assert loader.stats().samples_per_batch == BATCH
