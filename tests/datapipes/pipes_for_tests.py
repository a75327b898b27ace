"""Module-level functions and pipes the DataPipe tests share (module level, so they pickle)."""

from __future__ import annotations

import os
import random
import threading
import time
from collections.abc import Iterator
from typing import Any

import numpy as np
import torch

from pipeload.datapipes import IterDataPipe, NotAvailable, PipeIterator, lazy_init
from pipeload.datapipes.protocol import Notifier


def add_one(x: int) -> int:
    return x + 1


def double(x: int) -> int:
    return 2 * x


def is_even(x: int) -> bool:
    return x % 2 == 0


def add(a: int, b: int) -> int:
    return a + b


def parity(x: int) -> int:
    return x % 2


def first_letter(text: str) -> str:
    return text[0]


def as_tensor(x: int) -> torch.Tensor:
    return torch.full((4,), x, dtype=torch.int64)


def as_large_tensor(x: int) -> torch.Tensor:
    return torch.full((1 << 14,), x, dtype=torch.int64)  # 128 KiB: beyond what rides inline


def fail_at_three(x: int) -> int:
    if x == 3:
        raise KeyError(f"no item {x}")
    return x


def exit_at_three(x: int) -> int:
    if x == 3:
        os._exit(7)
    return x


def pid_and_item(x: int) -> tuple[int, int]:
    return os.getpid(), x


def with_random_draws(x: int) -> tuple[int, tuple[float, float, float]]:
    """The item and one draw from each global generator (torch, random, numpy) where it runs."""
    return x, (float(torch.rand(())), random.random(), float(np.random.rand()))


def normalise(value: Any) -> Any:
    """Outputs in a comparable form: lists for DataChunks, (tolist, dtype) for tensors."""
    if isinstance(value, torch.Tensor):
        return ("tensor", value.tolist(), str(value.dtype))
    if isinstance(value, list):
        return [normalise(v) for v in value]
    if isinstance(value, tuple):
        return tuple(normalise(v) for v in value)
    if isinstance(value, dict):
        return {k: normalise(v) for k, v in value.items()}
    return value


class Counting(IterDataPipe):
    """Counts the items its runs have produced (shared across copies in this process)."""

    def __init__(self, count: int, counter: list[int]) -> None:
        self.count = count
        self.counter = counter

    def __iter__(self) -> Iterator[int]:
        for i in range(self.count):
            self.counter[0] += 1
            yield i


class Gate:
    """An asynchronous source controlled by the test: it releases items when told to."""

    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.released: list[Any] = []
        self.ended = False
        self.notifier = Notifier()
        self.polls = 0

    def release(self, *items: Any) -> None:
        with self.lock:
            self.released.extend(items)
        self.notifier.notify()

    def end(self) -> None:
        with self.lock:
            self.ended = True
        self.notifier.notify()


class GatedPipe(IterDataPipe):
    """An iterable pipe over a :class:`Gate`: NotAvailable until the test releases items."""

    def __init__(self, gate: Gate) -> None:
        self.gate = gate

    def __iter__(self) -> PipeIterator[Any]:
        return _GatedIterator(self.gate)


class _GatedIterator(PipeIterator[Any]):
    def __init__(self, gate: Gate) -> None:
        super().__init__()
        self._gate = gate

    def nonblocking_next(self) -> Any:
        gate = self._gate
        with gate.lock:
            gate.polls += 1
            if gate.released:
                return gate.released.pop(0)
            if gate.ended:
                raise StopIteration
        raise NotAvailable

    def notifiers(self) -> list[Notifier]:
        return [self._gate.notifier]


def release_later(gate: Gate, items: list[Any], end: bool) -> threading.Thread:
    """Release ``items`` one by one from another thread, once each is waited for."""

    def run() -> None:
        for item in items:
            time.sleep(0.01)  # spaced out so the consumer has to wait; not a synchronisation
            gate.release(item)
        if end:
            gate.end()

    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    return thread


class MadeWhereUsed(IterDataPipe):
    """Yields the pid of the process where its lazily made resource was made."""

    def __init__(self, source: IterDataPipe) -> None:
        self.source = source

    @lazy_init
    def resource(self) -> int:
        return os.getpid()

    def __iter__(self) -> Iterator[int]:
        return (self.resource for _ in self.source)


class CountsDown(IterDataPipe):
    """A pipe that is its own iterator, as IterDataPipe's default ``__iter__`` (return self)
    invites: ``__iter__`` starts again, ``__next__`` reads."""

    def __init__(self, start: int) -> None:
        self.start = start
        self.left = start

    def __iter__(self) -> CountsDown:
        self.left = self.start
        return self

    def __next__(self) -> int:
        if self.left == 0:
            raise StopIteration
        self.left -= 1
        return self.left


class ListsWhereUsed(IterDataPipe):
    """The RFC's lazy initialisation: its ``lazy_init()`` makes the list (and notes the pid)
    before the first ``__iter__`` or ``__len__`` of each copy; ``__init__`` lists nothing."""

    def __init__(self, count: int) -> None:
        self.count = count
        self.numbers: list[int] | None = None
        self.lazy_inits = 0

    def lazy_init(self) -> None:
        self.numbers = list(range(self.count))
        self.listed_in = os.getpid()
        self.lazy_inits += 1

    def __iter__(self) -> Iterator[tuple[int, int]]:
        assert self.numbers is not None, "lazy_init() was not called before __iter__"
        return ((number, self.listed_in) for number in self.numbers)

    def __len__(self) -> int:
        assert self.numbers is not None, "lazy_init() was not called before __len__"
        return len(self.numbers)


def unpicklable_item(x: int) -> Any:
    return (i for i in range(x))  # a generator cannot be pickled
