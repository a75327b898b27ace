"""Where items come from: memory, files, tar shards, WebDataset samples, remote storage.

A source is an ordinary pipe with no parents. Sources whose reading can be split across workers
expose ``apply_sharding(num_of_instances, instance_id)`` (the graph functions find them as they
find ``sharding_filter``), and sources with a position expose it through their iterator's
``state_dict()``. Files and URLs are read through the operating system (local paths) or fsspec
(``http(s)://``, ``s3://``, ...: the ``remote`` extra). Retries, archive checks and the
``on_error`` policy are explained in the design note (docs/design/sources.md in the source
repository).
"""

from pipeload.datapipes.sources._retry import RetryPolicy, is_transient
from pipeload.datapipes.sources._tar_stream import LinkLeftOutWarning
from pipeload.datapipes.sources.decoders import Decoder, SampleDecodeError, default_handlers, text_lines
from pipeload.datapipes.sources.errors import ArchiveError, SampleGroupingError, SourceChangedError, SourceError
from pipeload.datapipes.sources.files import FileLister, FileOpener, FileReader, StreamReader, open_stream
from pipeload.datapipes.sources.memory import IterableWrapper, SequenceWrapper
from pipeload.datapipes.sources.on_error import (
    FailureBudgetExceeded,
    FailureCounts,
    FailureSite,
    SkippedSampleWarning,
    failure_counts,
)
from pipeload.datapipes.sources.pipeline import expand_urls, webdataset_pipeline
from pipeload.datapipes.sources.tar import ArchiveMember, TarArchiveLoader
from pipeload.datapipes.sources.webdataset import MemberLeftOutWarning, WebDataset, split_key

__all__ = [
    "ArchiveError",
    "ArchiveMember",
    "Decoder",
    "FailureBudgetExceeded",
    "FailureCounts",
    "FailureSite",
    "FileLister",
    "FileOpener",
    "FileReader",
    "IterableWrapper",
    "LinkLeftOutWarning",
    "MemberLeftOutWarning",
    "RetryPolicy",
    "SampleDecodeError",
    "SampleGroupingError",
    "SequenceWrapper",
    "StreamReader",
    "SkippedSampleWarning",
    "SourceChangedError",
    "SourceError",
    "TarArchiveLoader",
    "WebDataset",
    "default_handlers",
    "expand_urls",
    "failure_counts",
    "is_transient",
    "open_stream",
    "split_key",
    "text_lines",
    "webdataset_pipeline",
]
