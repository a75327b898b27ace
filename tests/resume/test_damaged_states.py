"""Damaged checkpoints are refused whole, before anything is set, naming what is wrong.

The issue's own examples (issue 25, item 2), each an ``IncompatibleStateError`` naming the field
by its path and the value received; a refused state leaves the loader (and a sampler) as it was,
its next epochs what they would have been; states of the previous version (no digest) still
load, every field of ours still checked, and their pipes' states tried through the pipes' own
``load_state_dict()``; the digest survives JSON and ``torch.save``.
"""

from __future__ import annotations

import copy
import io
import json
import re
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch
from conftest import LeakGuard
from state_damage import REMOVE, edited, value_at
from states_for_tests import (
    CASES,
    LENGTH,
    Augmented,
    OwnState,
    checkpoint,
    epoch_of,
    loader_of,
    pipe_loader,
    resume,
    seed_everything,
    seeded_loader,
    write_shards,
)

import pipeload
from pipeload._state_digest import digest_of
from pipeload.errors import IncompatibleStateError


def mid_epoch_state(make: Callable[[], pipeload.DataLoader] = seeded_loader, taken: int = 2) -> dict[str, Any]:
    seed_everything(0)
    loader = make()
    epoch_of(loader, 0, taken)
    return json.loads(json.dumps(loader.state_dict()))


def refused(state: dict[str, Any], make: Callable[[], pipeload.DataLoader] = seeded_loader) -> str:
    with pytest.raises(IncompatibleStateError) as caught:
        make().load_state_dict(state)
    return str(caught.value)


def with_change(state: dict[str, Any], change: Callable[[dict[str, Any]], Any]) -> dict[str, Any]:
    damaged = copy.deepcopy(state)
    change(damaged)
    return damaged


def as_version_1(state: Any) -> Any:
    """The state as the previous pipeload wrote it: version 1, no digest (samplers' too)."""
    if isinstance(state, dict):
        state = {k: as_version_1(v) for k, v in state.items() if k != "digest"}
        if isinstance(state.get("version"), int) and ("type" in state or state.get("format")):
            state["version"] = 1
        return state
    if isinstance(state, list):
        return [as_version_1(v) for v in state]
    return state


# -- the issue's examples -------------------------------------------------------------------------

EXAMPLES: dict[str, tuple[Callable[[dict[str, Any]], Any], str]] = {
    "consumed -5": (lambda s: s["epoch"].update(consumed=-5),
                    "epoch.consumed should be an int >= 0, but got epoch.consumed=-5"),
    "no epoch": (lambda s: s.pop("epoch"), "it should have either 'epoch'"),
    "no config": (lambda s: s.pop("config"), "it has no config"),
    "no global_rng": (lambda s: s["epoch"].pop("global_rng"), "it has no epoch.global_rng"),
    "no consumed": (lambda s: s["epoch"].pop("consumed"), "it has no epoch.consumed"),
    "sampler 'x'": (lambda s: s["epoch"].update(sampler="x"), "epoch.sampler should be a dict, but got epoch.sampler='x'"),
    "generator not base64": (lambda s: s["epoch"].update(generator="not base64!"),
                             "epoch.generator should be a torch generator state"),
    "consumed '5'": (lambda s: s["epoch"].update(consumed="5"), "but got epoch.consumed='5'"),
    "consumed 5.5": (lambda s: s["epoch"].update(consumed=5.5), "but got epoch.consumed=5.5"),
    "consumed past the epoch": (lambda s: s["epoch"].update(consumed=7),
                                "epoch.consumed should be an int from 0 to 6 (the batches of an epoch)"),
    "truncated generator": (lambda s: s["epoch"].update(generator=s["epoch"]["generator"][:-40]),
                            "Expected a CPUGeneratorImplState of size 5056"),
    "truncated sampler generator": (
        lambda s: s["epoch"]["sampler"]["sampler"].update(generator=s["epoch"]["sampler"]["sampler"]["generator"][:4000]),
        "epoch.sampler.sampler.generator should be a torch generator state"),
    "consumed 2 -> 3 (well-formed)": (lambda s: s["epoch"].update(consumed=3), "does not match its digest"),
    "a byte of the generator changed": (
        lambda s: s["epoch"].update(generator=s["epoch"]["generator"][:100] + ("B" if s["epoch"]["generator"][100] != "B" else "C")
                                    + s["epoch"]["generator"][101:]),
        "does not match its digest"),
    "a stray field": (lambda s: s["epoch"].update(consumd=2), "epoch.consumd should be absent"),
}


@pytest.mark.parametrize("example", EXAMPLES)
def test_each_damage_of_the_issue_is_refused_naming_the_field(example: str) -> None:
    change, named = EXAMPLES[example]
    message = refused(with_change(mid_epoch_state(), change))
    assert named in message


def test_a_long_value_is_shortened_in_the_message() -> None:
    state = mid_epoch_state()
    cut = state["epoch"]["global_rng"][:-8]
    message = refused(with_change(state, lambda s: s["epoch"].update(global_rng=cut)))
    assert f"(str of {len(cut)} characters)" in message
    assert len(message) < 400


# -- a refused state changes nothing ----------------------------------------------------------------

def test_a_loader_that_refused_a_state_goes_on_as_it_would_have() -> None:
    state = mid_epoch_state()
    seed_everything(3)
    untouched = seeded_loader()
    expected = [epoch_of(untouched, e)[0] for e in range(2)]
    seed_everything(3)
    loader = seeded_loader()
    for damage in EXAMPLES.values():
        with pytest.raises(IncompatibleStateError):
            loader.load_state_dict(with_change(state, damage[0]))
    assert [epoch_of(loader, e)[0] for e in range(2)] == expected


def test_a_refused_state_keeps_the_state_loaded_before_it() -> None:
    good = mid_epoch_state()
    expected = two_epochs(_loaded(good))
    loader = _loaded(good)
    with pytest.raises(IncompatibleStateError):
        loader.load_state_dict(with_change(good, lambda s: s["epoch"].update(consumed=1)))
    assert loader.state_dict() == good  # still the one loaded, as state_dict() promises
    assert two_epochs(loader) == expected


def two_epochs(loader: pipeload.DataLoader) -> list[Any]:
    seed_everything(5)
    return [epoch_of(loader, e)[0] for e in range(2)]


def _loaded(state: dict[str, Any]) -> pipeload.DataLoader:
    loader = seeded_loader()
    loader.load_state_dict(state)
    return loader


def test_a_sampler_that_refused_a_state_goes_on_as_it_would_have() -> None:
    make = lambda: pipeload.RandomSampler(range(LENGTH), generator=torch.Generator().manual_seed(4))  # noqa: E731
    other = make()
    iterator = iter(other)
    next(iterator)
    state = other.state_dict()
    sampler, untouched = make(), make()
    for damage in (lambda s: s.update(generator=s["generator"][:-4]), lambda s: s["iteration"].update(yielded=-1),
                   lambda s: s["iteration"].update(yielded=3), lambda s: s.pop("config")):
        with pytest.raises(IncompatibleStateError):
            sampler.load_state_dict(with_change(state, damage))
    assert sampler.state_dict() == untouched.state_dict()
    assert list(sampler) == list(untouched)


class RefusingSampler(OwnState):
    """A user's sampler whose own load_state_dict fails halfway on a state it cannot read."""

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.generator.manual_seed(0)  # changed before it finds out
        if state.get("broken"):
            raise KeyError("broken")
        super().load_state_dict(state)


def test_a_users_sampler_refusing_its_state_leaves_it_and_the_loader_as_they_were() -> None:
    make = lambda: pipeload.DataLoader(Augmented(), batch_sampler=pipeload.BatchSampler(  # noqa: E731
        RefusingSampler(), 3, False), worker_seeding="per_batch", generator=torch.Generator().manual_seed(2))
    seed_everything(0)
    original = make()
    epoch_of(original, 0)
    epoch_of(original, 1, 2)  # the loader's generator has moved on: the state sets it back
    state = json.loads(json.dumps(original.state_dict()))
    state["epoch"]["sampler"]["sampler"]["broken"] = True  # as its own code would find it
    state["version"] = 1  # no digest to catch it first: only the sampler's own load can tell
    state["epoch"]["sampler"] = as_version_1(state["epoch"]["sampler"])
    state.pop("digest")
    expected = two_epochs(make())
    loader = make()
    with pytest.raises(IncompatibleStateError, match=re.escape(
            "RefusingSampler.load_state_dict() refused epoch.sampler.sampler (KeyError: 'broken')")):
        loader.load_state_dict(state)
    assert two_epochs(loader) == expected


# -- the previous version's states ------------------------------------------------------------------

@pytest.mark.parametrize("name", ["inline-global-generator", "threads-persistent-between-epochs",
                                  "pipe-shuffle-inline", "batch-sampler-users-sampler"])
def test_a_state_of_the_previous_version_still_resumes_exactly(name: str, tmp_path: Path, leak_guard: LeakGuard) -> None:
    case = CASES[name]
    state = checkpoint(case, None)
    old = as_version_1(state)
    assert "digest" not in json.dumps(old)
    assert resume(case, None, old) == resume(case, None, state)


# written later within version 1; a replica position's "failed" later still (in both versions)
V1_OPTIONAL = {"padded", "handed_out_above", "repeat_from", "failed", "persistent_workers", "graph"}


def our_fields(state: Any, opaque: set[str], path: tuple[Any, ...] = ()) -> list[tuple[Any, ...]]:
    """The paths of every dict field of ours, and a snapshot's count (the replica's state in a
    snapshot, and a user's sampler's state, are theirs: not walked)."""
    found = []
    if isinstance(state, dict):
        for key, value in state.items():
            here = (*path, key)
            if ".".join(map(str, here)) in opaque:
                continue
            if not (len(path) >= 1 and path[-1] == "streams"):  # worker ids: keys, not fields
                found.append(here)
            found.extend(our_fields(value, opaque, here))
    elif isinstance(state, list) and path and path[-1] == "snapshot":
        found.append((*path, 0))
    return found


@pytest.mark.parametrize(("name", "opaque"), [
    ("inline-global-generator", set()),
    ("threads-persistent-later-epoch", set()),
    ("distributed-sampler", set()),
    ("batch-sampler-users-sampler", {"epoch.sampler.sampler"}),
    ("pipe-shuffle-threads", set()),
    ("iterable-own-state", set()),
    ("inline-own-generator-between-epochs", set()),
])
def test_every_field_of_a_previous_version_state_is_checked(name: str, opaque: set[str], leak_guard: LeakGuard) -> None:
    """Without a digest, the field checks alone: each field of ours deleted or given a value of
    another type is refused, the message naming it."""
    case = CASES[name]
    old = as_version_1(checkpoint(case, None))
    target = loader_of(case, None)
    before = target.state_dict()
    checked = 0
    for path in our_fields(old, opaque):
        field = str(path[-1])
        value = value_at(old, path)
        damages = [] if field in V1_OPTIONAL or isinstance(path[-1], int) else [REMOVE]
        damages += [v for v in (True, 2.5, "5", [], {}) if type(v) is not type(value)]
        for damage in damages:
            with pytest.raises(IncompatibleStateError) as caught:
                target.load_state_dict(edited(old, path, lambda _, damage=damage: damage))
            assert field in str(caught.value), f"{'.'.join(map(str, path))} -> {damage!r}: {caught.value}"
            checked += 1
    assert target.state_dict() == before
    assert checked > 40


def test_a_previous_version_pipe_state_is_tried_through_the_pipes_own_load() -> None:
    state = as_version_1(mid_epoch_state(pipe_loader))
    snapshot = state["epoch"]["streams"]["0"]["snapshot"]
    source = snapshot[1]
    while source["upstream"]:
        source = source["upstream"][0]
    source["own"] = "5"  # the items an in-memory source had handed out, as text
    with pytest.raises(IncompatibleStateError, match=r"epoch\.streams\.0\.snapshot is not a state that worker 0's "
                       r"replica of Mapper takes: its load_state_dict\(\) raised IncompatibleStateError: .*"
                       r"upstream\.0\.upstream\.0\.upstream\.0\.own should be an int from 0 to \d+, but got "
                       r"upstream\.0\.upstream\.0\.upstream\.0\.own='5'"):
        pipe_loader().load_state_dict(state)


# -- the digest --------------------------------------------------------------------------------------

@pytest.mark.parametrize("name", ["pipe-shuffle-inline", "tar-shards", "iterable-own-state", "distributed-sampler"])
def test_json_and_torch_save_keep_the_digest(name: str, tmp_path: Path) -> None:
    case = CASES[name]
    shards = write_shards(tmp_path) if case.needs_shards else None
    seed_everything(0)
    loader = loader_of(case, shards)
    _, iterator = epoch_of(loader, 0, 2)
    state = loader.state_dict()
    del iterator
    buffer = io.BytesIO()
    torch.save(state, buffer)
    buffer.seek(0)
    for kept in (json.loads(json.dumps(state)), torch.load(buffer, weights_only=True)):
        assert kept["digest"] == digest_of(kept) == state["digest"]
        loader_of(case, shards).load_state_dict(kept)


@pytest.mark.parametrize(("failed", "named"), [
    ([1], "epoch.streams.0.failed should be a list of distinct batch numbers from 2 to 2, ascending"),
    ([3], "but got epoch.streams.0.failed=[3]"),
    ([2, 2], "but got epoch.streams.0.failed=[2, 2]"),
    ("1", "but got epoch.streams.0.failed='1'"),
])
def test_a_replicas_failed_batches_out_of_its_range_are_refused_by_name(failed: Any, named: str) -> None:
    # (a previous version's state: without a digest, the field check is all there is)
    iterable = CASES["iterable-own-state"].build
    state = as_version_1(mid_epoch_state(iterable))
    position = state["epoch"]["streams"]["0"]
    assert (position["batches"], position["snapshot"][0], position["failed"]) == (2, 1, [])  # batch 2: since
    assert named in refused(with_change(state, lambda s: s["epoch"]["streams"]["0"].update(failed=failed)),
                            iterable)


@pytest.mark.parametrize("saved, here", [("per_batch", "torch"), ("torch", "per_batch")])
def test_a_state_seeded_another_way_is_refused_naming_worker_seeding(saved: str, here: str) -> None:
    # Loaded, it resumed the same indices with other random values in every later sample.
    taken = pipeload.DataLoader(Augmented(), batch_size=4, shuffle=True, worker_seeding=saved)
    iterator = iter(taken)
    next(iterator)
    state = json.loads(json.dumps(taken.state_dict()))
    loader = pipeload.DataLoader(Augmented(), batch_size=4, shuffle=True, worker_seeding=here)
    with pytest.raises(IncompatibleStateError, match=rf"worker_seeding.*{saved!r}.*{here!r}"):
        loader.load_state_dict(state)
    del iterator
