"""A loader state read field by field, every field checked, before anything is set from it.

What can be told from the state alone is checked here: each field's presence, type and range,
the generator states decoded and tried on a throwaway generator, the fields that must agree
with each other (a watermark below the batches handed out above it, a snapshot no later than
its replica's position), and, for states that carry one, the digest over the whole (so a value
damaged yet well-formed is refused too). What needs the loader (its configuration, its
generator, its sampler, its number of batches) is checked by ``state.py`` after this.

Version 2 states (this pipeload's) carry a digest and every field; version 1 states (the
previous one's) have no digest, and may lack ``padded``, ``handed_out_above`` and
``repeat_from`` (written later within version 1): they still load, with every other check.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from pipeload._state_digest import DIGEST_FIELD, check_digest
from pipeload._state_fields import StateFields, is_int, join
from pipeload.engine.fetch import StreamPosition
from pipeload.errors import IncompatibleStateError, bad_state_field
from pipeload.resume.epoch import EpochRecord, RepeatFrom
from pipeload.resume.faithful import read_back

FORMAT = "pipeload.DataLoader"
VERSION = 2  # 2: a digest of the content, every field present; 1: without (still read)
READ_VERSIONS = (1, 2)
DATASET_KINDS = ("map", "iterable")
MODES = ("classic", "economic")
WORKER_SEEDINGS = ("torch", "per_batch")
SEED_HIGH = 2**64 - 1  # base seeds are unsigned 64-bit values


@dataclass(frozen=True)
class CheckedEpoch:
    """An epoch in progress, as its state says (see ``ResumePoint`` for each field)."""

    record: EpochRecord
    consumed: int
    streams: dict[int, StreamPosition]
    last_worker: int | None
    padded: int
    repeat_from: RepeatFrom | None
    handed_out_above: frozenset[int]
    sampler_started: bool


@dataclass(frozen=True)
class CheckedNext:
    """Between epochs: the generators' states and the persistent session's next epoch."""

    generator: torch.Tensor | None
    sampler: Any
    session: tuple[int, int] | None


@dataclass(frozen=True)
class CheckedState:
    """A loader state whose every field was checked; ``epoch`` or ``next`` is set."""

    version: int
    config: dict[str, Any]
    epoch: CheckedEpoch | None
    next: CheckedNext | None
    persistent: bool | None = None  # whether its loader ran persistent workers (None: not said)

    @property
    def saved_generator(self) -> torch.Tensor | None:
        return self.epoch.record.generator if self.epoch is not None else self.next.generator  # type: ignore[union-attr]

    @property
    def sampler(self) -> Any:
        return self.epoch.record.sampler if self.epoch is not None else self.next.sampler  # type: ignore[union-attr]

    @property
    def sampler_path(self) -> str:
        return "epoch.sampler" if self.epoch is not None else "next.sampler"


def read_fields(state: Any) -> CheckedState:
    """Check every field of ``state`` that can be checked without the loader (the digest is
    checked last, by :func:`check_content`).

    Raises:
        IncompatibleStateError: not a loader state, another version, or a field missing,
            mistyped, out of range or undecodable (named by its path).
    """
    version = _check_format(state)
    fields = StateFields(state, "")
    fields.raw("format", repr(FORMAT))
    fields.raw("version", str(VERSION))
    config = _read_config(fields)
    fields.choice("worker_seeding", WORKER_SEEDINGS)
    fields.choice("mode", MODES)
    # Written since stop 54: states saved before it do not say, and load without the warning.
    persistent = fields.boolean("persistent_workers", default=None)
    has_epoch, has_next = "epoch" in state, "next" in state
    if has_epoch == has_next:
        raise IncompatibleStateError(
            "cannot load this state: it should have either 'epoch' (taken mid-epoch) or 'next' "
            f"(taken between epochs), but it has {'both' if has_epoch else 'neither'}")
    iterable = config["dataset_kind"] == "iterable"
    epoch = _read_epoch(fields.fields("epoch"), version, iterable, config.get("num_workers")) if has_epoch else None
    upcoming = _read_next(fields.fields("next")) if has_next else None
    if version >= 2:
        fields.raw(DIGEST_FIELD, "the digest state_dict() writes")
    fields.finish()
    return CheckedState(version, config, epoch, upcoming, persistent)


def check_content(state: dict[str, Any], checked: CheckedState) -> None:
    """The digest, checked after every named check passed: it catches what they cannot (a
    value damaged yet well-formed), and they name the field when they can."""
    if checked.version >= 2:
        check_digest(state)


def _check_format(state: Any) -> int:
    if not isinstance(state, dict) or state.get("format") != FORMAT:
        got = state.get("format") if isinstance(state, dict) else None
        raise IncompatibleStateError(
            f"load_state_dict expects a state made by DataLoader.state_dict() (format {FORMAT!r}), "
            f"but got {type(state).__name__} with format {got!r}")
    version = state.get("version")
    if not (is_int(version) and version in READ_VERSIONS):
        raise IncompatibleStateError(
            f"cannot load a DataLoader state of version {version!r}: this pipeload reads versions "
            f"{' and '.join(map(str, READ_VERSIONS))}")
    return version


def _read_config(fields: StateFields) -> dict[str, Any]:
    config = fields.fields("config")
    assert config is not None
    kind = config.choice("dataset_kind", DATASET_KINDS)
    world_size = config.integer("world_size", low=1)
    read = {
        "dataset_kind": kind,
        "dataset_length": config.integer("dataset_length", none=True),
        "batch_size": config.integer("batch_size", low=1, none=True),
        "drop_last": config.boolean("drop_last"),
        "world_size": world_size,
        "rank": config.integer("rank", high=world_size - 1),
    }
    if kind == "iterable":
        read["num_workers"] = config.integer("num_workers")
        # A DataPipe graph's shape (resume/state.py's graph_shape); absent from states written
        # before it was kept, and from those of iterable datasets that are not pipes.
        expected = "the digest of a DataPipe graph's shape ('sha256:...' text)"
        shape = config.raw("graph", expected, default=None)
        if shape is not None:
            if not (isinstance(shape, str) and shape.startswith("sha256:")):
                raise bad_state_field(config.name("graph"), shape, expected)
            read["graph"] = shape
    config.finish()
    return read


def _read_next(fields: StateFields | None) -> CheckedNext:
    assert fields is not None
    generator = fields.generator("generator", none=True)
    sampler = fields.raw("sampler", "the index sampler's state, or None")
    session = fields.sequence("session", "None or [base seed, epoch number]", length=2, none=True)
    if session is not None:
        if not (is_int(session[0]) and 0 <= session[0] <= SEED_HIGH and is_int(session[1]) and session[1] >= 1):
            raise bad_state_field(fields.name("session"), session,
                                  "None or [base seed (an int from 0 to 2**64 - 1), epoch number (an int >= 1)]")
        session = (session[0], session[1])
    fields.finish()
    return CheckedNext(generator, sampler, session)


def _read_epoch(fields: StateFields | None, version: int, iterable: bool, num_workers: int | None) -> CheckedEpoch:
    assert fields is not None
    record = EpochRecord(
        global_rng=fields.generator("global_rng"),  # type: ignore[arg-type]
        generator=fields.generator("generator", none=True),
        sampler=fields.raw("sampler", "the index sampler's state as the epoch began, or None"),
        base_seed=fields.integer("base_seed", high=SEED_HIGH),
        session_epoch=fields.integer("session_epoch", low=1),
        later_in_session=fields.boolean("later_in_session"),
    )
    if iterable and record.sampler is not None:
        raise bad_state_field(fields.name("sampler"), record.sampler, "None (an iterable dataset has no sampler)")
    workers = max(num_workers or 0, 1) if iterable else 0  # map-style: no replica positions
    consumed = fields.integer("consumed")
    optional = {} if version >= 2 else {"default": None}  # version 1: written later, may be absent
    streams = _read_streams(fields, workers)
    last_worker = _read_last_worker(fields, streams)
    padded = fields.integer("padded", **({} if version >= 2 else {"default": 0}))
    above = _read_handed_out_above(fields, consumed, iterable, optional)
    repeat = _read_repeat_from(fields, consumed, streams, last_worker, workers, optional)
    started = fields.boolean("sampler_started")
    fields.finish()
    return CheckedEpoch(record, consumed, streams, last_worker, padded, repeat, above, started)


def _read_streams(fields: StateFields, workers: int) -> dict[int, StreamPosition]:
    """Iterable datasets: each replica's position after its latest batch handed out (or, in
    ``repeat_from``, before the latest good one)."""
    streams = fields.fields("streams")
    assert streams is not None
    positions = {}
    for key in list(streams.state):
        worker = _worker_key(key)
        if worker is None or worker >= workers:
            expected = (f"a worker id from 0 to {workers - 1}" if workers else
                        "absent (a map-style dataset has no replica positions)")
            raise bad_state_field(join(streams.path, key), streams.state[key], f"keyed by {expected}",
                                  f"a position for worker {key!r}")
        positions[worker] = _read_position(streams.fields(key), worker)  # type: ignore[arg-type]
    streams.finish()
    return positions


def _worker_key(key: Any) -> int | None:
    if is_int(key):
        return key if key >= 0 else None
    if isinstance(key, str) and key.isdigit() and key.isascii():
        return int(key)
    return None


def _read_position(fields: StateFields, worker: int) -> StreamPosition:
    batches = fields.integer("batches")
    snapshot = fields.sequence("snapshot", "None or [batches made when it was taken, the replica's state]",
                               length=2, none=True)
    if snapshot is not None and not (is_int(snapshot[0]) and 0 <= snapshot[0] <= batches):
        raise bad_state_field(fields.name("snapshot"), snapshot,
                              f"[batches made when it was taken (an int from 0 to {batches}), the replica's state]")
    # The batches since the snapshot's state that raised (absent from states written before
    # they were kept: none then).
    since = snapshot[0] if snapshot is not None and snapshot[1] is not None else 0
    expected = f"a list of distinct batch numbers from {since + 1} to {batches}, ascending"
    failed = fields.sequence("failed", expected, default=[])
    if not (all(is_int(n) and since < n <= batches for n in failed)
            and all(a < b for a, b in zip(failed, failed[1:]))):
        raise bad_state_field(fields.name("failed"), failed, expected)
    fields.finish()
    snapshot = (snapshot[0], read_back(snapshot[1])) if snapshot is not None else None  # see faithful.py
    return StreamPosition(worker, batches, snapshot, tuple(failed))


def _read_last_worker(fields: StateFields, streams: dict[int, StreamPosition]) -> int | None:
    """The worker of the latest batch handed out: one with a position (None: no position yet)."""
    last = fields.raw("last_worker", "None or a worker id")
    if (last is None and not streams) or (is_int(last) and last in streams):
        return last
    expected = "None (no replica has a position)" if not streams else f"one of {sorted(streams)} (the workers with a position)"
    raise bad_state_field(fields.name("last_worker"), last, expected)


def _read_handed_out_above(fields: StateFields, consumed: int, iterable: bool, optional: dict[str, Any]) -> frozenset[int]:
    above = fields.sequence("handed_out_above", "a list of batch numbers above consumed, ascending",
                            **optional)
    if above is None:
        return frozenset()
    numbers_ok = all(is_int(n) for n in above) and all(a < b for a, b in zip(above, above[1:]))
    if not numbers_ok or (above and above[0] <= consumed) or (above and iterable):
        expected = ("[] (iterable datasets hand batches out in order)" if iterable else
                    f"a list of distinct batch numbers above consumed ({consumed}), ascending")
        raise bad_state_field(fields.name("handed_out_above"), above, expected)
    return frozenset(above)


def _read_repeat_from(fields: StateFields, consumed: int, streams: dict[int, StreamPosition],
                      last_worker: int | None, workers: int, optional: dict[str, Any]) -> RepeatFrom | None:
    repeat = fields.fields("repeat_from", none=True, **optional)
    if repeat is None:
        return None
    before = repeat.integer("consumed", high=consumed)
    if "position" in repeat.state and "streams" not in repeat.state:
        return _read_repeat_position(repeat, before, streams, last_worker, workers)
    earlier = _read_streams(repeat, workers)
    worker = _read_last_worker(repeat, earlier)
    for key, position in earlier.items():  # a replica's position only moves on
        now = streams.get(key)
        if now is None or position.batches > now.batches:
            raise bad_state_field(join(join(repeat.name("streams"), str(key)), "batches"), position.batches,
                                  f"at most the batches of epoch.streams.{key} "
                                  f"({now.batches if now is not None else 'absent there'})")
    repeat.finish()
    return RepeatFrom(before, earlier, worker)


def _read_repeat_position(repeat: StateFields, before: int, streams: dict[int, StreamPosition],
                          last_worker: int | None, workers: int) -> RepeatFrom:
    """A state written before ``repeat_from`` kept every replica's position: it kept the one of
    the latest batch's replica, before that batch (None: it had made nothing yet)."""
    if workers:
        worker = repeat.integer("last_worker", high=workers - 1, none=True)
    elif (worker := repeat.raw("last_worker", "None")) is not None:
        raise bad_state_field(repeat.name("last_worker"), worker, "None (a map-style dataset has no workers' positions)")
    position = repeat.fields("position", none=True)
    if position is not None and last_worker is None:
        raise bad_state_field(position.path, position.state, "None (no batch was handed out with a position)")
    earlier = dict(streams)
    if last_worker is not None:
        earlier.pop(last_worker, None)
        if position is not None:
            earlier[last_worker] = _read_position(position, last_worker)
    repeat.finish()
    return RepeatFrom(before, earlier, worker)
