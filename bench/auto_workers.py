"""num_workers="auto" against the best fixed num_workers, on a CPU-bound and an I/O-like workload.

    python -m bench.auto_workers [--warm-up-epochs 3] [--epochs 2] [--workload cpu|io ...]

Every setting gets a fresh loader with persistent workers. The warm-up epochs are where "auto"
finds its settings (and where every setting starts its workers), so they are timed apart; the
ratio compares steady throughput, samples/s over the epochs after them, of "auto" with the best
fixed setting of the same run. Workloads:

    cpu   ~1 ms of pure-Python work per item: more workers than CPUs cannot help
    io    a 2 ms wait per item, as a remote read: workers wait, so many more than CPUs help
"""

from __future__ import annotations

import argparse
import sys
import time
import warnings
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import pipeload
from pipeload.stats.recorder import usable_cpus

BATCH_SIZE = 16


class BusyItems(pipeload.Dataset):
    """Each item costs ``cost_s`` of CPU in a Python loop."""

    def __init__(self, count: int, cost_s: float) -> None:
        self.count, self.cost_s = count, cost_s

    def __len__(self) -> int:
        return self.count

    def __getitem__(self, index: int) -> int:
        until = time.perf_counter() + self.cost_s
        while time.perf_counter() < until:
            pass
        return index


class WaitingItems(pipeload.Dataset):
    """Each item waits ``wait_s`` as a remote read does, using no CPU meanwhile."""

    def __init__(self, count: int, wait_s: float) -> None:
        self.count, self.wait_s = count, wait_s

    def __len__(self) -> int:
        return self.count

    def __getitem__(self, index: int) -> int:
        time.sleep(self.wait_s)
        return index


@dataclass(frozen=True)
class Workload:
    name: str
    make: Any
    fixed: tuple[int, ...]


WORKLOADS = {
    "cpu": Workload("cpu", lambda: BusyItems(3000, 0.001), (1, 2, 4)),
    "io": Workload("io", lambda: WaitingItems(6000, 0.002), (8, 16, 32, 64)),
}


def run(dataset: Any, num_workers: Any, warm_up: int, epochs: int) -> tuple[float, float, Any]:
    """(warm-up seconds, samples/s over the epochs after it, the loader's stats)."""
    loader = pipeload.DataLoader(dataset, batch_size=BATCH_SIZE, num_workers=num_workers,
                                 prefetch_factor="auto" if num_workers == "auto" else None,
                                 persistent_workers=True)
    started = time.perf_counter()
    first = later = 0.0
    samples = 0
    for epoch in range(warm_up + epochs):
        epoch_started = time.perf_counter()
        count = sum(len(batch) for batch in loader)
        if epoch < warm_up:
            first = time.perf_counter() - started
        else:
            samples += count
            later += time.perf_counter() - epoch_started
    stats = loader.stats()
    loader._iterator = None  # stop the persistent workers now
    return first, samples / later if later else 0.0, stats


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench.auto_workers", description=__doc__.split("\n")[0])
    parser.add_argument("--warm-up-epochs", type=int, default=3)
    parser.add_argument("--epochs", type=int, default=2)
    parser.add_argument("--workload", action="append", choices=sorted(WORKLOADS))
    args = parser.parse_args(argv)
    warnings.filterwarnings("ignore", message="This DataLoader will create")  # more than CPUs: meant
    print(f"{usable_cpus()} usable CPUs; batch {BATCH_SIZE}; persistent workers; "
          f"{args.warm_up_epochs} warm-up epochs, then {args.epochs} timed for the steady figure")
    print(f"{'workload':<9}{'num_workers':<14}{'warm-up s':>10}{'steady samples/s':>18}")
    for name in args.workload or list(WORKLOADS):
        workload = WORKLOADS[name]
        dataset = workload.make()
        best = 0.0
        for count in workload.fixed:
            first, steady, _ = run(dataset, count, args.warm_up_epochs, args.epochs)
            best = max(best, steady)
            print(f"{name:<9}{count:<14}{first:>10.2f}{steady:>18,.0f}", flush=True)
        first, steady, stats = run(dataset, "auto", args.warm_up_epochs, args.epochs)
        settled = stats.decisions[-1]
        label = f"auto->{settled.num_workers}/{settled.prefetch_factor}"
        print(f"{name:<9}{label:<14}{first:>10.2f}{steady:>18,.0f}   "
              f"{steady / best:.2f}x the best fixed", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
