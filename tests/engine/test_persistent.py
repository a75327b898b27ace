"""``persistent_workers=True``: the same workers serve every epoch, and an epoch left early (break)
does not spill into the next one, which is whole and in order.
"""

from __future__ import annotations

import os
import signal
from collections import Counter
from pathlib import Path

import pytest
import torch
from conftest import pid_gone, wait_until
from faults import (
    ECONOMIC,
    ECONOMIC_THREAD,
    FORK,
    SPAWN,
    THREAD,
    Numbers,
    Shards,
    Uneven,
    engine_params,
    flatten,
    loader_kwargs,
    worker_pids,
)

from pipeload import DataLoader
from pipeload.errors import WorkerDiedError

pytestmark = [
    pytest.mark.usefixtures("leak_guard", "no_gc"),
    pytest.mark.timeout(60),
    pytest.mark.filterwarnings("ignore:This DataLoader will create:UserWarning"),
]

FAST = engine_params(FORK, THREAD, ECONOMIC, ECONOMIC_THREAD)


def _persistent(dataset, engine, **kwargs) -> DataLoader:
    kwargs.setdefault("batch_size", 2)
    kwargs.setdefault("num_workers", 2)
    return DataLoader(dataset, persistent_workers=True, **kwargs, **loader_kwargs(engine))


def _identity(iterator) -> list:
    """What stays the same for a persistent worker: its pid (process) or its handle (thread)."""
    handles = iterator._workers
    return [h.pid for h in handles] if handles and handles[0].pid != os.getpid() else list(handles)


@pytest.mark.parametrize("engine", engine_params(FORK, SPAWN, THREAD, ECONOMIC, ECONOMIC_THREAD, slow=(SPAWN,)))
@pytest.mark.timeout(90)
def test_same_workers_serve_every_epoch(engine, leak_guard):
    loader = _persistent(Numbers(10), engine)
    seen = []
    for _ in range(3):
        iterator = iter(loader)
        assert flatten(list(iterator)) == list(range(10))
        seen.append(_identity(iterator))  # after the epoch: economic batch workers start on demand
    assert seen[0] == seen[1] == seen[2]
    if not engine.threads:
        assert all(not pid_gone(pid) for pid in seen[0])
        del loader, iterator
        leak_guard.assert_exited(seen[0], within_s=1.0)


@pytest.mark.parametrize("engine", FAST)
@pytest.mark.parametrize("stop_after", [0, 1, 3])
def test_epoch_after_a_break_is_whole_and_in_order(engine, stop_after):
    loader = _persistent(Uneven(30), engine, num_workers=3, prefetch_factor=2)
    for _ in range(3):
        for count, _batch in enumerate(loader):
            if count == stop_after:
                break  # batches are still being built by the workers
        assert flatten(list(loader)) == list(range(30))


@pytest.mark.parametrize("engine", FAST)
def test_epoch_after_a_break_out_of_order(engine):
    loader = _persistent(Uneven(30), engine, in_order=False)
    for batch in loader:
        break
    assert Counter(flatten(list(loader))) == Counter(range(30))


@pytest.mark.parametrize("engine", FAST)
def test_abandoned_iterator_then_a_new_epoch(engine):
    loader = _persistent(Uneven(20), engine)
    abandoned = iter(loader)
    next(abandoned)
    assert flatten(list(loader)) == list(range(20))


@pytest.mark.parametrize("engine", engine_params(FORK, THREAD))
def test_iterable_dataset_restarts_every_epoch(engine):
    loader = _persistent(Shards(20), engine, batch_size=3)
    for _ in range(3):
        assert Counter(flatten(list(loader))) == Counter(range(20))


@pytest.mark.parametrize("engine", FAST)
def test_shuffled_persistent_epochs(engine):
    loader = _persistent(Numbers(24), engine, shuffle=True, generator=torch.Generator().manual_seed(3))
    epochs = [flatten(list(loader)) for _ in range(3)]
    assert all(sorted(epoch) == list(range(24)) for epoch in epochs)
    assert len({tuple(epoch) for epoch in epochs}) == 3


def _log_start(worker_id: int) -> None:
    with open(os.environ["PIPELOAD_TEST_INIT_LOG"], "a") as log:
        log.write(f"{worker_id} {os.getpid()}\n")


def test_worker_init_fn_runs_once_per_worker(tmp_path: Path, monkeypatch):
    log = tmp_path / "starts.log"
    monkeypatch.setenv("PIPELOAD_TEST_INIT_LOG", str(log))
    loader = _persistent(Numbers(8), FORK, worker_init_fn=_log_start)
    for _ in range(3):
        assert flatten(list(loader)) == list(range(8))
    assert sorted(line.split()[0] for line in log.read_text().splitlines()) == ["0", "1"]


def test_after_a_worker_dies_the_next_epoch_starts_fresh_workers(leak_guard):
    loader = _persistent(Numbers(40), FORK)
    iterator = iter(loader)
    old_pids = worker_pids(iterator)
    next(iterator)
    os.kill(old_pids[0], signal.SIGKILL)
    assert wait_until(lambda: pid_gone(old_pids[0]), 5.0)
    with pytest.raises(WorkerDiedError, match=rf"worker 0 \(pid {old_pids[0]}\)"):
        for _ in range(25):
            next(iterator)
    leak_guard.assert_exited(old_pids, within_s=1.0)

    iterator = iter(loader)
    new_pids = worker_pids(iterator)
    assert not set(new_pids) & set(old_pids)
    assert flatten(list(iterator)) == list(range(40))


def test_worker_dying_between_epochs_is_reported_when_the_next_starts(leak_guard):
    loader = _persistent(Numbers(8), FORK)
    iterator = iter(loader)
    pids = worker_pids(iterator)
    assert flatten(list(iterator)) == list(range(8))
    os.kill(pids[1], signal.SIGKILL)
    assert wait_until(lambda: pid_gone(pids[1]), 5.0)
    with pytest.raises(WorkerDiedError, match=rf"worker 1 \(pid {pids[1]}\).*SIGKILL"):
        list(loader)
    leak_guard.assert_exited(pids, within_s=1.0)
    assert flatten(list(loader)) == list(range(8))  # a fresh session


# -- without persistent workers, a worker with nothing left to do leaves at once ------------


def test_without_persistent_workers_each_worker_exits_once_its_last_task_is_answered() -> None:
    # 4 batches, 2 workers, 2 in flight each: every task goes out at iter(). Once the loop has
    # the last batch's answer, both workers have nothing left and are asked to stop, so they exit
    # while the loop still holds batches it has not taken (what a training step would overlap),
    # not when StopIteration comes; their exit is no death: the epoch ends as usual.
    loader = DataLoader(Numbers(16), batch_size=4, num_workers=2, prefetch_factor=2)
    iterator = iter(loader)
    pids = worker_pids(iterator)
    taken = [next(iterator) for _ in range(4)]  # the last one's answer is in by the 4th
    assert wait_until(lambda: all(pid_gone(pid) for pid in pids), 10.0), "workers still running"
    assert [batch.tolist() for batch in taken] == [[4 * b + i for i in range(4)] for b in range(4)]
    with pytest.raises(StopIteration):
        next(iterator)


def test_persistent_workers_stay_after_their_last_task() -> None:
    loader = DataLoader(Numbers(16), batch_size=4, num_workers=2, persistent_workers=True)
    iterator = iter(loader)
    pids = worker_pids(iterator)
    assert len(list(iterator)) == 4
    assert not any(pid_gone(pid) for pid in pids)
    assert len(list(loader)) == 4 and worker_pids(iter(loader)) == pids
