"""The main process's record of reports (stats/recorder.py): what WorkerGroup.receive does with
each burst of reports, in one step unless one of them carries totals."""

from __future__ import annotations

from pipeload.stats.clock import StageClock
from pipeload.stats.recorder import (LoaderSetup, StatsRecorder, carries_totals, count_by_worker,
                                     worker_of)
from pipeload.transport.messages import Report, WorkerReport


def _receive(session, bursts) -> None:
    """As WorkerGroup.receive: count a burst without totals per worker, record the others."""
    for burst in bursts:
        if any(map(carries_totals, burst)):
            session.record(burst)
        else:
            count_by_worker(session.lag, map(worker_of, burst))


def test_tasks_since_the_latest_totals_are_counted_per_worker_across_bursts() -> None:
    recorder = StatsRecorder(LoaderSetup("classic", "process", 2, 2, 4, False))
    session = recorder.new_session(4)
    clock = StageClock(1)
    clock._counted = 3  # three tasks done when worker 1 sent its totals
    totals = clock.snapshot()
    plain = [WorkerReport(Report.BATCH, worker, number) for number, worker in enumerate([0, 1, 0, 1])]
    _receive(session, [
        plain,  # no totals: counted in one step
        [WorkerReport(Report.BATCH, 1, 4), WorkerReport(Report.BATCH, 1, 5, totals=totals),
         WorkerReport(Report.BATCH, 0, 6), WorkerReport(Report.BATCH, 1, 7)],
        plain[:1],
    ])
    # Worker 1's count restarted at its totals: one task since. Worker 0 sent none: 4 tasks.
    assert dict(session.lag) == {0: 4, 1: 1}
    tasks = {worker.worker_id: worker.tasks for worker in recorder.snapshot().workers}
    assert tasks == {1: 4}  # 3 in the totals, 1 since; worker 0 has no totals to scale yet


def _totals(tasks: int, samples: int) -> tuple:
    clock = StageClock(1)
    clock._counted, clock.samples = tasks, samples
    return clock.snapshot()


def test_economic_workers_of_either_kind_are_counted_apart_under_the_same_id() -> None:
    # Item worker 0 and batch worker 0 share an id: each kind's reports are counted under
    # (report type, worker id), in one step per burst, and a START_EPOCH answer names its kind.
    recorder = StatsRecorder(LoaderSetup("economic", "process", 1, 2, 4, False))
    kinds = {Report.ITEMS_DONE: "item", Report.BATCH: "batch", Report.FAILED: "batch"}
    session = recorder.new_session(2, kinds)
    item, batch = (lambda n, **k: WorkerReport(Report.ITEMS_DONE, 0, n, **k),
                   lambda n, **k: WorkerReport(Report.BATCH, 0, n, **k))
    bursts = [
        [item(0, totals=_totals(1, 4)), batch(0, totals=_totals(1, 8))],
        [item(1), item(2), batch(1)],  # no totals: counted in one step
        [item(3), WorkerReport(Report.FAILED, 0, 2, totals=_totals(3, 16))],  # its count restarts
        [batch(3), item(4)],
        [WorkerReport(Report.EPOCH_STARTED, 0, 2, "item", _totals(5, 20))],  # item 0: 5 pieces
    ]
    for burst in bursts:
        if any(map(carries_totals, burst)):
            session.record(burst)
        else:
            count_by_worker(session.lag, map(session.count_key, burst))
    workers = {(w.kind, w.worker_id): (w.tasks, w.samples) for w in recorder.snapshot().workers}
    assert workers == {("item", 0): (5, 20), ("batch", 0): (4, 21)}  # 3 + 1 since, scaled
