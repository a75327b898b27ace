"""Which version of a remote object a read is pinned to, and whether a reopened read still sees it.

A read that reconnects after a cut connection continues at the byte where it stopped. If the
object was replaced in between, carrying on would splice the old version's first part to the new
one's rest: a tar shard whose members are partly one file and partly another, without a word.
So the first response's validators are kept (an HTTP ETag, Last-Modified and length; an object
store's ETag, version id and size), a resumed HTTP request asks the server to answer only if the
object is still that one (``If-Match`` and ``If-Range``), and every reopened read is compared
with the first: a difference is a :class:`SourceChangedError` naming the URL and what changed.

A server that sends neither an ETag nor a Last-Modified can be checked by length only.

A checkpoint taken inside an archive keeps the version too (:func:`stream_version`: a remote
stream's pinned one, a local file's length and content fingerprint): resuming at a byte of an
archive replaced since is the same splice, across processes instead of across a reconnect.
"""

from __future__ import annotations

import hashlib
import io
import os
import re
import stat
import zlib
from dataclasses import dataclass, fields
from typing import Any

from pipeload.datapipes.sources.errors import SourceChangedError

_CONTENT_RANGE = re.compile(r"bytes (\d+)-(\d+)/(\d+|\*)")
HTTP_PRECONDITION_FAILED = 412
HTTP_RANGE_NOT_SATISFIABLE = 416
HTTP_PARTIAL_CONTENT = 206
# s3fs raises this (an OSError) when a ranged read's If-Match no longer holds.
_EXPIRED_CLASS_NAMES = frozenset({"FileExpired"})
# What object stores and fsspec filesystems call their validators, in ``file.details``.
_DETAIL_NAMES = {
    "etag": ("ETag", "etag", "md5Hash"),
    "version_id": ("VersionId", "version_id", "generation"),
    "last_modified": ("LastModified", "last_modified", "mtime", "updated"),
    "size": ("size", "Size", "ContentLength"),
}


@dataclass(frozen=True)
class ObjectVersion:
    """What identifies one version of a remote object; None where the server did not say."""

    etag: str | None = None
    last_modified: str | None = None
    size: int | None = None
    version_id: str | None = None
    mtime_ns: int | None = None  # a local file's modification time
    # A local file's status-change time: a rewrite moves it even when the modification time is
    # set back afterwards (``cp -p``, ``rsync --inplace -t``), and nobody can set it by hand.
    ctime_ns: int | None = None
    content: str | None = None  # a local file's fingerprint (see local_fingerprint)

    @property
    def strong_etag(self) -> str | None:
        """The ETag, if it is a strong one (weak ETags may not be used to resume a range)."""
        return self.etag if self.etag and not self.etag.startswith("W/") else None

    def changes_since(self, first: ObjectVersion, keep_validators: bool = False) -> list[str]:
        """What differs from ``first``, in words; only what both versions tell is compared,
        except, with ``keep_validators``, a validator ``first`` had and this one lacks: the
        version can no longer be confirmed. (A reopened response without the ETag the first
        one had let a same-length new version through: a member spliced from two versions,
        stop 54's sources skeptic.)"""
        changed = []
        for field in fields(self):
            before, now = getattr(first, field.name), getattr(self, field.name)
            if before is not None and now is not None and before != now:
                changed.append(f"its {_LABELS[field.name]} was {before!r} and is now {now!r}")
        said = [name for name in VALIDATORS if getattr(first, name) is not None]
        if keep_validators and said and all(getattr(self, name) is None for name in said):
            was = " and ".join(f"{_LABELS[name]} was {getattr(first, name)!r}" for name in said)
            changed.append(f"its {was}, and none is given now, so the version cannot be confirmed")
        return changed

    @property
    def is_remote(self) -> bool:
        """Whether a server said this version (no local file's status or fingerprint in it)."""
        return self.mtime_ns is None and self.ctime_ns is None and self.content is None


_LABELS = {"etag": "ETag", "last_modified": "Last-Modified", "size": "length", "version_id": "version id",
           "mtime_ns": "modification time (ns)", "ctime_ns": "status-change time (ns)",
           "content": "first and last 64 KiB"}
LOCAL_ONLY = ("mtime_ns", "ctime_ns")  # a copy of the file has others, and the same bytes
# What a server must say of the version it sends again: HTTP requires a 206 to carry the ETag a
# 200 would (RFC 9110, 15.3.7), not Last-Modified, which a 206 answering If-Range may leave out.
VALIDATORS = ("etag", "version_id")
TEXT_FIELDS = ("etag", "last_modified", "version_id", "content")  # in a checkpoint: text; the rest, counts
FINGERPRINT_BYTES = 64 * 1024  # read from each end of a local file: ~0.1 ms an archive opened


def changed_error(url: str, what: str) -> SourceChangedError:
    return SourceChangedError(
        f"{url!r} changed while it was read ({what}): the bytes already read belong to the "
        "version read first, so the read stops rather than splice two versions", url)


def check_unchanged(url: str, first: ObjectVersion, now: ObjectVersion) -> None:
    """Raise :class:`SourceChangedError` if ``now`` is not the version ``first`` was."""
    changes = now.changes_since(first, keep_validators=True)
    if changes:
        raise changed_error(url, "; ".join(changes))


def stream_version(stream: Any) -> ObjectVersion | None:
    """The version of the object an opened stream reads: a remote stream's (``open_stream``
    pins it at its first response), a local file's length, modification time and content
    fingerprint; None for a stream that cannot say (a buffer in memory, a pipe)."""
    version = getattr(getattr(stream, "raw", None), "version", None)  # open_stream's RetryingReader
    if isinstance(version, ObjectVersion):
        return version
    try:
        status = os.fstat(stream.fileno())
    except (AttributeError, OSError, ValueError):
        return None
    if not stat.S_ISREG(status.st_mode):
        return None
    return ObjectVersion(size=status.st_size, mtime_ns=status.st_mtime_ns, ctime_ns=status.st_ctime_ns,
                         content=local_fingerprint(stream.fileno(), status.st_size))


def local_status(status: os.stat_result) -> ObjectVersion:
    """What one ``fstat`` tells of an open local file's version, to compare while it is read."""
    return ObjectVersion(size=status.st_size, mtime_ns=status.st_mtime_ns, ctime_ns=status.st_ctime_ns)


def is_plain_file(stream: Any) -> bool:
    """Whether ``stream`` reads a file's own bytes through the operating system (its ``fileno()``
    then reads the same bytes at the same places): not a stream that decompresses or otherwise
    transforms what it reads from a file (``gzip.open``), whose ``fileno()`` is the file's too."""
    return isinstance(stream, (io.FileIO, io.BufferedReader, io.BufferedRandom, ReadDigest))


class ReadDigest:
    """A local file's stream with a running CRC-32 of the bytes read through it (from where it
    was opened or last sought), one byte in ``SAMPLE_STRIDE`` at fixed places: what a reader
    compares with the file as it is now, to tell a rewrite whose modification time was set back
    from a ``chmod`` or a new link, which leave the status-change time moved all the same.

    A sample, as a CRC-32 of every byte (~4 GB/s) halved the rate of reading a cached shard
    (``bench.tar_read``: 3.8 to 1.9 GiB/s a worker). Any change of ``SAMPLE_STRIDE`` bytes in a
    row or more is seen for sure (a rewritten member, header or shard), a shorter one by chance
    (one byte: 1 in 128). The comparison rereads the bytes once per such change.

    Owned by the one reader of the stream.
    """

    def __init__(self, stream: Any) -> None:
        self._stream = stream
        self._start = self._tell()
        self._length = 0
        self._crc = 0

    def read(self, size: int = -1) -> bytes:
        data = self._stream.read(size)
        self._crc = zlib.crc32(data[-self._length % SAMPLE_STRIDE::SAMPLE_STRIDE], self._crc)
        self._length += len(data)
        return data

    def seekable(self) -> bool:
        return self._stream.seekable()

    def tell(self) -> int:
        return self._stream.tell()

    def seek(self, offset: int, whence: int = io.SEEK_SET) -> int:
        position = self._stream.seek(offset, whence)
        self._start, self._length, self._crc = position, 0, 0
        return position

    def fileno(self) -> int:
        return self._stream.fileno()

    def read_unchanged(self) -> bool:
        """Whether the bytes read so far are still the file's bytes at their place (as far as
        the sample sees)."""
        fd, crc, at, end = self._stream.fileno(), 0, self._start, self._start + self._length
        while at < end:
            chunk = os.pread(fd, min(REREAD_CHUNK_BYTES, end - at), at)
            if not chunk:
                return False  # shorter now
            crc = zlib.crc32(chunk[-(at - self._start) % SAMPLE_STRIDE::SAMPLE_STRIDE], crc)
            at += len(chunk)
        return crc == self._crc

    def _tell(self) -> int:
        try:
            return self._stream.tell()
        except (AttributeError, OSError, ValueError, io.UnsupportedOperation):
            return 0


REREAD_CHUNK_BYTES = 1 << 20
SAMPLE_STRIDE = 128


class LocalWatch:
    """An open local file's length, modification and status-change times as first seen, checked
    again after each read of it (one ``fstat``, about a microsecond), so that a read across a
    rewrite raises instead of splicing two versions.

    A status-change time that moved alone is a rewrite whose modification time was set back
    (``cp -p``, ``rsync --inplace -t``), or a ``chmod`` or a new hard link: which one, only the
    content could tell, so it is taken for a change. Except when the file has no name left (it
    was replaced by a rename, or deleted): its bytes stay as they were for the reader that holds
    it open.

    Owned by the one reader of the stream.
    """

    __slots__ = ("url", "fd", "size", "mtime_ns", "ctime_ns")

    def __init__(self, url: str, fd: int, status: os.stat_result) -> None:
        self.url, self.fd = url, fd
        self.size, self.mtime_ns, self.ctime_ns = status.st_size, status.st_mtime_ns, status.st_ctime_ns

    @classmethod
    def of(cls, url: str, stream: Any) -> LocalWatch | None:
        """A watch on ``stream`` if it reads a regular local file, else None."""
        try:
            fd = stream.fileno()
            status = os.fstat(fd)
        except (AttributeError, OSError, ValueError, io.UnsupportedOperation):
            return None
        return cls(url, fd, status) if stat.S_ISREG(status.st_mode) else None

    def check(self) -> None:
        """Raise :class:`SourceChangedError` if the file changed since the watch began."""
        status = os.fstat(self.fd)
        if status.st_size != self.size or status.st_mtime_ns != self.mtime_ns:
            first = ObjectVersion(size=self.size, mtime_ns=self.mtime_ns)
            check_unchanged(self.url, first, ObjectVersion(size=status.st_size, mtime_ns=status.st_mtime_ns))
        if status.st_ctime_ns != self.ctime_ns:
            if status.st_nlink == 0:
                self.ctime_ns = status.st_ctime_ns
                return
            raise changed_error(self.url, "its status-change time moved while its length and modification "
                                "time stayed: rewritten with its modification time set back, or its "
                                "permissions or links changed")


def local_fingerprint(fd: int, size: int) -> str:
    """A digest of a local file's first and last ``FINGERPRINT_BYTES``: what a checkpoint
    compares to tell the archive it was taken in from one regenerated with the same layout,
    while a copy of it (new modification time, same bytes: ``cp``, a fresh download, another
    machine) still resumes."""
    digest = hashlib.blake2b(digest_size=16)
    digest.update(os.pread(fd, FINGERPRINT_BYTES, 0))
    if size > FINGERPRINT_BYTES:
        digest.update(os.pread(fd, FINGERPRINT_BYTES, max(FINGERPRINT_BYTES, size - FINGERPRINT_BYTES)))
    return digest.hexdigest()


def version_state(version: ObjectVersion | None) -> dict[str, Any] | None:
    """``version`` for a checkpoint: its known fields (plain JSON types); None for none."""
    if version is None:
        return None
    # Not a local file's modification or status-change time: a copy of the file has others, and
    # the same bytes (its content fingerprint tells). They still catch a rewrite while it is read.
    return {field.name: getattr(version, field.name) for field in fields(version)
            if getattr(version, field.name) is not None and field.name not in LOCAL_ONLY}


def changed_since_checkpoint_error(url: str, what: str, offset: int) -> SourceChangedError:
    return SourceChangedError(
        f"{url!r} changed since the checkpoint was taken ({what}): resuming at byte {offset} "
        "of it would splice the new version's members to the old version's, so it is not "
        "resumed", url)


def check_unchanged_since_checkpoint(url: str, saved: ObjectVersion, now: ObjectVersion | None,
                                     offset: int) -> None:
    """Raise :class:`SourceChangedError` if the archive opened to resume a checkpoint at
    ``offset`` is not the version the checkpoint was taken on: what both tell is compared, and a
    server's validator the checkpoint has must be given again by a server (a local copy of the
    archive is compared by what a copy keeps)."""
    # A stream that cannot say its version (None) is compared as before: nothing to hold it to.
    keep = now is not None and saved.is_remote and now.is_remote
    changes = (now or ObjectVersion()).changes_since(saved, keep_validators=keep)
    if changes:
        raise changed_since_checkpoint_error(url, "; ".join(changes), offset)


def is_expired(error: BaseException) -> bool:
    """Whether ``error`` is an object store refusing a read because the object changed."""
    return any(cls.__name__ in _EXPIRED_CLASS_NAMES for cls in type(error).__mro__)


# -- HTTP -------------------------------------------------------------------------------------

def http_version(response: Any) -> ObjectVersion:
    """The validators of an HTTP response (an aiohttp response, as fsspec's stream holds it).

    Its length is the whole object's: a 206's Content-Range total, else Content-Length (unless
    the body is content-encoded, when that is the encoded length and says nothing)."""
    headers = response.headers
    size = None
    if response.status == HTTP_PARTIAL_CONTENT:
        match = _CONTENT_RANGE.fullmatch(headers.get("Content-Range", "").strip())
        if match is not None and match.group(3) != "*":
            size = int(match.group(3))
    elif "Content-Length" in headers and "Content-Encoding" not in headers:
        size = int(headers["Content-Length"])
    return ObjectVersion(etag=headers.get("ETag"), last_modified=headers.get("Last-Modified"), size=size)


def http_resume_headers(first: ObjectVersion, position: int) -> dict[str, str]:
    """Headers asking for the object from byte ``position`` on, only while it is ``first``.

    ``Range`` with ``If-Range`` gets the rest (206) if the object is unchanged and the whole new
    one (200) otherwise; ``If-Match`` makes a server that knows it answer 412 instead. Without a
    strong ETag the date stands in (``If-Range`` and ``If-Unmodified-Since``)."""
    headers = {"Range": f"bytes={position}-"}
    if first.strong_etag is not None:
        headers["If-Range"] = headers["If-Match"] = first.strong_etag
    elif first.last_modified is not None:
        headers["If-Range"] = headers["If-Unmodified-Since"] = first.last_modified
    return headers


def http_body_start(url: str, response: Any, position: int) -> int:
    """The byte of the object the response's body begins at: ``position`` for a 206 that
    answers the range asked, 0 for a whole object (200).

    Raises:
        SourceChangedError: a 206 for another range (the server answered some other request).
    """
    if response.status != HTTP_PARTIAL_CONTENT:
        return 0
    match = _CONTENT_RANGE.fullmatch(response.headers.get("Content-Range", "").strip())
    if match is None or int(match.group(1)) != position:
        raise changed_error(url, f"asked for its bytes from {position} on, the server sent "
                                 f"Content-Range {response.headers.get('Content-Range')!r}")
    return position


def http_refusal(url: str, status: int) -> SourceChangedError | None:
    """The error for a resumed request the server refused because the object changed."""
    if status == HTTP_PRECONDITION_FAILED:
        return changed_error(url, "the server answered 412 Precondition Failed to a request "
                                  "for the version read first")
    if status == HTTP_RANGE_NOT_SATISFIABLE:
        return changed_error(url, "the server answered 416: it is now shorter than the bytes "
                                  "already read")
    return None


# -- object stores and other fsspec filesystems ---------------------------------------------

def details_version(details: Any) -> ObjectVersion:
    """The validators an fsspec file's ``details`` hold (s3fs: ETag, VersionId, size, ...)."""
    if not isinstance(details, dict):
        return ObjectVersion()
    found: dict[str, Any] = {}
    for name, keys in _DETAIL_NAMES.items():
        for key in keys:
            value = details.get(key)
            if value is not None and value != "":
                found[name] = value if name == "size" else str(value)
                break
    size = found.get("size")
    return ObjectVersion(found.get("etag"), found.get("last_modified"),
                         int(size) if isinstance(size, (int, str)) and str(size).isdigit() else None,
                         found.get("version_id"))
