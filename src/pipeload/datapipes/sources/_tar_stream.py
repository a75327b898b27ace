"""Reading one tar archive front to back from a stream, and telling a clean end from a broken one.

Python's ``tarfile`` in stream mode ends quietly when a header after the first cannot be read:
a shard cut off at a member boundary, or with garbage in a header, looks exactly like a short
shard. Every sample after the damage would vanish without a word. So the decompressed bytes pass
through a :class:`TailWatch` that keeps the last few records; when ``tarfile`` stops, the block
at its offset tells why: zeros are the end-of-archive marker, a short block means the data ran
out (truncated), anything else is a header ``tarfile`` could not parse (corrupt).

Compression is recognised from the first bytes, not the name: gzip, bzip2 and xz with the
standard library, zstd with the ``zstandard`` package (the ``zstd`` extra).
"""

from __future__ import annotations

import bz2
import gzip
import io
import lzma
import tarfile
from collections import deque
from typing import IO, Any

BLOCK_BYTES = tarfile.BLOCKSIZE
TAIL_BYTES = 8 * tarfile.RECORDSIZE  # tarfile reads RECORDSIZE at a time; the failing header is in the last two
_MAGIC_BYTES = 6
_GZIP, _BZIP2, _XZ, _ZSTD = b"\x1f\x8b", b"BZh", b"\xfd7zXZ\x00", b"\x28\xb5\x2f\xfd"
ZSTD_EXTRA_HINT = "pip install 'pipeload[zstd]' (the zstandard package)"


class TailWatch:
    """A read-only stream that remembers its last ``TAIL_BYTES`` and whether it hit the end."""

    def __init__(self, source: Any) -> None:
        self._source = source
        self.position = 0  # bytes handed out
        self.ended = False
        self._tail: deque[tuple[int, bytes]] = deque()  # (start, chunk), oldest first
        self._tail_bytes = 0

    def read(self, size: int = -1) -> bytes:
        chunk = self._source.read(size)
        if not chunk and size != 0:
            self.ended = True
            return chunk
        self._tail.append((self.position, chunk))
        self.position += len(chunk)
        self._tail_bytes += len(chunk)
        while self._tail_bytes - len(self._tail[0][1]) >= TAIL_BYTES:
            self._tail_bytes -= len(self._tail.popleft()[1])
        return chunk

    def bytes_at(self, offset: int, size: int) -> bytes | None:
        """The bytes read at ``[offset, offset + size)`` (fewer where the data ended), or None
        if they are no longer held."""
        if self._tail and offset < self._tail[0][0]:
            return None
        parts = []
        for start, chunk in self._tail:
            if start + len(chunk) > offset and start < offset + size:
                parts.append(chunk[max(0, offset - start):offset + size - start])
        return b"".join(parts)


class _Prefixed:
    """A stream with bytes already read from its front put back."""

    def __init__(self, prefix: bytes, rest: IO[bytes]) -> None:
        self._prefix = prefix
        self._rest = rest

    def read(self, size: int = -1) -> bytes:
        if not self._prefix:
            return self._rest.read(size)
        if size is None or size < 0:
            data, self._prefix = self._prefix + self._rest.read(), b""
            return data
        data, self._prefix = self._prefix[:size], self._prefix[size:]
        return data


def decompressed(stream: IO[bytes]) -> Any:
    """``stream`` with any compression taken off, recognised by its magic bytes."""
    head = b"" if isinstance(stream, io.TextIOBase) else stream.read(_MAGIC_BYTES)
    if not isinstance(head, bytes) or isinstance(stream, io.TextIOBase):
        raise TypeError(f"load_from_tar needs binary streams, got a text stream ({type(stream).__name__}): "
                        "open the files with mode='b'")
    source = _Prefixed(head, stream)
    if head.startswith(_GZIP):
        return gzip.GzipFile(fileobj=source)  # type: ignore[arg-type]
    if head.startswith(_BZIP2):
        return bz2.BZ2File(source)  # type: ignore[arg-type]
    if head.startswith(_XZ):
        return lzma.LZMAFile(source)  # type: ignore[arg-type]
    if head.startswith(_ZSTD):
        return _zstd_reader(source)
    return source


def _zstd_reader(source: Any) -> Any:
    try:
        import zstandard
    except ImportError as error:
        raise ImportError(f"reading a zstd-compressed tar (.tar.zst) needs zstandard, which is not "
                          f"installed: {ZSTD_EXTRA_HINT}") from error
    return zstandard.ZstdDecompressor().stream_reader(source, read_across_frames=True)


def how_it_ended(watch: TailWatch, offset: int) -> str | None:
    """None for a clean end-of-archive marker at ``offset``; otherwise what went wrong there."""
    block = watch.bytes_at(offset, BLOCK_BYTES)
    if block is None:
        return None  # long gone from the tail: tarfile did not stop on a bad header here
    if len(block) < BLOCK_BYTES:
        if not block:
            return "truncated: the data ends without an end-of-archive marker"
        return f"truncated: the data ends {len(block)} bytes into a header"
    if block.count(0) == BLOCK_BYTES:
        return None
    return f"corrupt: the header at byte {offset} is not a valid tar header"


def open_tar(watch: TailWatch) -> tarfile.TarFile:
    """A stream-mode TarFile over already-decompressed bytes."""
    return tarfile.open(fileobj=watch, mode="r|")  # type: ignore[call-overload]
