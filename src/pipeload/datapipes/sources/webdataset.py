"""``webdataset``: consecutive archive members that share a key become one sample dict."""

from __future__ import annotations

import re
import warnings
from collections.abc import Iterator
from typing import Any

from pipeload._state_fields import StateFields
from pipeload.datapipes.base import IterDataPipe
from pipeload.datapipes.iter._columns import no_length
from pipeload.datapipes.sources._checks import check_length
from pipeload.datapipes.protocol import PipeIterator
from pipeload.datapipes.sources.errors import SampleGroupingError
from pipeload.datapipes.sources.on_error import SAMPLE, ErrorPolicyMixin, FailureHandler, OnError, check_policy

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


class MemberLeftOutWarning(UserWarning):
    """A tar member whose name has no key and extension (``README``, ``.hidden.cls``) is in no
    sample of ``webdataset``."""


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
        check_length(length, "WebDataset")
        self.datapipe = datapipe
        self.length = length
        self.on_error = on_error
        self.max_failures = max_failures

    def __iter__(self) -> Iterator[dict[str, Any]]:
        return _GroupingIterator(self.datapipe, self._failure_handler("webdataset", "the sample", SAMPLE))

    def __len__(self) -> int:
        if self.length == -1:
            raise no_length(self)
        return self.length


def _fields(sample: dict[str, Any]) -> list[str]:
    return [name for name in sample if not name.startswith("__")]


def _split_across(previous: dict[str, Any] | None, url: str | None, key: str, extension: str) -> bool:
    """Whether a member of ``key`` that begins archive ``url`` continues the sample that ended
    the archive before it: the same key, and a file that sample lacks (the same files again
    are a sample of its own under a reused key, as shards that number their keys from 0 make)."""
    return (previous is not None and url is not None and previous.get("__url__") not in (None, url)
            and previous["__key__"] == key and extension not in previous)


def _url_and_name(member: Any) -> tuple[str | None, str]:
    archive = getattr(member, "archive", None)
    if archive is not None:
        return archive, member.name
    return None, member[0]


class _GroupingIterator(PipeIterator[dict[str, Any]]):
    """Fills one sample at a time from consecutive members; a member with another key (or from
    another archive) finishes it.

    A sample whose archive broke before it ended is dropped, not yielded short: members carry
    how their archive's reading ended (``ArchiveMember.outcome``, set before anything after the
    break is handed out), so a sample finished by a member of another reading, or by the end,
    is whole only if its reading did not fail.

    Its checkpoint is the upstream's as it stood before the first member of the sample being
    filled (``load_from_tar`` can say: ``state_before_last``), so that resuming reads that
    sample's members again instead of holding their bytes in the checkpoint.
    """

    def __init__(self, source: Any, failures: FailureHandler) -> None:
        super().__init__(source)
        (self._members,) = self.upstream
        self.failures = failures
        self._sample: dict[str, Any] | None = None  # being filled; kept across NotAvailable
        self._outcome: Any = None  # how the reading of the sample's members ends (None: unknown)
        self._broken = False  # the sample being filled had a duplicate and is to be skipped
        self._ended = False
        self._before_sample: Any = None  # the upstream's checkpoint before the sample's first member
        # The keys of the archive reading being grouped, so that a key coming back after another
        # key's members is seen (a mis-packed shard); bounded by one archive's samples.
        self._reading: tuple[Any, Any] | None = None  # (url, outcome) of that reading
        self._keys_in_reading: set[str] = set()
        self._warned_reading = False  # a member left out of that reading was said

    def nonblocking_next(self) -> dict[str, Any]:
        while True:
            if self._ended:
                raise StopIteration
            try:
                member = self._members.nonblocking_next()
            except StopIteration:
                self._ended = True
                finished = self._take_sample(None)
                if finished is not None:
                    return finished
                raise
            finished = self._add(member)
            if finished is not None:
                return finished

    def _add(self, member: Any) -> dict[str, Any] | None:
        url, name = _url_and_name(member)
        outcome = getattr(member, "outcome", None)
        self._note_reading(url, outcome, getattr(member, "index", None))
        parts = split_key(name)
        if parts is None:
            self._warn_left_out(url, name)
            return None
        key, extension = parts[0], parts[1].lower()
        finished = None
        if (self._sample is None or self._sample["__key__"] != key or self._sample.get("__url__") != url
                or outcome is not self._outcome):
            previous = self._sample
            finished = self._take_sample(outcome)
            self._sample = {"__key__": key, "__url__": url} if url is not None else {"__key__": key}
            self._outcome = outcome
            self._before_sample = self._upstream_before_last()
            self._check_key_is_new(url, key)
            if finished is not None and _split_across(previous, url, key, extension):
                # Neither part is the sample: both are left out, or the error raised.
                self._refuse(url, key, f"continues the sample of that key which ended archive "
                             f"{previous['__url__']!r} (its {', '.join(sorted(_fields(previous)))} there, "
                             f"{extension!r} here): a sample's members must be in one shard")
                self.failures.dropped(1)
                finished = None
        if extension in self._sample:
            self._refuse(url, key, f"has two files with extension {extension!r}")
        self._sample[extension] = member[1]
        return finished

    def _note_reading(self, url: str | None, outcome: Any, index: int | None) -> None:
        """Forget the previous reading's keys where a new reading of an archive begins: another
        archive, another reading's outcome, or its first member (the same shard listed twice
        in a row is read twice, and its keys come again rightly)."""
        if (url, outcome) != self._reading or index == 0:
            self._reading = (url, outcome)
            self._keys_in_reading.clear()
            self._warned_reading = False

    def _warn_left_out(self, url: str | None, name: str) -> None:
        """Say (once an archive reading) that a member with no key and extension to group by
        is in no sample: nothing of a shard is left out without a word."""
        if self._warned_reading:
            return
        self._warned_reading = True
        where = f" of {url!r}" if url is not None else ""
        warnings.warn(f"pipeload: member {name!r}{where} is left out of every sample: its name has no "
                      "key and extension (WebDataset's convention: the key runs to the first dot of "
                      "the file's own name, which must not begin with one, and an extension follows "
                      "it); this is said once an archive", MemberLeftOutWarning, stacklevel=2)

    def _check_key_is_new(self, url: str | None, key: str) -> None:
        if url is None:  # plain (path, data) pairs: no archive to hold the keys of
            return
        if key in self._keys_in_reading:
            self._refuse(url, key, "comes back after another key's members: the members of one "
                         "sample must be adjacent in the shard (it is mis-packed); its earlier "
                         "members went out as a sample without these")
        self._keys_in_reading.add(key)

    def _refuse(self, url: str | None, key: str, what: str) -> None:
        """The sample being filled is not whole: an error naming the archive and the key, or
        (``on_error``) the sample is dropped."""
        self._broken = True
        where = f" of archive {url!r}" if url is not None else ""
        error = SampleGroupingError(f"webdataset: sample key {key!r}{where} {what}", url, key)
        self.failures.handle(error, self.failures.site(url, key))

    def _take_sample(self, next_outcome: Any) -> dict[str, Any] | None:
        """The sample filled so far, now that a member with ``next_outcome`` (None: the end, or
        plain pairs) came after it; None if it is to be dropped."""
        sample, broken, outcome = self._sample, self._broken, self._outcome
        self._sample, self._broken = None, False
        if sample is None or broken:
            return None
        if outcome is not None and outcome is not next_outcome and outcome.failed:
            self.failures.dropped(1)  # cut short by its archive's failure, already counted
            return None
        return sample

    def _upstream_before_last(self) -> Any:
        before_last = getattr(self._members, "state_before_last", None)
        return before_last() if callable(before_last) else None

    def state_dict(self) -> dict[str, Any]:
        own = {"ended": self._ended}
        if self._sample is None:
            return {"own": own, "upstream": [self._members.state_dict()]}
        if self._before_sample is None:
            raise NotImplementedError(
                "webdataset keeps a checkpoint only where its upstream can say where it stood "
                f"before its latest item ({type(self._members).__name__} cannot; load_from_tar "
                "can): it can only be resumed by skipping items")
        return {"own": own, "upstream": [self._before_sample]}

    def _check_own_state(self, fields: StateFields) -> Any:
        own = fields.fields("own")
        ended = own.boolean("ended")
        own.finish()
        return {"ended": ended}

    def _load_own_state(self, state: Any) -> None:
        self._ended = bool(state["ended"])
