"""A pipe graph through pipeload's DataLoader against the same work as a map-style dataset
under torch.utils.data, in one run.

    python -m bench.datapipes [--items 3000] [--num-workers 2] [--repeats 3] [--work-ms 1.0]
    python -m bench.datapipes --cpu-per-item [--repeats 5]

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
"""

from __future__ import annotations

import argparse
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


def main(argv: Sequence[str] | None = None) -> int:
    args = _parser().parse_args(argv)
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
    parser.add_argument("--items", type=int, default=3000)
    parser.add_argument("--num-workers", type=int, default=2)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--work-ms", type=float, default=1.0)
    parser.add_argument("--cpu-per-item", action="store_true",
                        help="CPU time per item of a cheap graph instead (less disturbed by load)")
    return parser


if __name__ == "__main__":
    sys.exit(main())
