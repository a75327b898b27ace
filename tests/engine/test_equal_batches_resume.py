"""equal_batches="pad" resumed across ranks makes the rank's latest good batch again (to repeat it
once the rank's own batches are spent), and the batches that raised after it, each replica from
where it stood then: an error the interrupted run raised too is expected, any other says the
data changed since the checkpoint."""

from __future__ import annotations

import json
import warnings
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch.distributed as dist
from conftest import run_rank_processes

import pipeload
from pipeload._state_digest import sealed

WORLD_SIZE = 2
STEPS_BEFORE_CHECKPOINT = 3  # rank 0: good, good, its third sample's error; then it pads
NOTE = "the data changed since the checkpoint"


class NumberFiles(pipeload.Dataset):
    """Samples read from files; a missing file raises (as a deleted shard would)."""

    def __init__(self, folder: Path, count: int) -> None:
        self.paths = [folder / f"{i}.txt" for i in range(count)]

    def __len__(self) -> int:
        return len(self.paths)

    def __getitem__(self, index: int) -> int:
        return int(self.paths[index].read_text())


def _loader(folder: Path) -> pipeload.DataLoader:
    # rank 0: 3 samples, the last one's file missing; rank 1: 5 samples, so rank 0 pads twice
    dataset = NumberFiles(folder, 3) if dist.get_rank() == 0 else list(range(100, 105))
    return pipeload.DataLoader(dataset, batch_size=1, equal_batches="pad")


def _steps(iterator: Any, count: int | None = None) -> list[Any]:
    seen: list[Any] = []
    while count is None or len(seen) < count:
        try:
            seen.append(next(iterator).tolist())
        except StopIteration:
            break
        except FileNotFoundError:
            seen.append("error")
    return seen


def _resumed(folder: Path, state: dict[str, Any]) -> Any:
    loader = _loader(folder)
    loader.load_state_dict(state)
    try:
        return _steps(iter(loader))
    except FileNotFoundError as error:
        return {"raised": type(error).__name__, "notes": getattr(error, "__notes__", [])}


class SkipsBadItems:
    """An iterator that raises for item 1 and goes on after it (a generator would end there)."""

    def __init__(self, items: list[int]) -> None:
        self._items = iter(items)

    def __iter__(self) -> SkipsBadItems:
        return self

    def __next__(self) -> int:
        item = next(self._items)
        if item == 1:
            raise FileNotFoundError("item 1's file is missing")
        return item


class RankShare(pipeload.IterableDataset):
    """Rank 0: items 0-3 (1 raising), rank 1: 8 items; split across the workers."""

    def __init__(self) -> None:
        self.rank = dist.get_rank()  # workers have no process group: read it here

    def __iter__(self) -> SkipsBadItems:
        share = list(range(4)) if self.rank == 0 else list(range(100, 108))
        info = pipeload.get_worker_info()
        if info is not None:
            share = share[info.id::info.num_workers]
        return SkipsBadItems(share)


def _iterable_loader() -> pipeload.DataLoader:
    return pipeload.DataLoader(RankShare(), batch_size=1, num_workers=2, worker_type="thread",
                               equal_batches="pad")


def _as_written_before(state: dict[str, Any]) -> tuple[dict[str, Any] | None, bool]:
    """The state as the previous pipeload wrote it (None: one without ``repeat_from``), and
    whether it resumes exactly: ``repeat_from`` kept one position, that of the latest batch's
    replica before it, which is enough unless a batch that raised came after it."""
    epoch = state.get("epoch")
    if epoch is None or epoch["repeat_from"] is None:
        return None, False
    repeat, last = epoch["repeat_from"], epoch["last_worker"]
    exact = epoch["consumed"] - repeat["consumed"] == 1
    before = repeat.pop("streams")
    repeat["position"] = before.get(str(last)) if last is not None else None
    return sealed(state), exact


def _resumed_epoch(make: Callable[[], pipeload.DataLoader], state: dict[str, Any], before: list[Any]) -> list[Any]:
    resumed = make()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # RankShare has no state: it is fast-forwarded
        resumed.load_state_dict(state)
    return before + _steps(iter(resumed))


def _every_checkpoint(make: Callable[[], pipeload.DataLoader]) -> dict[str, Any]:
    """The uninterrupted epoch, and the epoch checkpointed after each step and resumed (from
    the state, and from the same state as the previous pipeload wrote it, where it could)."""
    found: dict[str, Any] = {"uninterrupted": _steps(iter(make()))}
    for taken in range(len(found["uninterrupted"])):
        loader = make()
        iterator = iter(loader)
        before = _steps(iterator, taken)
        state = json.loads(json.dumps(loader.state_dict()))
        del iterator, loader
        found[str(taken)] = _resumed_epoch(make, state, before)
        older, exact = _as_written_before(state)
        if older is not None:  # every rank resumes it: each resume takes a collective
            resumed = _resumed_epoch(make, older, before)
            if exact:
                found[f"{taken}-older"] = resumed
    return found


def _run_iterable_rank(rank: int, init_file: str, out_dir: str) -> None:
    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=WORLD_SIZE)
    try:
        Path(out_dir, f"{rank}.json").write_text(json.dumps(_every_checkpoint(_iterable_loader)))
    finally:
        dist.destroy_process_group()


def _run(target: Callable[..., None], *args: str) -> None:
    # fork is quick, and the ranks start no process of their own
    run_rank_processes(target, args, WORLD_SIZE, start_method="fork")


def _run_rank(rank: int, init_file: str, folder: str, out_dir: str) -> None:
    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=WORLD_SIZE)
    try:
        data = Path(folder)
        found: dict[str, Any] = {"uninterrupted": _steps(iter(_loader(data)))}
        loader = _loader(data)
        iterator = iter(loader)
        found["before"] = _steps(iterator, STEPS_BEFORE_CHECKPOINT)
        state = json.loads(json.dumps(loader.state_dict()))
        del iterator, loader
        found["resumed"] = _resumed(data, state)
        if rank == 0:
            (data / "1.txt").unlink()  # the batch rank 0 repeats is gone since the checkpoint
        found["resumed_after_change"] = _resumed(data, state)
        Path(out_dir, f"{rank}.json").write_text(json.dumps(found))
    finally:
        dist.destroy_process_group()


@pytest.mark.timeout(120)
def test_pad_resume_raises_only_the_errors_of_before(tmp_path: Path) -> None:
    data = tmp_path / "data"
    data.mkdir()
    for i in range(2):  # no 2.txt: rank 0's third sample raises, in every run
        (data / f"{i}.txt").write_text(str(i))
    _run(_run_rank, str(tmp_path / "init"), str(data), str(tmp_path))
    rank0, rank1 = (json.loads((tmp_path / f"{r}.json").read_text()) for r in range(WORLD_SIZE))
    assert rank0["uninterrupted"] == [[0], [1], "error", [1], [1]]
    assert rank0["before"] + rank0["resumed"] == rank0["uninterrupted"]
    assert rank1["before"] + rank1["resumed"] == rank1["uninterrupted"] == [[100], [101], [102], [103], [104]]
    # The batch rank 0 repeats raises now where it did not then: said, not swallowed.
    changed = rank0["resumed_after_change"]
    assert isinstance(changed, dict), changed
    assert changed["raised"] == "FileNotFoundError"
    assert any(NOTE in note for note in changed["notes"]), changed["notes"]
    assert rank1["resumed_after_change"] == rank1["resumed"]


@pytest.mark.timeout(120)
def test_pad_resume_after_another_replicas_error_loses_no_batch(tmp_path: Path) -> None:
    # Rank 0, two workers: worker 0 makes [0], worker 1 raises for item 1 (and goes on), worker 0
    # makes [2], worker 1 makes [3], and the rank pads with [3]. A checkpoint right after the
    # error lost [2]: worker 0 resumed past its good batch [0] and made [2] in its place.
    _run(_run_iterable_rank, str(tmp_path / "init"), str(tmp_path))
    for rank in range(WORLD_SIZE):
        found = json.loads((tmp_path / f"{rank}.json").read_text())
        uninterrupted = found.pop("uninterrupted")
        assert len(uninterrupted) == 8
        resumed = {taken: found.pop(str(taken)) for taken in range(8)}
        assert resumed == {taken: uninterrupted for taken in range(8)}, rank
        # what is left: states as the previous pipeload wrote them, where they were exact
        assert found and all(older == uninterrupted for older in found.values()), (rank, found)
    assert json.loads((tmp_path / "0.json").read_text())["uninterrupted"] == [[0], "error", [2]] + [[3]] * 5
