"""What the framework runs load: samples that say which index they are and who built them.

Imported by the scripts that Lightning and torchrun start, so it must not import pytest.
"""

from __future__ import annotations

import os
import sys
from typing import Any

import torch

import pipeload

DATASET_LENGTH = 24  # a multiple of the world size: DistributedSampler pads nothing
WORLD_SIZE = 2


def built_inside_torch_loader() -> bool:
    """True when a frame of torch's loading code (its fetchers, iterators, worker loop) is on the
    stack: then torch's engine, not ours, is building this sample."""
    frame = sys._getframe(1)
    while frame is not None:
        module = frame.f_globals.get("__name__", "")
        if module.startswith("torch.utils.data") and not module.startswith("torch.utils.data.datapipes"):
            return True
        frame = frame.f_back
    return False


class Witness(pipeload.Dataset):
    """Sample ``i``: its index, the pid and pipeload worker id that built it, and whether torch's
    loader code was on the stack."""

    def __init__(self, length: int = DATASET_LENGTH) -> None:
        self.length = length

    def __len__(self) -> int:
        return self.length

    def __getitem__(self, index: int) -> dict[str, Any]:
        info = pipeload.get_worker_info()
        return {
            "index": torch.tensor(index),
            "pid": torch.tensor(os.getpid()),
            "worker": torch.tensor(-1 if info is None else info.id),
            "torch_loop": torch.tensor(built_inside_torch_loader()),
        }


class TaggedLoader(pipeload.DataLoader):
    """A user's subclass with an extra ``__init__`` argument, as frameworks must rebuild it."""

    def __init__(self, dataset: Any, tag: str, **kwargs: Any) -> None:
        super().__init__(dataset, **kwargs)
        self.tag = tag


def describe(batch: dict[str, torch.Tensor]) -> dict[str, Any]:
    """The JSON-friendly record of one batch."""
    return {
        "indices": batch["index"].tolist(),
        "pids": sorted(set(batch["pid"].tolist())),
        "workers": sorted(set(batch["worker"].tolist())),
        "torch_loop": bool(batch["torch_loop"].any()),
    }
