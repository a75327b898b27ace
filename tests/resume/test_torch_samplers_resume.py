"""torch's own samplers handed to the loader: one with a generator of its own cannot resume a
later epoch (its generator is the user's, not in the state); the warning says so and names
pipeload's sampler of the same name, which resumes exactly with the same draws."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import pytest
import torch
import torch.utils.data as torch_data

import pipeload

DATA = list(range(11))


def _torch_random() -> dict[str, Any]:
    return {"sampler": torch_data.RandomSampler(DATA, generator=torch.Generator().manual_seed(5)),
            "batch_size": 3}


def _torch_batches() -> dict[str, Any]:
    inner = torch_data.RandomSampler(DATA, generator=torch.Generator().manual_seed(5))
    return {"batch_sampler": torch_data.BatchSampler(inner, 3, drop_last=False)}


def _ours_random() -> dict[str, Any]:
    return {"sampler": pipeload.RandomSampler(DATA, generator=torch.Generator().manual_seed(5)),
            "batch_size": 3}


def _epochs(loader: pipeload.DataLoader, count: int) -> list[list[list[int]]]:
    return [[batch.tolist() for batch in loader] for _ in range(count)]


def _state_in_second_epoch(arguments: Callable[[], dict[str, Any]]) -> tuple[dict[str, Any], list[list[int]]]:
    loader = pipeload.DataLoader(DATA, **arguments())
    _epochs(loader, 1)
    iterator = iter(loader)
    taken = [next(iterator).tolist()]
    return loader.state_dict(), taken


@pytest.mark.parametrize(("arguments", "names"), [
    (_torch_random, "pipeload.RandomSampler takes"),
    (_torch_batches, "pipeload.BatchSampler and pipeload.RandomSampler take"),
])
def test_a_torch_sampler_with_its_own_generator_is_warned_with_ours_named(
        arguments: Callable[[], dict[str, Any]], names: str) -> None:
    state, _ = _state_in_second_epoch(arguments)
    with pytest.warns(UserWarning, match="has no state_dict") as caught:
        pipeload.DataLoader(DATA, **arguments()).load_state_dict(state)
    assert len(caught) == 1
    assert f"{names} the same arguments as torch's" in str(caught[0].message)


def test_ours_of_the_same_name_resumes_a_later_epoch_exactly_with_torchs_draws() -> None:
    torchs = _epochs(torch_data.DataLoader(DATA, **_torch_random()), 2)
    state, taken = _state_in_second_epoch(_ours_random)
    resumed = pipeload.DataLoader(DATA, **_ours_random())
    resumed.load_state_dict(state)
    assert taken + _epochs(resumed, 1)[0] == torchs[1]


def test_a_users_sampler_is_warned_without_ours_named() -> None:
    class OwnOrder(torch_data.Sampler[int]):
        def __iter__(self) -> Any:
            return iter(reversed(DATA))

        def __len__(self) -> int:
            return len(DATA)

    state, _ = _state_in_second_epoch(lambda: {"sampler": OwnOrder(), "batch_size": 3})
    with pytest.warns(UserWarning, match="OwnOrder has no state_dict") as caught:
        pipeload.DataLoader(DATA, sampler=OwnOrder(), batch_size=3).load_state_dict(state)
    assert "pipeload." not in str(caught[0].message)
