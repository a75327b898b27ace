"""Batching variable-size items: padded batches and length buckets."""

from __future__ import annotations

import random
from collections import deque
from collections.abc import Callable, Iterator, Mapping
from typing import Any

import torch

from pipeload.datapipes._functions import raised_by_function
from pipeload.datapipes.base import IterDataPipe
from pipeload.datapipes.chunk import DataChunk
from pipeload.datapipes.iter._columns import batch_count, check_positive, length_of
from pipeload.datapipes.iter.combinatorics import SeededPipe
from pipeload.datapipes.iter.grouping import Batcher, _BatcherIterator
from pipeload.datapipes.protocol import PipeIterator, SkipToResume

_SCALARS = (int, float, complex, bool)


class PaddedBatcher(Batcher):
    """Batch items, padding each batch's tensors and lists to its longest (functional name:
    ``padded_batch``).

    Items are padded field by field: tensors at the end of every dimension up to the largest
    size in the batch, lists of numbers at the end up to the longest list, tuples and dicts
    field by field (named tuples keep their type); anything else is left as it is. Follow with
    ``.collate()`` to stack the batch into tensors.

    Args:
        datapipe: the source pipe.
        batch_size: items per batch.
        drop_last: drop the last batch if it is short.
        padding_value: the value padding is filled with.

    Example:
        >>> list(IterableWrapper([[1, 2, 3], [4]]).padded_batch(2, padding_value=-1))
        [[[1, 2, 3], [4, -1, -1]]]
    """

    def __init__(self, datapipe: IterDataPipe, batch_size: int, drop_last: bool = False, padding_value: Any = 0) -> None:
        super().__init__(datapipe, batch_size, drop_last)
        self.padding_value = padding_value

    def __iter__(self) -> Iterator[DataChunk]:
        return _PaddedIterator(self, self.datapipe)


class _PaddedIterator(_BatcherIterator):
    def __init__(self, pipe: PaddedBatcher, source: Any) -> None:
        super().__init__(pipe, source)
        self._padding_value = pipe.padding_value

    def nonblocking_next(self) -> DataChunk:
        batch = super().nonblocking_next()
        return DataChunk(pad_to_longest(list(batch), self._padding_value))


def pad_to_longest(samples: list[Any], value: Any) -> list[Any]:
    """Pad the tensors and lists of ``samples`` (field by field) to the longest in the list."""
    first = samples[0]
    if isinstance(first, torch.Tensor):
        return _pad_tensors(samples, value)
    if isinstance(first, tuple):
        fields = [pad_to_longest(list(column), value) for column in zip(*samples, strict=True)]
        rebuild = type(first)._make if hasattr(first, "_fields") else type(first)
        return [rebuild(values) for values in zip(*fields, strict=True)]
    if isinstance(first, Mapping):
        padded = {key: pad_to_longest([sample[key] for sample in samples], value) for key in first}
        return [type(first)({key: padded[key][i] for key in first}) for i in range(len(samples))]  # type: ignore[call-arg]
    if isinstance(first, list) and all(_is_number_list(sample) for sample in samples):
        longest = max(len(sample) for sample in samples)
        return [sample + [value] * (longest - len(sample)) for sample in samples]
    return samples


def _is_number_list(sample: Any) -> bool:
    return isinstance(sample, list) and all(isinstance(x, _SCALARS) for x in sample)


def _pad_tensors(samples: list[torch.Tensor], value: Any) -> list[torch.Tensor]:
    ranks = {sample.dim() for sample in samples}
    if len(ranks) > 1:
        raise ValueError(
            "padded_batch pads tensors of the same number of dimensions, but the batch has shapes "
            f"{[tuple(sample.shape) for sample in samples]}"
        )
    largest = [max(sizes) for sizes in zip(*(sample.shape for sample in samples), strict=True)]
    padded = []
    for sample in samples:
        if list(sample.shape) == largest:
            padded.append(sample)
            continue
        out = sample.new_full(largest, value)
        out[tuple(slice(0, size) for size in sample.shape)] = sample
        padded.append(out)
    return padded


class BucketBatcher(SeededPipe, IterDataPipe[DataChunk]):
    """Batch items of similar size together, to cut padding (functional name: ``bucketbatch``).

    The source is read in pools of ``batch_size * batch_num * bucket_num`` items. A pool's
    items are shuffled (unless there is one bucket and a ``sort_key``: each bucket is then that
    many consecutive items, as torchdata keeps them), cut into ``bucket_num`` buckets that
    ``sort_key`` sorts, and cut into batches; with a ``sort_key`` the batches are shuffled too
    (``use_in_batch_shuffle=True``: within each run of ``bucket_num`` batches, as torchdata
    does, so one bucket keeps its batches in order). The arguments are torchdata's;
    ``set_seed``/``set_shuffle`` work as for ``shuffle``.

    Args:
        datapipe: the source pipe.
        batch_size: items per batch.
        drop_last: drop the last batch if it is short.
        batch_num: batches per bucket.
        bucket_num: buckets per pool.
        sort_key: bucket (a list) -> the same items sorted, e.g.
            ``lambda bucket: sorted(bucket, key=len)``; None leaves buckets unsorted.
        use_in_batch_shuffle: shuffle each pool's items on its own (True) or mix items across
            pools through a reservoir of one pool's size (False); and each run of
            ``bucket_num`` batches on its own (True) or the pool's batches together (False).

    Example:
        >>> dp = IterableWrapper(sentences).bucketbatch(32, sort_key=by_length)
    """

    _parent_fields = ("datapipe",)

    def __init__(
        self,
        datapipe: IterDataPipe,
        batch_size: int,
        drop_last: bool = False,
        batch_num: int = 100,
        bucket_num: int = 1,
        sort_key: Callable[[list[Any]], list[Any]] | None = None,
        use_in_batch_shuffle: bool = True,
    ) -> None:
        check_positive(batch_size, "batch_size", "Batch size")
        check_positive(batch_num, "batch_num", "Number of batches")
        check_positive(bucket_num, "bucket_num", "Number of buckets")
        self.datapipe = datapipe
        self.batch_size = batch_size
        self.drop_last = drop_last
        self.batch_num = batch_num
        self.bucket_num = bucket_num
        self.sort_key = sort_key
        self.use_in_batch_shuffle = use_in_batch_shuffle
        self._enabled = True
        self._seed: int | None = None

    @property
    def bucket_size(self) -> int:
        return self.batch_size * self.batch_num

    @property
    def pool_size(self) -> int:
        return self.bucket_size * self.bucket_num

    @property
    def _mixes_items(self) -> bool:
        """Whether items are shuffled before they are bucketed: not with one bucket and a
        ``sort_key`` (torchdata's rule: a bucket is then consecutive items)."""
        return self._enabled and (self.bucket_num > 1 or self.sort_key is None)

    def __iter__(self) -> Iterator[DataChunk]:
        return _BucketIterator(self, self.datapipe)

    def __len__(self) -> int:
        return batch_count(length_of(self.datapipe, self), self.batch_size, self.drop_last)


class _BucketIterator(SkipToResume, PipeIterator[DataChunk]):
    """Fills one pool (surviving NotAvailable), then hands out its batches."""

    def __init__(self, pipe: BucketBatcher, source: Any) -> None:
        super().__init__(source)
        (self._source,) = self.upstream
        self._pipe = pipe
        self._pool: list[Any] = []
        self._reservoir: list[Any] = []
        self._batches: deque[DataChunk] = deque()
        self._source_done = False
        self._rng: random.Random | None = None

    def nonblocking_next(self) -> DataChunk:
        if self._rng is None:
            self._rng = random.Random(self._pipe._take_seed() if self._pipe._enabled else 0)
        while not self._batches:
            if self._source_done and not self._pool and not self._reservoir:
                raise StopIteration
            self._fill_pool()
            self._batches.extend(self._cut(self._pool))
            self._pool = []
        return self._batches.popleft()

    def _fill_pool(self) -> None:
        pipe, rng = self._pipe, self._rng
        mixing = pipe._mixes_items and not pipe.use_in_batch_shuffle
        while not self._source_done and len(self._pool) < pipe.pool_size:
            try:
                item = self._source.nonblocking_next()
            except StopIteration:
                self._source_done = True
                break
            if not mixing:
                self._pool.append(item)
            elif len(self._reservoir) < pipe.pool_size:
                self._reservoir.append(item)
            else:  # the reservoir is full: a random resident leaves for the pool
                slot = rng.randint(0, pipe.pool_size - 1)  # type: ignore[union-attr]
                self._pool.append(self._reservoir[slot])
                self._reservoir[slot] = item
        if self._source_done and mixing:
            self._pool.extend(self._reservoir)
            self._reservoir = []

    def _cut(self, pool: list[Any]) -> list[DataChunk]:
        pipe, rng = self._pipe, self._rng
        assert rng is not None
        if pipe._mixes_items and pipe.use_in_batch_shuffle:  # else the reservoir mixed them
            rng.shuffle(pool)
        if pipe.sort_key is not None:
            size = pipe.bucket_size
            try:
                pool = [item for start in range(0, len(pool), size) for item in pipe.sort_key(pool[start:start + size])]
            except Exception as error:
                raise raised_by_function(error, pipe, "sort_key")
        size = pipe.batch_size
        batches = [DataChunk(pool[start:start + size]) for start in range(0, len(pool), size)]
        if batches and pipe.drop_last and len(batches[-1]) < size:
            batches.pop()
        if pipe._enabled and pipe.sort_key is not None:
            if not pipe.use_in_batch_shuffle:
                rng.shuffle(batches)
                return batches
            # Runs of bucket_num batches, from the pool's start: a pool holds batch_num of them,
            # so they line up with torchdata's runs over the whole stream.
            runs = [batches[start:start + pipe.bucket_num] for start in range(0, len(batches), pipe.bucket_num)]
            for run in runs:
                rng.shuffle(run)
            batches = [batch for run in runs for batch in run]
        return batches
