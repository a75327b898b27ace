"""The checkpoint fuzz: a damaged state is refused, or resumes exactly; nothing else.

Real states from every engine and mode (``states_for_tests.CASES``: no workers, process and
thread workers, persistent sessions, economic mode, ``in_order=False``, samplers of ours and a
user's, an iterable with and without a state, a DataPipe graph with a shuffle, tar shards; with
and without a generator; mid-epoch and between epochs) are damaged by a seeded generator: a field
or an item deleted, a value swapped for one of another type, a text, list or dict truncated, a bit
flipped in an int, a float, a bool or a character. 1,000 damaged states in all
(``PIPELOAD_FUZZ_SEED`` picks other damages). Each one must be

- refused with ``IncompatibleStateError``, leaving the loader as it was (its ``state_dict()`` and
  torch's global generator unchanged: ``test_damaged_states.py`` shows by iterating that such a
  loader's next epochs are what they would have been), or
- accepted, and then resume exactly as the undamaged state does (the rest of its epoch and the
  next, every random value included): a damage that changes nothing that matters, such as a list
  kept as a tuple.

Any other exception, or an accepted state that resumes otherwise, fails the test.
"""

from __future__ import annotations

import os
import random
from pathlib import Path
from typing import Any

import pytest
import torch
from conftest import LeakGuard
from state_damage import damaged, try_load
from states_for_tests import CASES, Case, checkpoint, loader_of, resume, write_shards


DAMAGES = 1000
PER_CASE = -(-DAMAGES // len(CASES))
SEED = int(os.environ.get("PIPELOAD_FUZZ_SEED", "0"))
def fingerprint(loader: Any) -> tuple[Any, torch.Tensor]:
    return loader.state_dict(), torch.get_rng_state()


def unchanged(loader: Any, before: tuple[Any, torch.Tensor]) -> bool:
    state, rng = fingerprint(loader)
    return state == before[0] and torch.equal(rng, before[1])


def fuzz(case: Case, shards: list[str] | None, count: int, seed: int) -> tuple[int, list[str]]:
    """Damage ``count`` copies of the case's state; (accepted, failures as text)."""
    state = checkpoint(case, shards)
    expected = resume(case, shards, state)
    rng = random.Random(seed)
    target = loader_of(case, shards)  # a refused state leaves it as it was: one serves them all
    before = fingerprint(target)
    accepted, failures = 0, []
    for _ in range(count):
        what, bad = damaged(state, rng)
        loaded, failure = try_load(lambda: target.load_state_dict(bad), what, lambda: unchanged(target, before))
        if failure:
            failures.append(failure)
        if not loaded:
            continue
        accepted += 1
        try:
            if resume(case, shards, bad) != expected:
                failures.append(f"{what}: accepted, and resumed otherwise")
        except Exception as error:  # noqa: BLE001 - accepted, then failing from deep inside
            failures.append(f"{what}: accepted, then {type(error).__name__}: {error}"[:300])
        target = loader_of(case, shards)
        before = fingerprint(target)
    return accepted, failures


@pytest.mark.timeout(180)
@pytest.mark.parametrize("name", CASES)
def test_a_damaged_state_is_refused_or_resumes_exactly(name: str, tmp_path: Path, leak_guard: LeakGuard) -> None:
    case = CASES[name]
    shards = write_shards(tmp_path) if case.needs_shards else None
    seed = SEED * 1000 + list(CASES).index(name)
    accepted, failures = fuzz(case, shards, PER_CASE, seed)
    assert not failures, f"{len(failures)} of {PER_CASE} damaged states (seed {seed}):\n" + "\n".join(failures[:10])
    assert accepted < PER_CASE // 4  # nearly all damage is refused: the digest sees it


def test_the_fuzz_damages_1000_states() -> None:
    assert PER_CASE * len(CASES) >= DAMAGES


@pytest.mark.slow
@pytest.mark.timeout(900)
@pytest.mark.parametrize("name", CASES)
def test_ten_times_more_damage(name: str, tmp_path: Path, leak_guard: LeakGuard) -> None:
    case = CASES[name]
    shards = write_shards(tmp_path) if case.needs_shards else None
    accepted, failures = fuzz(case, shards, PER_CASE * 10, 10_000 + SEED * 1000 + list(CASES).index(name))
    assert not failures, "\n".join(failures[:10])
