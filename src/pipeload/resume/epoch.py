"""What the loader notes about each epoch so that it can be begun again and continued.

An epoch's batches are fixed by a few things decided when it begins: the state of the generators
the loader and its sampler draw from, and (for a persistent session) the session's base seed and
epoch number. :class:`EpochRecord` keeps those, taken just before the epoch's first draw;
:class:`EpochProgress` counts what the epoch has handed out since. Neither holds a sample, an
engine or a worker: the loader keeps the latest pair, and ``state_dict()`` reads it.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any, NamedTuple

import torch

# A replica's state_dict() is taken with its first batch and every this-many-th one after (it
# can be costly: a shuffle buffer is copied); resuming re-makes at most this many minus one
# batches per replica from the latest snapshot.
STREAM_SNAPSHOT_EVERY = 8

from pipeload._optional import optional_attribute
from pipeload.engine.epoch_flow import NumberedBatch, batch_number_of, worker_of
from pipeload.engine.equal_batches import PaddedBatch
from pipeload.engine.fetch import StreamBatch, StreamPosition
from pipeload.errors import LoaderTimeoutError
from pipeload.samplers._epoch_lengths import EpochLengths
from pipeload.samplers._own_generators import epoch_holders, generators_state
from pipeload.samplers._state import StatefulSampler, fresh_state


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


class RepeatFrom(NamedTuple):
    """Where an epoch stood just before its latest good batch was handed out.

    Under ``equal_batches="pad"`` a rank repeats that batch once its own are spent, so a rank
    resumed from a checkpoint must have it again: it resumes from here, and the equal-batches
    stage makes the batches handed out since (that one, and any that raised after it) again
    without handing them out.

    Attributes:
        consumed: batches handed out before it.
        streams: iterable datasets: every replica's position before it (empty for map-style).
            Not only its own replica's: a batch that raised after it moved its replica on, and
            the round-robin makes it again too, in its turn.
        last_worker: the worker of the batch handed out before it.
    """

    consumed: int
    streams: dict[int, StreamPosition]
    last_worker: int | None


@dataclass
class EpochProgress:
    """What an epoch has handed out. Updated by the epoch's iterator, read by ``state_dict()``.

    Attributes:
        consumed: batches handed out, a batch whose building raised included (its turn passed);
            repeats handed out by ``equal_batches="pad"`` not included. Out of order: every
            batch numbered below it has been handed out.
        handed_out_above: out of order (``in_order=False``, map-style): the numbers of the
            batches handed out beyond ``consumed`` (a few: at most those in flight).
        streams: iterable datasets: worker id -> that replica's position after its latest batch
            handed out, with its latest snapshot.
        last_worker: the worker of the latest batch handed out (None before the first).
        padded: ``equal_batches="pad"``: how many times this rank, its own batches spent, has
            handed out its last good batch again.
        repeat_from: where the epoch stood before its latest good batch (None before the first).
        ended: the epoch reached its end (StopIteration).
        sampler_started: the sampler was asked for its first task before this epoch's engine
            began (a resumed epoch that replayed that draw), whatever the engine does now.
        iterable: the epoch's batches come from iterable replicas, whose positions count a
            batch that raised too (``streams``).
    """

    consumed: int = 0
    streams: dict[int, StreamPosition] = field(default_factory=dict)
    last_worker: int | None = None
    padded: int = 0
    repeat_from: RepeatFrom | None = None
    handed_out_above: set[int] = field(default_factory=set)
    ended: bool = False
    sampler_started: bool = False
    iterable: bool = False

    def handed_out(self, batch: Any) -> Any:
        """Note a batch handed out; returns it without its position and padding marks."""
        if isinstance(batch, PaddedBatch):
            self.padded += 1
            batch = batch.batch
            return batch.batch if isinstance(batch, (StreamBatch, NumberedBatch)) else batch
        if isinstance(batch, NumberedBatch):
            self.repeat_from = None  # out of order, "pad" cannot checkpoint (state.py says why)
            self._mark(batch.number)
            return batch.batch
        if not isinstance(batch, StreamBatch):
            self.repeat_from = RepeatFrom(self.consumed, {}, self.last_worker)
            self._mark(self.consumed)
            return batch
        position = batch.position
        previous = self.streams.get(position.worker_id)
        self.repeat_from = RepeatFrom(self.consumed, dict(self.streams), self.last_worker)
        if position.snapshot is None and previous is not None:
            # not taken with this batch: the replica's latest snapshot stands
            position = position._replace(snapshot=previous.snapshot, failed=previous.failed)
        elif previous is not None and position.snapshot is not None and position.snapshot[1] is None:
            # a replica without a state is made again from its start on resuming
            position = position._replace(failed=previous.failed)
        self.streams[position.worker_id] = position
        self.last_worker = position.worker_id
        self.consumed += 1
        return batch.batch

    def failed(self, error: BaseException) -> None:
        """A batch raised in its turn: it counts as handed out; a timeout does not (it comes)."""
        if isinstance(error, Exception) and not isinstance(error, LoaderTimeoutError):
            number = batch_number_of(error)
            worker = worker_of(error)
            if self.iterable and worker is not None:
                self._replica_failed(worker)
            self._mark(self.consumed if number is None else number)

    def _replica_failed(self, worker: int) -> None:
        """Worker ``worker``'s replica raised building its next batch: that batch's turn passed
        (its replica counts it as made), so its position moves on by one, noted as failed."""
        previous = self.streams.get(worker)
        batches = (previous.batches if previous is not None else 0) + 1
        failed = (previous.failed if previous is not None else ()) + (batches,)
        snapshot = previous.snapshot if previous is not None else None
        self.streams[worker] = StreamPosition(worker, batches, snapshot, failed)
        self.last_worker = worker

    def _mark(self, number: int) -> None:
        """Batch ``number`` was handed out (in order, it is ``consumed``)."""
        if number != self.consumed:
            if number > self.consumed:
                self.handed_out_above.add(number)
            return
        self.consumed += 1
        while self.consumed in self.handed_out_above:  # a resumed in-order epoch jumps these
            self.handed_out_above.discard(self.consumed)
            self.consumed += 1


def begin_epoch(loader: Any, resumed: EpochRecord | None = None) -> EpochRecord:
    """The record of an epoch about to begin (taken before anything is drawn for it), but for
    the state of one of pipeload's samplers, which ``record_sampler_state`` adds once the
    workers have started. A user's index sampler is recorded now: torch asks it for an iteration
    before its workers start (see ``DataLoader.__iter__``), and its state is from before that.

    An epoch begun again from a checkpoint keeps the global generator state it first began
    with (the one it is replayed under), so a checkpoint taken after resuming replays it too.
    """
    generator = loader.generator
    sampler = loader._index_sampler
    users = loader._dataset_kind.label == "map" and not isinstance(sampler, StatefulSampler)
    return EpochRecord(
        global_rng=resumed.global_rng if resumed is not None else torch.get_rng_state(),
        generator=generator.get_state() if generator is not None else None,
        sampler=fresh_sampler_state(sampler) if users else None,
    )


def record_sampler_state(loader: Any, record: EpochRecord) -> None:
    """Add the state of pipeload's index sampler as the epoch began to ``record`` (map-style
    datasets; a user's sampler was recorded by ``begin_epoch``).

    Asked after the workers started and before the sampler's first draw: the state names the
    dataset's length, and a dataset's ``__len__`` may run code a worker must not inherit
    (``samplers/_lengths.py``), which torch's loader first runs after its workers started. Only
    the loader's generator is drawn from since the epoch began (the workers' base seed, a
    graph's seed); a sampler drawing from that same generator is asked as it stood then.
    """
    if loader._dataset_kind.label != "map" or not isinstance(loader._index_sampler, StatefulSampler):
        return
    generator = loader.generator
    if generator is None or record.generator is None:
        record.sampler = fresh_sampler_state(loader._index_sampler)
        return
    now = generator.get_state()
    generator.set_state(record.generator)
    try:
        record.sampler = fresh_sampler_state(loader._index_sampler)
    finally:
        generator.set_state(now)


def recorded_at_first_draw(loader: Any, record: EpochRecord, tasks: Iterator[Any]) -> Iterator[Any]:
    """``tasks``, the index sampler's state recorded again as its first task is drawn: without
    workers the sampler draws at the first batch, after whatever the loop did since ``iter()``.
    Lightning calls ``set_epoch`` there: the state named the epoch before it while the batches
    came in the new epoch's order, and a resume lost and repeated samples without a word (stop
    54's resume skeptic). Only the sampler's state: the generators' are those of ``iter()``,
    where the epoch's other draws (the base seed) were made; of a user's sampler, only its
    epochs (an eager one has drawn its order at ``iter()``, and its generators with it)."""
    # A generator: this runs at the first next(), before the sampler is asked. The record and
    # the draw ask the dataset's length once between them (samplers/_epoch_lengths.py): the
    # length the dataset has at the draw, as torch's draw asks it, and no more often than torch.
    sampler = loader._index_sampler
    with EpochLengths().active():
        if isinstance(sampler, StatefulSampler):
            record_sampler_state(loader, record)
        elif isinstance(record.sampler, dict) and "epochs" in record.sampler:
            epochs = {place: holder.epoch for place, holder in epoch_holders(sampler).items()}
            record.sampler = {**record.sampler, "epochs": epochs}
        first = next(tasks, _NO_TASK)
    if first is _NO_TASK:
        return
    yield first
    yield from tasks


_NO_TASK = object()


def fresh_sampler_state(sampler: Any) -> dict[str, Any] | None:
    """``sampler.state_dict()`` as for an iteration not yet begun; without one, the states of
    the generators it draws from itself (samplers/_own_generators.py), or None."""
    if isinstance(sampler, StatefulSampler):
        return sampler.fresh_state_dict()
    state_dict = optional_attribute(sampler, "state_dict")
    if not callable(state_dict):
        return generators_state(sampler)
    return fresh_state(state_dict())
