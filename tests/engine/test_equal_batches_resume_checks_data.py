"""equal_batches="pad" resumed across ranks makes the rank's latest good batch again (to repeat it
once the rank's own batches are spent), and the batches that raised after it: an error the
interrupted run raised too is expected, any other says the data changed since the checkpoint."""

from __future__ import annotations

import json
import multiprocessing
from pathlib import Path
from typing import Any

import pytest
import torch.distributed as dist

import pipeload

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
    context = multiprocessing.get_context("fork")  # quick: the ranks start no thread or worker
    ranks = [context.Process(target=_run_rank, args=(rank, str(tmp_path / "init"), str(data), str(tmp_path)))
             for rank in range(WORLD_SIZE)]
    for process in ranks:
        process.start()
    for process in ranks:
        process.join(100)
    assert [process.exitcode for process in ranks] == [0] * WORLD_SIZE
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
