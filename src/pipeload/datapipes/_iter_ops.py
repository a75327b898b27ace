"""The built-in operations of iterable pipes, as real methods.

``IterDataPipe`` inherits these, so ``pipe.map(f).batch(8)`` is visible to type checkers and IDEs
(torch only finds them at run time through ``__getattr__``). Each method builds the operation's
class, which lives in ``pipeload.datapipes.iter``; the imports are local because those modules
import the pipe base classes that inherit from this one.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING, Any, Literal

from pipeload.collate import default_collate
from pipeload.datapipes.chunk import DataChunk

if TYPE_CHECKING:
    from pipeload.datapipes.base import IterDataPipe
    from pipeload.datapipes.boundary.pipes import Prefetcher, QueueBoundary
    from pipeload.datapipes.iter.callable import Collator, FlatMapper, Mapper
    from pipeload.datapipes.iter.combinatorics import InBatchShuffler, Shuffler
    from pipeload.datapipes.iter.combining import Concater, GreedyJoiner, Multiplexer, Zipper
    from pipeload.datapipes.iter.grouping import Batcher, Grouper, UnBatcher
    from pipeload.datapipes.iter.padding import BucketBatcher, PaddedBatcher
    from pipeload.datapipes.iter.selecting import Filter
    from pipeload.datapipes.iter.sharding import ShardingFilter
    from pipeload.datapipes.iter.util import Cycler, Enumerator, Header, InMemoryCacheHolder
    from pipeload.datapipes.sources._retry import RetryPolicy
    from pipeload.datapipes.sources.decoders import Decoder, ImageOutput
    from pipeload.datapipes.sources.files import FileLister, FileOpener, StreamReader
    from pipeload.datapipes.sources.on_error import OnError
    from pipeload.datapipes.sources.tar import TarArchiveLoader
    from pipeload.datapipes.sources.webdataset import WebDataset


class IterOperations:
    """Chainable operations; see each class in ``pipeload.datapipes.iter`` for the details."""

    # -- one item in, one (or zero, or many) out ---------------------------------------------

    def map(self, fn: Callable[..., Any], input_col: Any = None, output_col: Any = None) -> Mapper:
        """Apply ``fn`` to every item (or to the columns ``input_col``); see :class:`Mapper`."""
        from pipeload.datapipes.iter.callable import Mapper

        return Mapper(self, fn, input_col, output_col)  # type: ignore[arg-type]

    def filter(self, filter_fn: Callable[..., bool], input_col: Any = None) -> Filter:
        """Keep the items for which ``filter_fn`` is True; see :class:`Filter`."""
        from pipeload.datapipes.iter.selecting import Filter

        return Filter(self, filter_fn, input_col)  # type: ignore[arg-type]

    def flatmap(self, fn: Callable[..., Any] | None = None, input_col: Any = None) -> FlatMapper:
        """Apply ``fn`` and yield each element of its (iterable) result; see :class:`FlatMapper`."""
        from pipeload.datapipes.iter.callable import FlatMapper

        return FlatMapper(self, fn, input_col)  # type: ignore[arg-type]

    def collate(
        self, conversion: Any = default_collate, collate_fn: Callable[..., Any] | None = None
    ) -> Collator:
        """Turn each batch into tensors (``default_collate`` unless told); see :class:`Collator`."""
        from pipeload.datapipes.iter.callable import Collator

        return Collator(self, conversion, collate_fn)  # type: ignore[arg-type]

    def enumerate(self, starting_index: int = 0) -> Enumerator:
        """Yield ``(index, item)`` pairs; see :class:`Enumerator`."""
        from pipeload.datapipes.iter.util import Enumerator

        return Enumerator(self, starting_index)  # type: ignore[arg-type]

    # -- batching ----------------------------------------------------------------------------

    def batch(
        self, batch_size: int, drop_last: bool = False, wrapper_class: type[DataChunk] = DataChunk
    ) -> Batcher:
        """Group items into lists of ``batch_size``; see :class:`Batcher`."""
        from pipeload.datapipes.iter.grouping import Batcher

        return Batcher(self, batch_size, drop_last, wrapper_class)  # type: ignore[arg-type]

    def unbatch(self, unbatch_level: int = 1) -> UnBatcher:
        """Flatten batches ``unbatch_level`` levels deep (-1: all); see :class:`UnBatcher`."""
        from pipeload.datapipes.iter.grouping import UnBatcher

        return UnBatcher(self, unbatch_level)  # type: ignore[arg-type]

    def padded_batch(self, batch_size: int, drop_last: bool = False, padding_value: Any = 0) -> PaddedBatcher:
        """Batch, padding tensors and sequences to the longest in the batch; see :class:`PaddedBatcher`."""
        from pipeload.datapipes.iter.padding import PaddedBatcher

        return PaddedBatcher(self, batch_size, drop_last, padding_value)  # type: ignore[arg-type]

    def bucketbatch(
        self,
        batch_size: int,
        drop_last: bool = False,
        batch_num: int = 100,
        bucket_num: int = 1,
        sort_key: Callable[[list[Any]], list[Any]] | None = None,
        use_in_batch_shuffle: bool = True,
    ) -> BucketBatcher:
        """Batch items of similar size together (sorted buckets); see :class:`BucketBatcher`."""
        from pipeload.datapipes.iter.padding import BucketBatcher

        return BucketBatcher(self, batch_size, drop_last, batch_num, bucket_num, sort_key, use_in_batch_shuffle)  # type: ignore[arg-type]

    def groupby(
        self,
        group_key_fn: Callable[[Any], Any],
        *,
        keep_key: bool = False,
        buffer_size: int = 10000,
        group_size: int | None = None,
        guaranteed_group_size: int | None = None,
        drop_remaining: bool = False,
    ) -> Grouper:
        """Group items by ``group_key_fn`` into batches; see :class:`Grouper`."""
        from pipeload.datapipes.iter.grouping import Grouper

        return Grouper(
            self, group_key_fn, keep_key=keep_key, buffer_size=buffer_size,  # type: ignore[arg-type]
            group_size=group_size, guaranteed_group_size=guaranteed_group_size,
            drop_remaining=drop_remaining,
        )

    # -- order, sharding, length ---------------------------------------------------------------

    def shuffle(self, *, buffer_size: int = 10000, unbatch_level: int = 0) -> Shuffler:
        """Shuffle through a buffer of ``buffer_size`` items; see :class:`Shuffler`."""
        from pipeload.datapipes.iter.combinatorics import Shuffler

        return Shuffler(self, buffer_size=buffer_size, unbatch_level=unbatch_level)  # type: ignore[arg-type]

    def in_batch_shuffle(self) -> InBatchShuffler:
        """Shuffle the items inside each batch (torchdata's); see :class:`InBatchShuffler`."""
        from pipeload.datapipes.iter.combinatorics import InBatchShuffler

        return InBatchShuffler(self)  # type: ignore[arg-type]

    def sharding_filter(self, sharding_group_filter: Any = None) -> ShardingFilter:
        """Mark where the graph splits across workers and ranks; see :class:`ShardingFilter`."""
        from pipeload.datapipes.iter.sharding import ShardingFilter

        return ShardingFilter(self, sharding_group_filter)  # type: ignore[arg-type]

    def cycle(self, count: int | None = None) -> Cycler:
        """Repeat the pipe ``count`` times (for ever if None); see :class:`Cycler`."""
        from pipeload.datapipes.iter.util import Cycler

        return Cycler(self, count)  # type: ignore[arg-type]

    def header(self, limit: int | None = 10) -> Header:
        """Yield at most the first ``limit`` items; see :class:`Header`."""
        from pipeload.datapipes.iter.util import Header

        return Header(self, limit)  # type: ignore[arg-type]

    def in_memory_cache(self, size: int | None = None) -> InMemoryCacheHolder:
        """Keep the first pass in memory (up to ``size`` MB) and replay it; see :class:`InMemoryCacheHolder`."""
        from pipeload.datapipes.iter.util import InMemoryCacheHolder

        return InMemoryCacheHolder(self, size)  # type: ignore[arg-type]

    # -- several pipes -------------------------------------------------------------------------

    def zip(self, *datapipes: IterDataPipe) -> Zipper:
        """Tuples of one item from each pipe, until the shortest ends; see :class:`Zipper`."""
        from pipeload.datapipes.iter.combining import Zipper

        return Zipper(self, *datapipes)  # type: ignore[arg-type]

    def concat(self, *datapipes: IterDataPipe) -> Concater:
        """This pipe's items, then each other pipe's; see :class:`Concater`."""
        from pipeload.datapipes.iter.combining import Concater

        return Concater(self, *datapipes)  # type: ignore[arg-type]

    def mux(self, *datapipes: IterDataPipe) -> Multiplexer:
        """One item from each pipe in turn, until the shortest ends; see :class:`Multiplexer`."""
        from pipeload.datapipes.iter.combining import Multiplexer

        return Multiplexer(self, *datapipes)  # type: ignore[arg-type]

    def greedy_join(self, *datapipes: IterDataPipe) -> GreedyJoiner:
        """Whichever pipe has an item ready first, until all end; see :class:`GreedyJoiner`."""
        from pipeload.datapipes.iter.combining import GreedyJoiner

        return GreedyJoiner(self, *datapipes)  # type: ignore[arg-type]

    def fork(
        self, num_instances: int, buffer_size: int = 1000, copy: Literal["shallow", "deep"] | None = None
    ) -> list[IterDataPipe]:
        """``num_instances`` branches that each see every item; see :class:`Forker`."""
        from pipeload.datapipes.iter.branching import Forker

        return Forker(self, num_instances, buffer_size, copy)  # type: ignore[arg-type,return-value]

    def demux(
        self,
        num_instances: int,
        classifier_fn: Callable[[Any], int | None],
        drop_none: bool = False,
        buffer_size: int = 1000,
    ) -> list[IterDataPipe]:
        """Split items into ``num_instances`` branches by ``classifier_fn``; see :class:`Demultiplexer`."""
        from pipeload.datapipes.iter.branching import Demultiplexer

        return Demultiplexer(self, num_instances, classifier_fn, drop_none, buffer_size)  # type: ignore[arg-type,return-value]

    # -- other threads and processes -----------------------------------------------------------

    def prefetch(self, buffer_size: int = 10) -> Prefetcher:
        """Fill a buffer of ``buffer_size`` items from a background thread; see :class:`Prefetcher`."""
        from pipeload.datapipes.boundary.pipes import Prefetcher

        return Prefetcher(self, buffer_size)  # type: ignore[arg-type]

    def queue_boundary(
        self, worker_type: str = "thread", buffer_size: int = 8, multiprocessing_context: Any = None,
        **options: Any,
    ) -> QueueBoundary:
        """Run everything upstream of here in another thread or process; see :class:`QueueBoundary`.
        ``worker_type="ray"`` runs it in Ray actors, with ``options``; see
        :class:`~pipeload.datapipes.boundary.ray_pipe.RayQueueBoundary`."""
        if worker_type == "ray":
            from pipeload.datapipes.boundary.ray_pipe import RayQueueBoundary

            if multiprocessing_context is not None:
                raise ValueError("multiprocessing_context only applies to worker_type='process', but got "
                                 f"multiprocessing_context={multiprocessing_context!r} with worker_type='ray'")
            return RayQueueBoundary(self, buffer_size, **options)  # type: ignore[arg-type,return-value]
        from pipeload.datapipes.boundary.pipes import QueueBoundary

        return QueueBoundary(self, worker_type, buffer_size, multiprocessing_context, **options)  # type: ignore[arg-type]


    # -- files, archives, samples (pipeload.datapipes.sources) -------------------------------

    def list_files(self, masks: str | list[str] = "", *, recursive: bool = False, abspath: bool = False,
                   non_deterministic: bool = False, length: int = -1,
                   storage_options: dict[str, Any] | None = None) -> FileLister:
        """List the files under each root this pipe yields; see :class:`FileLister`."""
        from pipeload.datapipes.sources.files import FileLister

        return FileLister(self, masks, recursive=recursive, abspath=abspath,  # type: ignore[arg-type]
                          non_deterministic=non_deterministic, length=length, storage_options=storage_options)

    def open_files(self, mode: str = "r", encoding: str | None = None, length: int = -1, *,
                   storage_options: dict[str, Any] | None = None, retry: RetryPolicy | None = None,
                   on_error: OnError = "raise", max_failures: int | None = None) -> FileOpener:
        """Open each path or URL as a ``(url, stream)`` pair; see :class:`FileOpener`."""
        from pipeload.datapipes.sources.files import FileOpener

        return FileOpener(self, mode, encoding, length, storage_options=storage_options,  # type: ignore[arg-type]
                          retry=retry, on_error=on_error, max_failures=max_failures)

    def read_from_stream(self, chunk: int | None = None) -> StreamReader:
        """Read each ``(label, stream)`` pair's stream in pieces; see :class:`StreamReader`."""
        from pipeload.datapipes.sources.files import StreamReader

        return StreamReader(self, chunk)  # type: ignore[arg-type]

    def load_from_tar(self, mode: str = "r:*", length: int = -1, *, on_error: OnError = "raise",
                      max_failures: int | None = None, hold_until_checked: bool = False) -> TarArchiveLoader:
        """Stream the members of each tar archive; see :class:`TarArchiveLoader`."""
        from pipeload.datapipes.sources.tar import TarArchiveLoader

        return TarArchiveLoader(self, mode, length, on_error=on_error,  # type: ignore[arg-type]
                                max_failures=max_failures, hold_until_checked=hold_until_checked)

    def webdataset(self, length: int = -1, *, on_error: OnError = "raise",
                   max_failures: int | None = None) -> WebDataset:
        """Group archive members into sample dicts by key; see :class:`WebDataset`."""
        from pipeload.datapipes.sources.webdataset import WebDataset

        return WebDataset(self, length, on_error=on_error, max_failures=max_failures)  # type: ignore[arg-type]

    def decode(self, handlers: Any = None, *, image: ImageOutput = "pil", on_error: OnError = "raise",
               max_failures: int | None = None) -> Decoder:
        """Decode each sample's fields by extension; see :class:`Decoder`."""
        from pipeload.datapipes.sources.decoders import Decoder

        return Decoder(self, handlers, image=image, on_error=on_error, max_failures=max_failures)  # type: ignore[arg-type]
