"""Where a run across a queue boundary stands, so that it can be checkpointed and resumed.

The upstream iterator lives beyond the boundary (in the producing thread or process), so the
consuming side cannot ask it for its state when a checkpoint is taken. Instead the producer
takes the upstream iterator's ``state_dict()`` right after it makes an item, and the consumer
pairs the latest one at or before its own position with the items it handed downstream since:
that pair is the boundary's checkpoint. A resumed run (:class:`Resume`) loads the state into a
fresh upstream iterator, makes again and drops the items counted, then goes on (the scheme of
the Ray boundary's actors, ``ray_shard.py``).

Where the states go: a thread producer writes them into a :class:`StateLog` the consumer reads
(no copy: a ``state_dict()`` returns objects its pipe does not change afterwards, a copy of any
buffer, as pipeload's pipes do); a process producer pickles it (timed with the state: its cost
counts) and sends it with the item (:class:`Carrying`).

How often (:class:`StateTaker`): once the time since the last state is ``COST_RATIO`` times
what that state cost to take (and, for a process consumer, to pickle), so states take about 2%
of the producer's time. A cheap state (a webdataset reader's: ~1 us beside ~40 us a raw sample)
comes after every item or two, and a resume makes again, and drops, that many; a dear one (a
shuffle buffer of 100 copied with its generator, ~10 us) comes every few dozen cheap items.
Behind a thread boundary the two threads share the GIL, so a pipe of nearly free items read
straight through runs up to ~7% slower for it, one of ~25 us items 2% to 6% (``python -m
bench.datapipes --boundary-states``); a pipe that decodes images, none that a run can see.
"""

from __future__ import annotations

import math
import pickle
import threading
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

COST_RATIO = 50  # states cost at most ~2% of the producer's time
_FAR = float(1 << 40)  # items "never" to wait, for a ratio made infinite (bench.datapipes)


@dataclass(frozen=True)
class UpstreamState:
    """The upstream iterator's state as a process producer sends it: pickled (``pickled``; None:
    at its start, or none), or why it has none (``unavailable``: its ``NotImplementedError``)."""

    pickled: bytes | None = None
    unavailable: str | None = None

    def state(self) -> Any:
        """The state itself (None: the upstream at its start), read back when asked for."""
        return None if self.pickled is None else pickle.loads(self.pickled)

    @classmethod
    def of(cls, state: Any) -> UpstreamState:
        return cls(None if state is None else pickle.dumps(state, protocol=pickle.HIGHEST_PROTOCOL))


@dataclass(frozen=True)
class Carrying:
    """An item that carries the upstream's state after it, across a process queue (one message:
    a separate one would take a place, and a slab grant, of its own)."""

    item: Any
    state: UpstreamState


@dataclass(frozen=True)
class Resume:
    """Where a resumed run starts: ``upstream_state`` loaded into the fresh upstream iterator
    (None: its start), then ``skip`` items made and dropped."""

    upstream_state: Any
    skip: int


START = UpstreamState()  # a run before its first item: the upstream at its start


class StateLog:
    """A thread producer's states by item count, for its consumer (the only two users).

    ``record(count, state)``: the upstream's state after its first ``count`` items of the run.
    ``at(position)``: the latest state at or before ``position`` and its count. Only what the
    consumer may still ask for is kept: it is never more than ``lag`` items behind the producer
    (the queue's size and the items in the two threads' hands).
    """

    def __init__(self, lag: int) -> None:
        self._lag = lag
        self._lock = threading.Lock()
        self._entries: deque[tuple[int, Any]] = deque([(0, None)])  # the run's start
        self.unavailable: str | None = None

    def record(self, count: int, state: Any) -> None:
        oldest_wanted = count - self._lag
        with self._lock:
            entries = self._entries
            entries.append((count, state))
            while len(entries) > 1 and entries[1][0] <= oldest_wanted:
                entries.popleft()  # a later one serves every position the consumer can be at

    def no_state(self, why: str) -> None:
        self.unavailable = why

    def at(self, position: int) -> tuple[int, Any]:
        with self._lock:
            for count, state in reversed(self._entries):
                if count <= position:
                    return count, state
        raise AssertionError(f"no state at or before item {position}: the log kept too few")


class StateTaker:
    """The producer's side: take the upstream's state after an item when it is cheap enough
    (see the module's note), and hand it to ``sink(count, state)``; ``missing(why)`` hears once
    that the upstream has none (its ``NotImplementedError``), after which no state is taken.

    Per item the producer only counts down ``left`` (a clock read per item cost a cheap pipe a
    tenth of its rate); at zero it calls :meth:`take`, which takes the state if it is due and
    sets how many items to wait before looking again, from the items' rate since the last one.
    """

    def __init__(self, sink: Callable[[int, Any], None], missing: Callable[[str], None]) -> None:
        self._sink = sink
        self._missing = missing
        self._count = 0  # items made before the current countdown
        self.left = 1  # the first state comes after the first item
        self._asked = 1
        # What a state costs: the least of the latest few (one taken while this thread was
        # preempted would otherwise space the next ones out for nothing).
        self._costs: deque[float] = deque(maxlen=8)
        self._cost_s = 0.0
        self._since = time.perf_counter()
        self._items_since = 0

    def take(self, iterator: Any) -> None:
        """The countdown ran out: take the state after the latest item if it is due."""
        self._count += self._asked
        self._items_since += self._asked
        started = time.perf_counter()
        elapsed = started - self._since
        wanted = COST_RATIO * self._cost_s
        if elapsed < wanted:  # not yet: look again when the items' rate says it will be due
            per_item = elapsed / self._items_since
            self._wait((wanted - elapsed) / per_item if per_item > 0 else 1)
            return
        try:
            state = iterator.state_dict()
        except NotImplementedError as missing:
            self.left = -1  # never again: it will not have one later either
            self._missing(str(missing) or type(iterator).__name__)
            return
        self._sink(self._count, state)
        ended = time.perf_counter()
        self._costs.append(ended - started)
        self._cost_s = min(self._costs)
        per_item = elapsed / self._items_since
        self._since, self._items_since = ended, 0
        self._wait(COST_RATIO * self._cost_s / per_item if per_item > 0 else 1)

    def _wait(self, items: float) -> None:
        self._asked = self.left = max(1, math.ceil(min(items, _FAR)))


def resumed(iterator: Any, resume: Resume | None, take: Callable[[], Any]) -> None:
    """Bring a fresh upstream ``iterator`` to where ``resume`` says (nothing when None): load its
    state, then make and drop ``resume.skip`` items with ``take``."""
    if resume is None:
        return
    if resume.upstream_state is not None:
        iterator.load_state_dict(resume.upstream_state)
    for _ in range(resume.skip):
        take()
