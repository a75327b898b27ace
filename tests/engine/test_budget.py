"""The in-flight budget: as many batches as keep the consumer fed, never more than torch keeps."""

from __future__ import annotations

import pytest

from pipeload.engine.budget import (
    CALM_REQUESTS,
    GROW_AFTER,
    LARGE_BATCH_BYTES,
    POOL_TOLERATED_WAIT,
    TOLERATED_WAIT,
    InFlightBudget,
    PoolBuildClock,
)


class Clock:
    """A clock the test moves by hand (the budget reads time only through it)."""

    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


def _serve(budget: InFlightBudget, clock: Clock, consume_s: float, starved: bool = False,
           waited_s: float = 0.0) -> None:
    """One request: the consumer worked ``consume_s``, asked, and got its batch."""
    clock.now += consume_s
    budget.request_started()
    budget.request_served(starved, waited_s)
    budget.consumer_resumes()


def test_the_first_wave_is_one_task_per_worker_then_nothing_until_the_pace_is_known():
    clock = Clock()
    budget = InFlightBudget(max_batches=8, num_workers=4, max_bytes=1 << 40, clock=clock)
    assert budget.allowed(0) == 4
    budget.batch_built(0.5)
    _serve(budget, clock, 0.0)
    assert budget.allowed(0) == 1  # the consumer's pace is not known yet


def test_batches_that_travel_inline_all_fly_whatever_the_consumer_pace():
    clock = Clock()
    budget = InFlightBudget(max_batches=8, num_workers=4, max_bytes=1 << 40, clock=clock)
    budget.batch_built(0.5)
    _serve(budget, clock, 0.0)
    assert budget.allowed(0, inline_only=True) == 8  # no waiting for the consumer's pace
    for _ in range(4):  # a slow consumer would keep one in flight; inline ones cost nothing
        budget.batch_built(0.05)
        _serve(budget, clock, 0.2)
    assert budget.allowed(0) == 1
    assert budget.allowed(0, inline_only=True) == 8
    budget.set_max_batches(2)
    assert budget.allowed(0, inline_only=True) == 2  # still never more than torch keeps


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


def _large_batches(build_s: float, consume_s: float,
                   requests: int = 2 + GROW_AFTER) -> tuple[InFlightBudget, Clock]:
    clock = Clock()
    budget = InFlightBudget(max_batches=4, num_workers=2, max_bytes=1 << 40, clock=clock)
    budget.allowed(LARGE_BATCH_BYTES)
    for _ in range(requests):
        budget.batch_built(build_s)
        _serve(budget, clock, consume_s)
    return budget, clock


def test_large_batches_fly_one_at_a_time_while_a_build_takes_about_a_step():
    # Small batches keep a margin (2 in flight here); a large one costs a slab, so one flies
    # while the consumer would wait at most TOLERATED_WAIT of its step.
    budget, _ = _large_batches(build_s=0.2 * (1 + TOLERATED_WAIT) - 0.01, consume_s=0.2)
    assert budget.allowed(LARGE_BATCH_BYTES) == 1
    assert budget.allowed(0) == 2
    slower, _ = _large_batches(build_s=0.5, consume_s=0.2)
    assert slower.allowed(LARGE_BATCH_BYTES) == 3  # ceil(2.5 - TOLERATED_WAIT)


def test_large_batches_count_only_waits_beyond_the_tolerated_share_as_starving():
    budget, clock = _large_batches(build_s=0.1, consume_s=0.2)
    _serve(budget, clock, 0.2, starved=True, waited_s=0.2 * TOLERATED_WAIT / 2)
    assert budget.allowed(LARGE_BATCH_BYTES) == 1
    _serve(budget, clock, 0.2, starved=True, waited_s=0.2 * TOLERATED_WAIT * 2)
    assert budget.allowed(LARGE_BATCH_BYTES) == 2


def test_large_batches_get_another_slab_only_when_the_estimate_keeps_asking():
    # The pace is known from the second request on; the estimate must ask GROW_AFTER times.
    budget, clock = _large_batches(build_s=0.5, consume_s=0.2, requests=GROW_AFTER)
    assert budget.allowed(LARGE_BATCH_BYTES) == 1
    budget.batch_built(0.5)
    _serve(budget, clock, 0.2)
    assert budget.allowed(LARGE_BATCH_BYTES) == 3
    # One slow build among quick ones leaves no slab behind.
    steady, clock = _large_batches(build_s=0.1, consume_s=0.2)
    steady.batch_built(0.9)
    _serve(steady, clock, 0.2)
    for _ in range(GROW_AFTER):
        steady.batch_built(0.1)
        _serve(steady, clock, 0.2)
        assert steady.allowed(LARGE_BATCH_BYTES) == 1


def test_the_pool_build_clock_times_batches_one_after_another_and_skips_the_first():
    clock = PoolBuildClock()
    clock.opened(0, at=10.0)
    clock.opened(1, at=10.0)  # opened together: the pool starts on 1 once 0 is done
    assert clock.arrived(0, at=11.5) == 0.0  # the first of an epoch waited for the workers too
    assert clock.arrived(1, at=11.6) == pytest.approx(0.1)
    clock.opened(2, at=12.0)  # opened after the pool went idle (a slow training loop)
    assert clock.arrived(2, at=12.15) == pytest.approx(0.15)
    assert clock.arrived(9, at=13.0) == 0.0  # never opened here (an earlier epoch's)


def test_a_pool_that_builds_batches_one_at_a_time_tolerates_half_a_step_before_another_slab():
    def pool_budget(build_s: float) -> InFlightBudget:
        clock = Clock()
        budget = InFlightBudget(max_batches=2, num_workers=1, max_bytes=1 << 40, clock=clock,
                                tolerated_wait=POOL_TOLERATED_WAIT)
        budget.allowed(LARGE_BATCH_BYTES)
        for _ in range(2 + GROW_AFTER):
            budget.batch_built(build_s)
            _serve(budget, clock, 0.2)
        return budget

    # 1.3 steps: a classic worker's budget takes a second slab, the pool's does not.
    assert _large_batches(build_s=0.26, consume_s=0.2)[0].allowed(LARGE_BATCH_BYTES) == 2
    assert pool_budget(0.26).allowed(LARGE_BATCH_BYTES) == 1
    assert pool_budget(0.2 * (1 + POOL_TOLERATED_WAIT) - 0.01).allowed(LARGE_BATCH_BYTES) == 1
    assert pool_budget(0.2 * (1 + POOL_TOLERATED_WAIT) + 0.01).allowed(LARGE_BATCH_BYTES) == 2
    # A wait counts as starving only beyond half a step.
    budget = pool_budget(0.1)
    budget.request_served(starved=True, waited_s=0.2 * POOL_TOLERATED_WAIT * 0.9)
    assert budget.allowed(LARGE_BATCH_BYTES) == 1
    budget.request_served(starved=True, waited_s=0.2 * POOL_TOLERATED_WAIT * 1.1)
    assert budget.allowed(LARGE_BATCH_BYTES) == 2
