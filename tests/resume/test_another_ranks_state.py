"""Rank 0's loader state loaded on every rank (as Lightning does), checked in a real 2-rank gloo job.

A map-style state saved on another rank is taken as this rank's position, and the warning says
whose order goes on: this rank's own where the sampler splits the data by rank (its order comes
from the seed, the epoch and its rank), the saving rank's otherwise (kept in the sampler's
state), which is this rank's own only where the ranks seeded alike.
"""

from __future__ import annotations

import json
import warnings
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed as dist
from conftest import run_rank_processes

import pipeload

WORLD_SIZE = 2
LENGTH = 24
TAKEN = 2  # batches handed out before the checkpoint


class _Augmented(pipeload.Dataset):
    """Sample ``i`` is ``i`` and a random value drawn for it (an augmentation)."""

    def __len__(self) -> int:
        return LENGTH

    def __getitem__(self, i: int) -> torch.Tensor:
        return torch.stack([torch.tensor(i), torch.randint(0, 10**6, ())])


def _loader(sampling: str) -> pipeload.DataLoader:
    data = list(range(LENGTH))
    if sampling == "distributed":
        return pipeload.DataLoader(data, batch_size=3, sampler=pipeload.DistributedSampler(data, seed=1))
    if sampling == "augmented":
        augmented = _Augmented()
        return pipeload.DataLoader(augmented, batch_size=3, sampler=pipeload.DistributedSampler(augmented, seed=1),
                                   worker_seeding="per_batch")
    # Each rank shuffles its own copy with its own generator (a dataset of its own, say): the
    # sampler's state (its generator as the epoch began) is this rank's order.
    return pipeload.DataLoader(data, batch_size=3, shuffle=True)


def _load_rank_zeros_state(rank: int, init_file: str, out_dir: str, sampling: str, seed_apart: bool = True) -> None:
    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=WORLD_SIZE)
    try:
        warnings.simplefilter("ignore")  # the loader not split by rank: said by test_distributed.py
        seed = 10 + rank if seed_apart else 10  # seed + rank, as many scripts do, or one seed
        torch.manual_seed(seed)
        whole = [b.tolist() for b in _loader(sampling)]
        torch.manual_seed(seed)
        saving = _loader(sampling)
        iterator = iter(saving)
        head = [next(iterator).tolist() for _ in range(TAKEN)]
        states: list[Any] = [None] * WORLD_SIZE
        dist.all_gather_object(states, json.loads(json.dumps(saving.state_dict())))
        del iterator
        resumed = _loader(sampling)
        found: dict[str, Any] = {"whole": whole}
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            resumed.load_state_dict(states[0])
        found["warnings"] = [str(w.message) for w in caught]
        found["resumed"] = head + [b.tolist() for b in resumed]
        Path(out_dir, f"{rank}.json").write_text(json.dumps(found))
    finally:
        dist.destroy_process_group()


def _rank_one(tmp_path: Path, sampling: str, seed_apart: bool = True) -> dict[str, Any]:
    run_rank_processes(_load_rank_zeros_state, (str(tmp_path / "init"), str(tmp_path), sampling, seed_apart), WORLD_SIZE,
                       start_method="fork", join_s=60)
    return json.loads((tmp_path / "1.json").read_text())


@pytest.mark.timeout(90)
def test_rank_zeros_state_resumes_this_ranks_order_under_a_distributed_sampler(tmp_path: Path) -> None:
    found = _rank_one(tmp_path, "distributed")
    assert found["resumed"] == found["whole"]
    assert any("saved on rank 0 and is loaded on rank 1" in message for message in found["warnings"])


@pytest.mark.timeout(90)
@pytest.mark.parametrize("seed_apart", [True, False], ids=["ranks-seeded-apart", "ranks-seeded-alike"])
def test_rank_zeros_state_under_a_sampler_not_split_by_rank_says_whose_order_goes_on(
        tmp_path: Path, seed_apart: bool) -> None:
    # Its sampler's state (a RandomSampler's generator as the epoch began) is rank 0's order: rank
    # 1 took it with a warning that it went on "in its own order", and went on in rank 0's (with
    # ranks seeded apart, some of its samples twice in the epoch, others never). Seeded alike,
    # that order is rank 1's own, and the resume exact: so it is said, not refused.
    found = _rank_one(tmp_path, "shuffle", seed_apart)
    (message,) = [m for m in found["warnings"] if "saved on rank 0 and is loaded on rank 1" in m]
    assert "goes on in rank 0's order" in message and "its own only where every rank seeded alike" in message
    assert (found["resumed"] == found["whole"]) is (not seed_apart)


@pytest.mark.timeout(90)
def test_rank_zeros_state_says_this_ranks_random_values_are_drawn_from_rank_zeros_seed(tmp_path: Path) -> None:
    # The samples are this rank's, but the random values drawn for the rest of the epoch come from
    # the generators the state recorded as the epoch began, rank 0's: with ranks seeded apart they
    # are not the uninterrupted run's, which the warning did not say ("this rank goes on in its
    # own order"), though per-batch seeding promises exact random values on resume.
    found = _rank_one(tmp_path, "augmented")
    assert [[s[0] for s in b] for b in found["resumed"]] == [[s[0] for s in b] for b in found["whole"]]
    (message,) = [m for m in found["warnings"] if "saved on rank 0 and is loaded on rank 1" in m]
    assert "random values" in message and "only where every rank seeded" in message
