"""The in-flight budget: as many batches as keep the consumer fed, never more than torch keeps."""

from __future__ import annotations

from pipeload.engine.budget import CALM_REQUESTS, InFlightBudget


class Clock:
    """A clock the test moves by hand (the budget reads time only through it)."""

    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


def _serve(budget: InFlightBudget, clock: Clock, consume_s: float, starved: bool = False) -> None:
    """One request: the consumer worked ``consume_s``, asked, and got its batch."""
    clock.now += consume_s
    budget.request_started()
    budget.request_served(starved)
    budget.consumer_resumes()


def test_the_first_wave_is_one_task_per_worker_then_nothing_until_the_pace_is_known():
    clock = Clock()
    budget = InFlightBudget(max_batches=8, num_workers=4, max_bytes=1 << 40, clock=clock)
    assert budget.allowed(0) == 4
    budget.batch_built(0.5)
    _serve(budget, clock, 0.0)
    assert budget.allowed(0) == 1  # the consumer's pace is not known yet


def test_a_fast_consumer_gets_everything_torch_would_keep_in_flight():
    clock = Clock()
    budget = InFlightBudget(max_batches=8, num_workers=4, max_bytes=1 << 40, clock=clock)
    budget.batch_built(0.05)
    for _ in range(3):
        _serve(budget, clock, 0.0001)
    assert budget.allowed(0) == 8


def test_a_slow_consumer_keeps_one_batch_in_flight():
    clock = Clock()
    budget = InFlightBudget(max_batches=4, num_workers=2, max_bytes=1 << 40, clock=clock)
    for _ in range(4):
        budget.batch_built(0.05)
        _serve(budget, clock, 0.2)
    assert budget.allowed(0) == 1


def test_in_between_it_keeps_what_the_ratio_needs():
    clock = Clock()
    budget = InFlightBudget(max_batches=16, num_workers=8, max_bytes=1 << 40, clock=clock)
    for _ in range(6):
        budget.batch_built(0.3)
        _serve(budget, clock, 0.1)
    assert budget.allowed(0) == 4  # ceil(1.25 * 0.3 / 0.1)


def test_starved_requests_add_batches_and_calm_ones_give_them_back():
    clock = Clock()
    budget = InFlightBudget(max_batches=4, num_workers=2, max_bytes=1 << 40, clock=clock)
    for _ in range(4):
        budget.batch_built(0.05)
        _serve(budget, clock, 0.2)
    _serve(budget, clock, 0.2, starved=True)
    _serve(budget, clock, 0.2, starved=True)
    assert budget.allowed(0) == 3
    for _ in range(2 * CALM_REQUESTS):
        _serve(budget, clock, 0.2)
    assert budget.allowed(0) == 1


def test_the_byte_budget_caps_it_but_one_batch_always_flies():
    clock = Clock()
    budget = InFlightBudget(max_batches=8, num_workers=4, max_bytes=100, clock=clock)
    budget.batch_built(0.05)
    for _ in range(3):
        _serve(budget, clock, 0.0001)
    assert budget.allowed(batch_bytes=30) == 3
    assert budget.allowed(batch_bytes=1000) == 1


def test_a_new_epoch_does_not_count_the_gap_as_consumer_time():
    clock = Clock()
    budget = InFlightBudget(max_batches=4, num_workers=2, max_bytes=1 << 40, clock=clock)
    budget.batch_built(0.05)
    for _ in range(3):
        _serve(budget, clock, 0.0001)
    assert budget.allowed(0) == 4
    budget.epoch_started()
    clock.now += 60.0  # validation between epochs
    _serve(budget, clock, 0.0001)
    assert budget.allowed(0) == 4
