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
wall clock. The cost is the median over rounds of each round's own ratio (on against the mean of
the two "off"), so load that drifts between rounds cancels out, with its quartiles beside it;
the A/A is the same median for "off" against "off again". The 10th-percentile cost of earlier
versions of this script is shown too. The verdict says whether the cost is within the 1% target
and flags an A/A over 0.5% (too noisy to read a 1% figure against).

The clock cannot settle a fraction of a percent on a shared machine, so the script also counts,
deterministically, the Python bytecodes the calling thread executes per batch with stats on and
off (``sys.settrace`` opcode events, over a stretch past the loader's all-timed start): for
the inline engine that is all of its work, for workers the main process's side.
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


def quartiles(values: list[float]) -> tuple[float, float, float]:
    ordered = sorted(values)
    n = len(ordered)
    return ordered[n // 4], statistics.median(ordered), ordered[(3 * n) // 4]


def report(name: str, runs: dict[str, list[float]]) -> tuple[bool, bool]:
    """One engine's line; (cost within the target, A/A within it too).

    The verdict is the median over rounds of each round's own ratio: a round's three bursts run
    back to back, so a change of machine load between rounds cancels out of its ratio, and the
    median ignores the rounds a burst of another job landed in. The A/A ratio (off against off
    again) is computed the same way: the noise the cost figure has to be read against.
    """
    on, off, again = (runs[s] for s in SETTINGS)
    costs = [a / ((b + c) / 2) - 1 for a, b, c in zip(on, off, again)]
    noises = [b / c - 1 for b, c in zip(off, again)]
    low, cost, high = quartiles(costs)
    noise = statistics.median(noises)
    met, trusted = cost <= TARGET, abs(noise) <= TARGET / 2
    verdict = ("met" if met else "NOT met") + ("" if trusted else " (A/A > 0.5%: noisy)")
    print(f"{name:<9}{statistics.median(on) * 1e6:>9.2f}{statistics.median(off) * 1e6:>9.2f}"
          f"{statistics.median(again) * 1e6:>9.2f}{cost:>+9.2%}  [{low:+.1%}, {high:+.1%}]"
          f"{noise:>+9.2%}{p10(on) / ((p10(off) + p10(again)) / 2) - 1:>+9.2%}   {verdict}", flush=True)
    return met, trusted


def bytecodes_per_batch(engine: dict, stats: bool, batches: int = 2000) -> float:
    """Python bytecodes the calling thread executes per batch (deterministic)."""
    batches_iter = iter(pipeload.DataLoader(PythonInts(10**9), batch_size=BATCH_SIZE, stats=stats, **engine))
    for _ in range(200):  # past the loader's first 64 batches, which are all timed
        next(batches_iter)
    count = 0

    def tracer(frame: Any, event: str, arg: Any) -> Any:
        nonlocal count
        frame.f_trace_opcodes = True
        count += event == "opcode"
        return tracer

    sys.settrace(tracer)
    try:
        for _ in range(batches):
            next(batches_iter)
    finally:
        sys.settrace(None)
    return count / batches


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench.stats_overhead",
                                     description=__doc__.split("\n")[0])
    parser.add_argument("--burst", type=int, default=64, help="batches per burst")
    parser.add_argument("--rounds", type=int, default=400)
    parser.add_argument("--engine", action="append", choices=sorted(ENGINES))
    args = parser.parse_args(argv)
    print(f"tiny items: ints, batch {BATCH_SIZE}; {args.rounds} rounds of a {args.burst}-batch burst "
          f"from each of on / off / off again, rotating; load average {os.getloadavg()[0]:.1f}")
    print(f"{'':<9}{'CPU us/batch (median)':^27}{'cost: median of per-round ratios':^36}{'A/A':>7}"
          f"{'cost p10':>9}")
    print(f"{'engine':<9}{'on':>9}{'off':>9}{'again':>9}{'median':>9}  {'[quartiles]':<17}{'':>9}")
    print("Python bytecodes per batch in the calling thread (deterministic):")
    for name in args.engine or list(ENGINES):
        if name == "economic":
            continue  # its batches take milliseconds: a few bytecodes are far below 1%
        on, off = (bytecodes_per_batch(ENGINES[name], stats) for stats in (True, False))
        print(f"  {name:<9} on {on:8.1f}  off {off:8.1f}  stats add {on - off:+6.1f}", flush=True)
    results = [report(name, rounds_of(ENGINES[name], args.burst, max(20, int(args.rounds * FEWER.get(name, 1)))))
               for name in args.engine or list(ENGINES)]
    met = all(m for m, _ in results)
    trusted = all(t for _, t in results)
    print("stats overhead target (<= 1% CPU per batch): "
          + ("met on every engine" if met else "NOT met on every engine")
          + ("" if trusted else "; some A/A controls exceeded 0.5%: read those figures against them")
          + f"; load average now {os.getloadavg()[0]:.1f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
