"""Pipes over data already in memory: an iterable, or a sequence/mapping."""

from __future__ import annotations

import copy
import hashlib
import os
import warnings
from collections.abc import Iterable, Iterator, Mapping, Sequence, Sized
from typing import Any, TypeVar

from pipeload._user_frame import first_frame_outside_pipeload
from pipeload._state_fields import StateFields
from pipeload.datapipes.base import IterDataPipe, MapDataPipe
from pipeload.datapipes.iter._columns import no_length
from pipeload.datapipes.protocol import PipeIterator, skipped_ahead

T = TypeVar("T")


class IterableWrapper(IterDataPipe[T]):
    """An iterable pipe over any Python iterable.

    Args:
        iterable: the data (a list, a range, a generator-producing object, ...).
        deepcopy: iterate a deep copy made when each run reads its first item, so in-place
            changes downstream never alter the source (an uncopyable iterable is used as is,
            with a warning).

    Example:
        >>> list(IterableWrapper(range(3)))
        [0, 1, 2]
    """

    _parent_fields = ()  # a source: its data is never scanned for pipes

    def __init__(self, iterable: Iterable[T], deepcopy: bool = True) -> None:
        self.iterable = iterable
        self.deepcopy = deepcopy

    def __iter__(self) -> Iterator[T]:
        return _WrapperIterator(self)

    def __len__(self) -> int:
        if isinstance(self.iterable, Sized):
            return len(self.iterable)
        raise no_length(self)


class _WrapperIterator(PipeIterator[Any]):
    def __init__(self, pipe: IterableWrapper[Any]) -> None:
        super().__init__()
        self._pipe = pipe
        self._items: Iterator[Any] | None = None
        self._position = 0  # items handed out, for checkpoints
        self._names_digest: str | None = None  # of the data's names, once a run ("": not paths)

    def nonblocking_next(self) -> Any:
        if self._items is None:
            self._items = iter(self._source_data())
        try:
            item = next(self._items)
        except StopIteration:
            # Ended for good, as torch's generator-based wrapper is: an iterable that yields
            # again after its end is not read past it.
            self._items = iter(())
            raise
        self._position += 1
        return item

    def _source_data(self) -> Iterable[Any]:
        if not self._pipe.deepcopy:
            return self._pipe.iterable
        try:
            return copy.deepcopy(self._pipe.iterable)
        except TypeError:
            warnings.warn(
                "The input iterable can not be deepcopied, please be aware of in-place "
                f"modification would affect source data. ({type(self._pipe.iterable).__name__})",
                stacklevel=first_frame_outside_pipeload(),
            )
            return self._pipe.iterable

    def _own_state(self) -> Any:
        return self._position

    # States written before stop 53 have no names: they still load, unchecked.
    _settings_unchecked_when_missing = frozenset({"names_in_order"})

    def _settings(self) -> dict[str, Any]:
        # A list grown or shrunk since (a shard appended to a shuffled shard list): the same
        # position would be replayed through another shuffle, into other items. The same shards
        # in another order (a list from glob or listdir on another machine) would be too: for
        # a list of paths or URLs, their names in order are recorded as well.
        data = self._pipe.iterable
        if not isinstance(data, Sized):
            return {}
        settings: dict[str, Any] = {"length": len(data)}
        if self._names_digest is None:
            self._names_digest = names_digest(data)
        if self._names_digest:
            settings["names_in_order"] = self._names_digest
        return settings

    def _pipe_name(self) -> str:
        return "IterableWrapper"

    def _check_own_state(self, fields: StateFields) -> Any:
        # Replaying is exact for data in memory; sources that can seek do better (issue 9). It is
        # done here, on an iterator of its own, so a position past the data is refused unset.
        length = len(self._pipe.iterable) if isinstance(self._pipe.iterable, Sized) else None
        position = fields.integer("own", 0, length)
        if position == 0:
            return None, 0  # nothing read: the data is copied at the first item, as before
        items = skipped_ahead(iter(self._source_data()), position, fields.name("own"), "the data has {} items")
        return items, position

    def _load_own_state(self, state: Any) -> None:
        self._items, self._position = state


# The longest list whose names a checkpoint records: shard lists run to thousands; a list of a
# path a sample (a million images) cost 0.5 s a run in every worker, whose iterators the loader
# snapshots every epoch whether or not a checkpoint is ever saved (stop 53's review).
NAMES_DIGEST_MAX_ITEMS = 100_000


def names_digest(data: Any) -> str:
    """A digest of each path or URL in ``data``, in order, by as many of its last parts as tell
    the list's paths apart; "" when ``data`` is not all paths, is not a list or tuple, or is
    longer than ``NAMES_DIGEST_MAX_ITEMS``. Last parts, so that a dataset moved to another
    directory, bucket or host still resumes (as a shard's own check allows), and shards of one
    name in directories of their own (``part-3/data.tar``) are told apart; a URL's query string
    is left out (a presigned URL signed again)."""
    if not isinstance(data, (list, tuple)) or not isinstance(data[0] if data else None, (str, os.PathLike)):
        return ""  # (a list of numbers or samples is told apart at its first item)
    if len(data) > NAMES_DIGEST_MAX_ITEMS:
        return ""  # a path a sample, not a shard list: its length alone is checked
    paths = [os.fspath(item) if isinstance(item, os.PathLike) else item for item in data]
    if not all(isinstance(path, str) for path in paths):
        return ""
    normal = [_normal(path) for path in paths]
    names = [path.rpartition("/")[2] for path in normal]
    if len(set(names)) < len(names):  # one name in several directories: deeper, until told apart
        parts = [path.split("/") for path in normal]
        for depth in range(2, max(len(each) for each in parts) + 1):
            names = ["/".join(each[-depth:]) for each in parts]
            if len(set(names)) == len(names):
                break
    joined = "\0".join(names)
    return "blake2b:" + hashlib.blake2b(joined.encode("utf-8", "surrogatepass"), digest_size=12).hexdigest()


def _normal(path: str) -> str:
    """``path`` with separators of either kind as "/", no trailing one, without a URL's query."""
    if "://" in path:
        path = path.partition("?")[0]
    return path.replace("\\", "/").rstrip("/")


class SequenceWrapper(MapDataPipe[T]):
    """A map-style pipe over a sequence or a mapping.

    Args:
        sequence: the data; keys are its indices (or the mapping's keys).
        deepcopy: keep a deep copy, made now (an uncopyable sequence is kept as is, with a
            warning).

    Example:
        >>> SequenceWrapper({"a": 100, "b": 200})["b"]
        200
    """

    _parent_fields = ()

    def __init__(self, sequence: Sequence[T] | Mapping[Any, T], deepcopy: bool = True) -> None:
        self.sequence = sequence
        if deepcopy:
            try:
                self.sequence = copy.deepcopy(sequence)
            except TypeError:
                warnings.warn(
                    "The input sequence can not be deepcopied, please be aware of in-place "
                    f"modification would affect source data ({type(sequence).__name__})",
                    stacklevel=first_frame_outside_pipeload(),
                )

    def __getitem__(self, index: Any) -> T:
        return self.sequence[index]

    def __len__(self) -> int:
        return len(self.sequence)
