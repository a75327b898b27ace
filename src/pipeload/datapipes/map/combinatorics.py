"""shuffle on map-style pipes: an iterable pipe over the items in a random order."""

from __future__ import annotations

import random
from collections import Counter
from collections.abc import Iterator
from typing import Any, TypeVar

from pipeload._state_fields import StateFields
from pipeload.datapipes.base import IterDataPipe, MapDataPipe, get_nowait
from pipeload.datapipes.iter.combinatorics import SeededPipe
from pipeload.datapipes.protocol import PipeIterator
from pipeload.errors import bad_state_field

T_co = TypeVar("T_co", covariant=True)


class Shuffler(SeededPipe, IterDataPipe[T_co]):
    """Read a map-style pipe's items in a random order (functional name: ``shuffle``). On a
    map-style pipe it makes an iterable pipe: order is what iterable pipes are for.

    The random stream is torch's: the same seed gives the same order. Seeding works as for the
    iterable ``shuffle`` (``set_seed`` for the next run; the DataLoader seeds every epoch).

    Args:
        datapipe: the map-style pipe.
        indices: the keys to read (default ``range(len(datapipe))``).

    Example:
        >>> sorted(SequenceWrapper("abc").shuffle())
        ['a', 'b', 'c']
    """

    _parent_fields = ("datapipe",)

    def __init__(self, datapipe: MapDataPipe, *, indices: list[Any] | None = None) -> None:
        self.datapipe = datapipe
        self._indices = indices
        self._enabled = True
        self._seed: int | None = None

    @property
    def indices(self) -> list[Any]:
        """The keys to read: those given, else every key of the pipe as it is when read (a
        shardable map pipe upstream holds its shard's keys once the loader has sharded it; fixed
        when the shuffle was built, they ran past its end)."""
        if self._indices is not None:
            return self._indices
        return list(range(len(self.datapipe)))  # type: ignore[arg-type]

    @indices.setter
    def indices(self, keys: list[Any]) -> None:
        self._indices = keys

    def __iter__(self) -> Iterator[T_co]:
        return _MapShufflerIterator(self)

    def __len__(self) -> int:
        return len(self.datapipe)  # type: ignore[arg-type]


class _MapShufflerIterator(PipeIterator[Any]):
    def __init__(self, pipe: Shuffler[Any]) -> None:
        super().__init__()
        self._pipe = pipe
        self._keys: list[Any] | None = None  # popped from the end

    def nonblocking_next(self) -> Any:
        if self._keys is None:
            self._keys = self._order()
        if not self._keys:
            raise StopIteration
        item = get_nowait(self._pipe.datapipe, self._keys[-1])  # popped once read: NotAvailable keeps it
        self._keys.pop()
        return item

    def _order(self) -> list[Any]:
        pipe = self._pipe
        indices = pipe.indices
        if not pipe._enabled:
            return list(reversed(indices))
        rng = random.Random(pipe._take_seed())
        return rng.sample(indices, len(indices))

    def _own_state(self) -> Any:
        return None if self._keys is None else list(self._keys)

    def _check_own_state(self, fields: StateFields) -> Any:
        expected = "None or a list of the keys left (some of the shuffle's indices, each once)"
        keys = fields.sequence("own", expected, none=True)
        if keys is not None and not _some_of(keys, self._pipe.indices):
            raise bad_state_field(fields.name("own"), keys, expected)
        return None if keys is None else list(keys)

    def _load_own_state(self, state: Any) -> None:
        if state is not None and self._keys is None and self._pipe._enabled:
            self._pipe._take_seed()  # as the run that wrote it did: else the next run reuses it
        self._keys = state


def _some_of(keys: Any, indices: Any) -> bool:
    """Whether ``keys`` could be what is left of ``indices`` (each index at most as often)."""
    if len(keys) > len(indices):
        return False
    try:  # by type too: 5.0 and True are not the key 5, though Python finds them equal
        left = Counter((type(index), index) for index in indices)
        left.subtract((type(key), key) for key in keys)
    except TypeError:  # unhashable keys: only the count can be checked
        return True
    return all(count >= 0 for count in left.values())
