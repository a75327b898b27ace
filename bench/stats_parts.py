"""Where the process engine's stats cost goes: ``bench.stats_overhead``'s CPU measure, with parts
of the stats turned off in the "on" loader.

    python -m bench.stats_parts [--variant NAME ...] [--triples 3000] [--generations 30] [--by-side]
    python -m bench.stats_parts --direct
    python -m bench.stats_parts --serve-times
    python -m bench.stats_parts --thread-functions

Each variant runs the same method as ``python -m bench.stats_overhead --engine process``
(loaders "on", "off" and "off again", bursts in a balanced rotating order, made afresh in generations, the
median of per-triple ratios with a bootstrap interval), after patching this process's modules
(the workers are forked, so they run the patched code too). Since stop 22 the classic pool's
ledger counts each worker's answers, so the main process counts no report in any variant (the
variants that turn "counting" off now differ from ``as-is`` only for economic mode, which this
script does not run), and every gap between timed tasks is stretched for short tasks on top of
what a variant sets (``stats.clock.SPACING_S``):

    all-off       the "on" loader's stats are off as well: what the method reads for no cost
    as-is         the code as it is
    main-only     workers get no clock: only the main process's side of the stats
    workers-only  the main process neither counts reports nor times the training loop
    stats-off-path  workers keep a clock but fetch as with stats off, and never time a task
    rarely-timed  workers time their first task only (the numbered fetch path, no timed tasks)
    every-256     workers time one task in 256 instead of 64
    sparse        as every-256, and the main process times the loop's waits and looks at the
                  queue about once in 128 batches instead of 32
    main-sparse   the main process times the loop's waits and looks at the queue about once in
                  128 batches instead of 32; workers as they are
    sparsest      workers time one task in 1024, the main process once in 512 batches
    main-counts-only  as main-only, and the training loop's waits are not timed either: the main
                  process only counts reports (and looks at the queue now and then)
    main-waits-only   as main-only, and reports are not counted: waits and queue looks only
    nothing-done  stats on, with every part above turned off (no clocks, no counting, no
                  waits, no queue looks): what a stats-on loader costs for its set-up alone
    off-but-counting  all three loaders' stats off; the "on" loader's main process counts its
                  reports per worker all the same (as ``WorkerGroup.receive`` did before
                  stop 22, and does in economic mode), and nothing else

``--direct`` instead times three pieces on their own, in this process: a worker's task timed
against untimed (fetch, collate and the report's pickle), the numbered fetch path against the
stats-off one, and ``SessionStats.record_answered`` (a report with totals) per call and per batch
in a real 2-worker loader.

``--serve-times`` instead reads a worker process's CPU per untimed and per timed task in a
stats-on loader taken in bursts (where a timed task's code runs cold). ``--engine thread`` runs
the variants on thread workers. ``--thread-functions`` instead counts one thread worker's
bytecodes per task by function, stats on minus off.

``--by-side`` also splits each setting's CPU per batch into the calling thread and the workers. Variants run in the order given, in separate processes (each patch is for good).
"""

from __future__ import annotations

import argparse
import itertools
import math
import subprocess
import sys
from collections.abc import Callable, Sequence

import numpy as np

VARIANTS = ("all-off", "as-is", "main-only", "workers-only", "main-counts-only", "main-waits-only", "nothing-done", "off-but-counting", "stats-off-path", "rarely-timed", "every-256", "sparse", "main-sparse", "sparsest")


def _all_off() -> None:
    import bench.stats_overhead as overhead

    made = overhead.Burst.__init__

    def without_stats(self, dataset, engine, stats, size) -> None:  # type: ignore[no-untyped-def]
        made(self, dataset, engine, False, size)

    overhead.Burst.__init__ = without_stats  # type: ignore[method-assign]


def _main_only() -> None:
    import pipeload.engine.worker_main as worker_main

    worker_main.StageClock = lambda every: None  # type: ignore[assignment,misc]


def _workers_only() -> None:
    import pipeload.engine.workers as workers
    import pipeload.stats.recorder as recorder

    made = workers.WorkerGroup.__init__

    def not_recording(self, *args, **kwargs) -> None:  # type: ignore[no-untyped-def]
        made(self, *args, **kwargs)
        self._record = False

    workers.WorkerGroup.__init__ = not_recording  # type: ignore[method-assign]
    recorder._Consumer.epoch_started = lambda self, called_at=None: recorder.EpochCount(math.inf)  # type: ignore[method-assign]


def _main_counts_only() -> None:
    import pipeload.stats.recorder as recorder

    _main_only()
    recorder._Consumer.epoch_started = lambda self, called_at=None: recorder.EpochCount(math.inf)  # type: ignore[method-assign]


def _main_waits_only() -> None:
    import pipeload.engine.workers as workers

    _main_only()
    made = workers.WorkerGroup.__init__

    def not_recording(self, *args, **kwargs) -> None:  # type: ignore[no-untyped-def]
        made(self, *args, **kwargs)
        self._record = False

    workers.WorkerGroup.__init__ = not_recording  # type: ignore[method-assign]


def _nothing_done() -> None:
    import pipeload.stats.recorder as recorder

    _main_waits_only()
    recorder._Consumer.epoch_started = lambda self, called_at=None: recorder.EpochCount(math.inf)  # type: ignore[method-assign]
    recorder.SessionStats.handing_out = lambda self, *args: math.inf  # type: ignore[method-assign]


def _off_but_counting() -> None:
    import collections

    import bench.stats_overhead as overhead
    import pipeload.engine.workers as workers
    from pipeload.stats.recorder import count_by_worker, worker_of

    making_on = [False]
    made_burst = overhead.Burst.__init__

    def burst(self, dataset, engine, stats, size) -> None:  # type: ignore[no-untyped-def]
        making_on[0] = stats
        made_burst(self, dataset, engine, False, size)
        making_on[0] = False

    made_group = workers.WorkerGroup.__init__
    receive = workers.WorkerGroup.receive

    def group(self, *args, **kwargs) -> None:  # type: ignore[no-untyped-def]
        made_group(self, *args, **kwargs)
        self.counting_alone = collections.defaultdict(int) if making_on[0] else None

    def counting_receive(self, deadline):  # type: ignore[no-untyped-def]
        reports = receive(self, deadline)
        if self.counting_alone is not None:
            count_by_worker(self.counting_alone, map(worker_of, reports))
        return reports

    overhead.Burst.__init__ = burst  # type: ignore[method-assign]
    workers.WorkerGroup.__init__ = group  # type: ignore[method-assign]
    workers.WorkerGroup.receive = counting_receive  # type: ignore[method-assign]


def _stats_off_path() -> None:
    import pipeload.engine.fetch as fetch

    made = fetch.MapFetcher.__init__

    def without_clock(self, spec, clock=None, seeding=None) -> None:  # type: ignore[no-untyped-def]
        made(self, spec, None, seeding)

    fetch.MapFetcher.__init__ = without_clock  # type: ignore[method-assign]


def _rarely_timed() -> None:
    import pipeload.stats.clock as clock

    clock.TIME_ALL_FIRST = 0
    clock.gaps = lambda every: itertools.cycle([10**9])  # type: ignore[assignment]


def _every_256() -> None:
    import pipeload.engine.worker_main as worker_main

    worker_main.SAMPLE_EVERY = 256  # type: ignore[misc]


def _sparse() -> None:
    import pipeload.stats.recorder as recorder

    _every_256()
    recorder.LOOK_EVERY = 128  # type: ignore[misc]


def _main_sparse() -> None:
    import pipeload.stats.recorder as recorder

    recorder.LOOK_EVERY = 128  # type: ignore[misc]


def _sparsest() -> None:
    import pipeload.engine.worker_main as worker_main
    import pipeload.stats.recorder as recorder

    worker_main.SAMPLE_EVERY = 1024  # type: ignore[misc]
    recorder.LOOK_EVERY = 512  # type: ignore[misc]


PATCHES: dict[str, Callable[[], None]] = {
    "all-off": _all_off, "as-is": lambda: None, "main-only": _main_only,
    "workers-only": _workers_only, "main-counts-only": _main_counts_only,
    "main-waits-only": _main_waits_only, "nothing-done": _nothing_done,
    "off-but-counting": _off_but_counting, "stats-off-path": _stats_off_path,
    "rarely-timed": _rarely_timed, "every-256": _every_256, "sparse": _sparse,
    "main-sparse": _main_sparse, "sparsest": _sparsest,
}


def run_variant(variant: str, triples: int, generations: int, by_side: bool, engine: str = "process") -> str:
    """One variant's line (in this process: the patches stay)."""
    PATCHES[variant]()
    import bench.stats_overhead as overhead

    sides: dict[str, list[tuple[list[float], list[float]]]] = {setting: [] for setting in overhead.SETTINGS}
    per_batch = overhead.Burst.per_batch

    def kept(self) -> list[float]:  # type: ignore[no-untyped-def]
        totals = per_batch(self)
        helpers = np.diff(self.helpers_at)
        setting = overhead.SETTINGS[len(sides_seen) % len(overhead.SETTINGS)]
        sides_seen.append(setting)
        sides[setting].append(([m / self.size for m in self.main_s][len(overhead.ORDERS):],
                               [h / self.size for h in helpers][len(overhead.ORDERS):]))
        return totals

    sides_seen: list[str] = []
    overhead.Burst.per_batch = kept  # type: ignore[method-assign]
    runs, generation_of = overhead.triples_of(overhead.ENGINES[engine], 8, triples, generations)
    on, off, again = (np.array(runs[setting]) for setting in overhead.SETTINGS)
    groups = np.array(generation_of)
    rng = np.random.default_rng(0)
    cost = overhead.median_interval(on / ((off + again) / 2) - 1, groups, rng)
    noise = overhead.median_interval(off / again - 1, groups, rng)
    line = (f"{variant:<15} cost {cost[1]:+.2%} [{cost[0]:+.2%}, {cost[2]:+.2%}]   "
            f"A/A {noise[1]:+.2%} [{noise[0]:+.2%}, {noise[2]:+.2%}]")
    if by_side:
        for side, name in ((0, "calling thread"), (1, f"worker {'threads' if engine == 'thread' else 'processes'}")):
            medians = [1e6 * float(np.median([x for one in sides[s] for x in one[side]])) for s in overhead.SETTINGS]
            line += f"\n    {name}: " + " / ".join(f"{m:.2f}" for m in medians) + " us per batch (on / off / again)"
    return line


def direct() -> str:
    """The three direct measures of ``--direct`` (medians of repeated runs)."""
    import pickle
    import statistics
    import time

    import pipeload
    import pipeload.stats.recorder as recorder
    from bench.workloads import PythonInts
    from pipeload.collate import default_collate
    from pipeload.engine.fetch import MapFetcher
    from pipeload.engine.plan import DatasetKind, FetchSpec
    from pipeload.stats.clock import StageClock
    from pipeload.transport.messages import Report, WorkerReport

    indices = list(range(64))

    def clock() -> StageClock:
        made = StageClock()
        made.untimed_size = 64
        made.counted_by_receiver(2)
        return made

    def tasks_us(every_task_timed: bool, tasks: int = 20_000) -> float:
        own = clock()
        fetcher = MapFetcher(FetchSpec(list(range(100)), DatasetKind.MAP, True, default_collate, False), own)
        started = time.thread_time()
        for task in range(tasks):
            if every_task_timed:
                own.next_timed = 0
            batch = fetcher.fetch(indices, 2 * task)
            totals = own.finished(batch) if own.timing else None
            pickle.dumps(WorkerReport(Report.BATCH, 0, 2 * task, None, totals))
        return (time.thread_time() - started) / tasks * 1e6

    def fetch_ns(with_clock: bool, tasks: int = 200_000) -> float:
        own = clock()
        own.next_timed = 10**12
        fetcher = MapFetcher(FetchSpec(list(range(100)), DatasetKind.MAP, True, lambda x: x, False),
                             own if with_clock else None)
        started = time.perf_counter()
        for task in range(tasks):
            fetcher.fetch(indices, task)
        return (time.perf_counter() - started) / tasks * 1e9

    pairs = [(tasks_us(False), tasks_us(True)) for _ in range(5)]
    untimed, timed = (statistics.median(pair[i] for pair in pairs) for i in (0, 1))
    paths = [(fetch_ns(True), fetch_ns(False)) for _ in range(7)]
    numbered, plain = (statistics.median(pair[i] for pair in paths) for i in (0, 1))
    spent = [0.0, 0]
    record = recorder.SessionStats.record_answered

    def timed_record(self, report) -> None:  # type: ignore[no-untyped-def]
        started = time.perf_counter()
        record(self, report)
        spent[0] += time.perf_counter() - started
        spent[1] += 1

    recorder.SessionStats.record_answered = timed_record  # type: ignore[method-assign]
    batches = iter(pipeload.DataLoader(PythonInts(10**9), batch_size=64, num_workers=2))
    for _ in range(300):
        next(batches)
    spent[:] = [0.0, 0]
    count = 20_000
    for _ in range(count):
        next(batches)
    del batches
    return (f"a worker's task: {untimed:.2f} us untimed, {timed:.2f} us timed ({timed - untimed:+.2f} us)\n"
            f"fetch path: numbered {numbered:.0f} ns, stats off {plain:.0f} ns ({numbered - plain:+.0f} ns a task)\n"
            f"SessionStats.record_answered: {spent[1]} calls in {count} batches, {spent[0] / max(1, spent[1]) * 1e6:.1f} us "
            f"a call, {spent[0] / count * 1e6:.3f} us per batch")


def serve_times(bursts: int = 1500) -> str:
    """A worker process's CPU per task, untimed and timed, as the workers of a stats-on loader
    spend it when its batches are taken in bursts (as the bench takes them): the timed tasks'
    code runs cold among the untimed ones. Read with ``time.thread_time_ns`` around
    ``WorkerLoop._serve`` in the workers (forked: the wrapper travels with them)."""
    import multiprocessing
    import time

    import pipeload
    import pipeload.engine.worker_main as worker_main
    from bench.workloads import PythonInts

    sums = multiprocessing.Array("d", 4, lock=False)  # untimed: tasks, ns; timed: tasks, ns
    serve = worker_main.WorkerLoop._serve

    def timed_serve(self, command) -> None:  # type: ignore[no-untyped-def]
        timed = self._clock is not None and command.batch_number >= self._clock.next_timed
        started = time.thread_time_ns()
        serve(self, command)
        sums[2 * timed] += 1
        sums[2 * timed + 1] += time.thread_time_ns() - started

    worker_main.WorkerLoop._serve = timed_serve  # type: ignore[method-assign]
    batches = iter(pipeload.DataLoader(PythonInts(10**9), batch_size=64, num_workers=2))
    for _ in range(200):
        next(batches)
    for index in range(4):
        sums[index] = 0
    for _ in range(bursts):
        started = time.perf_counter()
        for _ in range(8):
            next(batches)
        time.sleep(2 * (time.perf_counter() - started))  # as the bench's other two loaders' bursts
    del batches
    untimed_us, timed_us = (sums[2 * k + 1] / max(1, sums[2 * k]) / 1e3 for k in (0, 1))
    return (f"a worker process's task, CPU in the worker: untimed {untimed_us:.1f} us ({int(sums[0])} tasks), "
            f"timed {timed_us:.1f} us ({int(sums[2])} tasks), {timed_us - untimed_us:+.1f} us a timed task")


def thread_worker_functions(batches: int = 3000) -> str:
    """Python bytecodes per task in one thread worker, per function, stats on minus off
    (``threading.settrace`` opcode events, counted past the stats' all-timed start). Tracing
    slows every task, so the tasks look long to the clock and are timed one in 64 here, not
    stretched as in a real run: the timed functions' share reads high."""
    import collections
    import threading

    import pipeload
    from bench.workloads import PythonInts

    def per_function(stats: bool) -> dict[str, float]:
        counts: collections.Counter[str] = collections.Counter()
        tracing = [False]

        def local(frame, event, arg):  # type: ignore[no-untyped-def]
            if event == "opcode" and tracing[0]:
                counts[frame.f_code.co_qualname] += 1
            return local

        def tracer(frame, event, arg):  # type: ignore[no-untyped-def]
            frame.f_trace_opcodes = True
            return local

        loader = pipeload.DataLoader(PythonInts(10**9), batch_size=64, num_workers=1, worker_type="thread",
                                     stats=stats)
        threading.settrace(tracer)  # the worker thread starts with the iterator
        iterator = iter(loader)
        threading.settrace(None)  # type: ignore[arg-type]
        for _ in range(batches):
            next(iterator)
        tracing[0] = True
        for _ in range(batches):
            next(iterator)
        tracing[0] = False
        del iterator
        return {name: count / batches for name, count in counts.items()}

    on, off = per_function(True), per_function(False)
    names = sorted(set(on) | set(off), key=lambda name: -abs(on.get(name, 0) - off.get(name, 0)))
    lines = [f"  {name:<40} {on.get(name, 0) - off.get(name, 0):+7.2f}" for name in names[:8]]
    return (f"one thread worker, bytecodes per task, stats on minus off: {sum(on.values()) - sum(off.values()):+.1f}"
            f" (of {sum(off.values()):.0f})\n" + "\n".join(lines))


def burst_count_us() -> str:
    """What counting a burst of reports per worker costs the main process, as economic mode's
    ``WorkerGroup.receive`` does (and the classic pool's did before stop 22)."""
    import timeit
    from collections import defaultdict

    from pipeload.stats.recorder import carries_totals, count_by_worker, worker_of
    from pipeload.transport.messages import Report, WorkerReport

    lines = []
    for size in (1, 3):
        reports = [WorkerReport(Report.BATCH, i % 2, i, None, None) for i in range(size)]
        lag: dict[int, int] = defaultdict(int)

        def count() -> None:
            if not any(map(carries_totals, reports)):
                count_by_worker(lag, map(worker_of, reports))

        runs = 200_000
        lines.append(f"{min(timeit.repeat(count, number=runs, repeat=5)) / runs * 1e6:.2f} us for {size}")
    return "counting a burst of reports per worker: " + ", ".join(lines)


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench.stats_parts", description=__doc__.split("\n")[0])
    parser.add_argument("--variant", action="append", choices=VARIANTS)
    parser.add_argument("--triples", type=int, default=3000)
    parser.add_argument("--generations", type=int, default=30)
    parser.add_argument("--by-side", action="store_true")
    parser.add_argument("--direct", action="store_true", help="time three pieces on their own instead")
    parser.add_argument("--serve-times", action="store_true",
                        help="a worker process's CPU per untimed and per timed task instead")
    parser.add_argument("--thread-functions", action="store_true",
                        help="one thread worker's bytecodes per task, per function, stats on minus off, instead")
    parser.add_argument("--engine", choices=("process", "thread"), default="process",
                        help="the engine the variants run (default: process)")
    parser.add_argument("--one", choices=VARIANTS, help=argparse.SUPPRESS)  # a child's own variant
    args = parser.parse_args(argv)
    if args.triples < 20 or args.generations < 1:
        parser.error("--triples must be at least 20 and --generations positive")
    if args.direct:
        print(direct(), flush=True)
        print(burst_count_us(), flush=True)
        return 0
    if args.serve_times:
        print(serve_times(), flush=True)
        return 0
    if args.thread_functions:
        print(thread_worker_functions(), flush=True)
        return 0
    if args.one:
        print(run_variant(args.one, args.triples, args.generations, args.by_side, args.engine), flush=True)
        return 0
    for variant in args.variant or ["all-off", "as-is"]:
        command = [sys.executable, "-m", "bench.stats_parts", "--one", variant, "--triples", str(args.triples),
                   "--generations", str(args.generations), "--engine", args.engine] + (["--by-side"] if args.by_side else [])
        subprocess.run(command, check=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
