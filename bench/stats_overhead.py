"""What stats cost: the tiny-items workload with ``stats=True`` and ``stats=False``, same run.

    python -m bench.stats_overhead [--items 200000] [--repeats 7] [--engine NAME ...]

Tiny items (Python ints, batch 64) make the loader's own per-batch work the whole cost, so any
overhead of the stats shows there first. For each engine, three settings take turns, in a
rotating order so drifting machine load falls on all alike: stats on, stats off, and stats off
again (an A/A control: whatever the two "off" columns differ by is the machine's noise, not
ours). The figure per setting is the best of the repeats, samples/s over one epoch of a fresh
loader (workers' start-up included): on a shared, loaded machine the best run is the one least
disturbed by others, and medians there wander by more than the 1% being measured.
"""

from __future__ import annotations

import argparse
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


def one_epoch(dataset: PythonInts, engine: dict, stats: bool) -> float:
    """Samples/s of one epoch with a fresh loader."""
    loader = pipeload.DataLoader(dataset, batch_size=BATCH_SIZE, stats=stats, **engine)
    started = time.perf_counter()
    samples = sum(len(batch) for batch in loader)
    return samples / (time.perf_counter() - started)


def best_of(engine: dict, items: int, repeats: int) -> dict[str, float]:
    """The best samples/s of each setting over ``repeats`` rotations."""
    dataset = PythonInts(items)
    one_epoch(dataset, engine, True)  # warm-up: imports, first fork
    best = dict.fromkeys(SETTINGS, 0.0)
    for repeat in range(repeats):
        shift = repeat % len(SETTINGS)
        for setting in SETTINGS[shift:] + SETTINGS[:shift]:
            best[setting] = max(best[setting], one_epoch(dataset, engine, setting == "on"))
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
    print(f"{'engine':<10}{'stats on':>12}{'stats off':>12}{'off again':>12}"
          f"{'overhead':>10}{'A/A noise':>11}")
    for name in args.engine or list(ENGINES):
        best = best_of(ENGINES[name], args.items // SMALLER.get(name, 1), args.repeats)
        overhead = 1 - best["on"] / max(best["off"], best["off again"])
        noise = abs(1 - best["off again"] / best["off"])
        print(f"{name:<10}{best['on']:>12,.0f}{best['off']:>12,.0f}{best['off again']:>12,.0f}"
              f"{overhead:>+10.1%}{noise:>11.1%}", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
