"""What stats cost: the tiny-items workload with ``stats=True`` and ``stats=False``, same run.

    python -m bench.stats_overhead [--rounds 300] [--burst 8] [--round-batches 64] [--engine NAME ...]

Tiny items (Python ints, batch 64) make the loader's own per-batch work the whole cost, so any
overhead of the stats shows there first. For each engine three loaders run side by side, each
one long epoch, warmed up first: stats on, stats off, and stats off again (an A/A control: what
the two "off" loaders differ by is the machine's noise and the method's bias, not ours).

Two measures:

- **Python bytecodes per batch** in the calling thread, on and off (``sys.settrace`` opcode
  events, past the loader's all-timed start): deterministic for the inline engine, whose whole
  work runs in that thread, nearly so for the main process's side of the worker engines (it
  polls a little more or less as the workers keep pace). This settles a fraction of a percent
  where no clock can on a shared machine.
- **CPU time per batch**: each round takes ``--round-batches`` batches from each loader in
  bursts of ``--burst``, alternating between the three loaders in all six orders in turn, so
  each comes first, second and third, and after each other, equally often. A burst's cost is
  the calling thread's CPU time during it (``time.thread_time``), plus the CPU time of the
  loader's own helpers (its worker processes, and its threads in this process) from the start
  of its burst to the start of its next one: a burst's batches are rebuilt by the workers just
  after it, and that refill is charged to it, not to whichever burst runs meanwhile. Between
  bursts the script pauses as long as the burst took, so refills end before the next burst.
  Waiting for a CPU counts in neither (the kernel's per-thread counters), as it would on the
  wall clock.

Each triple of bursts (one per loader, back to back) gives a ratio, on against the mean of the
two "off", and an A/A ratio, "off" against "off again": load that drifts between triples cancels
out of them. The cost is the median of the ratios, with a 95% confidence interval from a moving
block bootstrap (blocks of consecutive triples, so that slow drifts of the machine widen the
interval rather than fool it; fixed seed). The verdict, against the 1% target:

- "can't tell" when the A/A interval is wider than 1 point: the machine was too noisy (or the
  run too short) for a 1% verdict;
- "met" when the cost's interval ends at or below +1%;
- "NOT met" when it begins above +1%;
- "can't tell" otherwise (the interval straddles 1%).
"""

from __future__ import annotations

import argparse
import itertools
import os
import sys
import time
from collections.abc import Sequence
from typing import Any

import numpy as np
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
ORDERS = list(itertools.permutations(range(len(SETTINGS))))  # all six, in turn
FEWER = {"economic": 0.1}  # economic mode moves every tiny item on its own: a burst takes 100x longer
BYTECODE_BATCHES = {"economic": 200}  # its main thread runs little per batch, but slowly traced
BOOTSTRAP_RESAMPLES = 2000
BLOCK = 12  # triples per bootstrap block: a few seconds of the machine's drift at most
CONFIDENCE = 0.95


def _tasks_cpu_s(task_dirs: list[str]) -> float:
    """CPU seconds of the given threads (``/proc/PID/task/TID``); those gone count 0."""
    total = 0
    for task in task_dirs:
        try:
            with open(f"{task}/schedstat", "rb") as file:
                total += int(file.read().split()[0])
        except (OSError, ValueError, IndexError):
            pass
    return total / 1e9


def _threads_of(pid: int) -> list[str]:
    try:
        return [f"/proc/{pid}/task/{tid}" for tid in os.listdir(f"/proc/{pid}/task")]
    except OSError:
        return []


class Burst:
    """One loader's epoch, taken ``size`` batches at a time; see the module docstring for what
    a burst is charged."""

    known_pids: set[int] = set()
    known_threads: set[str] = set()

    def __init__(self, dataset: PythonInts, engine: dict, stats: bool, size: int) -> None:
        Burst.known_threads.update(_threads_of(os.getpid()))
        self.loader = pipeload.DataLoader(dataset, batch_size=BATCH_SIZE, stats=stats, **engine)
        self.batches = iter(self.loader)
        self.size = size
        for _ in range(3 * size):  # warm-up: workers started, first batches through
            next(self.batches)
        self.pids = [child.pid for child in psutil.Process().children(recursive=True)
                     if child.pid not in Burst.known_pids]
        Burst.known_pids.update(self.pids)
        # Its threads in this process (thread workers, pinning, economic routing): those that
        # appeared with it. The calling thread is measured apart.
        self.threads = sorted(set(_threads_of(os.getpid())) - Burst.known_threads)
        Burst.known_threads.update(self.threads)
        self.main_s: list[float] = []
        self.helpers_at: list[float] = []

    def helpers_cpu_s(self) -> float:
        tasks = list(self.threads)
        for pid in self.pids:
            tasks += _threads_of(pid)
        return _tasks_cpu_s(tasks)

    def take(self) -> float:
        """Take one burst; returns its wall time."""
        self.helpers_at.append(self.helpers_cpu_s())
        wall, cpu = time.perf_counter(), time.thread_time()
        for _ in range(self.size):
            next(self.batches)
        self.main_s.append(time.thread_time() - cpu)
        return time.perf_counter() - wall

    def per_batch(self) -> list[float]:
        """CPU seconds per batch of each burst taken (call once, after the last burst)."""
        self.helpers_at.append(self.helpers_cpu_s())
        helpers = np.diff(self.helpers_at)
        return [(main + helper) / self.size for main, helper in zip(self.main_s, helpers)]

    def close(self) -> None:
        self.batches = None  # stops the workers


def triples_of(engine: dict, burst: int, triples: int) -> dict[str, list[float]]:
    """Per setting: CPU seconds per batch of each triple's burst."""
    dataset = PythonInts(10**9)
    bursts = [Burst(dataset, engine, setting == "on", burst) for setting in SETTINGS]
    for index in range(triples + len(ORDERS)):  # the first six: warm-up in every order
        for which in ORDERS[index % len(ORDERS)]:
            took = bursts[which].take()
            if bursts[which].pids or bursts[which].threads:
                time.sleep(min(took, 0.05))  # its helpers refill what it took (see docstring)
    runs = {setting: one.per_batch()[len(ORDERS):] for setting, one in zip(SETTINGS, bursts)}
    for one in bursts:
        one.close()
    return runs


def median_interval(values: np.ndarray, rng: np.random.Generator) -> tuple[float, float, float]:
    """(low, median, high): the median and its confidence interval, by a moving block
    bootstrap over consecutive values."""
    n = len(values)
    block = min(BLOCK, n)
    starts = rng.integers(0, n - block + 1, size=(BOOTSTRAP_RESAMPLES, -(-n // block)))
    picks = (starts[:, :, None] + np.arange(block)).reshape(BOOTSTRAP_RESAMPLES, -1)[:, :n]
    medians = np.median(values[picks], axis=1)
    tail = (1 - CONFIDENCE) / 2
    low, high = np.quantile(medians, [tail, 1 - tail])
    return float(low), float(np.median(values)), float(high)


def verdict(cost: tuple[float, float, float], noise: tuple[float, float, float]) -> str:
    """The 1% verdict from the cost's and the A/A's intervals (see the module docstring)."""
    if noise[2] - noise[0] > TARGET:
        return "can't tell: A/A interval wider than 1 point"
    if cost[2] <= TARGET:
        return "met"
    if cost[0] > TARGET:
        return "NOT met"
    return "can't tell: the interval straddles 1%"


def report(name: str, runs: dict[str, list[float]]) -> str:
    """One engine's line; returns its verdict."""
    on, off, again = (np.array(runs[s]) for s in SETTINGS)
    rng = np.random.default_rng(12)
    cost = median_interval(on / ((off + again) / 2) - 1, rng)
    noise = median_interval(off / again - 1, rng)
    said = verdict(cost, noise)
    print(f"{name:<9}{len(on):>6}{np.median(on) * 1e6:>9.2f}{np.median(off) * 1e6:>9.2f}"
          f"{np.median(again) * 1e6:>9.2f}{cost[1]:>+9.2%} [{cost[0]:+.2%}, {cost[2]:+.2%}]"
          f"{noise[1]:>+9.2%} [{noise[0]:+.2%}, {noise[2]:+.2%}]   {said}", flush=True)
    return said


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
    del batches_iter  # its workers stop before the next measure starts
    return count / batches


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench.stats_overhead",
                                     description=__doc__.split("\n")[0])
    parser.add_argument("--rounds", type=int, default=300,
                        help="rounds per engine (economic: a tenth, at least 20); each takes "
                             "--round-batches batches from each loader")
    parser.add_argument("--round-batches", type=int, default=64, help="batches per loader per round")
    parser.add_argument("--burst", type=int, default=8, help="batches per burst (a round alternates "
                                                              "round-batches / burst times)")
    parser.add_argument("--engine", action="append", choices=sorted(ENGINES))
    parser.add_argument("--no-bytecodes", action="store_true", help="skip the bytecode count")
    args = parser.parse_args(argv)
    if args.rounds < 1 or args.burst < 1 or args.round_batches < args.burst:
        parser.error("--rounds and --burst must be positive, --round-batches at least --burst")
    engines = args.engine or list(ENGINES)
    per_round = args.round_batches // args.burst
    print(f"tiny items: ints, batch {BATCH_SIZE}; {args.rounds} rounds of {args.round_batches} "
          f"batches from each of on / off / off again, in bursts of {args.burst}, alternating; "
          f"load average {os.getloadavg()[0]:.1f}; pid {os.getpid()}", flush=True)
    if not args.no_bytecodes:
        print("Python bytecodes per batch in the calling thread (deterministic):")
        for name in engines:
            batches = BYTECODE_BATCHES.get(name, 2000)
            on, off = (bytecodes_per_batch(ENGINES[name], stats, batches) for stats in (True, False))
            print(f"  {name:<9} on {on:8.1f}  off {off:8.1f}  stats add {on - off:+6.1f} "
                  f"({(on - off) / off:+.2%})", flush=True)
    print(f"CPU time per batch (us, medians); cost and A/A: median of per-triple ratios "
          f"[{CONFIDENCE:.0%} interval]")
    print(f"{'engine':<9}{'triples':>6}{'on':>9}{'off':>9}{'again':>9}{'cost':>9} {'[interval]':<19}"
          f"{'A/A':>8} {'[interval]':<19}   verdict")
    verdicts = {}
    for name in engines:
        rounds = max(20, int(args.rounds * FEWER.get(name, 1)))
        verdicts[name] = report(name, triples_of(ENGINES[name], args.burst, rounds * per_round))
    print("stats overhead target (<= 1% CPU per batch): "
          + ", ".join(f"{name} {said.split(':')[0]}" for name, said in verdicts.items())
          + f"; load average now {os.getloadavg()[0]:.1f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
