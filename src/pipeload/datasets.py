"""Dataset descriptions: map-style and iterable-style bases and the ways to combine them.

Everything here is a plain, picklable description of where samples come from; nothing starts a
thread or opens a file. The classes follow ``torch.utils.data`` in names, signatures, errors and
random streams, so ``random_split`` with the same generator state gives the same split.

Each class also subclasses its namesake in ``torch.utils.data``, for identity alone: training
frameworks decide what to do with a dataset by ``isinstance`` against torch's classes. Ours come
first in every method resolution order and define every method torch's class defines, so none of
torch's code runs (the test suite checks both).
"""

from __future__ import annotations

import bisect
import itertools
import math
import warnings
from collections.abc import Iterator, Sequence
from typing import Any, Iterable, TypeVar

import torch
import torch.utils.data as torch_data  # torch's classes: bases for identity, never called

from pipeload._user_frame import first_frame_outside_pipeload

__all__ = [
    "ChainDataset",
    "ConcatDataset",
    "Dataset",
    "IterableDataset",
    "StackDataset",
    "Subset",
    "TensorDataset",
    "random_split",
]

T = TypeVar("T")
T_co = TypeVar("T_co", covariant=True)


class Dataset(torch_data.Dataset[T_co]):
    """A map-style dataset: a mapping from keys (usually ``0..len-1``) to samples.

    Subclasses implement ``__getitem__`` and usually ``__len__``. They may add
    ``__getitems__(indices) -> list`` to fetch a whole batch in one call.

    Example:
        >>> class Squares(Dataset[int]):
        ...     def __getitem__(self, i: int) -> int: return i * i
        ...     def __len__(self) -> int: return 10
    """

    def __getitem__(self, index: Any) -> T_co:
        raise NotImplementedError(
            "Subclasses of Dataset should implement __getitem__. (pipeload: "
            f"{type(self).__name__} must implement __getitem__(index) to be used as a map-style "
            "Dataset)"
        )

    # No default __len__ or __getitems__: their absence is meaningful to samplers and fetchers.

    def __add__(self, other: Dataset[T_co]) -> ConcatDataset[T_co]:
        return ConcatDataset([self, other])


class IterableDataset(Dataset[T_co], torch_data.IterableDataset[T_co]):
    """An iterable-style dataset: a stream of samples, read through ``__iter__``.

    With several workers each worker iterates its own copy; use
    ``pipeload.get_worker_info()`` inside ``__iter__`` to give each copy its own share.

    Example:
        >>> class Count(IterableDataset[int]):
        ...     def __iter__(self): return iter(range(3))
    """

    # __iter__ stays abstract (from Iterable): a subclass without one cannot be instantiated.

    def __add__(self, other: Dataset[T_co]) -> ChainDataset:  # type: ignore[override]
        return ChainDataset([self, other])


def _is_iterable_dataset(obj: object) -> bool:
    """True for iterable-style datasets: ours, torch's, and torch's DataPipes, all of which
    subclass ``torch.utils.data.IterableDataset``."""
    return isinstance(obj, torch_data.IterableDataset)


class TensorDataset(Dataset[tuple[torch.Tensor, ...]], torch_data.TensorDataset):
    """Samples are rows of tensors that share their first dimension.

    Args:
        *tensors: tensors with the same size along dimension 0.

    Raises:
        AssertionError: the tensors differ in their first dimension.
        IndexError: ``len()`` of a dataset made from no tensors (accepted, as torch does).

    Example:
        >>> ds = TensorDataset(torch.arange(4), torch.zeros(4, 2))
        >>> ds[1]
        (tensor(1), tensor([0., 0.]))
    """

    tensors: tuple[torch.Tensor, ...]

    def __init__(self, *tensors: torch.Tensor) -> None:
        sizes = [tensor.size(0) for tensor in tensors]
        if any(size != sizes[0] for size in sizes):
            raise AssertionError(
                f"Size mismatch between tensors: every tensor must have the same size in "
                f"dimension 0, but got sizes {sizes}"
            )
        self.tensors = tensors

    def __getitem__(self, index: Any) -> tuple[torch.Tensor, ...]:
        return tuple(tensor[index] for tensor in self.tensors)

    def __len__(self) -> int:
        if not self.tensors:
            raise IndexError("tuple index out of range: TensorDataset has no length, it was made from no tensors")
        return self.tensors[0].size(0)


class StackDataset(Dataset[T_co], torch_data.StackDataset):
    """Zips datasets of equal length: sample ``i`` is a tuple (positional) or dict (keywords).

    Args:
        *args: datasets whose samples form a tuple.
        **kwargs: datasets whose samples form a dict under these keys.

    Raises:
        ValueError: both or neither of args and kwargs given, or lengths differ.

    Example:
        >>> StackDataset(image=images, label=labels)[0]   # {"image": ..., "label": ...}
    """

    datasets: tuple[Any, ...] | dict[str, Any]

    def __init__(self, *args: Dataset[Any], **kwargs: Dataset[Any]) -> None:
        if args and kwargs:
            # torch's sentence, its missing space after "or" included.
            raise ValueError(
                "Supported either ``tuple``- (via ``args``) or``dict``- (via ``kwargs``) like "
                "input/output, but both types are given. (pipeload: StackDataset takes datasets "
                "either positionally, for tuple samples, or by keyword, for dict samples; got "
                f"{len(args)} positional and keywords {sorted(kwargs)})"
            )
        if not args and not kwargs:
            raise ValueError(
                "At least one dataset should be passed (pipeload: StackDataset got none)"
            )
        parts = list(args) if args else list(kwargs.values())
        lengths = [len(part) for part in parts]
        if any(length != lengths[0] for length in lengths):
            names = [f"#{i}" for i in range(len(args))] if args else list(kwargs)
            described = ", ".join(f"{n}: {k}" for n, k in zip(names, lengths, strict=True))
            raise ValueError(
                f"Size mismatch between datasets: all must have the same length, but got {described}"
            )
        self._length = lengths[0]
        self.datasets = args if args else kwargs

    def __getitem__(self, index: Any) -> Any:
        if isinstance(self.datasets, dict):
            return {key: part[index] for key, part in self.datasets.items()}
        return tuple(part[index] for part in self.datasets)

    def __getitems__(self, indices: list[Any]) -> list[Any]:
        if isinstance(self.datasets, dict):
            columns = {key: _fetch_many(part, indices) for key, part in self.datasets.items()}
            return [{key: column[row] for key, column in columns.items()}
                    for row in range(len(indices))]
        tuple_columns = [_fetch_many(part, indices) for part in self.datasets]
        return [tuple(column[row] for column in tuple_columns) for row in range(len(indices))]

    def __len__(self) -> int:
        return self._length


def _fetch_many(dataset: Any, indices: list[Any]) -> list[Any]:
    """Fetch ``indices`` from ``dataset``, in one ``__getitems__`` call when it offers one."""
    getitems = getattr(dataset, "__getitems__", None)
    if not callable(getitems):
        return [dataset[index] for index in indices]
    items = getitems(indices)
    if len(items) != len(indices):
        raise ValueError(
            f"Nested dataset's output size mismatch. Expected {len(indices)}, got {len(items)} "
            f"(pipeload: from {type(dataset).__name__}.__getitems__)"
        )
    return items


class ConcatDataset(Dataset[T_co], torch_data.ConcatDataset):
    """Map-style datasets laid end to end.

    Args:
        datasets: a non-empty iterable of map-style datasets (ours or torch's).

    Raises:
        AssertionError: ``datasets`` is empty or contains an iterable-style dataset.

    Example:
        >>> len(ConcatDataset([range(3), range(5)]))
        8
    """

    datasets: list[Dataset[T_co]]
    cumulative_sizes: list[int]

    @staticmethod
    def cumsum(sequence: Iterable[Any]) -> list[int]:
        """Running totals of the lengths of ``sequence``'s items."""
        return list(itertools.accumulate(len(item) for item in sequence))

    def __init__(self, datasets: Iterable[Dataset[Any]]) -> None:
        self.datasets = list(datasets)
        if not self.datasets:
            raise AssertionError("datasets should not be an empty iterable, but got no datasets")
        for position, part in enumerate(self.datasets):
            if _is_iterable_dataset(part):
                raise AssertionError(
                    "ConcatDataset does not support IterableDataset, but datasets"
                    f"[{position}] is {type(part).__name__}; use ChainDataset for streams"
                )
        self.cumulative_sizes = self.cumsum(self.datasets)

    def __len__(self) -> int:
        return self.cumulative_sizes[-1]

    def __getitem__(self, idx: int) -> T_co:
        total = len(self)
        if idx < 0:
            if -idx > total:
                raise ValueError(
                    "absolute value of index should not exceed dataset length, but got "
                    f"idx={idx} for a ConcatDataset of length {total}"
                )
            idx += total
        part = bisect.bisect_right(self.cumulative_sizes, idx)
        if part >= len(self.datasets):
            # torch's words are those of its list of parts, the one it indexes past the end.
            raise IndexError(
                f"list index out of range (pipeload: got idx={idx} for a ConcatDataset of length {total})"
            )
        offset = self.cumulative_sizes[part - 1] if part > 0 else 0
        return self.datasets[part][idx - offset]

    @property
    def cummulative_sizes(self) -> list[int]:
        """Deprecated misspelling of ``cumulative_sizes``, kept for old code."""
        warnings.warn(
            "`cummulative_sizes` attribute is renamed to `cumulative_sizes`",
            FutureWarning,
            stacklevel=first_frame_outside_pipeload(),
        )
        return self.cumulative_sizes


class ChainDataset(IterableDataset[Any], torch_data.ChainDataset):
    """Iterable-style datasets read one after another, lazily.

    Args:
        datasets: iterable-style datasets (ours or torch's). Checked while iterating.

    Example:
        >>> list(ChainDataset([stream_a, stream_b]))   # all of a, then all of b
    """

    def __init__(self, datasets: Iterable[Dataset[Any]]) -> None:
        self.datasets = datasets

    def __iter__(self) -> Iterator[Any]:
        for part in self.datasets:
            _require_iterable_part(part)
            yield from part

    def __len__(self) -> int:
        total = 0
        for part in self.datasets:
            _require_iterable_part(part)
            total += len(part)  # type: ignore[arg-type]
        return total


def _require_iterable_part(part: object) -> None:
    if not _is_iterable_dataset(part):
        raise AssertionError(
            f"ChainDataset only supports IterableDataset, but got a {type(part).__name__}"
        )


class Subset(Dataset[T_co], torch_data.Subset):
    """The samples of ``dataset`` at ``indices``, in that order.

    Args:
        dataset: the whole map-style dataset.
        indices: positions in ``dataset`` that make up the subset.

    Example:
        >>> Subset(range(10), [7, 3])[1]
        3
    """

    dataset: Dataset[T_co]
    indices: Sequence[int]

    def __init__(self, dataset: Dataset[T_co], indices: Sequence[int]) -> None:
        self.dataset = dataset
        self.indices = indices
        _check_getitems_follows_getitem(type(self))

    def __getitem__(self, idx: Any) -> Any:
        if isinstance(idx, list):
            return self.dataset[[self.indices[i] for i in idx]]  # type: ignore[index]
        return self.dataset[self.indices[idx]]

    def __getitems__(self, indices: list[int]) -> list[T_co]:
        # A subclass that customises __getitem__ must see every fetch, batched ones included.
        if type(self).__getitem__ is not Subset.__getitem__:
            return [self[idx] for idx in indices]
        return _fetch_many(self.dataset, [self.indices[idx] for idx in indices])

    # It fetches as its dataset does: economic mode looks through it (engine/fetch.py,
    # fetches_items_one_by_one).
    __getitems__.passes_indices_on = True  # type: ignore[attr-defined]

    def __len__(self) -> int:
        return len(self.indices)


def _check_getitems_follows_getitem(kind: type) -> None:
    """torch refuses a Subset subclass that customises ``__getitem__`` alone (the loader fetches
    batches through ``__getitems__``, which would pass it by): so do we, in torch's words.

    Raises:
        NotImplementedError: naming the class and both methods, with the one-line fix.
    """
    if kind.__getitem__ is not Subset.__getitem__ and kind.__getitems__ is Subset.__getitems__:
        raise NotImplementedError(
            f"{kind.__name__} overrides __getitem__ but not __getitems__. The DataLoader fetches "
            f"a batch of a Subset with one __getitems__ call, so give {kind.__name__} one that "
            "goes through your __getitem__:\n\n"
            "    def __getitems__(self, indices):\n"
            "        return [self[index] for index in indices]")


def random_split(
    dataset: Dataset[T],
    lengths: Sequence[int | float],
    generator: torch.Generator | None = torch.default_generator,
) -> list[Subset[T]]:
    """Split ``dataset`` at random into non-overlapping subsets of the given sizes.

    ``lengths`` may be fractions summing to 1: each split gets ``floor(frac * len)`` and the
    remainder is handed out one at a time, round-robin from the first split. Draws exactly one
    ``torch.randperm(len(dataset), generator=generator)``, as torch does.

    Args:
        dataset: the map-style dataset to split.
        lengths: sizes of the splits, or fractions that sum to 1.
        generator: source of randomness; defaults to torch's global generator.

    Returns:
        One ``Subset`` per entry of ``lengths``.

    Raises:
        ValueError: a fraction outside [0, 1], a negative length, or lengths that do not add
            up to ``len(dataset)``.

    Example:
        >>> train, val = random_split(range(10), [0.8, 0.2], torch.Generator().manual_seed(0))
    """
    total = len(dataset)  # type: ignore[arg-type]
    if math.isclose(sum(lengths), 1) and sum(lengths) <= 1:
        lengths = _lengths_from_fractions(lengths, total)
    for position, length in enumerate(lengths):
        if length < 0:
            raise ValueError(
                f"Lengths must not be negative, but got lengths[{position}]={length}"
            )
    if sum(lengths) != total:
        raise ValueError(
            "Sum of input lengths does not equal the length of the input dataset! Got "
            f"lengths={list(lengths)} (sum {sum(lengths)}) for a dataset of length {total}"
        )
    order = torch.randperm(sum(lengths), generator=generator).tolist()  # type: ignore[call-overload]
    ends = itertools.accumulate(lengths)
    return [Subset(dataset, order[end - length:end])  # type: ignore[misc]
            for end, length in zip(ends, lengths, strict=True)]


def _lengths_from_fractions(fractions: Sequence[int | float], total: int) -> list[int]:
    for position, fraction in enumerate(fractions):
        if not 0 <= fraction <= 1:
            raise ValueError(
                f"Fraction at index {position} is not between 0 and 1: got {fraction}"
            )
    lengths = [math.floor(total * fraction) for fraction in fractions]
    for extra in range(total - sum(lengths)):
        lengths[extra % len(lengths)] += 1
    for position, length in enumerate(lengths):
        if length == 0:
            warnings.warn(
                f"Length of split at index {position} is 0. This might result in an empty "
                "dataset.",
                stacklevel=first_frame_outside_pipeload(),
            )
    return lengths
