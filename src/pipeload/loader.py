"""DataLoader: validates its arguments as torch does, then hands each epoch to an engine.

The loader is a description; what runs an epoch is an engine (inline, or a pool of workers),
optionally followed by a pin stage. ``iter(loader)`` returns an epoch iterator that owns the
engine (or borrows the loader's, with ``persistent_workers=True``).

``DataLoader`` subclasses ``torch.utils.data.DataLoader`` for identity alone, so that training
frameworks that test ``isinstance`` shard and rebuild it as they do torch's. None of torch's
loader code runs: its ``__init__`` is never called and every method it defines is defined here.
"""

from __future__ import annotations

import dataclasses
import math
import threading
import warnings
import weakref
from collections.abc import Callable, Iterable
from typing import Any, TypeVar

import torch
import torch.utils.data as torch_data  # torch's DataLoader: a base for identity, never called

from pipeload import _arguments as arguments
from pipeload.collate import default_collate, default_convert
from pipeload.datasets import Dataset, _is_iterable_dataset
from pipeload.distributed import check_ranks_can_agree, current_placement, replication_warning
from pipeload.engine import replica
from pipeload.engine.auto import AutoEngine, pools_like
from pipeload.engine.economic import EconomicConfig, EconomicEngine
from pipeload.engine.equal_batches import EqualBatches
from pipeload.engine.inline import InlineEngine
from pipeload.engine.pin_stage import InlinePinning, ThreadedPinning
from pipeload.engine.plan import DatasetKind, EconomicSetup, EpochStart, FetchSpec, ReplicaSetup, WorkerSetup
from pipeload.engine.pool import PoolConfig, PoolEngine
from pipeload import resume
from pipeload.pin import pinning_available
from pipeload.samplers import (
    BatchSampler,
    Sampler,
    exact_length,
)
from pipeload.shared import warn_if_copy_on_read
from pipeload.stats.clock import profiling, span
from pipeload.stats.recorder import LoaderSetup, StatsRecorder, usable_cpus
from pipeload.stats.report import LoaderStats
from pipeload.stats.tuner import AutoTuner, Settings, memory_budget_bytes

T_co = TypeVar("T_co", covariant=True)

_FROZEN_AFTER_INIT = frozenset(
    {"batch_size", "batch_sampler", "sampler", "drop_last", "dataset", "persistent_workers", "mode",
     "num_batch_workers", "equal_batches", "worker_seeding"}
)


class DataLoader(torch_data.DataLoader[T_co]):
    """Loads batches from a dataset; the same arguments and behaviour as torch's DataLoader.

    Args:
        dataset: a map-style (``__getitem__``/``__len__``) or iterable-style dataset.
        batch_size: samples per batch, or None to disable automatic batching.
        shuffle: reshuffle every epoch (map-style only).
        sampler: the order of keys; exclusive with ``shuffle``.
        batch_sampler: yields lists of keys; exclusive with batch_size/shuffle/sampler/drop_last.
        num_workers: 0 loads in the main process; N > 0 starts N workers; "auto" starts with
            the CPUs this process may use and adjusts while running (see ``stats()``).
        collate_fn: merges a list of samples into a batch.
        pin_memory: hand out batches in pinned memory (when an accelerator is present).
        drop_last: drop the last, incomplete batch.
        timeout: seconds to wait for a batch from the workers before raising (0: no limit).
        worker_init_fn: called in each worker with its id, after seeding.
        multiprocessing_context: "fork", "spawn", "forkserver" or a context object.
        generator: the RNG for the sampler's shuffle and the workers' base seed.
        prefetch_factor: batches in flight per worker (default 2 when num_workers > 0); "auto"
            starts at 2 and may double once the workers are settled.
        persistent_workers: keep workers alive across epochs.
        pin_memory_device: kept for compatibility; the current accelerator is used.
        in_order: yield batches in sampler order (True) or as soon as they are ready.
        worker_type: "process" (the default) or "thread" workers.
        mode: "classic" (the default: each worker builds whole batches, as torch does) or
            "economic": ``num_workers`` item workers fetch items, ``num_batch_workers`` batch
            workers collate them, and ``prefetch_factor`` counts the batches in flight across
            all workers, so memory does not grow with ``num_workers``. Map-style datasets only.
        num_batch_workers: economic mode's batch workers (default: ``prefetch_factor``).
        stats: count and time every stage for :meth:`stats` (on by default: about a microsecond
            per batch, under 1% once a batch takes a millisecond). False turns it off.
        max_shm_bytes: the most shared memory (bytes) process workers' batches in flight and
            reusable slabs may take; None (the default) allows half of what the memory behind
            them can still take. Batches larger than it still load, one at a time.
        equal_batches: under ``torch.distributed`` with several ranks, make every rank yield the
            same number of batches each epoch, so DDP never waits on a rank that has finished:
            ``"drop"`` ends the epoch on every rank when the first runs out, ``"pad"`` lets ranks
            that ran out repeat their last batch until the last rank is done. Costs one small
            ``all_reduce`` per batch; needs an initialised process group. None (the default, as
            torch): each rank yields what its share holds.
        worker_seeding: ``"torch"`` (the default) seeds each worker once, as torch does;
            ``"per_batch"`` seeds the generators that build each batch (torch, random, numpy)
            from the base seed, the epoch and the batch alone, so the random values of a batch
            do not depend on which worker built it: what exact resume of random augmentations
            needs (see ``state_dict``).

    Example:
        >>> loader = DataLoader(TensorDataset(torch.arange(10)), batch_size=4, shuffle=True)
        >>> [batch[0].shape[0] for batch in loader]
        [4, 4, 2]
        >>> big = DataLoader(videos, batch_size=64, num_workers=16, mode="economic")  # doctest: +SKIP
    """

    dataset: Dataset[T_co]
    batch_size: int | None
    num_workers: int
    pin_memory: bool
    drop_last: bool
    timeout: float
    sampler: Sampler | Iterable
    prefetch_factor: int | None
    __initialized = False

    def __init__(
        self,
        dataset: Dataset[T_co],
        batch_size: int | None = 1,
        shuffle: bool | None = None,
        sampler: Sampler | Iterable | None = None,
        batch_sampler: Sampler[list] | Iterable[list] | None = None,
        num_workers: int | str = 0,
        collate_fn: Callable[[list[Any]], Any] | None = None,
        pin_memory: bool = False,
        drop_last: bool = False,
        timeout: float = 0,
        worker_init_fn: Callable[[int], None] | None = None,
        multiprocessing_context: Any = None,
        generator: torch.Generator | None = None,
        *,
        prefetch_factor: int | str | None = None,
        persistent_workers: bool = False,
        pin_memory_device: str = "",
        in_order: bool = True,
        worker_type: str = "process",
        mode: str = "classic",
        num_batch_workers: int | None = None,
        stats: bool = True,
        max_shm_bytes: int | None = None,
        equal_batches: str | None = None,
        worker_seeding: str = "torch",
    ) -> None:
        # torch's __init__ is deliberately not called: it would set up torch's loading state.
        auto = arguments.auto_options(num_workers, prefetch_factor, stats)
        if auto[0]:
            num_workers = usable_cpus()
        if auto[1]:
            prefetch_factor = None  # the usual default to start from
        arguments.check_num_workers(num_workers)
        arguments.check_max_shm_bytes(max_shm_bytes)
        arguments.check_timeout(timeout)
        prefetch_factor = arguments.resolve_prefetch_factor(prefetch_factor, num_workers)
        arguments.check_worker_options(num_workers, persistent_workers, worker_type, multiprocessing_context)
        arguments.check_equal_batches(equal_batches)
        arguments.check_worker_seeding(worker_seeding)
        self.equal_batches = equal_batches
        self.worker_seeding = worker_seeding
        self.dataset = dataset
        self.num_workers = num_workers
        self.prefetch_factor = prefetch_factor
        self.pin_memory = pin_memory
        self.pin_memory_device = pin_memory_device
        self.timeout = timeout
        self.worker_init_fn = worker_init_fn
        self.multiprocessing_context = multiprocessing_context
        self.in_order = in_order
        self.worker_type = worker_type
        self.max_shm_bytes = max_shm_bytes

        iterable = _is_iterable_dataset(dataset)
        self._dataset_kind = DatasetKind.ITERABLE if iterable else DatasetKind.MAP
        self.num_batch_workers = arguments.resolve_mode(
            mode, num_workers, num_batch_workers, prefetch_factor, dataset, iterable
        )
        self.mode = mode
        if iterable:
            # A DataPipe graph takes ``shuffle`` itself: it turns the graph's shuffle pipes on/off.
            shuffle = replica.apply_shuffle_option(dataset, shuffle)
            arguments.check_iterable_options(shuffle, sampler, batch_sampler)
        else:
            shuffle = bool(shuffle)
        batch_size, drop_last = arguments.check_batching(batch_size, shuffle, sampler, batch_sampler, drop_last)

        if sampler is None:
            sampler = arguments.default_sampler(dataset, iterable, bool(shuffle), generator)
        if batch_size is not None and batch_sampler is None:
            batch_sampler = BatchSampler(sampler, batch_size, drop_last)

        self.batch_size = batch_size
        self.drop_last = drop_last
        self.sampler = sampler
        self.batch_sampler = batch_sampler
        self.generator = generator
        if collate_fn is None:
            collate_fn = default_collate if batch_sampler is not None else default_convert
        self.collate_fn = collate_fn
        self.persistent_workers = persistent_workers
        self._persistent_engine: Any = None
        self._persistent_epoch: weakref.ref[_EpochIterator] | None = None
        self._len_reported: int | None = None
        self._warned_every_rank_loads_all = False
        self._checked_graph_sharding = False
        self._stats = StatsRecorder(self._stats_setup()) if stats else None
        self._auto = auto  # (num_workers, prefetch_factor) given as "auto"
        self._tuner: AutoTuner | None = None
        self._session = (0, 0)  # (base seed, epoch number) of the latest engine's session
        self._epoch_notes: tuple[resume.EpochRecord, resume.EpochProgress] | None = None
        self._resume_point: resume.ResumePoint | None = None
        self.__initialized = True
        arguments.warn_if_too_many_workers(num_workers)

    # -- torch-compatible attributes -------------------------------------------------------

    @property
    def multiprocessing_context(self) -> Any:
        return self.__multiprocessing_context

    @multiprocessing_context.setter
    def multiprocessing_context(self, context: Any) -> None:
        self.__multiprocessing_context = arguments.resolve_context(context, self.num_workers)

    def __setattr__(self, name: str, value: Any) -> None:
        if self.__initialized and name in _FROZEN_AFTER_INIT:
            raise ValueError(
                f"{name} attribute should not be set after {type(self).__name__} is initialized "
                f"(tried to set {name}={value!r}); build a new DataLoader instead"
            )
        super().__setattr__(name, value)

    @property
    def _auto_collation(self) -> bool:
        return self.batch_sampler is not None

    @property
    def _index_sampler(self) -> Any:
        return self.batch_sampler if self._auto_collation else self.sampler

    def __len__(self) -> int:
        if self._dataset_kind is DatasetKind.ITERABLE:
            length = len(self.dataset)  # type: ignore[arg-type]
            self._len_reported = length
            if self.batch_size is not None:
                length = length // self.batch_size if self.drop_last else math.ceil(length / self.batch_size)
            return length
        return len(self._index_sampler)

    # -- stats -----------------------------------------------------------------------------

    def stats(self) -> LoaderStats:
        """What this loader has done so far, across epochs: per-stage and per-worker counts and
        times, queue occupancy, throughput, and ``str()`` of it names the bottleneck.

        Raises:
            RuntimeError: the loader was built with ``stats=False``.

        Example:
            >>> for batch in loader:  # doctest: +SKIP
            ...     train_step(batch)
            >>> print(loader.stats())  # doctest: +SKIP
        """
        if self._stats is None:
            raise RuntimeError("stats are off for this loader: build it with stats=True (the default)")
        return self._stats.snapshot()

    def _stats_setup(self) -> LoaderSetup:
        return LoaderSetup(self.mode, self.worker_type, self.num_workers, self.prefetch_factor,
                           self.batch_size, self.pin_memory)

    # -- running an epoch ------------------------------------------------------------------

    def check_worker_number_rationality(self) -> None:
        """Warn when num_workers exceeds the CPUs this process may use (torch's public method)."""
        arguments.warn_if_too_many_workers(self.num_workers)

    def _get_iterator(self) -> _EpochIterator:
        # Some training frameworks call torch's private hook; it is one epoch's iterator.
        return iter(self)

    def __iter__(self) -> _EpochIterator:
        point, self._resume_point = self._resume_point, None
        self._warn_if_every_rank_loads_all()
        self._warn_if_graph_unsharded()
        record = resume.begin_epoch(self, point.record if point is not None else None)  # before any draw
        with resume.epoch_start_draws(point):
            tasks = iter(self._index_sampler)
            engine, owned, epoch_seed = self._engine_for_epoch(point, record)
            tasks, start = self._position_tasks(tasks, point)
        if self.equal_batches is not None and self._dataset_kind is DatasetKind.MAP:
            start = dataclasses.replace(start, epoch_batches=exact_length(self._index_sampler))
        try:
            engine.start_epoch(tasks, start=start, **epoch_seed)
        except BaseException:
            engine.close()
            raise
        if self._stats is not None:
            self._stats.epoch_started()
        progress = resume.progress_from(point)
        self._epoch_notes = (record, progress)
        iterator = _EpochIterator(self, engine, owned, progress)
        if not owned:
            self._persistent_epoch = weakref.ref(iterator)
        return iterator

    def _engine_for_epoch(self, point: resume.ResumePoint | None, record: resume.EpochRecord) -> tuple[Any, bool, dict[str, int]]:
        """This epoch's engine (a new one, or the persistent session's), whether the epoch owns
        it, and the seed a persistent session's later epoch gives its DataPipe graphs."""
        epoch_seed: dict[str, int] = {}
        session = point.session if point is not None else None
        if not (self.persistent_workers and self.num_workers > 0):
            engine = self._build_engine(point, session)
            record.base_seed, record.session_epoch = self._session
            record.later_in_session = session is not None
            return engine, True, epoch_seed
        if self._persistent_engine is None or self._persistent_engine.closed:
            self._persistent_engine = self._build_engine(point, session)
            weakref.finalize(self, self._persistent_engine.close)
            record.later_in_session = session is not None
        else:
            if replica.draws_shared_seed(self.dataset):
                # A later epoch of a persistent session: torch draws one seed, for the graphs only.
                epoch_seed["shared_seed"] = replica.draw_shared_seed(self.generator)
            self._session = (self._session[0], self._session[1] + 1)
            record.later_in_session = True
        record.base_seed, record.session_epoch = self._session
        return self._persistent_engine, False, epoch_seed

    def _position_tasks(self, tasks: Any, point: resume.ResumePoint | None) -> tuple[Any, EpochStart]:
        """Where a resumed epoch goes on: map-style skips the keys already handed out."""
        if self._dataset_kind is DatasetKind.ITERABLE:
            return tasks, resume.stream_start(point, self.num_workers)
        keys_of = len if self._auto_collation else (lambda _task: 1)
        return resume.skip_handed_out(tasks, point, keys_of)

    def state_dict(self) -> dict[str, Any]:
        """A checkpoint of where this loader stands: small, JSON-serialisable, versioned.

        Taken after any batch, and loaded into a new DataLoader over the same dataset (in a new
        process, say), the new loader yields exactly the remaining batches of the epoch, then
        the following epochs, as this one would have. What is guaranteed about random values
        drawn while building batches is in docs/design/resume.md (``worker_seeding``).

        Raises:
            ValueError: ``in_order=False`` with workers and ``equal_batches="pad"`` across
                ranks (see ``resume.check_can_checkpoint``).
        """
        resume.check_can_checkpoint(self)
        record, progress = self._epoch_notes if self._epoch_notes is not None else (None, None)
        session = None
        if self._persistent_engine is not None and not self._persistent_engine.closed:
            session = (self._session[0], self._session[1] + 1)  # the session's next epoch
        return resume.build_state(self, record, progress, session)

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Continue from a ``state_dict()``: the next ``iter(loader)`` resumes that epoch.

        Persistent workers this loader already runs are stopped (the checkpoint's session takes
        their place).

        Raises:
            IncompatibleStateError: the state comes from another configuration (dataset length,
                batch size, world size, ...: the message names each difference), another kind
                of state, or a newer version.
        """
        point = resume.read_state(self, state)
        if self._persistent_engine is not None:
            self._iterator = None  # type: ignore[assignment]
        self._epoch_notes = None
        self._resume_point = point

    def _draw_base_seed(self) -> int:
        return _draw_base_seed(self.generator)

    def _build_engine(self, point: resume.ResumePoint | None = None,
                      session: tuple[int, int] | None = None) -> Any:
        # The draws and their order follow torch's: a DataPipe graph's shared seed, the base seed,
        # and, once workers have started, one more shared seed that torch draws and never uses.
        # A session resumed from a checkpoint has its base seed already: it draws the graph's
        # seed only, as the session's later epochs did.
        replica_setup = self._replica_setup()
        base_seed = self._draw_base_seed() if session is None else session[0]
        self._session = (base_seed, 1 if session is None else session[1])
        if self.timeout > 0 and self.num_workers == 0:
            raise arguments.ArgumentAssertionError(
                "_SingleProcessDataLoaderIter requires timeout == 0 (pipeload: "
                f"timeout={self.timeout!r} needs workers: set num_workers > 0 or timeout=0)"
            )
        if self.equal_batches is not None:
            check_ranks_can_agree()
        spec = self._fetch_spec(point)
        if self.num_workers == 0:
            engine: Any = InlineEngine(spec, replica_setup, self._stats, base_seed, self._session[1])
        elif any(self._auto) and self.mode == "classic":
            engine = self._auto_engine(spec, base_seed, replica_setup)
        elif self.mode == "economic":
            if any(self._auto):
                self._auto_tuner()  # records the starting settings, which economic mode keeps
            engine = EconomicEngine(self._economic_config(spec, base_seed, replica_setup))
        else:
            engine = PoolEngine(self._pool_config(spec, base_seed, replica_setup))
            if replica_setup.shared_seed is not None and session is None:
                replica.draw_shared_seed(self.generator, share=False)
        if point is not None and point.handed_out_above:
            engine = resume.DropHandedOut(engine)  # below pinning and the ranks' agreement
        return self._balance_ranks(self._maybe_pin(engine))

    def _balance_ranks(self, engine: Any) -> Any:
        if self.equal_batches is None or current_placement().world_size == 1:
            return engine
        return EqualBatches(engine, self.equal_batches)

    def _fetch_spec(self, point: resume.ResumePoint | None) -> FetchSpec:
        iterable = self._dataset_kind is DatasetKind.ITERABLE
        streams = resume.resumed_streams(point)
        return FetchSpec(
            self.dataset, self._dataset_kind, self._auto_collation, self.collate_fn, self.drop_last,
            per_batch_seeding=self.worker_seeding == "per_batch" and self.mode == "classic",
            stream_snapshot_every=resume.STREAM_SNAPSHOT_EVERY if iterable else 0,
            resume_streams=streams,
        )

    def _auto_engine(self, spec: FetchSpec, base_seed: int, replica_setup: ReplicaSetup) -> Any:
        """The engine for num_workers/prefetch_factor="auto" in classic mode: a pool the tuner
        may replace mid-epoch over a map-style dataset. An iterable dataset's replicas cannot be
        re-split mid-stream: it keeps its starting settings."""
        tuner = self._auto_tuner()
        first = self._pool_config(spec, base_seed, replica_setup)
        return AutoEngine(pools_like(first), tuner, first.setup.first_epoch)

    def _auto_tuner(self) -> AutoTuner:
        """The loader's tuner, made once; it re-tunes only map-style datasets in classic mode."""
        if self._tuner is None:
            adjustable = self._dataset_kind is DatasetKind.MAP and self.mode == "classic"
            start = Settings(self.num_workers, self.prefetch_factor)  # type: ignore[arg-type]
            budget = memory_budget_bytes(getattr(self, "max_shm_bytes", None))
            self._tuner = AutoTuner(self._stats, usable_cpus(), self._auto[0] and adjustable,
                                    self._auto[1] and adjustable, start, budget)
        return self._tuner

    def _replica_setup(self) -> ReplicaSetup:
        """Where this session's copies of the dataset sit among ranks, and their graph seed."""
        placement = current_placement()
        seed = replica.draw_shared_seed(self.generator) if replica.draws_shared_seed(self.dataset) else None
        return ReplicaSetup(placement.rank, placement.world_size, seed)

    def _warn_if_every_rank_loads_all(self) -> None:
        if self._warned_every_rank_loads_all or self._dataset_kind is not DatasetKind.MAP:
            return
        message = replication_warning(self.dataset, self.sampler, self.batch_sampler)
        if message is not None:
            self._warned_every_rank_loads_all = True
            warnings.warn(message, stacklevel=3)

    def _warn_if_graph_unsharded(self) -> None:
        # Once per loader: walking a torch graph pickles it, data and all.
        if self._checked_graph_sharding:
            return
        self._checked_graph_sharding = True
        world_size = current_placement().world_size
        message = replica.unsharded_warning(self.dataset, max(self.num_workers, 1), world_size)
        if message is not None:
            warnings.warn(message, stacklevel=3)

    @property
    def _iterator(self) -> _EpochIterator | None:
        """The epoch iterator of a persistent session, as torch keeps it (None without one).

        Frameworks shut persistent workers down by setting this to None (Lightning does at the
        end of ``fit``): the workers stop at once, or at the end of an epoch still running, as
        torch's stop when its dropped iterator goes.
        """
        return self._persistent_epoch() if self._persistent_epoch is not None else None

    @_iterator.setter
    def _iterator(self, value: None) -> None:
        if value is not None:
            raise ValueError(
                f"_iterator can only be set to None (to stop persistent workers), but got {value!r}"
            )
        running = self._iterator
        self._persistent_epoch = None
        engine, self._persistent_engine = self._persistent_engine, None
        if running is not None and running._engine is engine:
            running._adopt_engine()  # like torch's dropped iterator: its epoch may still finish
        elif engine is not None:
            engine.close()

    def _worker_setup(self, spec: FetchSpec, base_seed: int, replica_setup: ReplicaSetup) -> WorkerSetup:
        warn_if_copy_on_read(self.dataset, self.worker_type)  # pytorch#13246: points at the fix
        method = "thread" if self.worker_type == "thread" else "multiprocessing"
        return WorkerSetup(spec, self.num_workers, base_seed, self.worker_init_fn, method, replica_setup,
                           stats=self._stats is not None, first_epoch=self._session[1])

    def _economic_config(self, spec: FetchSpec, base_seed: int, replica_setup: ReplicaSetup) -> EconomicConfig:
        setup = EconomicSetup(self._worker_setup(spec, base_seed, replica_setup), self.num_batch_workers)  # type: ignore[arg-type]
        return EconomicConfig(
            setup=setup,
            prefetch_factor=self.prefetch_factor,  # type: ignore[arg-type]
            in_order=self.in_order,
            timeout_s=self.timeout,
            worker_type=self.worker_type,
            mp_context=self.multiprocessing_context,
            stats=self._stats,
            max_shm_bytes=self.max_shm_bytes,
            pin_slabs=self.pin_memory and pinning_available(),
            numbered=self._numbers_batches(),
        )

    def _pool_config(self, spec: FetchSpec, base_seed: int, replica_setup: ReplicaSetup) -> PoolConfig:
        return PoolConfig(
            setup=self._worker_setup(spec, base_seed, replica_setup),
            prefetch_factor=self.prefetch_factor,  # type: ignore[arg-type]
            in_order=self.in_order,
            timeout_s=self.timeout,
            worker_type=self.worker_type,
            mp_context=self.multiprocessing_context,
            stats=self._stats,
            max_shm_bytes=self.max_shm_bytes,
            pin_slabs=self.pin_memory and pinning_available(),  # page-locked in place: no copy
            numbered=self._numbers_batches(),
        )

    def _numbers_batches(self) -> bool:
        # Out of order, a map-style epoch's batches say their numbers, so that a checkpoint can
        # record which were handed out (iterable replicas record their own positions).
        return not self.in_order and self._dataset_kind is DatasetKind.MAP

    def _maybe_pin(self, engine: Any) -> Any:
        if not self.pin_memory:
            return engine
        if self.pin_memory_device:
            warnings.warn(
                "pin_memory_device is deprecated, the current accelerator will be used as the "
                f"device,ignore pin_memory_device='{self.pin_memory_device}'. (pipeload: batches "
                "are pinned for the current accelerator.)",
                stacklevel=4,
            )
        if not pinning_available():
            warnings.warn(
                "'pin_memory' argument is set as true but no accelerator is found, then device "
                "pinned memory won't be used. (pipeload: batches are handed out in ordinary "
                "memory.)",
                stacklevel=4,
            )
            return engine
        if self.num_workers == 0:
            return InlinePinning(engine, None, self._stats)
        return ThreadedPinning(engine, None, self._stats)


class _EpochIterator:
    """One epoch over a loader. Owns its engine unless the loader keeps workers persistent.

    Closing it (at the end, or when it is dropped) stops an owned engine at once. An error
    raised for one batch leaves the epoch running, as in torch: catch it, call ``next`` again,
    and the other batches keep coming. The engine itself closes on what ends an epoch (a dead
    worker, a broken channel); Ctrl-C (anything that is not an ``Exception``) closes it here.
    """

    def __init__(self, loader: DataLoader, engine: Any, owns_engine: bool,
                 progress: resume.EpochProgress) -> None:
        self._engine = engine
        self._progress = progress
        self._owns_engine = owns_engine
        # A borrowed (persistent) engine lives as long as its loader: hold the loader, or
        # `for b in DataLoader(..., persistent_workers=True)` would close it under our feet.
        self._loader = None if owns_engine else loader
        self._index_sampler = loader._index_sampler
        self._len_reported = loader._len_reported
        self._is_iterable = loader._dataset_kind is DatasetKind.ITERABLE
        self._num_workers = loader.num_workers
        self._dataset = loader.dataset
        self._yielded = 0
        self._ended = False
        self._stats = loader._stats
        self._finalizer = weakref.finalize(self, engine.close) if owns_engine else None

    def __iter__(self) -> _EpochIterator:
        return self

    def __next__(self) -> Any:
        stats = self._stats  # times the wait for data; holds no engine, so the frame may keep it
        asked = stats.asking() if stats is not None else 0.0
        try:
            if profiling():  # a span as torch's loader records for its __next__
                with span("pipeload.DataLoader.__next__"):
                    batch = self._engine.next_batch()
            else:
                batch = self._engine.next_batch()
        except StopIteration:
            self._progress.ended = True
            if stats is not None:
                stats.ended(asked)
            self._finish()
            raise
        except Exception as error:
            self._progress.failed(error)
            if stats is not None:
                stats.ended(asked)
            # The error's traceback keeps this frame: without `self` in it, an uncaught error
            # (one that unwinds the caller's `for` loop) still lets the iterator go, and its
            # workers with it, however long the error itself is kept.
            del self, error
            raise
        except BaseException:
            self._engine.close()  # Ctrl-C ends the epoch: no half-alive workers
            del self
            raise
        if stats is not None:
            stats.handed(asked)
        batch = self._progress.handed_out(batch)
        self._yielded += 1
        if self._is_iterable and self._len_reported is not None and self._yielded > self._len_reported:
            _warn_length_exceeded(self._dataset, self._len_reported, self._yielded, self._num_workers)
        return batch

    def __len__(self) -> int:
        return len(self._index_sampler)

    @property
    def _workers(self) -> list[Any]:
        return self._engine.workers

    @property
    def _pin_memory(self) -> bool:
        """Whether batches are pinned (torch's attribute: False without an accelerator)."""
        return isinstance(self._pin_stage, (InlinePinning, ThreadedPinning))

    @property
    def _pin_memory_thread(self) -> threading.Thread:
        """The thread that pins batches, as in torch: only with workers and an accelerator."""
        stage = self._pin_stage
        thread = stage.thread if isinstance(stage, ThreadedPinning) else None
        if thread is None:
            raise AttributeError(f"'{type(self).__name__}' object has no attribute '_pin_memory_thread'")
        return thread

    @property
    def _pin_stage(self) -> Any:
        engine = self._engine
        return engine.inner if isinstance(engine, EqualBatches) else engine

    def close(self) -> None:
        """Stop the workers now (persistent workers belong to the loader and stay)."""
        if self._finalizer is not None:
            self._finalizer()

    def _finish(self) -> None:
        self._ended = True
        if self._owns_engine:
            self.close()

    def _adopt_engine(self) -> None:
        """The loader let go of its persistent workers mid-epoch: this epoch stops them when it
        ends (or is dropped), as torch's workers stop with the iterator that held them."""
        self._owns_engine = True
        self._loader = None
        self._finalizer = weakref.finalize(self, self._engine.close)
        if self._ended:
            self.close()

    def __getstate__(self) -> Any:
        raise NotImplementedError(f"{type(self).__name__} cannot be pickled")


def _draw_base_seed(generator: torch.Generator | None) -> int:
    # One int64 from the loader's generator (or the global RNG) per worker session, as torch
    # draws it, so the global random stream stays in step with torch's.
    return int(torch.empty((), dtype=torch.int64).random_(generator=generator).item())


def _warn_length_exceeded(dataset: Any, reported: int, yielded: int, num_workers: int) -> None:
    # torch's sentence, its missing space before "(when" included.
    message = (
        f"Length of IterableDataset {dataset} was reported to be {reported}(when accessing "
        f"len(dataloader)), but {yielded} samples have been fetched. "
    )
    if num_workers > 0:
        message += (
            "For multiprocessing data-loading, this could be caused by not properly configuring "
            "the IterableDataset replica at each worker. Please see "
            "https://pytorch.org/docs/stable/data.html#torch.utils.data.IterableDataset for "
            "examples. (pipeload: with several workers, each worker's replica must yield only "
            "its share: see get_worker_info().)"
        )
    warnings.warn(message, stacklevel=3)
