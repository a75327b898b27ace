"""The errors sources raise: each names the file or URL (and the archive member) it was reading."""

from __future__ import annotations

import re
from urllib.parse import parse_qsl, unquote, urlsplit

REDACTED = "***"
# Query parameters that carry secrets in signed or tokened URLs: S3's and GCS's presigned URLs
# (X-Amz-Signature, X-Amz-Credential, X-Amz-Security-Token, X-Goog-Signature), Azure SAS (sig),
# and the usual token/key/password names.
_SECRET_PARAMETER = re.compile(r"sig|signature|credential|token|secret|password|passwd|key|auth|session",
                               re.IGNORECASE)
_SHORTEST_SECRET = 4  # shorter values are replaced only where the whole URL is quoted


_URL_IN_TEXT = re.compile(r"[A-Za-z][A-Za-z0-9+.-]*://[^\s'\"<>]+")


def url_secrets(url: str) -> list[str]:
    """The secrets written into ``url``: the password of ``user:password@``, and the values of
    query parameters whose names say they are secrets. Both as written and percent-decoded. (A
    user name given alone, often a token, is hidden where the URL is shown, by ``redact_url``,
    not wherever its text appears: "data" in ``https://data@host/data/`` is no secret there.)"""
    if "://" not in url:  # a local path holds no secret
        return []
    try:
        parts = urlsplit(url)
        password = parts.password
        query = parse_qsl(parts.query, keep_blank_values=False)
    except ValueError:  # not a URL that parses: nothing recognisable to hide
        return []
    found = [password] if password else []
    found.extend(value for name, value in query if _SECRET_PARAMETER.search(name))
    variants = {form for secret in found for form in (secret, unquote(secret))}
    raw_query = parts.query.split("&")
    variants.update(item.split("=", 1)[1] for item in raw_query
                    if "=" in item and _SECRET_PARAMETER.search(item.split("=", 1)[0]))
    return sorted((v for v in variants if v), key=len, reverse=True)


def redact_url(url: str) -> str:
    """``url`` as an error message may show it: its secrets (``url_secrets``) replaced by ``***``.

    Example:
        >>> redact_url("https://u:pw@host/a.tar?X-Amz-Signature=abc123&part=1")
        'https://u:***@host/a.tar?X-Amz-Signature=***&part=1'
    """
    if not url_secrets(url) and not _user_alone(url):
        return url
    parts = urlsplit(url)
    netloc = parts.netloc
    if parts.password:
        user, _, host = netloc.rpartition("@")
        netloc = f"{user.split(':', 1)[0]}:{REDACTED}@{host}"
    elif parts.username:
        netloc = f"{REDACTED}@{netloc.rpartition('@')[2]}"
    query = "&".join(
        f"{item.split('=', 1)[0]}={REDACTED}" if "=" in item and _SECRET_PARAMETER.search(item.split("=", 1)[0])
        else item for item in parts.query.split("&")) if parts.query else ""
    return parts._replace(netloc=netloc, query=query).geturl()


def _user_alone(url: str) -> bool:
    """Whether ``url`` names a user with no password (``https://TOKEN@host``)."""
    if "://" not in url or "@" not in url:
        return False
    try:
        parts = urlsplit(url)
        return bool(parts.username) and not parts.password
    except ValueError:
        return False


def hide_url_secrets(text: str, url: str | None) -> str:
    """``text`` with ``url``, and every other URL written in it, shown redacted, and their
    secrets replaced wherever else they appear (a network library's own message names the URL
    its way, query string included). Other URLs too: a sample split across two presigned
    shards, or a checkpoint's archive, named a second URL with its signature (stop 54)."""
    urls = ([url] if url else []) + _URL_IN_TEXT.findall(text)
    for each in dict.fromkeys(urls):
        text = text.replace(each, redact_url(each))
        for secret in url_secrets(each):
            if len(secret) >= _SHORTEST_SECRET:
                text = text.replace(secret, REDACTED)
    return text


class SourceError(OSError):
    """A file or URL could not be opened or read (after any retries).

    Attributes:
        url: the file or URL (None in an error a worker raised: the loader rebuilds a worker's
            error in the main process from its type and message alone, and the message names it).
        member: the archive member being read, when there was one.

    The underlying error is the ``__cause__``. The message never shows a secret written into
    the URL (a password, a presigned URL's signature): it is ``***`` there (``redact_url``);
    ``url`` keeps the URL as given.
    """

    def __init__(self, message: str, url: str | None = None, member: str | None = None) -> None:
        super().__init__(hide_url_secrets(message, url))
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
    """``Type: message`` of an error, for messages that wrap it; with the error it was raised
    while handling, where it has one and says little itself (a library's own bug in its
    handler, over the timeout that matters), and how many attempts were made (pipeload's note,
    which the wrapping message would otherwise leave behind on its cause)."""
    words = _type_and_message(error)
    context = error.__cause__ or (None if error.__suppress_context__ else error.__context__)
    if context is not None and not isinstance(error, SourceError):
        words += f" (raised while handling {_type_and_message(context)})"
    attempts = [note[len("pipeload: "):] for note in getattr(error, "__notes__", ())
                if note.startswith("pipeload: gave up after")]
    return words + "".join(f"; {note}" for note in attempts)


def _type_and_message(error: BaseException) -> str:
    text = str(error)
    return f"{type(error).__name__}: {text}" if text else type(error).__name__
