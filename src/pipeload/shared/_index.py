"""A hash index over a column of keys that every process computes alike.

Python's own ``hash()`` of a string changes from one interpreter to the next (``PYTHONHASHSEED``),
so a spawned worker could not find a key placed by the main process. Keys here are hashed with
CRC-32 over a canonical encoding, chosen so that keys equal in Python hash alike, as a dict
requires: ``1``, ``1.0`` and ``True`` share a hash; so do ``(1, "a")`` and ``(1.0, "a")``.

The index is an open-addressing table with linear probing, at most half full, of uint64 entries
``(hash << 32) | (key number + 1)`` (0: empty). A lookup usually reads one entry; keeping the
hash in the entry means a colliding key is skipped without decoding it. The table is built with
numpy, a round of vectorized placements per probe step.
"""

from __future__ import annotations

import operator
import struct
import zlib
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from pipeload.shared._segment import Segment, SegmentWriter

KEY_TYPES = "str, bytes, int, float, bool, None, or tuples of these"
_NONE_HASH = zlib.crc32(b"None")
_FLOAT = struct.Struct("<d")
_NUMBER_MASK = 0xFFFF_FFFF  # a table entry is (hash << 32) | (key number + 1); 0 is an empty slot
_NUMBER_LIMIT = _NUMBER_MASK


class UnsupportedKey(TypeError):
    """A key of a type the shared index cannot hash consistently across processes."""


def stable_hash(key: Any) -> int:
    """A hash of ``key`` that is the same in every process; equal keys hash alike.

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
        if key.is_integer():
            return _int_hash(int(key))  # 2.0 == 2
        return zlib.crc32(_FLOAT.pack(key))
    if key is None:
        return _NONE_HASH
    if isinstance(key, tuple):
        return zlib.crc32(b"t" + b"".join(stable_hash(part).to_bytes(4, "little") for part in key))
    if hasattr(type(key), "__index__"):  # numpy integers look up as the ints they equal
        return _int_hash(operator.index(key))
    raise UnsupportedKey(f"key {key!r} of type {type(key).__name__}")


def _int_hash(value: int) -> int:
    try:
        return zlib.crc32(value.to_bytes(8, "little", signed=True))
    except OverflowError:
        return zlib.crc32(str(value).encode())


@dataclass(frozen=True)
class IndexLayout:
    """Where a key index lives in its segment: ``slots`` uint64 entries at ``table_at``."""

    length: int
    slots: int
    table_at: int


def write_index(writer: SegmentWriter, keys: Sequence[Any]) -> IndexLayout:
    """Hash ``keys`` (raising UnsupportedKey, with the key's position) and append their table."""
    if len(keys) >= _NUMBER_LIMIT:
        raise ValueError(f"SharedMapping holds at most {_NUMBER_LIMIT - 1:,} entries, got {len(keys):,}")
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
    trying = hashes & mask
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


def key_finder(segment: Segment, layout: IndexLayout, read_key: Callable[[int], Any]) -> Callable[[Any], int]:
    """A function that returns the number of the stored key equal to its argument, or -1.

    Raises UnsupportedKey for a key that no stored key can equal (another type). A lookup is a
    hash, usually one table read, and one decoded key to compare.
    """
    table = segment.array(layout.table_at, layout.slots, "Q")
    mask = layout.slots - 1
    crc32 = zlib.crc32

    def find(key: Any) -> int:
        if type(key) is str:  # the common case, without stable_hash's type dispatch
            wanted = crc32(key.encode("utf-8", "surrogatepass"))
        else:
            wanted = stable_hash(key)
        slot = wanted & mask
        while entry := table[slot]:
            if entry >> 32 == wanted:
                number = (entry & _NUMBER_MASK) - 1
                if read_key(number) == key:
                    return number
            slot = (slot + 1) & mask
        return -1

    return find
