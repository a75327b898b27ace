"""Fetchers: turn one task (a list of indices, or one index) into one batch.

Shared by the inline engine and the workers, so every engine fetches the same way. With a
:class:`~pipeload.stats.clock.StageClock` a fetcher times the dataset and ``collate_fn`` apart
(and opens profiler spans for them while a torch profiler runs); without one it only fetches.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from pipeload.engine.plan import DatasetKind, FetchSpec
from pipeload.stats.clock import StageClock, now, profiling, span


class DatasetExhausted(Exception):
    """An iterable dataset replica has nothing more to give (never sent as an object: see messages)."""


class MapFetcher:
    """Indexes a map-style dataset; whole batches go to ``__getitems__`` when it is defined."""

    def __init__(self, spec: FetchSpec, clock: StageClock | None = None) -> None:
        self._spec = spec
        self._clock = clock
        getitems = getattr(spec.dataset, "__getitems__", None)
        self._getitems = getitems if getitems else None

    def fetch(self, index: Any) -> Any:
        spec = self._spec
        clock = self._clock
        if clock is not None:
            take = (lambda: self.samples(index)) if spec.auto_collation else (lambda: [spec.dataset[index]])
            if profiling():
                return _traced(clock, take, spec.collate_fn, spec.auto_collation)
            # The common case, kept lean: a tiny batch's whole trip takes tens of microseconds.
            started = now()
            samples = take()
            fetched = now()
            clock.fetch_s += fetched - started
            clock.samples += len(samples)
            batch = spec.collate_fn(samples if spec.auto_collation else samples[0])
            clock.collate_s += now() - fetched
            return batch
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

    def __init__(self, spec: FetchSpec, clock: StageClock | None = None) -> None:
        self._spec = spec
        self._clock = clock
        self._samples = iter(spec.dataset)
        self._ended = False

    def fetch(self, index: Any) -> Any:
        if self._ended:
            raise DatasetExhausted
        spec = self._spec
        if not spec.auto_collation:
            take = self._take_one
        else:
            def take() -> list[Any]:
                samples = self._take(len(index))
                if not samples or (spec.drop_last and len(samples) < len(index)):
                    raise DatasetExhausted
                return samples
        if self._clock is not None:
            return _traced(self._clock, take, spec.collate_fn, spec.auto_collation, profiling())
        samples = take()
        return spec.collate_fn(samples if spec.auto_collation else samples[0])

    def _take_one(self) -> list[Any]:
        try:
            return [next(self._samples)]
        except StopIteration:
            self._ended = True
            raise DatasetExhausted from None

    def _take(self, count: int) -> list[Any]:
        samples = []
        for _ in range(count):
            try:
                samples.append(next(self._samples))
            except StopIteration:
                self._ended = True
                break
        return samples


def _traced(clock: StageClock, take: Callable[[], list[Any]], collate_fn: Callable[[Any], Any],
            auto_collation: bool, traced: bool = True) -> Any:
    """``collate_fn`` over what ``take`` returns, each timed into ``clock``, and each in a
    profiler span when ``traced``. Time spent in a call that raised counts too."""
    started = now()
    try:
        if traced:
            with span("pipeload.fetch"):
                samples = take()
        else:
            samples = take()
    finally:
        fetched = now()
        clock.fetch_s += fetched - started
    clock.samples += len(samples)
    try:
        if traced:
            with span("pipeload.collate"):
                return collate_fn(samples if auto_collation else samples[0])
        return collate_fn(samples if auto_collation else samples[0])
    finally:
        clock.collate_s += now() - fetched


def make_fetcher(spec: FetchSpec, clock: StageClock | None = None) -> MapFetcher | IterableFetcher:
    """Build the fetcher for ``spec``; for iterable datasets this calls ``iter(dataset)``."""
    if spec.kind is DatasetKind.ITERABLE:
        return IterableFetcher(spec, clock)
    return MapFetcher(spec, clock)
