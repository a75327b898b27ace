"""num_workers="auto" against the best fixed num_workers, on a CPU-bound and an I/O-like workload.

    python -m bench.auto_workers [--rounds 2] [--warm-up-epochs 4] [--epochs 2] [--workload cpu|io ...]

Every setting gets a fresh loader with persistent workers. The warm-up epochs are where "auto"
finds its settings (and where every setting starts its workers), so they are timed apart;
"auto" warms up for at least as many epochs as the others and on until its tuner has settled
(at most 12): the target is the throughput it reaches, and its warm-up time is shown beside it.
The ratio compares steady throughput, samples/s over the epochs after the warm-up. The settings take turns
within each round, each round starting one setting further along ("auto" first in the second),
so drifting machine load falls on all alike; the
table shows each setting's median over the rounds, and the ratio of "auto" to the best fixed
setting's median, with each round's own ratio beside it as the spread. Workloads:

    cpu   ~1 ms of pure-Python work per item: more workers than CPUs cannot help
    io    a 2 ms wait per item, as a remote read: workers wait, so many more than CPUs help

On a machine shared with other jobs, more processes than CPUs also win a bigger share of the
CPUs from the others: a fixed setting above the usable CPUs can look faster on CPU-bound work for
that reason alone. "auto" tries computing workers up to twice the usable CPUs and keeps them only
where that measured faster (the pool shrinks back in place otherwise). The load average is
printed at the start and the end for that reason.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
import warnings
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import pipeload
from pipeload.stats.recorder import usable_cpus
from pipeload.stats.tuner import memory_budget_bytes

BATCH_SIZE = 16
MAX_WARM_UP = 12  # epochs "auto" may take to settle before it is timed anyway


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
    "cpu": Workload("cpu", lambda: BusyItems(2000, 0.001), (1, 2, 4)),
    "io": Workload("io", lambda: WaitingItems(6000, 0.002), (8, 16, 32, 64)),
}


def run(dataset: Any, num_workers: Any, warm_up: int, epochs: int) -> tuple[float, float, Any]:
    """(warm-up seconds, samples/s over the epochs after it, the loader's stats). "auto" warms
    up until its tuner has settled (at most ``MAX_WARM_UP`` epochs), however many that takes."""
    loader = pipeload.DataLoader(dataset, batch_size=BATCH_SIZE, num_workers=num_workers,
                                 prefetch_factor="auto" if num_workers == "auto" else None,
                                 persistent_workers=True)
    started = time.perf_counter()
    warmed = 0
    while warmed < warm_up or (num_workers == "auto" and not settled(loader) and warmed < MAX_WARM_UP):
        for _ in loader:
            pass
        warmed += 1
    first = time.perf_counter() - started
    samples = 0
    started = time.perf_counter()
    for _ in range(epochs):
        samples += sum(len(batch) for batch in loader)
    later = time.perf_counter() - started
    stats = loader.stats()
    loader._iterator = None  # stop the persistent workers now
    return first, samples / later if later else 0.0, stats


def settled(loader: Any) -> bool:
    """Whether "auto" has taken its last decision (the ones it is still trying say "trying")."""
    return "trying" not in loader.stats().decisions[-1].reason


def describe_auto(stats: Any) -> str:
    """Where "auto" settled, and whether its batches in flight stayed within its memory budget."""
    settled = stats.decisions[-1]
    per_batch = stats.bytes_moved / stats.batches if stats.batches else 0
    in_flight = settled.num_workers * settled.prefetch_factor * per_batch
    budget = memory_budget_bytes(None)
    within = "within" if budget is None or in_flight <= budget else "OVER"
    return (f"auto->{settled.num_workers}/{settled.prefetch_factor}: {len(stats.decisions)} decisions, "
            f"{in_flight / 2**20:,.1f} MiB in flight at most, {within} its budget "
            f"({(budget or 0) / 2**20:,.0f} MiB); last: {settled.reason}")


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench.auto_workers", description=__doc__.split("\n")[0])
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--warm-up-epochs", type=int, default=4)
    parser.add_argument("--epochs", type=int, default=2)
    parser.add_argument("--workload", action="append", choices=sorted(WORKLOADS))
    args = parser.parse_args(argv)
    warnings.filterwarnings("ignore", message="This DataLoader will create")  # more than CPUs: meant
    print(f"{usable_cpus()} usable CPUs; batch {BATCH_SIZE}; persistent workers; "
          f"{args.warm_up_epochs} warm-up epochs, then {args.epochs} timed for the steady figure; "
          f"{args.rounds} rounds; load average {os.getloadavg()[0]:.1f}")
    met = []
    for name in args.workload or list(WORKLOADS):
        workload = WORKLOADS[name]
        dataset = workload.make()
        settings: list[Any] = [*workload.fixed, "auto"]
        steady: dict[Any, list[float]] = {s: [] for s in settings}
        warm: dict[Any, list[float]] = {s: [] for s in settings}
        ratios = []
        for round_ in range(args.rounds):
            shift = round_ % len(settings)  # each round starts one setting further along
            for setting in settings[-shift:] + settings[:-shift] if shift else settings:
                first, speed, stats = run(dataset, setting, args.warm_up_epochs, args.epochs)
                steady[setting].append(speed)
                warm[setting].append(first)
                if setting == "auto":
                    print(f"  round {round_ + 1}: {describe_auto(stats)}", flush=True)
            ratios.append(steady["auto"][-1] / max(steady[s][-1] for s in workload.fixed))
        print(f"{'workload':<9}{'num_workers':<14}{'warm-up s':>10}{'steady samples/s':>18}")
        for setting in settings:
            print(f"{name:<9}{setting!s:<14}{statistics.median(warm[setting]):>10.2f}"
                  f"{statistics.median(steady[setting]):>18,.0f}")
        best = max(statistics.median(steady[s]) for s in workload.fixed)
        ratio = statistics.median(steady["auto"]) / best
        met.append(ratio >= 0.9)
        print(f"{name}: auto is {ratio:.2f}x the best fixed setting (per round: "
              f"{', '.join(f'{r:.2f}x' for r in ratios)}); target >= 0.9x: "
              f"{'met' if ratio >= 0.9 else 'NOT met'}", flush=True)
    print(f"auto-workers target: {'met' if all(met) else 'NOT met'} on every workload; "
          f"load average now {os.getloadavg()[0]:.1f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
