"""Samplers: descriptions of the order in which a map-style dataset is read.

A sampler yields keys (or, for ``BatchSampler``, lists of keys). Random samplers draw from
torch's generators in exactly the order ``torch.utils.data`` does, so the same seed gives the
same indices, including the lazy seed draw a ``RandomSampler`` without a generator makes when
iteration starts.

Each class also subclasses its namesake in ``torch.utils.data`` for identity alone (frameworks
choose how to shard by ``isinstance``, e.g. Lightning shuffles the DistributedSampler it injects
only if the loader's sampler is a ``RandomSampler``); ours define every method, so none of
torch's runs.
"""

from __future__ import annotations

import itertools
import math
from collections.abc import Iterable, Iterator, Sequence, Sized
from typing import Any, TypeVar

import torch
import torch.utils.data as torch_data  # torch's classes: bases for identity, never called

from pipeload._sampler_state import StatefulSampler
from pipeload.errors import exact_value

__all__ = [
    "BatchSampler",
    "DistributedSampler",
    "RandomSampler",
    "Sampler",
    "SequentialSampler",
    "SubsetRandomSampler",
    "WeightedRandomSampler",
]

T_co = TypeVar("T_co", covariant=True)

# RandomSampler with replacement draws its indices this many at a time (torch's block size).
_REPLACEMENT_BLOCK = 32


class Sampler(torch_data.Sampler[T_co]):
    """Base class: an iterable over dataset keys, optionally with ``__len__``.

    Example:
        >>> class Evens(Sampler[int]):
        ...     def __init__(self, n: int) -> None: self.n = n
        ...     def __iter__(self): return iter(range(0, self.n, 2))
        ...     def __len__(self) -> int: return (self.n + 1) // 2
    """

    def __iter__(self) -> Iterator[T_co]:
        raise NotImplementedError(f"{type(self).__name__} must implement __iter__()")

    # No default __len__: a sampler without one is a sampler of unknown length.


class SequentialSampler(StatefulSampler, Sampler[int], torch_data.SequentialSampler):
    """Yields ``0, 1, ..., len(data_source) - 1``.

    Example:
        >>> list(SequentialSampler(range(3)))
        [0, 1, 2]
    """

    data_source: Sized

    def __init__(self, data_source: Sized) -> None:
        self.data_source = data_source

    def _keys(self) -> Iterator[int]:
        return iter(range(len(self.data_source)))

    def _config(self) -> dict[str, Any]:
        return {"length": len(self.data_source)}

    def __len__(self) -> int:
        return len(self.data_source)


class RandomSampler(StatefulSampler, Sampler[int], torch_data.RandomSampler):
    """Yields indices in random order: a shuffle, or draws with replacement.

    Args:
        data_source: anything with ``__len__``.
        replacement: draw with replacement (``num_samples`` draws) instead of shuffling.
        num_samples: how many indices to yield; defaults to ``len(data_source)``. Without
            replacement and above the length, whole fresh permutations are chained.
        generator: a ``torch.Generator``; if None, each iteration seeds a private generator
            from torch's global RNG when the first index is requested.

    Raises:
        TypeError: ``replacement`` is not a bool.
        ValueError: ``num_samples`` is not a positive int.

    Example:
        >>> list(RandomSampler(range(5), generator=torch.Generator().manual_seed(0)))
    """

    data_source: Sized
    replacement: bool

    def __init__(
        self,
        data_source: Sized,
        replacement: bool = False,
        num_samples: int | None = None,
        generator: torch.Generator | None = None,
    ) -> None:
        self.data_source = data_source
        self.replacement = replacement
        self._num_samples = num_samples
        self.generator = generator
        if not isinstance(replacement, bool):
            raise TypeError(
                f"replacement should be a boolean value, but got replacement={replacement}"
                f"{exact_value('replacement', replacement)}"
            )
        count = self.num_samples
        # bool passes as an int here on purpose: torch accepts num_samples=True.
        if not isinstance(count, int) or count <= 0:
            raise ValueError(
                f"num_samples should be a positive integer value, but got num_samples={count}"
                f"{exact_value('num_samples', count)}"
            )

    @property
    def num_samples(self) -> int:
        """Indices per iteration: the value given, or the current length of the data."""
        if self._num_samples is None:
            return len(self.data_source)
        return self._num_samples

    def _draws_from(self) -> tuple[bool, torch.Generator | None]:
        return True, self.generator

    def _config(self) -> dict[str, Any]:
        return {"length": len(self.data_source), "num_samples": self.num_samples,
                "replacement": self.replacement}

    def _keys(self) -> Iterator[int]:
        size = len(self.data_source)
        generator = self.generator
        if generator is None:
            # Same draw as torch: one int64 from the global RNG, made lazily on first next().
            seed = int(torch.empty((), dtype=torch.int64).random_().item())
            generator = torch.Generator()
            generator.manual_seed(seed)
        if self.replacement:
            yield from _draws_with_replacement(size, self.num_samples, generator)
        else:
            yield from _chained_permutations(size, self.num_samples, generator)

    def __len__(self) -> int:
        return self.num_samples


def _draws_with_replacement(size: int, count: int, generator: torch.Generator) -> Iterator[int]:
    full_blocks, rest = divmod(count, _REPLACEMENT_BLOCK)
    for _ in range(full_blocks):
        block = torch.randint(high=size, size=(_REPLACEMENT_BLOCK,), dtype=torch.int64,
                              generator=generator)
        yield from block.tolist()
    # torch always makes this last call, even for zero draws; keep the generator in step.
    yield from torch.randint(high=size, size=(rest,), dtype=torch.int64,
                             generator=generator).tolist()


def _chained_permutations(size: int, count: int, generator: torch.Generator) -> Iterator[int]:
    if size == 0:
        # ZeroDivisionError is the type torch raises here; keep it, with a clearer message.
        raise ZeroDivisionError(
            f"RandomSampler cannot draw num_samples={count} without replacement from an empty "
            "data_source (len 0)"
        )
    for _ in range(count // size):
        yield from torch.randperm(size, generator=generator).tolist()
    # As in torch, a final permutation is drawn even when nothing of it is used.
    yield from torch.randperm(size, generator=generator).tolist()[: count % size]


class SubsetRandomSampler(StatefulSampler, Sampler[int], torch_data.SubsetRandomSampler):
    """Yields the given indices in a random order (one ``randperm`` per iteration).

    Args:
        indices: the keys to shuffle.
        generator: a ``torch.Generator``; None uses torch's global RNG.

    Example:
        >>> sorted(SubsetRandomSampler([4, 8, 15]))
        [4, 8, 15]
    """

    indices: Sequence[int]

    def __init__(self, indices: Sequence[int], generator: torch.Generator | None = None) -> None:
        self.indices = indices
        self.generator = generator

    def _draws_from(self) -> tuple[bool, torch.Generator | None]:
        return True, self.generator

    def _config(self) -> dict[str, Any]:
        return {"length": len(self.indices)}

    def _keys(self) -> Iterator[int]:
        for position in torch.randperm(len(self.indices), generator=self.generator).tolist():
            yield self.indices[position]

    def __len__(self) -> int:
        return len(self.indices)


class WeightedRandomSampler(StatefulSampler, Sampler[int], torch_data.WeightedRandomSampler):
    """Yields ``num_samples`` indices into ``weights``, drawn with probability ∝ weight.

    Args:
        weights: a 1-d sequence of non-negative, finite weights with a positive sum.
        num_samples: how many indices to draw per iteration.
        replacement: draw with replacement; without it ``num_samples <= len(weights)``.
        generator: a ``torch.Generator``; None uses torch's global RNG.

    Raises:
        ValueError: bad ``num_samples``, ``replacement`` or shape of ``weights``.
        RuntimeError: weights that ``torch.multinomial`` would refuse (checked up front).

    Example:
        >>> list(WeightedRandomSampler([0.0, 1.0], 3))
        [1, 1, 1]
    """

    weights: torch.Tensor
    num_samples: int
    replacement: bool

    def __init__(
        self,
        weights: Sequence[float] | torch.Tensor,
        num_samples: int,
        replacement: bool = True,
        generator: torch.Generator | None = None,
    ) -> None:
        if not isinstance(num_samples, int) or isinstance(num_samples, bool) or num_samples <= 0:
            raise ValueError(
                "num_samples should be a positive integer value, but got "
                f"num_samples={num_samples}{exact_value('num_samples', num_samples)}"
            )
        if not isinstance(replacement, bool):
            raise ValueError(
                f"replacement should be a boolean value, but got replacement={replacement}"
                f"{exact_value('replacement', replacement)}"
            )
        weights_tensor = torch.as_tensor(weights, dtype=torch.double)
        if weights_tensor.dim() != 1:
            raise ValueError(
                "weights should be a 1d sequence but given weights have shape "
                f"{tuple(weights_tensor.shape)}"
            )
        _check_weights(weights_tensor, num_samples, replacement)
        self.weights = weights_tensor
        self.num_samples = num_samples
        self.replacement = replacement
        self.generator = generator

    def _draws_from(self) -> tuple[bool, torch.Generator | None]:
        return True, self.generator

    def _config(self) -> dict[str, Any]:
        return {"weights": self.weights.numel(), "num_samples": self.num_samples,
                "replacement": self.replacement}

    def _keys(self) -> Iterator[int]:
        drawn = torch.multinomial(self.weights, self.num_samples, self.replacement,
                                  generator=self.generator)
        yield from drawn.tolist()

    def __len__(self) -> int:
        return self.num_samples


def _check_weights(weights: torch.Tensor, num_samples: int, replacement: bool) -> None:
    """Reject, at construction, what torch.multinomial would reject at the first iteration.

    Each message starts with torch.multinomial's own sentence for the case.
    """
    problems = {
        "every weight must be finite, but some are inf or NaN": ~torch.isfinite(weights),
        "every weight must be >= 0, but some are negative": weights < 0,
    }
    for problem, where in problems.items():
        if bool(where.any()):
            positions = where.nonzero().flatten().tolist()[:10]
            raise RuntimeError(
                "probability tensor contains either `inf`, `nan` or element < 0 (pipeload: "
                f"invalid weights: {problem}, at positions {positions})"
            )
    if not float(weights.sum()) > 0:
        raise RuntimeError(
            "invalid multinomial distribution (sum of probabilities <= 0) (pipeload: the weights "
            f"must have a positive sum, but got {weights.numel()} weights summing to "
            f"{float(weights.sum())})"
        )
    if not replacement and num_samples > weights.numel():
        raise RuntimeError(
            "cannot sample n_sample > prob_dist.size(-1) samples without replacement (pipeload: "
            f"cannot draw num_samples={num_samples} without replacement from "
            f"{weights.numel()} weights)"
        )


class BatchSampler(StatefulSampler, Sampler[list[int]], torch_data.BatchSampler):
    """Groups the keys of ``sampler`` into lists of ``batch_size``.

    Args:
        sampler: any iterable of keys (a Sampler, a list, a generator...).
        batch_size: keys per batch, a positive int.
        drop_last: drop a final batch shorter than ``batch_size``.

    Raises:
        ValueError: ``batch_size`` is not a positive int (bools refused) or ``drop_last`` is
            not a bool.

    Example:
        >>> list(BatchSampler(range(5), batch_size=2, drop_last=False))
        [[0, 1], [2, 3], [4]]
    """

    def __init__(
        self,
        sampler: Sampler[int] | Iterable[int],
        batch_size: int,
        drop_last: bool,
    ) -> None:
        if not isinstance(batch_size, int) or isinstance(batch_size, bool) or batch_size <= 0:
            raise ValueError(
                f"batch_size should be a positive integer value, but got batch_size={batch_size}"
                f"{exact_value('batch_size', batch_size)}"
            )
        if not isinstance(drop_last, bool):
            raise ValueError(
                f"drop_last should be a boolean value, but got drop_last={drop_last}"
                f"{exact_value('drop_last', drop_last)}"
            )
        self.sampler = sampler
        self.batch_size = batch_size
        self.drop_last = drop_last

    def _keys(self) -> Iterator[list[int]]:
        inner = self.sampler
        keys = inner._uncounted_iter() if isinstance(inner, StatefulSampler) else iter(inner)
        while batch := list(itertools.islice(keys, self.batch_size)):
            if self.drop_last and len(batch) < self.batch_size:
                return
            yield batch

    def _config(self) -> dict[str, Any]:
        return {"batch_size": self.batch_size, "drop_last": self.drop_last}

    def _inner_state(self) -> dict[str, Any]:
        # Mid-iteration, the keys inside are replayed from their start and regrouped; the sampler
        # inside has often finished already (batches are taken ahead), so ask for its start.
        inner = self.sampler
        if not isinstance(inner, StatefulSampler):
            return {"sampler": None}
        latest = self._latest
        in_progress = latest is not None and not latest.finished
        return {"sampler": inner._replay_state() if in_progress else inner.state_dict()}

    def _load_inner_state(self, state: dict[str, Any], replay: bool) -> None:
        inner_state = state.get("sampler")
        if inner_state is not None and isinstance(self.sampler, StatefulSampler):
            self.sampler.load_state_dict(inner_state)

    def __len__(self) -> int:
        count = len(self.sampler)  # type: ignore[arg-type]
        if self.drop_last:
            return count // self.batch_size
        return -(-count // self.batch_size)


class DistributedSampler(StatefulSampler, Sampler[int], torch_data.DistributedSampler):
    """Yields this rank's share of the dataset: every ``num_replicas``-th index from ``rank``.

    All ranks see the same (optionally shuffled, seeded by ``seed + epoch``) order. Without
    ``drop_last`` the order is padded by repeating its start so every rank gets the same
    count; with it, the tail is cut instead.

    Args:
        dataset: anything with ``__len__``.
        num_replicas: number of ranks; default: the world size of the initialised group.
        rank: this process's rank; default: the rank in the initialised group.
        shuffle: shuffle the order each epoch.
        seed: base seed, identical on every rank.
        drop_last: cut the tail instead of padding.

    Raises:
        RuntimeError: rank or num_replicas left out and ``torch.distributed`` is unavailable.
        ValueError: left out with no initialised process group (from ``torch.distributed``),
            or ``rank`` outside ``[0, num_replicas)``.

    Example:
        >>> list(DistributedSampler(range(5), num_replicas=2, rank=1, shuffle=False))
        [1, 3, 0]
    """

    def __init__(
        self,
        dataset: Sized,
        num_replicas: int | None = None,
        rank: int | None = None,
        shuffle: bool = True,
        seed: int = 0,
        drop_last: bool = False,
    ) -> None:
        if num_replicas is None:
            num_replicas = _process_group().get_world_size()
        if rank is None:
            rank = _process_group().get_rank()
        if rank < 0 or rank >= num_replicas:
            raise ValueError(
                f"Invalid rank {rank}, rank should be in the interval [0, {num_replicas - 1}]: "
                f"got rank={rank} with num_replicas={num_replicas}"
            )
        self.dataset = dataset
        self.num_replicas = num_replicas
        self.rank = rank
        self.epoch = 0
        self.drop_last = drop_last
        self.shuffle = shuffle
        self.seed = seed
        size = len(dataset)
        if drop_last and size % num_replicas != 0:
            self.num_samples = math.ceil((size - num_replicas) / num_replicas)
        else:
            self.num_samples = math.ceil(size / num_replicas)
        self.total_size = self.num_samples * num_replicas

    def _config(self) -> dict[str, Any]:
        return {"length": len(self.dataset), "num_replicas": self.num_replicas, "rank": self.rank,
                "shuffle": self.shuffle, "seed": self.seed, "drop_last": self.drop_last}

    def _inner_state(self) -> dict[str, Any]:
        return {"epoch": self.epoch}

    def _load_inner_state(self, state: dict[str, Any], replay: bool) -> None:
        self.epoch = state["epoch"]

    def _keys(self) -> Iterator[int]:
        size = len(self.dataset)
        if self.shuffle:
            generator = torch.Generator()
            generator.manual_seed(self.seed + self.epoch)
            order = torch.randperm(size, generator=generator).tolist()
        else:
            order = list(range(size))
        if self.drop_last:
            order = order[: self.total_size]
        elif self.total_size > len(order):
            missing = self.total_size - len(order)
            order += (order * math.ceil(missing / len(order)))[:missing]
        return iter(order[self.rank : self.total_size : self.num_replicas])

    def __len__(self) -> int:
        return self.num_samples

    def set_epoch(self, epoch: int) -> None:
        """Set the epoch; with ``shuffle`` each epoch gets its own order (the same on all ranks)."""
        self.epoch = epoch


def _process_group() -> Any:
    """``torch.distributed``, imported only when asked for; RuntimeError if it is absent."""
    try:
        import torch.distributed as dist
    except ImportError:  # pragma: no cover - builds without distributed support
        dist = None
    if dist is None or not dist.is_available():
        raise RuntimeError(
            "Requires distributed package to be available: pass num_replicas and rank "
            "explicitly, or use a torch build with torch.distributed"
        )
    return dist


class _InfiniteConstantSampler(Sampler[None]):
    """Yields None forever: the key stream for an iterable-style dataset."""

    def __iter__(self) -> Iterator[None]:
        return itertools.repeat(None)


def exact_length(sampler: Any) -> int | None:
    """``len(sampler)`` when it is exactly what iterating yields and iterating cannot fail
    midway: torch's samplers and ours, as they are (a subclass may yield otherwise); else None."""
    kind = type(sampler)
    if kind in (BatchSampler, torch_data.BatchSampler):
        return len(sampler) if exact_length(sampler.sampler) is not None else None
    if kind.__name__ in _EXACT_SAMPLERS and kind.__module__ in (__name__, torch_data.sampler.__name__,
                                                                 torch_data.distributed.__name__):
        return len(sampler)
    return None


_EXACT_SAMPLERS = frozenset({"SequentialSampler", "RandomSampler", "SubsetRandomSampler",
                             "WeightedRandomSampler", "DistributedSampler"})
