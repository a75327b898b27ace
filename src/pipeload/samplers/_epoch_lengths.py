"""A dataset's length, asked once an epoch.

torch's loader asks a dataset's ``__len__`` once an epoch, when its sampler begins to draw.
pipeload's loader needs that length in more places as an epoch starts: the size of the last batch
(told to the workers), the epoch's checkpoint record, the stats' count of batches, and the draw
itself. A ``__len__`` is the user's code: it may list a store, open the file it counts in, or
count its calls. While an epoch's lengths are active (:meth:`EpochLengths.active`, entered by the
loader around the start of each epoch), a sampler asks each source once and reuses the answer;
outside of one (a user's own ``len(sampler)``), every question asks again, as torch's samplers do.
"""

from __future__ import annotations

import contextlib
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


class EpochLengths:
    """The lengths one epoch asked, kept between the calls that start it (``iter(loader)`` and
    the first ``next``). Owned by the loader's epoch; the context variable makes it the one that
    samplers consult only while one of those calls runs, in the thread that runs it."""

    def __init__(self) -> None:
        self._known: _Known = {}

    @contextlib.contextmanager
    def active(self) -> Iterator[None]:
        token = _ACTIVE.set(self._known)
        try:
            yield
        finally:
            _ACTIVE.reset(token)
