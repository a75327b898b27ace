"""Columns: how a list of Python values is laid out in a segment, and read back one at a time.

A column stores ``length`` values of one kind, chosen from the values themselves:

* ``INT`` / ``FLOAT``: every value is exactly an ``int`` (fitting 64 bits) / a ``float``; they are
  packed as int64 / float64, and reading one is a single typed-memory lookup.
* ``STR`` / ``BYTES`` / ``PICKLE``: variable-sized values, concatenated, with an int64 offsets
  array (``length + 1`` absolute positions in the segment). Strings are UTF-8; a column with lone
  surrogates (as ``os.fsdecode`` makes them) is ``STR_ESCAPED`` and read with ``surrogatepass``,
  which costs a little more per read. Anything else is pickled value by value.
* ``RECORD``: every value is a tuple of the same small width, such as ``(path, label)``; each
  field is its own column, so a tuple of a string and an int is read with the fast paths above.

Reading builds a fresh Python object from the bytes each time: nothing read in a worker keeps a
reference count on a shared page.
"""

from __future__ import annotations

import enum
import pickle
from array import array
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from itertools import accumulate, islice
from operator import itemgetter
from typing import Any

from pipeload.shared._segment import Segment, SegmentWriter, pickling_into_a_segment

CHUNK_ITEMS = 65_536  # values encoded per write: bounds the temporary bytes while building
MAX_RECORD_WIDTH = 16
_TEXT_ERRORS = "surrogatepass"


class Kind(enum.IntEnum):
    """How one column's values are stored."""

    INT = 1
    """Packed int64."""
    FLOAT = 2
    """Packed float64."""
    STR = 3
    """UTF-8 bytes between offsets."""
    STR_ESCAPED = 7
    """UTF-8 bytes between offsets, some with lone surrogates (read with ``surrogatepass``)."""
    BYTES = 4
    """Raw bytes between offsets."""
    PICKLE = 5
    """One pickle per value, between offsets."""
    RECORD = 6
    """Tuples of one width: one column per field."""


@dataclass(frozen=True)
class ColumnLayout:
    """Where a column lives in its segment. Small and picklable: it travels with the handle.

    Attributes:
        kind: how values are stored.
        length: number of values.
        start: where the packed values (INT, FLOAT) or the offsets (STR, BYTES, PICKLE) begin.
        fields: one layout per tuple field (RECORD).
    """

    kind: Kind
    length: int
    start: int = 0
    fields: tuple[ColumnLayout, ...] = ()


def write_column(
    writer: SegmentWriter, values: Sequence[Any], what: str, name: Callable[[int], str] = "item {}".format
) -> ColumnLayout:
    """Append ``values`` to the segment being written.

    In errors, ``what`` names the container and ``name(n)`` value ``n`` (a mapping names its key).
    """
    kind = _choose_kind(values)
    if kind is Kind.RECORD:
        width = len(values[0])
        fields = tuple(
            write_column(writer, list(map(itemgetter(field), values)), f"{what} (tuple field {field})", name)
            for field in range(width)
        )
        return ColumnLayout(kind, len(values), fields=fields)
    if kind in (Kind.INT, Kind.FLOAT):
        packed = array("q" if kind is Kind.INT else "d", values)
        writer.align()
        return ColumnLayout(kind, len(values), writer.write(packed))
    start, escaped = _write_variable(writer, values, kind, _encoder(kind, what, name))
    return ColumnLayout(Kind.STR_ESCAPED if escaped else kind, len(values), start)


def _choose_kind(values: Sequence[Any]) -> Kind:
    types = set(map(type, values))
    if not types or types == {int}:
        if not types or _fits_int64(values):
            return Kind.INT
        return Kind.PICKLE
    if len(types) > 1:
        return Kind.PICKLE
    only = types.pop()
    if only is float:
        return Kind.FLOAT
    if only is str:
        return Kind.STR
    if only is bytes:
        return Kind.BYTES
    if only is tuple and len(widths := set(map(len, values))) == 1 and 0 < widths.pop() <= MAX_RECORD_WIDTH:
        return Kind.RECORD
    return Kind.PICKLE


def _fits_int64(values: Sequence[int]) -> bool:
    try:
        array("q", (min(values), max(values)))
    except OverflowError:
        return False
    return True


def _write_variable(
    writer: SegmentWriter, values: Sequence[Any], kind: Kind, encode: Callable[[Sequence[Any], int], list[bytes]]
) -> tuple[int, bool]:
    """Write the values' bytes back to back, then their offsets.

    Returns where the offsets are, and whether some string needed ``surrogatepass``.
    """
    offsets = array("q", [writer.position])
    escaped = False
    for chunk_start in range(0, len(values), CHUNK_ITEMS):
        chunk = values[chunk_start : chunk_start + CHUNK_ITEMS]
        try:
            pieces = encode(chunk, chunk_start)
        except UnicodeEncodeError:  # lone surrogates (os.fsdecode of an undecodable file name)
            pieces, escaped = [value.encode("utf-8", _TEXT_ERRORS) for value in chunk], True
        offsets.extend(islice(accumulate(map(len, pieces), initial=offsets[-1]), 1, None))
        writer.write(b"".join(pieces))
    writer.align()
    return writer.write(offsets), escaped


def _encoder(kind: Kind, what: str, name: Callable[[int], str]) -> Callable[[Sequence[Any], int], list[bytes]]:
    if kind is Kind.STR:
        return lambda chunk, _: [value.encode() for value in chunk]
    if kind is Kind.BYTES:
        return lambda chunk, _: list(chunk)

    def pickle_each(chunk: Sequence[Any], first: int) -> list[bytes]:
        pieces = []
        with pickling_into_a_segment():  # a shared container among the values: no segment per read
            for number, value in enumerate(chunk, first):
                try:
                    pieces.append(pickle.dumps(value, pickle.HIGHEST_PROTOCOL))
                except Exception as exc:
                    raise TypeError(
                        f"{what}: {name(number)} ({_short(value)}) cannot be stored in shared memory "
                        f"because this {type(value).__qualname__} cannot be pickled: {exc}"
                    ) from exc
        return pieces

    return pickle_each


def _short(value: Any) -> str:
    text = repr(value)
    return text if len(text) <= 80 else text[:77] + "..."


def text_offsets(segment: Segment, layout: ColumnLayout) -> memoryview | None:
    """The offsets of a ``STR`` column, for readers that decode inline; None for other kinds."""
    return segment.array(layout.start, layout.length + 1, "q") if layout.kind is Kind.STR else None


def column_reader(segment: Segment, layout: ColumnLayout) -> Callable[[int], Any]:
    """A function that returns value ``i`` (0 <= i < length) of the column, freshly decoded."""
    kind = layout.kind
    if kind is Kind.RECORD:
        return _record_reader([column_reader(segment, field) for field in layout.fields])
    if kind in (Kind.INT, Kind.FLOAT):
        return segment.array(layout.start, layout.length, "q" if kind is Kind.INT else "d").__getitem__
    data = segment.data
    offsets = segment.array(layout.start, layout.length + 1, "q")
    if kind is Kind.STR:
        return lambda i: data[offsets[i] : offsets[i + 1]].decode()
    if kind is Kind.STR_ESCAPED:
        return lambda i: data[offsets[i] : offsets[i + 1]].decode("utf-8", _TEXT_ERRORS)
    if kind is Kind.BYTES:
        return lambda i: data[offsets[i] : offsets[i + 1]]
    loads = pickle.loads
    return lambda i: loads(data[offsets[i] : offsets[i + 1]])


def _record_reader(fields: list[Callable[[int], Any]]) -> Callable[[int], tuple[Any, ...]]:
    if len(fields) == 2:  # (path, label): the common case, without a generator per read
        first, second = fields
        return lambda i: (first(i), second(i))
    return lambda i: tuple([field(i) for field in fields])
