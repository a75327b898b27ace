"""The loader's checkpoint: building it from what the loader noted, and reading it back.

The state is plain JSON (ints, strings, lists, dicts), versioned, and holds no sample: the
generator states an epoch began with (as base64 text), counts, and for iterable datasets each
replica's own ``state_dict()``. Its ``config`` says what it was taken from; a loader whose
dataset length, batch size, world size, ... differ refuses it, naming each difference.
"""

from __future__ import annotations

import copy
import hashlib
import warnings
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch
import torch.utils.data as torch_data

from pipeload._optional import optional_attribute
from pipeload._rng_state import encode_state
from pipeload._state_digest import DIGEST_FIELD, check_digest, sealed
from pipeload._state_fields import is_int
from pipeload._user_frame import first_frame_outside_pipeload
from pipeload.datapipes import graph
from pipeload.datapipes.base import IterDataPipe, is_iter_datapipe
from pipeload.datapipes.iter.sharding import ShardingFilter
from pipeload.distributed import current_placement, splits_by_rank
from pipeload.engine import replica
from pipeload.engine.fetch import StreamPosition
from pipeload.errors import bad_state_field, state_mismatch
from pipeload.resume.checked import FORMAT, VERSION, CheckedEpoch, CheckedState, check_content, read_fields
from pipeload.resume.epoch import EpochProgress, EpochRecord, RepeatFrom, fresh_sampler_state
from pipeload.resume.faithful import written
from pipeload.resume.trial import try_replica_states
from pipeload.samplers import StatefulSampler, exact_length
from pipeload.samplers._own_generators import (
    epoch_holders,
    keeps_a_shape,
    own_generators,
    read_generators_state,
    set_generators,
)
from pipeload.samplers._state import load_users_state



@dataclass(frozen=True)
class ResumePoint:
    """What the next ``iter(loader)`` does with a loaded state.

    Attributes:
        record: mid-epoch: how the interrupted epoch began (it is begun again from it); None to
            start the next epoch afresh.
        consumed: mid-epoch: batches already handed out (skipped, never loaded again for
            map-style datasets).
        streams: iterable datasets: each replica's position and latest snapshot (a replica
            without one starts over and drops the batches it had made).
        session: persistent workers: (base seed, epoch number) of the epoch to run, when it
            belongs to a session begun before the checkpoint.
        sampler_started: mid-epoch: the sampler had been asked for its first task before the
            checkpoint (so its draws from the global generator are part of the replay).
        last_worker: iterable datasets: the worker of the latest batch handed out (None before
            the first).
        padded: ``equal_batches="pad"``: the repeats of its last batch this rank had handed out.
        repeat_from: ``equal_batches="pad"`` across ranks: the engine resumes from here, before
            the rank's latest good batch, which the equal-batches stage makes again to repeat.
    """

    record: EpochRecord | None
    consumed: int = 0
    streams: dict[int, StreamPosition] | None = None
    session: tuple[int, int] | None = None
    sampler_started: bool = True
    last_worker: int | None = None
    padded: int = 0
    repeat_from: RepeatFrom | None = None
    handed_out_above: frozenset[int] = frozenset()

    def engine_view(self) -> tuple[int, dict[int, StreamPosition], int | None, int]:
        """(batches to skip, replica positions, worker of the batch before, batches the engine
        makes again without handing them out) where the engine resumes."""
        if self.repeat_from is None:
            return self.consumed, dict(self.streams or {}), self.last_worker, 0
        before = self.repeat_from
        return before.consumed, dict(before.streams), before.last_worker, self.consumed - before.consumed


def config_of(loader: Any) -> dict[str, Any]:
    """What a state must agree with to be loaded: the loader's shape, not its speed settings."""
    placement = current_placement()
    config = {
        "dataset_kind": loader._dataset_kind.label,
        "dataset_length": _unsharded_length(loader.dataset),
        "batch_size": loader.batch_size,
        "drop_last": loader.drop_last,
        "world_size": placement.world_size,
        "rank": placement.rank,
    }
    if loader._dataset_kind.label == "iterable":
        config["num_workers"] = loader.num_workers  # each replica's position is its own shard's
        shape = graph_shape(loader.dataset)
        if shape is not None:
            config["graph"] = shape
    return config


def graph_shape(dataset: Any) -> str | None:
    """A digest of the DataPipe graph's shape: each pipe's class and which pipes it reads from
    (a pipe reached twice, a fork's source, is named once and then referred to), not the data
    nor the functions. None for a dataset that is not an iterable pipe, or a graph that cannot
    be walked.

    A replica with a stage that keeps no checkpoint (fork, demux, zip, ...) is resumed by making
    its batches again: its state is a count, which a graph of another shape took silently and
    skipped that many of its own batches. The pipes' own states refuse another graph; this
    refuses it when there are none.
    """
    if not is_iter_datapipe(dataset):
        return None
    try:
        text = _shape_text(dataset, {})
    except Exception:  # noqa: BLE001 - a graph that cannot be walked is not compared
        return None
    return "sha256:" + hashlib.sha256(text.encode()).hexdigest()


def _shape_text(pipe: Any, seen: dict[int, int]) -> str:
    if id(pipe) in seen:
        return f"@{seen[id(pipe)]}"  # shared (a fork's source), or a pipe that refers to itself
    seen[id(pipe)] = len(seen)
    parents = ",".join(_shape_text(parent, seen) for parent in graph.parents_of(pipe))
    return f"{type(pipe).__qualname__}({parents})"


def _unsharded_length(dataset: Any) -> int | None:
    """The dataset's length as the user built it (None: it has none). Without workers, the loader
    shards a pipe graph in place, in the main process (as torch's does): its length then is this
    rank's share, which a fresh loader over the same graph, not yet sharded, would never match."""
    try:
        if not any(getattr(pipe, "groups", None) for pipe in _sharding_filters(dataset)):
            return len(dataset)
        copy = graph.copy_graph(dataset)
        for pipe in _sharding_filters(copy):
            pipe.groups, pipe.num_of_instances, pipe.instance_id = {}, 1, 0
        return len(copy)
    except TypeError:
        return None


def _sharding_filters(dataset: Any) -> list[Any]:
    if not isinstance(dataset, IterDataPipe):
        return []
    return [pipe for pipe in graph.list_dps(dataset) if isinstance(pipe, ShardingFilter)]


def build_state(loader: Any, record: EpochRecord | None, progress: EpochProgress | None,
                session: tuple[int, int] | None) -> dict[str, Any]:
    """The JSON-serialisable checkpoint of ``loader`` now."""
    _warn_if_a_map_datasets_state_is_left_out(loader)
    state: dict[str, Any] = {"format": FORMAT, "version": VERSION, "config": config_of(loader),
                             "worker_seeding": loader.worker_seeding, "mode": loader.mode,
                             "persistent_workers": _runs_a_session(loader)}
    if record is not None and progress is not None and not progress.ended:
        state["epoch"] = _epoch_state(record, progress, _pads_across_ranks(loader))
        # Engines with workers ask the sampler for tasks as the epoch starts; without workers
        # the first task is asked for with the first batch. A sampler drawing from the global
        # generator has drawn already, or will draw after the checkpoint: the replay must agree.
        # A resumed epoch that replayed the draw has made it, whatever its engine.
        state["epoch"]["sampler_started"] = (progress.sampler_started or progress.consumed > 0
                                             or progress.padded > 0 or loader.num_workers > 0)
        return sealed(state)
    generator = loader.generator
    state["next"] = {
        "generator": encode_state(generator.get_state()) if generator is not None else None,
        "sampler": fresh_sampler_state(loader._index_sampler) if loader._dataset_kind.label == "map" else None,
        "session": list(session) if session is not None else None,
    }
    return sealed(state)


def check_can_checkpoint(loader: Any) -> None:
    """Refuse the one configuration whose place cannot be written down.

    Raises:
        ValueError: ``in_order=False`` with workers and ``equal_batches="pad"`` across ranks.
    """
    if loader.in_order or loader.num_workers == 0 or not _pads_across_ranks(loader):
        return
    raise ValueError(
        "state_dict() cannot checkpoint equal_batches='pad' with in_order=False and "
        f"num_workers={loader.num_workers}: a rank that pads repeats its latest batch, which a "
        "resumed rank must make again before anything else, but out of order the engine hands "
        "out whichever batch finishes first, so the batch to repeat cannot be told from the "
        "batches still to come. Use in_order=True (the default) or equal_batches='drop'"
    )


def _pads_across_ranks(loader: Any) -> bool:
    return loader.equal_batches == "pad" and current_placement().world_size > 1


def _position_state(position: StreamPosition) -> dict[str, Any]:
    # A replica's state may hold samples: tuples and int keys kept through JSON (faithful.py).
    snapshot = [position.snapshot[0], written(position.snapshot[1])] if position.snapshot is not None else None
    return {"batches": position.batches, "snapshot": snapshot, "failed": list(position.failed)}


def _streams_state(streams: dict[int, StreamPosition]) -> dict[str, Any]:
    return {str(w): _position_state(p) for w, p in streams.items()}


def _epoch_state(record: EpochRecord, progress: EpochProgress, pads: bool) -> dict[str, Any]:
    streams = _streams_state(progress.streams)
    repeat = progress.repeat_from if pads else None
    return {
        "global_rng": encode_state(record.global_rng),
        "generator": encode_state(record.generator) if record.generator is not None else None,
        "sampler": record.sampler,
        "base_seed": record.base_seed,
        "session_epoch": record.session_epoch,
        "later_in_session": record.later_in_session,
        "consumed": progress.consumed,
        "streams": streams,
        "last_worker": progress.last_worker,
        "padded": progress.padded,
        "handed_out_above": sorted(progress.handed_out_above),
        "repeat_from": None if repeat is None else {
            "consumed": repeat.consumed, "last_worker": repeat.last_worker,
            "streams": _streams_state(repeat.streams)},
    }


def read_state(loader: Any, state: Any) -> ResumePoint:
    """Check ``state`` whole against ``loader``, then set the generators it names, and say how
    to resume. Nothing is set unless every check passes: a loader that refuses a state (and its
    generator and sampler) is left as it was.

    Raises:
        IncompatibleStateError: not a loader state, a newer version, another configuration, or
            a damaged state (a field named by its path, or content that does not match its
            digest).
    """
    state = _as_this_ranks(loader, state)
    checked = read_fields(state)
    _check_config(loader, checked.config)
    _check_seeding(loader, state["worker_seeding"])  # read_fields checked it is one of the choices
    _warn_if_the_mode_draws_otherwise(loader, state["mode"])
    _warn_if_persistence_draws_otherwise(loader, checked.persistent)
    _check_generator(loader, checked.saved_generator is not None)
    _check_sampler(loader, checked.sampler, checked.sampler_path)
    if checked.epoch is not None:
        _check_epoch_fits(loader, checked.epoch)
    check_content(state, checked)
    if checked.epoch is not None:
        # The pipes' own loads check each replica's state against this loader's graph: a digest
        # says the state is what some graph wrote, not that this one takes it (a shuffle buffer
        # of another size loaded, and failed only at the first batch, in a worker).
        try_replica_states(loader, checked.epoch.streams)
    _set_generators(loader, checked)
    if checked.epoch is not None:
        point = _mid_epoch(checked.epoch)
        _warn_if_replicas_start_over(loader, checked.epoch.streams)
    else:
        session = checked.next.session if loader.persistent_workers else None  # type: ignore[union-attr]
        point = ResumePoint(None, session=session)
    if loader._dataset_kind.label == "map":
        _warn_if_sampler_cannot_resume(loader, checked.sampler)
    _warn_if_the_generator_is_the_global_one(loader)
    return point


def _as_this_ranks(loader: Any, state: Any) -> Any:
    """``state``, or, when it is another rank's state of this map-style loader (only the rank
    differs, the world size agrees), the same state for this rank.

    Lightning saves its checkpoint on rank 0 and loads rank 0's loader state on every rank. A
    map-style loader's position is a count of batches, the same on every rank in step (a
    ``DistributedSampler`` gives each rank as many), and its order comes from the seed, the epoch
    and its own rank: this rank goes on in its own order from the same count. Only an intact
    state is taken so (its digest is checked first); under a sampler not split by rank, the
    warning says that this rank goes on in the saving rank's order. An iterable dataset's
    positions belong to the rank that wrote them, and another rank's state is refused, naming the
    rank."""
    if loader._dataset_kind.label != "map" or not isinstance(state, dict):
        return state
    saved, here = state.get("config"), config_of(loader)
    if not isinstance(saved, dict) or DIGEST_FIELD not in state:
        return state  # a state without a digest (version 1) is checked field by field, as it is
    rank = saved.get("rank")
    if rank == here["rank"] or not (is_int(rank) and 0 <= rank < here["world_size"]):
        return state
    if any(saved.get(key) != here.get(key) for key in here.keys() | saved.keys() if key != "rank"):
        return state  # refused by name, as any other configuration
    _check_every_digest(state)  # before _with_rank seals them again: damage inside stays refused
    warnings.warn(
        f"this state was saved on rank {saved.get('rank')!r} and is loaded on rank {here['rank']}: "
        "its position (the batches handed out) is taken as this rank's, which holds when the ranks "
        "go in step (Lightning saves rank 0's loader state for every rank); "
        f"{_whose_order(loader, rank)} The random values drawn for the rest of this epoch (the workers' base "
        f"seed, per-batch seeds) come from the generators rank {saved.get('rank')!r} recorded as the "
        "epoch began: they are this rank's uninterrupted ones only where every rank seeded torch's "
        "global generator (or the loader's generator) alike",
        stacklevel=first_frame_outside_pipeload(),
    )
    return _with_rank(copy.deepcopy(state), here["rank"])


def _whose_order(loader: Any, rank: int) -> str:
    """Which order a rank that loaded rank ``rank``'s state goes on in."""
    if splits_by_rank(loader.batch_sampler, loader.sampler):
        return "this rank goes on in its own order (its sampler splits the data by rank)."
    # Not split by rank (each rank shuffling a copy of its own): the sampler's state, a generator
    # as the epoch began, is the saving rank's order. Refused, it would also refuse the ranks
    # that seed alike, where that order is this rank's own and the resume exact.
    return (f"its sampler ({type(loader.sampler).__name__}) is not split by rank, so this rank goes on "
            f"in rank {rank}'s order, kept in the state: its own only where every rank seeded alike; "
            "with ranks seeded apart, the rest of this epoch repeats some of this rank's samples and "
            "leaves others out (load the state this rank saved instead).")


def _check_every_digest(state: Any, path: str = "") -> None:
    """Check the digest of ``state`` and of every part of it that has one (a sampler's state
    inside), innermost first, each named by its path."""
    if isinstance(state, dict):
        for key, value in state.items():
            _check_every_digest(value, f"{path}.{key}" if path else str(key))
        if DIGEST_FIELD in state:
            check_digest(state, path)
    elif isinstance(state, list):
        for index, item in enumerate(state):
            _check_every_digest(item, f"{path}.{index}")


def _with_rank(state: Any, rank: int) -> Any:
    """``state`` (a copy) with every ``config.rank`` in it set to ``rank``, and every digest
    sealed again, innermost first (a batch sampler's covers its sampler's state)."""
    if isinstance(state, dict):
        for key, value in state.items():
            if key != "config":
                state[key] = _with_rank(value, rank)
        config = state.get("config")
        if isinstance(config, dict) and "rank" in config:
            config["rank"] = rank
        if DIGEST_FIELD in state:
            sealed(state)
    elif isinstance(state, list):
        return [_with_rank(item, rank) for item in state]
    return state


def _warn_if_the_generator_is_the_global_one(loader: Any) -> None:
    """``generator=torch.default_generator``: the state sets the loader's generator back to where
    it stood, and that is the global one, which the user's checkpoint restores too (and the
    training loop draws from): one of the two settings is lost, so the resumed batches or the
    loop's draws differ from the run's."""
    if loader.generator is not torch.default_generator:
        return
    warnings.warn(
        "this loader's generator is torch.default_generator, the global generator: a resumed "
        "epoch cannot give both it and the loader their states back, so its batches (or your "
        "loop's torch draws) may differ from the run it was saved from. Give the loader a "
        "torch.Generator() of its own.",
        stacklevel=first_frame_outside_pipeload(),
    )


def _check_config(loader: Any, saved: dict[str, Any]) -> None:
    here = config_of(loader)
    if "graph" not in saved:
        here.pop("graph", None)  # a state written before the graph's shape was kept
    differences = {k: (saved.get(k), here.get(k)) for k in here.keys() | saved.keys()
                   if saved.get(k) != here.get(k)}
    if differences:
        raise state_mismatch("this DataLoader", dict(sorted(differences.items())))


def _check_seeding(loader: Any, saved: str) -> None:
    """How the workers' generators are seeded decides every random value a sample draws: a
    state seeded one way, resumed the other, gave the same indices and other augmentations,
    silently (the speed settings may change; this is not one)."""
    if saved != loader.worker_seeding:
        raise state_mismatch("this DataLoader", {"worker_seeding": (saved, loader.worker_seeding)})


def _runs_a_session(loader: Any) -> bool:
    """Whether the loader's workers outlive an epoch (persistent, and there are workers)."""
    return bool(loader.persistent_workers) and loader.num_workers > 0


def _warn_if_persistence_draws_otherwise(loader: Any, saved: bool | None) -> None:
    """A loader with persistent workers draws its session's base seed once; one without draws
    one from its generator every epoch, as torch's do. Resumed the other way, the loaded epoch's
    rest goes on as saved, but every later epoch draws otherwise, and a shuffle drawing from the
    same generator (the global one, by default) shuffles otherwise: said, not refused (stop 53's
    resume skeptic found it silent). ``saved`` None: a state from before the field."""
    if saved is None or saved == _runs_a_session(loader):
        return
    had, has = ("with", "without") if saved else ("without", "with")
    warnings.warn(
        f"this state was saved by a loader {had} persistent workers and is resumed by one {has} "
        "them: the rest of the loaded epoch goes on as saved, but from the next epoch on the "
        "loader draws from its generator otherwise (a persistent session draws its workers' base "
        "seed once, other loaders once an epoch), so the order a shuffle draws from that "
        "generator and the random values drawn while building batches (augmentations) differ "
        "from the run's. Resume with the persistent_workers and num_workers the state was saved "
        "with to go on as the run would have.",
        stacklevel=first_frame_outside_pipeload(),
    )


def _warn_if_the_mode_draws_otherwise(loader: Any, saved: str) -> None:
    """Another ``mode`` may resume a state (its samples and their order are the same), but
    economic mode seeds each item from its position, classic mode each worker: the random values
    drawn while building batches differ from the run's from the first resumed batch on. Said,
    not refused: stop 53's resume skeptic found it silent."""
    if saved != loader.mode:
        warnings.warn(
            f"this state was saved with mode={saved!r} and is resumed with mode={loader.mode!r}: "
            "the samples and their order go on as saved, but the random values drawn while "
            "building batches (augmentations) differ from the run's, as the two modes seed "
            "their workers differently. Resume with the mode the state was saved with to draw "
            "the same values.",
            stacklevel=first_frame_outside_pipeload(),
        )


def _check_generator(loader: Any, saved: bool) -> None:
    """The order and base seeds come from the loader's generator, or else from torch's global
    one: a state drawn from the one cannot go on from the other."""
    named = {True: "a torch.Generator", False: None}
    if saved != (loader.generator is not None):
        raise state_mismatch("this DataLoader", {"generator": (named[saved], named[loader.generator is not None])})


def _check_sampler(loader: Any, saved: Any, path: str) -> None:
    """The index sampler's state: None when it keeps none; ours there, and checked whole."""
    sampler = loader._index_sampler
    keeps_one = loader._dataset_kind.label == "map" and callable(optional_attribute(sampler, "state_dict"))
    name = type(sampler).__name__
    if loader._dataset_kind.label == "map" and keeps_a_shape(sampler):
        if saved is not None:  # None: written before these states were kept (it resumes as then)
            read_generators_state(sampler, saved, path)
        return
    if not keeps_one:
        if saved is not None:
            why = "an iterable dataset has no sampler" if loader._dataset_kind.label != "map" else f"this loader's {name} has no state_dict()"
            raise bad_state_field(path, saved, f"None ({why})")
        return
    if isinstance(sampler, StatefulSampler):  # a user's may say None: its state is its own
        if saved is None:
            raise bad_state_field(path, saved, f"the state of this loader's {name}")
        sampler.check_state_dict(saved, path)


def _check_epoch_fits(loader: Any, epoch: CheckedEpoch) -> None:
    """Map-style: the batches handed out are batches of this epoch (a count past its end would
    resume past the end, silently losing the rest)."""
    if loader._dataset_kind.label != "map":
        return
    total = exact_length(loader._index_sampler)
    if total is None:
        return  # a sampler that cannot say: replaying it tells (replay.py refuses one that runs out)
    if epoch.consumed > total:
        raise bad_state_field("epoch.consumed", epoch.consumed, f"an int from 0 to {total} (the batches of an epoch)")
    if epoch.handed_out_above and max(epoch.handed_out_above) >= total:
        raise bad_state_field("epoch.handed_out_above", sorted(epoch.handed_out_above),
                              f"batch numbers below {total} (the batches of an epoch)")


def _set_generators(loader: Any, checked: CheckedState) -> None:
    """Set the loader's generator, then its sampler; a user's sampler refusing its state (the
    one part only its own code can check) leaves the generator as it was."""
    generator = loader.generator
    before = generator.get_state() if generator is not None else None
    if generator is not None and checked.saved_generator is not None:
        generator.set_state(checked.saved_generator)
    try:
        _load_sampler(loader, checked.sampler, checked.sampler_path)
    except BaseException:
        if before is not None:
            generator.set_state(before)
        raise


def generators_as_loaded(loader: Any) -> tuple[tuple[torch.Generator, torch.Tensor], ...]:
    """The generators a loaded state sets (the loader's, and its sampler's), each with the state
    it holds now, just after the load: the next ``iter()`` sets them so again
    (:func:`set_generators_as_loaded`), so that draws made in between, by an iterator made before
    the load and advanced after it, do not shift the resumed stream. torchdata's loader applies a
    loaded state at the next ``iter()`` likewise."""
    generators = [loader.generator]
    sampler = loader._index_sampler
    if keeps_a_shape(sampler):
        generators.extend(own_generators(sampler).values())
    for holder in (sampler, getattr(sampler, "sampler", None)):
        generators.append(getattr(holder, "generator", None))
    # Never the global generator: the loop draws from it too (a model's initialisation, the
    # user's own torch.set_rng_state after the load), and its state resumes from the user's own
    # checkpoint, not the loader's.
    unique = {id(g): g for g in generators
              if isinstance(g, torch.Generator) and g is not torch.default_generator}
    return tuple((generator, generator.get_state()) for generator in unique.values())


def set_generators_as_loaded(loaded: tuple[tuple[torch.Generator, torch.Tensor], ...]) -> None:
    """Set each generator back to the state a load left it in (see :func:`generators_as_loaded`)."""
    for generator, state in loaded:
        generator.set_state(state)


def _load_sampler(loader: Any, saved: Any, path: str) -> None:
    if saved is None:
        return
    sampler = loader._index_sampler
    if isinstance(sampler, StatefulSampler):
        sampler._load_state_at(saved, path)
    elif keeps_a_shape(sampler):
        set_generators(sampler, read_generators_state(sampler, saved, path))
    else:
        load_users_state(sampler, saved, path)


def _mid_epoch(epoch: CheckedEpoch) -> ResumePoint:
    record = epoch.record
    session = (record.base_seed, record.session_epoch) if record.later_in_session else None
    return ResumePoint(record, epoch.consumed, dict(epoch.streams), session, epoch.sampler_started,
                       epoch.last_worker, epoch.padded, epoch.repeat_from, epoch.handed_out_above)


def _warn_if_replicas_start_over(loader: Any, positions: dict[int, StreamPosition]) -> None:
    again = sum(p.batches for p in positions.values() if p.snapshot is not None and p.snapshot[1] is None)
    if again:
        warnings.warn(
            f"{_stage_without_state(loader)}, so resuming reads the {again} batches already handed "
            "out this epoch again and drops them. Give it state_dict()/load_state_dict() to resume "
            "without re-reading.",
            stacklevel=first_frame_outside_pipeload(),  # the caller of load_state_dict
        )


def _warn_if_a_map_datasets_state_is_left_out(loader: Any) -> None:
    """A map-style dataset with a ``state_dict()`` of its own (an RNG it keeps for its
    transforms, say) is not in the checkpoint: its copies live in the workers, one per worker,
    and resuming rebuilds the batches from the sampler's keys alone. torchdata's
    StatefulDataLoader keeps each worker's; said once per loader rather than left out silently."""
    dataset = loader.dataset
    if (loader._dataset_kind.label != "map" or not callable(optional_attribute(dataset, "state_dict"))
            or getattr(loader, "_warned_dataset_state", False)):
        return
    loader._warned_dataset_state = True
    warnings.warn(
        f"{type(dataset).__name__} has a state_dict() of its own, which this checkpoint does not "
        "keep: pipeload resumes a map-style dataset from the sampler's keys alone (torchdata's "
        "StatefulDataLoader keeps each worker's copy). Keep what it holds with your own checkpoint, "
        "or draw its random values from the generators pipeload seeds (worker_seeding='per_batch')",
        stacklevel=first_frame_outside_pipeload(),  # the caller of state_dict
    )


def _warn_if_sampler_cannot_resume(loader: Any, saved: Any) -> None:
    """A sampler of the user's own without state_dict() is iterated again from its start: right
    if it draws nothing, or draws from torch's global generator as its iteration starts, or if
    the state holds the states of the generators it draws from itself (``saved``: the index
    sampler's state)."""
    kept = _generators_kept(loader._index_sampler, saved)
    for sampler in (loader.batch_sampler, loader.sampler):
        if (sampler is None or isinstance(sampler, Sequence) or callable(optional_attribute(sampler, "state_dict"))
                or any(sampler is k for k in kept)):
            continue
        warnings.warn(
            f"{type(sampler).__name__} has no state_dict(): resuming iterates it again from its "
            "start and skips the batches already handed out. That gives the same keys only if it "
            "draws no random numbers, or draws them from torch's global generator when its "
            f"iteration starts; give it state_dict()/load_state_dict() otherwise.{_ours_instead(sampler)}",
            stacklevel=first_frame_outside_pipeload(),  # the caller of load_state_dict
        )
        return


def _generators_kept(index_sampler: Any, saved: Any) -> list[Any]:
    """The samplers whose draws ``saved`` holds: the index sampler's, or the sampler's inside
    our BatchSampler (none in a state written before they were kept)."""
    if _draws_kept(index_sampler, saved):
        return [index_sampler]
    inner = optional_attribute(index_sampler, "sampler")
    if isinstance(index_sampler, StatefulSampler) and isinstance(saved, dict) and _draws_kept(inner, saved.get("sampler")):
        return [inner]
    return []


def _draws_kept(sampler: Any, saved: Any) -> bool:
    """Whether ``saved`` (``sampler``'s generators state) holds what decides its order: its own
    generators' states, or the epoch of torch's ``DistributedSampler`` itself (its order is its
    seed, its rank and its epoch; a subclass, Lightning's ``DistributedSamplerWrapper`` around a
    sampler with a generator of its own, or a user's sampler with an epoch may draw from more)."""
    if sampler is None or not isinstance(saved, dict):
        return False
    if own_generators(sampler):
        return True
    holders = epoch_holders(sampler).values()
    return (isinstance(saved.get("epochs"), dict) and bool(holders)
            and all(type(holder) is torch_data.DistributedSampler for holder in holders))


def _ours_instead(sampler: Any) -> str:
    """torch's own samplers, which keep no state: ours of the same name take the same arguments,
    draw the same numbers and keep one (no warning, and a user's subclass of ours keeps it too)."""
    from pipeload import samplers  # the package: the names it exports

    theirs = [s for s in (sampler, optional_attribute(sampler, "sampler"))
              if type(s).__module__.startswith("torch.utils.data") and type(s).__name__ in samplers.__all__]
    if not theirs:
        return ""
    names = " and ".join(f"pipeload.{type(s).__name__}" for s in theirs)
    if len(theirs) == 1:
        return (f" {names} takes the same arguments as torch's, draws the same numbers and keeps "
                "a state_dict(): use it to resume exactly.")
    return (f" {names} take the same arguments as torch's, draw the same numbers and keep a "
            "state_dict(): use them to resume exactly.")


def _stage_without_state(loader: Any) -> str:
    """The stage a resume warning names: a queue boundary of a kind that keeps no checkpoint in
    the dataset's graph, else the dataset itself (a pipe: one of its stages keeps no state)."""
    boundaries = replica.stages_without_checkpoint(loader.dataset)
    if boundaries:
        return (f"{' and '.join(boundaries)} cannot say where it stands (a queue boundary of that "
                "kind keeps no checkpoint)")
    return (f"{type(loader.dataset).__name__} cannot say where it stands (no state_dict() on it or on "
            "its iterator, or on a stage of its graph: fork, demux, zip, mux, groupby and in-memory "
            "caches keep none yet, nor does a plain iterator or generator inside)")
