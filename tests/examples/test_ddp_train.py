"""examples/ddp_train.py under torchrun (2 CPU ranks, gloo): the ranks see disjoint samples that
together cover every epoch, and take the same number of steps (DDP would hang otherwise)."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
from conftest import LeakGuard, wait_until

sys.path.insert(0, str(Path(__file__).parents[1] / "frameworks"))
from ranks import LEFTOVER_DEADLINE_S, no_rank_left, run_ranks  # noqa: E402

EXAMPLE = Path(__file__).parents[2] / "examples" / "ddp_train.py"
WORLD_SIZE = 2
SAMPLES = 40  # the example's five shards, or its map-style dataset


def torchrun(*arguments: str) -> list[str]:
    return [sys.executable, "-m", "torch.distributed.run", "--standalone",
            f"--nproc_per_node={WORLD_SIZE}", str(EXAMPLE), *arguments]


def distinct_ids(batches: list[list[int]]) -> set[int]:
    return {i for batch in batches for i in batch}


@pytest.mark.timeout(300)
# shards: a slow test (a torchrun job, ~6 s); the map-style job runs in the fast suite, and
# tests/test_distributed.py splits shards over gloo ranks there
@pytest.mark.parametrize("data", ["map", pytest.param("shards", marks=pytest.mark.slow)])
def test_ranks_split_every_epoch_and_take_equal_steps(data: str, tmp_path: Path, leak_guard: LeakGuard) -> None:
    command = torchrun("--data", data, "--shards", str(tmp_path / "shards"), "--record", str(tmp_path))
    records = run_ranks(command, tmp_path, WORLD_SIZE)
    assert wait_until(lambda: no_rank_left(tmp_path), LEFTOVER_DEADLINE_S)
    assert [(r["rank"], r["world_size"]) for r in records] == [(0, 2), (1, 2)]
    orders = []
    for epoch in ("0", "1"):
        shares = [record["seen"][epoch] for record in records]
        assert len(shares[0]) == len(shares[1]), f"unequal steps in epoch {epoch}: {shares}"
        first, second = distinct_ids(shares[0]), distinct_ids(shares[1])
        assert not first & second, (epoch, shares)
        assert first | second == set(range(SAMPLES)), (epoch, shares)
        orders.append(shares)
    assert orders[0] != orders[1], "both epochs in the same order"
    if data == "map":  # a DistributedSampler's shares are equal by construction: no padding
        assert all(len(distinct_ids(s)) == SAMPLES // WORLD_SIZE for s in orders[0])


def first_padding_step(records: list[dict]) -> int | None:
    """The global step just after a rank first repeats a batch (equal_batches="pad"), if any."""
    done = 0
    for epoch in sorted(records[0]["seen"], key=int):
        for record in records:
            batches = record["seen"][epoch]
            repeats = [i for i in range(1, len(batches)) if batches[i] == batches[i - 1]]
            if repeats:
                return done + repeats[0] + 1
        done += len(records[0]["seen"][epoch])
    return None


@pytest.mark.slow  # three torchrun jobs; tests/test_resume_after_kill.py covers resuming in the fast suite
@pytest.mark.timeout(400)
@pytest.mark.parametrize("data", ["map", "shards"])
def test_stopped_mid_epoch_and_resumed_it_trains_as_if_never_stopped(data: str, tmp_path: Path,
                                                                      leak_guard: LeakGuard) -> None:
    whole, parts = tmp_path / "whole", tmp_path / "parts"
    whole.mkdir()
    parts.mkdir()
    options = ("--data", data, "--shards", str(tmp_path / "shards"))
    expected = run_ranks(torchrun(*options, "--record", str(whole)), whole, WORLD_SIZE)
    # map-style: in the second epoch of five steps; shards: while a rank repeats its last batch
    stop_after = 7 if data == "map" else first_padding_step(expected)
    assert stop_after is not None, "no rank padded: the shards no longer leave the ranks uneven"
    checkpoint = str(tmp_path / "checkpoints")
    stopped = run_ranks(torchrun(*options, "--record", str(parts), "--checkpoint", checkpoint,
                                 "--stop-after", str(stop_after)), parts, WORLD_SIZE)
    assert [record["stopped"] for record in stopped] == [stop_after] * WORLD_SIZE
    resumed = run_ranks(torchrun(*options, "--record", str(parts), "--checkpoint", checkpoint, "--resume"),
                        parts, WORLD_SIZE)
    assert wait_until(lambda: no_rank_left(tmp_path), LEFTOVER_DEADLINE_S)
    for want, have in zip(expected, resumed, strict=True):
        assert have["seen"] == want["seen"]
        assert have["weights"] == want["weights"]  # the same batches in the same steps
