"""Which engine runs a loader's epochs, and how it is configured.

The loader decides *when* an engine is built (each epoch, or once for persistent workers) and
keeps the session's numbers; this module turns the loader's settings into the engine: inline,
a pool (or the pools ``num_workers="auto"`` swaps), economic mode, then the stages stacked on
it (dropping batches a resumed out-of-order epoch had handed out, pinning, the ranks'
agreement on equal batch counts). The draws it makes from the loader's generator follow
torch's order.
"""

from __future__ import annotations

import dataclasses

import warnings
import weakref
from collections.abc import Callable
from typing import Any

import torch

from pipeload._user_frame import first_frame_outside_pipeload
from pipeload.loader import _arguments as arguments
from pipeload import resume
from pipeload.distributed import check_ranks_can_agree, current_placement, unshared_seed_warning
from pipeload.errors import ArgumentAssertionError
from pipeload.engine import replica
from pipeload.engine.auto import AutoEngine
from pipeload.engine.economic import EconomicConfig, EconomicEngine
from pipeload.engine.equal_batches import EqualBatches
from pipeload.engine.inline import InlineEngine
from pipeload.engine.pin_stage import InlinePinning, ThreadedPinning
from pipeload.engine.plan import DatasetKind, EconomicSetup, FetchSpec, ReplicaSetup, WorkerSetup
from pipeload.engine.pool import PoolConfig, PoolEngine
from pipeload.pin import pinning_available
from pipeload.samplers import batch_sizes, draws_unseen_by_workers, sampler_runs_no_user_code
from pipeload.shared import warn_if_copy_on_read
from pipeload.stats.recorder import usable_cpus
from pipeload.stats.tuner import AutoTuner, Settings, memory_budget_bytes


# torch's own sentence for a timeout without workers, which ours starts with (it names torch's
# single-process iterator; none of torch's iterators runs here: tests/test_identity.py).
TORCH_TIMEOUT_WITHOUT_WORKERS = "_SingleProcess" "DataLoaderIter requires timeout == 0"


def build_engine(loader: Any, point: resume.ResumePoint | None = None,
                 session: tuple[int, int] | None = None) -> Any:
    """The engine for ``loader``'s next epoch (a new worker session), with its stages.

    ``point``: a loaded checkpoint the epoch resumes; ``session``: the (base seed, epoch) of a
    persistent session begun before that checkpoint.
    """
    # The draws and their order follow torch's: a DataPipe graph's shared seed, the base seed,
    # and, once workers have started, one more shared seed that torch draws and never uses.
    # A session resumed from a checkpoint has its base seed already: it draws the graph's
    # seed only, as the session's later epochs did.
    replica_setup = _replica_setup(loader)
    base_seed = draw_base_seed(loader.generator) if session is None else session[0]
    loader._session = (base_seed, 1 if session is None else session[1])
    pins = _pins(loader)
    if loader.timeout > 0 and loader.num_workers == 0:
        raise ArgumentAssertionError(TORCH_TIMEOUT_WITHOUT_WORKERS + " (pipeload: "
            f"timeout={loader.timeout!r} needs workers: set num_workers > 0 or timeout=0)"
        )
    if loader.equal_batches is not None:
        check_ranks_can_agree()
    spec = _fetch_spec(loader, point)
    if loader.num_workers == 0:
        engine: Any = InlineEngine(spec, replica_setup, loader._stats, base_seed, loader._session[1],
                                   _batch_sizes(loader))
    elif any(loader._auto) and loader.mode == "classic":
        engine = _auto_engine(loader, spec, base_seed, replica_setup, point is not None)
    elif loader.mode == "economic":
        if any(loader._auto):
            _auto_tuner(loader)  # records the starting settings, which economic mode keeps
        engine = EconomicEngine(_economic_config(loader, spec, base_seed, replica_setup, point is not None))
    else:
        engine = PoolEngine(_pool_config(loader, spec, base_seed, replica_setup, point is not None))
        if replica_setup.shared_seed is not None and session is None:
            replica.draw_shared_seed(loader.generator, share=False)
    if point is not None and point.handed_out_above:
        engine = resume.DropHandedOut(engine)  # below pinning and the ranks' agreement
    return _balance_ranks(loader, _maybe_pin(loader, engine, pins))

def _balance_ranks(loader: Any, engine: Any) -> Any:
    if loader.equal_batches is None or current_placement().world_size == 1:
        return engine
    return EqualBatches(engine, loader.equal_batches)

def _fetch_spec(loader: Any, point: resume.ResumePoint | None) -> FetchSpec:
    iterable = loader._dataset_kind is DatasetKind.ITERABLE
    streams = resume.resumed_streams(point)
    # The RFC's is_separate_process(): the loader places the process boundaries it asks for.
    worker_type = loader.worker_type if loader.num_workers else None
    dataset, placed = replica.separate_processes(loader.dataset, worker_type, loader.multiprocessing_context)
    if placed and loader._stats is not None:
        loader._stats.note_separate_processes(placed)
    return FetchSpec(
        dataset, loader._dataset_kind, loader._auto_collation, loader.collate_fn, loader.drop_last,
        per_batch_seeding=loader.worker_seeding == "per_batch" and loader.mode == "classic",
        stream_snapshot_every=resume.STREAM_SNAPSHOT_EVERY if iterable else 0,
        resume_streams=streams,
        failures=loader._failure_board,
    )

def _auto_engine(loader: Any, spec: FetchSpec, base_seed: int, replica_setup: ReplicaSetup,
                 resumed: bool) -> Any:
    """The engine for num_workers/prefetch_factor="auto" in classic mode: a pool the tuner
    may resize mid-epoch over a map-style dataset. An iterable dataset's replicas cannot be
    re-split mid-stream: it keeps its starting settings."""
    tuner = _auto_tuner(loader)
    config = _pool_config(loader, spec, base_seed, replica_setup, resumed)
    # A later epoch of a loader without persistent workers starts where the tuner stands.
    setup = dataclasses.replace(config.setup, num_workers=tuner.current.num_workers)
    config = dataclasses.replace(config, setup=setup, prefetch_factor=tuner.current.prefetch_factor)
    _show_settings(loader, tuner.current)
    return AutoEngine(PoolEngine(config), tuner, on_resize=_showing_settings_on(loader))


def _show_settings(loader: Any, settings: Settings) -> None:
    """The loader's ``num_workers`` and ``prefetch_factor`` read what the tuner runs now (what
    code written for torch sizes things by), as set by the tuner, not by the user: not checked
    as an assignment is, nor taken as one."""
    auto_workers, auto_prefetch = loader._auto
    if auto_workers:
        loader.__dict__["num_workers"] = settings.num_workers
    if auto_prefetch:
        loader.__dict__["prefetch_factor"] = settings.prefetch_factor


def _showing_settings_on(loader: Any) -> Callable[[Settings], None]:
    """``_show_settings`` for ``loader``, held weakly (the engine must not keep its loader alive)."""
    ref = weakref.ref(loader)

    def show(settings: Settings) -> None:
        alive = ref()
        if alive is not None:
            _show_settings(alive, settings)
    return show

def _auto_tuner(loader: Any) -> AutoTuner:
    """The loader's tuner, made once; it re-tunes only map-style datasets in classic mode."""
    if loader._tuner is None:
        adjustable = loader._dataset_kind is DatasetKind.MAP and loader.mode == "classic"
        start = Settings(loader.num_workers, loader.prefetch_factor)  # type: ignore[arg-type]
        budget = memory_budget_bytes(getattr(loader, "max_shm_bytes", None))
        loader._tuner = AutoTuner(loader._stats, usable_cpus(), loader._auto[0] and adjustable,
                                loader._auto[1] and adjustable, start, budget)
    return loader._tuner

def _replica_setup(loader: Any) -> ReplicaSetup:
    """Where this session's copies of the dataset sit among ranks, and their graph seed."""
    placement = current_placement()
    seed = None
    if replica.draws_shared_seed(loader.dataset):
        seed = replica.draw_shared_seed(loader.generator)
        _warn_if_ranks_shuffle_apart(loader)
    return ReplicaSetup(placement.rank, placement.world_size, seed)

def _warn_if_ranks_shuffle_apart(loader: Any) -> None:
    """Once a loader: its graph's shuffles may differ between ranks (see unshared_seed_warning).
    Checked once, as a torch graph is pickled to be walked."""
    if loader._checked_rank_seeds:
        return
    message = unshared_seed_warning(loader.generator)
    if message is None:
        return  # a process group may come later: looked at again next epoch
    loader._checked_rank_seeds = True
    if replica.has_random_pipes(loader.dataset):
        warnings.warn(message, stacklevel=first_frame_outside_pipeload())

def _worker_setup(loader: Any, spec: FetchSpec, base_seed: int, replica_setup: ReplicaSetup) -> WorkerSetup:
    warn_if_copy_on_read(loader.dataset, loader.worker_type)  # pytorch#13246: points at the fix
    method = "thread" if loader.worker_type == "thread" else "multiprocessing"
    return WorkerSetup(spec, loader.num_workers, base_seed, loader.worker_init_fn, method, replica_setup,
                       stats=loader._stats is not None, first_epoch=loader._session[1],
                       batch_sizes=_sizes_before_workers(loader))

def _sizes_before_workers(loader: Any) -> tuple[int, int | None] | None:
    """What the workers' setup says the batches hold: the last batch's number only where the
    sampler's length runs no user code (else the pool tells them once they have started)."""
    if loader._stats is None or loader._dataset_kind is not DatasetKind.MAP:
        return None
    sampler = loader._index_sampler
    return batch_sizes(sampler, loader._auto_collation, count_batches=sampler_runs_no_user_code(sampler))

def _batch_sizes(loader: Any) -> Any:
    """What the loader's batches hold, read afresh each epoch (``samplers.batch_sizes``; always
    None for iterable datasets and with stats off, where nothing uses it)."""
    if loader._stats is None or loader._dataset_kind is not DatasetKind.MAP:
        return lambda: None
    sampler, collating = loader._index_sampler, loader._auto_collation
    return lambda: batch_sizes(sampler, collating)

def _economic_config(loader: Any, spec: FetchSpec, base_seed: int, replica_setup: ReplicaSetup,
                     resumed: bool) -> EconomicConfig:
    setup = EconomicSetup(_worker_setup(loader, spec, base_seed, replica_setup), loader.num_batch_workers)  # type: ignore[arg-type]
    return EconomicConfig(setup=setup, stop_when_done=not loader.persistent_workers,
                          forks_as_tasks_go=_forks_as_tasks_go(loader, resumed), **_engine_settings(loader))

def _pool_config(loader: Any, spec: FetchSpec, base_seed: int, replica_setup: ReplicaSetup,
                 resumed: bool) -> PoolConfig:
    return PoolConfig(setup=_worker_setup(loader, spec, base_seed, replica_setup),
                      batch_sizes=_batch_sizes(loader), stop_when_done=not loader.persistent_workers,
                      forks_as_tasks_go=_forks_as_tasks_go(loader, resumed), **_engine_settings(loader))

def _forks_as_tasks_go(loader: Any, resumed: bool) -> bool:
    # A resumed epoch's first draws replay under a borrowed global generator: forks before them.
    return (not resumed and loader._dataset_kind is DatasetKind.MAP
            and draws_unseen_by_workers(loader._index_sampler))

def _engine_settings(loader: Any) -> dict[str, Any]:
    """What both worker engines (classic and economic) take from the loader alike."""
    return {
        "prefetch_factor": loader.prefetch_factor,
        "in_order": loader.in_order,
        "timeout_s": loader.timeout,
        "worker_type": loader.worker_type,
        "mp_context": loader.multiprocessing_context,
        "stats": loader._stats,
        "max_shm_bytes": loader.max_shm_bytes,
        "pin_slabs": loader.pin_memory and pinning_available(),  # page-locked in place: no copy
        "numbered": _numbers_batches(loader),
        "slab_keeper": loader._slab_keeper,  # its slabs outlive each set of workers
    }

def _numbers_batches(loader: Any) -> bool:
    # Out of order, a map-style epoch's batches say their numbers, so that a checkpoint can
    # record which were handed out (iterable replicas record their own positions).
    return not loader.in_order and loader._dataset_kind is DatasetKind.MAP

def _pins(loader: Any) -> bool:
    """Whether the epoch's batches are pinned; says why not, or what is ignored, as torch's
    iterator does before anything else can fail (a timeout without workers, say)."""
    if not loader.pin_memory:
        return False
    if loader.pin_memory_device:
        warnings.warn(
            "pin_memory_device is deprecated, the current accelerator will be used as the "
            f"device,ignore pin_memory_device='{loader.pin_memory_device}'. (pipeload: batches "
            "are pinned for the current accelerator.)",
            stacklevel=first_frame_outside_pipeload(),
        )
    if not pinning_available():
        warnings.warn(
            "'pin_memory' argument is set as true but no accelerator is found, then device "
            "pinned memory won't be used. (pipeload: batches are handed out in ordinary "
            "memory.)",
            stacklevel=first_frame_outside_pipeload(),
        )
        return False
    return True


def _maybe_pin(loader: Any, engine: Any, pins: bool) -> Any:
    if not pins:
        return engine
    if loader.num_workers == 0:
        return InlinePinning(engine, None, loader._stats)
    return ThreadedPinning(engine, None, loader._stats)


def draw_base_seed(generator: torch.Generator | None) -> int:
    # One int64 from the loader's generator (or the global RNG) per worker session, as torch
    # draws it, so the global random stream stays in step with torch's.
    return int(torch.empty((), dtype=torch.int64).random_(generator=generator).item())
