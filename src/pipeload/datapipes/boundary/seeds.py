"""The number a queue boundary's far side seeds from, run by run (process and Ray kinds).

A graph run in one process draws nothing from torch's global generator for its random pipes
once the DataLoader has seeded them (it does every epoch), and a seed given with ``set_seed``
seeds the next run only. A boundary whose upstream runs elsewhere keeps both: the far side's
seed is made from the pipes' seeds when they all have one (the loop's random numbers and the
next epoch's seeds are then those of the same graph without the boundary), and the seeds a run
was sent with are taken from the local pipes once it is sent.

The DataLoader gives every copy of a graph (each worker's, each rank's) the same pipe seeds, so
that shuffles before the sharding pipe split one order. A far side seeded from those alone would
draw the same random values in every copy; so the copy's place (``Replica``, which the loader
tells each boundary through ``graph.apply_replica``) is mixed in, and each worker and rank gets
its own streams there, the same again for the same loader seed.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from pipeload.datapipes.graph import is_random_datapipe, list_dps
from pipeload.engine.worker_info import derive_seed, this_workers_torch_generator

_SEED_MIX = 1_000_003  # a prime: different seed lists make different numbers
_SEED_RANGE = 2 ** 63


@dataclass(frozen=True)
class Replica:
    """Which copy of a graph a boundary is in: ``index`` of ``count`` (DataLoader workers x
    ranks, numbered as their shards are)."""

    count: int = 1
    index: int = 0


def check_replica(num_replicas: Any, replica_id: Any) -> Replica:
    """``Replica(num_replicas, replica_id)``; a ValueError naming them unless 0 <= id < count."""
    counted = isinstance(num_replicas, int) and not isinstance(num_replicas, bool) and num_replicas >= 1
    placed = isinstance(replica_id, int) and not isinstance(replica_id, bool)
    if not counted or not placed or not 0 <= replica_id < num_replicas:
        raise ValueError("set_replica needs an int num_replicas >= 1 and an int replica_id in "
                         f"[0, num_replicas), but got num_replicas={num_replicas!r}, replica_id={replica_id!r}")
    return Replica(num_replicas, replica_id)


def run_seed(graph: Any, replica: Replica | None = None) -> int:
    """The number a run's far side seeds from: a process boundary's upstream process its
    global generators, a Ray boundary's actors the random pipes that have no seed.

    When every random pipe of ``graph`` has its seed already (the DataLoader sets them every
    epoch), it is made from those seeds: the run draws nothing from torch's global generator,
    so the loop's random numbers and the next epoch's seeds are those of the same graph without
    the boundary. Otherwise it is one number drawn from torch's global generator (a thread
    worker's own generator in a thread worker: the global one is the training loop's). Either
    is then mixed with ``replica`` when the graph is one of several copies.
    """
    seeds = [getattr(pipe, "_seed", None) for pipe in list_dps(graph) if is_random_datapipe(pipe)]
    if not seeds or not all(isinstance(seed, int) for seed in seeds):
        mixed = _drawn()
    else:
        mixed = 0
        for seed in seeds:
            mixed = (mixed * _SEED_MIX + seed) % _SEED_RANGE
    if replica is None or replica.count == 1:
        return mixed  # a single copy keeps the seeds it always had
    return derive_seed(mixed, replica.count, replica.index) % _SEED_RANGE


def _drawn() -> int:
    generator = this_workers_torch_generator()
    return int(torch.empty((), dtype=torch.int64).random_(generator=generator).item())


def take_seeds(graph: Any) -> None:
    """Forget the seeds of ``graph``'s random pipes once a run was sent with them: as in one
    process, a seed given with ``set_seed`` seeds the next run only (later runs draw theirs)."""
    for pipe in list_dps(graph):
        if is_random_datapipe(pipe) and getattr(pipe, "_seed", None) is not None:
            pipe._seed = None
