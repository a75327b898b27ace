"""equal_batches: every rank of a gloo job yields the same number of batches, by dropping or by
padding, whatever each rank's share holds."""

from __future__ import annotations

import json
import os
import random
import warnings
from collections.abc import MutableMapping
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed as dist
from conftest import in_shared_memory, run_rank_processes
from state_damage import damaged

import pipeload
from pipeload._state_digest import digest_of
from pipeload.engine.equal_batches import independent_copy
from pipeload.errors import IncompatibleStateError
from pipeload.transport.codec import INLINE_MAX_BYTES

WORLD_SIZE = 2
# Rank 0's share makes 3 batches of 2, rank 1's makes 5 (the last one partial).
SHARES = {0: list(range(6)), 1: list(range(100, 109))}


class RankShare(pipeload.IterableDataset):
    """An iterable that shards by rank itself, unevenly; workers split it further."""

    def __init__(self) -> None:
        self.rank = dist.get_rank()  # workers have no process group: read it here

    def __iter__(self) -> Any:
        share = SHARES[self.rank]
        info = pipeload.get_worker_info()
        if info is not None:
            share = share[info.id::info.num_workers]
        return iter(share)


class FailsOnce(RankShare):
    def __iter__(self) -> Any:
        for item in super().__iter__():
            if item == 102:
                raise KeyError("one bad sample")
            yield item


def _epochs(policy: str, num_workers: int, dataset: Any) -> list[list[Any]]:
    # Thread workers: quick to start, and they shard the same way (the stage is after the engine).
    loader = pipeload.DataLoader(dataset, batch_size=2, num_workers=num_workers, equal_batches=policy,
                                 worker_type="thread")
    epochs = []
    for _ in range(2):
        seen = []
        iterator = iter(loader)
        while True:
            try:
                seen.append(next(iterator).tolist())
            except StopIteration:
                break
            except KeyError:
                seen.append("error")
        epochs.append(seen)
    return epochs


def _pad_loader(kind: str, num_workers: int) -> pipeload.DataLoader:
    dataset = RankShare() if kind == "iterable" else SHARES[dist.get_rank()]
    return pipeload.DataLoader(dataset, batch_size=2, num_workers=num_workers, equal_batches="pad",
                               worker_type="thread", worker_seeding="per_batch")


def _resumed_while_padding(kind: str, num_workers: int, taken: int) -> list[Any]:
    """Every rank checkpoints after ``taken`` steps (rank 0 padding by then), and a new loader
    goes on from its state: what the epoch handed out, before and after."""
    loader = _pad_loader(kind, num_workers)
    iterator = iter(loader)
    seen = [next(iterator).tolist() for _ in range(taken)]
    state = json.loads(json.dumps(loader.state_dict()))
    del iterator, loader
    _damaged_states_are_refused(state, lambda: _pad_loader(kind, num_workers))
    resumed = _pad_loader(kind, num_workers)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # RankShare has no state: it is fast-forwarded
        resumed.load_state_dict(state)
    iterator = iter(resumed)
    seen += [next(iterator).tolist()]
    state = json.loads(json.dumps(resumed.state_dict()))  # a second checkpoint, after resuming
    del iterator, resumed
    again = _pad_loader(kind, num_workers)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        again.load_state_dict(state)
    return seen + [batch.tolist() for batch in again]


def _damaged_states_are_refused(state: dict[str, Any], make: Any) -> None:
    """A padding rank's state (its repeat_from and padded count included), damaged at random
    (tests/state_damage.py): refused, or of the same content (a list kept as a tuple). Loading
    takes no collective, so each rank checks its own."""
    rng = random.Random(dist.get_rank())
    target = make()
    for _ in range(40):
        what, bad = damaged(state, rng)
        try:
            target.load_state_dict(bad)
        except IncompatibleStateError:
            continue
        assert digest_of(bad) == digest_of(state), f"{what}: accepted"
        target = make()


def _run_rank(rank: int, init_file: str, out_dir: str) -> None:
    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=WORLD_SIZE)
    try:
        found = {f"{policy}-{workers}": _epochs(policy, workers, RankShare())
                 for policy in ("drop", "pad") for workers in (0, 2)}
        found["pad-error"] = _epochs("pad", 0, FailsOnce())
        # map-style with exact lengths: the ranks agree on the count once per epoch
        found.update({f"map-{policy}-{workers}": _epochs(policy, workers, SHARES[rank])
                      for policy in ("drop", "pad") for workers in (0, 2)})
        for kind in ("map", "iterable"):
            for workers in (0, 2):
                found[f"resumed-{kind}-{workers}"] = _resumed_while_padding(kind, workers, taken=3)
                found[f"uninterrupted-{kind}-{workers}"] = [b.tolist() for b in _pad_loader(kind, workers)]
        Path(out_dir, f"{rank}.json").write_text(json.dumps(found))
    finally:
        dist.destroy_process_group()


@pytest.mark.timeout(180)
def test_drop_and_pad_give_every_rank_the_same_count(tmp_path: Path) -> None:
    run_rank_processes(_run_rank, (str(tmp_path / "init"), str(tmp_path)), WORLD_SIZE, join_s=150)
    rank0, rank1 = (json.loads((tmp_path / f"{r}.json").read_text()) for r in range(WORLD_SIZE))
    # Rank 0 has 3 batches alone, 4 with two workers (each worker's last one partial); rank 1 has 5.
    for workers, fewer in ((0, 3), (2, 4)):
        for epoch in range(2):
            # drop: both ranks stop when rank 0 runs out
            assert len(rank0[f"drop-{workers}"][epoch]) == len(rank1[f"drop-{workers}"][epoch]) == fewer
            assert sorted(sum(rank0[f"drop-{workers}"][epoch], [])) == SHARES[0]
            # pad: rank 0 repeats its last batch until rank 1's five are done
            padded, full = rank0[f"pad-{workers}"][epoch], rank1[f"pad-{workers}"][epoch]
            assert len(padded) == len(full) == 5
            assert all(batch == padded[fewer - 1] for batch in padded[fewer:])
            assert sorted(sum(full, [])) == SHARES[1]
    for workers in (0, 2):
        for epoch in range(2):
            assert rank0[f"map-drop-{workers}"][epoch] == [[0, 1], [2, 3], [4, 5]]
            assert rank1[f"map-drop-{workers}"][epoch] == [[100, 101], [102, 103], [104, 105]]
            assert rank0[f"map-pad-{workers}"][epoch] == [[0, 1], [2, 3], [4, 5], [4, 5], [4, 5]]
            assert rank1[f"map-pad-{workers}"][epoch] == [[100, 101], [102, 103], [104, 105], [106, 107], [108]]
    # a batch's error is a step like any other: the ranks stay in step around it
    # (rank 1's generator is finished by its error, as in torch, and pads from its first batch)
    assert len(rank0["pad-error"][0]) == len(rank1["pad-error"][0]) == 3
    assert rank1["pad-error"][0] == [[100, 101], "error", [100, 101]]
    # checkpoints taken while rank 0 pads (after step 3 of 5, and again after step 4): both ranks
    # go on exactly as the uninterrupted epoch, rank 0 repeating the batch it repeated
    for found in (rank0, rank1):
        for kind in ("map", "iterable"):
            for workers in (0, 2):
                uninterrupted = found[f"uninterrupted-{kind}-{workers}"]
                assert len(uninterrupted) == 5
                assert found[f"resumed-{kind}-{workers}"] == uninterrupted, (kind, workers)
    assert rank0["uninterrupted-map-0"][3:] == [[4, 5], [4, 5]]


class NamedRows(pipeload.Dataset):
    """This rank's share as map-style rows of a tensor and a name (a nested batch)."""

    def __init__(self) -> None:
        self.share = SHARES[dist.get_rank()]

    def __len__(self) -> int:
        return len(self.share)

    def __getitem__(self, index: int) -> dict[str, Any]:
        return _row(self.share[index])


class NamedRankShare(RankShare):
    def __iter__(self) -> Any:
        return map(_row, super().__iter__())


ROW_WIDTH = INLINE_MAX_BYTES // 4 + 1  # even a batch of one row is past what is sent inline: a slab carries it


def _row(value: int) -> dict[str, Any]:
    return {"x": torch.full((ROW_WIDTH,), float(value)), "name": f"row {value}"}


def _changing_each_batch_in_place(rank: int, init_file: str, out_dir: str) -> None:
    """Each loader's epoch, as a loop that changes every batch in place saw it before changing it."""
    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=WORLD_SIZE)
    try:
        found = {}
        for kind, dataset in (("map", NamedRows()), ("iterable", NamedRankShare())):
            for workers in (0, 2):  # process workers: the batches are views of shared-memory slabs
                # forked: a spawned rank would spawn them too, seconds each on a small machine
                context = "fork" if workers else None
                loader = pipeload.DataLoader(dataset, batch_size=2, num_workers=workers, equal_batches="pad",
                                             multiprocessing_context=context)
                seen = []
                for batch in loader:
                    seen.append({"x": batch["x"][:, [0, -1]].tolist(), "name": list(batch["name"]),
                                 "shared": in_shared_memory(batch["x"])})
                    batch["x"].sub_(1000)  # as a loop normalising its batch in place
                    batch["name"].append("changed")
                found[f"{kind}-{workers}"] = seen
        Path(out_dir, f"{rank}.json").write_text(json.dumps(found))
    finally:
        dist.destroy_process_group()


@pytest.mark.timeout(120)
def test_pad_repeats_the_batch_as_made_when_the_loop_changed_it_in_place(tmp_path: Path) -> None:
    # It handed out the same batch object again: a loop that normalised its batch in place got
    # the repeat normalised twice (and a list in it appended to twice).
    run_rank_processes(_changing_each_batch_in_place, (str(tmp_path / "init"), str(tmp_path)), WORLD_SIZE,
                       join_s=100)
    found = json.loads((tmp_path / "0.json").read_text())
    # rank 0 runs out first (3 batches alone, 4 with two workers) and pads to rank 1's 5
    for config, own in (("map-0", 3), ("map-2", 3), ("iterable-0", 3), ("iterable-2", 4)):
        seen = found[config]
        assert len(seen) == 5, config
        last = {key: seen[own - 1][key] for key in ("x", "name")}
        assert min(min(row) for row in last["x"]) >= 0 and "changed" not in last["name"], config
        for repeat in seen[own:]:
            assert {key: repeat[key] for key in ("x", "name")} == last, config
    assert all(batch["shared"] for batch in found["map-2"][:3] + found["iterable-2"][:4])


def test_outside_a_job_it_changes_nothing() -> None:
    loader = pipeload.DataLoader(range(5), batch_size=2, equal_batches="pad")
    assert [b.tolist() for b in loader] == [[0, 1], [2, 3], [4]]


def test_a_torchrun_environment_without_a_group_is_refused(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("RANK", "1")
    monkeypatch.setenv("WORLD_SIZE", "2")
    loader = pipeload.DataLoader(range(5), batch_size=2, equal_batches="drop")
    warnings.simplefilter("ignore")  # that every rank loads everything: not this test's point
    with pytest.raises(RuntimeError, match="equal_batches needs an initialised torch.distributed"):
        iter(loader)


def test_the_argument_names_its_choices() -> None:
    with pytest.raises(ValueError, match=r"equal_batches should be one of .*'even'"):
        pipeload.DataLoader(range(5), equal_batches="even")


def _rank_that_outlives_the_other(rank: int, init_file: str, out_dir: str) -> None:
    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=WORLD_SIZE)
    loader = pipeload.DataLoader(RankShare(), batch_size=1, equal_batches="pad")
    iterator = iter(loader)
    next(iterator)
    if rank == 1:
        os._exit(0)  # a rank that dies mid-epoch (a crash, an OOM kill)
    try:
        for _ in iterator:
            pass
    except RuntimeError as error:
        found = {"notes": getattr(error, "__notes__", []), "after": [b.tolist() for b in iterator]}
        Path(out_dir, "0.json").write_text(json.dumps(found))


@pytest.mark.timeout(60)
def test_a_rank_that_dies_mid_epoch_ends_the_others_epoch_with_an_error_naming_the_stage(tmp_path: Path) -> None:
    # gloo notices the closed connection at once; the error said nothing of the loader, and a
    # further next() asked the ranks again. Now it names the stage and the epoch is over.
    # fork is quick, and the ranks start no process of their own
    run_rank_processes(_rank_that_outlives_the_other, (str(tmp_path / "init"), str(tmp_path)), WORLD_SIZE,
                       start_method="fork", join_s=30)
    found = json.loads((tmp_path / "0.json").read_text())
    assert any("equal_batches='pad'" in note and "rank 0 of 2" in note for note in found["notes"]), found
    assert found["after"] == []


class _ItemsInAnAttribute(MutableMapping):
    """A mapping that keeps its items in an attribute: its shallow copy shares them."""

    def __init__(self, items: dict) -> None:
        self._items = items

    def __getitem__(self, key):
        return self._items[key]

    def __setitem__(self, key, value) -> None:
        self._items[key] = value

    def __delitem__(self, key) -> None:
        del self._items[key]

    def __iter__(self):
        return iter(self._items)

    def __len__(self) -> int:
        return len(self._items)


class _Pair(tuple):
    def __new__(cls, first, second):
        return super().__new__(cls, (first, second))


def test_a_padded_copy_shares_nothing_with_custom_containers() -> None:
    # A mapping class with its items in an attribute was shallow-copied and refilled: the copy
    # and the batch were one dict. A tuple class with its own constructor raised.
    custom = _ItemsInAnAttribute({"x": torch.zeros(2), "names": ["a"]})
    again = independent_copy(custom)
    custom["x"].add_(1)
    custom["names"].append("changed")
    assert again["x"].tolist() == [0.0, 0.0] and again["names"] == ["a"]
    pair = _Pair(torch.zeros(1), [1])
    copied = independent_copy(pair)
    pair[0].add_(1)
    pair[1].append(2)
    assert copied[0].tolist() == [0.0] and copied[1] == [1]  # a plain tuple, as collate makes


class SizedRankShare(RankShare):
    """RankShare with a length: each rank's own (6 and 9 items)."""

    def __len__(self) -> int:
        return len(SHARES[self.rank])


def _lengths_seen(rank: int, init_file: str, out_dir: str) -> None:
    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=WORLD_SIZE)
    try:
        found: dict[str, Any] = {}
        for policy in ("drop", "pad"):
            loader = pipeload.DataLoader(SizedRankShare(), batch_size=2, equal_batches=policy)
            try:
                found[f"len-{policy}"] = len(loader)
            except TypeError as error:
                found[f"len-{policy}"] = str(error)
            found[f"batches-{policy}"] = sum(1 for _batch in loader)
            # A map-style loader over each rank's own list: the same (stop 54, a Lightning job
            # stopped one rank at its own count and crashed the other's next collective).
            loader = pipeload.DataLoader(list(SHARES[rank]), batch_size=2, equal_batches=policy)
            try:
                found[f"map-len-{policy}"] = len(loader)
            except TypeError as error:
                found[f"map-len-{policy}"] = str(error)
            found[f"map-batches-{policy}"] = sum(1 for _batch in loader)
        # Map-style over torch's DistributedSampler: every rank's count is the same, and len() says it.
        sampler = torch.utils.data.DistributedSampler(list(range(9)), shuffle=False)
        loader = pipeload.DataLoader(list(range(9)), batch_size=2, sampler=sampler, equal_batches="pad")
        found["map"] = [len(loader), sum(1 for _batch in loader)]
        Path(out_dir, f"{rank}.json").write_text(json.dumps(found))
    finally:
        dist.destroy_process_group()


@pytest.mark.timeout(120)
def test_len_of_a_loader_whose_ranks_differ_under_equal_batches_is_unknown_so_frameworks_run_it_to_the_end(
        tmp_path: Path) -> None:
    # Lightning stops an epoch at len(loader): it read each rank's own count, so a padding rank
    # stopped after its own batches (3 of 7, a skeptic's run) while the other went on, whose next
    # collective found no peer ("Connection closed by peer"). Without a length it runs the loader
    # to the end the ranks agree on. (Agreeing in len() would be a collective, which a len() on
    # rank 0 alone would put out of step with the ranks' other collectives.)
    run_rank_processes(_lengths_seen, (str(tmp_path / "init"), str(tmp_path)), WORLD_SIZE, join_s=100)
    ranks = [json.loads((tmp_path / f"{r}.json").read_text()) for r in range(WORLD_SIZE)]
    for found in ranks:
        for policy, batches in (("drop", 3), ("pad", 5)):
            assert f"equal_batches={policy!r} across 2 ranks is not known in advance" in found[f"len-{policy}"]
            assert found[f"batches-{policy}"] == batches
            assert f"equal_batches={policy!r} across 2 ranks is not known in advance" in found[f"map-len-{policy}"]
            assert found[f"map-batches-{policy}"] == batches
        assert found["map"] == [3, 3]
