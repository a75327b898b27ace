"""Fetchers: turn one task (a list of indices, or one index) into one batch.

Shared by the inline engine and the workers, so every engine fetches the same way.
"""

from __future__ import annotations

from typing import Any

from pipeload.engine.plan import DatasetKind, FetchSpec


class DatasetExhausted(Exception):
    """An iterable dataset replica has nothing more to give (never sent as an object: see messages)."""


class MapFetcher:
    """Indexes a map-style dataset; whole batches go to ``__getitems__`` when it is defined."""

    def __init__(self, spec: FetchSpec) -> None:
        self._spec = spec
        getitems = getattr(spec.dataset, "__getitems__", None)
        self._getitems = getitems if getitems else None

    def fetch(self, index: Any) -> Any:
        spec = self._spec
        if not spec.auto_collation:
            return spec.collate_fn(spec.dataset[index])
        return spec.collate_fn(self.samples(index))

    def samples(self, indices: list[Any]) -> list[Any]:
        """The samples at ``indices``, uncollated (economic mode's item workers stop here)."""
        if self._getitems is not None:
            return self._getitems(indices)
        return [self._spec.dataset[i] for i in indices]

    @property
    def has_getitems(self) -> bool:
        return self._getitems is not None


class IterableFetcher:
    """Pulls from one replica of an iterable dataset; a task's index list only sets the batch size."""

    def __init__(self, spec: FetchSpec) -> None:
        self._spec = spec
        self._samples = iter(spec.dataset)
        self._ended = False

    def fetch(self, index: Any) -> Any:
        if self._ended:
            raise DatasetExhausted
        spec = self._spec
        if not spec.auto_collation:
            try:
                sample = next(self._samples)
            except StopIteration:
                self._ended = True
                raise DatasetExhausted from None
            return spec.collate_fn(sample)
        samples = self._take(len(index))
        if not samples or (spec.drop_last and len(samples) < len(index)):
            raise DatasetExhausted
        return spec.collate_fn(samples)

    def _take(self, count: int) -> list[Any]:
        samples = []
        for _ in range(count):
            try:
                samples.append(next(self._samples))
            except StopIteration:
                self._ended = True
                break
        return samples


def make_fetcher(spec: FetchSpec) -> MapFetcher | IterableFetcher:
    """Build the fetcher for ``spec``; for iterable datasets this calls ``iter(dataset)``."""
    if spec.kind is DatasetKind.ITERABLE:
        return IterableFetcher(spec)
    return MapFetcher(spec)
