"""A hash index over a column of keys that every process computes alike.

Python's own ``hash()`` of a string changes from one interpreter to the next (``PYTHONHASHSEED``),
so a spawned worker could not find a key placed by the main process. Keys here are hashed with
CRC-32 over their UTF-8 or raw bytes (str, bytes), multiplicative hashing (ints), and rules chosen
so that keys equal in Python hash alike, as a dict requires: ``1``, ``1.0`` and ``True`` share a
hash; so do ``(1, "a")`` and ``(1.0, "a")``.

The index is an open-addressing table with linear probing, at most half full, of uint64 entries
``(hash << 32) | (key number + 1)`` (0: empty). A lookup usually reads one entry; keeping the
hash in the entry means a colliding key is skipped without decoding it. The table is built with
numpy, a round of vectorized placements per probe step.
"""

from __future__ import annotations

import contextlib
import numbers
import operator
import struct
import zlib
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from pipeload.shared._nan import same_value
from pipeload.shared._segment import Segment, SegmentWriter

KEY_TYPES = "str, bytes, int, float, bool, None, or tuples of these"
_NONE_HASH = zlib.crc32(b"None")
_NAN_HASH = zlib.crc32(b"NaN")  # every NaN alike, whatever its sign and payload bits: any NaN finds it
_FLOAT = struct.Struct("<d")
_NUMBER_MASK = 0xFFFF_FFFF  # a table entry is (hash << 32) | (key number + 1); 0 is an empty slot
_MAX_ENTRIES = 2**31 - 1  # the table (2 slots a key at least) must fit a 32-bit hash's range
_INT64_LIMIT = 2**63
_U64 = 2**64 - 1
_GOLDEN = 0x9E37_79B9_7F4A_7C15  # 2**64 divided by the golden ratio, made odd


class UnsupportedKey(TypeError):
    """A key of a type the shared index cannot hash consistently across processes."""


def stable_hash(key: Any) -> int:
    """A 32-bit hash of ``key`` that is the same in every process; equal keys hash alike.

    Raises:
        UnsupportedKey: ``key`` is not one of ``KEY_TYPES``.
    """
    if isinstance(key, str):
        return zlib.crc32(key.encode("utf-8", "surrogatepass"))
    if isinstance(key, bytes):
        return zlib.crc32(key)
    if isinstance(key, int):  # bool included: True == 1
        return _int_hash(key)
    if isinstance(key, float):
        if key != key:
            return _NAN_HASH
        if key.is_integer():
            return _int_hash(int(key))  # 2.0 == 2
        return zlib.crc32(_FLOAT.pack(key))
    if key is None:
        return _NONE_HASH
    if isinstance(key, tuple):
        return zlib.crc32(b"t" + b"".join(stable_hash(part).to_bytes(4, "little") for part in key))
    plain = _plain_equal(key)
    if plain is not None:
        return stable_hash(plain)
    raise UnsupportedKey(f"key {key!r} of type {type(key).__name__}")


def _plain_equal(key: Any) -> Any:
    """The key of ``KEY_TYPES`` a dict would find for ``key`` (equal, and hashing alike), or None.

    numpy integers, floats and bools, a Fraction, a complex with no imaginary part, a read-only
    memoryview of bytes: found as the int, float, bool or bytes they equal, as a dict finds them.
    A tensor, though, hashes by identity: a dict finds no stored key with one, and neither do we.
    """
    candidates = []
    if isinstance(key, np.bool_):  # it has no __index__
        candidates.append(bool(key))
    if hasattr(type(key), "__index__"):
        with contextlib.suppress(TypeError):
            candidates.append(operator.index(key))
    if isinstance(key, numbers.Complex) and not isinstance(key, numbers.Real):
        candidates.append(key.real)  # found only when there is no imaginary part
    elif isinstance(key, numbers.Real):
        with contextlib.suppress(OverflowError):  # beyond any float: left unsupported
            candidates.append(float(key))
    if isinstance(key, memoryview):
        with contextlib.suppress(ValueError, TypeError):
            candidates.append(key.tobytes())
    return next((plain for plain in candidates if _found_by_dict(key, plain)), None)


def _found_by_dict(key: Any, plain: Any) -> bool:
    """Whether a dict holding ``plain`` finds it when asked for ``key``."""
    try:
        return hash(key) == hash(plain) and bool(key == plain)
    except (TypeError, ValueError, RuntimeError):  # unhashable, or an ambiguous comparison
        return False


def _int_hash(value: int) -> int:
    if -_INT64_LIMIT <= value < _INT64_LIMIT:
        # Multiplicative (Fibonacci) hashing: the top bits of the product mix all of the key's
        # bits, so sequential and strided ids spread evenly; cheaper than CRC in Python.
        return ((value & _U64) * _GOLDEN & _U64) >> 32
    return zlib.crc32(str(value).encode())


@dataclass(frozen=True)
class IndexLayout:
    """Where a key index lives in its segment: ``slots`` uint64 entries at ``table_at``."""

    length: int
    slots: int
    table_at: int


def write_index(writer: SegmentWriter, keys: Sequence[Any]) -> IndexLayout:
    """Hash ``keys`` (raising UnsupportedKey, with the key's position) and append their table."""
    if len(keys) > _MAX_ENTRIES:
        raise ValueError(f"SharedMapping holds at most {_MAX_ENTRIES:,} entries, got {len(keys):,}")
    hashes = np.empty(len(keys), dtype=np.uint64)
    for number, key in enumerate(keys):
        try:
            hashes[number] = stable_hash(key)
        except UnsupportedKey as exc:
            raise UnsupportedKey(f"SharedMapping keys must be {KEY_TYPES}; got {exc} (key number {number})") from None
    slots = 1 << (2 * len(keys)).bit_length()  # a power of two above twice the keys: half full at most
    table = _fill_table(hashes, slots)
    writer.align()
    return IndexLayout(len(keys), slots, writer.write(table))


def _fill_table(hashes: np.ndarray, slots: int) -> np.ndarray:
    """Linear probing, placed in rounds: every key still homeless tries its next slot at once.

    A key moves on from a slot only once that slot is taken, and taken slots stay taken, so
    every slot between a key's home and its place is occupied: the lookup's probe finds it.
    """
    mask = np.uint64(slots - 1)
    table = np.zeros(slots, dtype=np.uint64)
    numbers = np.arange(len(hashes), dtype=np.uint64)
    entries = (hashes << np.uint64(32)) | (numbers + np.uint64(1))
    trying = hashes >> np.uint64(_home_shift(slots))
    homeless = np.arange(len(hashes))
    while homeless.size:
        wanted = trying[homeless]
        free = table[wanted] == 0
        taken_slots, first = np.unique(wanted[free], return_index=True)
        winners = homeless[free][first]
        table[taken_slots] = entries[winners]
        placed = np.zeros(len(hashes), dtype=bool)
        placed[winners] = True
        homeless = homeless[~placed[homeless]]
        trying[homeless] = (trying[homeless] + np.uint64(1)) & mask
    return table


def _home_shift(slots: int) -> int:
    """A key's first slot is its hash's top bits: multiplicative hashing puts the mixing there."""
    return 32 - (slots.bit_length() - 1)


def key_finder(
    segment: Segment, layout: IndexLayout, read_key: Callable[[int], Any], key_text_offsets: memoryview | None
) -> Callable[[Any], int]:
    """A function that returns the number of the stored key equal to its argument, or -1.

    Raises UnsupportedKey for a key that no stored key can equal (another type). A lookup is a
    hash, usually one table read, and one key comparison: with ``key_text_offsets`` (the keys
    are a plain UTF-8 column) a str key is compared as bytes, without decoding the stored one.
    """
    table = segment.array(layout.table_at, layout.slots, "Q")
    mask = layout.slots - 1
    shift = _home_shift(layout.slots)
    crc32 = zlib.crc32
    data = segment.data

    def find(key: Any) -> int:
        # str and int keys are the common cases: hash them without stable_hash's type dispatch.
        kind = type(key)
        encoded = None
        if kind is str:
            encoded = key.encode("utf-8", "surrogatepass")
            wanted = crc32(encoded)
        elif kind is int and -_INT64_LIMIT <= key < _INT64_LIMIT:
            wanted = ((key & _U64) * _GOLDEN & _U64) >> 32  # as _int_hash, inline
        else:
            wanted = stable_hash(key)
        slot = wanted >> shift
        while entry := table[slot]:
            if entry >> 32 == wanted:
                number = (entry & _NUMBER_MASK) - 1
                if encoded is not None and key_text_offsets is not None:
                    if data[key_text_offsets[number] : key_text_offsets[number + 1]] == encoded:
                        return number
                elif same_value(read_key(number), key):
                    return number  # a stored NaN is read back as a new float: == alone never finds it
            slot = (slot + 1) & mask
        return -1

    return find
