"""The main process's record of reports (stats/recorder.py): what WorkerGroup.receive does with
each burst of reports, in one step unless one of them carries totals."""

from __future__ import annotations

import queue
import time

import pytest

from pipeload.engine.plan import DatasetKind, FetchSpec, WorkerSetup
from pipeload.engine.worker_main import WorkerLoop
from pipeload.stats.clock import SAMPLE_EVERY, SUMS_LENGTH, TIME_ALL_FIRST, StageClock, WorkerTotals
from pipeload.stats.recorder import (LoaderSetup, StatsRecorder, carries_totals, count_by_worker,
                                     worker_of)
from pipeload.transport.channel import QueueEnd
from pipeload.transport.messages import Command, ItemsDone, Report, WorkerCommand, WorkerReport


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


def test_tasks_since_the_latest_totals_are_estimated_from_the_later_tasks_cpu_time_included() -> None:
    # An economic item worker reports its totals with about one piece in 64 (and none at an
    # epoch's end): most of its pieces come after its latest totals. Brought up to them with
    # the stage seconds alone, its CPU seconds stayed behind ("53% on a CPU, 42% waiting inside
    # the work" for JPEG decoding); brought up with the average of all its tasks, its cold
    # first ones counted again for each. The tasks since are like its later ones, CPU included.
    recorder = StatsRecorder(LoaderSetup("classic", "process", 1, 2, 4, False))
    session = recorder.new_session(4)
    # 15 cold first tasks: 0.5 s, 0.3 s of it on a CPU; 5 later ones: 0.01 s each, 0.009 on a CPU.
    start = (15, 0.5, 0.0, 0.0, 0, 0.3, 0.0)
    totals = WorkerTotals(tasks=20, samples=80, fetch_s=0.55, collate_s=0.0, send_s=0.0, bytes_out=0,
                          started_at=time.perf_counter() - 10.0, cpu_s=0.345, queued_s=0.0,
                          start=start)
    session.record([WorkerReport(Report.BATCH, 0, 19, totals=tuple(totals))])
    count_by_worker(session.lag, [0] * 80)
    worker, = recorder.snapshot().workers
    assert worker.tasks == 100 and worker.samples == 400
    assert worker.fetch_s == pytest.approx(0.55 + 80 * 0.01)
    assert worker.cpu_s == pytest.approx(0.345 + 80 * 0.009)
    assert worker.cpu_s / worker.busy_s == pytest.approx(1.065 / 1.35)


def _worker_reports(commands: list[WorkerCommand], num_workers: int, sizes: tuple[int, int]) -> list:
    """What a classic process worker's loop reports for ``commands`` (run here, in a thread,
    through real queues; no clock lent: the worker's tasks are counted by the receiver)."""
    fetch = FetchSpec(list(range(10_000)), DatasetKind.MAP, True, list, False)
    setup = WorkerSetup(fetch, num_workers, base_seed=0, worker_init_fn=None,
                        worker_method="fork", stats=True, batch_sizes=sizes)
    inbox, outbox = QueueEnd(queue.SimpleQueue()), QueueEnd(queue.SimpleQueue())
    for command in [*commands, WorkerCommand(Command.STOP)]:
        inbox.send(command)
    WorkerLoop(setup, 1, inbox, outbox, should_stop=lambda: False).run()
    reports = []
    while (report := outbox.receive(0)) is not None:
        reports.append(report)
    return reports


def test_a_process_workers_tasks_are_counted_by_the_main_process_and_its_totals_completed() -> None:
    # Worker 1 of 3 gets every third batch number; each epoch has 1000 batches of 4 and a last
    # one of 2 (number 1000, which this worker gets: 1000 % 3 == 1). Past its first
    # TIME_ALL_FIRST tasks it times about one in SAMPLE_EVERY of its own, going by the numbers,
    # and always the epoch's last; the main process counts the reports that come without totals.
    epoch = [WorkerCommand(Command.FETCH, n, list(range(4 if n < 1000 else 2))) for n in range(1, 1001, 3)]
    commands = [*epoch, WorkerCommand(Command.START_EPOCH, 1000, epoch=2), *epoch]
    reports = _worker_reports(commands, num_workers=3, sizes=(4, 1000))
    assert [r.report for r in reports].count(Report.BATCH) == 2 * len(epoch)
    with_totals = [r for r in reports if r.totals is not None]
    timed = [r.batch_number for r in with_totals if r.report is Report.BATCH]
    assert 1000 in timed[TIME_ALL_FIRST:]  # the short last batch, both epochs
    assert timed.count(1000) == 2
    assert len(timed) < TIME_ALL_FIRST + 2 * (2 * len(epoch) // SAMPLE_EVERY + 2)  # sampled
    assert all(len(r.totals) == SUMS_LENGTH for r in with_totals)  # the worker counts no tasks

    recorder = StatsRecorder(LoaderSetup("classic", "process", 3, 2, 4, False))
    session = recorder.new_session(4)
    _receive(session, [reports[i:i + 3] for i in range(0, len(reports), 3)])
    worker, = recorder.snapshot().workers
    last_with_totals = max(i for i, r in enumerate(reports) if r.totals is not None)
    covered = [r for r in reports[:last_with_totals + 1] if r.report is Report.BATCH]
    assert session.lag[1] == len(reports) - 1 - last_with_totals
    assert WorkerTotals._make(recorder._seen[(1, "", 1)][0]).tasks == len(covered)
    assert WorkerTotals._make(recorder._seen[(1, "", 1)][0]).samples == sum(len(r.payload) for r in covered)
    assert worker.tasks == 2 * len(epoch)


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
    item, batch = (lambda n, **k: WorkerReport(Report.ITEMS_DONE, 0, n, ItemsDone(4), **k),
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


def test_an_item_workers_samples_since_its_totals_are_counted_not_scaled_from_its_pieces() -> None:
    # An epoch's first batch is cut finer than the rest: an item worker whose latest totals
    # covered two pieces of 5 items, then reported three pieces of 8, fetched 29 items, not
    # 5 / 2 x 5 tasks. Totals cover their own piece and the earlier ones of their burst.
    recorder = StatsRecorder(LoaderSetup("economic", "process", 1, 2, 4, False))
    kinds = {Report.ITEMS_DONE: "item", Report.BATCH: "batch", Report.FAILED: "batch"}
    session = recorder.new_session(2, kinds)
    def piece(number: int, count: int, totals: tuple | None = None) -> WorkerReport:
        return WorkerReport(Report.ITEMS_DONE, 0, number, ItemsDone(count), totals=totals)

    bursts = [
        [piece(0, 3), piece(1, 2, totals=_totals(2, 5))],  # the totals cover both
        [piece(2, 8), piece(3, 8)],
        [piece(4, 8)],
    ]
    for burst in bursts:
        if any(map(carries_totals, burst)):
            session.record(burst)
        else:
            count_by_worker(session.lag, map(session.count_key, burst))
        for report in burst:  # as the engine reads them, after the burst was recorded
            if report.totals is None:
                session.items_reported(report.worker_id, report.payload.count)
    line, = recorder.snapshot().workers
    assert (line.tasks, line.samples) == (5, 29)
    session.close()  # folded into the loader's line with the same count
    line, = recorder.snapshot().workers
    assert (line.tasks, line.samples) == (5, 29)


def test_a_closed_sessions_workers_are_folded_into_one_line_each() -> None:
    """A loader that makes a new pool every epoch keeps one line per worker, not one per worker
    and epoch (thread workers lend live clocks: kept, they grew the loader without bound)."""
    import torch

    from pipeload import DataLoader

    data = torch.arange(40.0).reshape(20, 2)
    for mode in ("classic", "economic"):
        loader = DataLoader(data, batch_size=4, num_workers=2, worker_type="thread", mode=mode)
        for _ in range(12):
            assert torch.equal(torch.cat(list(loader)), data)
        stats = loader.stats()
        recorder = loader._stats
        assert recorder._seen == {} and recorder._lags == {}  # every session closed and folded
        kinds = {(line.kind, line.worker_id) for line in stats.workers}
        assert len(kinds) == len(stats.workers)
        fetching = [line for line in stats.workers if line.kind in ("", "item")]
        assert sum(line.samples for line in fetching) == 12 * 20


def test_a_started_worker_has_an_idle_line_until_it_reports_and_a_lent_clock_is_kept() -> None:
    from pipeload.engine.workers import WorkerLabel

    recorder = StatsRecorder(LoaderSetup("classic", "thread", 3, 2, 4, False))
    session = recorder.new_session(6)
    clock = StageClock(1)
    session.lend_clock(2)(clock)  # a thread worker may lend its clock before the pool says it started
    session.started([WorkerLabel("", worker_id) for worker_id in range(3)])
    assert recorder._seen[(1, "", 2)] == (clock, None)
    worker = StageClock(1)
    worker._counted = 2
    session.record([WorkerReport(Report.BATCH, 0, 1, totals=worker.snapshot())])
    assert [(w.worker_id, w.tasks, w.busy_fraction) for w in recorder.snapshot().workers][1] == (1, 0, 0.0)
    assert [w.tasks for w in recorder.snapshot().workers][0] == 2
    session.close()  # the worker that never reported keeps its (empty) line
    assert [w.worker_id for w in recorder.snapshot().workers] == [0, 1, 2]
