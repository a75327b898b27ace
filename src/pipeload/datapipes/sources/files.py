"""Files as pipes: list them (``FileLister``), open them as streams (``FileOpener``), read the
streams in chunks (``StreamReader``), or read them by index (``FileReader``, map-style). Local
paths need nothing; URLs go through fsspec."""

from __future__ import annotations

import contextlib
import errno
import io
import os
from collections.abc import Iterator, Mapping, Sequence
from typing import IO, Any

from pipeload._state_fields import StateFields, is_int
from pipeload.datapipes.base import IterDataPipe, MapDataPipe, is_iter_datapipe
from pipeload.datapipes.iter._columns import no_length
from pipeload.datapipes.protocol import PipeIterator, SkipToResume
from pipeload.datapipes.sources import _storage
from pipeload.datapipes.sources._checks import (
    check_length,
    check_mode_and_encoding,
    check_retry,
    check_storage_options,
    checked_paths,
)
from pipeload.datapipes.sources._retry import RetryingReader, RetryPolicy
from pipeload.datapipes.sources._versions import LocalWatch, ObjectVersion
from pipeload.datapipes.sources.memory import IterableWrapper
from pipeload.datapipes.sources.errors import SourceChangedError, SourceError, describe_failure, redact_url, url_secrets
from pipeload.datapipes.sources.on_error import FILE, ErrorPolicyMixin, OnError, check_policy
from pipeload.errors import bad_state_field

# Each read of a remote file is a hop to fsspec's IO thread and back: read in large pieces.
REMOTE_BUFFER_BYTES = 1 << 20
_ERRNOS = {FileNotFoundError: errno.ENOENT, PermissionError: errno.EACCES, IsADirectoryError: errno.EISDIR}
_MODES = {"r": "r", "t": "r", "rt": "r", "b": "rb", "rb": "rb"}


def open_stream(url: str, mode: str = "rb", encoding: str | None = None,
                storage_options: Mapping[str, Any] | None = None,
                retry: RetryPolicy | None = None) -> IO[Any]:
    """Open ``url`` (a path, ``file://``, ``http(s)://``, ``s3://``, ...) for streaming reads.

    Remote files reconnect and resume on transient errors (see :class:`RetryPolicy`).

    Raises:
        FileNotFoundError, PermissionError: as raised for the file, naming ``url``.
        SourceError: anything else that stopped the open, after the retries; names ``url``.
            A remote read that fails after the retries (a body cut short, a stall) raises one
            too, naming ``url``, with the network library's error as its ``__cause__``.
        ImportError: a remote URL without the ``remote`` extra installed.
    """
    return _open(url, mode, encoding, storage_options, retry, _NamingReader)


def _open(url: str, mode: str, encoding: str | None, storage_options: Mapping[str, Any] | None,
          retry: RetryPolicy | None, reader_type: type[RetryingReader]) -> IO[Any]:
    """``open_stream``, its remote reads made by a ``reader_type``."""
    binary = _MODES.get(mode)
    if binary is None:
        raise ValueError(f"Invalid mode {mode}: mode must be one of {sorted(_MODES)}")
    try:
        if _storage.is_local(url):
            return open(_storage.local_path(url), binary, encoding=encoding)  # noqa: SIM115
        def opener(at: int, version: ObjectVersion | None) -> Any:
            return _storage.open_remote(url, storage_options, at, version)

        reader = reader_type(url, opener, retry or RetryPolicy())
    except (FileNotFoundError, PermissionError, IsADirectoryError) as error:
        if error.errno is not None and url in str(error) and not url_secrets(url):
            raise  # the operating system's words, naming the path
        raise _naming(error, url) from error
    except (ImportError, SourceError):
        raise
    except Exception as error:
        raise SourceError(f"cannot open {url!r}: {describe_failure(error)}", url) from error
    stream: IO[Any] = io.BufferedReader(reader, REMOTE_BUFFER_BYTES)
    if binary == "r":
        stream = io.TextIOWrapper(stream, encoding=encoding)
    return stream


def _naming(error: OSError, url: str) -> OSError:
    """The same kind of error as ``error``, naming ``url`` (s3fs names an object by its path in
    the store, without ``s3://``: not something the user could open or grep for)."""
    code = error.errno or _ERRNOS.get(type(error), errno.EIO)
    return type(error)(code, error.strerror if error.errno else os.strerror(code), redact_url(url))


def read_naming(stream: IO[Any], url: str, size: int | None = None) -> Any:
    """The rest of ``stream`` (at most ``size`` of it, when given); a failure (after the
    stream's own retries) names ``url``."""
    with _read_failures_naming(url):
        return stream.read() if size is None else stream.read(size)


@contextlib.contextmanager
def _read_failures_naming(url: str) -> Iterator[None]:
    """Raise a read's failure as a SourceError naming ``url``, the failure as its cause."""
    try:
        yield
    except (ValueError, TypeError, MemoryError, SourceError):  # the data or the caller; named
        raise
    except Exception as error:
        raise SourceError(f"cannot read {url!r}: {describe_failure(error)}", url) from error


class _NamingReader(RetryingReader):
    """A :class:`RetryingReader` whose failed reads (after its retries) name its URL, as
    ``read_naming`` names them: ``open_stream``'s caller may read with anything (``tarfile``,
    ``json.load``), and a network library's error alone (``ClientPayloadError``, an
    ``FSTimeoutError`` without a message) does not say which of its files broke."""

    def readinto(self, buffer: Any) -> int:
        with _read_failures_naming(self.url):
            return super().readinto(buffer)


class FileLister(IterDataPipe[str]):
    """The files under one or more roots whose names match ``masks`` (functional name: ``list_files``).

    Args:
        root: a directory or file (a local path, or a URL through fsspec), a list of them, or a
            pipe yielding them.
        masks: shell-style patterns for the file name (``"*.tar"``); a list matches any; empty
            matches everything.
        recursive: go into subdirectories.
        abspath: yield absolute paths (local roots only).
        non_deterministic: torch's permission to skip sorting; each root's listing is sorted
            either way (the sort costs little next to the listing, and workers and ranks that
            list alike can shard one order).
        length: what ``len()`` reports (-1: no length).
        storage_options: passed to fsspec for remote roots (credentials, endpoints).

    Example:
        >>> list(FileLister("shards", "*.tar"))
        ['shards/train-0000.tar', 'shards/train-0001.tar']
    """

    _parent_fields = ("datapipe",)

    def __init__(self, root: str | Sequence[str] | IterDataPipe = ".", masks: str | list[str] = "",
                 *, recursive: bool = False, abspath: bool = False, non_deterministic: bool = False,
                 length: int = -1, storage_options: Mapping[str, Any] | None = None) -> None:
        self.datapipe = root if is_iter_datapipe(root) else None
        self.roots = None if self.datapipe is not None else _texts(
            root, "root", "a path or URL (str), a sequence of them or a pipe yielding them")
        self.masks = _texts(masks, "masks", "a str or a sequence of str")
        _check_lister_options(length, storage_options, recursive=recursive, abspath=abspath,
                              non_deterministic=non_deterministic)
        self.recursive = recursive
        self.abspath = abspath
        self.non_deterministic = non_deterministic
        self.length = length
        self.storage_options = dict(storage_options) if storage_options else None

    def __iter__(self) -> Iterator[str]:
        # Roots given as paths are read through IterableWrapper, whose position checkpoints.
        roots = self.datapipe if self.datapipe is not None else IterableWrapper(self.roots, deepcopy=False)
        return iter(_ListingIterator(self, roots))  # type: ignore[arg-type]

    def list_root(self, root: str) -> list[str]:
        masks = [m for m in self.masks if m] or ["*"]
        found = _storage.expand(root, masks, self.recursive, self.storage_options)
        if self.abspath and _storage.is_local(root):
            found = [os.path.abspath(path) for path in found]
        return found

    def __len__(self) -> int:
        if self.length == -1:
            raise no_length(self)
        return self.length


def _texts(value: Any, name: str, expected: str) -> list[str]:
    """``value``, a str or an iterable of str, as a list; else a TypeError naming ``name`` (the
    listing would otherwise trip on it only when iterated, as ``masks=5`` did)."""
    if isinstance(value, str):
        return [value]
    try:
        items = None if isinstance(value, (bytes, bytearray)) else list(value)
    except TypeError:
        items = None
    if items is None or not all(isinstance(item, str) for item in items):
        raise TypeError(f"FileLister: {name} must be {expected}, got {name}={value!r}")
    return items


def _check_lister_options(length: Any, storage_options: Any, **flags: Any) -> None:
    """Refuse, naming it, an option the listing would take wrongly (``recursive="no"`` is true)
    or trip on later."""
    for name, value in flags.items():
        if not isinstance(value, bool):
            raise TypeError(f"FileLister: {name} must be True or False, got {name}={value!r} "
                            f"({type(value).__name__})")
    check_length(length, "FileLister")
    check_storage_options(storage_options, "FileLister")


class _ListingIterator(PipeIterator[str]):
    """Lists each root as it comes. Its checkpoint: the upstream's state before the current
    root, how many of that root's paths were handed out and the last of them (resuming lists
    the root again, a metadata read, checks that the listing still reaches that path there,
    and skips them)."""

    def __init__(self, pipe: FileLister, roots: Any) -> None:
        super().__init__(roots)
        (self._roots,) = self.upstream
        self._pipe = pipe
        self._pending: Iterator[str] = iter(())
        self._before_root: Any = None  # the upstream's state before the current root
        self._handed_out = 0  # paths of the current root handed out
        self._last: str | None = None  # the last of them
        self._skip: tuple[int, str | None] = (0, None)  # resuming: paths of the next root handed out, the last

    def nonblocking_next(self) -> str:
        while True:
            for path in self._pending:
                self._handed_out += 1
                self._last = path
                return path
            before = _state_or_none(self._roots)
            root = self._roots.nonblocking_next()
            listed = self._pipe.list_root(root)
            (skip, last), self._skip = self._skip, (0, None)
            _check_listed_the_same(root, listed, skip, last)
            self._pending, self._before_root = iter(listed[skip:]), before
            self._handed_out, self._last = skip, listed[skip - 1] if skip else None

    def state_dict(self) -> dict[str, Any]:
        if self._before_root is None:  # before the first root, or roots without a checkpoint
            return {"own": 0, "upstream": [self._roots.state_dict()]}
        return {"own": [self._handed_out, self._last], "upstream": [self._before_root]}

    def _check_own_state(self, fields: StateFields) -> Any:
        # [paths of the root handed out, the last of them]; a count alone (the previous form,
        # and before the first root): not checked against the listing
        if is_int(fields.state.get("own")):
            return fields.integer("own"), None
        expected = "[paths of the root handed out, the last of them (None when none)]"
        own = fields.listed("own", expected, length=2)
        assert own is not None
        count = own.integer(0)
        last = own.raw(1, expected)
        if (count == 0) != (last is None) or not (last is None or isinstance(last, str)):
            raise bad_state_field(own.name(1), last, "the last path handed out (text), None when none was")
        return count, last

    def _load_own_state(self, state: Any) -> None:
        self._skip = state


def _check_listed_the_same(root: str, listed: list[str], skip: int, last: str | None) -> None:
    """Refuse to skip ``skip`` paths of a listing that no longer has ``last`` (by name: a
    dataset moved elsewhere still resumes) as its ``skip``-th, or has fewer: files were added
    or removed before it since the checkpoint, and skipping by count would hand some out twice
    and leave others out, unseen. (``last`` None: a state of the previous form, a count only.)"""
    if not skip:
        return
    now = listed[skip - 1] if len(listed) >= skip else None
    if now is None or (last is not None and _storage.file_name(now) != _storage.file_name(last)):
        was = f"its path {skip} was {last!r} and " if last is not None else ""
        found = f"it is now {now!r}" if now is not None else (
            f"it now lists {len(listed)} files, fewer than the {skip} handed out before")
        raise SourceChangedError(
            f"the listing of {root!r} changed since the checkpoint was taken: {was}{found} (a "
            "file added or removed before it), so the paths handed out before the checkpoint "
            "cannot be skipped by count", root)


def _state_or_none(iterator: PipeIterator[Any]) -> Any:
    try:
        return iterator.state_dict()
    except NotImplementedError:  # roots without a checkpoint: so is the listing (it says so)
        return None


class FileOpener(IterDataPipe[tuple[str, IO[Any]]], ErrorPolicyMixin):
    """Open each path or URL as a stream, yielding ``(url, stream)`` (functional name: ``open_files``).

    Streams are read as needed (nothing is downloaded first); the consumer closes them
    (``load_from_tar`` does). Remote streams reconnect and resume after transient failures.

    Args:
        datapipe: yields paths or URLs (``file://``, ``http(s)://``, ``s3://``, any fsspec URL).
        mode: ``"r"``/``"t"`` text (torchdata's default) or ``"b"`` bytes.
        encoding: the text encoding (text mode only).
        length: what ``len()`` reports (-1: no length, as in torch).
        storage_options: passed to fsspec (credentials, endpoints); environment variables such
            as ``AWS_ENDPOINT_URL`` work without it.
        retry: how transient failures are retried (default: 4 attempts, from 0.2 s doubling).
        on_error, max_failures: what a file that cannot be opened does; see
            ``pipeload.datapipes.sources.on_error``.

    Example:
        >>> FileLister("shards", "*.tar").open_files(mode="b").load_from_tar()
    """

    _parent_fields = ("datapipe",)

    def __init__(self, datapipe: IterDataPipe[str], mode: str = "r", encoding: str | None = None,
                 length: int = -1, *, storage_options: Mapping[str, Any] | None = None,
                 retry: RetryPolicy | None = None, on_error: OnError = "raise",
                 max_failures: int | None = None) -> None:
        if mode not in _MODES:
            raise ValueError(f"Invalid mode {mode}: mode must be one of {sorted(_MODES)}")
        check_mode_and_encoding(mode, encoding, _MODES[mode] == "rb", "FileOpener")
        check_policy(on_error, max_failures, "FileOpener")
        check_length(length, "FileOpener")
        check_retry(retry, "FileOpener")
        check_storage_options(storage_options, "FileOpener")
        self.datapipe = datapipe
        self.mode = mode
        self.encoding = encoding
        self.length = length
        self.storage_options = dict(storage_options) if storage_options else None
        self.retry = retry or RetryPolicy()
        self.on_error = on_error
        self.max_failures = max_failures

    def __iter__(self) -> Iterator[tuple[str, IO[Any]]]:
        return _OpenerIterator(self)

    def open(self, url: str) -> IO[Any]:
        # Plain RetryingReaders: load_from_tar names the archive member a failed read was in,
        # and a failure already named (a SourceError) it would pass on as it is.
        return _open(url, self.mode, self.encoding, self.storage_options, self.retry, RetryingReader)

    def __len__(self) -> int:
        # As torch's: no length unless told, even over a source with one (a file skipped under
        # on_error would make the source's length a promise the run breaks).
        if self.length == -1:
            raise no_length(self)
        return self.length


class _OpenerIterator(PipeIterator[tuple[str, IO[Any]]]):
    def __init__(self, pipe: FileOpener) -> None:
        super().__init__(pipe.datapipe)
        (self._urls,) = self.upstream
        self._pipe = pipe
        self.failures = pipe._failure_handler("open_files", "the file", FILE)

    def nonblocking_next(self) -> tuple[str, IO[Any]]:
        while True:
            url = self._urls.nonblocking_next()
            try:
                return url, self._pipe.open(url)
            except Exception as error:  # noqa: BLE001  (the policy decides: skip or raise)
                self.failures.handle(error, self.failures.site(url))


class StreamReader(IterDataPipe[tuple[str, Any]]):
    """Read each ``(label, stream)`` pair's stream to its end, yielding ``(label, data)`` pieces
    (functional name: ``read_from_stream``); each stream is closed once read.

    Args:
        datapipe: yields ``(label, stream)`` pairs (``open_files`` does).
        chunk: read this many bytes (characters, for a text stream) at a time; None: each stream
            in one piece.

    Example:
        >>> list(IterableWrapper([("letters", io.StringIO("abcde"))]).read_from_stream(chunk=2))
        [('letters', 'ab'), ('letters', 'cd'), ('letters', 'e')]
    """

    _parent_fields = ("datapipe",)

    def __init__(self, datapipe: IterDataPipe[tuple[str, IO[Any]]], chunk: int | None = None) -> None:
        if chunk is not None and (isinstance(chunk, bool) or not isinstance(chunk, int) or chunk <= 0):
            raise ValueError(f"chunk should be None or a positive integer, but got chunk={chunk!r}")
        self.datapipe = datapipe
        self.chunk = chunk

    def __iter__(self) -> Iterator[tuple[str, Any]]:
        return _StreamReadingIterator(self.datapipe, self.chunk)


class _StreamReadingIterator(SkipToResume, PipeIterator[tuple[str, Any]]):
    """Owns the stream being read: closed at its end, or when the run is closed."""

    def __init__(self, source: Any, chunk: int | None) -> None:
        super().__init__(source)
        (self._streams,) = self.upstream
        self._chunk = chunk
        self._current: tuple[str, IO[Any]] | None = None
        self._watch: LocalWatch | None = None  # on the current stream, when it reads a local file

    def nonblocking_next(self) -> tuple[str, Any]:
        while True:
            if self._current is None:
                self._current = self._streams.nonblocking_next()
                self._watch = LocalWatch.of(self._current[0], self._current[1])
            label, stream = self._current
            data = read_naming(stream, label, self._chunk)
            if self._watch is not None:
                self._watch.check()  # a piece read across a rewrite, or a cut-short end, never goes out
            if data:
                return label, data
            self._current = None
            stream.close()

    def close(self) -> None:
        current, self._current = self._current, None
        if current is not None:
            current[1].close()
        super().close()


class FileReader(MapDataPipe[tuple[str, Any]]):
    """A map-style pipe over a list of files: ``reader[i]`` is ``(path, contents)``.

    Reads the whole file at each access; pair it with a sampler for random access over many
    small files (images in a folder, local or in a bucket).

    Args:
        paths: the paths or URLs (``FileLister(...)`` turned into a list works).
        mode: ``"b"`` (bytes, the default) or ``"r"``/``"t"`` (text).
        encoding: the text encoding (text mode only).
        storage_options: passed to fsspec for remote files.
        retry: how transient failures are retried.

    Example:
        >>> reader = FileReader(sorted(glob.glob("images/*.jpg")))
        >>> path, data = reader[0]
    """

    _parent_fields = ()

    def __init__(self, paths: Sequence[str], mode: str = "b", encoding: str | None = None, *,
                 storage_options: Mapping[str, Any] | None = None, retry: RetryPolicy | None = None) -> None:
        if mode not in _MODES:
            raise ValueError(f"Invalid mode {mode}: mode must be one of {sorted(_MODES)}")
        check_mode_and_encoding(mode, encoding, _MODES[mode] == "rb", "FileReader")
        check_retry(retry, "FileReader")
        check_storage_options(storage_options, "FileReader")
        self.paths = checked_paths(paths, "FileReader")
        self.mode = mode
        self.encoding = encoding
        self.storage_options = dict(storage_options) if storage_options else None
        self.retry = retry or RetryPolicy()

    def __getitem__(self, index: int) -> tuple[str, Any]:
        url = self.paths[index]
        with open_stream(url, self.mode, self.encoding, self.storage_options, self.retry) as stream:
            watch = LocalWatch.of(url, stream)
            data = read_naming(stream, url)
            if watch is not None:
                watch.check()  # a file rewritten while it was read: two versions spliced, never handed out
            return url, data

    def __len__(self) -> int:
        return len(self.paths)
