"""The inline engine (num_workers=0): fetches in the calling thread, one batch at a time."""

from __future__ import annotations

import math
from collections.abc import Callable, Iterator
from typing import Any

from pipeload.engine import replica
from pipeload.engine.batch_seeding import BatchSeeding
from pipeload.engine.epoch_flow import mark_worker
from pipeload.engine.fetch import DatasetExhausted, IterableFetcher, MapFetcher, make_fetcher, meant_samples
from pipeload.engine.plan import DatasetKind, EpochStart, FetchSpec, ReplicaSetup
from pipeload.stats import skips
from pipeload.stats.ray_stage import ray_stage_counter


class InlineEngine:
    """No workers, no threads: ``next_batch`` builds the batch right here, from the loader's own
    dataset (a DataPipe graph is sharded by rank and seeded in place, as torch does).

    With per-batch seeding it borrows the process's generators for each batch and gives them
    back, so the training loop's own random stream is left as it was.
    """

    def __init__(self, spec: FetchSpec, replica_setup: ReplicaSetup = ReplicaSetup(),
                 stats: Any = None, base_seed: int = 0, epoch: int = 1,
                 batch_sizes: Callable[[], tuple[int, int | None] | None] = lambda: None) -> None:
        """``batch_sizes``: what each epoch's batches hold, when the sampler tells
        (``samplers.batch_sizes``), read as each epoch starts: the stats then count an untimed
        batch's samples without looking at it."""
        self._spec = spec
        self._replica = replica_setup
        self._base_seed = base_seed
        self._epoch = epoch  # seeds per batch name it: a resumed session's epoch, else 1
        self._batch_sizes = batch_sizes
        # With stats on (the loader's StatsRecorder), the fetching here is timed as a worker's.
        self._session = stats.new_session(1) if stats is not None else None
        self._clock = self._session.local_clock() if self._session is not None else None
        self._fetcher: MapFetcher | IterableFetcher | None = None
        self._tasks: Iterator[Any] = iter(())
        self._next_number = 0
        self._first_number = 0
        self._fetched_before = 0  # tasks of the epochs before this one
        if self._clock is not None and spec.kind is not DatasetKind.ITERABLE:
            # Map-style: the batch numbers drive the clock (one comparison per untimed batch).
            self._clock.count_tasks = self._tasks_fetched
            sizes = batch_sizes()
            if sizes is not None:  # the same every epoch (but the last batch's number)
                self._clock.untimed_size = sizes[0]
        self._closed = False

    def _tasks_fetched(self) -> int:
        """Tasks fetched (or failed) so far, over every epoch: the clock's task count."""
        return self._fetched_before + self._next_number - self._first_number

    @property
    def workers(self) -> list[Any]:
        return []

    @property
    def closed(self) -> bool:
        return self._closed

    def start_epoch(self, tasks: Iterator[Any], shared_seed: int | None = None,
                    start: EpochStart = EpochStart()) -> None:
        self._closed = False
        self._tasks = tasks
        self._fetched_before = self._tasks_fetched()
        self._next_number = self._first_number = start.first_batch
        clock = self._clock
        if clock is not None:
            clock.next_timed = start.first_batch  # each epoch's first batch is timed
            if clock.untimed_size is not None:  # and its last, which may be short
                sizes = self._batch_sizes()
                last = sizes[1] if sizes is not None else None
                clock.last_timed = math.inf if last is None else last
        if shared_seed is not None:
            self._replica = ReplicaSetup(self._replica.rank, self._replica.world_size, shared_seed)
        replica.prepare(self._spec.dataset, self._replica, worker_id=0, num_workers=1)
        seeding = BatchSeeding(self._base_seed, self._epoch, borrow=True) if self._spec.per_batch_seeding else None
        resume_from = (self._spec.resume_streams or {}).get(0)
        # Before the iterator is made: a read-ahead thread it starts counts from the first.
        skips.bind(self._spec.dataset, self._spec.failures, skips.MAIN_ROW)
        self._fetcher = make_fetcher(self._spec, self._clock, seeding, 0, resume_from, in_main_process=True)
        if self._clock is not None and self._clock.count_ray_stage is None:
            self._clock.count_ray_stage = ray_stage_counter(self._spec.dataset, self._clock.ray_stage)

    def next_batch(self) -> Any:
        """The next batch. The dataset's or collate_fn's error for it propagates, and the next
        call goes on with the next batch; once closed (Ctrl-C), the epoch is over."""
        if self._closed:
            raise StopIteration
        index = next(self._tasks)
        number = self._next_number
        self._next_number += 1
        try:
            batch = self._fetcher.fetch(index, number)
        except DatasetExhausted:
            raise StopIteration from None
        except Exception as error:
            mark_worker(error, 0)  # the batch's turn passed: its replica's position counts it
            if self._clock is not None:
                self._clock.failed(meant_samples(index, self._spec.auto_collation))
                self._clock.done()  # no bytes: the next, untimed, batch must not count its own
            raise
        if self._clock is not None and self._clock.timing:
            self._clock.done(batch)  # its bytes: what a worker would have to hand over (analysis.py)
        return batch

    def close(self) -> None:
        self._closed = True
        if isinstance(self._fetcher, IterableFetcher):
            self._fetcher.close()  # the graph's boundaries stop now, not when the collector runs
        if self._clock is not None:
            self._clock.stop_counting_ray_stage()
        if self._session is not None:
            self._session.close()
