"""The base class of every sampler (its own module so the sampler modules can share it)."""

from __future__ import annotations

from collections.abc import Iterator
from typing import TypeVar

import torch.utils.data as torch_data  # torch's class: a base for identity, never called

T_co = TypeVar("T_co", covariant=True)


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
