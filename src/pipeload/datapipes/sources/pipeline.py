"""The common case in one call: shard URLs -> shuffled shards -> samples -> decoded -> shuffled -> batches."""

from __future__ import annotations

import errno
import glob
import operator
import os
import re
from collections.abc import Callable, Mapping, Sequence
from typing import Any

from pipeload.datapipes.base import IterDataPipe
from pipeload.datapipes.sources import _storage
from pipeload.datapipes.sources._checks import check_retry, check_storage_options
from pipeload.datapipes.sources._retry import RetryPolicy
from pipeload.datapipes.sources.decoders import ImageOutput, check_handlers
from pipeload.datapipes.sources.errors import redact_url
from pipeload.datapipes.sources.memory import IterableWrapper
from pipeload.datapipes.sources.on_error import OnError, check_policy

_BRACES = re.compile(r"\{([^{}]*)\}")
_BRACE_RANGE = re.compile(r"(\d+)\.\.(\d+)")
_GLOB_CHARACTERS = frozenset("*?[")
REMOTE_PROBES = 8  # remote shards asked whether they exist when a pipeline is built, at most


def expand_urls(urls: str | Sequence[str], storage_options: Mapping[str, Any] | None = None) -> list[str]:
    """Shard URLs from a list, brace ranges and lists (``{train,val}-{0000..0099}.tar``) or a glob
    (``*.tar``).

    Globs are matched now, locally or through fsspec, and sorted. Local paths are looked at now
    too, as a glob would be: a pattern or list none of whose paths exists, or a directory where
    a shard should be, is refused here rather than found by a worker at the first batch.

    Raises:
        ValueError: nothing matched, or nothing named exists (a typo would otherwise give an
            empty epoch); a local path names a directory.

    Example:
        >>> expand_urls("s3://bucket/train-{0..2}.tar")
        ['s3://bucket/train-0.tar', 's3://bucket/train-1.tar', 's3://bucket/train-2.tar']
    """
    patterns = [urls] if isinstance(urls, str) else list(urls)
    if not patterns or not all(isinstance(pattern, str) for pattern in patterns):
        raise ValueError(f"urls must be a URL, a pattern or a non-empty list of them, got urls={urls!r}")
    found: list[str] = []
    for pattern in patterns:
        for url in _expand_braces(pattern):
            found.extend(_expand_glob(url, storage_options) if _is_glob(url) else [url])
    if not found:
        raise ValueError(f"no shard matches urls={urls!r}")
    _check_local(found, urls)
    return found


def _check_local(found: list[str], urls: Any) -> None:
    """Refuse local paths that are directories, or a list none of whose local paths exists."""
    local = [url for url in found if _storage.is_local(url)]
    for url in local:
        if os.path.isdir(_storage.local_path(url)):
            raise ValueError(f"urls names a directory, not a shard: {url!r} (from urls={urls!r}); "
                             f"name the shard files in it, e.g. {os.path.join(url, '*.tar')!r}")
    if local and not any(os.path.exists(_storage.local_path(url)) for url in local):
        raise ValueError(f"no shard matches urls={urls!r}: none of the {len(local)} paths it names "
                         f"exists (the first: {local[0]!r})")


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


def _is_glob(url: str) -> bool:
    """Whether ``url`` is a pattern to match. In an HTTP URL ``?`` starts the query (a presigned
    URL's signature, ``?download=true``), as fsspec reads it too: only ``*`` and ``[`` before it
    make a pattern. Matched as one, such a URL was fetched whole at build time, and silently left
    out of the list when missing."""
    if url.startswith(("http://", "https://")):
        return bool(set("*[") & set(url.split("?", 1)[0]))
    return bool(_GLOB_CHARACTERS & set(url))


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
            so waiting for the network overlaps decoding; 0 reads in the worker's own thread.
            Either way a checkpoint records where each worker's reading stands (the read-ahead
            thread sends its reader's state along with the samples now and then).
        hold_until_checked: compressed shards yield no sample before the decompressor has
            checked the whole stream's checksum (see ``load_from_tar``); costs holding one
            shard's samples in memory per worker.

    Example:
        >>> pipe = webdataset_pipeline("https://host/shards/train-{0000..0146}.tar", image="tensor")
        >>> loader = pipeload.DataLoader(pipe.map(to_pair), batch_size=64, num_workers=8)
    """
    _check_arguments(locals())  # first, before anything is listed or opened
    shard_urls = expand_urls(urls, storage_options)
    _storage.load_implementations(shard_urls)
    _check_shards_exist(shard_urls, urls, storage_options, on_error)
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


def _check_arguments(arguments: Mapping[str, Any]) -> None:
    """Refuse arguments of ``webdataset_pipeline`` that its stages would take wrongly
    (``shuffle_shards="no"`` is true, ``handlers={"cls": 5}`` fails every sample, skipped under
    ``on_error="skip"``) or refuse under another name (``buffer_size``), naming them. The
    stages check the rest (``image``, ``on_error``, ``max_failures``)."""
    _check_urls(arguments["urls"])
    for name in ("shuffle_shards", "hold_until_checked"):
        if not isinstance(arguments[name], bool):
            raise TypeError(f"webdataset_pipeline: {name} must be True or False, got "
                            f"{name}={arguments[name]!r} ({type(arguments[name]).__name__})")
    for name in ("shuffle_buffer", "read_ahead"):
        _check_count(name, arguments[name])
    check_handlers(arguments["handlers"], "webdataset_pipeline")
    check_storage_options(arguments["storage_options"], "webdataset_pipeline")
    check_retry(arguments["retry"], "webdataset_pipeline")
    check_policy(arguments["on_error"], arguments["max_failures"], "webdataset_pipeline")
    batch_size = arguments["batch_size"]
    if batch_size is not None and (isinstance(batch_size, bool) or not isinstance(batch_size, int)):
        # a bool is an int to Python: True batched by 1
        raise TypeError(f"webdataset_pipeline: batch_size must be an int or None, got "
                        f"batch_size={batch_size!r}")
    if batch_size is not None and batch_size <= 0:  # .batch() asserts, as torch's Batcher does
        raise ValueError(f"webdataset_pipeline: batch_size must be a positive int or None, got "
                         f"batch_size={batch_size}")


def _check_urls(urls: Any) -> None:
    """A str or a sequence of str; what it names, ``expand_urls`` finds out."""
    if isinstance(urls, str) or (isinstance(urls, Sequence) and all(isinstance(url, str) for url in urls)):
        return
    raise TypeError(f"webdataset_pipeline: urls must be a str or a sequence of str (URLs, paths or "
                    f"patterns), got urls={urls!r}")


def _check_count(name: str, value: Any) -> None:
    """An int (numpy's too, as the pipes take them), 0 or more: 0 turns the stage off."""
    try:
        count = None if isinstance(value, bool) else operator.index(value)
    except TypeError:
        count = None
    if count is None:
        raise TypeError(f"webdataset_pipeline: {name} must be an int (0: none), got {name}={value!r} "
                        f"({type(value).__name__})")
    if count < 0:
        raise ValueError(f"webdataset_pipeline: {name} must be 0 or more (0: none), got {name}={value!r}")


def _check_shards_exist(shard_urls: list[str], urls: Any, storage_options: Mapping[str, Any] | None,
                        on_error: OnError) -> None:
    """Refuse, when the pipeline is built, shards that are not there: remote ones none of which
    exists (the first ``REMOTE_PROBES`` are asked, one request each, until one answers), and
    under ``on_error="raise"`` any local one that is missing (the first batch would fail on it
    anyway, in a worker, long after the typo was made)."""
    remote = [url for url in shard_urls if not _storage.is_local(url)][:REMOTE_PROBES]
    if remote and not any(_exists(url, storage_options) for url in remote):
        shown = redact_url(urls) if isinstance(urls, str) else [redact_url(str(url)) for url in urls]
        raise ValueError(f"no shard matches urls={shown!r}: none of the first {len(remote)} shards it "
                         f"names exists (the first: {redact_url(remote[0])!r})")
    missing = [url for url in shard_urls if _storage.is_local(url) and not os.path.exists(_storage.local_path(url))]
    if missing and on_error == "raise":
        others = ", ".join(repr(url) for url in missing[1:5]) + (", ..." if len(missing) > 5 else "")
        raise FileNotFoundError(errno.ENOENT, f"{len(missing)} of the {len(shard_urls)} shards named do not "
                                f"exist{f' (also {others})' if others else ''}; on_error='skip' would "
                                "leave them out, counted. The first", missing[0])


def _exists(url: str, storage_options: Mapping[str, Any] | None) -> bool:
    """Whether ``url`` is there; True when asking failed otherwise (a refused connection, no
    credentials yet): reading it will say why, after its retries, naming it."""
    fs, path = _storage.filesystem(url, storage_options)
    try:
        if not url.startswith(("http://", "https://")):
            return bool(fs.exists(path))
        fs.info(path)  # a HEAD (fsspec's exists() is a whole GET, which starts sending the shard)
    except FileNotFoundError:
        return False
    except Exception:  # noqa: BLE001  (not a verdict on the path)
        return True
    return True
