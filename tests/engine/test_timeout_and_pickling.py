"""``timeout > 0`` raises when no batch arrives in time; under spawn/forkserver an object that cannot
be pickled is refused before any worker starts, with an error naming it.
"""

from __future__ import annotations

import multiprocessing
import os
import signal
import multiprocessing.context
import pickle
import threading
import time
import warnings
from typing import Any

import pytest
import torch
from conftest import wait_until
from faults import (
    ECONOMIC,
    ECONOMIC_THREAD,
    FORK,
    THREAD,
    Numbers,
    Stalls,
    Uneven,
    engine_params,
    flatten,
    loader_kwargs,
    record_pid_then_stall,
    stalling_init,
    worker_pids,
)

from pipeload import DataLoader, TensorDataset
from pipeload.engine.lifecycle import check_picklable
from pipeload.errors import LoaderTimeoutError, WorkerDiedError

pytestmark = [pytest.mark.usefixtures("leak_guard", "no_gc"), pytest.mark.timeout(60)]

TIMEOUT_S = 0.5


@pytest.fixture
def release_at_end():
    """Thread workers stuck in ``Stalls`` cannot be killed: release them when the test ends."""
    stalled: list[Stalls] = []
    yield stalled.append
    for dataset in stalled:
        dataset.release.set()


# -- timeout -----------------------------------------------------------------------------


def _timeout_cases() -> list[Any]:
    """(engine, stall index) pairs. Each case waits out the timeout twice: classic process
    workers run both stalls in the fast suite, the other engines one each (economic workers the
    first batch, thread workers the first, economic threads a later one), the rest with -m slow."""
    fast = {(FORK, 0), (FORK, 6), (ECONOMIC, 0), (THREAD, 0), (ECONOMIC_THREAD, 6)}
    stalls = {0: "first-batch", 6: "later-batch"}
    return [pytest.param(engine, stall, id=f"{label}-{engine.name}",
                         marks=[] if (engine, stall) in fast else [pytest.mark.slow])
            for stall, label in stalls.items() for engine in (FORK, THREAD, ECONOMIC, ECONOMIC_THREAD)]


@pytest.mark.parametrize(("engine", "stall_index"), _timeout_cases())
def test_no_batch_within_timeout_raises(engine, stall_index, leak_guard, release_at_end):
    dataset = Stalls(16, stall_index=stall_index)
    release_at_end(dataset)
    loader = DataLoader(dataset, batch_size=2, num_workers=2, timeout=TIMEOUT_S, **loader_kwargs(engine))
    iterator = iter(loader)
    pids = worker_pids(iterator)
    received = []
    started = time.monotonic()
    with pytest.raises(RuntimeError) as caught:
        while True:  # no loop variable: it would keep the last batch alive in the traceback
            received.append(next(iterator).tolist())
            started = time.monotonic()
    waited = time.monotonic() - started

    assert isinstance(caught.value, LoaderTimeoutError)
    assert str(caught.value).startswith(f"DataLoader timed out after {TIMEOUT_S} seconds")
    assert TIMEOUT_S <= waited < TIMEOUT_S + 2.5
    assert flatten(received) == list(range(stall_index - stall_index % 2))
    # As in torch, the timeout does not end the epoch: asking again waits again.
    with pytest.raises(LoaderTimeoutError):
        next(iterator)
    del iterator  # dropping the iterator is what stops the workers
    if not engine.threads:
        leak_guard.assert_exited(pids, within_s=1.0)


@pytest.mark.parametrize("engine", engine_params(FORK, THREAD))
def test_after_a_timeout_the_late_batch_and_the_rest_still_come(engine):
    # Batch 1 takes 1.2 s, the timeout is 0.5 s: the caller sees timeouts, then every batch in
    # order, exactly once (torch behaves the same).
    loader = DataLoader(Stalls(8, stall_index=2, stall_s=1.2), batch_size=2, num_workers=2,
                        timeout=TIMEOUT_S, **loader_kwargs(engine))
    iterator = iter(loader)
    seen, timeouts = [], 0
    while True:
        try:
            seen.append(next(iterator).tolist())
        except LoaderTimeoutError:
            timeouts += 1
        except StopIteration:
            break
    assert seen == [[0, 1], [2, 3], [4, 5], [6, 7]]
    assert timeouts >= 1


# About 1.5 MB of pickled indices: one task is more than a 1 MiB task pipe holds, so it cannot be
# written while the worker reads nothing (the budget sends one task per worker at first).
HUGE_BATCH = 300_000


def test_a_stuck_worker_with_a_full_task_pipe_times_out_instead_of_blocking_the_sender(leak_guard):
    loader = DataLoader(Numbers(4 * HUGE_BATCH), batch_size=HUGE_BATCH, num_workers=1,
                        timeout=TIMEOUT_S, multiprocessing_context="fork",
                        worker_init_fn=stalling_init)  # the worker never reads its pipe
    started = time.monotonic()
    with pytest.raises(LoaderTimeoutError, match="not taking new tasks"):
        iter(loader)  # sending the first task must give up, not wait on the pipe for ever
    assert time.monotonic() - started < TIMEOUT_S + 2.5


def test_a_worker_dying_while_its_task_pipe_is_full_is_reported(tmp_path, monkeypatch, leak_guard):
    monkeypatch.setenv("PIPELOAD_TEST_PID_DIR", str(tmp_path))
    loader = DataLoader(Numbers(4 * HUGE_BATCH), batch_size=HUGE_BATCH, num_workers=1,
                        multiprocessing_context="fork",
                        worker_init_fn=record_pid_then_stall)  # never reads: the pipe fills
    pid_file = tmp_path / "0"

    def kill_the_worker() -> None:
        if wait_until(pid_file.exists, 10.0):
            os.kill(int(pid_file.read_text()), signal.SIGKILL)

    killer = threading.Thread(target=kill_the_worker, daemon=True)
    killer.start()
    batches = iter(loader)  # blocked sending a task to a stuck worker until it died: never hangs
    with pytest.raises(WorkerDiedError, match=r"signal 9"):
        next(batches)  # the death is said by the first next(), as torch's loader says it
    killer.join()


@pytest.mark.parametrize("engine", engine_params(FORK, THREAD, ECONOMIC, ECONOMIC_THREAD))
def test_slow_but_steady_batches_do_not_time_out(engine):
    loader = DataLoader(Uneven(24, unit_s=0.01), batch_size=2, num_workers=2, timeout=2.0,
                        **loader_kwargs(engine))
    assert flatten(list(loader)) == list(range(24))


class _StallsOnSecondVisit(Numbers):
    """Index 0 comes back at once the first time a worker fetches it, and stalls the second time."""

    def __init__(self, length: int) -> None:
        super().__init__(length)
        self.visits = 0  # per worker process

    def __getitem__(self, index: int) -> int:
        if index == 0:
            self.visits += 1
            if self.visits == 2:
                threading.Event().wait(60)  # stuck for good: only a process worker gets here
        return index


def test_timeout_in_a_later_persistent_epoch(leak_guard):
    loader = DataLoader(_StallsOnSecondVisit(8), batch_size=2, num_workers=1, timeout=TIMEOUT_S,
                        persistent_workers=True, multiprocessing_context="fork")
    iterator = iter(loader)
    pids = worker_pids(iterator)
    assert flatten(list(iterator)) == list(range(8))
    with pytest.raises(LoaderTimeoutError):
        list(loader)
    del loader, iterator
    leak_guard.assert_exited(pids, within_s=1.0)


# -- picklability under spawn and forkserver -----------------------------------------------


def _watched_context(method: str) -> multiprocessing.context.BaseContext:
    """A context whose worker processes count the processes their starts made, to prove none
    was made (a start that cannot pickle what it sends fails before making one)."""
    base = type(multiprocessing.get_context(method))

    class Process(base.Process):
        starts = 0

        def start(self) -> None:
            try:
                super().start()
            finally:
                if self.pid is not None:
                    type(self).starts += 1

    class Watched(base):
        pass

    Watched.Process = Process
    return Watched()


class _HoldsALambda(Numbers):
    def __init__(self) -> None:
        super().__init__(4)
        self.transform = lambda x: x


def _local_init_fn():
    def init(worker_id: int) -> None:
        pass

    return init


UNPICKLABLE = {
    "dataset": dict(dataset=_HoldsALambda()),
    "collate_fn": dict(dataset=Numbers(4), collate_fn=lambda samples: samples),
    "worker_init_fn": dict(dataset=Numbers(4), worker_init_fn=_local_init_fn()),
}


@pytest.mark.parametrize("mode", ["classic", "economic"])
@pytest.mark.parametrize("method", ["spawn", "forkserver"])
@pytest.mark.parametrize("name", sorted(UNPICKLABLE))
def test_unpicklable_object_is_refused_before_any_worker_starts(method, name, mode):
    context = _watched_context(method)
    loader = DataLoader(batch_size=2, num_workers=2, multiprocessing_context=context, mode=mode,
                        **UNPICKLABLE[name])
    with pytest.raises((pickle.PicklingError, AttributeError, TypeError)) as caught:
        with warnings.catch_warnings(record=True) as warned:
            warnings.simplefilter("always")
            iter(loader)  # torch warns so too, then raises the pickling error
    # torch's warning, as torch gives it on every Python (it names 3.14's default start method)
    torchs = [w for w in warned if str(w.message).startswith("Got pickle error when attempting")]
    assert len(torchs) == 1, [str(w.message) for w in warned]
    assert all(w.filename == __file__ for w in torchs)  # the user's line
    text = str(caught.value)
    assert f"{name}=" in text, text
    assert "cannot be pickled" in text and f"'{method}'" in text
    assert "lambda" in text or "local" in text  # the inner reason is kept
    if name == "dataset":  # the class is at module level: what cannot be pickled is named
        assert "because dataset.transform (a function) cannot be pickled" in text, text
    assert context.Process.starts == 0


@pytest.mark.parametrize("mode", ["classic", "economic"])
def test_unpicklable_objects_are_fine_with_fork_and_threads(mode):
    for kwargs in ({"multiprocessing_context": "fork"}, {"worker_type": "thread"}):
        loader = DataLoader(_HoldsALambda(), batch_size=2, num_workers=2, mode=mode,
                            collate_fn=lambda samples: [s * 10 for s in samples], **kwargs)
        assert list(loader) == [[0, 10], [20, 30]]


@pytest.mark.filterwarnings("ignore:Got pickle error:UserWarning")
def test_a_huge_dataset_is_named_not_printed():
    dataset = list(range(100_000)) + [lambda: None]
    loader = DataLoader(dataset, batch_size=2, num_workers=1, multiprocessing_context="spawn")
    with pytest.raises((pickle.PicklingError, AttributeError, TypeError)) as caught:
        iter(loader)
    assert "dataset=[0, 1, 2" in str(caught.value)
    assert len(str(caught.value)) < 1000


class _CountsFetches(Numbers):
    """Holds a multiprocessing.Value: spawn can send it (only) while starting a worker."""

    def __init__(self, length: int, context) -> None:
        super().__init__(length)
        self.fetched = context.Value("i", 0)

    def __getitem__(self, index: int) -> int:
        with self.fetched.get_lock():
            self.fetched.value += 1
        return index


@pytest.mark.timeout(90)
def test_shared_value_in_the_dataset_is_accepted_under_spawn():
    context = multiprocessing.get_context("spawn")
    dataset = _CountsFetches(6, context)
    loader = DataLoader(dataset, batch_size=2, num_workers=2, multiprocessing_context=context)
    assert flatten(list(loader)) == list(range(6))
    assert wait_until(lambda: dataset.fetched.value == 6, 1.0)


def test_the_check_does_not_move_tensors_into_shared_memory():
    # Pickling for real (torch's reductions) would move the dataset's tensors into shared memory.
    data = torch.arange(8.0)
    check_picklable({"dataset": TensorDataset(data)}, "spawn")
    assert not data.is_shared()


class _CountsItsPicklings(torch.utils.data.Dataset):
    """Numbers that count, in the process that pickles them, how often they were pickled."""

    pickled = 0

    def __len__(self) -> int:
        return 4

    def __getitem__(self, index: int) -> int:
        return index

    def __getstate__(self) -> dict[str, Any]:
        type(self).pickled += 1
        return self.__dict__


def test_a_spawned_worker_is_sent_the_dataset_once_as_torchs():
    # A check before every start pickled a large dataset once more for each set of workers;
    # only a start that fails is checked now, to name what could not be sent.
    _CountsItsPicklings.pickled = 0
    loader = DataLoader(_CountsItsPicklings(), batch_size=2, num_workers=1, multiprocessing_context="spawn")
    assert [batch.tolist() for batch in loader] == [[0, 1], [2, 3]]
    assert _CountsItsPicklings.pickled == 1
