"""The common case in one call: shard URLs -> shuffled shards -> samples -> decoded -> shuffled -> batches."""

from __future__ import annotations

import glob
import re
from collections.abc import Callable, Mapping, Sequence
from typing import Any

from pipeload.datapipes.base import IterDataPipe
from pipeload.datapipes.sources import _storage
from pipeload.datapipes.sources._retry import RetryPolicy
from pipeload.datapipes.sources.decoders import ImageOutput
from pipeload.datapipes.sources.memory import IterableWrapper
from pipeload.datapipes.sources.on_error import OnError

_BRACES = re.compile(r"\{([^{}]*)\}")
_BRACE_RANGE = re.compile(r"(\d+)\.\.(\d+)")
_GLOB_CHARACTERS = frozenset("*?[")


def expand_urls(urls: str | Sequence[str], storage_options: Mapping[str, Any] | None = None) -> list[str]:
    """Shard URLs from a list, brace ranges and lists (``{train,val}-{0000..0099}.tar``) or a glob
    (``*.tar``).

    Globs are matched now, locally or through fsspec, and sorted.

    Raises:
        ValueError: nothing matched (a typo would otherwise give an empty epoch).

    Example:
        >>> expand_urls("s3://bucket/train-{0..2}.tar")
        ['s3://bucket/train-0.tar', 's3://bucket/train-1.tar', 's3://bucket/train-2.tar']
    """
    patterns = [urls] if isinstance(urls, str) else list(urls)
    found: list[str] = []
    for pattern in patterns:
        for url in _expand_braces(pattern):
            found.extend(_expand_glob(url, storage_options) if _GLOB_CHARACTERS & set(url) else [url])
    if not found:
        raise ValueError(f"no shard matches urls={urls!r}")
    return found


def _expand_braces(pattern: str) -> list[str]:
    """Every URL the first brace group with choices stands for, each expanded again; a group
    without choices (``{a}``) is kept as written, as braceexpand keeps it."""
    for match in _BRACES.finditer(pattern):
        choices = _brace_choices(match.group(1))
        if choices is not None:
            head, tail = pattern[:match.start()], pattern[match.end():]
            return [url for choice in choices for url in _expand_braces(f"{head}{choice}{tail}")]
    return [pattern]


def _brace_choices(inside: str) -> list[str] | None:
    """``"0..3"`` -> a range (zero-padded like its first number), ``"a,b"`` -> a list, else None."""
    numbers = _BRACE_RANGE.fullmatch(inside)
    if numbers is not None:
        first, last = numbers.group(1), numbers.group(2)
        width = len(first) if first.startswith("0") else 0
        return [f"{number:0{width}d}" for number in range(int(first), int(last) + 1)]
    return inside.split(",") if "," in inside else None


def _expand_glob(url: str, storage_options: Mapping[str, Any] | None) -> list[str]:
    if _storage.is_local(url):
        return sorted(glob.glob(_storage.local_path(url)))
    fs, path = _storage.filesystem(url, storage_options)
    protocol = url.split("://", 1)[0]
    return sorted(p if "://" in p else f"{protocol}://{p}" for p in fs.glob(path))


def webdataset_pipeline(
    urls: str | Sequence[str],
    *,
    shuffle_shards: bool = True,
    shuffle_buffer: int = 1000,
    batch_size: int | None = None,
    image: ImageOutput = "pil",
    handlers: Mapping[str, Callable[[bytes], Any] | None] | None = None,
    storage_options: Mapping[str, Any] | None = None,
    on_error: OnError = "raise",
    max_failures: int | None = None,
    retry: RetryPolicy | None = None,
    read_ahead: int = 64,
    hold_until_checked: bool = False,
) -> IterDataPipe:
    """Samples from WebDataset tar shards, ready for ``pipeload.DataLoader``.

    The shard list is shuffled (each epoch anew, seeded by the loader) and split across workers
    and ranks before anything is read, so each process streams only its own shards; samples are
    grouped by key, read ahead in a thread, shuffled in a buffer (still encoded), decoded and
    optionally batched.

    Args:
        urls: shard URLs or paths: a list, a brace range or a glob (see :func:`expand_urls`).
        shuffle_shards: shuffle the shard order.
        shuffle_buffer: samples held for shuffling (0: no sample shuffle).
        batch_size: make lists of this many samples (None: single samples; let the loader batch).
        image, handlers: as for ``decode``.
        storage_options: fsspec options for remote URLs (credentials, endpoints).
        on_error, max_failures: applied to opening, reading, grouping and decoding, with one
            budget for all four (in a DataLoader, for the loader's whole epoch); see
            ``pipeload.datapipes.sources.on_error``.
        retry: how transient remote failures are retried.
        read_ahead: samples read (not yet decoded) ahead by a background thread in each worker,
            so waiting for the network overlaps decoding; 0 reads in the worker's own thread
            (and lets a checkpoint record where each worker's reading stands: a read-ahead
            thread's queue keeps no checkpoint yet, so resuming re-reads the epoch's start).
        hold_until_checked: compressed shards yield no sample before the decompressor has
            checked the whole stream's checksum (see ``load_from_tar``); costs holding one
            shard's samples in memory per worker.

    Example:
        >>> pipe = webdataset_pipeline("https://host/shards/train-{0000..0146}.tar", image="tensor")
        >>> loader = pipeload.DataLoader(pipe.map(to_pair), batch_size=64, num_workers=8)
    """
    shard_urls = expand_urls(urls, storage_options)
    _storage.load_implementations(shard_urls)
    pipe: IterDataPipe = IterableWrapper(shard_urls)
    if shuffle_shards:
        pipe = pipe.shuffle()
    policy: dict[str, Any] = {"on_error": on_error, "max_failures": max_failures}
    opened = pipe.sharding_filter().open_files(mode="b", storage_options=storage_options, retry=retry, **policy)
    members = opened.load_from_tar(hold_until_checked=hold_until_checked, **policy)
    pipe = grouped = members.webdataset(**policy)
    if read_ahead:
        pipe = pipe.prefetch(read_ahead)
    if shuffle_buffer:  # before decoding: the buffer holds encoded bytes, not decoded images
        pipe = pipe.shuffle(buffer_size=shuffle_buffer)
    pipe = decoded = pipe.decode(handlers, image=image, **policy)
    for stage in (opened, members, grouped, decoded):  # max_failures: failures of all of them
        stage.failure_budget = "webdataset_pipeline"
    if batch_size is not None:
        pipe = pipe.batch(batch_size)
    return pipe
