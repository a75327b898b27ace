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
from pipeload._user_frame import first_frame_outside_pipeload
from pipeload.distributed import current_placement
from pipeload.engine.fetch import StreamPosition
from pipeload.errors import IncompatibleStateError, state_mismatch
from pipeload.resume.epoch import EpochProgress, EpochRecord, RepeatFrom, fresh_sampler_state

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
        streams = dict(self.streams or {})
        if self.repeat_from is None:
            return self.consumed, streams, self.last_worker, 0
        before = self.repeat_from
        if self.last_worker is not None:
            streams.pop(self.last_worker, None)
            if before.position is not None:
                streams[self.last_worker] = before.position
        return before.consumed, streams, before.last_worker, self.consumed - before.consumed


def config_of(loader: Any) -> dict[str, Any]:
    """What a state must agree with to be loaded: the loader's shape, not its speed settings."""
    placement = current_placement()
    try:
        length = len(loader.dataset)
    except TypeError:
        length = None
    config = {
        "dataset_kind": loader._dataset_kind.label,
        "dataset_length": length,
        "batch_size": loader.batch_size,
        "drop_last": loader.drop_last,
        "world_size": placement.world_size,
        "rank": placement.rank,
    }
    if loader._dataset_kind.label == "iterable":
        config["num_workers"] = loader.num_workers  # each replica's position is its own shard's
    return config


def build_state(loader: Any, record: EpochRecord | None, progress: EpochProgress | None,
                session: tuple[int, int] | None) -> dict[str, Any]:
    """The JSON-serialisable checkpoint of ``loader`` now."""
    state: dict[str, Any] = {"format": FORMAT, "version": VERSION, "config": config_of(loader),
                             "worker_seeding": loader.worker_seeding, "mode": loader.mode}
    if record is not None and progress is not None and not progress.ended:
        state["epoch"] = _epoch_state(record, progress, _pads_across_ranks(loader))
        # Engines with workers ask the sampler for tasks as the epoch starts; without workers
        # the first task is asked for with the first batch. A sampler drawing from the global
        # generator has drawn already, or will draw after the checkpoint: the replay must agree.
        # A resumed epoch that replayed the draw has made it, whatever its engine.
        state["epoch"]["sampler_started"] = (progress.sampler_started or progress.consumed > 0
                                             or progress.padded > 0 or loader.num_workers > 0)
        return state
    generator = loader.generator
    state["next"] = {
        "generator": encode_state(generator.get_state()) if generator is not None else None,
        "sampler": fresh_sampler_state(loader._index_sampler) if loader._dataset_kind.label == "map" else None,
        "session": list(session) if session is not None else None,
    }
    return state


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
    snapshot = list(position.snapshot) if position.snapshot is not None else None
    return {"batches": position.batches, "snapshot": snapshot}


def _position_of(worker: int, saved: dict[str, Any]) -> StreamPosition:
    snapshot = tuple(saved["snapshot"]) if saved["snapshot"] else None
    return StreamPosition(worker, saved["batches"], snapshot)


def _epoch_state(record: EpochRecord, progress: EpochProgress, pads: bool) -> dict[str, Any]:
    streams = {str(w): _position_state(p) for w, p in progress.streams.items()}
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
            "position": _position_state(repeat.position) if repeat.position is not None else None},
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
    _check_generator(loader, (state["epoch"] if "epoch" in state else state["next"])["generator"])
    if "epoch" in state:
        return _mid_epoch(loader, state["epoch"])
    return _next_epoch(loader, state["next"])


def _check_generator(loader: Any, saved: str | None) -> None:
    """The order and base seeds come from the loader's generator, or else from torch's global
    one: a state drawn from the one cannot go on from the other."""
    named = {True: "a torch.Generator", False: None}
    if (saved is not None) != (loader.generator is not None):
        raise state_mismatch("this DataLoader", {"generator": (named[saved is not None],
                                                               named[loader.generator is not None])})


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
    positions = {int(w): _position_of(int(w), p) for w, p in saved["streams"].items()}
    repeat = saved.get("repeat_from")
    if repeat is not None:
        position = repeat["position"]
        last = saved["last_worker"]
        repeat = RepeatFrom(repeat["consumed"], _position_of(last, position) if position else None,
                            repeat["last_worker"])
    _warn_if_replicas_start_over(loader, positions)
    session = (record.base_seed, record.session_epoch) if record.later_in_session else None
    return ResumePoint(record, saved["consumed"], positions, session, saved["sampler_started"],
                       saved["last_worker"], saved.get("padded", 0), repeat,
                       frozenset(saved.get("handed_out_above", ())))


def _warn_if_replicas_start_over(loader: Any, positions: dict[int, StreamPosition]) -> None:
    again = sum(p.batches for p in positions.values() if p.snapshot is not None and p.snapshot[1] is None)
    if again:
        warnings.warn(
            f"{type(loader.dataset).__name__} cannot say where it stands (no state_dict() on it or "
            f"on its iterator), so resuming reads the {again} batches already handed out this "
            "epoch again and drops them. Give it state_dict()/load_state_dict() to resume without "
            "re-reading.",
            stacklevel=first_frame_outside_pipeload(),  # the caller of load_state_dict
        )


def _load_sampler(loader: Any, sampler_state: dict[str, Any] | None) -> None:
    if loader._dataset_kind.label == "map":
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
            stacklevel=first_frame_outside_pipeload(),  # the caller of load_state_dict
        )
        return
