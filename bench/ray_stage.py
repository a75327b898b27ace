"""A pipe's upstream in Ray actors against the same pipe in one process, and against a process
boundary, in one run.

    python -m bench.ray_stage [--items 600] [--work-ms 2.0] [--repeats 3] [--address ADDR]

1. CPU-bound: ``IterableWrapper(range(items)).sharding_filter().map(work)``, ``work`` ~2 ms of
   pure Python per item, read in this process, against the same pipe behind
   ``queue_boundary("ray", buffer_size, num_actors=2)``. Ratio: the Ray boundary's items/s over
   one process's (the 2 actors share this machine's CPUs with Ray's own daemons and this reader).
2. Large items: 1 MiB float32 tensors made upstream, through ``queue_boundary("ray", ..,
   num_actors=1)`` against ``queue_boundary("process", ..)``: the object store against the
   shared-memory transport. Ratio: Ray's items/s over the process boundary's.

Also printed: the CPU each item costs in one process, and in the actors plus this reader
(scheduler counters, which a loaded machine moves far less than wall time: with Linux's
autogroup scheduling, a loaded machine gives this session, the actors included, about the CPU
of one busy process, so the wall-clock ratio there says little).

Boundaries are timed from their first item to their last (a process boundary starts its
process in each run, the Ray boundary keeps its actors between runs; what is compared is the
steady flow). Each repeat runs both sides, alternating which goes first; medians are printed.
A local Ray cluster (2 CPUs, everything on 127.0.0.1) is started unless ``--address`` names one.
"""

from __future__ import annotations

import argparse
import os
import statistics
import time
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from typing import Any

# Ray reads these when imported: a local cluster on the loopback, no token, no usage report.
for _name, _value in {"RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER": "0", "RAY_AUTH_MODE": "disabled",
                      "RAY_USAGE_STATS_ENABLED": "0"}.items():
    os.environ.setdefault(_name, _value)

import torch  # noqa: E402

from bench.datapipes import Work  # noqa: E402
from bench.workloads import python_work_iterations  # noqa: E402
from pipeload.datapipes.iter import IterableWrapper  # noqa: E402

TENSOR_SHAPE = (256, 1024)  # float32: 1 MiB


@dataclass(frozen=True)
class MakeTensor:
    """A 1 MiB tensor per item (module level, so Ray and a process boundary can send it)."""

    def __call__(self, index: int) -> torch.Tensor:
        return torch.full(TENSOR_SHAPE, float(index))


def timed_whole(make: Callable[[], Iterable[Any]], items: int) -> float:
    """Items/s over a whole run (the one-process pipe: no start-up to leave out)."""
    started = time.perf_counter()
    count = sum(1 for _ in make())
    elapsed = time.perf_counter() - started
    _check(count, items)
    return count / elapsed


def timed_after_first(make: Callable[[], Iterable[Any]], items: int) -> float:
    """Items/s from the first item to the last (a boundary's start-up left out)."""
    iterator = iter(make())
    next(iterator)
    started = time.perf_counter()
    count = 1 + sum(1 for _ in iterator)
    elapsed = time.perf_counter() - started
    _check(count, items)
    return (count - 1) / elapsed


def _check(count: int, items: int) -> None:
    if count != items:
        raise RuntimeError(f"read {count} items, expected {items}")


def compare(sides: dict[str, Callable[[], float]], repeats: int) -> dict[str, float]:
    """Median items/s of each side over ``repeats``, alternating which runs first."""
    rates: dict[str, list[float]] = {name: [] for name in sides}
    for repeat in range(repeats):
        order = list(sides) if repeat % 2 == 0 else list(reversed(sides))
        for name in order:
            rates[name].append(sides[name]())
    return {name: statistics.median(values) for name, values in rates.items()}


def cpu_bound(args: argparse.Namespace) -> float:
    iterations = python_work_iterations(args.work_ms / 1000)
    pipe = IterableWrapper(range(args.items)).sharding_filter().map(Work(iterations))
    ray_pipe = pipe.queue_boundary("ray", args.buffer_size, num_actors=2, chunk_size=args.chunk_size)
    timed_after_first(lambda: ray_pipe, args.items)  # starts the actors, warms them
    medians = compare({
        "one process": lambda: timed_whole(lambda: pipe, args.items),
        "Ray, 2 actors": lambda: timed_after_first(lambda: ray_pipe, args.items),
    }, args.repeats)
    ratio = medians["Ray, 2 actors"] / medians["one process"]
    print(f"1. {args.items} items of ~{args.work_ms} ms of Python, buffer_size {args.buffer_size}, "
          f"median of {args.repeats}")
    for name, rate in medians.items():
        print(f"   {name:22s} {rate:10.1f} items/s")
    print(f"   ratio Ray/one process  {ratio:10.2f}x   (target >= 1.5x)")
    local_ms, actors_ms, reader_ms = cpu_per_item(pipe, ray_pipe, args.items)
    print(f"   CPU per item: one process {local_ms:.2f} ms; Ray: actors {actors_ms:.2f} ms + reader "
          f"{reader_ms:.2f} ms; one process's over Ray's: {local_ms / (actors_ms + reader_ms):.2f} "
          "(scheduler counters: little moved by the machine's load)")
    ray_pipe.release_actors()
    return ratio


def cpu_per_item(pipe: Any, ray_pipe: Any, items: int) -> tuple[float, float, float]:
    """CPU milliseconds per item: the pipe in this process; the actors' processes and this
    reader over one Ray run (scheduler counters, not wall time, so the machine's load matters
    little)."""
    import psutil

    started = time.process_time()
    sum(1 for _ in pipe)
    local = time.process_time() - started
    iterator = iter(ray_pipe)
    next(iterator)
    actors = [psutil.Process(lane.handle.describe.remote().future().result()["pid"])
              for lane in iterator._upstream._lanes]
    before = sum(sum(actor.cpu_times()[:2]) for actor in actors)
    started = time.process_time()
    count = 1 + sum(1 for _ in iterator)
    reader = time.process_time() - started
    spent = sum(sum(actor.cpu_times()[:2]) for actor in actors) - before
    _check(count, items)
    return local / items * 1e3, spent / (items - 1) * 1e3, reader / (items - 1) * 1e3


def large_items(args: argparse.Namespace) -> float:
    items = args.tensor_items
    pipe = IterableWrapper(range(items)).map(MakeTensor())
    ray_pipe = pipe.queue_boundary("ray", args.buffer_size, num_actors=1)
    process_pipe = pipe.queue_boundary("process", args.buffer_size)
    timed_after_first(lambda: ray_pipe, items)
    medians = compare({
        "process boundary": lambda: timed_after_first(lambda: process_pipe, items),
        "Ray boundary": lambda: timed_after_first(lambda: ray_pipe, items),
    }, args.repeats)
    ratio = medians["Ray boundary"] / medians["process boundary"]
    print(f"2. {items} tensors of 1 MiB, buffer_size {args.buffer_size}, one upstream, median of {args.repeats}")
    for name, rate in medians.items():
        print(f"   {name:22s} {rate:10.1f} items/s")
    print(f"   ratio Ray/process      {ratio:10.2f}x   (target >= 0.8x)")
    ray_pipe.release_actors()
    return ratio


def main(argv: Sequence[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    import ray

    if args.address:
        ray.init(address=args.address)
    else:
        ray.init(num_cpus=2, include_dashboard=False, log_to_driver=False)
    try:
        load = os.getloadavg()[0]
        print(f"load average {load:.1f} on {os.cpu_count()} CPUs"
              + (" (a loaded machine: ratios are noisy)" if load > (os.cpu_count() or 1) else ""))
        cpu_bound(args)
        large_items(args)
    finally:
        ray.shutdown()
    return 0


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--items", type=int, default=600, help="items of the CPU-bound run")
    parser.add_argument("--work-ms", type=float, default=2.0, help="Python work per item")
    parser.add_argument("--tensor-items", type=int, default=300, help="1 MiB items of the second run")
    parser.add_argument("--buffer-size", type=int, default=64)
    parser.add_argument("--chunk-size", type=int, default=None, help="items per request (default: auto)")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--address", default=None, help="join this Ray cluster instead of starting one")
    return parser


if __name__ == "__main__":
    raise SystemExit(main())
