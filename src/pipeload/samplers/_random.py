"""The random samplers: ``RandomSampler``, ``SubsetRandomSampler``, ``WeightedRandomSampler``.

They draw from torch's generators in exactly the order ``torch.utils.data`` does, so the same
seed gives the same indices (``RandomSampler`` without a generator draws its seed lazily, when
iteration starts, as torch's does). Public through ``pipeload.samplers``.
"""

from __future__ import annotations

import hashlib
from collections.abc import Iterator, Sequence, Sized
from typing import Any

import torch
import torch.utils.data as torch_data  # torch's classes: bases for identity, never called

from pipeload.samplers._base import Sampler
from pipeload.samplers._epoch_lengths import length_of
from pipeload.samplers._state import StatefulSampler
from pipeload.errors import check_generator, exact_value

# RandomSampler with replacement draws its indices this many at a time (torch's block size).
_REPLACEMENT_BLOCK = 32


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
        check_generator(generator)
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
            return length_of(self.data_source)
        return self._num_samples

    def _draws_from(self) -> tuple[bool, torch.Generator | None]:
        return True, self.generator

    def _config(self) -> dict[str, Any]:
        return {"length": length_of(self.data_source), "num_samples": self.num_samples,
                "replacement": self.replacement}

    def _keys(self) -> Iterator[int]:
        size = length_of(self.data_source)
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


# Keys go out from a tensor a block at a time: an epoch's order held as one list of Python ints
# costs ~38 bytes a key in the main process where the tensor costs 8, and iterating that list
# writes to every int it holds (reference counts), so a worker forked after the first draw (an
# economic item worker, a grown pool) holds the list's old pages as its own: ~150 MiB for 4
# million keys (a review measured it). The values are the same as torch's ``.tolist()``.
_KEYS_PER_BLOCK = 4096


def keys_of(order: torch.Tensor) -> Iterator[int]:
    """The ints of the 1-d tensor ``order``, in order, a block of Python ints at a time."""
    for start in range(0, order.numel(), _KEYS_PER_BLOCK):
        yield from order[start:start + _KEYS_PER_BLOCK].tolist()


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
        # torch's error, its words first, then what they mean here.
        raise ZeroDivisionError(
            f"integer division or modulo by zero (pipeload: RandomSampler cannot draw "
            f"num_samples={count} without replacement from an empty data_source, len 0)"
        )
    for _ in range(count // size):
        yield from keys_of(torch.randperm(size, generator=generator))
    # As in torch, a final permutation is drawn even when nothing of it is used.
    yield from keys_of(torch.randperm(size, generator=generator)[: count % size])


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
        check_generator(generator)
        self.generator = generator

    def _draws_from(self) -> tuple[bool, torch.Generator | None]:
        return True, self.generator

    def _config(self) -> dict[str, Any]:
        # The indices themselves, digested: a state of another subset of the same length would
        # replay its position over other keys.
        return {"length": len(self.indices), "indices": _digest(self.indices)}

    def _keys(self) -> Iterator[int]:
        for position in keys_of(torch.randperm(len(self.indices), generator=self.generator)):
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
        RuntimeError: when iterated, weights that ``torch.multinomial`` refuses (as torch's:
            a sampler built with placeholder weights, set before the epoch, is no error).

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
        check_generator(generator)
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
        self.weights = weights_tensor
        self.num_samples = num_samples
        self.replacement = replacement
        self.generator = generator

    def _draws_from(self) -> tuple[bool, torch.Generator | None]:
        return True, self.generator

    def _config(self) -> dict[str, Any]:
        return {"weights": self.weights.numel(), "weights_digest": _digest(self.weights),
                "num_samples": self.num_samples, "replacement": self.replacement}

    def _keys(self) -> Iterator[int]:
        _check_weights(self.weights, self.num_samples, self.replacement)
        drawn = torch.multinomial(self.weights, self.num_samples, self.replacement,
                                  generator=self.generator)
        yield from drawn.tolist()

    def __len__(self) -> int:
        return self.num_samples


def _check_weights(weights: torch.Tensor, num_samples: int, replacement: bool) -> None:
    """Reject, as an iteration begins, what torch.multinomial rejects, saying what is wrong.

    Each message starts with torch.multinomial's own sentence for the case. Not at construction:
    torch's sampler is built with any weights and fails only when drawing (code that fills its
    weights in before the epoch, or a loader that torch refuses for another reason first).
    """
    problems = {
        "every weight must be finite, but some are inf or NaN": ~torch.isfinite(weights),
        "every weight must be >= 0, but some are negative": weights < 0,
    }
    for problem, where in problems.items():
        if bool(where.any()):
            positions = where.nonzero().flatten().tolist()[:10]
            raise RuntimeError(f"{_multinomials_words(weights, num_samples, replacement)} (pipeload: "
                               f"invalid weights: {problem}, at positions {positions})")
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


def _multinomials_words(weights: torch.Tensor, num_samples: int, replacement: bool) -> str:
    """What torch.multinomial says of weights that are negative, NaN or infinite: drawing more
    than one with replacement, it names the first such entry's kind ("< 0" for a NaN too, which
    fails its ``>= 0`` test first); otherwise one sentence for all."""
    if not (replacement and num_samples > 1):
        return "probability tensor contains either `inf`, `nan` or element < 0"
    first = int((~torch.isfinite(weights) | (weights < 0)).nonzero()[0, 0])
    if bool(torch.isinf(weights[first])) and float(weights[first]) > 0:
        return "invalid multinomial distribution (encountering probability entry = infinity or NaN)"
    return "invalid multinomial distribution (encountering probability entry < 0)"


def _digest(values: Any) -> str:
    """A short digest of a sampler's indices or weights, for its state's config: a state taken
    over other ones of the same length is refused, not replayed over other keys."""
    try:
        data = torch.as_tensor(values if isinstance(values, torch.Tensor) else list(values))
        raw = data.detach().cpu().contiguous().view(torch.uint8).numpy().tobytes() + str(data.dtype).encode()
    except (TypeError, ValueError, RuntimeError):
        raw = repr(list(values)).encode()
    return hashlib.blake2b(raw, digest_size=8).hexdigest()
