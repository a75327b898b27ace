"""The warning torch never gives: under torch.distributed, a map-style loader whose sampler is not
split by rank makes every rank load the whole dataset."""

from __future__ import annotations

import json
import warnings
from pathlib import Path
from typing import Any

import pytest
import torch.distributed as dist
import torch.utils.data as tud
from conftest import run_rank_processes

import pipeload
from pipeload.datapipes.iter import IterableWrapper
from pipeload.distributed import Placement, current_placement

WORLD_SIZE = 2
DATA = list(range(10))


class _Stream(pipeload.IterableDataset):
    def __iter__(self) -> Any:
        return iter(DATA)


def _loaders() -> dict[str, Any]:
    """Loaders by name; those whose name starts with "replicated" should warn."""
    # Outside a job a DistributedSampler needs to be told its place.
    place = {} if dist.is_initialized() else {"num_replicas": WORLD_SIZE, "rank": 0}
    return {
        "replicated-sequential": pipeload.DataLoader(DATA, batch_size=4),
        "replicated-shuffled": pipeload.DataLoader(DATA, batch_size=4, shuffle=True),
        "replicated-batch-sampler": pipeload.DataLoader(
            DATA, batch_sampler=pipeload.BatchSampler(pipeload.RandomSampler(DATA), 4, False)),
        "ours": pipeload.DataLoader(DATA, batch_size=4, sampler=pipeload.DistributedSampler(DATA, **place)),
        "torchs": pipeload.DataLoader(DATA, batch_size=4, sampler=tud.DistributedSampler(DATA, **place)),
        "inside-batch-sampler": pipeload.DataLoader(
            DATA, batch_sampler=pipeload.BatchSampler(pipeload.DistributedSampler(DATA, **place), 4, False)),
        "iterable": pipeload.DataLoader(_Stream(), batch_size=4),
    }


def _warnings_per_loader() -> dict[str, list[str]]:
    found = {}
    for name, loader in _loaders().items():
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            for _ in range(3):  # three epochs, one warning
                list(loader)
        found[name] = [str(w.message) for w in caught]
    return found


def _run_rank(rank: int, init_file: str, out_dir: str) -> None:
    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=WORLD_SIZE)
    try:
        Path(out_dir, f"{rank}.json").write_text(json.dumps(_warnings_per_loader()))
    finally:
        dist.destroy_process_group()


@pytest.mark.timeout(120)
def test_warns_once_per_loader_that_every_rank_loads_everything(tmp_path: Path) -> None:
    run_rank_processes(_run_rank, (str(tmp_path / "init"), str(tmp_path)), WORLD_SIZE)
    for rank in range(WORLD_SIZE):
        found = json.loads((tmp_path / f"{rank}.json").read_text())
        for name, messages in found.items():
            if name.startswith("replicated"):
                assert len(messages) == 1, (name, messages)
                assert "world size 2" in messages[0]
                assert "each of the 2 ranks will load all 10 samples" in messages[0]
                assert "sampler=pipeload.DistributedSampler(dataset)" in messages[0]
            else:
                assert messages == [], name


def test_silent_outside_a_distributed_job_and_in_a_job_of_one(tmp_path: Path) -> None:
    assert all(messages == [] for messages in _warnings_per_loader().values())
    dist.init_process_group("gloo", init_method=f"file://{tmp_path / 'init'}", rank=0, world_size=1)
    try:
        assert all(messages == [] for messages in _warnings_per_loader().values())
    finally:
        dist.destroy_process_group()


# -- without a process group: torchrun's environment ---------------------------------------------


def test_outside_a_job_this_is_rank_0_of_1(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("RANK", raising=False)
    monkeypatch.delenv("WORLD_SIZE", raising=False)
    assert current_placement() == Placement(0, 1)


def test_torchruns_environment_places_this_process(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("RANK", "3")
    monkeypatch.setenv("WORLD_SIZE", "4")
    assert current_placement() == Placement(3, 4)
    monkeypatch.delenv("WORLD_SIZE")
    assert current_placement() == Placement(0, 1)  # half an environment is not a job


def test_a_malformed_environment_names_both_variables(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("RANK", "zero")
    monkeypatch.setenv("WORLD_SIZE", "2")
    with pytest.raises(ValueError, match="RANK='zero', WORLD_SIZE='2'"):
        current_placement()


@pytest.mark.parametrize(("rank", "world_size"), [("2", "2"), ("-1", "2"), ("0", "0"), ("0", "-3")])
def test_an_environment_whose_rank_is_outside_the_world_names_both_variables(
    monkeypatch: pytest.MonkeyPatch, rank: str, world_size: str
) -> None:
    # Before, the placement was taken as it was and a DataPipe loader failed later, blaming a
    # sharding_filter's instance_id; a DistributedSampler would have refused such a rank.
    monkeypatch.setenv("RANK", rank)
    monkeypatch.setenv("WORLD_SIZE", world_size)
    with pytest.raises(ValueError, match=f"RANK={rank!r}, WORLD_SIZE={world_size!r}"):
        current_placement()
    with pytest.raises(ValueError, match="RANK"):
        list(pipeload.DataLoader(IterableWrapper(range(4)).sharding_filter(), batch_size=2))


def test_a_negative_local_rank_is_refused(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("LOCAL_RANK", "-1")
    with pytest.raises(ValueError, match="LOCAL_RANK='-1'"):
        current_placement()
