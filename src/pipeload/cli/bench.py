"""``pipeload bench``: torch's DataLoader and pipeload's modes, side by side, on JPEG shards.

Every loader reads the same dataset (see ``images.py``) with the same batch size, workers and
seed. Runs are interleaved: each repeat goes through all loaders, starting one further along each
time, so warm-up and drifting machine load fall on all of them alike; the table shows medians
and the spread (lowest to highest samples/s), so noise is visible rather than hidden.

torch's side lives in the source checkout's ``bench/baseline.py`` (pipeload itself never calls
torch's loader); without a checkout, only pipeload's rows are shown.
"""

from __future__ import annotations

import importlib.util
import os
import statistics
import sys
import time
import warnings
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

import pipeload
from pipeload.cli.images import (CROP_SIDE, OUTPUT_SIDE, SOURCE_SIDE, TarImages, cache_dir, ensure_images,
                                  shard_pipe)
from pipeload.cli.measure import Run, time_one_pass
from pipeload.cli.profile import CommandError

SEED = 0
BASELINE_PATH = Path(__file__).resolve().parents[3] / "bench" / "baseline.py"
MIB = 1024 * 1024


@dataclass(frozen=True)
class BenchOptions:
    """What ``pipeload bench`` runs."""

    size: int = 2048
    workers: int = 2
    repeats: int = 3
    batch_size: int = 64
    loaders: tuple[str, ...] = ("torch", "classic", "economic", "threads", "pipes")
    chart: Path | None = None  # None: a timestamped file under the cache directory


LoaderMaker = Callable[[TarImages, BenchOptions], Iterable[Any]]


def _generator() -> torch.Generator:
    return torch.Generator().manual_seed(SEED)


def _pipeload(**extra: Any) -> LoaderMaker:
    def make(images: TarImages, options: BenchOptions) -> Iterable[Any]:
        return pipeload.DataLoader(images, batch_size=options.batch_size, shuffle=True,
                                   num_workers=options.workers, generator=_generator(), **extra)
    return make


def _pipes(images: TarImages, options: BenchOptions) -> Iterable[Any]:
    return pipeload.DataLoader(shard_pipe(images), batch_size=options.batch_size,
                               num_workers=options.workers, generator=_generator())


def _torch(images: TarImages, options: BenchOptions) -> Iterable[Any]:
    baseline = _load_baseline()
    if baseline is None:
        raise LookupError(f"torch's side needs the source checkout's {BASELINE_PATH}")
    return baseline.make_torch_loader(images, options.batch_size, options.workers, SEED)


def _economic(images: TarImages, options: BenchOptions) -> Iterable[Any]:
    if options.workers == 0:
        raise LookupError("economic mode needs workers (--workers 0 was given)")
    return _pipeload(mode="economic")(images, options)


@dataclass(frozen=True)
class LoaderKind:
    """One row of the demo: how it is made, what runs, and what that mode is for (the same
    words as the README's "Modes" table, which a test holds them to)."""

    make: LoaderMaker
    how: str
    use_when: str


LOADERS: dict[str, LoaderKind] = {
    "torch": LoaderKind(_torch, "torch.utils.data.DataLoader, process workers",
                        "the reference: torch's own loader, the same dataset and settings"),
    "classic": LoaderKind(_pipeload(), "pipeload, process workers building whole batches (as torch)",
                          "the default: Python-heavy `__getitem__` (decoding, augmenting) that needs "
                          "real parallelism"),
    "economic": LoaderKind(_economic, "pipeload mode='economic': item workers fetch into the batch's shared memory, "
                           "batch workers collate what the main process cannot name in place",
                           "large items (video, volumes, audio): memory stays at `prefetch_factor` "
                           "batches whatever `num_workers` is, and the first batch is built by all "
                           "workers at once; small items (such as the demo's JPEGs) gain little from it: "
                           "on the 2-core box it ran 0.93x to 1.02x classic mode in five-run medians "
                           "(`pipeload bench --loaders classic,economic --repeats 5`, 2026-12-01; 0.87x "
                           "to 1.03x before a fresh loader's first batch went into shared memory too): "
                           "reseeding `random`, torch and numpy before every item (so that random draws "
                           "do not depend on which worker fetched it) takes its item workers about 4% of "
                           "their CPU, and every piece of a batch costs a message each way through the "
                           "main process"),
    "threads": LoaderKind(_pipeload(worker_type="thread"), "pipeload, thread workers",
                          "light samples, or work that mostly releases the GIL (numpy, torch ops, "
                          "I/O): no pickling, no shared memory, fast start; Python code per sample "
                          "(much of the demo's decoding) runs one thread at a time"),
    "pipes": LoaderKind(_pipes, "pipeload over a DataPipe graph reading whole shards",
                        "streaming from shards or remote storage, sharded per worker and rank"),
}
ECONOMIC_BATCH_WORKERS = 2  # economic mode's default: one per batch in flight (prefetch_factor 2)
# Fewer batches than this per pass: the rate is mostly start-up (workers, first batch).
MIN_RATE_BATCHES = 10
# A load average at or above this per usable CPU before the runs: other work shares the CPUs.
BUSY_LOAD_PER_CPU = 0.5
# What the table's columns measured, and where a newcomer goes from here (after the chart).
COLUMNS = ("columns: samples/s, the median over the runs (spread: slowest..fastest run); first batch: "
           "from iter(loader) to the first batch; peak RSS: resident memory of the loader's "
           "processes, summed (a page several of them share, such as what importing torch left in "
           "the main process before it forked them, counts in each: more processes, more RSS); "
           "peak shm: the shared memory they map or hold, each segment once")
NEXT_STEP = ("next: to see what limits your own loader, print(loader.stats()) after an epoch or "
             "run `pipeload profile yourmodule:make_dataset` (README: \"See what your loader is doing\")")


def _load_baseline() -> Any:
    """bench/baseline.py, found by path from this file, not by name (a stray `bench` module on
    the path cannot stand in for it); None outside a source checkout."""
    if not BASELINE_PATH.is_file():
        return None
    spec = importlib.util.spec_from_file_location("_pipeload_bench_baseline", BASELINE_PATH)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def available(names: Sequence[str]) -> list[str]:
    """``names`` without torch when there is no checkout to take it from (said once on stderr)."""
    if "torch" in names and not BASELINE_PATH.is_file():
        print(f"pipeload bench: torch's side needs a source checkout ({BASELINE_PATH} is missing): "
              "pipeload only", file=sys.stderr)
        return [n for n in names if n != "torch"]
    return list(names)


def batches_per_pass(options: BenchOptions) -> int:
    return -(-options.size // options.batch_size)


def check_options(options: BenchOptions) -> None:
    """Refuse runs that could not measure what the table shows.

    Raises:
        CommandError: fewer batches per pass than workers (some workers would build nothing,
            and the pipes loader, whose shards go to workers, would not even read them all).
        LookupError: economic mode without workers.
    """
    if "economic" in options.loaders and options.workers == 0:
        raise LookupError("economic mode needs workers (--workers 0 was given); leave it out "
                          "with --loaders, or give --workers 1 or more")
    batches = batches_per_pass(options)
    if batches < options.workers:
        raise CommandError(f"--size {options.size} with --batch-size {options.batch_size} makes "
                           f"{batches} batch(es) per pass, fewer than the {options.workers} workers: "
                           f"some would build nothing; give --size {options.workers * options.batch_size} "
                           "or more")


def degenerate(options: BenchOptions) -> list[str]:
    """What the table cannot show with these options, in words (empty: nothing)."""
    notes = []
    batches = batches_per_pass(options)
    if batches < MIN_RATE_BATCHES:
        notes.append(f"{batches} batch(es) per pass: the rates are mostly start-up (workers, first "
                     f"batch); give --size {MIN_RATE_BATCHES * options.batch_size} or more for "
                     "rates that mean something")
    if options.repeats == 1:
        notes.append("one run per loader: no spread to show the noise (--repeats 3 or more)")
    return notes


def run(options: BenchOptions) -> int:
    """The whole command: dataset, runs, table, chart. Returns the exit status."""
    check_options(options)
    if options.chart is not None:
        _check_chart_path(options.chart)
    names = available(options.loaders)
    images = TarImages(_dataset(options.size))
    _say(f"{len(images)} JPEG images ({images.directory}; each {SOURCE_SIDE}x{SOURCE_SIDE}, decoded, "
         f"cropped to {CROP_SIDE}, resized to {OUTPUT_SIDE}x{OUTPUT_SIDE}, flipped at random), "
         f"batch {options.batch_size}, {options.workers} workers, {options.repeats} repeats, "
         f"loaders: {', '.join(names)}")
    for name in names:
        extra = (f" ({options.workers} item worker{'s' * (options.workers != 1)} and up to "
                 f"{ECONOMIC_BATCH_WORKERS} batch workers, started when a batch needs one: "
                 "none for these flat samples)"
                 if name == "economic" else "")
        _say(f"  {name:<9} {LOADERS[name].how}{extra}")
    load_before = load_average()
    runs = []
    for repeat in range(options.repeats):
        shift = repeat % len(names)
        for name in names[shift:] + names[:shift]:
            runs.append(_one_run(name, repeat, images, options))
    rows = summarise(runs, names)
    print(format_table(rows))
    print(COLUMNS)
    print(_machine_line(options))
    for note in [*degenerate(options), *noise_notes(rows, load_before)]:
        print(f"note: {note}")
    print("what each mode is for:")
    for name in names:
        print(f"  {name:<9} {LOADERS[name].use_when}")
    chart = write_chart(rows, options)
    if chart is not None:
        print(f"chart: {chart}")
    print(NEXT_STEP)
    return 0


def _dataset(size: int) -> Path:
    from pipeload.cli.images import dataset_dir

    if (dataset_dir(size) / "index.json").is_file():
        return dataset_dir(size)
    if cache_dir().exists() and not cache_dir().is_dir():  # mkdir would say only "File exists"
        raise CommandError(f"the cache {cache_dir()} is not a directory; set PIPELOAD_CACHE to a "
                           "writable directory", status=1)
    try:
        cache_dir().mkdir(parents=True, exist_ok=True)  # an unusable cache is the only line said
        _say(f"first run: writing {size} synthetic JPEG images in tar shards under {cache_dir()}")
        with _bar(size, "writing images", "img") as bar:
            return ensure_images(size, bar)
    except OSError as error:
        raise CommandError(f"cannot write the dataset under {cache_dir()}: {error.strerror or error}; "
                           "set PIPELOAD_CACHE to a writable directory", status=1) from None


def _one_run(name: str, repeat: int, images: TarImages, options: BenchOptions) -> Run:
    label = f"{name:<9} {repeat + 1}/{options.repeats}"
    total = -(-len(images) // options.batch_size)
    with warnings.catch_warnings(), _bar(total, label, "batch") as bar:
        if name == "economic":
            # Its batch workers may start besides the --workers item workers (none do for these
            # flat samples), and torch's warning counts them (when the loader is made and as its
            # workers start): more processes than CPUs on a small machine, said in the middle of
            # the runs on every pass. The header says it once instead (see run).
            warnings.filterwarnings("ignore", message="This DataLoader will create", category=UserWarning)
        result = time_one_pass(name, repeat, lambda: LOADERS[name].make(images, options),
                               _batch_length, bar.update)
    _say(f"{label}: {result.samples_per_s:>9,.0f} samples/s, first batch "
         f"{result.first_batch_s * 1e3:,.0f} ms")
    return result


def _batch_length(batch: Any) -> int:
    return len(batch[0])


@dataclass(frozen=True)
class Row:
    """One loader over all repeats."""

    loader: str
    median_samples_per_s: float
    lowest: float
    highest: float
    first_batch_s: float
    peak_rss_bytes: int
    peak_shm_bytes: int
    runs: int = 1


def summarise(runs: Sequence[Run], names: Sequence[str]) -> list[Row]:
    rows = []
    for name in names:
        mine = [r for r in runs if r.loader == name]
        speeds = [r.samples_per_s for r in mine]
        rows.append(Row(name, statistics.median(speeds), min(speeds), max(speeds),
                        statistics.median(r.first_batch_s for r in mine),
                        max(r.peak_rss_bytes for r in mine), max(r.peak_shm_bytes for r in mine),
                        len(mine)))
    return rows


def format_table(rows: Sequence[Row]) -> str:
    """Plain text: per loader, median samples/s with its spread, and the ratio to torch's."""
    torch_row = next((r for r in rows if r.loader == "torch"), None)
    header = (f"{'loader':<10}{'samples/s':>11}{'spread':>19}{'vs torch':>10}"
              f"{'first batch':>13}{'peak RSS':>11}{'peak shm':>11}")
    lines = [header]
    for row in rows:
        ratio = f"{row.median_samples_per_s / torch_row.median_samples_per_s:.2f}x" if torch_row else "-"
        spread = f"{row.lowest:,.0f}..{row.highest:,.0f}" if row.runs > 1 else "(one run)"
        lines.append(f"{row.loader:<10}{row.median_samples_per_s:>11,.0f}{spread:>19}{ratio:>10}"
                     f"{row.first_batch_s * 1e3:>10,.0f} ms{row.peak_rss_bytes / MIB:>7,.0f} MiB"
                     f"{row.peak_shm_bytes / MIB:>7,.1f} MiB")
    return "\n".join(lines)


def _machine_line(options: BenchOptions) -> str:
    from pipeload.stats.recorder import usable_cpus

    runs = (f"medians of {options.repeats} interleaved runs; on a shared or busy machine the "
            "spread shows how much is noise" if options.repeats > 1 else "one run per loader")
    load = load_average()
    at_end = f", load average {load:.1f} at the end" if load is not None else ""
    return (f"{usable_cpus()} usable CPUs{at_end}, torch {torch.__version__}, pipeload "
            f"{pipeload.__version__}; {runs}")


def load_average() -> float | None:
    """The machine's 1-minute load average (None where the system has none)."""
    try:
        return os.getloadavg()[0]
    except (AttributeError, OSError):
        return None


def noise_notes(rows: Sequence[Row], load_before: float | None) -> list[str]:
    """What the figures cannot tell apart: a machine already busy before the runs (other work
    then takes a share that differs from run to run), and loaders whose spread overlaps
    torch's (their ratio may be noise)."""
    from pipeload.stats.recorder import usable_cpus

    notes = []
    cpus = usable_cpus()
    if load_before is not None and load_before >= BUSY_LOAD_PER_CPU * cpus:
        notes.append(f"the machine was busy before the runs (load average {load_before:.1f} on {cpus} "
                     "usable CPUs): other work took part of the CPUs, and more in some runs than in "
                     "others; compare loaders on an idle machine")
    torch_row = next((r for r in rows if r.loader == "torch" and r.runs > 1), None)
    if torch_row is not None:
        overlapping = [r.loader for r in rows if r is not torch_row and r.runs > 1
                       and r.lowest <= torch_row.highest and torch_row.lowest <= r.highest]
        if overlapping:
            notes.append(f"the spread of {', '.join(overlapping)} overlaps torch's "
                         f"({torch_row.lowest:,.0f}..{torch_row.highest:,.0f}): this run does not "
                         "tell them apart from torch")
    return notes


def _check_chart_path(path: Path) -> None:
    # Refused before the runs, not after minutes of them.
    if path.is_dir():
        raise CommandError(f"--chart {path} is a directory; give a file name such as {path / 'bench.png'}")
    blocking = next((parent for parent in path.parents if parent.exists() and not parent.is_dir()), None)
    if blocking is not None:  # mkdir says "File exists" of it
        raise CommandError(f"cannot write the chart to {path}: {blocking} is a file, not a directory")
    existed = path.exists()
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        with open(path, "ab"):  # a trial open: the only sure test of "can write here" (root included)
            pass
    except OSError as error:
        raise CommandError(f"cannot write the chart to {path}: {error.strerror or error}") from None
    if not existed:
        path.unlink()


def write_chart(rows: Sequence[Row], options: BenchOptions) -> Path | None:
    """A PNG bar chart of samples/s with the spread as error bars; None without matplotlib."""
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        _say("pipeload bench: matplotlib is not installed: no chart (pip install 'pipeload[bench]')")
        return None
    path = options.chart or cache_dir() / "bench" / f"pipeload-bench-{time.strftime('%Y%m%d-%H%M%S')}.png"
    figure, axis = plt.subplots(figsize=(7, 0.6 * len(rows) + 1.4))
    medians = [r.median_samples_per_s for r in rows]
    errors = [[m - r.lowest for m, r in zip(medians, rows)], [r.highest - m for m, r in zip(medians, rows)]]
    colours = ["#9e9e9e" if r.loader == "torch" else "#3f7fbf" for r in rows]
    axis.barh([r.loader for r in rows], medians, xerr=errors, color=colours, capsize=4)
    axis.invert_yaxis()
    axis.set_xlabel("samples/s (median; bars: lowest to highest run)")
    axis.set_title(f"pipeload bench: {options.size} JPEGs, batch {options.batch_size}, "
                   f"{options.workers} workers")
    figure.tight_layout()
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        # format= given: without it matplotlib appends ".png" to a name without that suffix, and
        # the path printed would not be the file written.
        figure.savefig(path, dpi=110, format="png")
    except OSError as error:
        raise CommandError(f"cannot write the chart to {path}: {error.strerror or error}", status=1) from None
    finally:
        plt.close(figure)
    return path


class _NoBar:
    def update(self, n: int = 1) -> None:
        pass

    def __enter__(self) -> _NoBar:
        return self

    def __exit__(self, *exc: object) -> None:
        pass


def _bar(total: int, label: str, unit: str) -> Any:
    try:
        from tqdm import tqdm
    except ImportError:
        return _NoBar()
    # disable=None: drawn only on a terminal, so logs and pipes stay clean.
    return tqdm(total=total, desc=label, unit=unit, leave=False, disable=None, file=sys.stderr)


def _say(message: str) -> None:
    print(message, file=sys.stderr, flush=True)
