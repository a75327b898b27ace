"""Several pipes into one: concat, zip, mux, greedy_join."""

from __future__ import annotations

from collections import deque
from collections.abc import Iterator, Sized
from typing import Any

from pipeload._state_fields import StateFields, join
from pipeload.datapipes.base import IterDataPipe, is_iter_datapipe
from pipeload.datapipes.iter._columns import no_length
from pipeload.datapipes.protocol import NotAvailable, PipeIterator, SkipToResume, StateLoad, as_nonblocking


class Concater(IterDataPipe[Any]):
    """Every item of the first pipe, then of the second, ... (functional name: ``concat``).

    Each pipe's iterator is made when the one before it ends, as torch makes them.

    Args:
        *datapipes: the pipes, in order (at least one).

    Example:
        >>> list(IterableWrapper(range(3)).concat(IterableWrapper(range(2))))
        [0, 1, 2, 0, 1]
    """

    _parent_fields = ("datapipes",)

    def __init__(self, *datapipes: IterDataPipe) -> None:
        if not datapipes:
            raise ValueError("Expected at least one DataPipe, but got nothing")
        _check_all_pipes(datapipes, "Expected all inputs to be `IterDataPipe`")
        self.datapipes = datapipes

    def __iter__(self) -> Iterator[Any]:
        return _ConcaterIterator(self.datapipes)

    def __len__(self) -> int:
        if all(isinstance(dp, Sized) for dp in self.datapipes):
            return sum(len(dp) for dp in self.datapipes)  # type: ignore[arg-type]
        raise no_length(self)


def _check_all_pipes(datapipes: tuple[Any, ...], message: str) -> None:
    refused = [dp for dp in datapipes if not is_iter_datapipe(dp)]
    if refused:
        raise TypeError(f"{message} (got {', '.join(type(dp).__name__ for dp in refused)})")


class _ConcaterIterator(PipeIterator[Any]):
    """Iterators are made one at a time, when the previous pipe ends, as torch makes them."""

    def __init__(self, datapipes: tuple[Any, ...]) -> None:
        super().__init__()
        self._waiting = deque(datapipes)
        self._current: PipeIterator[Any] | None = None

    def nonblocking_next(self) -> Any:
        while True:
            if self._current is None:
                if not self._waiting:
                    raise StopIteration
                self._current = as_nonblocking(self._waiting.popleft())
                self.upstream = (self._current,)
            try:
                return self._current.nonblocking_next()
            except StopIteration:
                self._current.close()
                self._current = None
                self.upstream = ()

    def state_dict(self) -> dict[str, Any]:
        current = None if self._current is None else self._current.state_dict()
        return {"own": len(self._waiting), "upstream": [current]}

    def check_state(self, state: Any, path: str, load: StateLoad) -> None:
        fields = StateFields(state, path)
        (current,) = fields.sequence("upstream", "a list of one state (None between inputs)", length=1)  # type: ignore[misc]
        # pipes still waiting after the current one (if any) was started
        left = fields.integer("own", 0, len(self._waiting) - (current is not None))
        fields.finish()
        done = len(self._waiting) - left - (current is not None)  # inputs already read through
        source = None
        if current is not None:
            source = as_nonblocking(self._waiting[done])
            load.made(source)
            source.check_state(current, join(fields.name("upstream"), 0), load)

        def apply() -> None:
            for _ in range(done + (source is not None)):
                self._waiting.popleft()
            if source is not None:
                self._current = source
                self.upstream = (source,)
        load.then(apply)


class Zipper(IterDataPipe[tuple[Any, ...]]):
    """Tuples of one item from each pipe; ends with the shortest (functional name: ``zip``).

    Args:
        *datapipes: the pipes to zip.

    Example:
        >>> list(IterableWrapper(range(3)).zip(IterableWrapper("ab")))
        [(0, 'a'), (1, 'b')]
    """

    _parent_fields = ("datapipes",)

    def __init__(self, *datapipes: IterDataPipe) -> None:
        _check_all_pipes(datapipes, "All inputs are required to be `IterDataPipe` for `ZipIterDataPipe`.")
        self.datapipes = datapipes

    def __iter__(self) -> Iterator[tuple[Any, ...]]:
        return _RoundIterator(self.datapipes, as_tuples=True)

    def __len__(self) -> int:
        if all(isinstance(dp, Sized) for dp in self.datapipes):
            return min(len(dp) for dp in self.datapipes)  # type: ignore[arg-type]
        raise no_length(self)


class Multiplexer(IterDataPipe[Any]):
    """One item from each pipe in turn; stops, dropping the unfinished round, when any pipe ends
    (functional name: ``mux``).

    Args:
        *datapipes: the pipes to take turns between.

    Example:
        >>> list(IterableWrapper(range(3)).mux(IterableWrapper(range(10, 15))))
        [0, 10, 1, 11, 2, 12]
    """

    _parent_fields = ("datapipes",)

    def __init__(self, *datapipes: IterDataPipe) -> None:
        self.datapipes = datapipes

    def __iter__(self) -> Iterator[Any]:
        return _RoundIterator(self.datapipes, as_tuples=False)

    def __len__(self) -> int:
        if all(isinstance(dp, Sized) for dp in self.datapipes):
            return min(len(dp) for dp in self.datapipes) * len(self.datapipes)  # type: ignore[arg-type]
        raise no_length(self)


class _RoundIterator(SkipToResume, PipeIterator[Any]):
    """Collects one item from every source per round; a partial round survives NotAvailable.

    zip yields each round as a tuple; mux yields its items one by one. Either ends for good when
    any source ends, discarding that unfinished round and closing every source.
    """

    def __init__(self, datapipes: tuple[Any, ...], as_tuples: bool) -> None:
        super().__init__(*datapipes)
        self._as_tuples = as_tuples
        self._round: list[Any] = []
        self._ready: deque[Any] = deque()
        self._ended = not datapipes

    def nonblocking_next(self) -> Any:
        if self._ready:
            return self._ready.popleft()
        if self._ended:
            raise StopIteration
        while len(self._round) < len(self.upstream):
            try:
                self._round.append(self.upstream[len(self._round)].nonblocking_next())
            except StopIteration:
                self._ended, self._round = True, []
                self.close()  # the other sources are read no further: stop their threads and processes now
                raise
        completed, self._round = self._round, []
        if self._as_tuples:
            return tuple(completed)
        self._ready.extend(completed[1:])
        return completed[0]


class GreedyJoiner(IterDataPipe[Any]):
    """Whichever pipe has an item ready first; ends when every pipe has ended (functional name:
    ``greedy_join``).

    With queue boundaries or prefetchers upstream, a slow input never holds up a fast one: the
    join asks each input in turn without waiting (starting after the one that last delivered, so
    a always-ready input cannot starve the others) and sleeps only when none has anything. Inputs
    that compute synchronously are always ready, so over them this is a round-robin that runs on
    past the shortest.

    Args:
        *datapipes: the pipes to join (at least one).

    Example:
        >>> fast = IterableWrapper(range(3)).prefetch()
        >>> slow = IterableWrapper(range(100, 103)).map(slow_fn).queue_boundary("process")
        >>> sorted(fast.greedy_join(slow))
        [0, 1, 2, 100, 101, 102]
    """

    _parent_fields = ("datapipes",)

    def __init__(self, *datapipes: IterDataPipe) -> None:
        if not datapipes:
            raise ValueError("Expected at least one DataPipe, but got nothing")
        _check_all_pipes(datapipes, "Expected all inputs to be `IterDataPipe`")
        self.datapipes = datapipes

    def __iter__(self) -> Iterator[Any]:
        return _GreedyIterator(self.datapipes)

    def __len__(self) -> int:
        if all(isinstance(dp, Sized) for dp in self.datapipes):
            return sum(len(dp) for dp in self.datapipes)  # type: ignore[arg-type]
        raise no_length(self)


class _GreedyIterator(SkipToResume, PipeIterator[Any]):
    def __init__(self, datapipes: tuple[Any, ...]) -> None:
        super().__init__(*datapipes)
        self._live = list(self.upstream)
        self._next_turn = 0

    def nonblocking_next(self) -> Any:
        tried = 0
        while self._live and tried < len(self._live):
            turn = self._next_turn % len(self._live)
            source = self._live[turn]
            try:
                item = source.nonblocking_next()
            except NotAvailable:
                self._next_turn, tried = turn + 1, tried + 1
                continue
            except StopIteration:
                source.close()
                del self._live[turn]
                self._next_turn = turn  # the next input has moved into this place
                continue
            self._next_turn = turn + 1
            return item
        if not self._live:
            raise StopIteration
        raise NotAvailable

    def notifiers(self) -> list[Any]:
        found = []
        for source in self._live:
            found.extend(source.notifiers())
        return found

# torch's long names, for scripts that import them from torch's submodule of this name: the
# same classes (torch's package exports the short names, as ours does).
ConcaterIterDataPipe = Concater
MultiplexerIterDataPipe = Multiplexer
ZipperIterDataPipe = Zipper
# torch keeps fork and demux in this submodule; ours are in branching.py (imported last: it needs
# nothing of this module, and this module needs them only here).
from pipeload.datapipes.iter.branching import Demultiplexer, Forker  # noqa: E402

DemultiplexerIterDataPipe = Demultiplexer
ForkerIterDataPipe = Forker
