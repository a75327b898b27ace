"""Sharding and seeding for pipeload's pipes when torch's own DataLoader runs them.

torch's loader splits a DataPipe graph across its worker processes, and gives every worker the
same shuffle seed, only for torch's own DataPipe classes (it checks ``isinstance`` and walks the
graph with its own traversal). pipeload's pipes are not of those classes, so a pipeload graph
that reaches torch's loader (``accelerate``'s ``prepare`` rebuilds every loader on torch's
class) would be read whole by every worker, each shuffling it its own way: every sample once
per worker. These functions stand in, from what torch's worker knows:

* a ``sharding_filter`` that nobody sharded keeps worker ``id``'s share of ``num_workers``;
* a shuffle that nobody seeded draws its seed from a generator that every worker of the same
  loader seeds alike (from the base seed torch drew for the epoch: ``WorkerInfo.seed - id``),
  so that the workers split one permutation, and that goes on to new seeds each epoch.

Neither applies inside pipeload's own loader, which shards and seeds its workers itself, nor in
torch's main process. Ranks are not split here: under ``torch.distributed``, torch's loader over
pipeload's pipes gives every rank the whole data (use ``pipeload.DataLoader``, which splits rank
x worker).
"""

from __future__ import annotations

import sys
import threading
from typing import Any

import torch

from pipeload.engine.worker_info import WorkerInfo, get_worker_info

_lock = threading.Lock()
_shared: dict[str, Any] = {"base": None, "generator": None}


def torch_worker_info() -> Any:
    """torch's ``WorkerInfo`` when this is one of torch's own loader workers (not pipeload's),
    else None."""
    if get_worker_info() is not None:
        return None  # pipeload's loader (or code posing as its worker) decides
    worker = sys.modules.get("torch.utils.data._utils.worker")
    info = getattr(worker, "_worker_info", None)
    if info is None or isinstance(info, WorkerInfo):
        return None
    return info


def shard_in_torch_worker() -> tuple[int, int] | None:
    """``(num_workers, id)`` of torch's worker running this, or None (not in one)."""
    info = torch_worker_info()
    if info is None or info.num_workers <= 1:
        return None
    return info.num_workers, info.id


def seed_in_torch_worker() -> int | None:
    """The next seed for an unseeded shuffle in torch's worker, the same in every worker of the
    loader's current epoch; None when not in one."""
    info = torch_worker_info()
    if info is None:
        return None
    base = info.seed - info.id  # torch draws one base seed per epoch, + id for each worker
    with _lock:
        if _shared["base"] != base:
            _shared["base"] = base
            _shared["generator"] = torch.Generator().manual_seed(base)
        generator = _shared["generator"]
        return int(torch.empty((), dtype=torch.int64).random_(generator=generator).item())

