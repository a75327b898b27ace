"""Helpers shared by the differential tests, where torch.utils.data is the oracle."""

from __future__ import annotations

from collections.abc import Callable, Iterator, Mapping
from types import ModuleType
from typing import Any

import pytest
import torch


def generator(seed: int) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


def raises_like_torch(
    theirs: ModuleType, ours: ModuleType, build_and_run: Callable[[Any], object]
) -> pytest.ExceptionInfo[BaseException]:
    """Run ``build_and_run`` with torch's module, then ours: both must raise the same type."""
    with pytest.raises(Exception) as their_error:
        build_and_run(theirs)
    with pytest.raises(type(their_error.value)) as our_error:
        build_and_run(ours)
    assert type(our_error.value) is type(their_error.value)
    return our_error


class FrozenMap(Mapping):
    """An immutable mapping that can be built from a dict (so containers keep its type)."""

    def __init__(self, data: Mapping[Any, Any]) -> None:
        self._data = dict(data)

    def __getitem__(self, key: Any) -> Any:
        return self._data[key]

    def __iter__(self) -> Iterator[Any]:
        return iter(self._data)

    def __len__(self) -> int:
        return len(self._data)


class KeywordOnlyMap(FrozenMap):
    """An immutable mapping that cannot be built from one dict: rebuilding falls back to dict."""

    def __init__(self, *, items: Mapping[Any, Any]) -> None:
        super().__init__(items)


def drain_skipping(iterator: Iterator[Any], error_type: type[BaseException]) -> tuple[list[Any], int]:
    """The skip-bad-batch loop users write: ``next()`` until StopIteration, counting and skipping
    ``error_type``. Returns the batches (as lists where they are tensors) and the error count.

    A bound guards against a loader that never ends (an error on every call).
    """
    batches: list[Any] = []
    errors = 0
    for _ in range(10_000):
        try:
            batch = next(iterator)
        except StopIteration:
            return batches, errors
        except error_type:
            errors += 1
            continue
        batches.append(_as_lists(batch))
    raise AssertionError(f"no end after 10000 calls: {len(batches)} batches, {errors} errors")


def _as_lists(batch: Any) -> Any:
    if isinstance(batch, torch.Tensor):
        return batch.tolist()
    if isinstance(batch, (list, tuple)):
        return [_as_lists(item) for item in batch]
    if isinstance(batch, Mapping):
        return {key: _as_lists(value) for key, value in batch.items()}
    return batch
