"""Remote reads that survive transient failures: retry with back-off, resume where they stopped.

A dropped connection half-way through a shard should cost a reconnect, not the shard. A
:class:`RetryingReader` remembers how many bytes it has handed out; when a read fails with a
transient error it waits (doubling the wait each attempt), opens the file again and carries on
from the same byte (seeking where the file can seek, reading and dropping the prefix where it
cannot, as a plain HTTP stream), on the same version of the object: one that changed meanwhile
is an error, never spliced (``_versions.py``). Errors that will not go away by trying again (a
missing file, refused credentials, a changed object) are raised at once.
"""

from __future__ import annotations

import errno
import io
import math
import numbers
import threading
from collections.abc import Callable
from dataclasses import dataclass
from typing import IO, Any

from pipeload.datapipes.sources._versions import ObjectVersion, changed_error, is_expired

# Errors from the network libraries under fsspec, by class name, so that neither aiohttp nor
# botocore needs importing here (they are optional, and only present with the remote extra).
_TRANSIENT_CLASS_NAMES = frozenset({
    "ClientConnectionError", "ClientOSError", "ClientPayloadError", "ServerDisconnectedError",
    "ServerTimeoutError", "ClientConnectorError", "ConnectionClosedError", "EndpointConnectionError",
    "ReadTimeoutError", "ConnectTimeoutError", "ResponseStreamingError", "IncompleteReadError",
    "IncompleteRead", "ProtocolError",
})
_TRANSIENT_HTTP_STATUS = frozenset({408, 429, 500, 502, 503, 504})
_TRANSIENT_ERRNOS = frozenset({errno.ECONNRESET, errno.ECONNREFUSED, errno.ECONNABORTED,
                               errno.EPIPE, errno.ETIMEDOUT, errno.EHOSTUNREACH, errno.ENETUNREACH})
SKIP_CHUNK_BYTES = 1 << 20  # a stream that cannot seek is fast-forwarded in reads of this size
# Bytes a stream must hand out after a failed read before its attempts start afresh.
PROGRESS_BYTES = 1 << 20


@dataclass(frozen=True)
class RetryPolicy:
    """How often and how patiently a remote read is tried again.

    Attributes:
        attempts: tries in all, the first included (1: never retry).
        backoff_s: the wait before the second try; each further wait doubles it.
        max_backoff_s: the longest single wait.
    """

    attempts: int = 4
    backoff_s: float = 0.2
    max_backoff_s: float = 5.0

    def __post_init__(self) -> None:
        # Refused here, where the policy is written: a float count silently rounds up (2.5
        # tries are 3), a string fails only at the first error, a NaN wait never ends.
        if isinstance(self.attempts, bool) or not isinstance(self.attempts, numbers.Integral):
            raise TypeError(f"RetryPolicy: attempts must be an int, got attempts={self.attempts!r} "
                            f"({type(self.attempts).__name__})")
        if self.attempts < 1:
            raise ValueError(f"RetryPolicy: attempts must be at least 1, got attempts={self.attempts!r}")
        for name in ("backoff_s", "max_backoff_s"):
            _check_wait(name, getattr(self, name))

    def wait_s(self, failed_attempts: int) -> float:
        """The wait after ``failed_attempts`` failures (1 or more)."""
        return min(self.backoff_s * 2 ** (failed_attempts - 1), self.max_backoff_s)


def _check_wait(name: str, seconds: Any) -> None:
    """Refuse a wait that is not a finite number of seconds, at least 0, naming the field."""
    if isinstance(seconds, bool) or not isinstance(seconds, numbers.Real):
        raise TypeError(f"RetryPolicy: {name} must be a number of seconds, got {name}={seconds!r} "
                        f"({type(seconds).__name__})")
    if not math.isfinite(seconds) or seconds < 0:
        raise ValueError(f"RetryPolicy: waits must be finite and not negative, got {name}={seconds!r}")


def is_transient(error: BaseException) -> bool:
    """Whether trying again may well succeed: connection trouble, timeouts, a server's 5xx/429,
    said by the error or by one it was raised while handling (s3fs, timed out reading a range,
    raises an IndexError of its own from the handler: the timeout is its context)."""
    if isinstance(error, (FileNotFoundError, PermissionError, IsADirectoryError)):
        return False
    seen: set[int] = set()
    while error is not None and id(error) not in seen and len(seen) < CHAIN_LOOKED_AT:
        seen.add(id(error))
        if _says_transient(error):
            return True
        error = error.__cause__ or (None if error.__suppress_context__ else error.__context__)
    return False


# How far down an error's chain (causes, contexts) a transient one is looked for.
CHAIN_LOOKED_AT = 4


def _says_transient(error: BaseException) -> bool:
    if isinstance(error, (FileNotFoundError, PermissionError, IsADirectoryError)):
        return False
    if isinstance(error, (ConnectionError, TimeoutError)):
        return True
    if isinstance(error, OSError) and error.errno in _TRANSIENT_ERRNOS:
        return True
    if any(cls.__name__ in _TRANSIENT_CLASS_NAMES for cls in type(error).__mro__):
        return True
    status = getattr(error, "status", None) or getattr(error, "code", None)
    return isinstance(status, int) and status in _TRANSIENT_HTTP_STATUS


def with_retries(action: Callable[[], Any], policy: RetryPolicy, stop: threading.Event | None = None,
                 failed_before: int = 0) -> Any:
    """``action()``, tried again after transient failures as ``policy`` allows.

    ``stop`` (when given and set) ends the waiting early: the last error is raised at once.
    ``failed_before``: failures already counted against ``policy.attempts`` (a stream's, whose
    reads since made too little progress to start afresh).
    """
    failures = failed_before
    while True:
        try:
            return action()
        except Exception as error:
            failures += 1
            if not is_transient(error) or failures >= policy.attempts:
                if failures > 1:
                    error.add_note(f"pipeload: gave up after {failures} attempts")
                raise
            waiter = stop if stop is not None else threading.Event()
            if waiter.wait(policy.wait_s(failures)):
                raise


# Opens the file from a byte on, as a version (None: the first open, whichever version is
# there); returns the file, the version it reads and the byte its data begins at.
Opener = Callable[[int, ObjectVersion | None], tuple[IO[bytes], ObjectVersion, int]]


class RetryingReader(io.RawIOBase):
    """A read-only byte stream over a remote file that reconnects and resumes on transient errors.

    The first open pins the object's version (``version``); a reopened read continues only on
    that version, else it raises :class:`SourceChangedError` (see ``_versions.py``).
    Not thread-safe: one run reads it. ``close()`` closes the file under it and is idempotent.
    """

    def __init__(self, url: str, opener: Opener, policy: RetryPolicy) -> None:
        super().__init__()
        self.url = url
        self._opener = opener
        self._policy = policy
        self._position = 0  # bytes handed out so far: where a reopened file must resume
        self._file: IO[bytes] | None = None
        self._file, self.version, _ = with_retries(lambda: opener(0, None), policy)
        self.reconnects = 0
        self._strikes = 0  # failed reads since the stream last made PROGRESS_BYTES of progress
        self._since_strike = 0  # bytes handed out since the last failed read
        self._ended = False  # the file's end was read: no more asks of it

    def readable(self) -> bool:
        return True

    def readinto(self, buffer: Any) -> int:
        view = memoryview(buffer).cast("B")
        if self._ended or not len(view):
            # A reader at the end asks again and again (gzip's, for another member): asked each
            # time, aiohttp's response logged a warning with a stack after the fifth ("Multiple
            # access to StreamReader in eof state"), sixteen for a 2 MB .tar.gz on stderr.
            return 0
        data = with_retries(lambda: self._read_once(len(view)), self._policy, failed_before=self._strikes)
        view[:len(data)] = data
        self._ended = not data
        self._position += len(data)
        # Attempts start afresh only after real progress: a server that sends a little after
        # each reconnect and stalls again (a proxy that stops forwarding) was followed for as
        # long as it went on, a stall timeout each time (a 2 MiB shard sent 64 KiB at a time:
        # 16 minutes, without a word).
        self._since_strike += len(data)
        if self._since_strike >= PROGRESS_BYTES:
            self._strikes = 0
        return len(data)

    def _read_once(self, size: int) -> bytes:
        if self._file is None:
            self._reopen()
        try:
            return self._file.read(size)  # type: ignore[union-attr]
        except Exception as error:
            self._drop_file()
            self._strikes += 1
            self._since_strike = 0
            if is_expired(error):  # the store refused the pinned version: it changed
                raise changed_error(self.url, f"the store refused a read of the version read "
                                              f"first: {error}") from error
            raise

    def _reopen(self) -> None:
        self.reconnects += 1
        file, _, start = self._opener(self._position, self.version)
        try:
            if start != self._position and not _seek(file, self._position):
                _read_past(file, self._position - start, self.url)
        except BaseException:
            file.close()
            raise
        self._file = file

    def _drop_file(self) -> None:
        file, self._file = self._file, None
        if file is not None:
            try:
                file.close()
            except Exception:  # noqa: BLE001  (a broken connection may fail to close; it is gone anyway)
                pass

    def close(self) -> None:
        if not self.closed:
            self._drop_file()
        super().close()


def _seek(file: IO[bytes], position: int) -> bool:
    """Seek ``file`` to ``position`` if it can (fsspec's HTTP streams say they can, and refuse)."""
    try:
        if not file.seekable():
            return False
        file.seek(position)
    except (ValueError, OSError):
        return False
    return True


def _read_past(file: IO[bytes], count: int, url: str) -> None:
    left = count
    while left > 0:
        chunk = file.read(min(left, SKIP_CHUNK_BYTES))
        if not chunk:
            raise changed_error(url, f"reopened, it ended after {count - left} bytes, before the "
                                     f"{count} already read")
        left -= len(chunk)
