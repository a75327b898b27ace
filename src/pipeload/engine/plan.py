"""Plain, picklable descriptions of what an epoch fetches and how a worker is set up."""

from __future__ import annotations

import enum
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any


class DatasetKind(enum.Enum):
    """Map-style datasets are indexed; iterable-style ones are iterated."""

    MAP = "map"
    ITERABLE = "iterable"


@dataclass(frozen=True)
class FetchSpec:
    """How to turn a task's indices into one batch (or one sample when not auto-collating).

    Attributes:
        dataset: the dataset (map-style or iterable-style).
        kind: which of the two it is.
        auto_collation: True when tasks carry a list of indices to collate into a batch.
        collate_fn: the function that turns the list of samples into a batch.
        drop_last: iterable-style only: drop each worker's last, partial batch.
    """

    dataset: Any
    kind: DatasetKind
    auto_collation: bool
    collate_fn: Callable[[Any], Any]
    drop_last: bool


@dataclass(frozen=True)
class WorkerSetup:
    """Everything a worker needs to start; shared by all workers of one session.

    Attributes:
        fetch: how to build batches.
        num_workers: how many workers the session runs.
        base_seed: drawn by the main process when the session starts; worker i uses base_seed + i.
        worker_init_fn: the user's hook, called with the worker id after seeding.
        worker_method: "multiprocessing" or "thread".
    """

    fetch: FetchSpec
    num_workers: int
    base_seed: int
    worker_init_fn: Callable[[int], None] | None
    worker_method: str
