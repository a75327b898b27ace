"""The inline engine (num_workers=0): fetches in the calling thread, one batch at a time."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

from pipeload.engine import replica
from pipeload.engine.fetch import DatasetExhausted, IterableFetcher, MapFetcher, make_fetcher
from pipeload.engine.plan import FetchSpec, ReplicaSetup
from pipeload.stats.skips import skip_counter


class InlineEngine:
    """No workers, no threads: ``next_batch`` builds the batch right here, from the loader's own
    dataset (a DataPipe graph is sharded by rank and seeded in place, as torch does)."""

    def __init__(self, spec: FetchSpec, replica_setup: ReplicaSetup = ReplicaSetup(),
                 stats: Any = None) -> None:
        self._spec = spec
        self._replica = replica_setup
        # With stats on (the loader's StatsRecorder), the fetching here is timed as a worker's.
        self._clock = stats.new_session(1).local_clock() if stats is not None else None
        self._fetcher: MapFetcher | IterableFetcher | None = None
        self._tasks: Iterator[Any] = iter(())
        self._closed = False

    @property
    def workers(self) -> list[Any]:
        return []

    @property
    def closed(self) -> bool:
        return self._closed

    def start_epoch(self, tasks: Iterator[Any], shared_seed: int | None = None) -> None:
        self._closed = False
        self._tasks = tasks
        if shared_seed is not None:
            self._replica = ReplicaSetup(self._replica.rank, self._replica.world_size, shared_seed)
        replica.prepare(self._spec.dataset, self._replica, worker_id=0, num_workers=1)
        self._fetcher = make_fetcher(self._spec, self._clock)
        if self._clock is not None and self._clock.count_skipped is None:
            self._clock.count_skipped = skip_counter(self._spec.dataset)

    def next_batch(self) -> Any:
        """The next batch. The dataset's or collate_fn's error for it propagates, and the next
        call goes on with the next batch; once closed (Ctrl-C), the epoch is over."""
        if self._closed:
            raise StopIteration
        index = next(self._tasks)
        try:
            batch = self._fetcher.fetch(index)
        except DatasetExhausted:
            raise StopIteration from None
        if self._clock is not None:
            self._clock.tasks += 1
        return batch

    def close(self) -> None:
        self._closed = True
