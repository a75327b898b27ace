"""Plain, picklable descriptions of what an epoch fetches and how a worker is set up."""

from __future__ import annotations

import enum
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any


class DatasetKind(enum.IntEnum):
    """Map-style datasets are indexed; iterable-style ones are iterated.

    The numbers are torch's (``torch.utils.data._DatasetKind``, in its ``__all__``), so that a
    loader's ``_dataset_kind`` compares equal to torch's; ``Map`` and ``Iterable`` are torch's
    names for them.
    """

    MAP = 0
    ITERABLE = 1
    Map = 0
    Iterable = 1

    @property
    def label(self) -> str:
        """"map" or "iterable": how checkpoints write the kind."""
        return self.name.lower()


@dataclass(frozen=True)
class FetchSpec:
    """How to turn a task's indices into one batch (or one sample when not auto-collating).

    Attributes:
        dataset: the dataset (map-style or iterable-style).
        kind: which of the two it is.
        auto_collation: True when tasks carry a list of indices to collate into a batch.
        collate_fn: the function that turns the list of samples into a batch.
        drop_last: iterable-style only: drop each worker's last, partial batch.
        per_batch_seeding: reseed the generators before building each batch, from the base
            seed, the epoch and the batch alone (``worker_seeding="per_batch"``).
        stream_snapshot_every: iterable-style only: send each batch with its replica's position
            (a :class:`~pipeload.engine.fetch.StreamBatch`), so the loader can checkpoint it, and
            the replica's ``state_dict()`` with every this-many-th batch (0: no positions).
        resume_streams: iterable-style only: worker id -> the position its replica resumes
            from, on the first epoch of a session (see ``pipeload/resume``).
        failures: the loader's failure board (``stats/skips.py``), where the on_error pipes of
            every copy of the dataset count; None when the dataset has none.
    """

    dataset: Any
    kind: DatasetKind
    auto_collation: bool
    collate_fn: Callable[[Any], Any]
    drop_last: bool
    per_batch_seeding: bool = False
    stream_snapshot_every: int = 0
    resume_streams: dict[int, Any] | None = None
    failures: Any = None


@dataclass(frozen=True)
class ReplicaSetup:
    """How each copy of the dataset is made ready (see ``engine/replica.py``).

    Attributes:
        rank: this process's rank in the distributed job (0 outside one).
        world_size: how many ranks share the dataset (1 outside a distributed job).
        shared_seed: seeds the random pipes of a DataPipe graph, the same on every worker and
            rank; None when the dataset has none to seed.
    """

    rank: int = 0
    world_size: int = 1
    shared_seed: int | None = None


@dataclass(frozen=True)
class WorkerSetup:
    """Everything a worker needs to start; shared by all workers of one session.

    Attributes:
        fetch: how to build batches.
        num_workers: how many workers the session runs.
        base_seed: drawn by the main process when the session starts; worker i uses base_seed + i.
        worker_init_fn: the user's hook, called with the worker id after seeding.
        worker_method: "multiprocessing" or "thread".
        replica: how each worker shards and seeds its copy of the dataset.
        stats: each worker times its stages and reports its totals (``loader.stats()``).
        first_epoch: the number of the session's first epoch (1, or where a resumed persistent
            session was); later epochs count on from it. Seeds derived per batch include it.
        batch_sizes: what the first epoch's batches hold, where the sampler tells
            (``samplers.batch_sizes``: samples in every batch but the last, the last's number):
            a classic worker's stats then count an untimed batch's samples without looking at
            it, and time the last batch, which may be short. Later epochs' last numbers come
            with START_EPOCH. None: each untimed batch is counted.
    """

    fetch: FetchSpec
    num_workers: int
    base_seed: int
    worker_init_fn: Callable[[int], None] | None
    worker_method: str
    replica: ReplicaSetup = ReplicaSetup()
    stats: bool = False
    first_epoch: int = 1
    batch_sizes: tuple[int, int | None] | None = None


@dataclass(frozen=True)
class EpochStart:
    """Where an epoch begins when it continues one that was cut short (a resumed checkpoint).

    Attributes:
        first_batch: the number of the first batch to build (the batches before it were handed
            out before the checkpoint); per-batch seeds are derived from these numbers.
        first_position: how many samples those batches held (economic mode's item seeds).
        first_worker: the worker whose turn comes first (iterable datasets, round-robin).
        remake: ``equal_batches="pad"`` across ranks: the epoch resumes before the rank's
            latest good batch (the one it repeats once its own are spent); the equal-batches
            stage makes this many batches again without handing them out, keeping that one.
            The engines ignore it.
        handed_out: out of order (``in_order=False``): numbers past ``first_batch`` handed out
            before the checkpoint; they are made again and dropped right after the engine
            (``resume/handed_out.py``). The engines ignore it.
        epoch_batches: how many batches the whole epoch has, when the sampler's length is
            exact (map-style, torch's or our samplers): the equal-batches stage then agrees
            with the other ranks once, not per batch. None when not known.
        steps_done: steps this rank took in the epoch before the checkpoint (handed out,
            raised, or repeated by ``"pad"``).
    """

    first_batch: int = 0
    first_position: int = 0
    first_worker: int = 0
    remake: int = 0
    handed_out: frozenset[int] = frozenset()
    epoch_batches: int | None = None
    steps_done: int = 0


@dataclass(frozen=True)
class EconomicSetup:
    """What every economic-mode worker needs to start.

    Attributes:
        worker: as for classic workers; ``worker.num_workers`` counts the item workers.
        num_batch_workers: how many batch workers the session runs.
    """

    worker: WorkerSetup
    num_batch_workers: int
