"""What several stats tests load and how they read it: a dataset whose items compute, and a loop
that goes on past the batches that raise."""

from __future__ import annotations

import time
from collections.abc import Iterable
from typing import Any

import pipeload


class Busy(pipeload.Dataset):
    """Each item costs ``cost_s`` of CPU (a busy loop, not a sleep: the workers must be busy)."""

    def __init__(self, count: int, cost_s: float) -> None:
        self.count, self.cost_s = count, cost_s

    def __len__(self) -> int:
        return self.count

    def __getitem__(self, index: int) -> int:
        until = time.perf_counter() + self.cost_s
        while time.perf_counter() < until:
            pass
        return index


def sizes_past_errors(loader: Iterable[Any], error: type[BaseException]) -> list[int]:
    """The length of each batch the loop received, going on past those that raised ``error``."""
    received, iterator = [], iter(loader)
    while True:
        try:
            received.append(len(next(iterator)))
        except error:
            continue
        except StopIteration:
            return received
