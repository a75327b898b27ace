"""DistributedSampler inside a real torch.distributed (gloo) group of two processes."""

from __future__ import annotations

import json
import multiprocessing
from pathlib import Path

import pytest

WORLD_SIZE = 2
DATASET_LENGTH = 23  # not a multiple of the world size: padding and drop_last both matter


def _run_rank(rank: int, init_file: str, out_dir: str) -> None:
    import torch.distributed as dist
    import torch.utils.data as tud

    import pipeload

    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank,
                            world_size=WORLD_SIZE)
    try:
        dataset = list(range(DATASET_LENGTH))
        result = {}
        for drop_last in (False, True):
            ours = pipeload.DistributedSampler(dataset, shuffle=True, seed=7, drop_last=drop_last)
            theirs = tud.DistributedSampler(dataset, shuffle=True, seed=7, drop_last=drop_last)
            ours.set_epoch(3)
            theirs.set_epoch(3)
            loader = pipeload.DataLoader(dataset, batch_size=4, sampler=ours)
            result[str(drop_last)] = {
                "ours": list(ours),
                "theirs": list(theirs),
                "rank": ours.rank,
                "num_replicas": ours.num_replicas,
                "batches": [batch.tolist() for batch in loader],
            }
        Path(out_dir, f"{rank}.json").write_text(json.dumps(result))
    finally:
        dist.destroy_process_group()


@pytest.mark.timeout(120)
def test_rank_and_world_come_from_the_process_group_and_match_torch(tmp_path: Path) -> None:
    context = multiprocessing.get_context("spawn")
    ranks = [
        context.Process(target=_run_rank, args=(rank, str(tmp_path / "init"), str(tmp_path)))
        for rank in range(WORLD_SIZE)
    ]
    for process in ranks:
        process.start()
    for process in ranks:
        process.join(100)
    assert [process.exitcode for process in ranks] == [0] * WORLD_SIZE

    results = [json.loads((tmp_path / f"{rank}.json").read_text()) for rank in range(WORLD_SIZE)]
    for drop_last in ("False", "True"):
        per_rank = [result[drop_last] for result in results]
        for rank, mine in enumerate(per_rank):
            assert mine["ours"] == mine["theirs"]
            assert (mine["rank"], mine["num_replicas"]) == (rank, WORLD_SIZE)
            assert sum(mine["batches"], []) == mine["ours"]
        shards = [set(mine["ours"]) for mine in per_rank]
        everything = set().union(*shards)
        if drop_last == "True":  # each rank gets 11: one sample is left out, none repeated
            assert len(everything) == DATASET_LENGTH - 1 and not shards[0] & shards[1]
        else:  # 12 each: every sample is seen, one of them twice (padding)
            assert everything == set(range(DATASET_LENGTH))
