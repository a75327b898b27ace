"""What stats cost: the tiny-items workload with ``stats=True`` and ``stats=False``, same run.

    python -m bench.stats_overhead [--rounds 300] [--burst 8] [--round-batches 64]
        [--generations 30] [--engine NAME ...] [--no-bytecodes | --no-cpu]

Tiny items (Python ints, batch 64) make the loader's own per-batch work the whole cost, so any
overhead of the stats shows there first. For each engine three loaders run side by side, each
one long epoch, warmed up first: stats on, stats off, and stats off again (an A/A control: what
the two "off" loaders differ by is the machine's noise and the method's bias, not ours).

Two measures:

- **Python bytecodes per batch** in the calling thread, on and off (``sys.settrace`` opcode
  events, past the loader's all-timed start): deterministic for the inline engine, whose whole
  work runs in that thread. Beside workers the main process's count also holds its polling
  while it waits for them, which varies from run to run (and more on a loaded machine): it is
  taken twice, with a pause before each batch so that the workers are ahead and every report
  has arrived ("workers ahead": the main side's own work, nearly deterministic), and back to
  back (the median of runs, with their range). This settles a fraction of a percent where no
  clock can on a shared machine.
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
out of them. Two loaders with the same settings can differ by a percent or two for as long as
they live (where their objects landed in memory): the three loaders are therefore made afresh
``--generations`` times, in a rotating order of creation, and the rounds spread over them. The
cost is the median of the ratios, with a 95% confidence interval from a bootstrap that resamples
whole generations (fixed seed), so that what differs between instances widens the interval
rather than fools it. The verdict, against the 1% target:

- "can't tell" when the A/A interval reaches past +-1%: the method cannot tell two loaders
  with the same settings apart to 1% on this machine now (noise, or a bias of its own);
- otherwise "met" when the cost's interval ends at or below +1%, "NOT met" when it begins
  above +1%, and "can't tell" when it straddles 1%.

The bytecode count is also taken in the workers of the process and thread engines: worker
threads are traced from here; each worker process traces itself from its ``worker_init_fn`` on
and keeps its count in memory it shares with this process.
"""

from __future__ import annotations

import argparse
import functools
import itertools
import multiprocessing
import os
import sys
import threading
import time
from collections.abc import Sequence
from typing import Any

import numpy as np
import psutil

import pipeload
from pipeload.stats.clock import TIME_ALL_FIRST
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
# All six orders, in a cycle where no loader takes two bursts in a row and each follows each of
# the other two equally often (three times in 18 bursts), across the triples' seams too. A burst
# right after the same loader's previous one runs on warm caches: itertools.permutations' order
# gives "on" and "off" one such pair per cycle and "off again" none, which read about 0.6% dearer
# for "off again" with all three loaders alike (python -m bench.stats_parts --variant all-off).
ORDERS = [(0, 1, 2), (0, 2, 1), (2, 1, 0), (1, 0, 2), (1, 2, 0), (2, 0, 1)]
FEWER = {"economic": 0.1}  # economic mode moves every tiny item on its own: a burst takes 100x longer
BYTECODE_BATCHES = {"economic": 200}  # its main thread runs little per batch, but slowly traced
WORKERS_TRACED = {"process": "worker processes", "thread": "worker threads"}
PAUSE_S = {"economic": 0.02}  # before each batch of the "workers ahead" count: time to refill
BOOTSTRAP_RESAMPLES = 2000
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
        # Warm-up: workers started, and past the stats' start, where every worker times all of
        # its first TIME_ALL_FIRST tasks (and the loop its first batches): a fixed cost of a
        # few milliseconds per loader, which the loaders made afresh for every generation would
        # otherwise pay again and again, and which a training run pays once.
        for _ in range(3 * size + 2 * TIME_ALL_FIRST * max(1, engine.get("num_workers", 0))):
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


def triples_of(engine: dict, burst: int, triples: int, generations: int) -> tuple[dict[str, list[float]], list[int]]:
    """Per setting: CPU seconds per batch of each triple's burst; and each triple's generation.

    Loaders are made afresh ``generations`` times (in a rotating order of creation): two loaders
    with the same settings can differ by a percent or two for as long as they live (where their
    objects landed in memory, which hash buckets they share), so a single instance per setting
    would mistake that for a cost. Each generation's first six triples (all orders) warm up."""
    dataset = PythonInts(10**9)
    runs: dict[str, list[float]] = {setting: [] for setting in SETTINGS}
    generation_of: list[int] = []
    for generation in range(generations):
        count = triples * (generation + 1) // generations - triples * generation // generations
        created = {}
        for which in ORDERS[generation % len(ORDERS)]:
            created[which] = Burst(dataset, engine, SETTINGS[which] == "on", burst)
        bursts = [created[which] for which in range(len(SETTINGS))]
        for index in range(count + len(ORDERS)):
            for which in ORDERS[index % len(ORDERS)]:
                took = bursts[which].take()
                if bursts[which].pids or bursts[which].threads:
                    time.sleep(min(took, 0.05))  # its helpers refill what it took (see docstring)
        for setting, one in zip(SETTINGS, bursts):
            runs[setting] += one.per_batch()[len(ORDERS):]
            one.close()
        generation_of += [generation] * count
    return runs, generation_of


def median_interval(values: np.ndarray, groups: np.ndarray, rng: np.random.Generator) -> tuple[float, float, float]:
    """(low, median, high): the median and its confidence interval, by a bootstrap that
    resamples whole groups (generations of loaders), so that what differs between loaders'
    instances widens the interval as it should."""
    members = [np.flatnonzero(groups == group) for group in np.unique(groups)]
    medians = np.empty(BOOTSTRAP_RESAMPLES)
    for resample in range(BOOTSTRAP_RESAMPLES):
        chosen = rng.integers(0, len(members), size=len(members))
        medians[resample] = np.median(values[np.concatenate([members[i] for i in chosen])])
    tail = (1 - CONFIDENCE) / 2
    low, high = np.quantile(medians, [tail, 1 - tail])
    return float(low), float(np.median(values)), float(high)


def verdict(cost: tuple[float, float, float], noise: tuple[float, float, float]) -> str:
    """The 1% verdict from the cost's and the A/A's intervals (see the module docstring)."""
    if noise[0] < -TARGET or noise[2] > TARGET:
        return "can't tell: the A/A interval reaches past 1%"
    if cost[2] <= TARGET:
        return "met"
    if cost[0] > TARGET:
        return "NOT met"
    return "can't tell: the interval straddles 1%"


def report(name: str, runs: dict[str, list[float]], groups: list[int]) -> str:
    """One engine's line; returns its verdict."""
    on, off, again = (np.array(runs[s]) for s in SETTINGS)
    rng = np.random.default_rng(12)
    cost = median_interval(on / ((off + again) / 2) - 1, np.array(groups), rng)
    noise = median_interval(off / again - 1, np.array(groups), rng)
    said = verdict(cost, noise)
    print(f"{name:<9}{len(on):>6}{np.median(on) * 1e6:>9.2f}{np.median(off) * 1e6:>9.2f}"
          f"{np.median(again) * 1e6:>9.2f}{cost[1]:>+9.2%} [{cost[0]:+.2%}, {cost[2]:+.2%}]"
          f"{noise[1]:>+9.2%} [{noise[0]:+.2%}, {noise[2]:+.2%}]   {said}", flush=True)
    return said


def bytecodes_per_batch(engine: dict, stats: bool, batches: int = 2000, workers: bool = False,
                        pause_s: float = 0.0) -> float:
    """Python bytecodes per batch that the calling thread executes inside ``next()``, or with
    ``workers``, that the loader's workers execute: its worker threads (traced from here), or
    its worker processes (each traces itself from its ``worker_init_fn`` on and keeps its count
    in memory shared with this process). ``pause_s`` before each ``next()`` lets the workers
    get ahead, so that the count is the main side's own work, not how often it polled while
    waiting for them (that varies from run to run with the machine's load)."""
    count = 0

    def tracer(frame: Any, event: str, arg: Any) -> Any:
        nonlocal count
        frame.f_trace_opcodes = True
        count += event == "opcode"
        return tracer

    in_processes = workers and engine.get("worker_type", "process") == "process"
    counts = multiprocessing.get_context("fork").RawArray("q", max(1, engine.get("num_workers", 0)))
    if in_processes:
        engine = {**engine, "multiprocessing_context": "fork",
                  "worker_init_fn": functools.partial(_count_bytecodes_here, counts)}
    elif workers:
        threading.settrace(tracer)  # the threads started from now on: the loader's workers
    try:
        batches_iter = iter(pipeload.DataLoader(PythonInts(10**9), batch_size=BATCH_SIZE, stats=stats, **engine))
        for _ in range(200):  # past the loader's first 64 batches, which are all timed
            next(batches_iter)
    finally:
        threading.settrace(None)
    before = count + sum(counts)
    for _ in range(batches):
        if pause_s:
            time.sleep(pause_s)
        if not workers:
            sys.settrace(tracer)
        try:
            next(batches_iter)
        finally:
            sys.settrace(None)
    # Workers run ahead by the tasks in flight at both reads alike: the difference is the
    # work of ``batches`` tasks.
    counted = count + sum(counts) - before
    del batches_iter  # its workers stop before the next measure starts
    return counted / batches


def _count_bytecodes_here(counts: Any, worker_id: int) -> None:
    """A worker process's ``worker_init_fn``: count the bytecodes this thread runs from now
    on (the loop's frames entered after this), into ``counts[worker_id]``."""
    count = 0

    def tracer(frame: Any, event: str, arg: Any) -> Any:
        nonlocal count
        frame.f_trace_opcodes = True
        if event == "opcode":
            count += 1
            counts[worker_id] = count
        return tracer

    sys.settrace(tracer)


def bytecodes_line(name: str, engine: dict, batches: int, runs: int, workers: bool = False,
                   pause_s: float = 0.0) -> None:
    """On minus off, ``runs`` times in turn (the median, and the range when they differ)."""
    pairs = [[bytecodes_per_batch(engine, stats, batches, workers, pause_s) for stats in (True, False)]
             for _ in range(runs)]
    added = sorted(on - off for on, off in pairs)
    on, off = (float(np.median([pair[i] for pair in pairs])) for i in (0, 1))
    spread = f" (runs: {added[0]:+.1f} .. {added[-1]:+.1f})" if runs > 1 and added[0] != added[-1] else ""
    print(f"  {name:<30} on {on:8.1f}  off {off:8.1f}  stats add {float(np.median(added)):+6.1f} "
          f"({float(np.median(added)) / off:+.2%}){spread}", flush=True)


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench.stats_overhead",
                                     description=__doc__.split("\n")[0])
    parser.add_argument("--rounds", type=int, default=300,
                        help="rounds per engine (economic: a tenth, at least 20); each takes "
                             "--round-batches batches from each loader")
    parser.add_argument("--round-batches", type=int, default=64, help="batches per loader per round")
    parser.add_argument("--burst", type=int, default=8, help="batches per burst (a round alternates "
                                                              "round-batches / burst times)")
    parser.add_argument("--generations", type=int, default=30,
                        help="times each engine's three loaders are made afresh (at least 4, and "
                             "20 triples each at least)")
    parser.add_argument("--engine", action="append", choices=sorted(ENGINES))
    parser.add_argument("--no-bytecodes", action="store_true", help="skip the bytecode count")
    parser.add_argument("--no-cpu", action="store_true", help="skip the CPU time measure (the "
                                                              "bytecode count alone is robust to load)")
    parser.add_argument("--bytecode-runs", type=int, default=5, help="on/off pairs of the bytecode count")
    args = parser.parse_args(argv)
    if args.no_bytecodes and args.no_cpu:
        parser.error("--no-bytecodes and --no-cpu together leave nothing to measure")
    if args.rounds < 1 or args.burst < 1 or args.round_batches < args.burst:
        parser.error("--rounds and --burst must be positive, --round-batches at least --burst")
    engines = args.engine or list(ENGINES)
    per_round = args.round_batches // args.burst
    print(f"tiny items: ints, batch {BATCH_SIZE}; {args.rounds} rounds of {args.round_batches} "
          f"batches from each of on / off / off again, in bursts of {args.burst}, alternating; "
          f"load average {os.getloadavg()[0]:.1f}; pid {os.getpid()}", flush=True)
    if not args.no_bytecodes:
        print(f"Python bytecodes per batch (median of {args.bytecode_runs} runs of on and off in turn):")
        for name in engines:
            batches = BYTECODE_BATCHES.get(name, 2000)
            if name == "inline":
                bytecodes_line(name, ENGINES[name], batches, args.bytecode_runs)
                continue
            pause_s = PAUSE_S.get(name, 0.002)
            bytecodes_line(f"{name} (main, workers ahead)", ENGINES[name], batches, args.bytecode_runs,
                           pause_s=pause_s)
            bytecodes_line(f"{name} (main, back to back)", ENGINES[name], batches, args.bytecode_runs)
            if name in WORKERS_TRACED:
                bytecodes_line(f"{name} ({WORKERS_TRACED[name]})", ENGINES[name], batches,
                               args.bytecode_runs, workers=True)
    if args.no_cpu:
        return 0
    print(f"CPU time per batch (us, medians); cost and A/A: median of per-triple ratios "
          f"[{CONFIDENCE:.0%} interval]")
    print(f"{'engine':<9}{'triples':>6}{'on':>9}{'off':>9}{'again':>9}{'cost':>9} {'[interval]':<19}"
          f"{'A/A':>8} {'[interval]':<19}   verdict")
    verdicts = {}
    for name in engines:
        rounds = max(20, int(args.rounds * FEWER.get(name, 1)))
        triples = rounds * per_round
        generations = max(4, min(args.generations, triples // 20))
        verdicts[name] = report(name, *triples_of(ENGINES[name], args.burst, triples, generations))
    print("stats overhead target (<= 1% CPU per batch): "
          + ", ".join(f"{name} {said.split(':')[0]}" for name, said in verdicts.items())
          + f"; load average now {os.getloadavg()[0]:.1f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
