"""DistributedSampler inside a real torch.distributed (gloo) group of two processes."""

from __future__ import annotations

import json
import multiprocessing
import re
import warnings
from pathlib import Path
from typing import Any

import pytest
import torch.utils.data

import pipeload

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


# -- set_epoch after loading a state ------------------------------------------------------------


def _sampler() -> Any:
    import pipeload

    return pipeload.DistributedSampler(range(20), num_replicas=2, rank=1, seed=3)


def _fresh_epoch(epoch: int) -> list[int]:
    sampler = _sampler()
    sampler.set_epoch(epoch)
    return list(sampler)


@pytest.mark.parametrize("batched", [False, True], ids=["sampler", "batch-sampler"])
def test_set_epoch_to_another_epoch_after_loading_a_mid_epoch_state_begins_that_epoch_whole(batched: bool) -> None:
    # The state of epoch 3, 4 keys in, loaded, then set_epoch(4): epoch 4 used to skip its own
    # first 4 keys (the count belonged to epoch 3's order). The same epoch still resumes.
    import pipeload

    def made() -> Any:
        sampler = _sampler()
        return pipeload.BatchSampler(sampler, 2, False) if batched else sampler

    def keys(sampler: Any) -> list[int]:
        return [k for batch in sampler for k in batch] if batched else list(sampler)

    def inner(sampler: Any) -> Any:
        return sampler.sampler if batched else sampler

    original = made()
    inner(original).set_epoch(3)
    iterator = iter(original)
    taken = [next(iterator) for _ in range(2)]
    state = json.loads(json.dumps(original.state_dict()))
    moved = made()
    moved.load_state_dict(state)
    inner(moved).set_epoch(4)
    assert keys(moved) == _fresh_epoch(4)
    same = made()
    same.load_state_dict(state)
    inner(same).set_epoch(3)
    assert (sum(taken, []) if batched else taken) + keys(same) == _fresh_epoch(3)


@pytest.mark.parametrize("taken", [2, 5], ids=["mid-epoch", "after-its-last-batch"])
def test_a_loader_resumed_then_moved_to_the_next_epoch_yields_that_epoch_whole(taken: int) -> None:
    # A checkpoint after the last batch of epoch 3, loaded by a loop that goes on with
    # set_epoch(4): the loader skipped epoch 4's first 5 batches, all of them, and the epoch was
    # empty without a word. Now epoch 4 comes whole, with a warning that epoch 3 is not resumed
    # where some of it was left (none where it had handed out every batch: nothing is lost).
    import pipeload

    def made() -> tuple[Any, Any]:
        sampler = _sampler()
        return sampler, pipeload.DataLoader(range(20), batch_size=2, sampler=sampler)

    sampler, loader = made()
    sampler.set_epoch(3)
    iterator = iter(loader)
    for _ in range(taken):
        next(iterator)
    state = json.loads(json.dumps(loader.state_dict()))
    sampler, resumed = made()
    resumed.load_state_dict(state)
    sampler.set_epoch(4)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        batches = [batch.tolist() for batch in resumed]
    said = [str(w.message) for w in caught if re.search(r"set_epoch\(4\).*epoch 3.*not resumed", str(w.message))]
    assert len(said) == (1 if taken < 5 else 0)
    assert sum(batches, []) == _fresh_epoch(4)
    sampler, resumed = made()
    resumed.load_state_dict(state)
    sampler.set_epoch(3)
    batches = [batch.tolist() for batch in resumed]
    if taken < 5:
        assert len(batches) == 5 - taken
    else:
        # After the last batch: the next epoch begins, the sampler moved on to it (torchdata's
        # rule; Lightning calls set_epoch only after it has made the iterator, and lost an epoch).
        assert sum(batches, []) == _fresh_epoch(4) and sampler.epoch == 4


@pytest.mark.parametrize("shuffle", [False, True])
def test_a_dataset_that_grew_since_the_sampler_was_made_fails_as_torchs(shuffle: bool) -> None:
    # Its new samples were never seen, without a word (torch's assertion catches it).
    def grown(cls: type) -> list[int]:
        data = list(range(10))
        sampler = cls(data, num_replicas=2, rank=0, shuffle=shuffle)
        data += [10, 11, 12]
        return list(sampler)

    with pytest.raises(AssertionError, match=r"Number of indices \(23\) does not match total_size \(10\)") as theirs:
        grown(torch.utils.data.DistributedSampler)
    with pytest.raises(AssertionError, match=re.escape(str(theirs.value)) + r" \(pipeload: the dataset has 13 samples now"):
        grown(pipeload.DistributedSampler)


@pytest.mark.parametrize("shuffle", [False, True])
def test_a_dataset_that_shrank_since_the_sampler_was_made_fails_as_torchs_with_drop_last(shuffle: bool) -> None:
    # The ranks got unequal counts (rank 0 two indices where len() said three), without a word.
    def shrunk(cls: type) -> list[int]:
        data = list(range(10))
        sampler = cls(data, num_replicas=3, rank=0, shuffle=shuffle, drop_last=True)
        del data[5:]
        return list(sampler)

    with pytest.raises(AssertionError, match=r"Number of indices \(5\) does not match total_size \(9\)") as theirs:
        shrunk(torch.utils.data.DistributedSampler)
    with pytest.raises(AssertionError, match=re.escape(str(theirs.value)) + r" \(pipeload: the dataset has 5 samples now"):
        shrunk(pipeload.DistributedSampler)
