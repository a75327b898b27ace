"""Checks of the options several sources share, refused where the pipe is built and named with
the caller: each was refused by one entry point and taken by its sibling (``FileOpener(retry=3)``
failed only at a remote read's first retry, in a worker; ``.webdataset(length=1.5)`` at ``len()``)."""

from __future__ import annotations

import codecs
import os
from collections.abc import Mapping
from typing import Any

from pipeload.datapipes.sources._retry import RetryPolicy


def check_retry(retry: Any, caller: str) -> None:
    if retry is not None and not isinstance(retry, RetryPolicy):
        raise TypeError(f"{caller}: retry must be a RetryPolicy or None, got retry={retry!r}")


def check_length(length: Any, caller: str) -> None:
    """An int, -1 for no length (what ``len()`` reports)."""
    if isinstance(length, bool) or not isinstance(length, int):
        raise TypeError(f"{caller}: length must be an int (-1: no length), got length={length!r}")
    if length < -1:
        raise ValueError(f"{caller}: length must be 0 or more, or -1 for no length, got length={length!r}")


def check_encoding(encoding: Any, caller: str) -> None:
    """None, or a text encoding Python knows (refused per file, when read, every file skipped
    under ``on_error="skip"``)."""
    if encoding is None:
        return
    if not isinstance(encoding, str):
        raise TypeError(f"{caller}: encoding must be a str such as 'utf-8' or None, got encoding={encoding!r}")
    try:
        codecs.lookup(encoding)
    except LookupError:
        raise ValueError(f"{caller}: unknown encoding {encoding!r}") from None


def check_storage_options(storage_options: Any, caller: str) -> None:
    """None or a mapping (``dict(5)`` failed with "'int' object is not iterable", naming nothing)."""
    if storage_options is not None and not isinstance(storage_options, Mapping):
        raise TypeError(f"{caller}: storage_options must be a mapping (fsspec's options) or None, "
                        f"got storage_options={storage_options!r}")


def check_mode_and_encoding(mode: str, encoding: Any, binary: bool, caller: str) -> None:
    """An encoding is for text: with a binary ``mode`` it was refused only at the first read."""
    if encoding is not None and binary:
        raise ValueError(f"binary mode doesn't take an encoding argument ({caller} got mode={mode!r}, "
                         f"encoding={encoding!r})")
    check_encoding(encoding, caller)


def checked_paths(paths: Any, caller: str) -> list[str]:
    """``paths`` as a list of paths or URLs; one path given alone (a str is iterable: each of its
    characters became a path, and ``reader[0]`` read ``'/'``) or anything else not a list of
    them is refused, naming ``paths``."""
    if isinstance(paths, (str, bytes, os.PathLike)):
        raise TypeError(f"{caller}: paths must be a list of paths or URLs, got one path, paths={paths!r} "
                        f"(give [{paths!r}])")
    try:
        listed = list(paths)
    except TypeError:
        raise TypeError(f"{caller}: paths must be a list of paths or URLs, got paths={paths!r} "
                        f"({type(paths).__name__})") from None
    for index, path in enumerate(listed):
        if not isinstance(path, (str, os.PathLike)):
            raise TypeError(f"{caller}: paths must be a list of paths or URLs, got paths[{index}]={path!r} "
                            f"({type(path).__name__})")
    return [os.fspath(path) for path in listed]
