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
  its last batch again, once per missing step.

The question is one ``all_reduce`` of one integer over a gloo group per batch (tens of
microseconds on one machine, a network round trip across machines), and it needs an initialised
process group. When every rank knows its epoch's batch count in advance (a map-style dataset
whose samplers are torch's or ours: their lengths are exact and they cannot fail mid-epoch), the
ranks agree once, as the epoch starts, on the count to stop at (the least for ``"drop"``, the
most for ``"pad"``), and then count their steps without asking again.
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Iterator
from typing import Any, NamedTuple

from pipeload.distributed import all_ranks_agree, all_ranks_range, current_placement
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
    rank agreed that this epoch is over; ``_last`` is the batch to repeat (``"pad"`` only);
    ``_steps_left`` is None while the ranks agree batch by batch, else the steps every rank
    still takes this epoch (agreed as it began).
    """

    def __init__(self, engine: Any, policy: str) -> None:
        self._engine = engine
        self._policy = policy
        self._last: Any = None
        self._handed_out = 0
        self._ended = True
        self._steps_left: int | None = None

    workers = property(lambda self: self._engine.workers)
    closed = property(lambda self: self._engine.closed)
    inner = property(lambda self: self._engine)

    def start_epoch(self, tasks: Iterator[Any], shared_seed: int | None = None,
                    start: EpochStart = EpochStart()) -> None:
        self._engine.start_epoch(tasks, shared_seed, start=start)
        self._last = None
        self._handed_out = 0
        self._ended = False
        self._steps_left = None
        if start.epoch_batches is not None:  # a collective every rank makes as its epoch starts
            fewest, most = self._ask_ranks(all_ranks_range, start.epoch_batches,
                                           "how many batches its epoch has")
            self._steps_left = (fewest if self._policy == "drop" else most) - start.steps_done
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
        if self._policy == "pad":
            self._last = batch
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
        if self._policy == "pad":
            self._last = batch
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
            if self._policy == "drop":  # the count was the least: a known length cannot end early
                self._end_epoch()
                raise RuntimeError(
                    "equal_batches='drop': this rank's sampler ended before the batch count it "
                    "reported with len(), which the ranks agreed on; the other ranks go on") from None
            batch = self._repeat_last()
        except LoaderTimeoutError:
            raise  # no step happened
        except Exception:
            self._steps_left -= 1  # type: ignore[operator]  # a batch's error is a step
            raise
        else:
            if not isinstance(batch, PaddedBatch):
                self._handed_out += 1
                if self._policy == "pad":
                    self._last = batch
        self._steps_left -= 1  # type: ignore[operator]
        return batch

    def _repeat_last(self) -> Any:
        if self._handed_out == 0:
            self._end_epoch()
            raise RuntimeError(
                "equal_batches='pad' cannot pad this rank: it had no batch at all this epoch, "
                "while another rank still has some. Shard the data so every rank gets at least "
                "one batch, or use equal_batches='drop'"
            )
        return PaddedBatch(self._last)

    def _end_epoch(self) -> None:
        self._ended = True
        self._last = None

    def close(self) -> None:
        self._last = None
        self._ended = True
        self._engine.close()
