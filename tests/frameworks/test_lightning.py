"""Lightning shards our loaders as it shards torch's, and our engine still builds the batches."""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Any

import pytest
import torch.utils.data as tud
from conftest import LeakGuard, lacks, wait_until
from ranks import HERE, LEFTOVER_DEADLINE_S, no_rank_left, run_ranks
from workload import DATASET_LENGTH, WORLD_SIZE, TaggedLoader, Witness

import pipeload

pytestmark = [lacks("lightning"), pytest.mark.imports_large_libraries]


@pytest.fixture
def lightning_data() -> Any:
    """Lightning's loader helpers, imported when a test asks (conftest.lacks says why)."""
    import lightning.pytorch.utilities.data

    return lightning.pytorch.utilities.data


def expected_share(rank: int, epoch: int, seed: int, shuffle: bool, length: int) -> list[int]:
    """What torch's DistributedSampler gives ``rank``: the oracle for every run here."""
    sampler = tud.DistributedSampler(range(length), num_replicas=WORLD_SIZE, rank=rank,
                                     shuffle=shuffle, seed=seed)
    sampler.set_epoch(epoch)
    return list(sampler)


def test_update_dataloader_rebuilds_ours_with_the_injected_sampler(leak_guard: LeakGuard, lightning_data: Any) -> None:
    dataset = Witness(DATASET_LENGTH + 2)
    injected = tud.DistributedSampler(dataset, num_replicas=2, rank=1, shuffle=True, seed=3)
    oracle = lightning_data._update_dataloader(
        tud.DataLoader(dataset, batch_size=4, shuffle=True, drop_last=True), injected)
    expected = [batch["index"].tolist() for batch in oracle]
    for loader in (
        pipeload.DataLoader(dataset, batch_size=4, shuffle=True, drop_last=True, num_workers=1),
        TaggedLoader(dataset, tag="kept", batch_size=4, shuffle=True, drop_last=True,
                     num_workers=1, worker_type="thread"),
    ):
        rebuilt = lightning_data._update_dataloader(loader, injected)
        assert type(rebuilt) is type(loader)
        assert getattr(rebuilt, "tag", None) == getattr(loader, "tag", None)
        assert rebuilt.num_workers == 1 and rebuilt.batch_sampler.sampler is injected
        # Our BatchSampler is not exactly torch's class, so Lightning rebuilds it through its
        # custom-batch-sampler path: the size and drop_last live on in the batch sampler.
        assert (rebuilt.batch_sampler.batch_size, rebuilt.batch_sampler.drop_last) == (4, True)
        batches = list(rebuilt)
        assert [b["index"].tolist() for b in batches] == expected
        assert all(b["worker"].eq(0).all() and not b["torch_loop"].any() for b in batches)


def test_lightning_sees_our_shuffle(lightning_data: Any) -> None:
    # Lightning shuffles the DistributedSampler it injects only when it sees a RandomSampler.
    shuffled = pipeload.DataLoader(Witness(), shuffle=True)
    assert lightning_data._is_dataloader_shuffled(shuffled)
    assert not lightning_data._is_dataloader_shuffled(pipeload.DataLoader(Witness()))


@pytest.mark.slow  # ~11 s of DDP processes; the two tests above run Lightning's rebuild in the fast suite
@pytest.mark.timeout(300)
def test_ddp_ranks_see_disjoint_shuffled_halves_loaded_by_our_workers(
    tmp_path: Path, leak_guard: LeakGuard
) -> None:
    script = HERE / "lightning_ddp.py"
    records = run_ranks([sys.executable, str(script), str(tmp_path)], tmp_path, WORLD_SIZE)
    assert wait_until(lambda: no_rank_left(tmp_path), LEFTOVER_DEADLINE_S)

    for rank, record in enumerate(records):
        assert record["rank"] == rank
        loaders = record["loaders"]
        assert loaders["plain"]["module"] == "pipeload.loader"
        assert (loaders["custom"]["type"], loaders["custom"]["tag"]) == ("TaggedLoader", "extra-argument")
        assert (loaders["val"]["type"], loaders["val"]["tag"]) == ("TaggedLoader", "made-in-hook")
        for name, shuffles in (("plain", True), ("custom", True), ("val", False)):
            assert loaders[name]["sampler"] == "DistributedSampler"
            assert loaders[name]["sampler_shuffles"] is shuffles

    for name, length, shuffle in (("plain", DATASET_LENGTH, True), ("custom", DATASET_LENGTH, True),
                                  ("val", 10, False)):
        for epoch in ("0", "1"):
            shares = []
            for rank, record in enumerate(records):
                batches = record["seen"][name][epoch]
                share = [i for batch in batches for i in batch["indices"]]
                assert share == expected_share(rank, int(epoch), record["seed"], shuffle, length)
                # Built in our worker processes, never by torch's loader code.
                assert all(not b["torch_loop"] and b["workers"] and min(b["workers"]) >= 0
                           and record["main_pid"] not in b["pids"] for b in batches), batches
                shares.append(share)
            assert not set(shares[0]) & set(shares[1])
            assert sorted(shares[0] + shares[1]) == list(range(length))
        if shuffle:
            first, second = (records[0]["seen"][name][e] for e in ("0", "1"))
            assert first != second  # set_epoch reached our loader: every epoch is shuffled anew
    workers_used = {w for b in records[0]["seen"]["plain"]["0"] for w in b["workers"]}
    assert workers_used == {0, 1}
