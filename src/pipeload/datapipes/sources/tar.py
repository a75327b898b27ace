"""``load_from_tar``: the members of tar archives, streamed (.tar, .tar.gz, .tar.bz2, .tar.xz, .tar.zst)."""

from __future__ import annotations

import collections
import dataclasses
import io
import os
import tarfile
from collections.abc import Iterator
from typing import IO, Any

from pipeload._state_fields import StateFields
from pipeload.datapipes.base import IterDataPipe
from pipeload.datapipes.iter._columns import no_length
from pipeload.datapipes.protocol import PipeIterator
from pipeload.datapipes.sources import _storage, _tar_stream, _versions
from pipeload.datapipes.sources._checks import check_length
from pipeload.datapipes.sources._versions import ObjectVersion
from pipeload.datapipes.sources.errors import ArchiveError, SourceChangedError, SourceError, describe_failure
from pipeload.datapipes.sources.on_error import FILE, ErrorPolicyMixin, FailureHandler, OnError, check_policy
from pipeload.errors import bad_state_field

# Errors that mean "these bytes are not a good archive", as opposed to "the bytes did not come".
_DATA_ERROR_NAMES = frozenset({"ZstdError", "BadGzipFile", "error", "LZMAError"})
_BZIP2_BAD_DATA = "Invalid data stream"  # bzip2 says so with a plain OSError


class ArchiveOutcome:
    """How one reading of an archive ended, shared by the members it yielded: ``failed`` turns
    True when the rest of the archive was given up (``on_error``), before anything after it is
    yielded, so that a sample those members began can be dropped as cut short (``webdataset``)."""

    __slots__ = ("failed",)

    def __init__(self) -> None:
        self.failed = False


class ArchiveMember(tuple):
    """One archive member as ``(path, data)``: ``path`` is ``"<archive url>/<member name>"``.

    ``archive`` and ``name`` keep the two parts apart (``webdataset`` groups by them);
    ``outcome`` is how the reading it came from ended (None once pickled); ``index`` is the
    member's number among its archive's regular files, from 0 (None: not known), which tells
    ``webdataset`` where a new reading of an archive begins even after pickling.
    """

    archive: str
    name: str
    outcome: ArchiveOutcome | None
    index: int | None

    def __new__(cls, archive: str, name: str, data: bytes,
                outcome: ArchiveOutcome | None = None, index: int | None = None) -> ArchiveMember:
        member = super().__new__(cls, (f"{archive}/{name}", data))
        member.archive = archive
        member.name = name
        member.outcome = outcome
        member.index = index
        return member

    def __getnewargs__(self) -> tuple[str, str, bytes]:  # type: ignore[override]
        return self.archive, self.name, self[1]

    def __reduce__(self) -> Any:
        return (ArchiveMember, (self.archive, self.name, self[1], None, self.index))


class TarArchiveLoader(IterDataPipe[ArchiveMember], ErrorPolicyMixin):
    """Stream the regular files of tar archives, without extracting them (functional name:
    ``load_from_tar``).

    Takes ``(url, binary stream)`` pairs (``open_files(mode="b")`` makes them) and yields one
    ``(url/member, bytes)`` pair per regular file, in archive order, closing each stream when
    its archive ends. Compression is recognised from the data: gzip, bzip2, xz, and zstd (with
    the ``zstandard`` package). A truncated or corrupt archive raises :class:`ArchiveError`
    naming the archive and the member where it broke, or is handled by ``on_error``: the members
    read before the damage have been yielded, the rest of that archive is skipped (one failure).

    A compressed archive's checksum covers the whole stream and is checked at its end, after its
    members were yielded: a flipped bit that still decompresses is found only then. With
    ``hold_until_checked=True`` no member of a compressed archive is yielded before the check
    passed (the archive's members are held in memory meanwhile); otherwise they stream, and a
    failed check names how many were already delivered.

    Args:
        datapipe: yields ``(url, stream)`` pairs.
        mode: accepted for torchdata compatibility (``"r:*"``); compression is always detected.
        length: what ``len()`` reports (-1: no length).
        on_error, max_failures: see ``pipeload.datapipes.sources.on_error``.
        hold_until_checked: hold each compressed archive's members until its checksum passed.

    Example:
        >>> for path, data in FileLister("shards", "*.tar").open_files(mode="b").load_from_tar():
        ...     ...
    """

    _parent_fields = ("datapipe",)

    def __init__(self, datapipe: IterDataPipe[tuple[str, IO[bytes]]], mode: str = "r:*", length: int = -1,
                 *, on_error: OnError = "raise", max_failures: int | None = None,
                 hold_until_checked: bool = False) -> None:
        _check_loader_arguments(mode, length, hold_until_checked)
        check_policy(on_error, max_failures, "TarArchiveLoader")
        self.datapipe = datapipe
        self.mode = mode
        self.length = length
        self.on_error = on_error
        self.max_failures = max_failures
        self.hold_until_checked = hold_until_checked

    def __iter__(self) -> Iterator[ArchiveMember]:
        return _TarIterator(self.datapipe, self._failure_handler("load_from_tar", "the rest of the archive", FILE),
                            self.hold_until_checked)

    def __len__(self) -> int:
        if self.length == -1:
            raise no_length(self)
        return self.length


def _check_loader_arguments(mode: Any, length: Any, hold_until_checked: Any) -> None:
    """Refuse, where the pipe is built, arguments the first archive would trip on (or, for
    ``hold_until_checked="no"``, take as true), naming them."""
    if not isinstance(mode, str):
        raise TypeError(f"TarArchiveLoader: mode must be a str such as 'r:*', got mode={mode!r}")
    if not mode.startswith("r"):
        raise ValueError(f"TarArchiveLoader only reads archives: mode must start with 'r', got mode={mode!r}")
    check_length(length, "TarArchiveLoader")
    if not isinstance(hold_until_checked, bool):
        raise TypeError(f"TarArchiveLoader: hold_until_checked must be True or False, got "
                        f"hold_until_checked={hold_until_checked!r} ({type(hold_until_checked).__name__})")


class _OpenArchive:
    """One archive being read: its stream, the reader over its bytes and how the reading ends.
    Owned by one run.

    Holding (a compressed archive under ``hold_until_checked``): every member is read, and the
    stream checked to its end, before the first is handed out; ``position`` is then where the
    next member to hand out begins, as a checkpoint needs it.
    """

    def __init__(self, url: str, stream: IO[bytes], hold: bool) -> None:
        self.url = url
        self.stream = stream
        self.version = _versions.stream_version(stream)  # what a checkpoint resumes only on
        # A local file is read through the OS: rewritten in place while it is read, its new
        # bytes follow the old ones already buffered (remote reads are pinned to a version).
        self._local_fd = stream.fileno() if self.version is not None and self.version.mtime_ns is not None else None
        # Only a plain file's bytes can be compared with the file's (a text stream is refused
        # by name below; a gzip.open() stream's fileno() is the compressed file's).
        plain = self._local_fd is not None and _versions.is_plain_file(stream)
        self._digest = _versions.ReadDigest(stream) if plain else None
        self.reader = _tar_stream.TarReader(_tar_stream.decompressed(self._digest or stream))
        self.outcome = ArchiveOutcome()
        self._held: collections.deque[tuple[ArchiveMember, tuple[int, int]]] | None = None
        self._hold = hold and self.reader.compressed
        self._position = (0, 0)  # holding: where the next member to hand out begins
        self._last_at = (0, 0)  # holding: where the last member handed out began
        self._handed_out = 0  # members of it handed out (streaming), a resumed run's earlier ones too

    def next_member(self) -> ArchiveMember | None:
        """The next regular file, or None at a clean end; raises at a broken one."""
        if self._hold:
            return self._next_held()
        found = self.reader.next_member()
        if found is None:
            return None
        self._check_unchanged()
        self._handed_out = self.reader.members_read
        return ArchiveMember(self.url, found[0], found[1], self.outcome, self.reader.members_read - 1)

    def _check_unchanged(self) -> None:
        """Raise SourceChangedError if a local archive changed since it was opened: checked after
        each member is read and before it is handed out, so a member read across a rewrite never
        goes out (one fstat, about a microsecond).

        A new length or modification time is a change. A new status-change time alone is also
        what a rewrite whose modification time was set back leaves (``cp -p``, ``rsync
        --inplace -t``), but equally a ``chmod``, a new hard link, or the file replaced by a
        rename (the open one then has no name left, and its bytes stay): the content tells
        them apart, once per such change. The bytes read so far are read again and compared
        with their running CRC-32 (``ReadDigest``), and the fingerprint's 64 KiB at each end:
        a rewrite confined to the middle, past the fingerprint, went through before. Bytes not
        read yet are the file's as it is now, the same version as those read."""
        if self._local_fd is None:
            return
        status = os.fstat(self._local_fd)
        version = self.version
        assert version is not None
        if status.st_mtime_ns != version.mtime_ns or status.st_size != version.size:
            _versions.check_unchanged(self.url, version, _versions.local_status(status))
        elif status.st_ctime_ns != version.ctime_ns:
            if status.st_nlink:  # a file replaced by a rename keeps its bytes for this reader
                content = _versions.local_fingerprint(self._local_fd, status.st_size)
                _versions.check_unchanged(self.url, version, dataclasses.replace(version, content=content))
                if self._digest is not None and not self._digest.read_unchanged():
                    raise _versions.changed_error(
                        self.url, "the bytes already read differ from the file's now: rewritten in "
                        "place with its modification time set back")
            self.version = dataclasses.replace(version, ctime_ns=status.st_ctime_ns)

    def _next_held(self) -> ArchiveMember | None:
        if self._held is None:
            self._position = (self.reader.offset, self.reader.members_read)
            held = collections.deque()
            while (found := self.reader.next_member()) is not None:
                self._check_unchanged()
                member = ArchiveMember(self.url, found[0], found[1], self.outcome, self.reader.members_read - 1)
                held.append((member, (self.reader.offset, self.reader.members_read)))
            self._held = held  # the whole stream read and its checksum checked
        if not self._held:
            return None
        self._last_at = self._position
        member, self._position = self._held.popleft()
        return member

    def move_to(self, offset: int, members_read: int) -> None:
        """Resume at a checkpoint's position; the members before it were handed out then."""
        self.reader.move_to(offset, members_read)
        self._handed_out = members_read

    def position(self) -> tuple[int, int]:
        """(bytes into the decompressed archive, members read) where the next member begins."""
        if self._held is None:  # nothing read ahead of what was handed out
            return self.reader.offset, self.reader.members_read
        return self._position

    def last_member_at(self) -> tuple[int, int]:
        """(bytes, members read) where the member handed out last begins: a checkpoint that
        hands it out again."""
        if self._held is None:
            return self.reader.member_started_at, self.reader.members_read - 1
        return self._last_at

    def delivered_unchecked(self) -> int:
        """Members handed out before a compressed archive's checksum was checked."""
        if not self.reader.compressed or self._hold:
            return 0
        # Counted as handed out: the reader's count leaves out a member whose data broke off
        # (so less one for it said one member fewer than went out, -1 for none) and counts one
        # read but refused before it went out (changed meanwhile).
        return self._handed_out

    def where(self) -> str:
        """Where in the archive reading stopped, in words."""
        reader = self.reader
        if reader.last_member is None:
            return "at its first header" if reader.members_read == 0 and reader.offset <= 512 else (
                f"at byte {reader.offset}")
        if reader.in_member:
            return f"in member {reader.last_member!r} (file {reader.members_read + 1})"
        return f"after member {reader.last_member!r} ({reader.members_read} files read)"

    @property
    def last_member(self) -> str | None:
        return self.reader.last_member

    def close(self) -> None:
        self.stream.close()


class _TarIterator(PipeIterator[ArchiveMember]):
    """Reads the archives its upstream opens, member by member.

    Its checkpoint is where the current archive came from (the upstream's state taken just
    before it was opened: loading that opens the same archive again) and how far into the
    archive's (decompressed) bytes reading got. Resuming seeks there in an uncompressed archive
    whose stream can seek, and reads up to there otherwise (a compressed stream cannot jump).

    :meth:`state_before_last` is the checkpoint as it was before the latest member was handed
    out (``webdataset`` keeps it for the sample it is filling).
    """

    def __init__(self, source: Any, failures: FailureHandler, hold: bool = False) -> None:
        super().__init__(source)
        (self._archives,) = self.upstream
        self.failures = failures
        self._hold = hold
        self._current: _OpenArchive | None = None
        self._before_current: Any = None  # the upstream's state before the current archive
        # (bytes, members, URL or None, version or None) into the next archive, from a checkpoint
        self._resume_at: tuple[int, int, str | None, ObjectVersion | None] | None = None
        self._upstream_has_state: bool | None = None  # asked once, with the first archive

    def nonblocking_next(self) -> ArchiveMember:
        while True:
            if self._current is None:
                before = self._archives.state_dict() if self._tracks_state() else None
                url, stream = self._archives.nonblocking_next()
                self._current, self._before_current = self._open(url, stream), before
                if self._current is None:
                    continue
            try:
                member = self._current.next_member()
            except Exception as error:  # noqa: BLE001  (named, then the policy decides)
                self._give_up(error)
                continue
            if member is not None:
                return member
            self._close_current()

    def _tracks_state(self) -> bool:
        """Whether the upstream can say where it is (asked once: a plain iterator cannot)."""
        tracks = self._upstream_has_state
        if tracks is None:
            try:
                self._archives.state_dict()
                tracks = True
            except NotImplementedError:
                tracks = False
            self._upstream_has_state = tracks
        return tracks

    def state_dict(self) -> dict[str, Any]:
        if not self._tracks_state():
            raise NotImplementedError(
                f"load_from_tar's archives come from a source without a checkpoint "
                f"({type(self._archives).__name__}): it can only be resumed by skipping items")
        if self._current is None:
            return {"own": None, "upstream": [self._archives.state_dict()]}
        return {"own": self._own(self._current.position()), "upstream": [self._before_current]}

    def state_before_last(self) -> dict[str, Any]:
        """The checkpoint as it stood before the latest member was handed out (asked right
        after it, before the next): resuming from it hands that member out again."""
        if not self._tracks_state() or self._current is None:
            return self.state_dict()
        return {"own": self._own(self._current.last_member_at()), "upstream": [self._before_current]}

    def _own(self, at: tuple[int, int]) -> list[Any]:
        """[bytes, members read, the archive's URL, its version]: a resume that finds another
        archive there (the list of archives changed), or another version of it, must not carry
        on at that byte (see ``_versions.py``)."""
        assert self._current is not None
        return [*at, self._current.url, _versions.version_state(self._current.version)]

    def _check_own_state(self, fields: StateFields) -> Any:
        # [bytes, members, url, version] (a state of the previous form has neither: unchecked)
        expected = "None or [bytes into the archive, members read, the archive's URL, its version or None]"
        items = fields.sequence("own", expected, none=True)
        if items is None:
            return None  # between archives
        if len(items) not in (2, 4):
            raise bad_state_field(fields.name("own"), items, expected)
        own = fields.listed("own", expected)
        assert own is not None
        offset = own.integer(0)
        # a checkpoint is taken between members, on a 512-byte block, each member a block or more
        if offset % _tar_stream.BLOCK_BYTES:
            raise bad_state_field(own.name(0), offset, f"a multiple of {_tar_stream.BLOCK_BYTES} (a tar block)")
        members = own.integer(1, 0, offset // _tar_stream.BLOCK_BYTES)
        url = version = None
        if len(items) == 4:
            url = own.raw(2, "the archive's URL (text)")
            if not isinstance(url, str):
                raise bad_state_field(own.name(2), url, "the archive's URL (text)")
            version = _read_version(own.fields(3, none=True))
        own.finish()
        return offset, members, url, version

    def _load_own_state(self, state: Any) -> None:
        self._resume_at = state

    def _open(self, url: str, stream: IO[bytes]) -> _OpenArchive | None:
        resume_at, self._resume_at = self._resume_at, None
        try:
            archive = _OpenArchive(url, stream, self._hold)
            if resume_at is not None:
                offset, members, saved_url, saved = resume_at
                if saved_url is not None:
                    _check_same_archive(url, saved_url, offset)
                if saved is not None:
                    _versions.check_unchanged_since_checkpoint(url, saved, archive.version, offset)
                archive.move_to(offset, members)
            return archive
        except Exception as error:  # noqa: BLE001
            stream.close()
            if isinstance(error, (TypeError, ImportError)):
                raise  # the pipeline is built wrong: no policy can help
            self.failures.handle(_named(error, url, "at its first header"), self.failures.site(url))
            return None

    def _give_up(self, error: Exception) -> None:
        archive, self._current = self._current, None
        assert archive is not None
        _close_quietly(archive)
        archive.outcome.failed = True  # before anything after it is yielded (see ArchiveOutcome)
        named = _named(error, archive.url, archive.where(), archive.last_member)
        unchecked = archive.delivered_unchecked()
        if unchecked:
            named.add_note(f"pipeload: its {unchecked} members already delivered were not yet "
                           "checked against the archive's checksum; hold_until_checked=True holds "
                           "them back until it passes")
        self.failures.handle(named, self.failures.site(archive.url, archive.last_member))

    def _close_current(self) -> None:
        archive, self._current = self._current, None
        if archive is not None:
            archive.close()

    def close(self) -> None:
        if self._current is not None:
            _close_quietly(self._current)
            self._current = None
        super().close()


def _check_same_archive(url: str, saved_url: str, offset: int) -> None:
    """Refuse to resume at ``offset`` of an archive other than the one the checkpoint was taken
    in: the upstream replayed to another (a file added to, or removed from, the list before it).
    Compared by file name, so a dataset moved to another directory still resumes."""
    if _storage.file_name(url) != _storage.file_name(saved_url):
        raise SourceChangedError(
            f"resuming from the checkpoint opened {url!r}, but the checkpoint was taken {offset} "
            f"bytes into {saved_url!r}: the archives given changed since (one added, removed or "
            "renamed before it), so it is not read on from that byte of another archive", url)


def _read_version(fields: StateFields | None) -> ObjectVersion | None:
    """An archive's version as ``_versions.version_state`` wrote it in a checkpoint."""
    if fields is None:
        return None  # a stream that could not say which version it read
    found: dict[str, Any] = {}
    for field in dataclasses.fields(ObjectVersion):
        if field.name not in fields.state:
            continue
        if field.name in _versions.TEXT_FIELDS:
            value = fields.raw(field.name, "text")
            if not isinstance(value, str):
                raise bad_state_field(fields.name(field.name), value, "text")
            found[field.name] = value
        else:
            found[field.name] = fields.integer(field.name)
    fields.finish()
    return ObjectVersion(**found)


def _close_quietly(archive: _OpenArchive) -> None:
    try:
        archive.close()
    except Exception:  # noqa: BLE001  (already failing: the first error is the one to report)
        pass


def _named(error: Exception, url: str, where: str, member: str | None = None) -> Exception:
    """The error as an ArchiveError/SourceError naming the archive and where in it it broke."""
    if isinstance(error, SourceError):
        return error
    kind = ArchiveError if _is_bad_data(error) else SourceError
    message = f"cannot read tar archive {url!r} {where}: {describe_failure(error)}"
    named = kind(message, url, member)
    named.__cause__ = error
    return named


def _is_bad_data(error: Exception) -> bool:
    if isinstance(error, (tarfile.TarError, EOFError)) or type(error).__name__ in _DATA_ERROR_NAMES:
        return True
    return type(error) is OSError and str(error) == _BZIP2_BAD_DATA
