"""``DistributedSampler``: this rank's share of a map-style dataset, exactly as torch's.

It reads the process group as torch's does (and fails as torch's does without one). Public
through ``pipeload.samplers``.
"""

from __future__ import annotations

import math
from collections.abc import Iterator, Sized
from typing import Any

import torch
import torch.utils.data as torch_data  # torch's class: a base for identity, never called

from pipeload.samplers._base import Sampler
from pipeload.samplers._epoch_lengths import length_of
from pipeload.samplers._random import keys_of
from pipeload._state_fields import StateFields
from pipeload.samplers._state import StatefulSampler


class DistributedSampler(StatefulSampler, Sampler[int], torch_data.DistributedSampler):
    """Yields this rank's share of the dataset: every ``num_replicas``-th index from ``rank``.

    All ranks see the same (optionally shuffled, seeded by ``seed + epoch``) order. Without
    ``drop_last`` the order is padded by repeating its start so every rank gets the same
    count; with it, the tail is cut instead.

    Args:
        dataset: anything with ``__len__``.
        num_replicas: number of ranks; default: the world size of the initialised group.
        rank: this process's rank; default: the rank in the initialised group.
        shuffle: shuffle the order each epoch.
        seed: base seed, identical on every rank.
        drop_last: cut the tail instead of padding.

    Raises:
        RuntimeError: rank or num_replicas left out and ``torch.distributed`` is unavailable.
        ValueError: left out with no initialised process group (from ``torch.distributed``),
            or ``rank`` outside ``[0, num_replicas)``.

    Example:
        >>> list(DistributedSampler(range(5), num_replicas=2, rank=1, shuffle=False))
        [1, 3, 0]
    """

    def __init__(
        self,
        dataset: Sized,
        num_replicas: int | None = None,
        rank: int | None = None,
        shuffle: bool = True,
        seed: int = 0,
        drop_last: bool = False,
    ) -> None:
        if num_replicas is None:
            num_replicas = _process_group().get_world_size()
        if rank is None:
            rank = _process_group().get_rank()
        if rank < 0 or rank >= num_replicas:
            raise ValueError(
                f"Invalid rank {rank}, rank should be in the interval [0, {num_replicas - 1}]: "
                f"got rank={rank} with num_replicas={num_replicas}"
            )
        self.dataset = dataset
        self.num_replicas = num_replicas
        self.rank = rank
        self.epoch = 0
        self._loaded_epoch: int | None = None  # the epoch a loaded state set, until iterated
        self.drop_last = drop_last
        self.shuffle = shuffle
        self.seed = seed
        size = len(dataset)
        if drop_last and size % num_replicas != 0:
            self.num_samples = math.ceil((size - num_replicas) / num_replicas)
        else:
            self.num_samples = math.ceil(size / num_replicas)
        self.total_size = self.num_samples * num_replicas

    def _config(self) -> dict[str, Any]:
        return {"length": length_of(self.dataset), "num_replicas": self.num_replicas,
                "rank": self.rank, "shuffle": self.shuffle, "seed": self.seed,
                "drop_last": self.drop_last}

    def _inner_state(self, fresh: bool = False) -> dict[str, Any]:
        return {"epoch": self.epoch}

    def _read_inner_state(self, fields: StateFields) -> int:
        return fields.integer("epoch", low=None)  # set_epoch takes any int, as torch's

    def _load_inner_state(self, inner: int, replay: bool) -> None:
        self.epoch = inner
        self._loaded_epoch = inner

    def _replay_abandoned_because(self) -> str | None:
        # Counts of keys handed out belong to the loaded epoch's order: skipping them from
        # another epoch's order would lose keys of that epoch.
        loaded = self._loaded_epoch
        if loaded is None or loaded == self.epoch:
            return None
        return f"set_epoch({self.epoch}) was called after loading a state of epoch {loaded}"

    def _keys(self) -> Iterator[int]:
        self._loaded_epoch = None  # an iteration begins: what was loaded is used, or left
        size = length_of(self.dataset)
        if self.shuffle:
            generator = torch.Generator()
            generator.manual_seed(self.seed + self.epoch)
            order = torch.randperm(size, generator=generator)
        else:
            order = torch.arange(size)
        if self.drop_last:
            order = order[: self.total_size]
            if len(order) < self.total_size:  # it shrank: the ranks would get unequal counts
                raise AssertionError(
                    f"Number of indices ({len(order)}) does not match total_size ({self.total_size}) "
                    f"(pipeload: the dataset has {size} samples now, {self.total_size} or more when "
                    "this sampler was made: make the sampler again after the dataset changes)")
        elif self.total_size > len(order):
            missing = self.total_size - len(order)
            order = torch.cat([order, order.repeat(math.ceil(missing / len(order)))[:missing]])
        elif len(order) > self.total_size:  # it grew: its new samples would never be seen
            raise AssertionError(
                f"Number of indices ({len(order) + self.total_size}) does not match total_size "
                f"({self.total_size}) (pipeload: the dataset has {len(order)} samples now, "
                f"{self.num_samples * self.num_replicas} or fewer when this sampler was made: "
                "make the sampler again after the dataset changes)")
        # A tensor, read a block at a time: see _random.keys_of.
        return keys_of(order[self.rank : self.total_size : self.num_replicas])

    def __len__(self) -> int:
        return self.num_samples

    def set_epoch(self, epoch: int) -> None:
        """Set the epoch; with ``shuffle`` each epoch gets its own order (the same on all ranks)."""
        self.epoch = epoch


def _process_group() -> Any:
    """``torch.distributed``, imported only when asked for; RuntimeError if it is absent."""
    try:
        import torch.distributed as dist
    except ImportError:  # pragma: no cover - builds without distributed support
        dist = None
    if dist is None or not dist.is_available():
        raise RuntimeError(
            "Requires distributed package to be available: pass num_replicas and rank "
            "explicitly, or use a torch build with torch.distributed"
        )
    return dist
