"""Where a small item's cost goes: CPU per sample by kind of process, context switches, syscalls.

    python -m bench.item_costs [--repeats 5] [--size 2048] [--workers 2] [--syscalls]

The workload is ``pipeload bench``'s (small 128x128 JPEGs in tar shards, decoded, cropped,
flipped and resized to 3x64x64 floats; batch 64; a fresh loader per pass), read by torch's
DataLoader and by pipeload's classic and economic modes, interleaved: each repeat runs every
loader, starting one further along each time. For every loader it prints the median samples/s
(and the spread), the ratio to torch and to classic mode, and figures that a busy machine
disturbs far less than throughput:

  * the process tree's CPU time per sample (exact: this process's and its reaped workers'
    ``getrusage``), and its split by kind of process (main, worker; economic mode's item and
    batch workers): each worker's whole life, fork to exit, as the kernel gives it when the
    worker is reaped (``os.wait4``: the benchmark has ``os.waitpid``, which multiprocessing
    reaps with, keep each child's resource usage);
  * voluntary and involuntary context switches per sample, over the tree.

``--syscalls`` adds one pass of each pipeload loader under ``strace -f -c``: system calls per
sample, and the messages (``sendmsg``) per batch. strace slows everything down; only the counts
mean something there.

``--in-process`` measures instead, in this one process and with real sockets and slabs, what
economic mode's hop costs per item beside classic mode's collation, for 64 decoded images already
in hand (no fetching, no seeding): the item worker's side (encoding its groups, each item written
into the batch's slab), the batch worker's (decoding, stacking, sending the batch) and the main
process's (receiving it). Thread CPU time, the fastest of many batches: the least disturbed by a
busy machine.
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import resource
import shutil
import statistics
import subprocess
import sys
import time
from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Any

import torch

import pipeload
from bench.baseline import make_torch_loader
from pipeload.cli.images import TarImages, dataset_dir, ensure_images

LOADERS = ("torch", "classic", "economic")
BATCH_SIZE = 64
SEED = 0
WARMUP_BATCHES = 4


@dataclass
class Pass:
    """One loader's pass over the dataset."""

    loader: str
    samples: int = 0
    seconds: float = 0.0
    tree_cpu_s: float = 0.0
    switches: tuple[int, int] = (0, 0)  # voluntary, involuntary
    by_kind: dict[str, float] = field(default_factory=dict)  # CPU seconds per kind of process

    @property
    def samples_per_s(self) -> float:
        return self.samples / self.seconds if self.seconds else 0.0

    def per_sample_us(self, seconds: float) -> float:
        return seconds / self.samples * 1e6 if self.samples else 0.0


def make_loader(name: str, images: TarImages, workers: int) -> Iterable[Any]:
    if name == "torch":
        return make_torch_loader(images, BATCH_SIZE, workers, SEED)
    if name not in LOADERS:
        raise ValueError(f"loader must be one of {LOADERS}, got {name!r}")
    return pipeload.DataLoader(images, batch_size=BATCH_SIZE, shuffle=True, num_workers=workers,
                               generator=torch.Generator().manual_seed(SEED), mode=name)


def _kinds(iterator: Any) -> dict[int, str]:
    """pid -> kind of worker, from pipeload's engine (torch's workers are all "worker")."""
    engine = getattr(iterator, "_engine", None)
    if engine is None:  # torch's iterator keeps its worker processes in ``_workers``
        return {w.pid: "worker" for w in getattr(iterator, "_workers", [])}
    handles = getattr(engine, "workers", None) or []
    return {h.pid: h.name.rsplit("-", 1)[0].removeprefix("pipeload-") for h in handles
            if getattr(h, "pid", None)}


class ReapedChildren:
    """The CPU seconds of every child process, fork to exit, kept as it is reaped.

    ``os.waitpid`` (which multiprocessing reaps its children with) is replaced by one that asks
    ``os.wait4`` instead, the same call that also returns the child's resource usage. Only a
    benchmark does this: the loaders run unchanged.
    """

    def __init__(self) -> None:
        self.cpu_s: dict[int, float] = {}
        self._waitpid = os.waitpid

    def __enter__(self) -> ReapedChildren:
        def waitpid(pid: int, options: int) -> tuple[int, int]:
            reaped, status, usage = os.wait4(pid, options)
            if reaped:
                self.cpu_s[reaped] = usage.ru_utime + usage.ru_stime
            return reaped, status

        os.waitpid = waitpid
        return self

    def __exit__(self, *exc: object) -> None:
        os.waitpid = self._waitpid


REAPED = ReapedChildren()


def _rusage() -> tuple[float, float, int, int]:
    me, kids = resource.getrusage(resource.RUSAGE_SELF), resource.getrusage(resource.RUSAGE_CHILDREN)
    return (me.ru_utime + me.ru_stime, kids.ru_utime + kids.ru_stime,
            me.ru_nvcsw + kids.ru_nvcsw, me.ru_nivcsw + kids.ru_nivcsw)


def _wait_for_workers(deadline_s: float = 10.0) -> None:
    """Until every worker has exited and been reaped (their CPU time is then in RUSAGE_CHILDREN)."""
    import psutil

    end = time.monotonic() + deadline_s
    while psutil.Process().children() and time.monotonic() < end:
        time.sleep(0.02)


def one_pass(name: str, images: TarImages, workers: int) -> Pass:
    """Run ``name``'s loader over ``images`` once and measure it."""
    gc.collect()
    before = _rusage()
    iterator = iter(make_loader(name, images, workers))
    kinds = _kinds(iterator)
    result = Pass(name)
    started = time.perf_counter()
    for batch in iterator:
        result.samples += len(batch[0])
    result.seconds = time.perf_counter() - started
    del iterator, batch
    gc.collect()
    _wait_for_workers()
    after = _rusage()
    result.tree_cpu_s = (after[0] - before[0]) + (after[1] - before[1])
    result.switches = (after[2] - before[2], after[3] - before[3])
    # The main process from iter() to its workers' exit (every thread: the loader's own too).
    result.by_kind = {"main": after[0] - before[0]}
    for pid, kind in kinds.items():
        result.by_kind[kind] = result.by_kind.get(kind, 0.0) + REAPED.cpu_s.pop(pid, 0.0)
    # Children the loader did not name (a resource tracker, say), or not reaped with waitpid.
    result.by_kind["other"] = max(0.0, result.tree_cpu_s - sum(result.by_kind.values()))
    return result


def warm_up(images: TarImages, workers: int) -> None:
    """One short pass of every loader: imports, caches and the first forks are paid here."""
    for name in LOADERS:
        iterator = iter(make_loader(name, images, workers))
        for number, _ in zip(range(WARMUP_BATCHES), iterator):
            pass
        del iterator
        _wait_for_workers()


def medians_by_loader(passes: list[Pass]) -> dict[str, dict[str, float]]:
    """Per loader: median samples/s and tree CPU per sample (us) over its passes."""
    return {name: {"samples_per_s": statistics.median(p.samples_per_s for p in mine),
                   "tree_cpu_us": statistics.median(p.per_sample_us(p.tree_cpu_s) for p in mine)}
            for name in LOADERS if (mine := [p for p in passes if p.loader == name])}


def report(passes: list[Pass]) -> str:
    """The table: medians over the repeats, ratios from the same run."""
    lines = [f"{'loader':<10}{'samples/s':>10}{'spread':>16}{'vs torch':>9}{'vs classic':>11}"
             f"{'tree CPU':>10}  CPU by kind of process, us/sample            switches/sample"]
    medians = {n: statistics.median(p.samples_per_s for p in passes if p.loader == n)
               for n in LOADERS}
    for name in LOADERS:
        mine = [p for p in passes if p.loader == name]
        speeds = [p.samples_per_s for p in mine]
        cpu = statistics.median(p.per_sample_us(p.tree_cpu_s) for p in mine)
        kinds = sorted({k for p in mine for k in p.by_kind})
        split = ", ".join(f"{k} {statistics.median(p.per_sample_us(p.by_kind.get(k, 0.0)) for p in mine):.0f}"
                          for k in kinds)
        vol = statistics.median(p.switches[0] / p.samples for p in mine)
        invol = statistics.median(p.switches[1] / p.samples for p in mine)
        lines.append(f"{name:<10}{medians[name]:>10,.0f}{min(speeds):>8,.0f}..{max(speeds):<6,.0f}"
                     f"{medians[name] / medians['torch']:>8.2f}x{medians[name] / medians['classic']:>10.2f}x"
                     f"{cpu:>7,.0f} us  {split:<44} {vol:.2f} vol, {invol:.2f} invol")
    return "\n".join(lines)


def count_syscalls(size: int, workers: int) -> None:
    """One pass of each pipeload loader under ``strace -f -c``: syscalls per sample, messages."""
    if shutil.which("strace") is None:
        print("--syscalls: strace is not installed; skipped")
        return
    for name in ("classic", "economic"):
        out = os.path.join(os.environ.get("TMPDIR", "/tmp"), f"pipeload-item-costs-{name}.strace")
        command = ["strace", "-f", "-qq", "-c", "-o", out, sys.executable, "-m", "bench.item_costs",
                   "--one", name, "--size", str(size), "--workers", str(workers)]
        subprocess.run(command, check=True, env={**os.environ, "PYTHONPATH": os.pathsep.join(sys.path)})
        calls = _strace_counts(out)
        total = sum(calls.values())
        print(f"{name:<9} {total / size:6.1f} syscalls/sample; per batch: "
              + ", ".join(f"{c} {calls.get(c, 0) * BATCH_SIZE / size:.1f}"
                          for c in ("sendmsg", "recvmsg", "write", "poll", "futex")))


def _strace_counts(path: str) -> dict[str, int]:
    counts = {}
    with open(path) as summary:
        for line in summary:
            parts = line.split()
            if len(parts) >= 5 and parts[0][0].isdigit() and parts[-1] != "total":
                counts[parts[-1]] = int(parts[3])
    return counts


def in_process_costs(images: TarImages, batches: int = 200) -> str:
    """Per item CPU of economic mode's hop and of classic mode's collation (see the module doc)."""
    from bench.hop_costs import Hop

    items = [images[i] for i in range(BATCH_SIZE)]
    with Hop(items) as hop:
        rows = {"classic": [], "economic": []}
        for token in range(batches):
            kind = "economic" if token % 2 else "classic"
            rows[kind].append(hop.economic(token) if kind == "economic" else hop.classic(token))
    lines = [f"{'per item, us (best batch)':<28}{'item worker':>12}{'batch worker':>13}{'main':>7}{'total':>8}"]
    for kind, times in rows.items():
        best = [min(t[i] for t in times[10:]) / BATCH_SIZE * 1e6 for i in range(3)]
        lines.append(f"{kind:<28}{best[0]:>12.1f}{best[1]:>13.1f}{best[2]:>7.1f}{sum(best):>8.1f}")
    lines.append(_seeding_costs())
    return "\n".join(lines)


def _seeding_costs(piece: int = 16, rounds: int = 300) -> str:
    """An item worker's seeding per item: one item at a time, and a piece's seeds at once."""
    from pipeload.engine.worker_info import item_seed, reseed

    def one_at_a_time() -> None:
        for position in range(piece):
            reseed(item_seed(SEED, 0, position), None)

    timings = {"one at a time": _best_per_item(one_at_a_time, piece, rounds)}
    try:
        from pipeload.engine.item_seeds import ItemSeeds
    except ImportError:  # a tree from before issue 24
        pass
    else:
        def at_once() -> None:
            seeds = ItemSeeds(SEED, 0, 0, piece)
            for offset in range(piece):
                seeds.apply(offset, None)

        timings[f"a piece of {piece} at once"] = _best_per_item(at_once, piece, rounds)
    return "seeding per item, us (best): " + ", ".join(f"{k} {v:.1f}" for k, v in timings.items())


def _best_per_item(run: Any, items: int, rounds: int) -> float:
    best = float("inf")
    for _ in range(rounds):
        started = time.thread_time()
        run()
        best = min(best, time.thread_time() - started)
    return best / items * 1e6


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--size", type=int, default=2048, help="images in the dataset")
    parser.add_argument("--workers", type=int, default=2)
    parser.add_argument("--syscalls", action="store_true", help="also count syscalls under strace")
    parser.add_argument("--in-process", action="store_true",
                        help="the hop's CPU per item in this one process, not whole loaders")
    parser.add_argument("--json", action="store_true",
                        help="print the medians as one JSON object (for bench.trees)")
    parser.add_argument("--one", choices=LOADERS, help=argparse.SUPPRESS)  # one pass, for strace
    args = parser.parse_args(argv)
    with REAPED:
        return _run(args)


def _run(args: argparse.Namespace) -> int:
    images = TarImages(ensure_images(args.size) if not (dataset_dir(args.size) / "index.json").is_file()
                       else dataset_dir(args.size))
    if args.one:
        one_pass(args.one, images, args.workers)
        return 0
    if args.in_process:
        print(in_process_costs(images))
        return 0
    warm_up(images, args.workers)
    passes = []
    for repeat in range(args.repeats):
        shift = repeat % len(LOADERS)
        for name in LOADERS[shift:] + LOADERS[:shift]:
            passes.append(one_pass(name, images, args.workers))
            print(f"  {name:<9} {passes[-1].samples_per_s:7,.0f} samples/s  "
                  f"load {os.getloadavg()[0]:.1f}", file=sys.stderr, flush=True)
    if args.json:
        print(json.dumps(medians_by_loader(passes)))
        return 0
    print(report(passes))
    print(f"{args.size} JPEGs, batch {BATCH_SIZE}, {args.workers} workers, {args.repeats} interleaved "
          f"repeats; load average {os.getloadavg()[0]:.1f} at the end")
    if args.syscalls:
        count_syscalls(args.size, args.workers)
    return 0


if __name__ == "__main__":
    sys.exit(main())
