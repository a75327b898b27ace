"""DataChunk: the list type that batching pipes yield, as torch's does."""

from __future__ import annotations

from collections.abc import Iterable, Iterator
from typing import TypeVar

T = TypeVar("T")


class DataChunk(list[T]):
    """A batch made by a pipe: a list that prints and iterates like one (as torch's DataChunk)."""

    def __init__(self, items: Iterable[T] = ()) -> None:
        items = list(items)
        super().__init__(items)
        self.items = items

    def as_str(self, indent: str = "") -> str:
        return indent + "[" + ", ".join(str(item) for item in iter(self)) + "]"

    def raw_iterator(self) -> Iterator[T]:
        yield from self.items
