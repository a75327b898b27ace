"""Load the same workloads with pipeload and torch.utils.data in one run, and compare.

    python -m bench.run [--workload NAME ...] [--num-workers 2] [--repeats N] [--quick]

For every workload, each loader first takes a few untimed warm-up batches. Then, for every
repeat, both loaders run one after the other with a fresh loader each, and the order alternates
(pipeload first, then torch first, ...) so warm-up and drifting machine load fall on both alike.
Every batch is read as a training step's copy would (one byte of each 4 KiB page), and a pass is
timed until its loader is dropped and its workers have exited (bench/measure.py). The table
gives, per workload and loader, the median samples/s and time to first batch over the
repeats, the peak RSS of the whole process tree and the peak shared memory the tree holds (see
bench/measure.py: /dev/shm segments, memfd files and anonymous shared mappings alike), the median
CPU time the tree spent per sample (main process and workers; on a shared machine it does not
swing with other programs' load as wall-clock rates do), then the ratio pipeload/torch for each
column. Under the table, each workload's ratio repeat by repeat says whether the pairs tell the
loaders apart at all.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import sys
import tempfile
import time
from collections import deque
from collections.abc import Callable, Iterable, Sequence
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import torch
import torch.utils.data

import pipeload
from bench.measure import Measurement, measure, warm_up
from bench.workloads import (
    DEFAULT_WORKLOADS,
    WORKLOADS,
    Workload,
    WorkloadContext,
    batch_length,
    get_workload,
)

LOADER_NAMES = ("pipeload", "torch")
START_METHODS = ("fork", "spawn", "forkserver")
WARMUP_BATCHES = 3
MIB = 1024 * 1024
# /dev/shm is shared with the whole machine; growth under 1 MiB on both sides is not a signal.
SHM_RATIO_FLOOR = 1 * MIB


@dataclass(frozen=True)
class RunOptions:
    """How every loader in the run is configured (the same for pipeload and torch)."""

    num_workers: int = 2
    repeats: int = 2
    epochs: int = 1
    quick: bool = False
    worker_type: str = "process"  # pipeload only
    start_method: str | None = None  # None: the platform's default


@dataclass(frozen=True)
class Summary:
    """One workload and loader, reduced over the repeats."""

    workload: str
    loader: str
    samples_per_s: float
    first_batch_s: float
    peak_rss_bytes: int
    peak_shm_bytes: int
    cpu_us_per_sample: float


def make_loader(
    loader_name: str, dataset: Any, batch_size: int, options: RunOptions, pin_memory: bool = False
) -> Iterable[Any]:
    """A fresh DataLoader of the named kind; both kinds get identical arguments."""
    arguments: dict[str, Any] = {"batch_size": batch_size, "num_workers": options.num_workers,
                                 "pin_memory": pin_memory}
    if options.start_method is not None and options.num_workers > 0:
        arguments["multiprocessing_context"] = options.start_method
    if loader_name == "pipeload":
        return pipeload.DataLoader(dataset, worker_type=options.worker_type, **arguments)
    if loader_name == "torch":
        return torch.utils.data.DataLoader(dataset, **arguments)
    raise ValueError(f"loader_name must be one of {LOADER_NAMES}, got {loader_name!r}")


def run_workload(
    name: str, options: RunOptions, scratch_dir: Path, first_loader: int = 0
) -> list[Measurement]:
    """Measure both loaders on one workload ``options.repeats`` times, alternating their order."""
    workload = get_workload(name)
    datasets = {
        loader_name: workload.make(
            WorkloadContext(workload.items(options.quick), loader_name, scratch_dir)
        )
        for loader_name in LOADER_NAMES
    }
    # Which loader forks first turns too: a process's first loader may leave its allocator in a
    # state the other's workers inherit.
    for loader_name in (reversed(LOADER_NAMES) if first_loader % 2 else LOADER_NAMES):
        warm_up(_loader_factory(loader_name, datasets[loader_name], workload, options),
                WARMUP_BATCHES)
    measurements = []
    for repeat in range(options.repeats):
        flip = (repeat + first_loader) % 2 == 1
        for loader_name in reversed(LOADER_NAMES) if flip else LOADER_NAMES:
            consumer = Consumer(workload)
            result = measure(
                _loader_factory(loader_name, datasets[loader_name], workload, options),
                batch_length, workload=name, loader=loader_name, epochs=options.epochs,
                step=consumer if consumer.active else None,
            )
            consumer.finish()
            if consumer.to_gpu and consumer.pinned < consumer.batches:
                _log(f"WARNING: {loader_name} handed out {consumer.batches - consumer.pinned} "
                     f"of {consumer.batches} batches unpinned on {name}")
            _log(f"{name:<13} {loader_name:<9} repeat {repeat + 1}/{options.repeats}: "
                 f"{result.samples_per_s:>12,.0f} samples/s, first batch "
                 f"{result.first_batch_s * 1e3:,.0f} ms, CPU {result.cpu_us_per_sample:,.1f} us/sample"
                 f"{consumer.describe()}")
            _check_sample_count(result, workload.items(options.quick) * options.epochs)
            measurements.append(result)
    return measurements


def _check_sample_count(result: Measurement, expected: int) -> None:
    # Every workload yields each item exactly once per epoch; a different count means items were
    # lost or duplicated (a bad iterable shard, say), and the speed figure is not comparable.
    if result.samples != expected:
        _log(f"WARNING: {result.loader} yielded {result.samples} samples on {result.workload}, "
             f"expected {expected}")


def _loader_factory(
    loader_name: str, dataset: Any, workload: Workload, options: RunOptions
) -> Callable[[], Iterable[Any]]:
    return lambda: make_loader(loader_name, dataset, workload.batch_size, options,
                               pin_memory=workload.to_gpu)


class Consumer:
    """The simulated training loop's work on each batch: a fixed delay, or a copy to the GPU.

    GPU copies are issued with ``non_blocking=True``, one batch in flight at a time (the copy of
    the previous batch is waited for before the next is issued), and every batch is checked for
    ``is_pinned()``.
    """

    def __init__(self, workload: Workload) -> None:
        self.delay_s = workload.consumer_s
        self.to_gpu = workload.to_gpu
        self.active = self.delay_s > 0 or self.to_gpu
        self.batches = 0
        self.pinned = 0
        self._in_flight: deque[Any] = deque()

    def __call__(self, batch: Any) -> None:
        self.batches += 1
        if self.to_gpu:
            self.pinned += int(batch.is_pinned())
            event = torch.cuda.Event()
            batch.cuda(non_blocking=True)
            event.record()
            self._in_flight.append(event)
            if len(self._in_flight) > 1:
                self._in_flight.popleft().synchronize()
        if self.delay_s > 0:
            time.sleep(self.delay_s)

    def finish(self) -> None:
        if self.to_gpu:
            torch.cuda.synchronize()

    def describe(self) -> str:
        return f", {self.pinned}/{self.batches} batches pinned" if self.to_gpu else ""


def summarise(measurements: Sequence[Measurement]) -> list[Summary]:
    """Per workload and loader: medians of speed and first-batch time, maxima of the peaks."""
    keys = dict.fromkeys((m.workload, m.loader) for m in measurements)
    summaries = []
    for workload, loader in keys:
        runs = [m for m in measurements if (m.workload, m.loader) == (workload, loader)]
        summaries.append(Summary(
            workload, loader,
            statistics.median(m.samples_per_s for m in runs),
            statistics.median(m.first_batch_s for m in runs),
            max(m.peak_rss_bytes for m in runs),
            max(m.peak_tree_shm_bytes for m in runs),
            statistics.median(m.cpu_us_per_sample for m in runs),
        ))
    return summaries


HEADERS = ("workload", "loader", "samples/s", "first batch ms", "peak RSS MiB", "peak shm MiB",
           "CPU us/sample")


def table_rows(summaries: Sequence[Summary]) -> list[tuple[str, ...]]:
    """Rows of text: each loader's figures, and after each workload a pipeload/torch ratio row."""
    rows = []
    by_key = {(s.workload, s.loader): s for s in summaries}
    for workload in dict.fromkeys(s.workload for s in summaries):
        for loader in LOADER_NAMES:
            if (row := by_key.get((workload, loader))) is not None:
                rows.append((workload, loader, f"{row.samples_per_s:,.0f}",
                             f"{row.first_batch_s * 1e3:,.0f}", f"{row.peak_rss_bytes / MIB:,.0f}",
                             f"{row.peak_shm_bytes / MIB:,.1f}", f"{row.cpu_us_per_sample:,.1f}"))
        ours, theirs = by_key.get((workload, "pipeload")), by_key.get((workload, "torch"))
        if ours is not None and theirs is not None:
            rows.append((workload, "pipeload/torch",
                         _ratio(ours.samples_per_s, theirs.samples_per_s),
                         _ratio(ours.first_batch_s, theirs.first_batch_s),
                         _ratio(ours.peak_rss_bytes, theirs.peak_rss_bytes),
                         _ratio(ours.peak_shm_bytes, theirs.peak_shm_bytes, SHM_RATIO_FLOOR),
                         _ratio(ours.cpu_us_per_sample, theirs.cpu_us_per_sample)))
    return rows


def paired_ratio_lines(measurements: Sequence[Measurement]) -> list[str]:
    """Per workload, pipeload/torch samples/s of each repeat (the two loaders ran back to back,
    so a drifting load weighs on both of a pair alike), and whether the pairs tell the loaders
    apart: the medians' ratio in the table divides runs of different repeats."""
    lines = []
    for workload in dict.fromkeys(m.workload for m in measurements):
        runs = {name: [m for m in measurements if (m.workload, m.loader) == (workload, name)]
                for name in LOADER_NAMES}
        pairs = [ours.samples_per_s / theirs.samples_per_s
                 for ours, theirs in zip(runs["pipeload"], runs["torch"]) if theirs.samples_per_s > 0]
        if not pairs:
            continue
        verdict = (f"pipeload faster in all {len(pairs)} pairs" if min(pairs) > 1 else
                   f"torch faster in all {len(pairs)} pairs" if max(pairs) < 1 else
                   "the pairs straddle 1: no difference this run can tell")
        if len(pairs) < 3:
            verdict += "; too few pairs to say more"
        lines.append(f"{workload}: pipeload/torch by repeat "
                     f"{', '.join(f'{ratio:.2f}x' for ratio in pairs)} ({verdict})")
    return lines


def _ratio(ours: float, theirs: float, floor: float = 0.0) -> str:
    # Below the floor, a ratio of two near-zero amounts is noise: say so instead of printing it.
    if theirs <= 0 or ours < 0 or max(ours, theirs) <= floor:
        return "n/a"
    return f"{ours / theirs:.2f}x"


def format_table(rows: Sequence[tuple[str, ...]], markdown: bool = False) -> str:
    """Aligned plain text, or a Markdown table to paste into RESULTS.md."""
    widths = [max(len(str(cell)) for cell in column) for column in zip(HEADERS, *rows)]
    if markdown:
        lines = ["| " + " | ".join(HEADERS) + " |",
                 "|" + "|".join(["---", "---"] + ["---:"] * (len(HEADERS) - 2)) + "|"]
        lines += ["| " + " | ".join(row) + " |" for row in rows]
        return "\n".join(lines)
    def line(cells: Sequence[str]) -> str:
        left = [f"{c:<{w}}" for c, w in zip(cells[:2], widths[:2])]
        right = [f"{c:>{w}}" for c, w in zip(cells[2:], widths[2:])]
        return "  ".join(left + right)
    return "\n".join([line(HEADERS), *(line(row) for row in rows)])


def describe_machine(options: RunOptions) -> str:
    """One line naming the machine and the settings, printed above the table."""
    start_method = options.start_method or torch.multiprocessing.get_start_method()
    return (f"{os.cpu_count()} CPUs, {platform.system()} {platform.machine()}, Python "
            f"{platform.python_version()}, torch {torch.__version__}, pipeload "
            f"{getattr(pipeload, '__version__', '?')}; num_workers={options.num_workers}, "
            f"start method {start_method}, pipeload workers: {options.worker_type}, "
            f"repeats {options.repeats}, epochs {options.epochs}"
            f"{', quick' if options.quick else ''}")


def main(argv: Sequence[str] | None = None) -> int:
    """Run the benchmark; see the module docstring."""
    args = _parser().parse_args(argv)
    options = RunOptions(
        num_workers=args.num_workers, repeats=args.repeats or (1 if args.quick else 2),
        epochs=args.epochs, quick=args.quick, worker_type=args.worker_type,
        start_method=args.start_method,
    )
    names = runnable_workloads(args.workload or [*DEFAULT_WORKLOADS, "gpu_copy"])
    if not names:
        _log("nothing to run: every workload asked for needs what this machine lacks")
        return 0
    _log(describe_machine(options))
    measurements = []
    with tempfile.TemporaryDirectory(prefix="pipeload-bench-") as scratch:
        for index, name in enumerate(names):
            measurements += run_workload(name, options, Path(scratch), first_loader=index)
    print(describe_machine(options))
    print(format_table(table_rows(summarise(measurements)), markdown=args.markdown))
    for line in paired_ratio_lines(measurements):
        print(line)
    if args.json is not None:
        _write_json(args.json, options, measurements)
    return 0


def runnable_workloads(names: Sequence[str]) -> list[str]:
    """``names`` without the workloads this machine cannot run, each skipped with a message
    saying why (``gpu_copy`` needs a CUDA device)."""
    runnable = []
    for name in names:
        if get_workload(name).to_gpu and not torch.cuda.is_available():
            _log(f"skipping {name}: it copies every batch to a CUDA device, and torch "
                 f"{torch.__version__} sees none here (torch.cuda.is_available() is False)")
            continue
        runnable.append(name)
    return runnable


def _write_json(path: Path, options: RunOptions, measurements: Sequence[Measurement]) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    record = {"machine": describe_machine(options), "options": asdict(options),
              "measurements": [asdict(m) | {"samples_per_s": m.samples_per_s}
                               for m in measurements]}
    path.write_text(json.dumps(record, indent=2) + "\n")


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="python -m bench.run", description=__doc__.split("\n")[0])
    parser.add_argument("--workload", action="append", choices=sorted(WORKLOADS),
                        help="a workload to run; repeat for several (default: all; gpu_copy "
                             "is skipped, with a message, where CUDA is not available)")
    parser.add_argument("--num-workers", type=_non_negative_int, default=2,
                        help="default: %(default)s")
    parser.add_argument("--repeats", type=_positive_int, default=None,
                        help="runs per loader and workload (default: 2, or 1 with --quick)")
    parser.add_argument("--epochs", type=_positive_int, default=1, help="default: %(default)s")
    parser.add_argument("--quick", action="store_true", help="about a tenth of the items")
    parser.add_argument("--worker-type", choices=("process", "thread"), default="process",
                        help="pipeload's workers (default: %(default)s)")
    parser.add_argument("--start-method", choices=START_METHODS, default=None,
                        help="multiprocessing context for both loaders (default: platform's)")
    parser.add_argument("--markdown", action="store_true", help="print a Markdown table")
    parser.add_argument("--json", type=Path, default=None, metavar="PATH",
                        help="also write every measurement here (bench/out/ is git-ignored)")
    return parser


def _positive_int(text: str) -> int:
    if not text.isdigit() or int(text) < 1:
        raise argparse.ArgumentTypeError(f"expected an integer >= 1, got {text!r}")
    return int(text)


def _non_negative_int(text: str) -> int:
    if not text.isdigit():
        raise argparse.ArgumentTypeError(f"expected an integer >= 0, got {text!r}")
    return int(text)


def _log(message: str) -> None:
    print(message, file=sys.stderr, flush=True)


if __name__ == "__main__":
    sys.exit(main())
