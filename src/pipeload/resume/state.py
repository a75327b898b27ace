"""The loader's checkpoint: building it from what the loader noted, and reading it back.

The state is plain JSON (ints, strings, lists, dicts), versioned, and holds no sample: the
generator states an epoch began with (as base64 text), counts, and for iterable datasets each
replica's own ``state_dict()``. Its ``config`` says what it was taken from; a loader whose
dataset length, batch size, world size, ... differ refuses it, naming each difference.
"""

from __future__ import annotations

import warnings
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from pipeload._rng_state import decode_state, encode_state
from pipeload.distributed import current_placement
from pipeload.engine.fetch import StreamPosition
from pipeload.errors import IncompatibleStateError, state_mismatch
from pipeload.resume.epoch import EpochProgress, EpochRecord, fresh_sampler_state

FORMAT = "pipeload.DataLoader"
VERSION = 1


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
        next_worker: iterable datasets: whose batch comes next, round-robin.
        session: persistent workers: (base seed, epoch number) of the epoch to run, when it
            belongs to a session begun before the checkpoint.
        sampler_started: mid-epoch: the sampler had been asked for its first task before the
            checkpoint (so its draws from the global generator are part of the replay).
    """

    record: EpochRecord | None
    consumed: int = 0
    streams: dict[int, StreamPosition] | None = None
    next_worker: int = 0
    session: tuple[int, int] | None = None
    sampler_started: bool = True


def config_of(loader: Any) -> dict[str, Any]:
    """What a state must agree with to be loaded: the loader's shape, not its speed settings."""
    placement = current_placement()
    try:
        length = len(loader.dataset)
    except TypeError:
        length = None
    config = {
        "dataset_kind": loader._dataset_kind.value,
        "dataset_length": length,
        "batch_size": loader.batch_size,
        "drop_last": loader.drop_last,
        "world_size": placement.world_size,
        "rank": placement.rank,
    }
    if loader._dataset_kind.value == "iterable":
        config["num_workers"] = loader.num_workers  # each replica's position is its own shard's
    return config


def build_state(loader: Any, record: EpochRecord | None, progress: EpochProgress | None,
                session: tuple[int, int] | None) -> dict[str, Any]:
    """The JSON-serialisable checkpoint of ``loader`` now."""
    state: dict[str, Any] = {"format": FORMAT, "version": VERSION, "config": config_of(loader),
                             "worker_seeding": loader.worker_seeding, "mode": loader.mode}
    if record is not None and progress is not None and not progress.ended:
        state["epoch"] = _epoch_state(record, progress)
        # Engines with workers ask the sampler for tasks as the epoch starts; without workers
        # the first task is asked for with the first batch. A sampler drawing from the global
        # generator has drawn already, or will draw after the checkpoint: the replay must agree.
        state["epoch"]["sampler_started"] = progress.consumed > 0 or loader.num_workers > 0
        return state
    generator = loader.generator
    state["next"] = {
        "generator": encode_state(generator.get_state()) if generator is not None else None,
        "sampler": fresh_sampler_state(loader._index_sampler) if loader._dataset_kind.value == "map" else None,
        "session": list(session) if session is not None else None,
    }
    return state


def _epoch_state(record: EpochRecord, progress: EpochProgress) -> dict[str, Any]:
    streams = {str(w): {"batches": p.batches, "snapshot": list(p.snapshot) if p.snapshot is not None else None}
               for w, p in progress.streams.items()}
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
    }


def read_state(loader: Any, state: dict[str, Any]) -> ResumePoint:
    """Check ``state`` against ``loader``, set the generators it names, and say how to resume.

    Raises:
        IncompatibleStateError: not a loader state, a newer version, or another configuration.
    """
    if not isinstance(state, dict) or state.get("format") != FORMAT:
        raise IncompatibleStateError(
            f"load_state_dict expects a state made by DataLoader.state_dict() (format {FORMAT!r}), "
            f"but got {type(state).__name__} with format {getattr(state, 'get', lambda _: None)('format')!r}")
    if state.get("version") != VERSION:
        raise IncompatibleStateError(
            f"cannot load a DataLoader state of version {state.get('version')!r}: this pipeload reads "
            f"version {VERSION}")
    here = config_of(loader)
    saved = state["config"]
    differences = {k: (saved.get(k), here.get(k)) for k in here.keys() | saved.keys()
                   if saved.get(k) != here.get(k)}
    if differences:
        raise state_mismatch("this DataLoader", dict(sorted(differences.items())))
    if "epoch" in state:
        return _mid_epoch(loader, state["epoch"])
    return _next_epoch(loader, state["next"])


def _next_epoch(loader: Any, saved: dict[str, Any]) -> ResumePoint:
    if saved["generator"] is not None and loader.generator is not None:
        loader.generator.set_state(decode_state(saved["generator"]))
    _load_sampler(loader, saved["sampler"])
    session = saved["session"]
    return ResumePoint(None, session=tuple(session) if session is not None and loader.persistent_workers else None)


def _mid_epoch(loader: Any, saved: dict[str, Any]) -> ResumePoint:
    record = EpochRecord(
        global_rng=decode_state(saved["global_rng"]),
        generator=decode_state(saved["generator"]) if saved["generator"] is not None else None,
        sampler=saved["sampler"],
        base_seed=saved["base_seed"],
        session_epoch=saved["session_epoch"],
        later_in_session=saved["later_in_session"],
    )
    if record.generator is not None and loader.generator is not None:
        loader.generator.set_state(record.generator)
    _load_sampler(loader, record.sampler)
    positions = {int(w): StreamPosition(int(w), p["batches"], tuple(p["snapshot"]) if p["snapshot"] else None)
                 for w, p in saved["streams"].items()}
    _warn_if_replicas_start_over(loader, positions)
    last = saved["last_worker"]
    next_worker = 0 if last is None else last + 1
    session = (record.base_seed, record.session_epoch) if record.later_in_session else None
    return ResumePoint(record, saved["consumed"], positions, next_worker, session, saved["sampler_started"])


def _warn_if_replicas_start_over(loader: Any, positions: dict[int, StreamPosition]) -> None:
    again = sum(p.batches for p in positions.values() if p.snapshot is not None and p.snapshot[1] is None)
    if again:
        warnings.warn(
            f"{type(loader.dataset).__name__} cannot say where it stands (no state_dict() on it or "
            f"on its iterator), so resuming reads the {again} batches already handed out this "
            "epoch again and drops them. Give it state_dict()/load_state_dict() to resume without "
            "re-reading.",
            stacklevel=5,  # the caller of load_state_dict
        )


def _load_sampler(loader: Any, sampler_state: dict[str, Any] | None) -> None:
    if loader._dataset_kind.value == "map":
        _warn_if_sampler_cannot_resume(loader)
    if sampler_state is None:
        return
    load = getattr(loader._index_sampler, "load_state_dict", None)
    if callable(load):
        load(sampler_state)


def _warn_if_sampler_cannot_resume(loader: Any) -> None:
    """A sampler of the user's own without state_dict() is iterated again from its start: right
    if it draws nothing, or draws from torch's global generator as its iteration starts."""
    for sampler in (loader.batch_sampler, loader.sampler):
        if sampler is None or isinstance(sampler, Sequence) or callable(getattr(sampler, "state_dict", None)):
            continue
        warnings.warn(
            f"{type(sampler).__name__} has no state_dict(): resuming iterates it again from its "
            "start and skips the batches already handed out. That gives the same keys only if it "
            "draws no random numbers, or draws them from torch's global generator when its "
            "iteration starts; give it state_dict()/load_state_dict() otherwise.",
            stacklevel=6,  # the caller of load_state_dict
        )
        return
