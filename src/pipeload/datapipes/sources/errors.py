"""The errors sources raise: each names the file or URL (and the archive member) it was reading."""

from __future__ import annotations


class SourceError(OSError):
    """A file or URL could not be opened or read (after any retries).

    Attributes:
        url: the file or URL (None in an error a worker raised: the loader rebuilds a worker's
            error in the main process from its type and message alone, and the message names it).
        member: the archive member being read, when there was one.

    The underlying error is the ``__cause__``.
    """

    def __init__(self, message: str, url: str | None = None, member: str | None = None) -> None:
        super().__init__(message)
        self.url = url
        self.member = member

    def __reduce__(self):  # type: ignore[no-untyped-def]  (crosses process boundaries whole)
        return (type(self), (self.args[0], self.url, self.member))

    def __str__(self) -> str:
        return str(self.args[0])


class ArchiveError(SourceError):
    """An archive is corrupt or truncated: names the archive and the member where it broke."""


class SampleGroupingError(ArchiveError, ValueError):
    """An archive's members do not make whole samples: a key whose members are not adjacent (it
    comes back after another key's), or one key with the same extension twice. A ``ValueError``
    too, as a repeated extension was before it was named an archive's fault."""


class SourceChangedError(SourceError):
    """A remote object changed while it was being read (another ETag, Last-Modified, length or
    version after a reconnect): carrying on would splice two versions' bytes, so the read stops."""


def describe_failure(error: BaseException) -> str:
    """``Type: message`` of an error, for messages that wrap it."""
    text = str(error)
    return f"{type(error).__name__}: {text}" if text else type(error).__name__
