"""Where bytes live: local paths through the operating system, anything else through fsspec.

fsspec (and s3fs for ``s3://``) is an optional extra, ``pip install pipeload[remote]``: the core
opens local files without it, and a remote URL without it fails with an error naming the extra.
Credentials and endpoints reach fsspec as its users pass them: a ``storage_options`` dict
(``{"key": ..., "secret": ..., "client_kwargs": {"endpoint_url": ...}}``), or the standard
environment variables (``AWS_ENDPOINT_URL``, ``AWS_ACCESS_KEY_ID``, ...), which process workers
inherit. fsspec resets its event loop and instance cache in a forked child, so a worker never
reuses the main process's connections.
"""

from __future__ import annotations

import errno
import fnmatch
import os
from collections.abc import Mapping
from typing import IO, Any

from pipeload.datapipes.sources import _versions
from pipeload.datapipes.sources._versions import ObjectVersion

REMOTE_EXTRA_HINT = "pip install 'pipeload[remote]' (fsspec, plus s3fs for s3://)"
LOCAL_PREFIX = "file://"
_SIZE_NOT_NEEDED = -1
# A remote read that brings no byte for this long has stalled: a transient failure (retried).
HTTP_STALL_S = 60.0
HTTP_CONNECT_S = 30.0  # aiohttp's own default for connecting


def is_local(url: str) -> bool:
    """Whether ``url`` names a local file: a plain path or a ``file://`` URL."""
    return "://" not in url or url.startswith(LOCAL_PREFIX)


def local_path(url: str) -> str:
    """The operating system's path for a local ``url``."""
    return url[len(LOCAL_PREFIX):] if url.startswith(LOCAL_PREFIX) else url


def fsspec_module(url: str) -> Any:
    """fsspec itself, or an ImportError naming the extra that brings it."""
    try:
        import fsspec
    except ImportError as error:
        raise ImportError(
            f"reading {url!r} needs fsspec, which is not installed: {REMOTE_EXTRA_HINT}"
        ) from error
    return fsspec


def filesystem(url: str, storage_options: Mapping[str, Any] | None) -> tuple[Any, str]:
    """The fsspec filesystem for ``url`` and the path inside it.

    Raises:
        ImportError: fsspec, or the protocol's own package (s3fs for ``s3://``), is missing.
    """
    fsspec = fsspec_module(url)
    options = dict(storage_options or {})
    try:
        if url.startswith(("http://", "https://")):
            options = _with_stall_timeout(options)  # imports aiohttp: inside, for the hint
        elif url.startswith(("s3://", "s3a://")):
            options = _with_one_botocore_attempt(options)
        return fsspec.core.url_to_fs(url, **options)
    except ImportError as error:
        raise ImportError(f"reading {url!r} needs a package that is not installed ({error}): "
                          f"{REMOTE_EXTRA_HINT}") from error


def _with_one_botocore_attempt(options: dict[str, Any]) -> dict[str, Any]:
    """s3 options whose botocore client tries each request once: s3fs retries a failed call
    itself, and the read around it retries as its ``RetryPolicy`` says. Botocore's own five
    attempts inside both made an endpoint that refuses connections take ~35 s to report
    (~3 s now). ``retries`` the user put in ``config_kwargs`` are kept."""
    config_kwargs = dict(options.get("config_kwargs") or {})
    if "retries" in config_kwargs:
        return options
    config_kwargs["retries"] = {"max_attempts": 1}
    return {**options, "config_kwargs": config_kwargs}


def _with_stall_timeout(options: dict[str, Any]) -> dict[str, Any]:
    """HTTP options whose session gives up on a read that brings nothing for ``HTTP_STALL_S``.

    aiohttp's default instead bounds the whole response at 300 s: a stalled server holds a read
    for five minutes per attempt, and a shard that takes longer than that to stream can never be
    read (each reconnect must read past the bytes already handed out, within the same 300 s).
    A ``timeout`` the user put in ``client_kwargs`` is kept.
    """
    client_kwargs = dict(options.get("client_kwargs") or {})
    if "timeout" in client_kwargs:
        return options
    import aiohttp

    client_kwargs["timeout"] = aiohttp.ClientTimeout(total=None, sock_connect=HTTP_CONNECT_S, sock_read=HTTP_STALL_S)
    return {**options, "client_kwargs": client_kwargs}


def load_implementations(urls: list[str]) -> None:
    """Import fsspec and the filesystem class of every remote protocol in ``urls`` now.

    Called where a pipe is built, in the main process: forked workers then start with them
    loaded, instead of each paying the import (aiohttp alone takes a third of a second) every
    epoch. Missing packages are left for the first open to report.
    """
    protocols = {url.split("://", 1)[0] for url in urls if not is_local(url)}
    if not protocols:
        return
    try:
        import fsspec

        for protocol in protocols:
            fsspec.get_filesystem_class(protocol)
    except (ImportError, ValueError):
        pass


def open_remote(url: str, storage_options: Mapping[str, Any] | None, position: int = 0,
                pinned: ObjectVersion | None = None) -> tuple[IO[bytes], ObjectVersion, int]:
    """Open a remote ``url`` for reading from byte ``position`` on, as the version ``pinned``
    (the first open's; None on the first open). Returns the file, the version it reads and the
    byte its data begins at (``position``, or 0 where the server sent the whole object).

    HTTP is opened as a plain stream (``block_size=0``): servers need not answer range requests,
    and a shard is read front to back anyway. A resumed HTTP read asks for the rest only while
    the object is ``pinned`` (``_versions.http_resume_headers``). Object stores (s3) read ahead
    in blocks; s3fs pins each file's reads to the ETag it opened.

    Raises:
        SourceChangedError: the object is no longer ``pinned``.
    """
    fs, path = filesystem(url, storage_options)
    if url.startswith(("http://", "https://")):
        return _open_http(fs, path, url, position, pinned)
    # What the store says now: a reopened read compares it with the first; a first read must
    # not pin the version a listing saw (an object replaced since, whole and consistent, was
    # refused as changed while it was read: s3fs pins its reads to the ETag it knows).
    fs.invalidate_cache(path)
    file = fs.open(path, "rb")
    try:
        version = _versions.details_version(getattr(file, "details", None))
        if pinned is not None:
            _versions.check_unchanged(url, pinned, version)
    except BaseException:
        file.close()
        raise
    return file, version, 0


def _open_http(fs: Any, path: str, url: str, position: int,
               pinned: ObjectVersion | None) -> tuple[IO[bytes], ObjectVersion, int]:
    # A stream needs no size; any size given keeps fsspec from asking the server for it first
    # (one more round trip per shard, and a whole GET where HEAD is not answered).
    # The bytes as stored, never a compressed representation: aiohttp does not notice a gzip body
    # cut short (no Content-Length, the connection closed: the file came back short, silently),
    # and a resumed read's Range counts the bytes as stored.
    headers = {**(getattr(fs, "kwargs", {}).get("headers") or {}), "Accept-Encoding": "identity"}
    if pinned is not None and position > 0:
        headers.update(_versions.http_resume_headers(pinned, position))
    options: dict[str, Any] = {"block_size": 0, "size": _SIZE_NOT_NEEDED, "headers": headers}
    try:
        file = fs.open(path, "rb", **options)
    except Exception as error:  # noqa: BLE001  (a refusal that says the object changed)
        refusal = _versions.http_refusal(url, getattr(error, "status", None))
        if pinned is not None and refusal is not None:
            raise refusal from error
        raise
    try:
        response = getattr(file, "r", None)  # fsspec's stream keeps aiohttp's response
        if response is None:
            return file, ObjectVersion(), 0
        version = _versions.http_version(response)
        start = _versions.http_body_start(url, response, position)
        if pinned is not None:
            _versions.check_unchanged(url, pinned, version)
    except BaseException:
        file.close()
        raise
    return file, version, start


def expand(root: str, masks: list[str], recursive: bool,
           storage_options: Mapping[str, Any] | None) -> list[str]:
    """The files under ``root`` (a directory, or a single file) whose names match a mask, sorted.

    Remote roots keep their protocol in the paths returned, so they can be opened again.
    """
    if is_local(root):
        return _expand_local(local_path(root), masks, recursive)
    fs, path = filesystem(root, storage_options)
    # Listed anew each time: fsspec keeps listings for the life of the process, and a lister
    # iterated again (the next epoch) kept a deleted shard and missed a new one.
    fs.invalidate_cache(path)
    if fs.isfile(path):
        found = [path]
    else:
        found = fs.find(path, maxdepth=None if recursive else 1)
    # An object store lists a missing prefix (or bucket) as an empty one: ask, as a local root
    # that is not there is an error, not an empty epoch. Only an empty listing pays the request.
    if not found and not fs.exists(path):
        raise missing_root(root)
    protocol = root.split("://", 1)[0]
    return sorted(_with_protocol(f, protocol) for f in found if _matches(f, masks))


def missing_root(root: str) -> FileNotFoundError:
    return FileNotFoundError(errno.ENOENT, "FileLister: root is neither a file nor a directory", root)


def _expand_local(root: str, masks: list[str], recursive: bool) -> list[str]:
    if os.path.isfile(root):
        return [root] if _matches(root, masks) else []
    if not os.path.isdir(root):
        raise missing_root(root)
    found = []
    for directory, subdirectories, names in os.walk(root):
        found.extend(os.path.join(directory, name) for name in names)
        if not recursive:
            subdirectories.clear()
    return sorted(path for path in found if _matches(path, masks))


def file_name(path: str) -> str:
    """The last part of a local path or URL (what a checkpoint compares to tell files apart
    wherever the dataset was moved)."""
    return path.rstrip("/").rsplit("/", 1)[-1]


def _matches(path: str, masks: list[str]) -> bool:
    return any(fnmatch.fnmatch(file_name(path), mask) for mask in masks)


def _with_protocol(path: str, protocol: str) -> str:
    return path if "://" in path else f"{protocol}://{path}"
