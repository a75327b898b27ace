"""Who am I? ``get_worker_info`` and the per-worker seeding that torch.utils.data users rely on.

Seeding follows torch exactly, so a dataset that draws random numbers in ``__getitem__`` gets the
same values under pipeload as under torch with the same seed: the worker's seed is
``base_seed + worker_id``; ``random`` and ``torch`` are seeded with it, and numpy's legacy global
RNG with four 32-bit words mixed from (worker_id, base_seed) by a SeedSequence-style hash.

Economic mode adds seeds that do not depend on which worker happens to do the work: before each
item is fetched the item worker reseeds from (base seed, epoch, the item's position in the epoch),
and before each batch is collated the batch worker reseeds from (base seed, epoch, batch number).
See docs/design/economic.md.
"""

from __future__ import annotations

import random
import sys
import threading
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

_MASK32 = 0xFFFFFFFF


@dataclass(frozen=True)
class WorkerRNG:
    """Random generators owned by one thread worker (process workers use the global ones)."""

    random_generator: random.Random
    torch_generator: torch.Generator
    numpy_generator: Any = None


@dataclass(frozen=True)
class WorkerInfo:
    """What a worker knows about itself; returned by :func:`get_worker_info` inside a worker.

    Attributes:
        id: this worker's id, in ``range(num_workers)``.
        num_workers: how many workers the loader runs.
        seed: the seed this worker's random generators were seeded with.
        dataset: this worker's copy of the dataset.
        rng: per-worker generators (thread workers only; None in process workers).
        worker_method: "multiprocessing" or "thread".
        kind: "classic" (a worker that fetches and collates whole batches), or in economic mode
            "item" (fetches items) or "batch" (collates them); ``id`` and ``num_workers`` count
            the workers of this kind.
    """

    id: int
    num_workers: int
    seed: int
    dataset: Any  # in the repr, as torch's: code that logs a worker's info names its dataset
    rng: WorkerRNG | None = None
    worker_method: str = "multiprocessing"
    kind: str = "classic"


class _CurrentWorker(threading.local):
    info: WorkerInfo | None = None
    # A thread worker's "stop now" (its engine closed): what a wait of pipeload's own inside the
    # dataset (a non-blocking pipe read as a blocking one) checks, since a thread cannot be killed.
    stopping: Callable[[], bool] | None = None


_current = _CurrentWorker()
# A process worker's info, for every thread of that process: torch's is one value per process,
# so a thread the user's code starts in a worker (a prefetching thread, a queue boundary's) shards
# by it too. A thread worker's stays its own thread's (``_current``).
_process_worker: list[WorkerInfo | None] = [None]
# What code set by hand to pose as a worker, process-wide, as torch's private
# ``_utils.worker._worker_info`` does (torch's own tests set it to make ``default_collate``
# believe it runs in a worker): ``pipeload._utils.worker._worker_info`` reads and sets it.
_posed: list[Any] = [None]


def posed_worker_info() -> Any:
    """What ``pose_as_worker`` set (None: nothing)."""
    return _posed[0]


def pose_as_worker(info: Any) -> None:
    """Answer ``get_worker_info()`` with ``info`` in every thread that is no worker of ours
    (None stops it): the effect of setting torch's ``_utils.worker._worker_info``."""
    _posed[0] = info


def get_worker_info() -> WorkerInfo | None:
    """Return this worker's :class:`WorkerInfo`, or None in the main process.

    Example:
        >>> class Shards(IterableDataset):
        ...     def __iter__(self):
        ...         info = get_worker_info()
        ...         start = 0 if info is None else info.id
        ...         step = 1 if info is None else info.num_workers
        ...         return iter(range(start, 100, step))
    """
    info = _current.info
    if info is None:
        info = _process_worker[0]
    return info if info is not None else _posed[0]


def set_worker_info(info: WorkerInfo | None) -> None:
    """Install ``info`` for the calling thread (a worker's first act; None when it ends)."""
    _current.info = info


def set_worker_stopping(check: Callable[[], bool] | None) -> None:
    """Install the calling thread worker's "stop now" check (None when it ends)."""
    _current.stopping = check


def worker_stopping() -> Callable[[], bool] | None:
    """The calling thread worker's "stop now" check; None outside a thread worker."""
    return _current.stopping


def set_process_worker_info(info: WorkerInfo) -> None:
    """Install ``info`` for every thread of this process: a process worker's, as torch's."""
    _process_worker[0] = info


def publish_to_torch(info: WorkerInfo) -> None:
    """Answer ``torch.utils.data.get_worker_info()`` too, inside a process worker.

    torch-native datasets shard themselves with torch's function, which reads one module-level
    variable. A worker process is ours alone, so setting it there is safe; thread workers cannot
    do this (the variable is per process), which the README says.
    """
    torch_worker_module = sys.modules.get("torch.utils.data._utils.worker")
    if torch_worker_module is not None and hasattr(torch_worker_module, "_worker_info"):
        torch_worker_module._worker_info = info


def numpy_seed_words(base_seed: int, worker_id: int) -> list[int]:
    """Four 32-bit words for ``np.random.seed``, mixed from the base seed and the worker id.

    The mixing is the SeedSequence construction (two multiply-xorshift hashes and a pairwise mix);
    torch uses the same one, which is why numpy draws in workers match torch's.
    """
    hasher = _MultiplyXorshift(init=0x43B0D7E5, mult=0x931E8875)
    entropy = [worker_id, base_seed & _MASK32, base_seed >> 32, 0]
    pool = [hasher.hash(word) for word in entropy]
    for src in range(4):
        for dst in range(4):
            if src != dst:
                pool[dst] = _mix(pool[dst], hasher.hash(pool[src]))
    finaliser = _MultiplyXorshift(init=0x8B51F9DD, mult=0x58F38DED)
    return [finaliser.hash(word) for word in pool]


class _MultiplyXorshift:
    """A hash whose multiplier advances after every call (SeedSequence's hashmix)."""

    def __init__(self, init: int, mult: int) -> None:
        self._const = init
        self._mult = mult

    def hash(self, value: int) -> int:
        value = (value ^ self._const) & _MASK32
        self._const = (self._const * self._mult) & _MASK32
        value = (value * self._const) & _MASK32
        return (value ^ (value >> 16)) & _MASK32


def _mix(x: int, y: int) -> int:
    result = ((0xCA01F9DD * x) - (0x4973F715 * y)) & _MASK32
    return (result ^ (result >> 16)) & _MASK32


_MASK64 = (1 << 64) - 1
ITEM_STREAM = 1  # tells item seeds and batch seeds apart when their other words are equal
BATCH_STREAM = 2


def splitmix64(value: int) -> int:
    """One step of the SplitMix64 finaliser: a cheap, well-spread 64-bit hash."""
    value = (value + 0x9E3779B97F4A7C15) & _MASK64
    value = ((value ^ (value >> 30)) * 0xBF58476D1CE4E5B9) & _MASK64
    value = ((value ^ (value >> 27)) * 0x94D049BB133111EB) & _MASK64
    return value ^ (value >> 31)


def derive_seed(base_seed: int, *words: int) -> int:
    """A 64-bit seed mixed from ``base_seed`` and ``words``: equal inputs, equal seed, anywhere."""
    value = splitmix64(base_seed & _MASK64)
    for word in words:
        value = splitmix64(value ^ (word & _MASK64))
    return value


def item_seed(base_seed: int, epoch: int, position: int) -> int:
    """The seed an economic-mode item fetch runs under: the sample's place, not its worker."""
    return derive_seed(base_seed, ITEM_STREAM, epoch, position)


def batch_seed(base_seed: int, epoch: int, batch_number: int) -> int:
    """The seed an economic-mode batch worker collates batch ``batch_number`` under."""
    return derive_seed(base_seed, BATCH_STREAM, epoch, batch_number)


def numpy_seed_of(seed: int) -> int:
    """What numpy's generator is seeded with when a worker reseeds with ``seed`` (per item, per
    batch): its low 32 bits.

    torch's CPU generator keeps only those bits of any seed (``manual_seed(s)`` and
    ``manual_seed(s + 2**32)`` draw alike), so numpy's draws are told apart no worse than torch's.
    One word takes numpy's integer path; an array of words (``numpy_seed_words``) goes through
    half a dozen array checks, which cost ~30 us an item in a worker whose caches the previous
    item's decoding has filled (a fifth of a small image's fetch time).
    """
    return seed & _MASK32


def reseed(seed: int, rng: WorkerRNG | None) -> None:
    """Seed a worker's generators with ``seed``: the process's globals, or a thread's own set."""
    if rng is None:
        # Not torch.manual_seed: it also visits every accelerator backend (~0.2 ms a call, too
        # much per item); workers draw from the CPU generator.
        random.seed(seed)
        torch.default_generator.manual_seed(seed)
        np.random.seed(numpy_seed_of(seed))
        return
    rng.random_generator.seed(seed)
    rng.torch_generator.manual_seed(seed)
    rng.numpy_generator.seed(numpy_seed_of(seed))


def seed_process_worker(base_seed: int, worker_id: int) -> int:
    """Seed this process's global ``random``, ``torch`` and numpy RNGs; return the worker seed."""
    seed = base_seed + worker_id
    random.seed(seed)
    accelerator = getattr(torch, "accelerator", None)  # torch >= 2.6
    if accelerator is not None and accelerator.current_accelerator() is None:
        # What torch.manual_seed does here, without queueing a lazy seed for every accelerator
        # module: each one keeps the stack it was queued from, whose source files linecache then
        # reads into about 1.2 MiB of this worker's own pages, for devices this torch has none of.
        torch.default_generator.manual_seed(seed)
    else:
        torch.manual_seed(seed)
    np.random.seed(numpy_seed_words(base_seed, worker_id))
    return seed


def this_workers_torch_generator() -> torch.Generator | None:
    """The torch generator a random draw in this thread should use: a thread worker's own (the
    global one is the training loop's, shared by every thread, so draws from it would depend
    on how the threads interleave), or None, torch's global one, anywhere else."""
    info = get_worker_info()
    rng = getattr(info, "rng", None)
    return rng.torch_generator if rng is not None else None


def make_thread_rng(base_seed: int, worker_id: int) -> WorkerRNG:
    """Generators for one thread worker, seeded exactly as a process worker's globals would be."""
    seed = base_seed + worker_id
    torch_gen = torch.Generator()
    torch_gen.manual_seed(seed)
    numpy_rng = np.random.RandomState(numpy_seed_words(base_seed, worker_id))
    return WorkerRNG(random.Random(seed), torch_gen, numpy_rng)
