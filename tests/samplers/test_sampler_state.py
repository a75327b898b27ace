"""Samplers' state_dict/load_state_dict: a sampler loaded from a checkpoint taken mid-iteration
yields exactly what the original went on to yield, then the same following iterations."""

from __future__ import annotations

import json
import random
import re
from collections.abc import Callable
from typing import Any

import pytest
import torch
from state_damage import damaged

import pipeload
from pipeload.errors import IncompatibleStateError


def seeded(seed: int) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


class OwnState(pipeload.Sampler[int]):
    """A user's sampler with a generator and a state_dict() of its own (no pipeload base)."""

    def __init__(self) -> None:
        self.generator = seeded(9)

    def __iter__(self) -> Any:
        return iter(torch.randperm(11, generator=self.generator).tolist())

    def __len__(self) -> int:
        return 11

    def state_dict(self) -> dict[str, Any]:
        return {"generator": self.generator.get_state().tolist()}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.generator.set_state(torch.tensor(state["generator"], dtype=torch.uint8))


SAMPLERS: dict[str, Callable[[], Any]] = {
    "sequential": lambda: pipeload.SequentialSampler(range(11)),
    "random-own-generator": lambda: pipeload.RandomSampler(range(11), generator=seeded(3)),
    "random-global": lambda: pipeload.RandomSampler(range(11)),
    "random-replacement": lambda: pipeload.RandomSampler(range(11), replacement=True, num_samples=70,
                                                         generator=seeded(3)),
    "random-more-than-length": lambda: pipeload.RandomSampler(range(5), num_samples=17),
    "subset-global": lambda: pipeload.SubsetRandomSampler([4, 8, 15, 16, 23, 42]),
    "weighted-own-generator": lambda: pipeload.WeightedRandomSampler([1.0, 2.0, 3.0], 9, generator=seeded(1)),
    "weighted-global": lambda: pipeload.WeightedRandomSampler([1.0, 2.0, 3.0, 0.5], 3, replacement=False),
    "distributed": lambda: pipeload.DistributedSampler(range(11), num_replicas=3, rank=1, seed=5),
    "batch-of-random": lambda: pipeload.BatchSampler(pipeload.RandomSampler(range(11)), 3, False),
    "batch-of-users-own-state": lambda: pipeload.BatchSampler(OwnState(), 3, False),
    "batch-drop-last": lambda: pipeload.BatchSampler(
        pipeload.RandomSampler(range(11), generator=seeded(2)), 4, True),
}


@pytest.mark.parametrize("name", SAMPLERS)
@pytest.mark.parametrize("taken", [0, 1, 2])
def test_resumed_sampler_goes_on_as_the_original(name: str, taken: int) -> None:
    make = SAMPLERS[name]
    torch.manual_seed(7)
    original = make()
    first = list(original)  # an earlier iteration: generators have moved on
    iterator = iter(original)
    head = [next(iterator) for _ in range(taken)]
    state = json.loads(json.dumps(original.state_dict()))  # JSON all the way
    global_state = torch.get_rng_state()
    if isinstance(original, pipeload.DistributedSampler):
        original.set_epoch(1)  # a later epoch must come from the state's epoch, then this one
    rest, following = list(iterator), list(original)

    torch.manual_seed(12345)  # a new process: other global state...
    resumed = make()
    torch.set_rng_state(global_state)  # ...until the user restores theirs, as a checkpoint does
    resumed.load_state_dict(state)
    assert head + list(resumed) == head + rest
    if isinstance(resumed, pipeload.DistributedSampler):
        resumed.set_epoch(1)
    assert list(resumed) == following
    assert len(first) == len(head + rest) or isinstance(original, pipeload.BatchSampler)


def test_a_finished_iteration_resumes_as_the_next_one() -> None:
    original = pipeload.RandomSampler(range(6), generator=seeded(0))
    list(original)
    state = original.state_dict()
    assert state["iteration"] is None
    following = list(original)
    resumed = pipeload.RandomSampler(range(6), generator=seeded(99))
    resumed.load_state_dict(state)
    assert list(resumed) == following


def test_the_state_holds_no_indices() -> None:
    sampler = pipeload.RandomSampler(range(1_000_000), generator=seeded(0))
    iterator = iter(sampler)
    next(iterator)
    assert len(json.dumps(sampler.state_dict())) < 16_000  # two generator states, not a permutation


@pytest.mark.parametrize(("make_other", "named"), [
    (lambda: pipeload.RandomSampler(range(12)), "length differs (state: 11, here: 12)"),
    (lambda: pipeload.SequentialSampler(range(11)), "sampler type differs"),
    (lambda: pipeload.DistributedSampler(range(11), num_replicas=4, rank=1), "num_replicas differs (state: 3, here: 4)"),
])
def test_a_state_from_another_configuration_is_refused(make_other: Callable[[], Any], named: str) -> None:
    source = (pipeload.DistributedSampler(range(11), num_replicas=3, rank=1)
              if "num_replicas" in named else pipeload.RandomSampler(range(11)))
    with pytest.raises(IncompatibleStateError, match=named.replace("(", r"\(").replace(")", r"\)")):
        make_other().load_state_dict(source.state_dict())


@pytest.mark.parametrize("own_before", [True, False])
def test_a_state_drawn_from_another_generator_is_refused(own_before: bool) -> None:
    # Replayed from the other generator, the iteration would go on in another order, silently.
    make = lambda own: pipeload.RandomSampler(range(11), generator=seeded(4) if own else None)  # noqa: E731
    original = make(own_before)
    next(iter(original))
    named = {True: "its own", False: "torch's global"}
    with pytest.raises(IncompatibleStateError, match=re.escape(
            f"generator differs (state: {named[own_before]!r}, here: {named[not own_before]!r})")):
        make(not own_before).load_state_dict(original.state_dict())


def test_batch_size_and_version_are_checked() -> None:
    state = pipeload.BatchSampler(range(10), 4, False).state_dict()
    with pytest.raises(IncompatibleStateError, match="batch_size differs"):
        pipeload.BatchSampler(range(10), 5, False).load_state_dict(state)
    with pytest.raises(IncompatibleStateError, match="version 99"):
        pipeload.BatchSampler(range(10), 4, False).load_state_dict({**state, "version": 99})


def _two_iterations(sampler: Any) -> list[Any]:
    torch.manual_seed(21)  # the same global generator for every sampler compared
    if isinstance(sampler, pipeload.DistributedSampler):
        return [list(sampler), (sampler.set_epoch(sampler.epoch + 1), list(sampler))[1]]
    return [list(sampler), list(sampler)]


@pytest.mark.parametrize("name", SAMPLERS)
def test_a_damaged_state_is_refused_or_resumes_exactly(name: str) -> None:
    """A sampler's state damaged at random (tests/state_damage.py): refused with
    IncompatibleStateError, the sampler as it was, or loaded and resumed as the undamaged one."""
    make = SAMPLERS[name]
    original = make()
    iterator = iter(original)
    next(iterator), next(iterator)
    state = json.loads(json.dumps(original.state_dict()))
    reference = make()
    reference.load_state_dict(state)
    expected = _two_iterations(reference)
    rng, target = random.Random(name), make()
    before = target.state_dict()
    for _ in range(60):
        what, bad = damaged(state, rng)
        try:
            target.load_state_dict(bad)
        except IncompatibleStateError:
            assert target.state_dict() == before, f"{what}: refused, but the sampler changed"
            continue
        assert _two_iterations(target) == expected, f"{what}: accepted, and resumed otherwise"
        target = make()
        before = target.state_dict()


def test_a_state_of_the_previous_version_still_loads() -> None:
    original = pipeload.BatchSampler(pipeload.RandomSampler(range(11), generator=seeded(3)), 3, False)
    iterator = iter(original)
    next(iterator)
    state = original.state_dict()
    old = {k: v for k, v in state.items() if k != "digest"} | {"version": 1}
    old["sampler"] = {k: v for k, v in state["sampler"].items() if k != "digest"} | {"version": 1}
    resumed, again = (pipeload.BatchSampler(pipeload.RandomSampler(range(11), generator=seeded(8)), 3, False)
                      for _ in range(2))
    resumed.load_state_dict(old)
    again.load_state_dict(state)
    assert list(resumed) == list(again) == list(iterator)
    with pytest.raises(IncompatibleStateError, match=r"sampler\.iteration\.yielded should be an int from 0 to 11"):
        inner = old["sampler"]
        resumed.load_state_dict({**old, "sampler": {**inner, "iteration": {**inner["iteration"], "yielded": 12}}})


@pytest.mark.parametrize("batched", [False, True])
def test_a_state_taken_right_after_loading_one_still_holds_the_loaded_iterations_rest(batched: bool) -> None:
    # A framework that saves right after it restores: the second state had lost the resumed
    # iteration, and resuming from it gave neither that iteration's rest nor the next one.
    def make() -> Any:
        sampler = pipeload.RandomSampler(range(8), generator=torch.Generator().manual_seed(1))
        return pipeload.BatchSampler(sampler, 3, False) if batched else sampler

    whole = list(make())
    first = make()
    iterator = iter(first)
    head = [next(iterator) for _ in range(1 if batched else 3)]
    restored = make()
    restored.load_state_dict(first.state_dict())
    again = make()
    again.load_state_dict(restored.state_dict())
    assert head + list(again) == head + list(restored) == whole


def test_a_state_is_refused_by_a_subset_or_weighted_sampler_over_other_keys_of_the_same_length() -> None:
    # Only the count was recorded: the position replayed over other indices or weights.
    def taken(sampler: Any) -> dict[str, Any]:
        iterator = iter(sampler)
        next(iterator)
        return sampler.state_dict()

    subset = taken(pipeload.SubsetRandomSampler([0, 1, 2, 3], generator=torch.Generator().manual_seed(0)))
    with pytest.raises(pipeload.IncompatibleStateError, match=r"indices differs"):
        pipeload.SubsetRandomSampler([4, 5, 6, 7], generator=torch.Generator().manual_seed(0)).load_state_dict(subset)
    weighted = taken(pipeload.WeightedRandomSampler([1.0, 2.0, 3.0], 6, generator=torch.Generator().manual_seed(0)))
    with pytest.raises(pipeload.IncompatibleStateError, match=r"weights_digest differs"):
        pipeload.WeightedRandomSampler([3.0, 2.0, 1.0], 6, generator=torch.Generator().manual_seed(0)).load_state_dict(weighted)
    same = pipeload.WeightedRandomSampler([1.0, 2.0, 3.0], 6, generator=torch.Generator().manual_seed(0))
    same.load_state_dict(json.loads(json.dumps(weighted)))  # the same weights: loads
