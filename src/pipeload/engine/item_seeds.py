"""The seeds of a run of consecutive items, computed at once (economic mode's item workers).

An item worker reseeds ``random``, torch's CPU generator and numpy's global generator before every
item it fetches, from ``item_seed(base seed, epoch, position)`` (numpy from its low 32 bits,
``worker_info.numpy_seed_of``). Computed one item at a time in Python, the seed's hash costs a
few microseconds an item; here it is computed for a whole piece of a batch with numpy's integer
arithmetic on arrays: exactly the values of the one-at-a-time function, which remains the
definition (``tests/engine/test_item_seeds.py`` checks that they agree).
"""

from __future__ import annotations

import random

import numpy as np
import torch

from pipeload.engine.worker_info import ITEM_STREAM, WorkerRNG, derive_seed

_M32 = np.uint64(0xFFFFFFFF)


def _splitmix64(values: np.ndarray) -> np.ndarray:
    """SplitMix64's finaliser on every element (uint64 arithmetic wraps as the scalar masks)."""
    values = values + np.uint64(0x9E3779B97F4A7C15)
    values = (values ^ (values >> np.uint64(30))) * np.uint64(0xBF58476D1CE4E5B9)
    values = (values ^ (values >> np.uint64(27))) * np.uint64(0x94D049BB133111EB)
    return values ^ (values >> np.uint64(31))


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
        self._seeds = seeds.tolist()
        self._numpy_seeds = (seeds & _M32).tolist()

    def seed(self, offset: int) -> int:
        """``item_seed`` of the ``offset``-th item of the run."""
        return self._seeds[offset]

    def apply(self, offset: int, rng: WorkerRNG | None) -> None:
        """Seed the generators for the ``offset``-th item of the run, as ``reseed`` would."""
        seed, numpy_seed = self._seeds[offset], self._numpy_seeds[offset]
        if rng is None:
            random.seed(seed)
            torch.default_generator.manual_seed(seed)
            np.random.seed(numpy_seed)
            return
        rng.random_generator.seed(seed)
        rng.torch_generator.manual_seed(seed)
        rng.numpy_generator.seed(numpy_seed)
