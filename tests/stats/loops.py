"""What several stats tests load: a dataset whose items compute."""

from __future__ import annotations

import time

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
