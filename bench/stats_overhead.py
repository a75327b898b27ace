"""What stats cost: the tiny-items workload with ``stats=True`` and ``stats=False``, same run.

    python -m bench.stats_overhead [--burst 64] [--rounds 400] [--engine NAME ...]

Tiny items (Python ints, batch 64) make the loader's own per-batch work the whole cost, so any
overhead of the stats shows there first. For each engine three loaders run side by side, each
one long epoch, warmed up first: stats on, stats off, and stats off again (an A/A control: what
the two "off" loaders differ by is the machine's noise, not ours). Each round takes a burst of
``--burst`` batches from each, in a rotating order (economic mode, whose bursts take a hundred
times longer, a tenth as many rounds).

The figure is CPU time per batch, the loader's whole CPU use: every thread of this process, and
every thread of the worker processes (the kernel's per-thread nanosecond counters,
``/proc/PID/task/TID/schedstat``), which waiting for a CPU does not inflate as it inflates the
wall clock. On a shared machine other processes still add to it (cache misses, slower clocks),
never take from it, and a short burst often runs undisturbed: so the table shows each setting's
10th percentile over the rounds (the typical undisturbed burst) beside its median, and the
cost and A/A computed from the 10th percentiles. The verdict says whether the cost is within
the 1% target, and whether the A/A was small enough (under 1%) for the figure to be trusted.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import psutil

import pipeload
from bench.workloads import PythonInts

BATCH_SIZE = 64
TARGET = 0.01
ENGINES = {
    "inline": {"num_workers": 0},
    "process": {"num_workers": 2},
    "thread": {"num_workers": 2, "worker_type": "thread"},
    "economic": {"num_workers": 2, "mode": "economic"},
}
SETTINGS = ("on", "off", "off again")
FEWER = {"economic": 0.1}  # economic mode moves every tiny item on its own: a burst takes 100x longer


def thread_cpu_s(pid: int) -> float:
    """CPU seconds of every thread of process ``pid`` (0 once it is gone)."""
    total = 0
    for stat in Path(f"/proc/{pid}/task").glob("*/schedstat"):
        try:
            total += int(stat.read_text().split()[0])
        except (OSError, ValueError, IndexError):
            pass  # a thread that ended meanwhile
    return total / 1e9


def workers_cpu_s(pids: list[int]) -> float:
    return sum(thread_cpu_s(pid) for pid in pids)


class Burst:
    """One loader's epoch, taken ``size`` batches at a time, each burst's CPU time measured."""

    def __init__(self, dataset: PythonInts, engine: dict, stats: bool, size: int) -> None:
        self.loader = pipeload.DataLoader(dataset, batch_size=BATCH_SIZE, stats=stats, **engine)
        self.batches = iter(self.loader)
        self.size = size
        self.take()  # warm-up: workers started, first batches through
        self.pids = [child.pid for child in psutil.Process().children(recursive=True)
                     if child.pid not in Burst.known]
        Burst.known.update(self.pids)

    known: set[int] = set()

    def take(self) -> float:
        """CPU seconds per batch of the next burst."""
        pids = getattr(self, "pids", [])
        workers = workers_cpu_s(pids)
        started = time.process_time()
        for _ in range(self.size):
            next(self.batches)
        main = time.process_time() - started
        return (main + workers_cpu_s(pids) - workers) / self.size

    def close(self) -> None:
        self.batches = None  # stops the workers


def rounds_of(engine: dict, burst: int, rounds: int) -> dict[str, list[float]]:
    """Per setting: CPU seconds per batch of every round's burst."""
    dataset = PythonInts(10**9)
    bursts = {s: Burst(dataset, engine, s == "on", burst) for s in SETTINGS}
    for setting in SETTINGS:
        for _ in range(3):
            bursts[setting].take()
    runs: dict[str, list[float]] = {s: [] for s in SETTINGS}
    for round_ in range(rounds):
        shift = round_ % len(SETTINGS)
        for setting in SETTINGS[shift:] + SETTINGS[:shift]:
            runs[setting].append(bursts[setting].take())
    for one in bursts.values():
        one.close()
    return runs


def p10(values: list[float]) -> float:
    return sorted(values)[len(values) // 10]


def report(name: str, runs: dict[str, list[float]]) -> tuple[bool, bool]:
    """One engine's line; (cost within the target, A/A within it too)."""
    on, off, again = (runs[s] for s in SETTINGS)
    cost = p10(on) / ((p10(off) + p10(again)) / 2) - 1
    noise = p10(off) / p10(again) - 1
    median_cost = statistics.median(on) / statistics.median(off + again) - 1
    met, trusted = cost <= TARGET, abs(noise) <= TARGET
    verdict = ("met" if met else "NOT met") + ("" if trusted else " (A/A > 1%: too noisy to tell)")
    print(f"{name:<9}{p10(on) * 1e6:>8.2f}{p10(off) * 1e6:>8.2f}{p10(again) * 1e6:>8.2f}"
          f"{cost:>+8.2%}{noise:>+8.2%}   {statistics.median(on) * 1e6:>8.2f}"
          f"{statistics.median(off) * 1e6:>8.2f}{median_cost:>+8.2%}   {verdict}", flush=True)
    return met, trusted


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench.stats_overhead",
                                     description=__doc__.split("\n")[0])
    parser.add_argument("--burst", type=int, default=64, help="batches per burst")
    parser.add_argument("--rounds", type=int, default=400)
    parser.add_argument("--engine", action="append", choices=sorted(ENGINES))
    args = parser.parse_args(argv)
    print(f"tiny items: ints, batch {BATCH_SIZE}; {args.rounds} rounds of a {args.burst}-batch burst "
          f"from each of on / off / off again, rotating; load average {os.getloadavg()[0]:.1f}")
    print(f"{'':<9}{'CPU us/batch, 10th percentile':^24}{'cost':>8}{'A/A':>8}   "
          f"{'median: on, off, cost':^24}   target <= 1%")
    print(f"{'engine':<9}{'on':>8}{'off':>8}{'again':>8}")
    results = [report(name, rounds_of(ENGINES[name], args.burst, max(20, int(args.rounds * FEWER.get(name, 1)))))
               for name in args.engine or list(ENGINES)]
    met = all(m for m, _ in results)
    trusted = all(t for _, t in results)
    print("stats overhead target (<= 1% CPU per batch): "
          + ("met on every engine" if met else "NOT met on every engine")
          + ("" if trusted else "; the machine was too noisy to tell on some (A/A > 1%)"))
    return 0


if __name__ == "__main__":
    sys.exit(main())
