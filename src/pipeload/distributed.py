"""Where this process stands in a ``torch.distributed`` job, and the check that keeps ranks from
silently loading the same data.

Nothing here starts a process group: torchrun, Lightning or accelerate do that. We only read the
group that is already there (rank and world size), share one seed from rank 0 with the others,
and notice when a loader is about to give every rank the whole dataset. Without a group, the
environment torchrun sets (RANK, WORLD_SIZE) still says where this process stands.

It is also ``torch.utils.data.distributed``'s path under pipeload: ``from pipeload.distributed
import DistributedSampler`` gives ``pipeload.DistributedSampler`` (the samplers room's class,
the same object), so DDP scripts switch by their import line alone. The sampler is looked up on
first use rather than imported here: this module sits below the samplers room, which the engine
imports it from.
"""

from __future__ import annotations

import importlib
import os
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import torch
import torch.utils.data as torch_data

__all__ = ["DistributedSampler"]  # torch's module's; the rank helpers below are pipeload's own

# How deep to look for a rank-aware sampler inside wrappers (a BatchSampler around a
# DistributedSampler, a framework's wrapper around that BatchSampler, ...).
_WRAPPER_DEPTH = 4


@dataclass(frozen=True)
class Placement:
    """This process's rank among ``world_size`` ranks (0 of 1 outside a distributed job), and
    its rank among the ranks of its machine (torchrun's LOCAL_RANK; 0 when not set)."""

    rank: int = 0
    world_size: int = 1
    local_rank: int = 0


# What torch's module also holds, found where they live when first asked for.
_TORCH_PATH_NAMES = {"DistributedSampler": "pipeload.samplers", "Sampler": "pipeload.samplers",
                     "Dataset": "pipeload.datasets"}


def __getattr__(name: str) -> Any:
    """``DistributedSampler`` (and torch's module's ``Sampler``, ``Dataset``) from their rooms,
    when first asked for (see the module's docstring)."""
    home = _TORCH_PATH_NAMES.get(name)
    if home is None:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    return getattr(importlib.import_module(home), name)


def __dir__() -> list[str]:
    return sorted([*globals(), *_TORCH_PATH_NAMES])


def _dist() -> Any:
    """``torch.distributed`` when it is built and a default group is initialised, else None."""
    import torch.distributed as dist

    if dist.is_available() and dist.is_initialized():
        return dist
    return None


def current_placement() -> Placement:
    """The rank and world size of the initialised default group, as torch's DataLoader reads them;
    without one, torchrun's RANK and WORLD_SIZE; else rank 0 of 1.

    torch's loader ignores torchrun's environment; reading it shards DataPipe graphs by rank even
    before (or without) ``init_process_group``. Without a group no seed can be shared, so the
    ranks must then seed their generators alike for their shuffles to agree.

    Raises:
        ValueError: RANK or WORLD_SIZE is set but is not an integer, or RANK is not in
            ``[0, WORLD_SIZE)``; LOCAL_RANK is set but is not an integer of at least 0.
    """
    local_rank = _local_rank()
    dist = _dist()
    if dist is not None:
        return Placement(dist.get_rank(), dist.get_world_size(), local_rank)
    rank, world_size = os.environ.get("RANK"), os.environ.get("WORLD_SIZE")
    if rank is None or world_size is None:
        return Placement(local_rank=local_rank)
    try:
        placement = Placement(int(rank), int(world_size), local_rank)
    except ValueError:
        raise ValueError(
            "RANK and WORLD_SIZE should be integers (as torchrun sets them), but got "
            f"RANK={rank!r}, WORLD_SIZE={world_size!r}"
        ) from None
    # Caught here, where both variables can be named; later, a DataPipe loader's sharding would
    # blame an instance_id the user never wrote.
    if not 0 <= placement.rank < placement.world_size:
        raise ValueError(
            "RANK should be in the interval [0, WORLD_SIZE - 1] and WORLD_SIZE at least 1 (as "
            f"torchrun sets them), but got RANK={rank!r}, WORLD_SIZE={world_size!r}"
        )
    return placement


def _local_rank() -> int:
    text = os.environ.get("LOCAL_RANK", "0")
    try:
        local_rank = int(text)
    except ValueError:
        local_rank = -1
    if local_rank < 0:
        raise ValueError(
            f"LOCAL_RANK should be an integer of at least 0 (as torchrun sets it), but got LOCAL_RANK={text!r}")
    return local_rank


class _GlooGroupCache:
    """One gloo group per default group, made the first time a seed must cross ranks.

    Seeds are CPU tensors, which an NCCL-only group cannot carry. torch makes a new gloo group on
    every epoch of a DataPipe loader; one per default group is enough, and making it is a
    collective every rank reaches at the same point (its first shared seed).
    """

    def __init__(self) -> None:
        self._world: Any = None
        self._group: Any = None

    def group_for(self, dist: Any) -> Any:
        if "gloo" in str(dist.get_backend()).lower():
            return None  # the default group speaks gloo already
        if self._world is not dist.group.WORLD:
            self._group = dist.new_group(backend="gloo")
            self._world = dist.group.WORLD
        return self._group


_GLOO_GROUPS = _GlooGroupCache()


def share_from_rank0(value: int) -> int:
    """Every rank gets rank 0's ``value`` (a collective: all ranks must call it together)."""
    dist = _dist()
    if dist is None or dist.get_world_size() == 1:
        return value
    tensor = torch.tensor(value, dtype=torch.int64)
    dist.broadcast(tensor, src=0, group=_GLOO_GROUPS.group_for(dist))
    return int(tensor.item())


def check_ranks_can_agree() -> None:
    """Check that the ranks can agree through a collective: an initialised group, or a job of one.

    Raises:
        RuntimeError: torchrun's environment says there are several ranks but no process group
            is initialised, so the ranks have no way to agree.
    """
    placement = current_placement()
    if _dist() is None and placement.world_size > 1:
        raise RuntimeError(
            "equal_batches needs an initialised torch.distributed process group to agree on "
            f"each epoch's batch count, but this process is rank {placement.rank} of "
            f"{placement.world_size} (from torchrun's RANK/WORLD_SIZE) without one: call "
            "torch.distributed.init_process_group() before iterating the DataLoader"
        )


def all_ranks_agree(value: bool, every: bool) -> bool:
    """Whether ``value`` holds on every rank (``every``) or on at least one (a collective: all
    ranks must call it together). Outside a group of several ranks, ``value`` itself."""
    dist = _dist()
    if dist is None or dist.get_world_size() == 1:
        return value
    flag = torch.tensor(int(value), dtype=torch.int64)
    op = dist.ReduceOp.MIN if every else dist.ReduceOp.MAX
    dist.all_reduce(flag, op=op, group=_GLOO_GROUPS.group_for(dist))
    return bool(flag.item())


def all_ranks_range(value: int) -> tuple[int, int]:
    """The least and the most ``value`` among the ranks, in one collective (all ranks must call
    it together). Outside a group of several ranks, ``(value, value)``."""
    dist = _dist()
    if dist is None or dist.get_world_size() == 1:
        return value, value
    both = torch.tensor([-value, value], dtype=torch.int64)
    dist.all_reduce(both, op=dist.ReduceOp.MAX, group=_GLOO_GROUPS.group_for(dist))
    return -int(both[0].item()), int(both[1].item())


def _is_rank_aware(sampler: Any) -> bool:
    if isinstance(sampler, torch_data.DistributedSampler):
        return True
    # Frameworks' own sharding samplers say whose share they yield under these names
    # (accelerate's BatchSamplerShard: num_processes/process_index).
    return (hasattr(sampler, "num_replicas") and hasattr(sampler, "rank")) or (
        hasattr(sampler, "num_processes") and hasattr(sampler, "process_index")
    )


def _samplers_within(*outermost: Any) -> Iterator[Any]:
    layer = [s for s in outermost if s is not None]
    for _ in range(_WRAPPER_DEPTH):
        yield from layer
        layer = [inner for s in layer for name in ("sampler", "batch_sampler")
                 if (inner := getattr(s, name, None)) is not None and inner is not s]


def splits_by_rank(*samplers: Any) -> bool:
    """Whether one of ``samplers`` (or a sampler they wrap, a few layers deep) yields only this
    rank's share: a ``DistributedSampler`` or a framework's sampler that says whose share it is."""
    return any(_is_rank_aware(s) for s in _samplers_within(*samplers))


def unshared_seed_warning(generator: Any) -> str | None:
    """Why the ranks' copies of a shuffled DataPipe graph may shuffle apart, or None.

    A loader shards a DataPipe graph by rank as soon as torchrun's RANK and WORLD_SIZE say there
    are several, but only a process group can carry rank 0's shuffle seed to the others. Without
    one, each rank draws its own from ``generator`` (torch's global generator when None): unless
    every rank seeded it alike, the shuffles before the sharding pipe differ and the shards
    overlap (some samples twice, others never), which torch's loader would not do either since it
    does not shard by rank without a group. Said only when nothing in the loader's own settings
    makes the ranks agree (a ``generator``, which the user seeds, is taken as seeded alike).
    """
    placement = current_placement()
    if placement.world_size <= 1 or _dist() is not None or generator is not None:
        return None
    return (
        f"This process is rank {placement.rank} of {placement.world_size} (from torchrun's "
        "RANK/WORLD_SIZE), so this DataLoader shards its DataPipe graph by rank, but no "
        "torch.distributed process group is initialised to share rank 0's shuffle seed: unless "
        "every rank seeded torch's global generator alike, each shuffles its own way and the "
        "ranks' shards overlap (some samples twice, others never). Call "
        "torch.distributed.init_process_group() before iterating, or give the DataLoader "
        "generator=torch.Generator().manual_seed(seed) with the same seed on every rank."
    )


def replication_warning(dataset: Any, sampler: Any, batch_sampler: Any) -> str | None:
    """Why every rank would load the whole (map-style) dataset, or None when it would not.

    torch says nothing in this case; the mistake is easy to make by hand (a loader built without
    a DistributedSampler under torchrun) and costs a duplicated epoch on every rank.
    """
    placement = current_placement()
    if placement.world_size <= 1:
        return None
    if splits_by_rank(batch_sampler, sampler):
        return None
    try:
        size = f"all {len(dataset)} samples"
    except Exception:  # no usable length: the message does without it
        size = "every sample"
    return (
        f"This job runs with world size {placement.world_size} (from torch.distributed, or "
        "torchrun's WORLD_SIZE), but this "
        f"DataLoader's sampler ({type(sampler).__name__}) is not split by rank: each of the "
        f"{placement.world_size} ranks will load {size} of {type(dataset).__name__}. Give it "
        "sampler=pipeload.DistributedSampler(dataset), and call sampler.set_epoch(epoch) at the "
        "start of every epoch so that each epoch is shuffled anew."
    )
