"""A running pool grows and shrinks in place (what ``num_workers="auto"`` does between two
batches): the running workers go on, every batch comes once and in sampler order, and closing
leaves nothing behind."""

from __future__ import annotations

import os
import signal
import sys

import pytest
import torch

import pipeload


class WhoBuilt(pipeload.Dataset):
    """Item i: a small tensor of i, and the id and pid of the worker that fetched it."""

    def __len__(self) -> int:
        return 480

    def __getitem__(self, index: int) -> tuple[torch.Tensor, int, int]:
        info = pipeload.get_worker_info()
        return torch.full((64,), index), info.id, os.getpid()


def _loader(worker_type: str) -> pipeload.DataLoader:
    return pipeload.DataLoader(WhoBuilt(), batch_size=4, num_workers=2, persistent_workers=True,
                               worker_type=worker_type,
                               multiprocessing_context="fork" if worker_type == "process" else None)


def _take(batches, count: int) -> list[tuple[int, int, int]]:
    """(item, worker id, pid) of every item in the next ``count`` batches."""
    got = []
    for _ in range(count):
        values, ids, pids = next(batches)
        got += [(int(v[0]), int(w), int(p)) for v, w, p in zip(values, ids, pids)]
    return got


@pytest.mark.timeout(60)
@pytest.mark.parametrize("worker_type", ["process", "thread"])
def test_a_pool_grows_in_place_and_keeps_order_and_its_workers(leak_guard, worker_type) -> None:
    loader = _loader(worker_type)
    batches = iter(loader)
    engine = batches._engine
    before = list(engine.workers)
    got = _take(batches, 10)
    engine.resize(5, 2)
    assert engine.workers[:2] == before and len(engine.workers) == 5
    assert all(handle.is_alive() for handle in engine.workers)
    got += [item for _ in range(110) for item in _take(batches, 1)]
    assert [item for item, _, _ in got] == list(range(480))  # once each, in sampler order
    assert {worker for _, worker, _ in got[-200:]} == set(range(5))  # the new ones built too
    with pytest.raises(StopIteration):
        next(batches)
    second = [int(v) for values, _, _ in loader for v in values[:, 0]]  # the next epoch, 5 workers
    assert second == list(range(480)) and len(engine.workers) == 5
    del batches, loader, engine, before


@pytest.mark.timeout(60)
@pytest.mark.parametrize("worker_type", ["process", "thread"])
def test_a_pool_shrinks_in_place_then_grows_again(leak_guard, worker_type) -> None:
    loader = _loader(worker_type)
    batches = iter(loader)
    engine = batches._engine
    engine.resize(4, 2)
    got = _take(batches, 20)
    first_two = list(engine.workers[:2])
    engine.resize(1, 2)  # the three others finish what they hold, then stop
    got += _take(batches, 40)
    assert engine.workers == first_two[:1]
    assert {worker for _, worker, _ in got[-40:]} == {0}
    engine.resize(3, 2)  # new workers under the numbers of stopped ones
    got += _take(batches, 60)
    assert [item for item, _, _ in got] == list(range(480))
    assert {worker for _, worker, _ in got[-40:]} == {0, 1, 2}
    stats = loader.stats()
    assert sum(worker.tasks for worker in stats.workers) == 120  # stopped workers' tasks kept
    del batches, loader, engine, first_two


def _ctrl_c_when_called(name: str, nth: int):
    """A trace function that sends this process a real SIGINT when the function ``name`` is
    called for the ``nth`` time (a Ctrl-C landing at that step), then stops tracing."""
    calls = [0]

    def trace(frame, event, arg):
        if event == "call" and frame.f_code.co_name == name:
            calls[0] += 1
            if calls[0] == nth:
                sys.settrace(None)
                signal.raise_signal(signal.SIGINT)
        return None

    return trace


def _open_pipes_and_sockets() -> set[str]:
    found = set()
    for fd in os.listdir("/proc/self/fd"):
        try:
            target = os.readlink(f"/proc/self/fd/{fd}")
        except OSError:
            continue  # the listing's own descriptor, closed by now
        if target.startswith(("pipe:", "socket:")):
            found.add(target)
    return found


@pytest.mark.timeout(60)
def test_a_ctrl_c_while_the_pool_grows_leaves_no_pipe_open(leak_guard) -> None:
    loader = _loader("process")
    before = _open_pipes_and_sockets()
    batches = iter(loader)
    engine = batches._engine
    _take(batches, 2)
    # Between a new worker's task pipe and its result socket: the pipe is made, not yet kept.
    sys.settrace(_ctrl_c_when_called("socketpair", 2))
    try:
        with pytest.raises(KeyboardInterrupt) as caught:
            engine.resize(4, 2)
    finally:
        sys.settrace(None)
    assert engine.closed
    # The loader, its engine and the traceback still live (a notebook keeps the last one): what
    # the stopped engine held is closed all the same, the new workers' ends included. (The
    # loader's slab pool stays for its next workers.)
    assert _open_pipes_and_sockets() - before == set()
    del batches, loader, engine, caught
