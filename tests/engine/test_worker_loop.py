"""The worker loop on its own: commands in, reports out, through real in-process queues; and what a
worker process sets up for itself before its loop runs."""

from __future__ import annotations

import gc
import os
import queue
import subprocess
import sys

import pytest
from faults import ECONOMIC, FORK, Numbers, engine_params, loader_kwargs

from pipeload import DataLoader, Dataset
from pipeload.collate import default_collate
from pipeload.engine.lifecycle import WORKER_SCHEDULING_ENV
from pipeload.engine.plan import DatasetKind, FetchSpec, WorkerSetup
from pipeload.engine.worker_main import WorkerLoop
from pipeload.transport.channel import QueueEnd
from pipeload.transport.messages import Command, Report, WorkerCommand


def _run_loop(commands: list[WorkerCommand], per_batch_seeding: bool = False) -> list:
    fetch = FetchSpec(Numbers(100), DatasetKind.MAP, True, default_collate, False, per_batch_seeding)
    setup = WorkerSetup(fetch, num_workers=1, base_seed=0, worker_init_fn=None,
                        worker_method="thread")
    inbox, outbox = QueueEnd(queue.SimpleQueue()), QueueEnd(queue.SimpleQueue())
    for command in commands:
        inbox.send(command)
    WorkerLoop(setup, 0, inbox, outbox, should_stop=lambda: False).run()  # returns at STOP
    reports = []
    while (report := outbox.receive(0)) is not None:
        reports.append(report)
    return reports


def _fetch(number: int, indices: list[int]) -> WorkerCommand:
    return WorkerCommand(Command.FETCH, number, indices)


def test_tasks_are_served_in_the_order_they_were_sent():
    reports = _run_loop([_fetch(0, [0, 1]), _fetch(1, [2, 3]), WorkerCommand(Command.STOP)])
    assert [(r.report, r.batch_number, r.payload.tolist()) for r in reports] == [
        (Report.BATCH, 0, [0, 1]),
        (Report.BATCH, 1, [2, 3]),
    ]


_ABANDONED_THEN_NEW_EPOCH = [
    _fetch(0, [0, 1]),  # the abandoned epoch's queued tasks: nobody will read them
    _fetch(1, [2, 3]),
    WorkerCommand(Command.START_EPOCH, epoch=2),
    _fetch(0, [4, 5]),
    WorkerCommand(Command.STOP),
]


def test_tasks_left_by_an_abandoned_epoch_are_built_under_torchs_seeding():
    # As torch's workers do: their draws from the worker's generators shape later batches.
    reports = _run_loop(_ABANDONED_THEN_NEW_EPOCH)
    assert [(r.report, r.batch_number) for r in reports] == [
        (Report.BATCH, 0),
        (Report.BATCH, 1),
        (Report.EPOCH_STARTED, 2),
        (Report.BATCH, 0),
    ]
    assert reports[-1].payload.tolist() == [4, 5]


def test_tasks_left_by_an_abandoned_epoch_are_dropped_under_per_batch_seeding():
    # Each batch reseeds the generators: building the abandoned ones would change nothing.
    reports = _run_loop(_ABANDONED_THEN_NEW_EPOCH, per_batch_seeding=True)
    assert [(r.report, r.batch_number) for r in reports] == [
        (Report.EPOCH_STARTED, 2),
        (Report.BATCH, 0),
    ]
    assert reports[1].payload.tolist() == [4, 5]


class _SchedulingPolicy(Dataset):
    """Each item is the scheduling policy of the process that fetched it."""

    def __len__(self) -> int:
        return 4

    def __getitem__(self, index: int) -> int:
        return os.sched_getscheduler(0)


_HAS_SCHEDULING = hasattr(os, "sched_getscheduler") and hasattr(os, "SCHED_BATCH")


@pytest.mark.skipif(not _HAS_SCHEDULING, reason="no scheduling policies on this platform")
@pytest.mark.usefixtures("leak_guard")
@pytest.mark.timeout(60)
@pytest.mark.parametrize("engine", engine_params(FORK, ECONOMIC))
@pytest.mark.parametrize("setting", [None, "normal"])
def test_worker_processes_run_as_batch_work_unless_told_not_to(engine, setting, monkeypatch):
    # A worker woken by a task must not preempt the main process that sent it (lifecycle.py).
    if setting is not None:
        monkeypatch.setenv(WORKER_SCHEDULING_ENV, setting)
    loader = DataLoader(_SchedulingPolicy(), batch_size=2, num_workers=2, **loader_kwargs(engine))
    policies = {int(policy) for batch in loader for policy in batch}
    expected = os.SCHED_OTHER if setting == "normal" else os.SCHED_BATCH
    assert policies == {expected}
    assert os.sched_getscheduler(0) == os.SCHED_OTHER  # the main process keeps its own


class _FrozenObjects(Dataset):
    """Each item is how many objects the collector of the fetching process leaves alone."""

    def __len__(self) -> int:
        return 4

    def __getitem__(self, index: int) -> int:
        return gc.get_freeze_count()


@pytest.mark.usefixtures("leak_guard")
@pytest.mark.timeout(60)
@pytest.mark.parametrize("engine", engine_params(FORK, ECONOMIC))
def test_worker_processes_keep_the_collector_off_what_they_inherited(engine):
    # A full collection would write to every inherited object, copying the main process's heap
    # into each worker page by page (docs/design/economic.md, "Where the memory goes").
    gc.unfreeze()  # conftest.py froze the session's objects: a worker's count must be its own
    try:
        loader = DataLoader(_FrozenObjects(), batch_size=2, num_workers=2, **loader_kwargs(engine))
        counts = [int(count) for batch in loader for count in batch]
    finally:
        gc.freeze()
    assert min(counts) > 1000  # torch's import alone leaves hundreds of thousands


def test_the_first_fork_comes_after_numpy_random_is_imported():
    # Every process worker seeds numpy's global generator; imported in each worker, numpy.random
    # would take pages of its own there, several MiB a worker.
    script = (
        "import sys\n"
        "import pipeload\n"
        "assert 'numpy.random' not in sys.modules, 'already imported: this test would prove nothing'\n"
        "loader = pipeload.DataLoader(list(range(4)), batch_size=2, num_workers=1,\n"
        "                             multiprocessing_context='fork')\n"
        "assert [batch.tolist() for batch in loader] == [[0, 1], [2, 3]]\n"
        "print('numpy.random' in sys.modules)\n"
    )
    environment = {**os.environ, "PYTHONPATH": os.pathsep.join(sys.path)}
    result = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True,
                            env=environment, timeout=120, check=False)
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip() == "True"
