"""webdataset_pipeline through the DataLoader as a torchrun job sees it: two ranks (torchrun's
RANK/WORLD_SIZE) of two process workers each share the shards, every sample exactly once per
epoch, and the shard order is a function of the loader's generator alone."""

from __future__ import annotations

import collections
from pathlib import Path

import pytest
import torch
from sources_for_tests import all_keys, sample_key, write_shards

import pipeload
from pipeload.datapipes import webdataset_pipeline

pytestmark = [pytest.mark.usefixtures("leak_guard"), pytest.mark.timeout(120)]

SHARDS, SAMPLES, WORLD_SIZE = 9, 2, 2


def rank_epochs(paths: list[str], rank: int, seed: int, monkeypatch: pytest.MonkeyPatch) -> list[list[str]]:
    """Two epochs of one rank's loader: the sample keys in the order it handed them out."""
    monkeypatch.setenv("RANK", str(rank))
    monkeypatch.setenv("WORLD_SIZE", str(WORLD_SIZE))
    pipe = webdataset_pipeline(paths, shuffle_buffer=0).map(sample_key)
    loader = pipeload.DataLoader(pipe, batch_size=None, num_workers=2, persistent_workers=True,
                                 generator=torch.Generator().manual_seed(seed))
    return [list(loader) for _ in range(2)]


def test_ranks_and_workers_share_the_shards_each_sample_once_in_a_seeded_order(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    paths = [str(p) for p in write_shards(tmp_path, SHARDS, SAMPLES)]
    ranks = [rank_epochs(paths, rank, 5, monkeypatch) for rank in range(WORLD_SIZE)]
    for epoch in range(2):
        seen = collections.Counter(key for rank in ranks for key in rank[epoch])
        assert sorted(seen) == all_keys(SHARDS, SAMPLES) and set(seen.values()) == {1}
    assert ranks[0][0] != ranks[0][1]  # shards reshuffled each epoch
    assert rank_epochs(paths, 0, 5, monkeypatch) == ranks[0]
    assert rank_epochs(paths, 0, 6, monkeypatch) != ranks[0]
