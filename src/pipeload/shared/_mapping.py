"""SharedMapping: a read-only dict whose keys, values and hash index live in one shared segment."""

from __future__ import annotations

import reprlib
from collections.abc import Callable, ItemsView, Iterable, Iterator, Mapping, ValuesView
from dataclasses import dataclass
from typing import Any, TypeVar

from pipeload.shared._columns import ColumnLayout, column_reader, text_offsets, write_column
from pipeload.shared._index import IndexLayout, UnsupportedKey, key_finder, write_index
from pipeload.shared._nan import holds_nan, same_value
from pipeload.shared._segment import Segment, SegmentBacked, SegmentWriter

K = TypeVar("K")
V = TypeVar("V")
_SHORT = reprlib.Repr()
_SHORT.maxdict, _SHORT.maxstring, _SHORT.maxother = 4, 60, 60
_MISSING = object()


@dataclass(frozen=True)
class _MappingLayout:
    keys: ColumnLayout
    values: ColumnLayout
    index: IndexLayout


class SharedMapping(SegmentBacked, Mapping[K, V]):
    """A read-only dict kept outside Python's reference counting, shared by every worker.

    Built from a dict (or anything ``dict()`` accepts). Keys must be ``str``, ``bytes``, ``int``,
    ``float``, ``bool``, ``None`` or tuples of these; values may be any picklable objects, with
    the same fast paths as :class:`SharedSequence`. Lookups hash the key the same way in every
    process (spawned workers included) and decode a fresh value each time, so workers never write
    to, and never copy, the pages that hold the data. Iteration follows the dict's order.

    Supports ``m[key]``, ``in``, ``len``, iteration (``reversed`` too), ``get``, ``keys()``,
    ``values()``, ``items()``, ``==`` with any mapping, and, giving a plain dict, ``copy()`` and
    ``|``. ``json.dumps`` takes dicts only: ``json.dumps(dict(m))``. The memory is freed when the last user in every
    process drops (or closes) it; nothing is ever left in ``/dev/shm``.

    Args:
        mapping: the entries, as a mapping or an iterable of ``(key, value)`` pairs.

    Raises:
        TypeError: a key of another type, or a value that cannot be pickled (the message names its key).

    Example:
        >>> labels = SharedMapping({"cat.jpg": 3, "dog.jpg": 5})
        >>> labels["dog.jpg"], "cow.jpg" in labels, labels.get("cow.jpg", -1)
        (5, False, -1)
    """

    __slots__ = ("_segment", "_layout", "_read_key", "_read_value", "_find_key", "_data", "_value_text_offsets",
                 "__weakref__")

    def __init__(self, mapping: Mapping[K, V] | Iterable[tuple[K, V]] = (), /) -> None:
        if isinstance(mapping, SharedMapping):
            self._attach(mapping._segment, mapping._layout)
            return
        entries = mapping if isinstance(mapping, dict) else dict(mapping)
        keys, values = list(entries), list(entries.values())
        writer = SegmentWriter(f"a SharedMapping of {len(keys):,} entries")
        try:
            index = write_index(writer, keys)
            key_layout = write_column(writer, keys, "SharedMapping", "key number {}".format)
            value_layout = write_column(writer, values, "SharedMapping",
                                        lambda n: f"the value of key {_SHORT.repr(keys[n])}")
        except BaseException:
            writer.abandon()
            raise
        self._attach(writer.finish(), _MappingLayout(key_layout, value_layout, index))

    def _attach(self, segment: Segment, layout: _MappingLayout) -> None:
        self._segment = segment
        self._layout = layout
        self._read_key: Callable[[int], K] = column_reader(segment, layout.keys)
        self._read_value: Callable[[int], V] = column_reader(segment, layout.values)
        self._find_key = key_finder(segment, layout.index, self._read_key, text_offsets(segment, layout.keys))
        self._data = segment.data
        self._value_text_offsets = text_offsets(segment, layout.values)  # str values: decoded inline

    # Lookups call the finder directly, not through a helper method: a dict lookup is cheap, and
    # one Python call less is a good part of what a shared one costs on top.

    def __getitem__(self, key: K) -> V:
        try:
            number = self._find_key(key)
        except (UnsupportedKey, ValueError):
            number = None  # sorted out below, so that errors raised there stand alone
        if number is None:
            number = self._find_slowly(key)
        if number < 0:
            raise KeyError(key)
        offsets = self._value_text_offsets
        if offsets is not None:
            return self._data[offsets[number] : offsets[number + 1]].decode()  # type: ignore[return-value]
        return self._read_value(number)

    def get(self, key: K, default: Any = None) -> Any:
        try:
            number = self._find_key(key)
        except (UnsupportedKey, ValueError):
            number = None
        if number is None:
            number = self._find_slowly(key)
        return default if number < 0 else self._read_value(number)

    def __contains__(self, key: object) -> bool:
        try:
            number = self._find_key(key)
        except (UnsupportedKey, ValueError):
            number = None
        if number is None:
            number = self._find_slowly(key)
        return number >= 0

    def _find_slowly(self, key: Any) -> int:
        """After the finder failed: a closed mapping, or a key of a type never stored here."""
        self._check_open()
        try:
            return self._find_key(key)
        except UnsupportedKey:
            hash(key)  # an unhashable key raises TypeError, as with a dict
            return -1  # a hashable key of another type cannot be stored here

    def __len__(self) -> int:
        return self._layout.keys.length

    def __iter__(self) -> Iterator[K]:
        self._check_open()
        return self._reading(map(self._read_key, range(len(self))))

    def values(self) -> ValuesView[V]:
        return _Values(self)

    def items(self) -> ItemsView[K, V]:
        return _Items(self)

    def _iter_values(self) -> Iterator[V]:
        self._check_open()
        return self._reading(map(self._read_value, range(len(self))))

    def __eq__(self, other: object) -> bool:
        if not isinstance(other, Mapping):
            return NotImplemented
        if other is self or (isinstance(other, SharedMapping) and other._segment is self._segment):
            return True
        if len(self) != len(other):
            return False
        return all(_holds_entry(other, key, value) for key, value in self.items())

    __hash__ = None  # type: ignore[assignment]

    # What a dict offers besides Mapping's and reads only, so that dataset code that did
    # ``self.meta.copy()`` or ``defaults | self.meta`` on the dict keeps working: each gives a
    # plain dict (a copy to change is what such code wants; this one cannot be changed).

    def copy(self) -> dict[K, V]:
        """A plain dict of the entries, in order (``dict.copy``'s result, which may be changed)."""
        return dict(self.items())

    def __or__(self, other: object) -> dict[Any, Any]:
        if not isinstance(other, Mapping):
            return NotImplemented
        merged = self.copy()
        merged.update(other)
        return merged

    def __ror__(self, other: object) -> dict[Any, Any]:
        if not isinstance(other, Mapping):
            return NotImplemented
        merged = dict(other)
        merged.update(self.items())
        return merged

    def __reversed__(self) -> Iterator[K]:
        self._check_open()
        return self._reading(map(self._read_key, reversed(range(len(self)))))

    def __repr__(self) -> str:
        if self.closed:
            return f"<closed SharedMapping of {len(self)} entries>"
        text = _SHORT.repr(dict(_first(self, min(len(self), 5))))
        return f"SharedMapping({text})" if len(self) <= 4 else f"SharedMapping({text}, len={len(self)})"

    def __reduce__(self) -> Any:
        return (_rebuild, (type(self), self._segment, self._layout))


class _Values(ValuesView):
    """Iterates the values column directly instead of looking every key up again."""

    _mapping: SharedMapping[Any, Any]

    def __iter__(self) -> Iterator[Any]:
        return self._mapping._iter_values()


class _Items(ItemsView):
    _mapping: SharedMapping[Any, Any]

    def __iter__(self) -> Iterator[tuple[Any, Any]]:
        return zip(self._mapping, self._mapping._iter_values())


def _holds_entry(other: Mapping[Any, Any], key: Any, value: Any) -> bool:
    """Whether ``other`` maps ``key`` to ``value``, a NaN (in a key or a value) matching any NaN."""
    theirs = other.get(key, _MISSING)
    if theirs is _MISSING and holds_nan(key):
        # A dict finds its NaN key only by identity, and ours is read back as a new float.
        theirs = next((v for k, v in other.items() if same_value(k, key)), _MISSING)
    return theirs is not _MISSING and same_value(theirs, value)


def _first(mapping: SharedMapping[Any, Any], count: int) -> list[tuple[Any, Any]]:
    return [(mapping._read_key(i), mapping._read_value(i)) for i in range(count)]


def _rebuild(cls: type[SharedMapping[Any, Any]], segment: Segment, layout: _MappingLayout) -> Any:
    mapping = cls.__new__(cls)
    mapping._attach(segment, layout)
    return mapping
