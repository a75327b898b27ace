"""Checks of the options several sources share, refused where the pipe is built and named with
the caller: each was refused by one entry point and taken by its sibling (``FileOpener(retry=3)``
failed only at a remote read's first retry, in a worker; ``.webdataset(length=1.5)`` at ``len()``)."""

from __future__ import annotations

import codecs
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
