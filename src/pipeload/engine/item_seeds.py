"""The seeds of a run of consecutive items, computed once per piece (economic mode's item workers).

An item worker reseeds ``random``, torch's CPU generator and numpy's global generator before every
item it fetches, from ``item_seed(base seed, epoch, position)`` (numpy from its low 32 bits,
``worker_info.numpy_seed_of``). A piece's seeds share their first hashes (base seed, stream,
epoch), so they are computed together: one finalising hash an item, the same values as the
one-at-a-time function, which remains the definition (``tests/engine/test_item_seeds.py`` checks
that they agree).
"""

from __future__ import annotations

import random

import numpy as np
import torch

from pipeload.engine.worker_info import ITEM_STREAM, WorkerRNG, derive_seed, numpy_seed_of, splitmix64


class ItemSeeds:
    """The seeds of items ``first_position .. first_position + count - 1`` of an epoch.

    Example:
        >>> seeds = ItemSeeds(base_seed=7, epoch=0, first_position=64, count=16)
        >>> seeds.apply(0, rng=None)  # before fetching the item at position 64
    """

    def __init__(self, base_seed: int, epoch: int, first_position: int, count: int) -> None:
        # item_seed's hashes up to the position, once; then the position's, for each item. (In
        # plain Python: numpy's array arithmetic took as long for a piece, and longer in a worker
        # whose caches the previous item's decoding has filled.)
        prefix = derive_seed(base_seed, ITEM_STREAM, epoch)
        self._seeds = [splitmix64(prefix ^ position)
                       for position in range(first_position, first_position + count)]
        self._numpy_seeds = [numpy_seed_of(seed) for seed in self._seeds]

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
