"""Iterable pipe operations, under the names torch.utils.data.datapipes.iter gives them (and
torchdata's names for the operations torch never had)."""

from pipeload.datapipes.boundary.pipes import Prefetcher, QueueBoundary
from pipeload.datapipes.iter.branching import Demultiplexer, Forker
from pipeload.datapipes.iter.callable import Collator, FlatMapper, Mapper
from pipeload.datapipes.iter.combinatorics import InBatchShuffler, Sampler, Shuffler
from pipeload.datapipes.iter.combining import Concater, GreedyJoiner, Multiplexer, Zipper
from pipeload.datapipes.iter.grouping import Batcher, Grouper, UnBatcher
from pipeload.datapipes.iter.padding import BucketBatcher, PaddedBatcher
from pipeload.datapipes.iter.selecting import Filter
from pipeload.datapipes.iter.sharding import SHARDING_PRIORITIES, ShardingFilter
from pipeload.datapipes.iter.util import Cycler, Enumerator, Header, InMemoryCacheHolder
from pipeload.datapipes.map.converters import MapToIterConverter
from pipeload.datapipes.nonblocking import EnsureNonBlockingNextDataPipe, NonBlockingIterDataPipe
from pipeload.datapipes.protocol import NotAvailable
from pipeload.datapipes.sources.decoders import Decoder
from pipeload.datapipes.sources.files import FileLister, FileOpener, StreamReader
from pipeload.datapipes.sources.memory import IterableWrapper
from pipeload.datapipes.sources.tar import TarArchiveLoader
from pipeload.datapipes.sources.webdataset import WebDataset

__all__ = [
    "SHARDING_PRIORITIES",
    "Batcher",
    "BucketBatcher",
    "Collator",
    "Concater",
    "Cycler",
    "Decoder",
    "Demultiplexer",
    "EnsureNonBlockingNextDataPipe",
    "Enumerator",
    "FileLister",
    "FileOpener",
    "Filter",
    "FlatMapper",
    "Forker",
    "GreedyJoiner",
    "Grouper",
    "Header",
    "InBatchShuffler",
    "InMemoryCacheHolder",
    "IterableWrapper",
    "MapToIterConverter",
    "Mapper",
    "Multiplexer",
    "NonBlockingIterDataPipe",
    "NotAvailable",
    "PaddedBatcher",
    "Prefetcher",
    "QueueBoundary",
    "Sampler",
    "ShardingFilter",
    "Shuffler",
    "StreamReader",
    "TarArchiveLoader",
    "UnBatcher",
    "WebDataset",
    "Zipper",
]
