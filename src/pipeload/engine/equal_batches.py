"""The equal-batches stage: every rank of a ``torch.distributed`` job yields as many batches.

DDP runs one collective per training step; a rank that stops one step early leaves the others
waiting in theirs for ever. A ``DistributedSampler`` gives every rank the same count by
construction, but an iterable dataset or a DataPipe sharded by rank cannot know its share's
length in advance (filters, uneven shards, several workers' last partial batches). This stage
sits after the engine (and after pinning, so the collective runs in the training thread) and,
before handing out each batch, asks every rank whether it still has one:

- ``"drop"``: the epoch ends on every rank as soon as one rank has run out; a rank's extra batches
  are never handed out (its engine stops them, as when a loop breaks early).
- ``"pad"``: the epoch goes on until every rank has run out; a rank that ran out first hands out
  its last batch again, once per missing step, each time as a copy of its own: a training loop
  that changes a batch in place (``batch.sub_(mean)``) must not find that change in a repeat.

The question is one ``all_reduce`` of one integer over a gloo group per batch (tens of
microseconds on one machine, a network round trip across machines), and it needs an initialised
process group. When every rank knows its epoch's batch count in advance (a map-style dataset
whose samplers are torch's or ours: their lengths are exact and they cannot fail mid-epoch), the
ranks agree once, as the epoch starts, on the count to stop at (the least for ``"drop"``, the
most for ``"pad"``), and then count their steps without asking again.

What ``"pad"`` repeats is kept as it was made: a copy of each good batch is taken before the batch
is handed out (the loop may change it in place at once, and whether it was the rank's last is
known only when the next one fails to come), and each repeat is a further copy of that one. The
copy costs one memory copy per batch on a rank that may pad: every rank when the ranks agree batch
by batch, only the ranks with fewer batches than the most when they agreed on the count at the
start. A resumed epoch makes the repeated batch again without handing it out: that one is kept as
it is.
"""

from __future__ import annotations

import copy
import functools
from collections.abc import Callable, Iterator
from typing import Any, NamedTuple

import torch

from pipeload.collate import rebuild_mapping, rebuild_sequence
from pipeload.distributed import all_ranks_agree, all_ranks_range, current_placement
from pipeload.engine.epoch_flow import NumberedBatch
from pipeload.engine.fetch import StreamBatch
from pipeload.engine.plan import EpochStart
from pipeload.errors import LoaderTimeoutError

POLICIES = ("drop", "pad")


class PaddedBatch(NamedTuple):
    """A batch handed out again by ``"pad"`` (this rank's own are spent): the loader's progress
    counts it apart, since a resumed rank must make the batch it repeats again, not skip it."""

    batch: Any


class EqualBatches:
    """Wraps an engine (or a pin stage) so that all ranks agree on each epoch's batch count.

    Driven by the training thread only. Invariant between calls: ``_ended`` is True once every
    rank agreed that this epoch is over; ``_kept`` is None or a copy of the latest good batch
    (without its position mark) that nobody outside this object has seen: it is set whenever
    ``_may_pad``; ``_steps_left`` is None while the ranks agree batch by batch, else the steps
    every rank still takes this epoch (agreed as it began).
    """

    def __init__(self, engine: Any, policy: str) -> None:
        self._engine = engine
        self._policy = policy
        self._kept: Any = None
        self._may_pad = False
        self._handed_out = 0
        self._ended = True
        self._steps_left: int | None = None

    workers = property(lambda self: self._engine.workers)
    closed = property(lambda self: self._engine.closed)
    inner = property(lambda self: self._engine)

    def start_epoch(self, tasks: Iterator[Any], shared_seed: int | None = None,
                    start: EpochStart = EpochStart()) -> None:
        self._engine.start_epoch(tasks, shared_seed, start=start)
        self._kept = None
        self._handed_out = 0
        self._ended = False
        self._steps_left = None
        self._may_pad = self._policy == "pad"
        if start.epoch_batches is not None:  # a collective every rank makes as its epoch starts
            fewest, most = self._ask_ranks(all_ranks_range, start.epoch_batches,
                                           "how many batches its epoch has")
            self._steps_left = (fewest if self._policy == "drop" else most) - start.steps_done
            self._may_pad = self._may_pad and start.epoch_batches < most
        for turn in range(start.remake):
            self._make_again(raised_before=turn > 0)

    def _make_again(self, raised_before: bool) -> None:
        """A resumed epoch begins before this rank's latest good batch (what ``"pad"`` repeats
        once the rank's own batches are spent): make it again and keep it, with the batches
        that raised after it (``raised_before``); all were handed out before the checkpoint. No
        collective: the other ranks take no step meanwhile.

        Raises:
            Exception: the good batch raised now, with a note: the data changed since the
                checkpoint (skipping it would pad with another batch, or fail to pad at all).
        """
        try:
            batch = self._engine.next_batch()
        except StopIteration:
            return
        except LoaderTimeoutError:
            raise
        except Exception as error:
            if raised_before:
                return  # it raised before the checkpoint too; its turn was counted then
            error.add_note("pipeload: raised while making again the batch equal_batches='pad' "
                           "repeats on this rank, handed out before the checkpoint without an "
                           "error, to resume from it: the data changed since the checkpoint, "
                           "and the rest of the epoch would not be what it was")
            raise
        if self._may_pad:
            self._kept = _without_marks(batch)  # never handed out since it was made: no copy
        self._handed_out += 1

    def next_batch(self) -> Any:
        """The next batch, or StopIteration once the ranks agree the epoch is over.

        A batch's own error counts as a step (the other ranks trained on theirs): it is raised
        after the ranks have agreed. A timeout is raised before asking, as no step happened.
        """
        if self._ended:
            raise StopIteration
        if self._steps_left is not None:
            return self._next_counted()
        error: Exception | None = None
        have = True
        try:
            batch = self._engine.next_batch()
        except StopIteration:
            have, batch = False, None
        except LoaderTimeoutError:
            raise
        except Exception as exc:  # one batch's error: the step still happened
            error, batch = exc, None
        go_on = self._ask_ranks(functools.partial(all_ranks_agree, every=self._policy == "drop"), have,
                                "whether it has another batch")
        if not go_on:
            self._end_epoch()
            raise StopIteration
        if error is not None:
            try:
                raise error
            finally:
                del error
        if not have:
            return self._repeat_last()
        self._handed_out += 1
        self._keep(batch)
        return batch

    def _ask_ranks(self, collective: Callable[[Any], Any], value: Any, question: str) -> Any:
        """``collective(value)``; when it fails (gloo: another rank's connection closed), the
        epoch is over here, and the error says which question the ranks were asked."""
        try:
            return collective(value)
        except RuntimeError as error:
            self._end_epoch()  # asking again would fail again, or wait for a rank that is gone
            placement = current_placement()
            error.add_note(
                f"pipeload: raised while equal_batches={self._policy!r} asked every rank {question} "
                f"(this process is rank {placement.rank} of {placement.world_size}): another rank "
                "has probably stopped (crashed, killed, or left the epoch); its own log says why")
            raise

    def _next_counted(self) -> Any:
        """The next batch when the ranks agreed on the count as the epoch began: no collective."""
        if self._steps_left <= 0:  # type: ignore[operator]
            self._end_epoch()
            raise StopIteration
        try:
            batch = self._engine.next_batch()
        except StopIteration:
            if not self._may_pad:  # the count was the least, or this rank's own: it cannot end early
                self._end_epoch()
                raise RuntimeError(
                    f"equal_batches={self._policy!r}: this rank's sampler ended before the batch "
                    "count it reported with len(), which the ranks agreed on; the other ranks go on"
                ) from None
            batch = self._repeat_last(final=self._steps_left == 1)
        except LoaderTimeoutError:
            raise  # no step happened
        except Exception:
            self._steps_left -= 1  # type: ignore[operator]  # a batch's error is a step
            raise
        else:
            if not isinstance(batch, PaddedBatch):
                self._handed_out += 1
                self._keep(batch)
        self._steps_left -= 1  # type: ignore[operator]
        return batch

    def _keep(self, batch: Any) -> None:
        """Keep a copy of a good batch about to be handed out, if this rank may repeat it."""
        if self._may_pad:
            self._kept = independent_copy(_without_marks(batch))

    def _repeat_last(self, final: bool = False) -> PaddedBatch:
        """The latest good batch again, as a copy nobody has seen (``final``: the epoch's last
        step, so the kept copy itself, which is not needed after it)."""
        if self._handed_out == 0:
            self._end_epoch()
            raise RuntimeError(
                "equal_batches='pad' cannot pad this rank: it had no batch at all this epoch, "
                "while another rank still has some. Shard the data so every rank gets at least "
                "one batch, or use equal_batches='drop'"
            )
        if final:
            kept, self._kept = self._kept, None
            return PaddedBatch(kept)
        return PaddedBatch(independent_copy(self._kept))

    def _end_epoch(self) -> None:
        self._ended = True
        self._kept = None

    def close(self) -> None:
        self._kept = None
        self._ended = True
        self._engine.close()


def _without_marks(batch: Any) -> Any:
    """A batch without the position or number the engine sent it with (progress needs those
    for the batches the engine makes, not for repeats)."""
    return batch.batch if isinstance(batch, (StreamBatch, NumberedBatch)) else batch


def independent_copy(batch: Any) -> Any:
    """A copy of a batch that shares no memory with it: changing one in place leaves the other.

    Walks a batch as ``pipeload.pin`` does: a tensor is cloned (its own elements only, not the
    rest of a shared-memory slab it views; pinned stays pinned); mappings, namedtuples, tuples
    and sequences are rebuilt with their own type where possible; strings, bytes and ranges
    are kept (they cannot change); anything else (numpy arrays, custom batch types) is deep-copied,
    which copies a tensor inside one whole storage and all (a view of a slab: the slab's size).

    Example:
        >>> batch = {"x": torch.zeros(2), "ids": ["a", "b"]}
        >>> again = independent_copy(batch)
        >>> _ = batch["x"].add_(1); batch["ids"].append("c")
        >>> again["x"].tolist(), again["ids"]
        ([0.0, 0.0], ['a', 'b'])
    """
    if isinstance(batch, torch.Tensor):
        return _tensor_copy(batch)
    if isinstance(batch, (str, bytes, range)):
        return batch
    # Rebuilt only where a shallow copy is a new container of its own (dict, list and their
    # subclasses): a mapping or sequence class that keeps its items in an attribute shares them
    # with its shallow copy, and is deep-copied instead.
    if isinstance(batch, dict):
        return rebuild_mapping(batch, {key: independent_copy(value) for key, value in batch.items()})
    if isinstance(batch, tuple):
        copies = [independent_copy(item) for item in batch]
        try:
            return type(batch)(*copies) if hasattr(batch, "_fields") else type(batch)(copies)
        except TypeError:  # a tuple subclass whose constructor takes something else
            return tuple(copies)  # as collate and pin do
    if isinstance(batch, list):
        return rebuild_sequence(batch, [independent_copy(item) for item in batch])
    return copy.deepcopy(batch)


def _tensor_copy(tensor: torch.Tensor) -> torch.Tensor:
    with torch.no_grad():
        if tensor.layout == torch.strided and tensor.is_pinned():
            copied = torch.empty_like(tensor, pin_memory=True).copy_(tensor)
        else:
            copied = tensor.clone()
    return copied.requires_grad_(tensor.requires_grad) if tensor.requires_grad else copied
