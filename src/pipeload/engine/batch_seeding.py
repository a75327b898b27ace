"""Per-batch seeding (``worker_seeding="per_batch"``): a batch's random values depend on the batch.

torch seeds each worker once (``base_seed + worker_id``), so what a dataset draws for a batch
depends on which worker built it and on everything that worker drew before. That is fine for one
uninterrupted run, but a resumed epoch cannot recreate it. With per-batch seeding, the generators
that build a batch (``torch``, ``random`` and numpy's global ones in a process worker; the
worker's own set in a thread worker; the main process's, borrowed and given back, without
workers) are seeded just before the batch is fetched, from:

- map-style datasets: (base seed, epoch, batch number) — the same whatever ``num_workers``;
- iterable datasets: (base seed, epoch, worker id, how many batches that worker's replica has
  made) — each replica is a stream of its own, and its count travels with its checkpoint.

Economic mode seeds per item and per collation already (``worker_info.item_seed``); it does not
use this module.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from dataclasses import dataclass

from pipeload._rng_state import global_rngs_kept
from pipeload.engine.worker_info import WorkerRNG, derive_seed, reseed

MAP_BATCH_STREAM = 3  # apart from economic mode's item (1) and batch (2) seeds
STREAM_BATCH_STREAM = 4


@dataclass(frozen=True)
class BatchSeeding:
    """How one replica seeds each batch it builds.

    Attributes:
        base_seed: the session's base seed.
        epoch: the session's epoch number.
        rng: a thread worker's own generators; None for the process's global ones.
        borrow: True in the main process (no workers): the global generators are the user's, so
            their states are put back after each batch.
    """

    base_seed: int
    epoch: int
    rng: WorkerRNG | None = None
    borrow: bool = False

    def for_map_batch(self, batch_number: int) -> contextlib.AbstractContextManager[None]:
        return self._seeded(derive_seed(self.base_seed, MAP_BATCH_STREAM, self.epoch, batch_number))

    def for_stream_batch(self, worker_id: int, made: int) -> contextlib.AbstractContextManager[None]:
        return self._seeded(derive_seed(self.base_seed, STREAM_BATCH_STREAM, self.epoch, worker_id, made))

    @contextlib.contextmanager
    def _seeded(self, seed: int) -> Iterator[None]:
        if not self.borrow:
            reseed(seed, self.rng)
            yield
            return
        with global_rngs_kept():
            reseed(seed, None)
            yield
