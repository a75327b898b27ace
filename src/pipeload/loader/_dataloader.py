"""DataLoader: validates its arguments as torch does, then hands each epoch to an engine.

The loader is a description; what runs an epoch is an engine (inline, or a pool of workers),
optionally followed by a pin stage. ``iter(loader)`` returns an epoch iterator that owns the
engine (or borrows the loader's, with ``persistent_workers=True``).

``DataLoader`` subclasses ``torch.utils.data.DataLoader`` for identity alone, so that training
frameworks that test ``isinstance`` shard and rebuild it as they do torch's. None of torch's
loader code runs: its ``__init__`` is never called and every method it defines is defined here.
"""

from __future__ import annotations

import copy
import math
import multiprocessing
import warnings
import weakref
from collections.abc import Callable, Iterable
from typing import Any, TypeVar

import torch
import torch.utils.data as torch_data  # torch's DataLoader: a base for identity, never called

from pipeload._user_frame import first_frame_outside_pipeload
from pipeload.loader import _arguments as arguments
from pipeload import resume
from pipeload.loader import _engine_choice
from pipeload.loader._epoch_iterator import _EpochIterator
from pipeload.collate import default_collate, default_convert
from pipeload.datasets import Dataset, _is_iterable_dataset
from pipeload.distributed import current_placement, replication_warning
from pipeload.engine import replica
from pipeload._interrupts import ctrl_c_held, ctrl_c_kept
from pipeload.engine.lifecycle import REAPED_WITHIN_S, wait_for_reaped
from pipeload.engine.plan import DatasetKind
from pipeload.errors import check_generator
from pipeload.samplers import BatchSampler, EpochLengths, Sampler, StatefulSampler
from pipeload.stats.recorder import EpochCount, LoaderSetup, StatsRecorder, usable_cpus
from pipeload.stats import skips
from pipeload.stats.clock import now
from pipeload.stats.report import LoaderStats
from pipeload.stats.tuner import AutoTuner
from pipeload.transport.slab_keeper import SlabKeeper

T_co = TypeVar("T_co", covariant=True)

_FROZEN_AFTER_INIT = frozenset(
    {"batch_size", "batch_sampler", "sampler", "drop_last", "dataset", "persistent_workers", "mode",
     "num_batch_workers", "equal_batches", "worker_seeding"}
)
# Settable after construction, as in torch, and checked when set (``_checked_setting``).
_CHECKED_WHEN_SET = frozenset(
    {"num_workers", "prefetch_factor", "timeout", "worker_type", "max_shm_bytes", "generator",
     "collate_fn", "worker_init_fn"}
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
        stats: count every batch and time a sample of them for :meth:`stats` (on by default:
            a countdown per batch, the timing about one batch in 64). False turns it off.
        max_shm_bytes: the most shared memory (bytes) process workers' batches in flight and
            reusable slabs may take; None (the default) allows half of what the memory behind
            them can still take. Batches larger than it still load, one at a time, in two
            reusable slabs: the batch the loop holds and the next (the least any loop needs).
        equal_batches: under ``torch.distributed`` with several ranks, make every rank yield the
            same number of batches each epoch, so DDP never waits on a rank that has finished:
            ``"drop"`` ends the epoch on every rank when the first runs out, ``"pad"`` lets ranks
            that ran out repeat their last batch until the last rank is done. Costs one small
            ``all_reduce`` per batch (per epoch when the sampler's length is exact: map-style,
            torch's or our samplers); needs an initialised process group. None (the default, as
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
        num_workers = arguments.resolve_num_workers(num_workers)
        arguments.check_max_shm_bytes(max_shm_bytes)
        timeout = arguments.resolve_timeout(timeout)
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
        # What torch finds wrong only once iterating, after what its constructor checks (its
        # BatchSampler's too): a loader wrong both ways raises torch's error, as torch's does.
        check_generator(generator)
        # worker_init_fn only where workers will call it: torch never looks at it without them.
        arguments.check_callables(collate_fn=collate_fn, worker_init_fn=worker_init_fn if num_workers != 0 else None)

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
        self._interrupted_session: tuple[int, int] | None = None  # see _engine_for_epoch
        self._persistent_epoch: weakref.ref[_EpochIterator] | None = None
        self._len_reported: int | None = None
        self._warned_every_rank_loads_all = False
        self._checked_rank_seeds = False  # _engine_choice: may the ranks' shuffles differ?
        self._checked_graph_sharding = False
        self._auto = auto  # (num_workers, prefetch_factor) given as "auto"
        self._stats = self._new_stats() if stats else None
        self._failure_board: Any = None  # where on_error pipes count (stats/skips.py), made once
        self._failures_checked = False
        self._tuner: AutoTuner | None = None
        self._session = (0, 0)  # (base seed, epoch number) of the latest engine's session
        self._epoch_notes: tuple[resume.EpochRecord, resume.EpochProgress] | None = None
        self._resume_point: resume.ResumePoint | None = None
        self._loaded_state: dict[str, Any] | None = None  # what _resume_point was read from
        self._loaded_generators: tuple = ()  # set again at the next iter() (resume/state.py)
        self._keep_slabs()
        self.__initialized = True
        if not auto[0]:  # "auto" chose the count: torch's warning is about a count one chose
            arguments.warn_if_too_many_workers(num_workers, self.num_batch_workers or 0, worker_type)

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
        if self.__initialized and name in _CHECKED_WHEN_SET:
            value = self._checked_setting(name, value)
        super().__setattr__(name, value)

    def _checked_setting(self, name: str, value: Any) -> Any:
        """A setting torch lets one assign after construction, checked (and normalised) as the
        constructor does: a ``prefetch_factor`` of 0 set later ended every epoch after its first
        batch, silently; torch's iterator refuses it when the epoch starts."""
        if name in ("num_workers", "prefetch_factor") and isinstance(value, str) and value == arguments.AUTO:
            raise ValueError(f"{name}='auto' is given when the DataLoader is made (its tuner starts with "
                             f"the first epoch); after that, set a number, but got {name}={value!r}")
        if name == "num_workers":
            return arguments.resolve_num_workers(value)
        if name == "prefetch_factor":
            return None if value is None else arguments.resolve_prefetch_factor(value, 1)
        if name == "timeout":
            return arguments.resolve_timeout(value)
        if name == "worker_type":
            arguments.check_worker_options(1, False, value, None)
        elif name == "max_shm_bytes":
            arguments.check_max_shm_bytes(value)
        elif name == "generator":
            check_generator(value)
        elif name == "collate_fn" or (name == "worker_init_fn" and self.num_workers != 0):
            arguments.check_callables(**{name: value})
        return value

    @property
    def _auto_collation(self) -> bool:
        return self.batch_sampler is not None

    @property
    def _index_sampler(self) -> Any:
        return self.batch_sampler if self._auto_collation else self.sampler

    @property
    def _IterableDataset_len_called(self) -> int | None:  # noqa: N802 - torch's name
        """The length an iterable dataset reported to ``len(loader)`` (None before), by torch's name."""
        return self._len_reported

    def __len__(self) -> int:
        if self._dataset_kind is DatasetKind.ITERABLE:
            self._refuse_len_the_ranks_agree_on_as_they_go()
            length = len(self.dataset)  # type: ignore[arg-type]
            self._len_reported = length
            if self.batch_size is not None:
                length = length // self.batch_size if self.drop_last else math.ceil(length / self.batch_size)
            return length
        if not _equal_on_every_rank(self._index_sampler):
            self._refuse_len_the_ranks_agree_on_as_they_go()
        return len(self._index_sampler)

    def _refuse_len_the_ranks_agree_on_as_they_go(self) -> None:
        """Ranks agree on their batch count under ``equal_batches`` only as the epoch runs: this
        rank's own count is not what it will yield, and a framework that stops an epoch at
        ``len(loader)`` (Lightning does) stopped a padding rank after its own 3 batches while
        the other padded on to 7, whose next collective found no peer. Without a length, such a
        framework runs the loader to the end the ranks agree on. (Asking the other ranks here
        would be a collective, which a ``len()`` on rank 0 alone, a progress bar's, would put
        out of step with the ranks' other collectives.) Map-style loaders too, unless their
        sampler gives every rank as many (stop 54: a Lightning job over per-rank lists crashed)."""
        if self.equal_batches is None:
            return
        placement = current_placement()
        if placement.world_size > 1:
            what = "an iterable dataset" if self._dataset_kind is DatasetKind.ITERABLE else (
                "a map-style dataset whose sampler is no DistributedSampler")
            raise TypeError(
                f"len() of a DataLoader over {what} with equal_batches="
                f"{self.equal_batches!r} across {placement.world_size} ranks is not known in "
                "advance: the ranks agree on when the epoch ends as it runs (each rank's dataset "
                "or sampler has its own length), so iterate it to its end")

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

    def _new_stats(self) -> StatsRecorder:
        # "auto" judges each window of batches by the loop's waits: it times every one.
        return StatsRecorder(self._stats_setup(), time_every_batch=any(self._auto))

    def _stats_setup(self) -> LoaderSetup:
        kind = "pipe" if replica.graph_rules(self.dataset) is not None else self._dataset_kind.label
        return LoaderSetup(self.mode, self.worker_type, self.num_workers, self.prefetch_factor,
                           self.batch_size, self.pin_memory, usable_cpus(), kind,
                           bool(self.persistent_workers), self.worker_init_fn is not None)

    # -- copies ----------------------------------------------------------------------------

    def __getstate__(self) -> dict[str, Any]:
        """What ``copy.deepcopy`` and ``pickle`` keep: the configuration, as torch's loader
        keeps its. What runs belongs to this loader alone: its persistent workers, its stats
        and tuner; a copy starts with none of them (torch cannot copy a loader whose
        persistent workers run at all)."""
        state = dict(self.__dict__)
        state.update(_persistent_engine=None, _persistent_epoch=None, _tuner=None, _interrupted_session=None,
                     _failure_board=None, _failures_checked=False,
                     _stats=self._stats is not None,  # a flag: the copy makes its own
                     _slab_keeper=None)  # and keeps its own slabs
        return state

    def __setstate__(self, state: dict[str, Any]) -> None:
        state.setdefault("_loaded_generators", ())  # a loader pickled by an older pipeload
        self.__dict__.update(state)  # not through __setattr__: the frozen ones are restored
        self._stats = self._new_stats() if state["_stats"] else None
        self._keep_slabs()

    # -- shared memory kept between epochs ---------------------------------------------------

    def _keep_slabs(self) -> None:
        # The slab pool process workers write batches into belongs to the loader, not to one set
        # of workers: each epoch without persistent workers, each new iterator, finds it ready.
        # It goes with the loader (or on release_shared_memory()).
        keeper = self._slab_keeper = SlabKeeper()
        weakref.finalize(self, ctrl_c_kept(_let_go_of_slabs), keeper.close).atexit = False

    def release_shared_memory(self) -> None:
        """Free the shared memory this loader keeps between epochs for its workers' batches.

        With process workers, batches are written into shared-memory slabs that the loader keeps
        from one set of workers to the next (each epoch without ``persistent_workers``, each new
        iterator), mapped and (with ``pin_memory``) page-locked, so that no epoch pays for them
        again. They are freed when the loader is garbage-collected; call this to free them
        earlier, for example between training and a long evaluation. Workers running now keep
        theirs until they stop; the next epoch makes new ones. Batches you still hold stay
        valid. The slabs of the process boundaries in a DataPipe graph (``queue_boundary
        ("process")``), and of the thread workers' copies of them, are freed too. Not a torch
        ``DataLoader`` method: an addition of pipeload's.

        Example:
            >>> for epoch in range(3):  # doctest: +SKIP
            ...     for batch in loader:
            ...         train_step(batch)
            >>> loader.release_shared_memory()  # doctest: +SKIP
        """
        _let_go_of_slabs(self._slab_keeper.release)
        replica.release_boundary_slabs(self.dataset)  # the process boundaries in its graph

    # -- running an epoch ------------------------------------------------------------------

    def check_worker_number_rationality(self) -> None:
        """Warn when the workers that start (economic mode: item and batch workers) exceed the
        CPUs this process may use (torch's public method)."""
        arguments.warn_if_too_many_workers(self.num_workers, self.num_batch_workers or 0, self.worker_type)

    def _warn_if_too_many_workers(self) -> None:
        """torch's warning again as new workers start (an epoch without persistent workers, a
        first epoch, ``num_workers`` raised since): torch says it at construction and in every
        new iterator with workers. Not where "auto" chose the count."""
        if self.num_workers > 0 and not self._auto[0]:
            self.check_worker_number_rationality()

    def _settings_agree(self) -> None:
        """Settings assigned after construction, each checked as it was set, agree with each
        other as an epoch starts: workers asked for after ``num_workers=0`` get torch's default
        ``prefetch_factor``, ``collate_fn=None`` the constructor's default, and what the
        constructor refuses together is refused here."""
        if self.num_workers > 0 and self.prefetch_factor is None:
            self.prefetch_factor = 2
        if self.collate_fn is None:  # the constructor's default, not a None to call
            self.collate_fn = default_collate if self.batch_sampler is not None else default_convert
        # persistent_workers with num_workers set to 0 since: the epoch runs in this process, as
        # torch's does (refused only when both are given to the constructor, as by torch).
        context = self.multiprocessing_context if self.worker_type == "process" else None
        arguments.check_worker_options(self.num_workers, False, self.worker_type, context)
        if self.num_workers != 0:  # workers asked for since worker_init_fn was set
            arguments.check_callables(worker_init_fn=self.worker_init_fn)

    def _get_iterator(self) -> _EpochIterator:
        # Some training frameworks call torch's private hook; it is one epoch's iterator.
        return iter(self)

    def __iter__(self) -> _EpochIterator:
        point = self._resume_point
        if resume.loaded_epoch_is_over(self, point):
            # A state saved after an epoch's last batch resumes with the next epoch, as
            # torchdata's StatefulDataLoader does and Lightning expects (it counts that epoch as
            # done): the loaded one is run to its end, empty, so that its sampler's draws and its
            # workers' session stand as after a whole epoch, then the next begins.
            for _ in self._begin_epoch_asking_lengths_once():
                raise AssertionError("an epoch loaded as over handed out a batch")  # never: checked
            resume.move_loaded_epochs_on(self, point)
        return self._begin_epoch_asking_lengths_once()

    def _begin_epoch_asking_lengths_once(self) -> _EpochIterator:
        # The dataset's __len__, asked once for all that starting the epoch needs of it (the
        # last batch's size, the record, the stats, the draws made now): samplers/_epoch_lengths.py.
        with EpochLengths().active():
            try:
                return self._begin_epoch()
            except BaseException:
                # As after any failed epoch (slab_keeper.py): the error (a dataset's __len__
                # raising, say) may keep the loader, and with it the slabs, alive for long.
                self._slab_keeper.release()
                replica.release_boundary_slabs(self.dataset)
                raise

    def _begin_epoch(self) -> _EpochIterator:
        called_at = now()  # the epoch's first batch is timed from here: starting workers included
        point, self._resume_point, self._loaded_state = self._resume_point, None, None
        resume.set_generators_as_loaded(self._loaded_generators)
        self._loaded_generators = ()
        point = resume.unless_sampler_moved_on(self, point)
        self._settings_agree()
        self._count_failures_anew()
        self._warn_if_every_rank_loads_all()
        self._warn_if_graph_unsharded()
        record = resume.begin_epoch(self, point.record if point is not None else None)  # before any draw
        with resume.epoch_start_draws(point):
            tasks = iter(self._index_sampler)
            engine, owned, epoch_seed = self._engine_for_epoch(point, record)
            try:
                resume.record_sampler_state(self, record)  # its length: once the workers started
                if self._asks_users_sampler_twice(record):
                    # torch asks a user's sampler for an iteration before its workers start, and
                    # again once they have, and draws from the second: a batch sampler that
                    # shuffles as it is asked gives torch's order only so.
                    tasks = iter(self._index_sampler)
                tasks, start = resume.position_tasks(self, tasks, point)
                if self.num_workers == 0 and self._dataset_kind is DatasetKind.MAP and (
                        point is None or point.record is None):
                    tasks = resume.recorded_at_first_draw(self, record, tasks)
            except BaseException:
                engine.close()  # a state that cannot be resumed: no workers left behind
                raise
        try:
            engine.start_epoch(tasks, start=start, **epoch_seed)
        except BaseException:
            engine.close()
            raise
        count = self._stats.epoch_started(called_at) if self._stats is not None else EpochCount()
        progress = resume.progress_from(point, self._dataset_kind is DatasetKind.ITERABLE)
        self._epoch_notes = (record, progress)
        if owned:
            return _EpochIterator(self, engine, owned, progress, count)
        # torch resets and returns the one iterator of a persistent session each epoch: code
        # that kept it (`it = iter(loader)` once, `next(it)` in every epoch) reads the new epoch.
        iterator = self._iterator
        if iterator is not None and iterator._engine is engine and not iterator._owns_engine:
            iterator._start_next_epoch(self, progress, count)
        else:
            iterator = _EpochIterator(self, engine, owned, progress, count)
            self._persistent_epoch = weakref.ref(iterator)
        return iterator

    def _asks_users_sampler_twice(self, record: resume.EpochRecord) -> bool:
        """Whether this epoch starts workers anew over a user's index sampler (a batch sampler,
        or a sampler without batching), which torch's loader asks for two iterations."""
        return (self.num_workers > 0 and not record.later_in_session
                and self._dataset_kind is DatasetKind.MAP
                and not isinstance(self._index_sampler, StatefulSampler))

    def _count_failures_anew(self) -> None:
        """A new epoch for the failure board: made on the first, if the dataset has on_error
        pipes (their ``max_failures`` is then one budget for the whole loader's epoch)."""
        board = self._failure_board
        if not self._failures_checked:
            self._failures_checked = True
            board = skips.board_for(self.dataset, self._spawns_workers())
        elif board is not None and not board.shareable and self._spawns_workers():
            board = board.made_shareable()  # the start method changed since
            skips.bind(self.dataset, board, None)
        if board is not None and board is not self._failure_board:
            self._failure_board = board
            if self._stats is not None:
                self._stats.failures = board
        if board is not None:
            board.new_epoch()

    def _spawns_workers(self) -> bool:
        """Whether the workers are processes started without fork (spawn, forkserver)."""
        if self.num_workers == 0 or self.worker_type == "thread":
            return False
        context = self.multiprocessing_context or multiprocessing.get_context()
        return context.get_start_method() != "fork"

    def _engine_for_epoch(self, point: resume.ResumePoint | None, record: resume.EpochRecord) -> tuple[Any, bool, dict[str, int]]:
        """This epoch's engine (a new one, or the persistent session's), whether the epoch owns
        it, and the seed a persistent session's later epoch gives its DataPipe graphs."""
        epoch_seed: dict[str, int] = {}
        session = point.session if point is not None else None
        if not (self.persistent_workers and self.num_workers > 0):
            self._warn_if_too_many_workers()
            engine = _engine_choice.build_engine(self, point, session)
            record.base_seed, record.session_epoch = self._session
            record.later_in_session = session is not None
            return engine, True, epoch_seed
        if self._persistent_engine is None or self._persistent_engine.closed:
            interrupted, self._interrupted_session = getattr(self, "_interrupted_session", None), None
            if session is None and interrupted is not None and point is None:
                # Ctrl-C stopped the session's workers (none is left half alive); a caught one
                # goes on as torch's persistent workers do, with the session's base seed and no
                # new draw from the generators (which put the sampler's order, and the loop's
                # own draws, out of step with torch's from then on).
                session = (interrupted[0], interrupted[1] + 1)
            self._warn_if_too_many_workers()
            self._persistent_engine = _engine_choice.build_engine(self, point, session)
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

    def state_dict(self) -> dict[str, Any]:
        """A checkpoint of where this loader stands: small, JSON-serialisable, versioned.

        Taken after any batch, and loaded into a new DataLoader over the same dataset (in a new
        process, say), the new loader yields exactly the remaining batches of the epoch, then
        the following epochs, as this one would have. Random values drawn while building
        batches (augmentations) resume exactly too with ``worker_seeding="per_batch"``, in
        economic mode, and with ``num_workers=0``; with torch's seeding (the default) workers
        draw theirs afresh. Between ``load_state_dict()`` and the next ``iter()``, it is
        the state loaded.

        Raises:
            ValueError: ``in_order=False`` with workers and ``equal_batches="pad"`` across
                ranks: out of order, the batch a padding rank repeats cannot be told from the
                batches still to come (use ``in_order=True`` or ``equal_batches="drop"``).
        """
        resume.check_can_checkpoint(self)
        if self._loaded_state is not None:
            # Loaded and not yet resumed: the position is still the loaded one (what the notes
            # hold is an epoch the load replaced).
            return copy.deepcopy(self._loaded_state)
        record, progress = self._epoch_notes if self._epoch_notes is not None else (None, None)
        session = None
        if self._persistent_engine is not None and not self._persistent_engine.closed:
            session = (self._session[0], self._session[1] + 1)  # the session's next epoch
        return resume.build_state(self, record, progress, session)

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Continue from a ``state_dict()``: the next ``iter(loader)`` resumes that epoch.

        Persistent workers this loader already runs are stopped (the checkpoint's session takes
        their place). The whole state is checked first: a loader that refuses one is left as it
        was.

        Raises:
            IncompatibleStateError: the state comes from another configuration (dataset length,
                batch size, world size, ...: the message names each difference), another kind
                of state, or a newer version; or it is damaged: a field missing, mistyped, out
                of range or undecodable (named by its path, with the value received), or
                content that does not match its digest.
        """
        point = resume.read_state(self, state)
        if self._persistent_engine is not None:
            self._iterator = None  # type: ignore[assignment]
        self._epoch_notes = None
        self._resume_point = point
        self._loaded_state = copy.deepcopy(state)
        self._loaded_generators = resume.generators_as_loaded(self)

    def _warn_if_every_rank_loads_all(self) -> None:
        if self._warned_every_rank_loads_all or self._dataset_kind is not DatasetKind.MAP:
            return
        message = replication_warning(self.dataset, self.sampler, self.batch_sampler)
        if message is not None:
            self._warned_every_rank_loads_all = True
            warnings.warn(message, stacklevel=first_frame_outside_pipeload())

    def _warn_if_graph_unsharded(self) -> None:
        # Once per loader: walking a torch graph pickles it, data and all.
        if self._checked_graph_sharding:
            return
        self._checked_graph_sharding = True
        world_size = current_placement().world_size
        message = replica.unsharded_warning(self.dataset, max(self.num_workers, 1), world_size)
        if message is not None:
            warnings.warn(message, stacklevel=first_frame_outside_pipeload())

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


def _let_go_of_slabs(release: Callable[[], None]) -> None:
    """Free a loader's kept slabs once the workers of its finished epochs, reaped beside the
    training loop (``reap_in_background``), are gone: nothing of them (an exit handle, a
    mapping) outlives the call. They are idle and asked to stop: a few milliseconds at most.
    A Ctrl-C waits for the slabs to go (a loader dropped each epoch runs this in the loop)."""
    with ctrl_c_held():
        wait_for_reaped(REAPED_WITHIN_S)
        release()


def _equal_on_every_rank(index_sampler: Any) -> bool:
    """Whether ``index_sampler`` gives every rank as many batches by construction: a
    ``DistributedSampler`` (torch's, ours, a subclass: Lightning's), alone or batched, pads or
    drops to an equal share."""
    sampler = index_sampler
    if isinstance(sampler, (BatchSampler, torch_data.BatchSampler)):
        sampler = getattr(sampler, "sampler", None)
    return isinstance(sampler, torch_data.DistributedSampler)
