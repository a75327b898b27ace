"""``webdataset``: consecutive archive members that share a key become one sample dict."""

from __future__ import annotations

import re
from collections.abc import Iterator
from typing import Any

from pipeload.datapipes.base import IterDataPipe
from pipeload.datapipes.iter._columns import no_length
from pipeload.datapipes.protocol import PipeIterator, SkipToResume
from pipeload.datapipes.sources.on_error import ErrorPolicyMixin, FailureHandler, OnError, check_policy

# WebDataset's convention: the key runs to the first dot of the file's own name (directories
# inside the archive belong to the key), the extension is everything after it.
_KEY_AND_EXTENSION = re.compile(r"^((?:.*/)?[^./]+)\.([^/]+)$")


def split_key(name: str) -> tuple[str, str] | None:
    """``("dir/sample0", "seg.png")`` for ``"dir/sample0.seg.png"``; None for a name with no dot.

    Example:
        >>> split_key("train/000123.cls")
        ('train/000123', 'cls')
    """
    match = _KEY_AND_EXTENSION.match(name)
    return (match.group(1), match.group(2)) if match else None


class WebDataset(IterDataPipe[dict[str, Any]], ErrorPolicyMixin):
    """Group tar members into samples by key, WebDataset's way (functional name: ``webdataset``).

    Consecutive members of one archive with the same key (``abc.jpg``, ``abc.cls``) make one dict:
    ``{"__key__": "abc", "__url__": <archive>, "jpg": b"...", "cls": b"..."}``, extensions in
    lower case. Members whose name has no extension are left out. Two members with one key and
    one extension in a sample is an error (``on_error`` may skip that sample instead).

    Args:
        datapipe: yields ``(path, data)`` members, as ``load_from_tar`` does.
        length: what ``len()`` reports (-1: no length).
        on_error, max_failures: see ``pipeload.datapipes.sources.on_error``.

    Example:
        >>> samples = FileLister("shards", "*.tar").open_files(mode="b").load_from_tar().webdataset()
        >>> next(iter(samples)).keys()
        dict_keys(['__key__', '__url__', 'jpg', 'cls'])
    """

    _parent_fields = ("datapipe",)

    def __init__(self, datapipe: IterDataPipe, length: int = -1, *, on_error: OnError = "raise",
                 max_failures: int | None = None) -> None:
        check_policy(on_error, max_failures, "WebDataset")
        self.datapipe = datapipe
        self.length = length
        self.on_error = on_error
        self.max_failures = max_failures

    def __iter__(self) -> Iterator[dict[str, Any]]:
        return _GroupingIterator(self.datapipe, self._failure_handler("webdataset", "the sample"))

    def __len__(self) -> int:
        if self.length == -1:
            raise no_length(self)
        return self.length


def _url_and_name(member: Any) -> tuple[str | None, str]:
    archive = getattr(member, "archive", None)
    if archive is not None:
        return archive, member.name
    return None, member[0]


class _GroupingIterator(SkipToResume, PipeIterator[dict[str, Any]]):
    def __init__(self, source: Any, failures: FailureHandler) -> None:
        super().__init__(source)
        (self._members,) = self.upstream
        self.failures = failures
        self._sample: dict[str, Any] | None = None  # being filled; kept across NotAvailable
        self._broken = False  # the sample being filled had a duplicate and is to be skipped
        self._ended = False

    def nonblocking_next(self) -> dict[str, Any]:
        while True:
            if self._ended:
                raise StopIteration
            try:
                member = self._members.nonblocking_next()
            except StopIteration:
                self._ended = True
                finished = self._take_sample()
                if finished is not None:
                    return finished
                raise
            finished = self._add(member)
            if finished is not None:
                return finished

    def _add(self, member: Any) -> dict[str, Any] | None:
        url, name = _url_and_name(member)
        parts = split_key(name)
        if parts is None:
            return None
        key, extension = parts[0], parts[1].lower()
        finished = None
        if self._sample is None or self._sample["__key__"] != key or self._sample.get("__url__") != url:
            finished = self._take_sample()
            self._sample = {"__key__": key, "__url__": url} if url is not None else {"__key__": key}
        if extension in self._sample:
            self._broken = True
            error = ValueError(f"webdataset: sample {key!r} of {url!r} has two files with extension "
                               f"{extension!r}; keys must be unique and members of one sample adjacent")
            self.failures.handle(error, self.failures.site(url, key))
        self._sample[extension] = member[1]
        return finished

    def _take_sample(self) -> dict[str, Any] | None:
        sample, broken = self._sample, self._broken
        self._sample, self._broken = None, False
        return None if broken else sample
