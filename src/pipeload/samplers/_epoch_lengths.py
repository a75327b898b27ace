"""A dataset's length, asked once for all that starting an epoch needs of it.

torch's loader asks a dataset's ``__len__`` once an epoch, when its sampler begins to draw.
pipeload's loader needs that length in more places as an epoch starts: the size of the last batch
(told to the workers), the epoch's checkpoint record, the stats' count of batches, and the draw
itself. A ``__len__`` is the user's code: it may list a store, open the file it counts in, or
count its calls. While an epoch's lengths are active (:meth:`EpochLengths.active`, entered by
``iter(loader)``, and without workers once more by the first ``next()``, around the sampler's
draw and the record of its state made then), a sampler asks each source once and reuses the
answer; outside of one (a user's own ``len(sampler)``, a dataset's ``__getitem__``), every
question asks again, as torch's samplers do. Without workers the sampler draws at the first
``next()``: the length then drawn from is the one the dataset has at the draw, as in torch. So
with workers (whose first draws ``iter()`` makes) the length is asked once an epoch; without,
twice (torch's loader asks it up to four times with a ``RandomSampler``).

A process forked while the lengths are active (a worker) forgets them: they would freeze every
length its own samplers ask for the rest of its life.
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Iterator, Sized
from contextvars import ContextVar

# id(source) -> (source, length): the source is held so that its id is not reused for the
# lifetime of the memo.
_Known = dict[int, tuple[Sized, int]]
_ACTIVE: ContextVar[_Known | None] = ContextVar("pipeload_epoch_lengths", default=None)


def length_of(source: Sized) -> int:
    """``len(source)``: asked once while an epoch's lengths are active, else every time."""
    known = _ACTIVE.get()
    if known is None:
        return len(source)
    entry = known.get(id(source))
    if entry is None or entry[0] is not source:
        entry = known[id(source)] = (source, len(source))  # a raising __len__ is not kept
    return entry[1]


def _forget_in_forked_child() -> None:
    _ACTIVE.set(None)


os.register_at_fork(after_in_child=_forget_in_forked_child)


class EpochLengths:
    """The lengths the start of one epoch asked. The context variable makes it the one samplers
    consult only while ``active()`` runs, in the thread that runs it (a thread started meanwhile
    begins with an empty context)."""

    def __init__(self) -> None:
        self._known: _Known = {}

    @contextlib.contextmanager
    def active(self) -> Iterator[None]:
        token = _ACTIVE.set(self._known)
        try:
            yield
        finally:
            _ACTIVE.reset(token)
