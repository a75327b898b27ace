"""BatchLedger on its own: who builds which batch, what may be yielded, and its invariants."""

from __future__ import annotations

import random

import pytest

from pipeload.engine.reorder import BatchLedger
from pipeload.transport.messages import Report, WorkerReport


def _batch(number: int, worker_id: int) -> WorkerReport:
    return WorkerReport(Report.BATCH, worker_id, number, payload=f"batch {number}")


def _dry(number: int, worker_id: int) -> WorkerReport:
    return WorkerReport(Report.EXHAUSTED, worker_id, number)


def _send(ledger: BatchLedger, count: int) -> list[tuple[int, int]]:
    """Send ``count`` batches; returns (batch number, worker id) for each."""
    sent = []
    for _ in range(count):
        worker_id = ledger.choose_worker()
        assert worker_id is not None
        sent.append((ledger.record_sent(worker_id), worker_id))
    return sent


def _check_invariants(ledger: BatchLedger) -> None:
    assert ledger.next_to_yield <= ledger.next_to_send
    assert len(ledger.building) == sum(map(ledger.in_flight, range(len(ledger.active))))
    assert ledger.outstanding == len(ledger.building) + len(ledger.arrived)
    if ledger.in_order:
        pending = range(ledger.next_to_yield, ledger.next_to_send)
        places = [
            (n in ledger.building) + (n in ledger.arrived) + (n in ledger.skipped) for n in pending
        ]
        assert all(count == 1 for count in places), "every pending batch is in exactly one place"
    for worker_id, active in enumerate(ledger.active):
        if not active:
            assert ledger.in_flight(worker_id) == 0
            assert worker_id not in ledger.building.values()


def test_round_robin_in_order():
    ledger = BatchLedger(3, in_order=True)
    assert [w for _, w in _send(ledger, 7)] == [0, 1, 2, 0, 1, 2, 0]
    assert ledger.next_to_send == 7 and ledger.outstanding == 7


def test_in_order_holds_early_arrivals_until_their_turn():
    ledger = BatchLedger(2, in_order=True)
    _send(ledger, 4)
    ledger.record_report(_batch(1, 1))
    ledger.record_report(_batch(3, 1))
    assert ledger.pop_ready() is None  # batch 0 is still being built
    assert ledger.outstanding == 4  # early arrivals still count against the prefetch budget
    ledger.record_report(_batch(0, 0))
    assert [ledger.pop_ready().batch_number for _ in range(2)] == [0, 1]
    assert ledger.pop_ready() is None
    ledger.record_report(_batch(2, 0))
    assert [ledger.pop_ready().batch_number for _ in range(2)] == [2, 3]
    assert ledger.nothing_left()
    _check_invariants(ledger)


def test_out_of_order_yields_whatever_is_here_and_prefers_idle_workers():
    ledger = BatchLedger(2, in_order=False)
    assert [w for _, w in _send(ledger, 2)] == [0, 1]
    ledger.record_report(_batch(1, 1))
    assert ledger.pop_ready().batch_number == 1
    assert ledger.pop_ready() is None
    # Worker 1 is idle now, worker 0 still busy with batch 0: the next batch goes to worker 1.
    assert ledger.choose_worker() == 1


def test_out_of_order_with_a_prefetch_factor_takes_the_next_worker_with_room_as_torch():
    ledger = BatchLedger(2, in_order=False, prefetch_factor=2)
    assert [w for _, w in _send(ledger, 4)] == [0, 1, 0, 1]  # two each, round-robin
    ledger.record_report(_batch(1, 1))
    assert ledger.pop_ready().batch_number == 1
    # worker 0 (batches 0 and 2) is full; worker 1 has room: it takes the next, and the next
    assert ledger.choose_worker() == 1
    ledger.record_sent(1)
    ledger.record_report(_batch(3, 1))
    assert ledger.choose_worker() == 1
    # once worker 0 has room again, the rotation comes back to it, however idle worker 1 is
    ledger.record_report(_batch(0, 0))
    assert ledger.choose_worker() == 0


def test_least_loaded_in_order_still_yields_in_order():
    # Economic mode's batch workers: the least loaded takes the next batch, order is kept anyway.
    ledger = BatchLedger(2, in_order=True, least_loaded=True)
    assert _send(ledger, 2) == [(0, 0), (1, 1)]
    ledger.record_report(_batch(1, 1))
    assert ledger.choose_worker() == 1  # worker 0 still builds batch 0
    assert ledger.pop_ready() is None  # batch 1 waits for batch 0
    ledger.record_report(_batch(0, 0))
    assert [ledger.pop_ready().batch_number, ledger.pop_ready().batch_number] == [0, 1]


def test_out_of_order_yields_lowest_number_first_among_arrivals():
    ledger = BatchLedger(3, in_order=False)
    _send(ledger, 3)
    for number in (2, 0):
        ledger.record_report(_batch(number, number))
    assert [ledger.pop_ready().batch_number for _ in range(2)] == [0, 2]


def test_failures_are_held_and_yielded_like_batches():
    ledger = BatchLedger(2, in_order=True)
    _send(ledger, 2)
    failed = WorkerReport(Report.FAILED, 1, 1, payload=None)
    ledger.record_report(failed)
    ledger.record_report(_batch(0, 0))
    assert ledger.pop_ready().report is Report.BATCH
    assert ledger.pop_ready() is failed


def test_dry_worker_is_retired_and_what_it_owes_is_skipped():
    ledger = BatchLedger(2, in_order=True)
    _send(ledger, 6)  # worker 0: 0, 2, 4; worker 1: 1, 3, 5
    ledger.record_report(_batch(0, 0))
    ledger.record_report(_dry(2, 0))  # worker 0 ran dry at batch 2; it will never send 4
    assert ledger.active == [False, True]
    assert [ledger.in_flight(0), ledger.in_flight(1)] == [0, 3]
    assert ledger.answered_per_worker == [2, 0]  # the batch and the dry report; 4 was skipped
    _check_invariants(ledger)
    assert ledger.choose_worker() == 1  # only worker 1 gets work now

    assert ledger.pop_ready().batch_number == 0
    for number in (1, 3, 5):
        ledger.record_report(_batch(number, 1))
    assert [ledger.pop_ready().batch_number for _ in range(3)] == [1, 3, 5]
    assert ledger.pop_ready() is None
    assert ledger.nothing_left()


def test_report_for_a_task_of_a_retired_worker_is_ignored():
    ledger = BatchLedger(2, in_order=True)
    _send(ledger, 4)
    ledger.record_report(_dry(0, 0))
    ledger.record_report(_batch(2, 0))  # cannot happen with a real worker; must not corrupt state
    _check_invariants(ledger)
    assert 2 not in ledger.arrived


def test_all_workers_dry_means_nothing_left():
    ledger = BatchLedger(2, in_order=True)
    _send(ledger, 4)
    ledger.record_report(_dry(0, 0))
    ledger.record_report(_dry(1, 1))
    assert ledger.choose_worker() is None
    assert not ledger.any_active()
    assert ledger.pop_ready() is None
    assert ledger.nothing_left()
    _check_invariants(ledger)


def test_out_of_order_dry_worker():
    ledger = BatchLedger(2, in_order=False)
    _send(ledger, 4)
    ledger.record_report(_dry(0, 0))
    ledger.record_report(_batch(1, 1))
    assert ledger.pop_ready().batch_number == 1
    assert not ledger.skipped  # out of order nothing waits on a number, so nothing is skipped
    assert ledger.outstanding == len(ledger.building) == sum(map(ledger.in_flight, range(len(ledger.active))))


@pytest.mark.parametrize("in_order", [True, False])
@pytest.mark.parametrize("seed", range(20))
def test_random_schedules_deliver_every_batch_exactly_once(in_order, seed):
    """Random arrival orders, random budgets, some workers running dry: every batch a worker
    built is yielded exactly once, in order when asked, and the invariants hold throughout."""
    rng = random.Random(seed)
    num_workers = rng.randint(1, 4)
    budget = rng.randint(1, 3) * num_workers
    dry_after = {w: rng.choice([None, rng.randint(0, 6)]) for w in range(num_workers)}
    built = {w: 0 for w in range(num_workers)}
    ledger = BatchLedger(num_workers, in_order)
    total, yielded, delivered = 40, [], []

    while True:
        while ledger.next_to_send < total and ledger.outstanding < budget:
            worker_id = ledger.choose_worker()
            if worker_id is None:
                break
            ledger.record_sent(worker_id)
        _check_invariants(ledger)
        if not ledger.building:
            break
        number = rng.choice(sorted(ledger.building))
        worker_id = ledger.building[number]
        if dry_after[worker_id] is not None and built[worker_id] >= dry_after[worker_id]:
            ledger.record_report(_dry(number, worker_id))
        else:
            built[worker_id] += 1
            ledger.record_report(_batch(number, worker_id))
            delivered.append(number)
        _check_invariants(ledger)
        while (report := ledger.pop_ready()) is not None:
            yielded.append(report.batch_number)
    while (report := ledger.pop_ready()) is not None:
        yielded.append(report.batch_number)

    assert ledger.nothing_left()
    assert sorted(yielded) == sorted(delivered)
    assert len(set(yielded)) == len(yielded)
    if in_order:
        assert yielded == sorted(yielded)
    if all(limit is None for limit in dry_after.values()):
        assert sorted(yielded) == list(range(total))
