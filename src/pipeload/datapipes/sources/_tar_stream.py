"""Reading one tar archive front to back from a stream, and telling a clean end from a broken one.

Python's ``tarfile`` in stream mode ends quietly when a header after the first cannot be read:
a shard cut off at a member boundary, or with garbage in a header, looks exactly like a short
shard, and every sample after the damage would vanish without a word. It is also slow for what
shards need (a general TarInfo per member). So members are read here, header by header: a zero
block is the end-of-archive marker, a short block means the data ran out (truncated), a block
whose checksum does not add up is corrupt. ustar, GNU long names and pax headers (``path``,
``size``) are understood, which covers what tar, Python's tarfile and WebDataset's writers make;
a type no writer here makes is read as a regular file, as POSIX asks; sparse files (GNU's type
and pax's) and multi-volume continuations are refused.

Compression is recognised from the first bytes, not the name: gzip, bzip2 and xz with the
standard library, zstd with the ``zstandard`` package (the ``zstd`` extra).
"""

from __future__ import annotations

import bz2
import gzip
import io
import lzma
import os
import posixpath
import tarfile
import warnings
from typing import IO, Any

from pipeload.datapipes.sources._versions import is_plain_file

BLOCK_BYTES = 512
_ZERO_BLOCK = bytes(BLOCK_BYTES)
_CHECKSUM_FIELD = slice(148, 156)
_CHECKSUM_SPACES = 8 * ord(" ")  # the checksum is computed with its own field read as spaces
_REGULAR_TYPES = frozenset({b"0", b"\0", b"7"})
_PAX_TYPE, _PAX_GLOBAL_TYPE, _GNU_LONG_NAME, _GNU_LONG_LINK, _GNU_SPARSE = b"x", b"g", b"L", b"K", b"S"
_HARDLINK_TYPE, _SYMLINK_TYPE = b"1", b"2"
_SOLARIS_PAX_TYPE, _MULTIVOLUME_TYPE = b"X", b"M"
# Entries that hold no file's bytes: character and block devices, directories, FIFOs, GNU's
# dump directories and volume labels. Any other type a writer invents is read as a regular file,
# as POSIX asks and tar and Python's tarfile do (dropping it lost a sample's field silently).
_NO_FILE_TYPES = frozenset({b"3", b"4", b"5", b"6", b"D", b"V"})
_SPARSE_PAX_KEYS = "GNU.sparse."
_LINK_TYPES = frozenset({_HARDLINK_TYPE, _SYMLINK_TYPE})
# The types read here as something other than a regular file.
_OTHER_KNOWN_TYPES = _NO_FILE_TYPES | _LINK_TYPES | {
    _PAX_TYPE, _SOLARIS_PAX_TYPE, _PAX_GLOBAL_TYPE, _GNU_LONG_NAME, _GNU_LONG_LINK, _GNU_SPARSE}
_POSIX_USTAR_MAGIC = b"ustar\x0000"
_GZIP, _BZIP2, _XZ, _ZSTD = b"\x1f\x8b", b"BZh", b"\xfd7zXZ\x00", b"\x28\xb5\x2f\xfd"
# What follows bzip2's "BZh" and its block-size digit: a block's or the stream's end's magic.
# "BZh" alone is printable, and a plain tar begins with its first member's name ("BZh91AY.jpg").
_BZIP2_BLOCKS = (b"\x31\x41\x59\x26\x53\x59", b"\x17\x72\x45\x38\x50\x90")
ZSTD_EXTRA_HINT = "pip install 'pipeload[zstd]' (the zstandard package)"


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
    head = b"" if isinstance(stream, io.TextIOBase) else stream.read(BLOCK_BYTES)
    if not isinstance(head, bytes) or isinstance(stream, io.TextIOBase):
        raise TypeError(f"load_from_tar needs binary streams, got a text stream ({type(stream).__name__}): "
                        "open the files with mode='b'")
    source = _Prefixed(head, stream)
    if _is_tar_header(head):
        return source  # a plain archive, whatever its first name ("BZh91AY&SY.jpg") begins with
    if head.startswith(_GZIP):
        return gzip.GzipFile(fileobj=source)  # type: ignore[arg-type]
    if _is_bzip2(head):
        return io.BufferedReader(JoinedStreams(source, bz2.BZ2Decompressor), JoinedStreams.CHUNK_BYTES)
    if head.startswith(_XZ):
        return io.BufferedReader(JoinedStreams(source, lzma.LZMADecompressor), JoinedStreams.CHUNK_BYTES)
    if head.startswith(_ZSTD):
        return _zstd_reader(source)
    return source


class JoinedStreams(io.RawIOBase):
    """The bytes of compressed streams written one after another (``cat a.tar.bz2 b.tar.bz2``),
    each after the first required to begin as one.

    bz2's and lzma's own file readers take what follows a stream and does not begin as one for
    garbage after the data, and stop without a word: one damaged byte at the head of a joined
    archive's stream lost its every member, silently (stop 54's sources skeptic; gzip's reader
    raises). Zero bytes after the last stream are padding, as those readers take them.

    Raises (from ``read``), as bz2's and lzma's readers do:
        EOFError: the data ends inside a stream.
        OSError: bzip2 data that is not a stream ("Invalid data stream"), after one or inside.
        lzma.LZMAError: the same for xz.
    """

    CHUNK_BYTES = 1 << 16

    def __init__(self, source: Any, decompressor: Any) -> None:
        super().__init__()
        self._source, self._make = source, decompressor
        self._decompressor = decompressor()
        self._input = b""  # read from the source, not yet given to the decompressor
        self._ended = False

    def readable(self) -> bool:
        return True

    def readinto(self, buffer: Any) -> int:
        while not self._ended:
            data = self._next_output(len(buffer))
            if data:
                buffer[:len(data)] = data
                return len(data)
        return 0

    def _next_output(self, most: int) -> bytes:
        """Up to ``most`` decompressed bytes (b"" when a stream just ended or took input only)."""
        decompressor = self._decompressor
        if decompressor.eof:
            self._begin_next_stream(decompressor.unused_data)
            return b""
        data = b""
        if decompressor.needs_input:
            data, self._input = self._input or self._source.read(self.CHUNK_BYTES), b""
            if not data:
                raise EOFError("Compressed file ended before the end-of-stream marker was reached")
        return decompressor.decompress(data, most)

    def _begin_next_stream(self, rest: bytes) -> None:
        """After a stream's end: another stream (its first bytes are checked as they are
        decompressed), zero padding to the end, or the end itself."""
        rest = rest.lstrip(b"\0")
        while not rest:
            rest = self._source.read(self.CHUNK_BYTES)
            if not rest:
                self._ended = True
                return
            rest = rest.lstrip(b"\0")
        self._decompressor, self._input = self._make(), rest


def _is_tar_header(block: bytes) -> bool:
    """Whether ``block`` is a whole tar header whose checksum adds up (no compressed stream's
    first bytes do, while printable magic such as bzip2's can be a member's name)."""
    if len(block) != BLOCK_BYTES or block == _ZERO_BLOCK:
        return False
    try:
        TarReader._check_header(block, 0)
    except TarFormatError:
        return False
    return True


def _is_bzip2(head: bytes) -> bool:
    """"BZh", a block size from 1 to 9, then a block's or the stream's end's magic."""
    return head.startswith(_BZIP2) and head[3:4].isdigit() and head[3:4] != b"0" and head[4:10] in _BZIP2_BLOCKS


def _zstd_reader(source: Any) -> Any:
    try:
        import zstandard
    except ImportError as error:
        raise ImportError(f"reading a zstd-compressed tar (.tar.zst) needs zstandard, which is not "
                          f"installed: {ZSTD_EXTRA_HINT}") from error
    return _ZstdFrames(source, zstandard.ZstdDecompressor())


class _ZstdFrames:
    """zstd frames one after another, decompressed as they are read; data that ends inside a
    frame is truncated.

    Not ``zstandard``'s stream reader: at the end of its input it ends quietly inside a frame,
    so a shard cut inside its last frame's checksum (every content byte there, the check gone),
    or inside a frame's data at a tar block boundary, read as whole. Each frame here goes
    through a decompression object of its own, which says when its frame has ended (checksum
    checked, if the frame has one)."""

    def __init__(self, source: Any, decompressor: Any) -> None:
        self._source = source
        self._decompressor = decompressor
        self._frame = decompressor.decompressobj()
        self._in_frame = False  # bytes fed to the current frame, and its end not reached
        self._ready = bytearray()

    def read(self, size: int = -1) -> bytes:
        while (size < 0 or len(self._ready) < size) and self._decompress_more():
            pass
        if size < 0:
            size = len(self._ready)
        data = bytes(self._ready[:size])
        del self._ready[:size]
        return data

    def _decompress_more(self) -> bool:
        """Decompress the next chunk of input; False at the end of the input."""
        chunk = self._source.read(_ZSTD_CHUNK_BYTES)
        if not chunk:
            if self._in_frame:
                raise TarFormatError("truncated: the zstd data ends inside a frame")
            return False
        while chunk:
            self._in_frame = True
            self._ready += self._frame.decompress(chunk)
            if not self._frame.eof:
                break
            chunk = self._frame.unused_data  # the next frame's first bytes
            self._frame = self._decompressor.decompressobj()
            self._in_frame = False
        return True


_SKIP_CHUNK_BYTES = 1 << 20
# Members kept for links to them: a link's target is read before it, and the files tar links
# in shards are small (a label, a caption written once for several samples).
LINK_TARGET_BYTES = 64 << 10
LINK_TARGETS_KEPT_BYTES = 4 << 20
# The most zeros read as an archive's padding after its end-of-archive marker: tar pads to
# whole records, 10 KiB by default (Python's tarfile and WebDataset's writers too), up to a few
# MiB at the largest blocking factors GNU tar takes. More is a file written only in part (a
# preallocated shard cut short); a shorter zeroed tail cannot be told from padding.
MAX_PADDING_BYTES = 16 << 20
# Tar's default record (blocking factor 20): tar, Python's tarfile and WebDataset's writers pad an
# archive to whole records after its end-of-archive marker, so an archive joined after another
# (`cat a.tar b.tar`) begins on the record boundary after the first one's marker. Anything else
# after zeros cannot be told from a stretch zeroed on disk: archives written with other records
# (tar -b 40, -b 1) or the marker alone (Go's and Rust's writers), and empty archives joined in
# (10 KiB of zeros each), are refused: an error, never a silent loss.
RECORD_BYTES = 20 * BLOCK_BYTES
_ZSTD_CHUNK_BYTES = 1 << 17
_MAX_READ_BYTES = 1 << 26


class TarFormatError(tarfile.ReadError):
    """The bytes are not a whole, valid tar archive (truncated or corrupt)."""


class LinkLeftOutWarning(UserWarning):
    """A tar member that links to data not at hand (out of the archive, or read before a
    resumed position in a stream that cannot be read again) was left out."""


def _origin(stream: Any) -> int | None:
    """Where an uncompressed archive begins in its local, seekable stream (None otherwise, and
    for a stream that transforms what it reads, whose ``fileno()`` reads other bytes)."""
    rest = getattr(stream, "_rest", None)
    if not isinstance(stream, _Prefixed) or rest is None or not is_plain_file(rest):
        return None
    try:
        if not rest.seekable():
            return None
        rest.fileno()
        return rest.tell() - len(stream._prefix)
    except (AttributeError, OSError, ValueError, io.UnsupportedOperation):
        return None


class TarReader:
    """The regular files of one tar archive, in order, from an already-decompressed stream.

    ``last_member``, ``in_member`` and ``members_read`` say where reading got to, for errors.
    Used by one run only.
    """

    def __init__(self, stream: Any) -> None:
        self._stream = stream
        self.offset = 0  # bytes consumed
        self.last_member: str | None = None  # the last header read
        self.in_member = False  # reading that member's data, not a header
        self.members_read = 0
        self.member_started_at = 0  # where the headers of the last member read begin
        self._kept: dict[str, bytes] = {}  # small members, for links to them (_keep_for_links)
        self._kept_bytes = 0
        self._places: dict[str, tuple[int, int]] = {}  # member -> (data offset, size)
        self.resumed = False  # moved to a checkpoint's position: earlier members were not read
        self._skipping = False  # moving there: headers read, large data sought past
        self._origin = _origin(stream)  # where the archive begins in a seekable local stream

    def next_member(self) -> tuple[str, bytes] | None:
        """``(name, data)`` of the next regular file; None at the end-of-archive marker.

        Raises:
            TarFormatError: the archive is truncated or a header is corrupt.
        """
        pax: dict[str, str] = {}
        long_name: str | None = None
        long_link: str | None = None
        started_at = self.offset
        while True:
            header_at = self.offset
            block = self._read_exactly(BLOCK_BYTES)
            if block == _ZERO_BLOCK:
                following = self._after_the_marker(header_at)
                if following is None:
                    return None
                header_at, block = self.offset - BLOCK_BYTES, following  # archives joined end to end
            self._check_header(block, header_at)
            kind = block[156:157]
            size = _number(block[124:136], header_at)
            if "size" in pax:
                size = _pax_size(pax["size"], size, header_at)
            if long_name is not None:
                _check_long_name(long_name, block, header_at)
            name = pax.get("path") or long_name or _ustar_name(block)
            if any(key.startswith(_SPARSE_PAX_KEYS) for key in pax):
                # tar --sparse --format=pax: the member's data is the file's non-hole parts (with
                # its map in front from format 1.0 on), under a made-up name from 0.1 on; read
                # as a regular file it gave those bytes for the file's, silently.
                raise TarFormatError(f"member {pax.get('GNU.sparse.name', name)!r} is a GNU sparse "
                                     "file (pax format), which is not supported")
            if kind == _MULTIVOLUME_TYPE:
                raise TarFormatError(f"member {name!r} continues a file from another volume of a "
                                     "multi-volume archive, which is not supported")
            if kind in _REGULAR_TYPES or kind not in _OTHER_KNOWN_TYPES:
                self.last_member, self.in_member = name, True
                data = self._read_data(size)
                self.in_member = False
                self._keep_for_links(name, data, size)
                return self._member_read(name, data, started_at)
            if kind in _LINK_TYPES:
                target = pax.get("linkpath") or long_link or _ustar_text(block[157:257])
                data = self._linked_data(name, target, kind)
                self._read_data(size)  # a link has no data of its own; padding if any
                if data is not None:
                    self.last_member = name
                    return self._member_read(name, data, started_at)
                self.last_member = name  # a symbolic link out of the archive: nothing to yield
                pax, long_name, long_link = {}, None, None
                continue
            if kind == _GNU_SPARSE:
                raise TarFormatError(f"member {name!r} is a GNU sparse file, which is not supported")
            extension = self._read_data(size)
            pax, long_name, long_link = {}, None, None  # they describe the very next header only
            if kind in (_PAX_TYPE, _SOLARIS_PAX_TYPE):
                pax = _pax_records(extension, header_at)
            elif kind == _GNU_LONG_NAME:
                long_name = extension.rstrip(b"\0").decode("utf-8", "surrogateescape")
            elif kind == _GNU_LONG_LINK:
                long_link = extension.rstrip(b"\0").decode("utf-8", "surrogateescape")
            elif kind != _PAX_GLOBAL_TYPE:
                self.last_member = name  # a directory, a device: nothing to yield

    def _member_read(self, name: str, data: bytes, started_at: int) -> tuple[str, bytes]:
        self.members_read += 1
        self.member_started_at = started_at
        return name, data

    def _keep_for_links(self, name: str, data: bytes, size: int) -> None:
        """Keep where a member's data lies, for links to it later in the archive; and, where the
        stream cannot be read again (compressed, remote), a small member's data itself
        (``LINK_TARGET_BYTES`` each, ``LINK_TARGETS_KEPT_BYTES`` in all)."""
        self._places[_link_key(name)] = (self.offset - (-size % BLOCK_BYTES) - size, size)
        if self._origin is not None:
            return  # a local uncompressed archive: read again where it lies, if ever linked to
        if len(data) == size <= LINK_TARGET_BYTES and self._kept_bytes + size <= LINK_TARGETS_KEPT_BYTES:
            self._kept[_link_key(name)] = data
            self._kept_bytes += len(data)

    def _read_again(self, target: str) -> bytes | None:
        """A member's data read again from where it lies, in a local uncompressed archive (None
        where the stream cannot be read at a position)."""
        place = self._places.get(target)
        stream = self._stream
        rest = getattr(stream, "_rest", None)
        if place is None or rest is None or self._origin is None:
            return None
        try:
            fd = rest.fileno()
        except (AttributeError, OSError, ValueError, io.UnsupportedOperation):
            return None
        data = os.pread(fd, place[1], self._origin + place[0])
        return data if len(data) == place[1] else None

    def _linked_data(self, name: str, target: str, kind: bytes) -> bytes | None:
        """The data of a link's target, read earlier in this archive: a hard link is how tar
        (and Python's tarfile) stores a second name of a file, the sample's member all the
        same. Left out, that sample came without it, and nothing said so. Kept when small,
        else read again where the archive is a local uncompressed file; else (and for a
        symbolic link out of the archive) the link is left out, with a warning."""
        if self._skipping:
            return b""  # handed out before the checkpoint: counted, not made again
        if kind == _SYMLINK_TYPE and not target.startswith("/"):
            target = posixpath.normpath(posixpath.join(posixpath.dirname(name), target))
        key = _link_key(target)
        data = self._kept.get(key)
        if data is None:
            data = self._read_again(key)
        if data is None:
            what = "a hard link" if kind == _HARDLINK_TYPE else "a symbolic link"
            if key in self._places:
                where = (f"over the {LINK_TARGET_BYTES >> 10} KiB kept for links, in a stream that "
                         "cannot be read again (compressed, or remote)")
            elif self.resumed:
                where = "before the position this run resumed from"
            else:
                where = "not in this archive"
            warnings.warn(f"pipeload: tar member {name!r} is {what} to {target!r}, whose data is "
                          f"{where}: the member is left out", LinkLeftOutWarning, stacklevel=2)
        return data

    @property
    def compressed(self) -> bool:
        """Whether the archive is read through a decompressor (which checks its checksum only
        at the end of the stream)."""
        return not isinstance(self._stream, _Prefixed)

    def _after_the_marker(self, marker_at: int) -> bytes | None:
        """Read on past the zero block at ``marker_at``: None at the end of the data (zeros
        alone followed: the archive's end, and its padding), or the header of another archive
        joined after this one (``cat a.tar b.tar``; GNU tar reads on with ``-i``), where it can
        only be: on the record boundary after this one's marker (``RECORD_BYTES``).

        A zero block is not believed at once: a header zeroed on disk (a lone zero block, as
        GNU tar warns of it) ended the shard there, and every member after it vanished without
        a word. And only at the end of compressed data does the decompressor check its checksum
        (gzip's CRC-32 and length, bzip2's stream CRC): a flipped bit that still decompresses,
        or a cut-off trailer, is otherwise delivered without a word. Costs the archive's zero
        padding.

        Raises:
            TarFormatError: a lone zero block before more members, zeros then a header
                anywhere but there (a stretch zeroed on disk), data after the marker that is no
                header, or more zeros than any writer pads with (``MAX_PADDING_BYTES``: a file
                preallocated and written only in part).
        """
        zeros = BLOCK_BYTES
        while True:
            block = self._stream.read(BLOCK_BYTES)
            if not block or (len(block) < BLOCK_BYTES and not block.strip(b"\0")):
                return None  # the end (a tail short of a block, zeros alone, is padding too)
            if len(block) < BLOCK_BYTES:
                raise TarFormatError(f"truncated: {len(block)} bytes of data after the end-of-archive "
                                     f"marker at byte {marker_at}")
            self.offset += BLOCK_BYTES
            if block == _ZERO_BLOCK:
                zeros += BLOCK_BYTES
                if zeros > MAX_PADDING_BYTES:
                    raise TarFormatError(
                        f"truncated: more than {MAX_PADDING_BYTES >> 20} MiB of zeros follow the "
                        f"end-of-archive marker at byte {marker_at}, more than any writer pads "
                        "with: a file written only in part (preallocated, then cut short)")
                continue
            at = self.offset - BLOCK_BYTES
            if zeros == BLOCK_BYTES:
                raise TarFormatError(
                    f"corrupt: a lone zero block at byte {marker_at}, with a header after it (at byte "
                    f"{at}): a header was zeroed, and the member it began would be lost")
            joined_at = -(-(marker_at + 2 * BLOCK_BYTES) // RECORD_BYTES) * RECORD_BYTES
            if at != joined_at:
                # A stretch zeroed on disk (a page, a hole a crash left) looks like a marker
                # followed by another archive; read on, the members it held vanished silently.
                # An archive joined after this one begins where tar's padding of it ends: the
                # record boundary after its marker, and nowhere else (allowing any boundary
                # read 16 KiB holes as joins 6 times in 70, against once).
                raise TarFormatError(
                    f"corrupt: {zeros // BLOCK_BYTES} zero blocks at byte {marker_at}, then a header "
                    f"at byte {at}: a stretch was zeroed, and the members it held would be lost (an "
                    f"archive joined after this one, as `cat a.tar b.tar` makes, would begin where "
                    f"tar's padding to {RECORD_BYTES // 1024} KiB records ends, at byte {joined_at})")
            try:
                self._check_header(block, at)
            except TarFormatError:
                raise TarFormatError(
                    f"corrupt: data that is no tar header follows the end-of-archive marker at byte "
                    f"{marker_at} (at byte {at})") from None
            return block

    def move_to(self, offset: int, members_read: int) -> None:
        """Continue from ``offset`` bytes into the archive (a member boundary, as a checkpoint
        recorded it), having read ``members_read`` files. The headers up to there are read, so
        that links after it find their targets (``_keep_for_links``); the data of members too
        large to keep is sought past where the stream can seek, else read and dropped.

        Raises:
            TarFormatError: the archive ends before ``offset``, or ``offset`` is no member
                boundary in it.
        """
        self.resumed = True
        self._skipping = True
        try:
            while self.offset < offset:
                if self.next_member() is None:
                    raise TarFormatError(f"truncated: the archive ends at byte {self.offset}, before "
                                         f"the checkpoint's position (byte {offset})")
        finally:
            self._skipping = False
        if self.offset != offset:
            raise TarFormatError(f"corrupt: byte {offset}, where the checkpoint resumes, is not "
                                 f"where a member begins in this archive (one begins at {self.offset})")
        self.members_read = members_read

    def _read_exactly(self, size: int) -> bytes:
        # Bounded reads: a file object's read(n) reserves n bytes first, and the size comes from
        # a header, which a cut-off shard may promise far past its end.
        data = self._stream.read(min(size, _MAX_READ_BYTES))
        if len(data) < size:
            data = self._read_rest(data, size)
        self.offset += len(data)
        if len(data) < size:
            if self.in_member:
                raise TarFormatError(f"truncated: the data ends {len(data)} of {size} bytes into the member")
            if not data:
                raise TarFormatError("truncated: the data ends without an end-of-archive marker")
            raise TarFormatError(f"truncated: the data ends {len(data)} bytes into a header")
        return data

    def _read_rest(self, start: bytes, size: int) -> bytes:
        """``start`` and what follows it, up to ``size`` bytes or the end of the data."""
        pieces, got = [start], len(start)
        while got < size:
            piece = self._stream.read(min(size - got, _MAX_READ_BYTES))
            if not piece:
                break
            pieces.append(piece)
            got += len(piece)
        return b"".join(pieces)

    def _read_data(self, size: int) -> bytes:
        if self._skipping and size > LINK_TARGET_BYTES and self._can_seek():
            self._stream._rest.seek(size + -size % BLOCK_BYTES, io.SEEK_CUR)  # moving to a checkpoint
            self.offset += size + -size % BLOCK_BYTES
            return b""
        data = self._read_exactly(size)
        self._read_exactly(-size % BLOCK_BYTES)  # members are padded to whole blocks
        return data

    def _can_seek(self) -> bool:
        """Whether the data can be sought past: an uncompressed archive in a seekable stream,
        its first bytes already read."""
        stream = self._stream
        if not isinstance(stream, _Prefixed) or stream._prefix:
            return False
        seekable = getattr(stream._rest, "seekable", None)
        return callable(seekable) and seekable()

    @staticmethod
    def _check_header(block: bytes, header_at: int) -> None:
        stored = _number(block[_CHECKSUM_FIELD], header_at)
        unsigned = sum(block) - sum(block[_CHECKSUM_FIELD]) + _CHECKSUM_SPACES
        if stored == unsigned:
            return
        # Some old writers summed signed bytes; tarfile accepts both, and so do we.
        high_bytes = sum(1 for byte in block if byte > 127) - sum(1 for byte in block[_CHECKSUM_FIELD] if byte > 127)
        if stored != unsigned - 256 * high_bytes:
            raise TarFormatError(f"corrupt: the header at byte {header_at} is not a valid tar header "
                                 "(its checksum does not match)")


def _link_key(name: str) -> str:
    """A member's name as links find it: ``tar -C dir -cf x.tar .`` names ``./a.txt``, and a
    symbolic link beside it points to ``a.txt`` (it was left out, its target "not in this
    archive")."""
    return posixpath.normpath(name)


def _number(field: bytes, header_at: int) -> int:
    if field and field[0] & 0x80:  # GNU base-256, for sizes past 8 GiB
        return int.from_bytes(field[1:], "big")
    text = field.split(b"\0", 1)[0].strip()
    try:
        return int(text, 8) if text else 0
    except ValueError:
        raise TarFormatError(f"corrupt: the header at byte {header_at} is not a valid tar header "
                             f"(number field {field!r})") from None


def _ustar_name(block: bytes) -> str:
    name = block[:100].split(b"\0", 1)[0]
    if block[257:265] == _POSIX_USTAR_MAGIC:
        prefix = block[345:500].split(b"\0", 1)[0]
        if prefix:
            name = prefix + b"/" + name
    return name.decode("utf-8", "surrogateescape")


def _ustar_text(field: bytes) -> str:
    """A header's text field (a link's target), up to its first NUL."""
    return field.split(b"\0", 1)[0].decode("utf-8", "surrogateescape")


def _pax_records(data: bytes, header_at: int) -> dict[str, str]:
    """``"<length> <key>=<value>\\n"`` records, as pax extended headers hold them. No checksum
    covers them: a record whose length, separator or end does not fit is corrupt."""
    records = {}
    position = 0
    while position < len(data) and data[position:position + 1] != b"\0":
        space = data.find(b" ", position, position + 20)
        digits = data[position:space] if space > position else b""
        length = int(digits) if digits.isdigit() else 0
        end = position + length
        if length <= space - position + 1 or end > len(data) or data[end - 1:end] != b"\n" or b"=" not in data[space:end]:
            raise TarFormatError(f"corrupt: the pax header at byte {header_at} has a malformed record "
                                 f"at byte {position} of it")
        key, _, value = data[space + 1:end - 1].partition(b"=")
        records[key.decode("utf-8", "surrogateescape")] = value.decode("utf-8", "surrogateescape")
        position = end
    return records


def _pax_size(value: str, header_size: int, header_at: int) -> int:
    """A member's size from its pax ``size`` record. Writers put a size there only where the
    header's field cannot hold it, leaving that field 0; a record that disagrees with a size the
    header holds (covered by its checksum) is damage."""
    size = int(value) if value.isdigit() else -1
    if size < 0 or (header_size and size != header_size):
        raise TarFormatError(f"corrupt: the member at byte {header_at} has a pax size {value!r} that "
                             f"does not agree with its header's ({header_size})")
    return size


def _check_long_name(long_name: str, block: bytes, header_at: int) -> None:
    """A GNU long name (no checksum covers it) must begin with the first 100 bytes of the name
    that tar and Python's tarfile also write in the member's own header (which one does)."""
    start = block[:100].split(b"\0", 1)[0]
    if start and not long_name.encode("utf-8", "surrogateescape").startswith(start):
        raise TarFormatError(f"corrupt: the long name before the header at byte {header_at} does not "
                             f"begin with the name in that header ({start[:40]!r}...)")
