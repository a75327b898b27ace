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
