"""Copy-on-read (pytorch#13246): memory growth of a dataset of millions of path strings.

    PYTHONPATH=src:. python -m bench.copy_on_read [--items 2000000] [--num-workers 4]
        [--variants list dict] [--start-method fork] [--access-repeats 3] [--quick] [--markdown]

Memory. Each case runs in a fresh Python process: it builds the dataset, reads that process's
PSS (proportional set size: a page shared by k processes counts 1/k in each, so the sum over a
process tree counts every page once), then runs one shuffled epoch over all items with the
workers and reads the tree's PSS (main + workers, from ``/proc/<pid>/smaps_rollup``) every
quarter of a second, the last time just after the last batch, while the workers still live.
Growth = the tree's peak PSS minus the builder's PSS. Cases, for each variant (``list``: the
dataset holds a list of paths; ``dict``: it holds a dict from item number to path):

    torch    plain      torch.utils.data.DataLoader, the plain list/dict
    pipeload plain      pipeload.DataLoader, the plain list/dict
    pipeload shared     pipeload.DataLoader, after pipeload.share_containers(dataset)
    pipeload no-objects pipeload.DataLoader over a dataset that formats each path from its index:
                        what the loader itself costs per worker, with no objects to copy
    torch    shared     torch.utils.data.DataLoader after share_containers (it works there too)

Targets: shared growth <= 1.5x the no-objects growth, and <= 0.3x torch's plain growth.

Access cost. In one process, per variant: a shuffled pass with num_workers=0 through
pipeload.DataLoader (batch 64) over the plain and the shared container, alternating, median of
``--access-repeats``; and the bare ``dataset[i]`` time in a loop over shuffled indices. Both are
CPU time of that process (all the work there is, with no workers), so that time other programs
hold the CPU on a shared machine is left out.
Target: the shared pass at least 0.5x as fast as the plain one.
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import platform
import random
import statistics
import subprocess
import sys
import time
from collections.abc import Iterable, Sequence
from dataclasses import asdict, dataclass
from typing import Any

MIB = 1024 * 1024
SAMPLE_EVERY_S = 0.25
BATCH_SIZE = 64
SEED = 0
CASES = (
    ("torch", "plain"),
    ("pipeload", "plain"),
    ("pipeload", "shared"),
    ("pipeload", "no-objects"),
    ("torch", "shared"),
)


def make_path(index: int) -> str:
    """An ImageNet-like path, about 60 characters, different for every index."""
    return f"/datasets/imagenet/train/n{index % 1000:08d}/n{index % 1000:08d}_{index:08d}.JPEG"


class PathList:
    """Item i is ``paths[i]``."""

    def __init__(self, paths: Any) -> None:
        self.paths = paths

    def __len__(self) -> int:
        return len(self.paths)

    def __getitem__(self, index: int) -> str:
        return self.paths[index]


class PathTable:
    """Item i is ``table[i]``: a dict from item number to path."""

    def __init__(self, table: Any) -> None:
        self.table = table

    def __len__(self) -> int:
        return len(self.table)

    def __getitem__(self, index: int) -> str:
        return self.table[index]


class NoObjects:
    """Item i is formatted from i: the dataset holds no Python objects at all."""

    def __init__(self, length: int) -> None:
        self.length = length

    def __len__(self) -> int:
        return self.length

    def __getitem__(self, index: int) -> str:
        return make_path(index)


def build_dataset(variant: str, container: str, items: int) -> Any:
    """The dataset of one case, in its final form (converted when ``container`` is shared)."""
    import pipeload

    if container == "no-objects":
        return NoObjects(items)
    paths = [make_path(i) for i in range(items)]
    dataset = PathList(paths) if variant == "list" else PathTable(dict(enumerate(paths)))
    del paths
    if container == "shared":
        pipeload.share_containers(dataset)
    gc.collect()
    return dataset


# -- memory --------------------------------------------------------------------------------


def pss_bytes(pid: int) -> int:
    """The PSS of one process (0 if it has just ended)."""
    try:
        with open(f"/proc/{pid}/smaps_rollup") as rollup:
            for line in rollup:
                if line.startswith("Pss:"):
                    return int(line.split()[1]) * 1024
    except (FileNotFoundError, ProcessLookupError):
        pass
    return 0


def tree_pss_bytes() -> int:
    """PSS summed over this process and all its descendants."""
    import psutil

    pids = [os.getpid()] + [child.pid for child in psutil.Process().children(recursive=True)]
    return sum(pss_bytes(pid) for pid in pids)


@dataclass(frozen=True)
class MemoryResult:
    variant: str
    loader: str
    container: str
    builder_pss_bytes: int
    peak_tree_pss_bytes: int
    epoch_s: float
    samples: int

    @property
    def growth_bytes(self) -> int:
        return self.peak_tree_pss_bytes - self.builder_pss_bytes


def make_loader(loader: str, dataset: Any, num_workers: int, start_method: str) -> Iterable[Any]:
    import torch

    arguments = dict(batch_size=BATCH_SIZE, shuffle=True, num_workers=num_workers,
                     generator=torch.Generator().manual_seed(SEED))
    if num_workers > 0:
        arguments["multiprocessing_context"] = start_method
    if loader == "torch":
        import torch.utils.data

        return torch.utils.data.DataLoader(dataset, **arguments)
    import pipeload

    return pipeload.DataLoader(dataset, **arguments)


def measure_memory(variant: str, loader: str, container: str, args: argparse.Namespace) -> MemoryResult:
    """One case, in this (fresh) process."""
    import warnings

    warnings.simplefilter("ignore")  # the plain cases trigger pipeload's copy-on-read warning: expected
    dataset = build_dataset(variant, container, args.items)
    builder = pss_bytes(os.getpid())
    peak, samples, next_sample = builder, 0, 0.0
    start = time.perf_counter()
    for batch in make_loader(loader, dataset, args.num_workers, args.start_method):
        samples += len(batch)
        now = time.perf_counter()
        if now >= next_sample or samples == args.items:
            peak = max(peak, tree_pss_bytes())  # the last one: after the last batch, workers alive
            next_sample = now + SAMPLE_EVERY_S
    return MemoryResult(variant, loader, container, builder, peak, time.perf_counter() - start, samples)


def run_case_in_child(variant: str, loader: str, container: str, args: argparse.Namespace) -> MemoryResult:
    command = [sys.executable, "-m", "bench.copy_on_read", "--child", variant, loader, container,
               "--items", str(args.items), "--num-workers", str(args.num_workers),
               "--start-method", args.start_method]
    done = subprocess.run(command, capture_output=True, text=True, check=False)
    if done.returncode != 0:
        raise RuntimeError(f"case {variant}/{loader}/{container} failed:\n{done.stderr}")
    return MemoryResult(**json.loads(done.stdout.strip().splitlines()[-1]))


# -- access cost ---------------------------------------------------------------------------


@dataclass(frozen=True)
class AccessResult:
    variant: str
    container: str
    loader_items_per_s: float
    getitem_ns: float


def measure_access(variant: str, args: argparse.Namespace) -> list[AccessResult]:
    """Plain and shared, alternating in one process: shuffled 0-worker passes and bare reads."""
    plain = build_dataset(variant, "plain", args.items)
    shared = build_dataset(variant, "shared", args.items)
    order = list(range(args.items))
    random.Random(SEED).shuffle(order)
    speeds: dict[str, list[float]] = {"plain": [], "shared": []}
    reads: dict[str, list[float]] = {"plain": [], "shared": []}
    for repeat in range(args.access_repeats):
        for name in ("plain", "shared") if repeat % 2 == 0 else ("shared", "plain"):
            dataset = plain if name == "plain" else shared
            # CPU time of this process: with no workers it is all the work there is, and on a
            # shared machine it does not count the time other programs held the CPU.
            start = time.process_time()
            count = sum(len(batch) for batch in make_loader("pipeload", dataset, 0, args.start_method))
            speeds[name].append(count / (time.process_time() - start))
            start = time.process_time()
            for index in order:
                dataset[index]
            reads[name].append((time.process_time() - start) / len(order) * 1e9)
    return [AccessResult(variant, name, statistics.median(speeds[name]), statistics.median(reads[name]))
            for name in ("plain", "shared")]


# -- report --------------------------------------------------------------------------------


def _ratio(ours: float, theirs: float) -> str:
    return f"{ours / theirs:.2f}x" if theirs > 0 else "n/a"


def memory_table(results: Sequence[MemoryResult]) -> list[tuple[str, ...]]:
    rows = []
    for result in results:
        same = {r.container: r for r in results if r.variant == result.variant and r.loader == "pipeload"}
        torch_plain = next((r for r in results if r.variant == result.variant
                            and (r.loader, r.container) == ("torch", "plain")), None)
        baseline = same.get("no-objects")
        rows.append((
            result.variant, result.loader, result.container,
            f"{result.builder_pss_bytes / MIB:,.0f}", f"{result.peak_tree_pss_bytes / MIB:,.0f}",
            f"{result.growth_bytes / MIB:,.0f}",
            _ratio(result.growth_bytes, baseline.growth_bytes) if baseline else "n/a",
            _ratio(result.growth_bytes, torch_plain.growth_bytes) if torch_plain else "n/a",
            f"{result.epoch_s:,.1f}",
        ))
    return rows


MEMORY_HEADERS = ("variant", "loader", "container", "builder PSS MiB", "peak tree PSS MiB",
                  "growth MiB", "growth / no-objects", "growth / torch plain", "epoch s")
ACCESS_HEADERS = ("variant", "container", "0-worker items/s", "vs plain", "ns per dataset[i]")


def access_table(results: Sequence[AccessResult]) -> list[tuple[str, ...]]:
    rows = []
    for result in results:
        plain = next(r for r in results if r.variant == result.variant and r.container == "plain")
        rows.append((result.variant, result.container, f"{result.loader_items_per_s:,.0f}",
                     _ratio(result.loader_items_per_s, plain.loader_items_per_s),
                     f"{result.getitem_ns:,.0f}"))
    return rows


def format_table(headers: Sequence[str], rows: Sequence[tuple[str, ...]], markdown: bool) -> str:
    if markdown:
        lines = ["| " + " | ".join(headers) + " |", "|" + "|".join("---" for _ in headers) + "|"]
        return "\n".join(lines + ["| " + " | ".join(row) + " |" for row in rows])
    widths = [max(len(cell) for cell in column) for column in zip(headers, *rows)]
    return "\n".join("  ".join(f"{cell:>{w}}" for cell, w in zip(row, widths)) for row in [headers, *rows])


def describe_machine(args: argparse.Namespace) -> str:
    import torch

    return (f"{os.cpu_count()} CPUs, {platform.system()} {platform.machine()}, Python "
            f"{platform.python_version()}, torch {torch.__version__}; {args.items:,} items, "
            f"num_workers={args.num_workers}, start method {args.start_method}, batch {BATCH_SIZE}")


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="python -m bench.copy_on_read", description=__doc__.split("\n")[0])
    parser.add_argument("--items", type=int, default=2_000_000)
    parser.add_argument("--num-workers", type=int, default=4)
    parser.add_argument("--variants", nargs="+", choices=("list", "dict"), default=["list", "dict"])
    parser.add_argument("--start-method", choices=("fork", "spawn", "forkserver"), default="fork")
    parser.add_argument("--access-repeats", type=int, default=5)
    parser.add_argument("--quick", action="store_true", help="200,000 items, three access repeats")
    parser.add_argument("--markdown", action="store_true")
    parser.add_argument("--child", nargs=3, metavar=("VARIANT", "LOADER", "CONTAINER"), help=argparse.SUPPRESS)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    if args.child:
        print(json.dumps(asdict(measure_memory(*args.child, args))))
        return 0
    if args.quick:
        args.items, args.access_repeats = 200_000, 3
    print(describe_machine(args), flush=True)
    memory = []
    for variant in args.variants:
        for loader, container in CASES:
            result = run_case_in_child(variant, loader, container, args)
            print(f"  {variant}/{loader}/{container}: growth {result.growth_bytes / MIB:,.0f} MiB", file=sys.stderr)
            memory.append(result)
    access = [result for variant in args.variants for result in measure_access(variant, args)]
    print("\nMemory (PSS summed over the process tree)\n")
    print(format_table(MEMORY_HEADERS, memory_table(memory), args.markdown))
    print("\nAccess cost (num_workers=0, shuffled)\n")
    print(format_table(ACCESS_HEADERS, access_table(access), args.markdown))
    return 0


if __name__ == "__main__":
    sys.exit(main())
