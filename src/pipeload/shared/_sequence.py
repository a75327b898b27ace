"""SharedSequence: a read-only list whose items live in one shared segment."""

from __future__ import annotations

import reprlib
import sys
from collections.abc import Callable, Iterable, Iterator, Sequence
from multiprocessing.context import get_spawning_popen
from typing import Any, TypeVar, overload

from pipeload.shared._columns import ColumnLayout, column_reader, text_offsets, write_column
from pipeload.shared._nan import same_value
from pipeload.shared._segment import Segment, SegmentBacked, SegmentWriter

T = TypeVar("T")
_SHORT = reprlib.Repr()
_SHORT.maxlist, _SHORT.maxstring, _SHORT.maxother = 5, 60, 60


class SharedSequence(SegmentBacked, Sequence[T]):
    """A read-only list kept outside Python's reference counting, shared by every worker.

    Built from any iterable of picklable values. The items are encoded once into one memory
    segment that the main process and all its workers map; reading an item decodes a fresh
    object from it, so forked workers never write to (and so never copy) pages of the dataset,
    and spawn/forkserver workers receive a handle to the segment instead of a pickled copy.
    Lists of ``str``, ``bytes``, ``int`` or ``float`` (and tuples of them, such as
    ``(path, label)``) take fast paths; other values are pickled one by one.

    Supports ``len``, indexing (negative too), slicing (a view that shares the segment),
    iteration, ``in``, ``index``, ``count``, ``==`` and ``<`` (and the other comparisons) with
    lists, tuples and other SharedSequences, and ``+`` and ``*``, which give a new list.
    ``json.dumps`` takes lists and tuples only: ``json.dumps(list(s))``. The memory is freed when the last SharedSequence (or view) using it is
    dropped or closed in every process; nothing is ever left in ``/dev/shm``.

    Args:
        items: the values, in order.

    Raises:
        TypeError: an item cannot be pickled (the message gives its index).

    Example:
        >>> paths = SharedSequence([f"img_{i}.jpg" for i in range(3)])
        >>> paths[-1], len(paths), paths[1:] == ["img_1.jpg", "img_2.jpg"]
        ('img_2.jpg', 3, True)
    """

    __slots__ = ("_segment", "_layout", "_positions", "_read", "_data", "_text_offsets", "__weakref__")

    def __init__(self, items: Iterable[T] = ()) -> None:
        if isinstance(items, SharedSequence):
            self._attach(items._segment, items._layout, items._positions)
            return
        values = items if isinstance(items, (list, tuple)) else list(items)
        writer = SegmentWriter(f"a SharedSequence of {len(values):,} items")
        try:
            layout = write_column(writer, values, "SharedSequence")
        except BaseException:
            writer.abandon()
            raise
        self._attach(writer.finish(), layout, range(len(values)))

    def _attach(self, segment: Segment, layout: ColumnLayout, positions: range) -> None:
        self._segment = segment
        self._layout = layout
        self._positions = positions  # which stored items this sequence (or view) shows, in order
        self._read: Callable[[int], T] = column_reader(segment, layout)
        # Lists of strings are the common case: __getitem__ decodes them inline, saving a call.
        self._data = segment.data
        self._text_offsets = text_offsets(segment, layout)

    @classmethod
    def _view(cls, segment: Segment, layout: ColumnLayout, positions: range) -> SharedSequence[T]:
        view = cls.__new__(cls)
        view._attach(segment, layout, positions)
        return view

    def __len__(self) -> int:
        return len(self._positions)

    @overload
    def __getitem__(self, index: int) -> T: ...
    @overload
    def __getitem__(self, index: slice) -> SharedSequence[T]: ...

    def __getitem__(self, index: Any) -> Any:
        # The fast path serves an int index; anything else (a slice, a bad index, a closed
        # sequence) fails in it and is sorted out below, outside the handler, so that errors
        # raised there do not carry this one along as their context.
        try:
            position = self._positions[index]  # range does a list's work: negatives, bounds, __index__
            offsets = self._text_offsets
            if offsets is not None:
                return self._data[offsets[position] : offsets[position + 1]].decode()
            return self._read(position)
        except (IndexError, TypeError, ValueError):
            pass
        return self._getitem_slowly(index)

    def _getitem_slowly(self, index: Any) -> Any:
        self._check_open()
        try:
            position = self._positions[index]
        except IndexError:
            raise IndexError(f"SharedSequence index {index} out of range (length {len(self)})") from None
        except TypeError:
            raise TypeError(
                f"SharedSequence indices must be integers or slices, not {type(index).__name__}"
            ) from None
        if type(position) is range:
            return self._view(self._segment, self._layout, position)
        return self._read(position)  # raises again what the fast path met (an item's unpickling)

    def __iter__(self) -> Iterator[T]:
        self._check_open()
        return self._reading(map(self._read, self._positions))

    def __reversed__(self) -> Iterator[T]:
        self._check_open()
        return self._reading(map(self._read, reversed(self._positions)))

    def index(self, value: Any, start: int = 0, stop: int = sys.maxsize) -> int:
        """The first position of ``value`` in ``self[start:stop]``, as ``list.index`` finds it."""
        self._check_open()
        for number in range(len(self))[start:stop]:  # a slice clamps start and stop as a list does
            item = self._read(self._positions[number])
            if same_value(item, value):
                return number
        # collections.abc.Sequence.index raises a bare ValueError; a list names the value.
        raise ValueError(f"{value!r} is not in SharedSequence")

    # A list tries identity before ==, which finds a NaN it holds; ours are read back as new
    # objects, so NaN matches NaN instead (the design note's "NaN" section).

    def __contains__(self, value: object) -> bool:
        return any(same_value(item, value) for item in self)

    def count(self, value: Any) -> int:
        """How many items equal ``value`` (a NaN counts every NaN)."""
        return sum(1 for item in self if same_value(item, value))

    def __eq__(self, other: object) -> bool:
        if not isinstance(other, (SharedSequence, list, tuple)):
            return NotImplemented
        if len(self) != len(other):
            return False
        if isinstance(other, SharedSequence) and other._segment is self._segment:
            if other._positions == self._positions:
                return True
        return all(same_value(mine, theirs) for mine, theirs in zip(self, other))

    __hash__ = None  # type: ignore[assignment]  # equal to lists, which are unhashable

    # What lists and tuples offer besides Sequence's and reads only, so that dataset code that
    # did ``self.samples + extra`` keeps working: a new list (a tuple with a tuple on the left),
    # as the list this one stands for would give; and order comparisons, item by item.

    def __add__(self, other: object) -> list[Any]:
        if not isinstance(other, (SharedSequence, list, tuple)):
            return NotImplemented
        return [*self, *other]

    def __radd__(self, other: object) -> Any:
        if isinstance(other, tuple):
            return other + tuple(self)
        if isinstance(other, list):
            return other + list(self)
        return NotImplemented

    def __mul__(self, times: object) -> list[Any]:
        if not hasattr(times, "__index__"):
            return NotImplemented
        return list(self) * times  # type: ignore[operator]

    __rmul__ = __mul__

    def _ordered(self, other: object) -> tuple[list[Any], list[Any]] | None:
        if not isinstance(other, (SharedSequence, list, tuple)):
            return None
        return list(self), list(other)

    def __lt__(self, other: object) -> bool:
        pair = self._ordered(other)
        return NotImplemented if pair is None else pair[0] < pair[1]

    def __le__(self, other: object) -> bool:
        pair = self._ordered(other)
        return NotImplemented if pair is None else pair[0] <= pair[1]

    def __gt__(self, other: object) -> bool:
        pair = self._ordered(other)
        return NotImplemented if pair is None else pair[0] > pair[1]

    def __ge__(self, other: object) -> bool:
        pair = self._ordered(other)
        return NotImplemented if pair is None else pair[0] >= pair[1]

    def __repr__(self) -> str:
        if self.closed:
            return f"<closed SharedSequence of {len(self)} items>"
        text = _SHORT.repr(list(self[:6]))
        return f"SharedSequence({text})" if len(self) <= 5 else f"SharedSequence({text}, len={len(self)})"

    def __reduce__(self) -> Any:
        # The segment pickles as a handle while a worker process starts, as bytes otherwise. A
        # view sent any other way (a slice a worker returns as its item) carries only its own
        # items: the whole segment's bytes could be thousands of times more.
        whole = self._positions == range(self._layout.length)
        if whole or get_spawning_popen() is not None:
            return (_rebuild, (type(self), self._segment, self._layout, self._positions))
        self._check_open()
        return (_from_items, (type(self), list(self)))


def _rebuild(cls: type[SharedSequence[Any]], segment: Segment, layout: ColumnLayout, positions: range) -> Any:
    return cls._view(segment, layout, positions)


def _from_items(cls: type[SharedSequence[Any]], items: list[Any]) -> Any:
    sequence = cls.__new__(cls)
    SharedSequence.__init__(sequence, items)
    return sequence
