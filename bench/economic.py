"""Economic mode against classic mode and torch.utils.data, on items that are big and slow to fetch.

    python -m bench.economic [--num-workers 8] [--repeats 2] [--sweep 2,4,8,16] [--markdown]

The workload is issue 7's: 1 MiB float32 items whose ``__getitem__`` sleeps 5-20 ms (I/O-like,
so 8 workers make sense on 2 cores), batch 64. Two training loops run over it:

  * slow (0.2 s per batch): the loaders run ahead of the loop, so memory fills up to each one's
    bound. Compared: peak shared memory and peak RSS of the process tree.
  * fast (nothing per batch): compared: throughput and time to first batch.

``economic-thread`` is economic mode with ``worker_type="thread"``: the same pool as threads of
this process, so the memory that every forked process maps again (torch's import: about 150 MiB
a process) is there once. Every loader gets the same dataset, batch size, ``num_workers`` and
``prefetch_factor`` (2) in the same run; the order of the loaders rotates between repeats.
``--sweep`` adds the slow loop's peak shared memory against num_workers for every loader. Shared memory is read two ways (memory.py): the
growth of the kernel's ``Shmem`` (machine-wide, memfd included) and the distinct segments the
process tree maps or holds. Memory is read three ways: the RSS sum, the tree's PSS, and the
tree's memory with every page counted once, mapped or not.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import Any

import torch
import torch.utils.data

import pipeload
from bench.measure import Measurement, measure, warm_up

LOADERS = ("torch", "classic", "economic", "economic-thread")
ECONOMIC_LOADERS = ("economic", "economic-thread")
BATCH_SIZE = 64
ITEM_FLOATS = 1 << 18  # 1 MiB of float32
FETCH_SLEEP_S = (0.005, 0.020)
SLOW_STEP_S = 0.2
PREFETCH_FACTOR = 2
WARMUP_BATCHES = 2
MIB = 1 << 20


class SlowBigItems(torch.utils.data.Dataset):
    """Item ``i``: a 1 MiB float32 tensor, after a sleep of 5-20 ms that depends only on ``i``."""

    def __init__(self, count: int) -> None:
        self.count = count

    def __len__(self) -> int:
        return self.count

    def __getitem__(self, index: int) -> torch.Tensor:
        if not 0 <= index < self.count:
            raise IndexError(f"index {index} out of range for {self.count} items")
        low, high = FETCH_SLEEP_S
        time.sleep(low + (high - low) * ((index * 7919) % 16) / 15)  # simulated I/O wait
        return torch.full((ITEM_FLOATS,), float(index % 251))


def batches_for(num_workers: int) -> int:
    """Enough batches for the classic loaders to fill their whole prefetch, and some to spare."""
    return 2 * num_workers * PREFETCH_FACTOR + 8


def make_loader(name: str, dataset: Any, num_workers: int) -> Iterable[Any]:
    common = {"batch_size": BATCH_SIZE, "num_workers": num_workers, "prefetch_factor": PREFETCH_FACTOR}
    if name == "torch":
        return torch.utils.data.DataLoader(dataset, **common)
    if name in ("classic", "economic"):
        return pipeload.DataLoader(dataset, mode=name, **common)
    if name == "economic-thread":  # item and batch workers as threads of this process
        return pipeload.DataLoader(dataset, mode="economic", worker_type="thread", **common)
    raise ValueError(f"loader name must be one of {LOADERS}, got {name!r}")


def _slow_step(batch: Any) -> None:
    time.sleep(SLOW_STEP_S)  # stands for the training step the loader must keep ahead of


@dataclass(frozen=True)
class Row:
    """One loader's figures for one loop, reduced over the repeats (medians; maxima for peaks)."""

    loader: str
    samples_per_s: float
    first_batch_s: float
    peak_rss_bytes: int
    peak_pss_bytes: int
    peak_shmem_bytes: int
    peak_tree_shm_bytes: int
    peak_tree_memory_bytes: int


def run_loop(loop: str, num_workers: int, repeats: int) -> list[Row]:
    """Measure every loader ``repeats`` times over one loop, rotating their order."""
    dataset = SlowBigItems(batches_for(num_workers) * BATCH_SIZE)
    step = _slow_step if loop == "slow" else None
    for name in LOADERS:
        warm_up(lambda name=name: make_loader(name, dataset, num_workers), WARMUP_BATCHES)
    runs: dict[str, list[Measurement]] = {name: [] for name in LOADERS}
    for repeat in range(repeats):
        order = LOADERS[repeat % len(LOADERS):] + LOADERS[:repeat % len(LOADERS)]
        for name in order:
            result = measure(lambda name=name: make_loader(name, dataset, num_workers),
                             _batch_length, workload=f"{loop}-loop", loader=name, step=step)
            _log(f"{loop} loop, {num_workers} workers, {name:<8} repeat {repeat + 1}/{repeats}: "
                 f"{result.samples_per_s:,.0f} samples/s, first batch {result.first_batch_s * 1e3:,.0f} ms, "
                 f"Shmem {result.peak_shmem_bytes / MIB:,.0f} MiB, RSS sum {result.peak_rss_bytes / MIB:,.0f} MiB, "
                 f"PSS {result.peak_pss_bytes / MIB:,.0f} MiB, tree shm {result.peak_tree_shm_bytes / MIB:,.0f} MiB, "
                 f"tree memory {result.peak_tree_memory_bytes / MIB:,.0f} MiB")
            runs[name].append(result)
    return [_reduce(name, runs[name]) for name in LOADERS]


def _reduce(name: str, runs: Sequence[Measurement]) -> Row:
    return Row(name, statistics.median(m.samples_per_s for m in runs),
               statistics.median(m.first_batch_s for m in runs),
               max(m.peak_rss_bytes for m in runs), max(m.peak_pss_bytes for m in runs),
               max(m.peak_shmem_bytes for m in runs), max(m.peak_tree_shm_bytes for m in runs),
               max(m.peak_tree_memory_bytes for m in runs))


def _batch_length(batch: Any) -> int:
    return int(batch.shape[0])


HEADERS = ("loop", "loader", "samples/s", "first batch ms", "peak RSS sum MiB", "peak PSS MiB",
           "peak tree memory MiB", "peak Shmem MiB", "peak tree shm MiB")


def loop_table(loop: str, rows: Sequence[Row]) -> list[tuple[str, ...]]:
    """Each loader's figures, then each economic loader's ratios against classic and torch."""
    table = [(loop, r.loader, f"{r.samples_per_s:,.0f}", f"{r.first_batch_s * 1e3:,.0f}",
              f"{r.peak_rss_bytes / MIB:,.0f}", f"{r.peak_pss_bytes / MIB:,.0f}",
              f"{r.peak_tree_memory_bytes / MIB:,.0f}", f"{r.peak_shmem_bytes / MIB:,.0f}",
              f"{r.peak_tree_shm_bytes / MIB:,.0f}") for r in rows]
    by_name = {r.loader: r for r in rows}
    for name in ECONOMIC_LOADERS:
        ours = by_name[name]
        for other in ("classic", "torch"):
            theirs = by_name[other]
            table.append((loop, f"{name}/{other}", _ratio(ours.samples_per_s, theirs.samples_per_s),
                          _ratio(ours.first_batch_s, theirs.first_batch_s),
                          _ratio(ours.peak_rss_bytes, theirs.peak_rss_bytes),
                          _ratio(ours.peak_pss_bytes, theirs.peak_pss_bytes),
                          _ratio(ours.peak_tree_memory_bytes, theirs.peak_tree_memory_bytes),
                          _ratio(ours.peak_shmem_bytes, theirs.peak_shmem_bytes),
                          _ratio(ours.peak_tree_shm_bytes, theirs.peak_tree_shm_bytes)))
    return table


def _ratio(ours: float, theirs: float) -> str:
    return f"{ours / theirs:.2f}x" if theirs > 0 else "n/a"


def target_checks(slow: Sequence[Row], fast: Sequence[Row], ours: str = "economic") -> list[tuple[str, float, float]]:
    """(target, measured ratio, limit) for issue 7's targets, for the loader named ``ours``; a
    ratio passes when it is on the right side of its limit (<= for memory and time, >= for
    throughput).

    Shared memory is checked two ways: the machine's ``Shmem`` growth also moves with whatever
    else runs on the machine, the tree's segments only with the loader's own. Memory is checked
    three ways: the RSS sum counts every shared page once per process mapping it, PSS counts
    shared pages only while mapped, tree memory counts every page once (see bench/memory.py).
    """
    s = {r.loader: r for r in slow}
    f = {r.loader: r for r in fast}
    e_s, e_f = s[ours], f[ours]
    checks = []
    for other in ("torch", "classic"):
        checks += [
            (f"slow: peak Shmem {ours}/{other} <= 1/3",
             e_s.peak_shmem_bytes / s[other].peak_shmem_bytes, 1 / 3),
            (f"slow: peak tree shm {ours}/{other} <= 1/3",
             e_s.peak_tree_shm_bytes / s[other].peak_tree_shm_bytes, 1 / 3),
        ]
    return checks + [
        (f"slow: peak tree RSS sum {ours}/torch <= 1/2", e_s.peak_rss_bytes / s["torch"].peak_rss_bytes, 1 / 2),
        (f"slow: peak tree PSS {ours}/torch <= 1/2", e_s.peak_pss_bytes / s["torch"].peak_pss_bytes, 1 / 2),
        (f"slow: peak tree memory {ours}/torch <= 1/2",
         e_s.peak_tree_memory_bytes / s["torch"].peak_tree_memory_bytes, 1 / 2),
        (f"fast: samples/s {ours}/classic >= 0.95", e_f.samples_per_s / f["classic"].samples_per_s, 0.95),
        (f"fast: first batch {ours}/classic <= 1/2", e_f.first_batch_s / f["classic"].first_batch_s, 1 / 2),
    ]


def format_checks(checks: Sequence[tuple[str, float, float]]) -> str:
    lines = []
    for target, ratio, limit in checks:
        met = ratio >= limit if ">=" in target else ratio <= limit
        lines.append(f"{'met   ' if met else 'MISSED'} {target}: {ratio:.2f}")
    return "\n".join(lines)


def sweep_table(worker_counts: Sequence[int]) -> list[tuple[str, ...]]:
    """Peak shared memory of the slow loop against num_workers, one run per loader and count."""
    table = []
    for num_workers in worker_counts:
        rows = {r.loader: r for r in run_loop("slow", num_workers, repeats=1)}
        cells = [str(num_workers)]
        for name in LOADERS:
            cells.append(f"{rows[name].peak_shmem_bytes / MIB:,.0f} ({rows[name].peak_tree_shm_bytes / MIB:,.0f})")
        table.append(tuple(cells))
    return table


def format_table(headers: Sequence[str], rows: Sequence[Sequence[str]], markdown: bool) -> str:
    if markdown:
        lines = ["| " + " | ".join(headers) + " |", "|" + "|".join("---" for _ in headers) + "|"]
        return "\n".join(lines + ["| " + " | ".join(row) + " |" for row in rows])
    widths = [max(len(str(c)) for c in column) for column in zip(headers, *rows)]
    return "\n".join("  ".join(f"{c:>{w}}" for c, w in zip(row, widths)) for row in [headers, *rows])


def main(argv: Sequence[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    _log(f"torch {torch.__version__}, pipeload {pipeload.__version__}, start method "
         f"{torch.multiprocessing.get_start_method()}, batch {BATCH_SIZE}, prefetch_factor "
         f"{PREFETCH_FACTOR}, num_workers {args.num_workers}, repeats {args.repeats}")
    slow = run_loop("slow", args.num_workers, args.repeats)
    fast = run_loop("fast", args.num_workers, args.repeats)
    print(format_table(HEADERS, loop_table("slow", slow) + loop_table("fast", fast), args.markdown))
    for name in ECONOMIC_LOADERS:
        print(format_checks(target_checks(slow, fast, name)))
    if args.sweep:
        headers = ("num_workers", *(f"{name} Shmem (tree) MiB" for name in LOADERS))
        print(format_table(headers, sweep_table(args.sweep), args.markdown))
    return 0


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="python -m bench.economic", description=__doc__.split("\n")[0])
    parser.add_argument("--num-workers", type=int, default=8, help="default: %(default)s")
    parser.add_argument("--repeats", type=int, default=2, help="default: %(default)s")
    parser.add_argument("--sweep", type=_counts, default=None, metavar="2,4,8,16",
                        help="also tabulate the slow loop's peak shared memory for these num_workers")
    parser.add_argument("--markdown", action="store_true", help="print Markdown tables")
    return parser


def _counts(text: str) -> list[int]:
    try:
        counts = [int(part) for part in text.split(",")]
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected numbers separated by commas, got {text!r}") from None
    if any(count < 1 for count in counts):
        raise argparse.ArgumentTypeError(f"worker counts must be >= 1, got {text!r}")
    return counts


def _log(message: str) -> None:
    print(message, file=sys.stderr, flush=True)


if __name__ == "__main__":
    sys.exit(main())
