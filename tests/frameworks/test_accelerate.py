"""accelerate under torchrun (2 CPU processes, gloo): both ways of using our loader shard correctly,
and the README's account of which engine runs in each stays true."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch.utils.data as tud
from conftest import LeakGuard, lacks, wait_until
from ranks import HERE, LEFTOVER_DEADLINE_S, no_rank_left, run_ranks
from workload import DATASET_LENGTH, WORLD_SIZE

# accelerate runs under torchrun: found here, not imported (conftest.lacks says why).
pytestmark = lacks("accelerate")


def indices(batches: list[dict]) -> list[int]:
    return [i for batch in batches for i in batch["indices"]]


def assert_sharded(records: list[dict], way: str) -> None:
    """Per epoch: the ranks' shares are disjoint and together the whole dataset."""
    for epoch in ("0", "1"):
        shares = [indices(record[way]["seen"][epoch]) for record in records]
        assert not set(shares[0]) & set(shares[1]), (way, epoch, shares)
        assert sorted(shares[0] + shares[1]) == list(range(DATASET_LENGTH)), (way, epoch, shares)
    first, second = (indices(records[0][way]["seen"][e]) for e in ("0", "1"))
    assert first != second, f"{way}: both epochs in the same order"


@pytest.mark.timeout(300)
def test_prepare_and_the_recipe_both_shard_the_epoch(tmp_path: Path, leak_guard: LeakGuard) -> None:
    script = HERE / "accelerate_torchrun.py"
    command = [sys.executable, "-m", "torch.distributed.run", "--standalone",
               f"--nproc_per_node={WORLD_SIZE}", str(script), str(tmp_path)]
    records = run_ranks(command, tmp_path, WORLD_SIZE)
    assert wait_until(lambda: no_rank_left(tmp_path), LEFTOVER_DEADLINE_S)
    assert [(r["rank"], r["world_size"], r["backend"]) for r in records] == [(0, 2, "gloo"), (1, 2, "gloo")]

    # prepare(loader): accelerate rebuilds the loader on torch's DataLoader class, so torch's
    # engine builds the batches (from our dataset and samplers); the README says so.
    assert_sharded(records, "prepared")
    for record in records:
        assert record["prepared"]["loader_class"] == "torch.utils.data.dataloader"
        assert all(b["torch_loop"] for e in ("0", "1") for b in record["prepared"]["seen"][e])

    # The recipe: our DistributedSampler in our loader, prepare() for the model and optimizer.
    assert_sharded(records, "recipe")
    for rank, record in enumerate(records):
        recipe = record["recipe"]
        assert recipe["loader_class"] == "pipeload.loader" and recipe["warnings"] == []
        for epoch in ("0", "1"):
            oracle = tud.DistributedSampler(range(DATASET_LENGTH), num_replicas=WORLD_SIZE,
                                            rank=rank, shuffle=True, seed=record["seed"])
            oracle.set_epoch(int(epoch))
            assert indices(recipe["seen"][epoch]) == list(oracle)
            assert all(not b["torch_loop"] and b["workers"] == [0] for b in recipe["seen"][epoch])

    # Neither: every rank loads everything, and pipeload says so, once per loader.
    for record in records:
        forgotten = record["forgotten"]
        assert sorted(indices(forgotten["seen"]["0"])) == list(range(DATASET_LENGTH))
        assert len(forgotten["warnings"]) == 1
        assert "DistributedSampler" in forgotten["warnings"][0]
