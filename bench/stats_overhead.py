"""What stats cost: the tiny-items workload with ``stats=True`` and ``stats=False``, same run.

    python -m bench.stats_overhead [--items 200000] [--repeats 7] [--engine NAME ...]

Tiny items (Python ints, batch 64) make the loader's own per-batch work the whole cost, so any
overhead of the stats shows there first. For each engine, three settings take turns, in a
rotating order so drifting machine load falls on all alike: stats on, stats off, and stats off
again (an A/A control: whatever the two "off" columns differ by is the machine's noise, not
ours). Each run is one epoch of a fresh loader (workers' start-up included).

Two figures per setting, each the best of the repeats (the run least disturbed by others):
CPU microseconds per batch, the loader's whole CPU use (every thread of this process, plus the
worker processes, reaped when the epoch ends: ``getrusage``), which waiting for a CPU does not
inflate; and samples/s by the wall clock, which on a shared, loaded machine wanders by more
than the 1% being measured.
"""

from __future__ import annotations

import argparse
import resource
import sys
import time
from collections.abc import Sequence

import pipeload
from bench.workloads import PythonInts

BATCH_SIZE = 64
ENGINES = {
    "inline": {"num_workers": 0},
    "process": {"num_workers": 2},
    "thread": {"num_workers": 2, "worker_type": "thread"},
    "economic": {"num_workers": 2, "mode": "economic"},
}
SMALLER = {"economic": 10}  # economic mode moves every tiny item on its own: a tenth as many
SETTINGS = ("on", "off", "off again")


def cpu_s() -> float:
    """CPU seconds of this process's threads and of its reaped children (microsecond steps)."""
    children = resource.getrusage(resource.RUSAGE_CHILDREN)
    return time.process_time() + children.ru_utime + children.ru_stime


def one_epoch(dataset: PythonInts, engine: dict, stats: bool) -> tuple[float, float]:
    """(samples/s, CPU seconds per batch) of one epoch with a fresh loader."""
    loader = pipeload.DataLoader(dataset, batch_size=BATCH_SIZE, stats=stats, **engine)
    cpu_before, started = cpu_s(), time.perf_counter()
    batches = samples = 0
    for batch in loader:
        batches += 1
        samples += len(batch)
    wall = time.perf_counter() - started
    del loader, batch  # the workers are stopped and reaped when the epoch ends
    return samples / wall, (cpu_s() - cpu_before) / batches


def best_of(engine: dict, items: int, repeats: int) -> dict[str, tuple[float, float]]:
    """Per setting: the best samples/s and the lowest CPU seconds per batch over the repeats."""
    dataset = PythonInts(items)
    one_epoch(dataset, engine, True)  # warm-up: imports, first fork
    best = dict.fromkeys(SETTINGS, (0.0, float("inf")))
    for repeat in range(repeats):
        shift = repeat % len(SETTINGS)
        for setting in SETTINGS[shift:] + SETTINGS[:shift]:
            speed, cpu = one_epoch(dataset, engine, setting == "on")
            best[setting] = (max(best[setting][0], speed), min(best[setting][1], cpu))
    return best


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench.stats_overhead",
                                     description=__doc__.split("\n")[0])
    parser.add_argument("--items", type=int, default=200_000, help="the tiny workload's size")
    parser.add_argument("--repeats", type=int, default=7)
    parser.add_argument("--engine", action="append", choices=sorted(ENGINES))
    args = parser.parse_args(argv)
    print(f"tiny items: {args.items:,} ints (economic: a tenth), batch {BATCH_SIZE}, best of "
          f"{args.repeats} per setting, settings rotating")
    print(f"{'':<10}{'CPU us per batch':^40}{'samples/s (wall clock)':^46}")
    print(f"{'engine':<10}{'on':>8}{'off':>8}{'again':>8}{'cost':>8}{'A/A':>8}"
          f"{'on':>11}{'off':>11}{'again':>11}{'cost':>7}{'A/A':>6}")
    for name in args.engine or list(ENGINES):
        best = best_of(ENGINES[name], args.items // SMALLER.get(name, 1), args.repeats)
        on, off, again = (best[s] for s in SETTINGS)
        cpu_cost = on[1] / min(off[1], again[1]) - 1
        wall_cost = 1 - on[0] / max(off[0], again[0])
        print(f"{name:<10}{on[1] * 1e6:>8.1f}{off[1] * 1e6:>8.1f}{again[1] * 1e6:>8.1f}"
              f"{cpu_cost:>+8.1%}{abs(again[1] / off[1] - 1):>8.1%}"
              f"{on[0]:>11,.0f}{off[0]:>11,.0f}{again[0]:>11,.0f}{wall_cost:>+7.1%}"
              f"{abs(1 - again[0] / off[0]):>6.1%}", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
