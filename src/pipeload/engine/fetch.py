"""Fetchers: turn one task (a list of indices, or one index) into one batch.

Shared by the inline engine and the workers, so every engine fetches the same way. With a
:class:`~pipeload.stats.clock.StageClock` a fetcher times the dataset and ``collate_fn`` apart
(and opens profiler spans for them while a torch profiler runs) on the tasks the clock samples,
and only counts samples on the others; without one it only fetches.
With per-batch seeding (``engine/batch_seeding.py``) it seeds the generators before each batch;
an iterable replica also reports its position with every batch (``StreamBatch``) and resumes
from one, which is how the loader checkpoints iterable datasets (``pipeload/resume``).
"""

from __future__ import annotations

import contextlib
import copy
import operator
import sys
from collections.abc import Callable
from typing import Any, NamedTuple

import torch.autograd.profiler as _torch_profiler
import torch.utils.data as torch_data

from pipeload._optional import optional_attribute
from pipeload._rng_state import global_rngs_kept
from pipeload.collate import collates_as_shipped, default_collate
from pipeload.engine.batch_seeding import BatchSeeding
from pipeload.engine.plan import DatasetKind, FetchSpec
from pipeload.stats.clock import StageClock, now, profiling, span
from pipeload.transport.sample_rows import rows_for


class DatasetExhausted(Exception):
    """An iterable dataset replica has nothing more to give (never sent as an object: see messages)."""


class StreamPosition(NamedTuple):
    """Where one iterable replica stands after a batch.

    A replica's ``state_dict()`` can be costly (a shuffle buffer is copied), so it is taken with
    every few batches only; resuming loads the latest one and makes (and drops) the batches made
    since. A replica without a state starts over and drops every batch it had made.

    A batch whose building raised counts as made (its turn passed, as the loader hands its error
    out in its place); ``failed`` says which, so that a resume expects them to raise again and
    refuses to drop, unseen, an error that did not happen before the checkpoint.

    Attributes:
        worker_id: the replica's worker (0 without workers).
        batches: how many batches it has made this epoch, this one included.
        snapshot: None, or ``(batches made when it was taken, the iterator's state_dict() or the
            dataset's, or None when it has none)``.
        failed: the numbers (counted as ``batches``, from 1) of the batches made since the
            snapshot's state (since the start, without one) whose building raised.
    """

    worker_id: int
    batches: int
    snapshot: tuple[int, Any] | None = None
    failed: tuple[int, ...] = ()


class StreamBatch(NamedTuple):
    """A batch with its replica's position, as sent when the loader tracks positions."""

    batch: Any
    position: StreamPosition


class MapFetcher:
    """Indexes a map-style dataset; whole batches go to ``__getitems__`` when it is defined."""

    def __init__(self, spec: FetchSpec, clock: StageClock | None = None,
                 seeding: BatchSeeding | None = None, place_rows: bool = False) -> None:
        """``place_rows``: write each sample into its rows of the batch's slab as it is fetched,
        when ``default_collate`` will stack them there (a classic process worker: see
        transport/sample_rows.py)."""
        self._spec = spec
        self._clock = clock
        self._seeding = seeding
        getitems = getattr(spec.dataset, "__getitems__", None)
        self._getitems = getitems if getitems else None
        self._places_rows = place_rows and spec.collate_fn is default_collate
        # A numbered clock (the inline engine, a process worker) is driven by the batch numbers;
        # chosen once here.
        numbered = clock is not None and clock.numbered
        self._fetch = self._fetch_counted
        if clock is not None and not numbered and clock.untimed_size is not None:
            self._fetch = self._fetch_sized
        if numbered:
            self._fetch = self._fetch_numbered if clock.untimed_size is not None else self._fetch_numbered_counting  # type: ignore[union-attr]

    def fetch(self, index: Any, batch_number: int = 0) -> Any:
        if self._seeding is None:
            return self._fetch(index, batch_number)
        with self._seeding.for_map_batch(batch_number):
            return self._fetch(index, batch_number)

    def _fetch_counted(self, index: Any, number: int) -> Any:
        clock = self._clock
        spec = self._spec
        if clock is not None:  # count down to the next timed task (stats/clock.py)
            clock.left -= 1
            # The profiler's flag read as an attribute (as stats.clock.profiling does): no call.
            if clock.left <= 0 or _torch_profiler._is_profiler_enabled:
                return self._timed(clock, index, number)
            # Untimed: no closures, no clock reads; the samples counted, exactly (a short last
            # batch among many full ones is one every epoch).
            if spec.auto_collation:
                clock.untimed_samples += len(index)
                return spec.collate_fn(self.samples(index))
            clock.untimed_samples += 1
            return spec.collate_fn(spec.dataset[index])
        if not spec.auto_collation:
            return spec.collate_fn(spec.dataset[index])
        return spec.collate_fn(self.samples(index))

    def _fetch_sized(self, index: Any, number: int) -> Any:
        clock = self._clock
        # A worker whose batches' sizes the sampler tells: it counts down to its next timed
        # task (its own tasks are not numbered in a row) and always times the epoch's last
        # batch, the one that may be short; an untimed one's samples are derived, not counted.
        clock.left -= 1  # type: ignore[union-attr]
        if clock.left <= 0 or number == clock.last_timed or _torch_profiler._is_profiler_enabled:  # type: ignore[union-attr]
            return self._timed(clock, index, number)  # type: ignore[arg-type]
        spec = self._spec
        if not spec.auto_collation:
            return spec.collate_fn(spec.dataset[index])
        return spec.collate_fn(self.samples(index))

    def _fetch_numbered(self, index: Any, number: int) -> Any:
        # Untimed: one comparison against the batch number, and the profiler's flag; nothing
        # to count, the clock knows how many samples an untimed batch holds (untimed_size).
        # (No local for the clock: two bytecodes fewer on the untimed path.)
        if number >= self._clock.next_timed or _torch_profiler._is_profiler_enabled:  # type: ignore[union-attr]
            return self._timed(self._clock, index, number)  # type: ignore[arg-type]
        spec = self._spec
        if not spec.auto_collation:
            return spec.collate_fn(spec.dataset[index])
        return spec.collate_fn(self.samples(index))

    def _fetch_numbered_counting(self, index: Any, number: int) -> Any:
        clock = self._clock
        # A batch sampler that does not tell its batches' sizes: each untimed one is counted.
        if number >= clock.next_timed or _torch_profiler._is_profiler_enabled:  # type: ignore[union-attr]
            return self._timed(clock, index, number)  # type: ignore[arg-type]
        spec = self._spec
        if not spec.auto_collation:
            clock.untimed_samples += 1  # type: ignore[union-attr]
            return spec.collate_fn(spec.dataset[index])
        clock.untimed_samples += operator.length_hint(index, 0)  # type: ignore[union-attr]
        return spec.collate_fn(self.samples(index))

    def _timed(self, clock: StageClock, index: Any, number: int) -> Any:
        if clock.numbered:
            timed = number >= clock.next_timed
            if timed:
                clock.start_timed_at(number)
        else:
            timed = clock.left <= 0 or number == clock.last_timed
            if timed:
                clock.start_timed()
        spec = self._spec
        if _torch_profiler._is_profiler_enabled:
            take = (lambda: self.samples(index)) if spec.auto_collation else (lambda: [spec.dataset[index]])
            return _traced(clock, take, spec.collate_fn, spec.auto_collation, True, timed,
                           meant_samples(index, spec.auto_collation))
        # A timed task without a profiler, kept lean: no closures, three clock reads.
        started = now()
        try:
            samples = self.samples(index) if spec.auto_collation else [spec.dataset[index]]
        except BaseException:
            clock.count_samples(meant_samples(index, spec.auto_collation))
            raise
        finally:
            fetched = now()
            clock.fetch_s += fetched - started
        clock.count_samples(_how_many(samples, meant_samples(index, spec.auto_collation)))
        try:
            return spec.collate_fn(samples if spec.auto_collation else samples[0])
        finally:
            clock.collate_s += now() - fetched

    def samples(self, indices: list[Any]) -> list[Any]:
        """The samples at ``indices``, uncollated (economic mode's item workers stop here)."""
        if self._getitems is not None:
            return self._getitems(indices)
        dataset = self._spec.dataset
        # (An iterator of indices, which torch takes too, has no length to lay rows out by.)
        placing = self._places_rows and hasattr(indices, "__len__") and collates_as_shipped()
        rows = rows_for(len(indices)) if placing else None
        if rows is None:
            return [dataset[i] for i in indices]
        samples: list[Any] = []
        for index in indices:
            samples.append(dataset[index])
            rows.place(samples)
        rows.settle()
        return samples

    @property
    def has_getitems(self) -> bool:
        return self._getitems is not None


def fetches_items_one_by_one(dataset: Any) -> bool:
    """Whether ``dataset`` has no ``__getitems__`` that fetches a batch in one go: none at all,
    or a ``Subset``'s (``random_split``'s), which passes the indices on to a dataset that has
    none of its own. Economic mode then cuts and seeds such batches item by item, the same
    values whatever ``num_workers`` is; a ``__getitems__`` call is one call and one seed, which
    made a ``random_split`` subset's values change with the number of item workers (a
    newcomer's probe at stop 53)."""
    while isinstance(dataset, torch_data.Subset):
        method = type(dataset).__getitems__
        if method is not torch_data.Subset.__getitems__ and not getattr(method, "passes_indices_on", False):
            return False  # a subclass's own
        dataset = dataset.dataset
    return not getattr(dataset, "__getitems__", None)


class IterableFetcher:
    """Pulls from one replica of an iterable dataset; a task's index list only sets the batch size."""

    def __init__(self, spec: FetchSpec, clock: StageClock | None = None, seeding: BatchSeeding | None = None,
                 worker_id: int = 0, resume_from: StreamPosition | None = None,
                 place_rows: bool = False, copy_states: bool = True, in_main_process: bool = False) -> None:
        """``place_rows``: see MapFetcher. ``copy_states``: snapshots are copies of the states
        taken (False where they are pickled at once to cross to another process).
        ``in_main_process``: the training loop's own process (no workers), whose global
        generators belong to the loop."""
        self._spec = spec
        self._copy_states = copy_states
        self._in_main_process = in_main_process
        self._clock = clock
        self._seeding = seeding
        self._worker_id = worker_id
        self._places_rows = place_rows and spec.collate_fn is default_collate
        self._made = 0  # batches made this epoch, those whose building raised included
        self._to_drop = 0  # batches made before the checkpoint since the snapshot resumed from
        self._failed_before: frozenset[int] = frozenset()  # those of them that raised then
        self._ended = False
        self._stateless = False
        snapshot = resume_from.snapshot if resume_from is not None else None
        self._samples = resumed_iterator(spec.dataset, snapshot[1] if snapshot else None)
        self._snapshot_sent = snapshot is not None and snapshot[1] is not None
        if resume_from is not None:
            self._made = snapshot[0] if snapshot and snapshot[1] is not None else 0
            self._to_drop = resume_from.batches - self._made
            self._failed_before = frozenset(resume_from.failed)

    def fetch(self, index: Any, batch_number: int = 0) -> Any:
        if self._to_drop:
            # In the training loop's process, drawing from its global generators: they were
            # restored by its checkpoint, and the batches made again only to be dropped must not
            # move them (the next batch, and the loop's own draws, came from them as they are).
            kept = global_rngs_kept() if self._in_main_process and self._seeding is None else contextlib.nullcontext()
            with kept:
                self._drop_made_before_the_checkpoint(index)
        batch = self._make(index)
        every = self._spec.stream_snapshot_every
        if not every:
            return batch
        # The first snapshot also says at once whether the replica has a state at all.
        due = not self._snapshot_sent or self._made % every == 0
        snapshot = (self._made, self._state()) if due else None
        self._snapshot_sent = self._snapshot_sent or due
        return StreamBatch(batch, StreamPosition(self._worker_id, self._made, snapshot))

    def _drop_made_before_the_checkpoint(self, index: Any) -> None:
        """Make again, as then, the batches made before the checkpoint since the snapshot the
        replica resumed from, and drop them."""
        while self._to_drop:
            self._to_drop -= 1
            number = self._made + 1
            try:
                self._make(index)
            except DatasetExhausted:
                raise
            except Exception as error:
                if number in self._failed_before:
                    continue  # it raised the first time too: its turn is what counts
                # Dropping it would drop what the failure left out (the rest of a shard deleted,
                # replaced or unreadable since), unseen: the batches would not be those of then.
                error.add_note(f"pipeload: raised while making again batch {number} of this "
                               "replica, made before the checkpoint without an error, to resume "
                               "from it: the data changed since, and the rest of the epoch "
                               "would not be what it was")
                raise

    def _make(self, index: Any) -> Any:
        if self._ended:
            raise DatasetExhausted
        seeding = self._seeding
        seeded = seeding.for_stream_batch(self._worker_id, self._made) if seeding else contextlib.nullcontext()
        try:
            with seeded:
                batch = self._next_batch(index)
        except DatasetExhausted:
            raise
        except Exception:
            self._made += 1  # its turn passed (its error is handed out): a resume makes it again
            raise
        self._made += 1
        return batch

    def _next_batch(self, index: Any) -> Any:
        if self._ended:
            raise DatasetExhausted
        spec = self._spec
        if not spec.auto_collation:
            take = self._take_one
        else:
            def take() -> list[Any]:
                samples = self._take(len(index))
                if not samples or (spec.drop_last and len(samples) < len(index)):
                    raise self._found_dry()
                return samples
        clock = self._clock
        # A batch whose read raised counts the samples it was to hold (its batch size), as a
        # map-style one does; the stream's end counts none.
        if clock is not None:  # count down to the next timed task (stats/clock.py)
            clock.left -= 1
            if clock.left <= 0:
                clock.start_timed()
                return _traced(clock, take, spec.collate_fn, spec.auto_collation, profiling(), True,
                               meant_samples(index, spec.auto_collation))
            if profiling():
                return _traced(clock, take, spec.collate_fn, spec.auto_collation, True, False,
                               meant_samples(index, spec.auto_collation))
        try:
            samples = take()
        except DatasetExhausted:
            raise
        except BaseException:
            if clock is not None:
                clock.untimed_samples += meant_samples(index, spec.auto_collation)
            raise
        if clock is not None:
            clock.untimed_samples += len(samples)
        return spec.collate_fn(samples if spec.auto_collation else samples[0])

    def _state(self) -> Any:
        """The replica's position, from its iterator (pipes) or the dataset; None without one."""
        if self._stateless:
            return None
        for holder in (self._samples, self._spec.dataset):
            state_dict = optional_attribute(holder, "state_dict")
            if callable(state_dict):
                try:
                    state = state_dict()
                except NotImplementedError:  # a pipe over a plain generator: it can only skip
                    break
                # A snapshot is read later, when the loader's state_dict() is called: a state
                # that the iterator goes on updating in place (its own live dict), or that holds
                # samples the training loop edits (a shuffle buffer's dicts), had moved on by
                # then, and the resume made and dropped batches from a later position than it
                # recorded, skipping samples without a word. Its containers are copied (the
                # leaves, tensors included, are shared: a deep copy cost a 1,000-sample shuffle
                # buffer 40x its loading, and refused a lock). In another process it is pickled.
                return containers_copied(state) if self._copy_states else state
        self._stateless = True
        return None

    def close(self) -> None:
        """Stop the run over the replica now, where it is a pipe graph's (its boundaries'
        threads and processes): dropping it is not enough, as an error one of its batches raised
        may keep it, in a reference cycle through that error's traceback (a thread boundary
        hands on the very exception), until the collector runs. Another iterator is left to go
        as torch lets it: its ``close`` may mean something else."""
        # Looked up, not imported: the engine room imports nothing from the pipes above it, and
        # where their module was never imported no pipe can have been made.
        protocol = sys.modules.get("pipeload.datapipes.protocol")
        if protocol is not None and isinstance(self._samples, protocol.PipeIterator):
            self._samples.close()

    def _take_one(self) -> list[Any]:
        try:
            return [next(self._samples)]
        except StopIteration:
            self._ended = True
            raise self._found_dry() from None

    def _found_dry(self) -> DatasetExhausted:
        """What the task in hand raises on finding the replica dry. It built no batch, so it is
        no task in the stats: its clock, told of it before the samples were taken, forgets it."""
        if self._clock is not None:
            self._clock.uncount()
        return DatasetExhausted()

    def _take(self, count: int) -> list[Any]:
        samples: list[Any] = []
        rows = rows_for(count) if self._places_rows and collates_as_shipped() else None
        for _ in range(count):
            try:
                samples.append(next(self._samples))
            except StopIteration:
                self._ended = True
                break
            if rows is not None:
                rows.place(samples)
        if rows is not None:
            rows.settle()
        return samples


def meant_samples(index: Any, auto_collation: bool) -> int:
    """The samples a task was to hold: a batch that failed counts them, as an untimed batch
    counts its sampler's size whatever happens to it (counted as none, failed batches took the
    stats' samples a batch, and samples/s, below what the loop received)."""
    return operator.length_hint(index, 0) if auto_collation else 1


def _how_many(samples: Any, meant: int) -> int:
    """How many samples a fetch returned; what the task was to hold when they have no length (a
    ``__getitems__`` that returns a generator: ``collate_fn`` then fails on it with torch's words,
    "'generator' object is not subscriptable", where counting them failed first)."""
    try:
        return len(samples)
    except TypeError:
        return meant


def _traced(clock: StageClock, take: Callable[[], list[Any]], collate_fn: Callable[[Any], Any],
            auto_collation: bool, traced: bool, timing: bool, meant: int = 0) -> Any:
    """``collate_fn`` over what ``take`` returns, each in a profiler span when ``traced``, and
    each timed into ``clock`` when ``timing`` (the clock samples this task). Time spent in a
    call that raised counts too, and so do the ``meant`` samples of a task whose fetch raised
    (0: not known, an iterable's)."""
    started = now()
    try:
        if traced:
            with span("pipeload.fetch"):
                samples = take()
        else:
            samples = take()
    except DatasetExhausted:
        # An iterable's end: no batch was meant, and the task is no task (its clock has taken it
        # back, StageClock.uncount), so its seconds are no stage's either.
        timing = False
        raise
    except BaseException:
        if meant and timing:
            clock.count_samples(meant)
        elif meant:
            clock.count_untimed(meant)
        raise
    finally:
        fetched = now()
        if timing:
            clock.fetch_s += fetched - started
    if timing:
        clock.count_samples(_how_many(samples, meant))
    else:
        clock.count_untimed(_how_many(samples, meant))
    try:
        if traced:
            with span("pipeload.collate"):
                return collate_fn(samples if auto_collation else samples[0])
        return collate_fn(samples if auto_collation else samples[0])
    finally:
        if timing:
            clock.collate_s += now() - fetched


def resumed_iterator(dataset: Any, state: Any) -> Any:
    """``iter(dataset)``, moved to ``state`` when there is one: through the iterator's
    ``load_state_dict`` (pipes), else the dataset's (before ``iter``, as torchdata's datasets)."""
    if state is None:
        return iter(dataset)
    load_into_dataset = optional_attribute(dataset, "load_state_dict")
    samples = iter(dataset) if load_into_dataset is None else None
    if samples is not None and callable(optional_attribute(samples, "load_state_dict")):
        samples.load_state_dict(state)
        return samples
    if callable(load_into_dataset):
        load_into_dataset(state)
        return iter(dataset)
    raise TypeError(f"{type(dataset).__name__} gave a state_dict() but has no load_state_dict() to take it back")


def make_fetcher(spec: FetchSpec, clock: StageClock | None = None, seeding: BatchSeeding | None = None,
                 worker_id: int = 0, resume_from: StreamPosition | None = None,
                 place_rows: bool = False, copy_states: bool = True,
                 in_main_process: bool = False) -> MapFetcher | IterableFetcher:
    """Build the fetcher for ``spec``; for iterable datasets this calls ``iter(dataset)``.
    ``place_rows``: see MapFetcher; ``copy_states`` and ``in_main_process``: see IterableFetcher."""
    if spec.kind is DatasetKind.ITERABLE:
        return IterableFetcher(spec, clock, seeding, worker_id, resume_from, place_rows, copy_states,
                               in_main_process)
    return MapFetcher(spec, clock, seeding, place_rows)


def containers_copied(value: Any) -> Any:
    """``value`` with its dicts, lists and tuples copied, all the way down, and everything else
    shared; ``value`` itself where a container cannot be copied (or nests too deep)."""
    try:
        return _copied(value)
    except (TypeError, RecursionError, copy.Error):
        return value


def _copied(value: Any) -> Any:
    kind = type(value)
    if kind is dict:
        return {key: _copied(item) for key, item in value.items()}
    if kind is list:
        return [_copied(item) for item in value]
    if kind is tuple:
        return tuple(_copied(item) for item in value)
    if isinstance(value, dict):  # an OrderedDict, a defaultdict: its own kind, items copied
        made = copy.copy(value)
        for key, item in made.items():
            made[key] = _copied(item)
        return made
    return value
