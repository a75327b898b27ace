"""What stats cost: the tiny-items workload with ``stats=True`` and ``stats=False``, same run.

    python -m bench.stats_overhead [--items 200000] [--rounds 9] [--engine NAME ...]

Tiny items (Python ints, batch 64) make the loader's own per-batch work the whole cost, so any
overhead of the stats shows there first. For each engine three loaders live side by side, each
with persistent workers and warmed by one epoch: stats on, stats off, and stats off again (an
A/A control: what the two "off" loaders differ by is the machine's noise, not ours). Each round
runs one epoch of each, in a rotating order, so drifting load falls on all three alike.

The figure is CPU time per batch, the loader's whole CPU use: every thread of this process, and
every thread of the worker processes (read from the kernel's per-thread nanosecond counters,
``/proc/PID/task/TID/schedstat``), which waiting for a CPU does not inflate as it inflates the
wall clock on a shared machine. Start-up is left out (the workers persist): stats add nothing
there but one clock per worker. Per round, the cost is on / mean(off, off again) - 1 and the
A/A is off / off again - 1; the table shows their medians over the rounds and the spread
(lowest to highest), then says whether the median cost meets the target of 1%. Samples/s by
the wall clock are shown beside, for reference only.
"""

from __future__ import annotations

import argparse
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
    "process": {"num_workers": 2, "persistent_workers": True},
    "thread": {"num_workers": 2, "worker_type": "thread", "persistent_workers": True},
    "economic": {"num_workers": 2, "mode": "economic", "persistent_workers": True},
}
SMALLER = {"economic": 10}  # economic mode moves every tiny item on its own: a tenth as many
SETTINGS = ("on", "off", "off again")


def thread_cpu_s(pid: int) -> float:
    """CPU seconds of every thread of process ``pid`` (0 once it is gone)."""
    total = 0
    for stat in Path(f"/proc/{pid}/task").glob("*/schedstat"):
        try:
            total += int(stat.read_text().split()[0])
        except (OSError, ValueError, IndexError):
            pass  # a thread that ended meanwhile
    return total / 1e9


def tree_cpu_s() -> float:
    """CPU seconds of this process and of its live child processes (the workers)."""
    me = psutil.Process()
    return time.process_time() + sum(thread_cpu_s(child.pid) for child in me.children(recursive=True))


def one_epoch(loader: Any) -> tuple[float, float]:
    """(samples/s, CPU seconds per batch) of one epoch."""
    cpu_before, started = tree_cpu_s(), time.perf_counter()
    batches = samples = 0
    for batch in loader:
        batches += 1
        samples += len(batch)
    wall = time.perf_counter() - started
    return samples / wall, (tree_cpu_s() - cpu_before) / batches


def rounds_of(engine: dict, items: int, rounds: int) -> dict[str, list[tuple[float, float]]]:
    """Per setting: (samples/s, CPU s per batch) of every round."""
    dataset = PythonInts(items)
    loaders = {s: pipeload.DataLoader(dataset, batch_size=BATCH_SIZE, stats=s == "on", **engine)
               for s in SETTINGS}
    for loader in loaders.values():
        one_epoch(loader)  # warm-up: imports, workers started
    runs: dict[str, list[tuple[float, float]]] = {s: [] for s in SETTINGS}
    for round_ in range(rounds):
        shift = round_ % len(SETTINGS)
        for setting in SETTINGS[shift:] + SETTINGS[:shift]:
            runs[setting].append(one_epoch(loaders[setting]))
    for loader in loaders.values():
        loader._iterator = None  # stop the persistent workers now
    return runs


def spread(values: list[float]) -> str:
    return f"{statistics.median(values):+.1%} [{min(values):+.1%}, {max(values):+.1%}]"


def report(name: str, runs: dict[str, list[tuple[float, float]]]) -> bool:
    on, off, again = ([cpu for _, cpu in runs[s]] for s in SETTINGS)
    costs = [a / ((b + c) / 2) - 1 for a, b, c in zip(on, off, again)]
    noise = [b / c - 1 for b, c in zip(off, again)]
    speed = {s: statistics.median(speed for speed, _ in runs[s]) for s in SETTINGS}
    met = statistics.median(costs) <= TARGET
    print(f"{name:<10}{statistics.median(on) * 1e6:>8.2f}{statistics.median(off) * 1e6:>8.2f}"
          f"{statistics.median(again) * 1e6:>8.2f}  {spread(costs):<26}{spread(noise):<26}"
          f"{speed['on']:>11,.0f}{speed['off']:>11,.0f}  {'met' if met else 'NOT met'}", flush=True)
    return met


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench.stats_overhead",
                                     description=__doc__.split("\n")[0])
    parser.add_argument("--items", type=int, default=200_000, help="the tiny workload's size")
    parser.add_argument("--rounds", type=int, default=9)
    parser.add_argument("--engine", action="append", choices=sorted(ENGINES))
    args = parser.parse_args(argv)
    print(f"tiny items: {args.items:,} ints (economic: a tenth), batch {BATCH_SIZE}, "
          f"{args.rounds} rounds of on / off / off again, rotating; persistent workers")
    print(f"{'':<10}{'CPU us/batch (median)':^24}  {'cost: median [range]':<26}"
          f"{'A/A noise: median [range]':<26}{'samples/s, median':^22}  target <= 1%")
    print(f"{'engine':<10}{'on':>8}{'off':>8}{'again':>8}  {'':<26}{'':<26}{'on':>11}{'off':>11}")
    results = [report(name, rounds_of(ENGINES[name], args.items // SMALLER.get(name, 1), args.rounds))
               for name in args.engine or list(ENGINES)]
    print("stats overhead target (<= 1% CPU per batch, median of the rounds): "
          + ("met on every engine" if all(results) else "NOT met on every engine"))
    return 0


if __name__ == "__main__":
    sys.exit(main())
