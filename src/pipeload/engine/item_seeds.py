"""The seeds of a run of consecutive items, computed at once (economic mode's item workers).

An item worker reseeds ``random``, torch's CPU generator and numpy's global generator before every
item it fetches, from ``item_seed(base seed, epoch, position)``, numpy's from four words mixed out
of that seed (``numpy_seed_words``). Computed one item at a time in Python, those two hashes cost
about as much as the three seedings together (tens of microseconds an item on a busy machine,
beside a few hundred for fetching a small image). Here they are computed for a whole piece of a
batch with numpy's integer arithmetic on arrays: exactly the values of the one-at-a-time
functions, which remain the definition (``tests/engine/test_item_seeds.py`` checks that they
agree).
"""

from __future__ import annotations

import random

import numpy as np
import torch

from pipeload.engine.worker_info import ITEM_STREAM, WorkerRNG, derive_seed

_M32 = np.uint64(0xFFFFFFFF)
_SHIFT16 = np.uint64(16)


def _hash_constants(init: int, mult: int, count: int) -> tuple[np.ndarray, np.ndarray]:
    """The xor and multiply constants of the ``count`` successive calls of a SeedSequence-style
    multiply-xorshift hash (its multiplier advances after every call), as (count, 1) columns."""
    xors, mults, const = [], [], init
    for _ in range(count):
        advanced = (const * mult) & 0xFFFFFFFF
        xors.append(const)
        mults.append(advanced)
        const = advanced
    column = (count, 1)
    return (np.array(xors, dtype=np.uint64).reshape(column),
            np.array(mults, dtype=np.uint64).reshape(column))


# The pool hash is called 16 times: once per entropy word, then 3 times for each of the 4 source
# words of the mix (each source word mixes into the 3 others, in order).
_POOL_XOR, _POOL_MULT = _hash_constants(0x43B0D7E5, 0x931E8875, 16)
_FINAL_XOR, _FINAL_MULT = _hash_constants(0x8B51F9DD, 0x58F38DED, 4)
_OTHERS = [[dst for dst in range(4) if dst != src] for src in range(4)]
_MIX_X, _MIX_Y = np.uint64(0xCA01F9DD), np.uint64(0x4973F715)


def _hash(values: np.ndarray, xor: np.ndarray, mult: np.ndarray) -> np.ndarray:
    hashed = ((values ^ xor) & _M32) * mult & _M32
    return hashed ^ (hashed >> _SHIFT16)


def _splitmix64(values: np.ndarray) -> np.ndarray:
    """SplitMix64's finaliser on every element (uint64 arithmetic wraps as the scalar masks)."""
    values = values + np.uint64(0x9E3779B97F4A7C15)
    values = (values ^ (values >> np.uint64(30))) * np.uint64(0xBF58476D1CE4E5B9)
    values = (values ^ (values >> np.uint64(27))) * np.uint64(0x94D049BB133111EB)
    return values ^ (values >> np.uint64(31))


def _numpy_words(seeds: np.ndarray) -> np.ndarray:
    """``numpy_seed_words(seed, 0)`` for every seed: a (len(seeds), 4) uint32 array.

    The pool is a (4, n) array, one row per word; a source word's three hashes (one per other
    word, each with its own constants) are computed together, as the source does not change
    while it mixes into the others."""
    entropy = np.zeros((4, len(seeds)), dtype=np.uint64)
    entropy[1] = seeds & _M32
    entropy[2] = seeds >> np.uint64(32)
    pool = _hash(entropy, _POOL_XOR[:4], _POOL_MULT[:4])
    for src in range(4):
        first = 4 + 3 * src
        hashed = _hash(pool[src], _POOL_XOR[first:first + 3], _POOL_MULT[first:first + 3])
        others = _OTHERS[src]
        mixed = (_MIX_X * pool[others] - _MIX_Y * hashed) & _M32
        pool[others] = mixed ^ (mixed >> _SHIFT16)
    return _hash(pool, _FINAL_XOR, _FINAL_MULT).T.astype(np.uint32)


class ItemSeeds:
    """The seeds of items ``first_position .. first_position + count - 1`` of an epoch.

    Example:
        >>> seeds = ItemSeeds(base_seed=7, epoch=0, first_position=64, count=16)
        >>> seeds.apply(0, rng=None)  # before fetching the item at position 64
    """

    def __init__(self, base_seed: int, epoch: int, first_position: int, count: int) -> None:
        prefix = np.uint64(derive_seed(base_seed, ITEM_STREAM, epoch))
        positions = np.arange(first_position, first_position + count, dtype=np.uint64)
        seeds = _splitmix64(prefix ^ positions)
        self._words = _numpy_words(seeds)
        self._seeds = seeds.tolist()

    def seed(self, offset: int) -> int:
        """``item_seed`` of the ``offset``-th item of the run."""
        return self._seeds[offset]

    def apply(self, offset: int, rng: WorkerRNG | None) -> None:
        """Seed the generators for the ``offset``-th item of the run, as ``reseed`` would."""
        seed, words = self._seeds[offset], self._words[offset]
        if rng is None:
            random.seed(seed)
            torch.default_generator.manual_seed(seed)
            np.random.seed(words)
            return
        rng.random_generator.seed(seed)
        rng.torch_generator.manual_seed(seed)
        rng.numpy_generator.seed(words)
