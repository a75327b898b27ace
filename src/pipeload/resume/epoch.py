"""What the loader notes about each epoch so that it can be begun again and continued.

An epoch's batches are fixed by a few things decided when it begins: the state of the generators
the loader and its sampler draw from, and (for a persistent session) the session's base seed and
epoch number. :class:`EpochRecord` keeps those, taken just before the epoch's first draw;
:class:`EpochProgress` counts what the epoch has handed out since. Neither holds a sample, an
engine or a worker: the loader keeps the latest pair, and ``state_dict()`` reads it.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch

# A replica's state_dict() is taken with its first batch and every this-many-th one after (it
# can be costly: a shuffle buffer is copied); resuming re-makes at most this many minus one
# batches per replica from the latest snapshot.
STREAM_SNAPSHOT_EVERY = 8

from pipeload.engine.fetch import StreamBatch, StreamPosition
from pipeload.errors import LoaderTimeoutError


@dataclass
class EpochRecord:
    """How an epoch began.

    Attributes:
        global_rng: torch's global generator state just before the epoch's first draw.
        generator: the loader's own generator's state then (None without one).
        sampler: the index sampler's ``state_dict()`` then, as a fresh iteration (None when it
            has none, and for iterable datasets).
        base_seed: the workers' base seed of this epoch's session.
        session_epoch: this epoch's number in its session (1 unless workers are persistent).
        later_in_session: True when the epoch ran on persistent workers started for an earlier
            epoch (it drew a DataPipe seed only, not a base seed).
    """

    global_rng: torch.Tensor
    generator: torch.Tensor | None
    sampler: dict[str, Any] | None
    base_seed: int = 0
    session_epoch: int = 1
    later_in_session: bool = False


@dataclass
class EpochProgress:
    """What an epoch has handed out. Updated by the epoch's iterator, read by ``state_dict()``.

    Attributes:
        consumed: batches handed out, a batch whose building raised included (its turn passed).
        streams: iterable datasets: worker id -> that replica's position after its latest batch
            handed out, with its latest snapshot.
        last_worker: the worker of the latest batch handed out (None before the first).
        ended: the epoch reached its end (StopIteration).
    """

    consumed: int = 0
    streams: dict[int, StreamPosition] = field(default_factory=dict)
    last_worker: int | None = None
    ended: bool = False

    def handed_out(self, batch: Any) -> Any:
        """Note a batch handed out; returns it without its position, if it came with one."""
        self.consumed += 1
        if isinstance(batch, StreamBatch):
            position = batch.position
            if position.snapshot is None and position.worker_id in self.streams:
                # not taken with this batch: the replica's latest snapshot stands
                position = position._replace(snapshot=self.streams[position.worker_id].snapshot)
            self.streams[position.worker_id] = position
            self.last_worker = position.worker_id
            return batch.batch
        return batch

    def failed(self, error: BaseException) -> None:
        """A batch raised in its turn: it counts as handed out; a timeout does not (it comes)."""
        if isinstance(error, Exception) and not isinstance(error, LoaderTimeoutError):
            self.consumed += 1


def begin_epoch(loader: Any) -> EpochRecord:
    """The record of an epoch about to begin (taken before anything is drawn for it)."""
    generator = loader.generator
    sampler_state = None
    if loader._dataset_kind.value == "map":
        sampler_state = fresh_sampler_state(loader._index_sampler)
    return EpochRecord(
        global_rng=torch.get_rng_state(),
        generator=generator.get_state() if generator is not None else None,
        sampler=sampler_state,
    )


def fresh_sampler_state(sampler: Any) -> dict[str, Any] | None:
    """``sampler.state_dict()`` as for an iteration not yet begun, or None without one."""
    state_dict = getattr(sampler, "state_dict", None)
    if not callable(state_dict):
        return None
    return _without_iterations(state_dict())


def _without_iterations(state: Any) -> Any:
    if not isinstance(state, dict):
        return state
    cleared = dict(state)
    if "iteration" in cleared:
        cleared["iteration"] = None
    if isinstance(cleared.get("sampler"), dict):
        cleared["sampler"] = _without_iterations(cleared["sampler"])
    return cleared
