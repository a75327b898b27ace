"""A pipe graph through pipeload's DataLoader against the same work as a map-style dataset
under torch.utils.data, in one run.

    python -m bench.datapipes [--items 3000] [--num-workers 2] [--repeats 3] [--work-ms 1.0]
    python -m bench.datapipes --cpu-per-item [--repeats 5]
    python -m bench.datapipes --large-items [--megabytes 1 38] [--items 200] [--repeats 3]
    python -m bench.datapipes --boundary-states [--repeats 9]

pipeload: ``IterableWrapper(range(items)).sharding_filter().map(work).batch(64).collate()``
through ``pipeload.DataLoader(pipe, batch_size=None, num_workers=k)``.
torch: a map-style dataset whose ``__getitem__`` does the same ``work`` through
``torch.utils.data.DataLoader(dataset, batch_size=64, num_workers=k)``.

``work`` is a pure-Python loop sized to take about ``--work-ms`` on this machine. Each repeat
runs both loaders, alternating which goes first; the table gives median samples/s and the ratio.

``--cpu-per-item`` measures what a busy machine disturbs less: the CPU time (``process_time``)
per item of a cheap graph, ``IterableWrapper(range(200_000)).sharding_filter().map(inc)
.batch(64)``, iterated directly and through ``DataLoader(pipe, batch_size=None)`` without workers
(median of ``--repeats``). Run it with two trees' ``PYTHONPATH`` to compare them.

``--large-items`` sends tensors of each ``--megabytes`` size through ``queue_boundary("process",
buffer_size=8)`` (torch has no such boundary to compare with): ``IterableWrapper(range(items))
.map(make)`` builds each tensor upstream ("built"), or ``.map(make_row).batch(64).collate()``
stacks it from 64 rows there ("collated"). The consumer reads one value per 4 KiB page of every
item, as a copy would. Per size and way, after a first run (whose shared memory the pipe may keep
for the next), the median over ``--repeats`` runs of: items/s from the first item to the last;
CPU per item of both processes (``getrusage``: this process, and the upstream process once it is
reaped at the run's end, its start included); minor page faults per item in the consumer and in
the upstream process. Fewer items are sent of large sizes (``--items`` MiB in all, at least 20).
Load-independent figures are the CPU and fault columns. Run it with two trees' ``PYTHONPATH`` to
compare them.

``--boundary-states`` measures what a thread boundary's checkpoints cost its pipe
(``boundary/positions.py``): ``IterableWrapper(range(n)).shuffle(buffer_size=100).map(work)
.prefetch(64)`` iterated directly, with work of ~0 and ~25 us an item, with the upstream's
states taken as usual and with them taken once only (``COST_RATIO`` set to infinity), the two
interleaved; median items/s of ``--repeats`` and the ratio.
"""

from __future__ import annotations

import argparse
import resource
import statistics
import sys
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import torch.utils.data

import pipeload
from bench.measure import measure, warm_up
from bench.workloads import PythonWork, _busy_loop, python_work_iterations
from pipeload.datapipes.iter import IterableWrapper

BATCH_SIZE = 64
WARMUP_BATCHES = 3


@dataclass(frozen=True)
class Work:
    """The per-item function, as a picklable object (the same loop the map-style dataset runs)."""

    iterations: int

    def __call__(self, index: int) -> int:
        return _busy_loop(index, self.iterations)


def pipeload_loader(items: int, iterations: int, num_workers: int) -> Callable[[], Any]:
    pipe = IterableWrapper(range(items)).sharding_filter().map(Work(iterations)).batch(BATCH_SIZE).collate()
    return lambda: pipeload.DataLoader(pipe, batch_size=None, num_workers=num_workers)


def torch_loader(items: int, iterations: int, num_workers: int) -> Callable[[], Any]:
    dataset = PythonWork(items, iterations)
    return lambda: torch.utils.data.DataLoader(dataset, batch_size=BATCH_SIZE, num_workers=num_workers)


CPU_ITEMS = 200_000


def _increment(x: int) -> int:
    return x + 1


def cpu_per_item(repeats: int) -> tuple[float, float]:
    """Median CPU nanoseconds per item: iterating the graph directly, and through the loader."""
    direct, inline = [], []
    for _ in range(repeats):
        pipe = IterableWrapper(range(CPU_ITEMS)).sharding_filter().map(_increment).batch(BATCH_SIZE)
        started = time.process_time()
        count = sum(len(batch) for batch in pipe)
        direct.append((time.process_time() - started) / count * 1e9)
        started = time.process_time()
        count = sum(len(batch) for batch in pipeload.DataLoader(pipe, batch_size=None))
        inline.append((time.process_time() - started) / count * 1e9)
    return statistics.median(direct), statistics.median(inline)


PAGE_BYTES = 4096
ROWS = 64  # a collated item is stacked from this many rows
BUFFER_SIZE = 8


@dataclass(frozen=True)
class MakeTensor:
    """Item ``i``: ``nbytes`` of float32 holding ``i`` (module level: it pickles)."""

    nbytes: int

    def __call__(self, index: int) -> torch.Tensor:
        return torch.full((self.nbytes // 4,), float(index))


@dataclass(frozen=True)
class RunFigures:
    items_per_s: float
    consumer_cpu_ms: float  # per item, first item to last
    upstream_cpu_ms: float  # per item, the whole upstream process (its start included)
    consumer_faults: float  # per item, first item to last
    upstream_faults: float  # per item, the whole upstream process


def large_item_pipe(nbytes: int, items: int, collated: bool) -> Any:
    if collated:
        rows = IterableWrapper(range(items * ROWS)).map(MakeTensor(nbytes // ROWS))
        upstream = rows.batch(ROWS).collate()
    else:
        upstream = IterableWrapper(range(items)).map(MakeTensor(nbytes))
    return upstream.queue_boundary("process", buffer_size=BUFFER_SIZE)


def _cpu_s(after: Any, before: Any) -> float:
    return after.ru_utime + after.ru_stime - before.ru_utime - before.ru_stime


def one_run(pipe: Any, items: int) -> RunFigures:
    """Read every item of one run of ``pipe``, one value per page, and say what it cost. The
    consumer is measured from its first item to its last (a run's start forks the upstream
    process, and this process then takes a copy-on-write fault for each page it writes)."""
    children_before = resource.getrusage(resource.RUSAGE_CHILDREN)
    iterator = iter(pipe)
    count, started, first = 0, 0.0, None
    for item in iterator:
        float(item.view(-1)[:: PAGE_BYTES // item.element_size()].sum())
        count += 1
        if count == 1:
            started, first = time.perf_counter(), resource.getrusage(resource.RUSAGE_SELF)
    elapsed, last = time.perf_counter() - started, resource.getrusage(resource.RUSAGE_SELF)
    del item, iterator  # the run ends: its upstream process is stopped and reaped
    if count != items:
        raise RuntimeError(f"read {count} items, expected {items}")
    children = resource.getrusage(resource.RUSAGE_CHILDREN)
    later = count - 1
    return RunFigures(later / elapsed, _cpu_s(last, first) / later * 1e3,
                      _cpu_s(children, children_before) / count * 1e3,
                      (last.ru_minflt - first.ru_minflt) / later,
                      (children.ru_minflt - children_before.ru_minflt) / count)


def large_items(megabytes: Sequence[float], total_mb: int, repeats: int) -> None:
    print(f"queue_boundary('process', buffer_size={BUFFER_SIZE}); median of {repeats} runs after a "
          "first; per item: CPU ms and minor faults of the consumer (first item to last) and of "
          "the upstream process (its whole life)")
    print(f"{'MiB':>6} {'how':9} {'items':>5} {'items/s':>9} {'CPU here':>9} {'upstream':>9} "
          f"{'faults here':>12} {'upstream':>9}  slabs made, items in one-shot buffers")
    for size in megabytes:
        nbytes = int(size * (1 << 20)) // (ROWS * 4) * ROWS * 4
        items = max(20, int(total_mb / size))
        for collated in (False, True):
            pipe = large_item_pipe(nbytes, items, collated)
            one_run(pipe, items)  # the first run: whatever it sets up may stay for the next
            runs = [one_run(pipe, items) for _ in range(repeats)]
            keeper = getattr(pipe, "_transient_slabs", None)  # none before issue 24's queue slabs
            slabs = "-" if keeper is None else (
                f"{keeper.counts().slabs_made}, {keeper.counts().batches_in_fresh_memory}")
            m = {field: statistics.median(getattr(r, field) for r in runs)
                 for field in RunFigures.__dataclass_fields__}
            print(f"{size:6g} {'collated' if collated else 'built':9} {items:5d} "
                  f"{m['items_per_s']:9.1f} {m['consumer_cpu_ms']:9.2f} {m['upstream_cpu_ms']:9.2f} "
                  f"{m['consumer_faults']:12.1f} {m['upstream_faults']:9.1f}  {slabs}")
            release = getattr(pipe, "release_shared_memory", None)
            if release is not None:
                release()


def boundary_states(repeats: int) -> None:
    """Items/s through a thread boundary with its upstream's states taken as usual, and once."""
    import math

    from pipeload.datapipes.boundary import positions

    usual = positions.COST_RATIO
    for label, work_s, items in (("~0 us", 0.0, 100_000), ("~25 us", 25e-6, 20_000)):
        iterations = python_work_iterations(work_s) if work_s else 0
        rates: dict[str, list[float]] = {"states as usual": [], "states once": []}
        for repeat in range(repeats):
            order = list(rates) if repeat % 2 == 0 else list(reversed(rates))
            for name in order:
                positions.COST_RATIO = usual if name == "states as usual" else math.inf
                try:
                    pipe = (IterableWrapper(range(items)).shuffle(buffer_size=100)
                            .map(Work(iterations) if iterations else _increment).prefetch(64))
                    started = time.perf_counter()
                    count = sum(1 for _ in pipe)
                    rates[name].append(count / (time.perf_counter() - started))
                finally:
                    positions.COST_RATIO = usual
        medians = {name: statistics.median(values) for name, values in rates.items()}
        print(f"{label} of work an item, {items} items, median of {repeats}: "
              + ", ".join(f"{name} {rate:,.0f} items/s" for name, rate in medians.items())
              + f"; ratio {medians['states as usual'] / medians['states once']:.2f}x")


def main(argv: Sequence[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    if args.boundary_states:
        boundary_states(args.repeats)
        return 0
    if args.large_items:
        large_items(args.megabytes, 200 if args.items is None else args.items, args.repeats)
        return 0
    if args.items is None:
        args.items = 3000
    if args.cpu_per_item:
        direct, inline = cpu_per_item(args.repeats)
        print(f"CPU per item, median of {args.repeats}: directly {direct:.0f} ns, "
              f"through DataLoader(num_workers=0) {inline:.0f} ns")
        return 0
    iterations = python_work_iterations(args.work_ms / 1000)
    factories = {
        "pipeload (pipe graph)": pipeload_loader(args.items, iterations, args.num_workers),
        "torch (map-style)": torch_loader(args.items, iterations, args.num_workers),
    }
    for factory in factories.values():
        warm_up(factory, WARMUP_BATCHES)
    rates: dict[str, list[float]] = {name: [] for name in factories}
    for repeat in range(args.repeats):
        order = list(factories) if repeat % 2 == 0 else list(reversed(factories))
        for name in order:
            result = measure(factories[name], len, workload="pipe_python_work", loader=name)
            if result.samples != args.items:
                raise RuntimeError(f"{name} loaded {result.samples} samples, expected {args.items}")
            rates[name].append(result.samples_per_s)
    medians = {name: statistics.median(values) for name, values in rates.items()}
    ours, theirs = medians.values()
    print(f"{args.items} items, ~{args.work_ms} ms of Python each, batch {BATCH_SIZE}, "
          f"{args.num_workers} process workers, median of {args.repeats}")
    for name, rate in medians.items():
        print(f"  {name:24s} {rate:10.0f} samples/s")
    print(f"  ratio pipeload/torch     {ours / theirs:10.2f}x")
    return 0


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--items", type=int, default=None,
                        help="items (default 3000); with --large-items, MiB sent per run (default 200)")
    parser.add_argument("--num-workers", type=int, default=2)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--work-ms", type=float, default=1.0)
    parser.add_argument("--cpu-per-item", action="store_true",
                        help="CPU time per item of a cheap graph instead (less disturbed by load)")
    parser.add_argument("--large-items", action="store_true",
                        help="large tensors through a process queue boundary instead")
    parser.add_argument("--boundary-states", action="store_true",
                        help="what a thread boundary's checkpoints cost its pipe instead")
    parser.add_argument("--megabytes", type=float, nargs="+", default=[1.0, 38.0],
                        help="with --large-items: tensor sizes in MiB (default: 1 38)")
    return parser


if __name__ == "__main__":
    sys.exit(main())
