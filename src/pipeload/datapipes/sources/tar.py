"""``load_from_tar``: the members of tar archives, streamed (.tar, .tar.gz, .tar.bz2, .tar.xz, .tar.zst)."""

from __future__ import annotations

import tarfile
from collections.abc import Iterator
from typing import IO, Any

from pipeload._state_fields import StateFields
from pipeload.datapipes.base import IterDataPipe
from pipeload.datapipes.iter._columns import no_length
from pipeload.datapipes.protocol import PipeIterator
from pipeload.datapipes.sources import _tar_stream
from pipeload.datapipes.sources.errors import ArchiveError, SourceError, describe_failure
from pipeload.datapipes.sources.on_error import ErrorPolicyMixin, FailureHandler, OnError, check_policy
from pipeload.errors import bad_state_field

# Errors that mean "these bytes are not a good archive", as opposed to "the bytes did not come".
_DATA_ERROR_NAMES = frozenset({"ZstdError", "BadGzipFile", "error", "LZMAError"})
_BZIP2_BAD_DATA = "Invalid data stream"  # bzip2 says so with a plain OSError


class ArchiveMember(tuple):
    """One archive member as ``(path, data)``: ``path`` is ``"<archive url>/<member name>"``.

    ``archive`` and ``name`` keep the two parts apart (``webdataset`` groups by them).
    """

    archive: str
    name: str

    def __new__(cls, archive: str, name: str, data: bytes) -> ArchiveMember:
        member = super().__new__(cls, (f"{archive}/{name}", data))
        member.archive = archive
        member.name = name
        return member

    def __getnewargs__(self) -> tuple[str, str, bytes]:  # type: ignore[override]
        return self.archive, self.name, self[1]

    def __reduce__(self) -> Any:
        return (ArchiveMember, (self.archive, self.name, self[1]))


class TarArchiveLoader(IterDataPipe[ArchiveMember], ErrorPolicyMixin):
    """Stream the regular files of tar archives, without extracting them (functional name:
    ``load_from_tar``).

    Takes ``(url, binary stream)`` pairs (``open_files(mode="b")`` makes them) and yields one
    ``(url/member, bytes)`` pair per regular file, in archive order, closing each stream when
    its archive ends. Compression is recognised from the data: gzip, bzip2, xz, and zstd (with
    the ``zstandard`` package). A truncated or corrupt archive raises :class:`ArchiveError`
    naming the archive and the member where it broke, or is handled by ``on_error``: the members
    read before the damage have been yielded, the rest of that archive is skipped (one failure).

    Args:
        datapipe: yields ``(url, stream)`` pairs.
        mode: accepted for torchdata compatibility (``"r:*"``); compression is always detected.
        length: what ``len()`` reports (-1: no length).
        on_error, max_failures: see ``pipeload.datapipes.sources.on_error``.

    Example:
        >>> for path, data in FileLister("shards", "*.tar").open_files(mode="b").load_from_tar():
        ...     ...
    """

    _parent_fields = ("datapipe",)

    def __init__(self, datapipe: IterDataPipe[tuple[str, IO[bytes]]], mode: str = "r:*", length: int = -1,
                 *, on_error: OnError = "raise", max_failures: int | None = None) -> None:
        if not mode.startswith("r"):
            raise ValueError(f"TarArchiveLoader only reads archives: mode must start with 'r', got mode={mode!r}")
        check_policy(on_error, max_failures, "TarArchiveLoader")
        self.datapipe = datapipe
        self.mode = mode
        self.length = length
        self.on_error = on_error
        self.max_failures = max_failures

    def __iter__(self) -> Iterator[ArchiveMember]:
        return _TarIterator(self.datapipe, self._failure_handler("load_from_tar", "the rest of the archive"))

    def __len__(self) -> int:
        if self.length == -1:
            raise no_length(self)
        return self.length


class _OpenArchive:
    """One archive being read: its stream and the reader over its bytes. Owned by one run."""

    def __init__(self, url: str, stream: IO[bytes]) -> None:
        self.url = url
        self.stream = stream
        self.reader = _tar_stream.TarReader(_tar_stream.decompressed(stream))

    def next_member(self) -> ArchiveMember | None:
        """The next regular file, or None at a clean end; raises at a broken one."""
        found = self.reader.next_member()
        return None if found is None else ArchiveMember(self.url, found[0], found[1])

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
    """

    def __init__(self, source: Any, failures: FailureHandler) -> None:
        super().__init__(source)
        (self._archives,) = self.upstream
        self.failures = failures
        self._current: _OpenArchive | None = None
        self._before_current: Any = None  # the upstream's state before the current archive
        self._resume_at: tuple[int, int] | None = None  # (bytes, members) into the next archive
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
                f"{type(self).__name__}'s archives come from a source without a checkpoint: it "
                "can only be resumed by skipping items")
        if self._current is None:
            return {"own": None, "upstream": [self._archives.state_dict()]}
        reader = self._current.reader
        return {"own": [reader.offset, reader.members_read], "upstream": [self._before_current]}

    def _check_own_state(self, fields: StateFields) -> Any:
        own = fields.listed("own", "None or [bytes into the archive, members read]", length=2, none=True)
        if own is None:
            return None  # between archives
        offset = own.integer(0)
        # a checkpoint is taken between members, on a 512-byte block, each member a block or more
        if offset % _tar_stream.BLOCK_BYTES:
            raise bad_state_field(own.name(0), offset, f"a multiple of {_tar_stream.BLOCK_BYTES} (a tar block)")
        return offset, own.integer(1, 0, offset // _tar_stream.BLOCK_BYTES)

    def _load_own_state(self, state: Any) -> None:
        self._resume_at = state

    def _open(self, url: str, stream: IO[bytes]) -> _OpenArchive | None:
        resume_at, self._resume_at = self._resume_at, None
        try:
            archive = _OpenArchive(url, stream)
            if resume_at is not None:
                archive.reader.move_to(*resume_at)
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
        named = _named(error, archive.url, archive.where(), archive.last_member)
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
