"""The number a queue boundary's far side seeds from, run by run (process and Ray kinds).

A graph run in one process draws nothing from torch's global generator for its random pipes
once the DataLoader has seeded them (it does every epoch), and a seed given with ``set_seed``
seeds the next run only. A boundary whose upstream runs elsewhere keeps both: the far side's
seed is made from the pipes' seeds when they all have one (the loop's random numbers and the
next epoch's seeds are then those of the same graph without the boundary), and the seeds a run
was sent with are taken from the local pipes once it is sent.
"""

from __future__ import annotations

from typing import Any

import torch

from pipeload.datapipes.graph import is_random_datapipe, list_dps

_SEED_MIX = 1_000_003  # a prime: different seed lists make different numbers
_SEED_RANGE = 2 ** 63


def run_seed(graph: Any) -> int:
    """The number a run's far side seeds from: a process boundary's upstream process its
    global generators, a Ray boundary's actors the random pipes that have no seed.

    When every random pipe of ``graph`` has its seed already (the DataLoader sets them every
    epoch), it is made from those seeds: the run draws nothing from torch's global generator,
    so the loop's random numbers and the next epoch's seeds are those of the same graph without
    the boundary. Otherwise it is one number drawn from torch's global generator.
    """
    seeds = [getattr(pipe, "_seed", None) for pipe in list_dps(graph) if is_random_datapipe(pipe)]
    if not seeds or not all(isinstance(seed, int) for seed in seeds):
        return int(torch.empty((), dtype=torch.int64).random_().item())
    mixed = 0
    for seed in seeds:
        mixed = (mixed * _SEED_MIX + seed) % _SEED_RANGE
    return mixed


def take_seeds(graph: Any) -> None:
    """Forget the seeds of ``graph``'s random pipes once a run was sent with them: as in one
    process, a seed given with ``set_seed`` seeds the next run only (later runs draw theirs)."""
    for pipe in list_dps(graph):
        if is_random_datapipe(pipe) and getattr(pipe, "_seed", None) is not None:
            pipe._seed = None
