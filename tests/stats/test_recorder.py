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
