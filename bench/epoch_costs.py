"""What each epoch costs, epoch by epoch: pipeload beside torch.utils.data, in one run.

    python -m bench.epoch_costs [--num-workers 2] [--batch-size 64] [--item-shape 3,224,224]
                                [--items 4096] [--epochs 4] [--scenario NAME ...] [--gpu-copy]
                                [--order back-to-back|interleaved]

Three ways a training script meets its loader's epochs, each run with both loaders:

    persistent   one loader, ``persistent_workers=True``: the same workers every epoch
    per-epoch    one loader, ``persistent_workers=False`` (torch's default): new workers each epoch
    new-loader   a new loader every epoch (the one before is deleted)

For every epoch it prints the set-up time (the ``iter()`` call), the first-batch time (from
``iter()`` to the first batch in hand), samples/s over the whole epoch (from ``iter()`` to the
end, workers stopped), and figures that depend little on the machine's load: the CPU time of the
whole process tree in the epoch (main process and workers, stopped ones included), the training
loop thread's minor page faults per batch (``getrusage(RUSAGE_THREAD)``) and, for pipeload, what
its slab pool did (slabs made; slabs mapped by workers, each a page-table entry per page in that
worker; batches that travelled in one-shot buffers instead of slabs).

The training loop reads each batch as a copy would: one value per 4 KiB page. ``--gpu-copy``
loads with ``pin_memory=True`` instead, copies each batch to the GPU with ``non_blocking=True``
(one copy in flight) and counts the batches that were ``is_pinned()``; without CUDA it says so and
stops.

``--order`` says how the loaders' epochs follow each other:

    back-to-back  (the default) each loader runs all its epochs one after the other, as a training
                  script does, then the next loader does; the runs' order turns with each
                  scenario, so that a machine whose load drifts weighs on both loaders
    interleaved   epoch 1 of every loader, then epoch 2 of every loader, and so on, the order
                  turning each time: drift weighs on all alike, but a loader's epoch starts
                  after another loader's, not after its own. That can flatter a loader
                  without persistent workers: its last workers finish exiting during another
                  loader's epoch (bench/RESULTS.md, stop 48)

Ratios compare the same epoch of the same run.
"""

from __future__ import annotations

import argparse
import gc
import os
import resource
import statistics
import sys
import time
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import Any

import psutil
import torch
import torch.utils.data

import pipeload
from bench.run import _positive_int

LOADERS = ("pipeload", "torch")
SCENARIOS = ("persistent", "per-epoch", "new-loader")
ORDERS = ("back-to-back", "interleaved")
PAGE_BYTES = 4096


class FloatItems(torch.utils.data.Dataset):
    """Item ``i`` is a float32 tensor of ``shape`` filled with a value derived from ``i``."""

    def __init__(self, count: int, shape: tuple[int, ...]) -> None:
        self.count = count
        self.shape = shape

    def __len__(self) -> int:
        return self.count

    def __getitem__(self, index: int) -> torch.Tensor:
        return torch.full(self.shape, float(index % 251) / 251.0)


@dataclass(frozen=True)
class Options:
    num_workers: int = 2
    batch_size: int = 64
    item_shape: tuple[int, ...] = (3, 224, 224)
    items: int = 4096
    epochs: int = 4
    scenarios: tuple[str, ...] = SCENARIOS
    gpu_copy: bool = False
    start_method: str | None = None
    order: str = "back-to-back"


@dataclass
class Epoch:
    """One epoch of one loader."""

    scenario: str
    loader: str
    number: int
    setup_s: float
    first_batch_s: float
    samples_per_s: float
    faults_per_batch: float
    tree_cpu_s: float = 0.0
    slabs_made: int | None = None
    slabs_adopted: int | None = None  # buffers the first batches came in, kept as slabs
    slab_maps: int | None = None
    fresh_batches: int | None = None
    pinned: int | None = None
    batches: int = 0


class TrainingLoop:
    """What the loop does with each batch: reads one value per page, or copies it to the GPU."""

    def __init__(self, gpu_copy: bool) -> None:
        self.gpu_copy = gpu_copy
        self.pinned = 0
        self._last_copy: Any = None

    def __call__(self, batch: torch.Tensor) -> None:
        if not self.gpu_copy:
            step = max(1, PAGE_BYTES // batch.element_size())
            float(batch.reshape(-1)[::step].sum())
            return
        self.pinned += int(batch.is_pinned())
        batch.cuda(non_blocking=True)
        event = torch.cuda.Event()
        event.record()
        if self._last_copy is not None:
            self._last_copy.synchronize()  # one copy in flight, as a training step allows
        self._last_copy = event

    def finish(self) -> None:
        if self.gpu_copy:
            torch.cuda.synchronize()
        self._last_copy = None


def make_loader(name: str, options: Options, persistent: bool) -> Iterable[Any]:
    """A loader of the named kind; both kinds get identical arguments."""
    arguments: dict[str, Any] = {
        "batch_size": options.batch_size, "num_workers": options.num_workers,
        "persistent_workers": persistent and options.num_workers > 0, "pin_memory": options.gpu_copy,
    }
    if options.start_method is not None:
        arguments["multiprocessing_context"] = options.start_method
    dataset = FloatItems(options.items, options.item_shape)
    if name == "pipeload":
        return pipeload.DataLoader(dataset, **arguments)
    return torch.utils.data.DataLoader(dataset, **arguments)


def tree_cpu_s() -> float:
    """CPU seconds of this process, its children waited for (stopped workers) and its live
    children (persistent workers)."""
    times = os.times()
    total = times.user + times.system + times.children_user + times.children_system
    for child in psutil.Process().children():
        try:
            child_times = child.cpu_times()
        except psutil.Error:
            continue  # it ended meanwhile: counted with the children waited for, or not at all
        total += child_times.user + child_times.system
    return total


def _slab_counts(loader: Any) -> Any:
    keeper = getattr(loader, "_slab_keeper", None)  # pipeload's only
    return keeper.counts() if keeper is not None else None


def run_epoch(loader: Any, scenario: str, name: str, number: int, options: Options) -> Epoch:
    """Iterate ``loader`` once, timing it and counting faults and slabs."""
    loop = TrainingLoop(options.gpu_copy)
    counts_before = _slab_counts(loader)
    faults_before = resource.getrusage(resource.RUSAGE_THREAD).ru_minflt
    cpu_before = tree_cpu_s()
    started = time.perf_counter()
    iterator = iter(loader)
    set_up = time.perf_counter()
    first = None
    samples = batches = 0
    for batch in iterator:
        if first is None:
            first = time.perf_counter()
        loop(batch)
        samples += batch.shape[0]
        batches += 1
    del batch, iterator
    loop.finish()
    ended = time.perf_counter()
    faults = resource.getrusage(resource.RUSAGE_THREAD).ru_minflt - faults_before
    epoch = Epoch(scenario, name, number, set_up - started, (first or ended) - started,
                  samples / (ended - started), faults / max(1, batches),
                  tree_cpu_s() - cpu_before, batches=batches)
    counts = _slab_counts(loader)
    if counts is not None:
        epoch.slabs_made = counts.slabs_made - counts_before.slabs_made
        # (getattr: a tree from before stop 52, run with this script for an A/B, has no such count)
        epoch.slabs_adopted = getattr(counts, "slabs_adopted", 0) - getattr(counts_before, "slabs_adopted", 0)
        epoch.slab_maps = counts.slab_mappings - counts_before.slab_mappings
        epoch.fresh_batches = counts.batches_in_fresh_memory - counts_before.batches_in_fresh_memory
    if options.gpu_copy:
        epoch.pinned = loop.pinned
    return epoch


def run_all(options: Options) -> list[Epoch]:
    """Every scenario with both loaders, ``options.epochs`` epochs each, in ``options.order``."""
    runs = [(scenario, name) for scenario in options.scenarios for name in LOADERS]
    if options.order == "interleaved":  # epoch 1 of each, then epoch 2 of each, order turning
        steps = [(run, number) for number in range(1, options.epochs + 1)
                 for run in _turned(runs, number - 1)]
    else:  # each loader's epochs in a row; which loader goes first turns with each scenario
        steps = [((scenario, name), number)
                 for turn, scenario in enumerate(options.scenarios)
                 for name in _turned(list(LOADERS), turn)
                 for number in range(1, options.epochs + 1)]
    loaders: dict[tuple[str, str], Any] = {}
    epochs = []
    for (scenario, name), number in steps:
        if (scenario, name) not in loaders or scenario == "new-loader":
            loaders.pop((scenario, name), None)
            gc.collect()  # the loader before is gone, workers and all, before the next starts
            loaders[scenario, name] = make_loader(name, options, scenario == "persistent")
        epochs.append(run_epoch(loaders[scenario, name], scenario, name, number, options))
        _log(_describe(epochs[-1]))
        if number == options.epochs and options.order == "back-to-back":
            del loaders[scenario, name]  # its run is over: no idle workers beside the next
            gc.collect()
    loaders.clear()
    gc.collect()
    return sorted(epochs, key=lambda e: (options.scenarios.index(e.scenario), e.number))


def _turned(items: list[Any], by: int) -> list[Any]:
    shift = by % len(items)
    return items[shift:] + items[:shift]


HEADERS = ("scenario", "epoch", "loader", "set-up ms", "first batch ms", "samples/s",
           "tree CPU ms", "faults/batch", "slabs made", "slabs adopted", "slab maps", "fresh batches")


def table_rows(epochs: Sequence[Epoch]) -> list[tuple[str, ...]]:
    """Each epoch of each loader, then the pipeload/torch ratios of that epoch."""
    rows = []
    by_key = {(e.scenario, e.number, e.loader): e for e in epochs}
    for scenario, number in dict.fromkeys((e.scenario, e.number) for e in epochs):
        pair = [by_key.get((scenario, number, name)) for name in LOADERS]
        for epoch in pair:
            if epoch is not None:
                rows.append((scenario, str(number), epoch.loader, f"{epoch.setup_s * 1e3:.1f}",
                             f"{epoch.first_batch_s * 1e3:.1f}", f"{epoch.samples_per_s:,.0f}",
                             f"{epoch.tree_cpu_s * 1e3:,.0f}", f"{epoch.faults_per_batch:.0f}",
                             _maybe(epoch.slabs_made), _maybe(epoch.slabs_adopted), _maybe(epoch.slab_maps),
                             _maybe(epoch.fresh_batches)))
        ours, theirs = pair
        if ours is not None and theirs is not None:
            rows.append((scenario, str(number), "pipeload/torch",
                         _ratio(ours.setup_s, theirs.setup_s),
                         _ratio(ours.first_batch_s, theirs.first_batch_s),
                         _ratio(ours.samples_per_s, theirs.samples_per_s),
                         _ratio(ours.tree_cpu_s, theirs.tree_cpu_s),
                         _ratio(ours.faults_per_batch, theirs.faults_per_batch), "", "", "", ""))
    return rows


def summary_lines(epochs: Sequence[Epoch]) -> list[str]:
    """Medians over epochs 2 and later: each scenario against torch, and pipeload's scenarios
    against its own persistent loader; and each scenario over all its epochs, the first (where
    pipeload makes its slabs) included."""
    def median(scenario: str, loader: str, field: str = "samples_per_s") -> float | None:
        values = [getattr(e, field) for e in epochs
                  if e.scenario == scenario and e.loader == loader and e.number >= 2]
        return statistics.median(values) if values else None

    def overall(scenario: str, loader: str) -> float | None:
        # Every epoch, the first included, as a run adds them up: epochs of equal size, so the
        # harmonic mean of their rates.
        rates = [e.samples_per_s for e in epochs if e.scenario == scenario and e.loader == loader]
        return len(rates) / sum(1 / rate for rate in rates) if rates and min(rates) > 0 else None

    lines = []
    persistent = median("persistent", "pipeload")
    persistent_cpu = median("persistent", "pipeload", "tree_cpu_s")
    for scenario in dict.fromkeys(e.scenario for e in epochs):
        ours, theirs = median(scenario, "pipeload"), median(scenario, "torch")
        if ours is None or theirs is None:
            continue
        line = (f"{scenario}, epochs 2+: pipeload {ours:,.0f}/s, torch {theirs:,.0f}/s, "
                f"{ours / theirs:.2f}x torch")
        ours_all, theirs_all = overall(scenario, "pipeload"), overall(scenario, "torch")
        if ours_all and theirs_all:
            line += (f"; all epochs, the first included: pipeload {ours_all:,.0f}/s, "
                     f"{ours_all / theirs_all:.2f}x torch")
        cpu = median(scenario, "pipeload", "tree_cpu_s")
        if persistent and persistent_cpu and cpu and scenario != "persistent":
            line += (f", {ours / persistent:.2f}x pipeload persistent (tree CPU an epoch "
                     f"{cpu / persistent_cpu:.2f}x persistent's)")
        lines.append(line)
    return lines


def format_table(rows: Sequence[tuple[str, ...]], markdown: bool = False) -> str:
    widths = [max(len(str(cell)) for cell in column) for column in zip(HEADERS, *rows)]
    if markdown:
        lines = ["| " + " | ".join(HEADERS) + " |",
                 "|" + "|".join(["---"] * 3 + ["---:"] * (len(HEADERS) - 3)) + "|"]
        return "\n".join(lines + ["| " + " | ".join(row) + " |" for row in rows])

    def line(cells: Sequence[str]) -> str:
        left = [f"{c:<{w}}" for c, w in zip(cells[:3], widths[:3])]
        return "  ".join(left + [f"{c:>{w}}" for c, w in zip(cells[3:], widths[3:])])

    return "\n".join([line(HEADERS), *(line(row) for row in rows)])


def describe_machine(options: Options) -> str:
    load = os.getloadavg()[0] if hasattr(os, "getloadavg") else float("nan")
    loop = "pin + .cuda(non_blocking=True)" if options.gpu_copy else "reads one value per 4 KiB page"
    return (f"{os.cpu_count()} CPUs, load average {load:.1f}, torch {torch.__version__}; "
            f"num_workers={options.num_workers}, batch {options.batch_size} x "
            f"{'x'.join(map(str, options.item_shape))} float32, {options.items} items an epoch, "
            f"start method {options.start_method or torch.multiprocessing.get_start_method()}; "
            f"the loop {loop}; epochs {options.order}")


def main(argv: Sequence[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    options = Options(args.num_workers, args.batch_size, args.item_shape, args.items, args.epochs,
                      tuple(args.scenario or SCENARIOS), args.gpu_copy, args.start_method,
                      args.order)
    if options.gpu_copy and not torch.cuda.is_available():
        print("--gpu-copy needs CUDA, which is not available here: nothing was measured.")
        return 0
    print(describe_machine(options))
    epochs = run_all(options)
    print(format_table(table_rows(epochs), args.markdown))
    for line in summary_lines(epochs):
        print(line)
    if options.gpu_copy:
        unpinned = [e for e in epochs if e.pinned is not None and e.pinned < e.batches]
        for epoch in unpinned:
            print(f"NOT PINNED: {epoch.loader} {epoch.scenario} epoch {epoch.number}: "
                  f"{epoch.batches - epoch.pinned} of {epoch.batches} batches")
        print("every batch was pinned" if not unpinned else "some batches were not pinned")
    return 0


def _describe(epoch: Epoch) -> str:
    return (f"{epoch.scenario} epoch {epoch.number} {epoch.loader}: {epoch.samples_per_s:,.0f}/s, "
            f"first batch {epoch.first_batch_s * 1e3:.0f} ms")


def _maybe(value: int | None) -> str:
    return "" if value is None else str(value)


def _ratio(ours: float, theirs: float) -> str:
    return f"{ours / theirs:.2f}x" if theirs > 0 else "n/a"


def _shape(text: str) -> tuple[int, ...]:
    try:
        shape = tuple(int(part) for part in text.split(","))
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected sizes separated by commas, got {text!r}") from None
    if not shape or min(shape) < 1:
        raise argparse.ArgumentTypeError(f"expected positive sizes, got {text!r}")
    return shape


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="python -m bench.epoch_costs",
                                     description=__doc__.split("\n")[0])
    parser.add_argument("--num-workers", type=_positive_int, default=2, help="default: %(default)s")
    parser.add_argument("--batch-size", type=_positive_int, default=64, help="default: %(default)s")
    parser.add_argument("--item-shape", type=_shape, default=(3, 224, 224),
                        help="float32 item sizes, e.g. 3,224,224 (the default)")
    parser.add_argument("--items", type=_positive_int, default=4096,
                        help="items an epoch (default: %(default)s)")
    parser.add_argument("--epochs", type=_positive_int, default=4, help="default: %(default)s")
    parser.add_argument("--scenario", action="append", choices=SCENARIOS,
                        help="run only this scenario; repeat for several (default: all)")
    parser.add_argument("--gpu-copy", action="store_true",
                        help="pin_memory=True, each batch copied to CUDA with non_blocking=True")
    parser.add_argument("--start-method", choices=("fork", "spawn", "forkserver"), default=None,
                        help="multiprocessing context for both loaders (default: platform's)")
    parser.add_argument("--order", choices=ORDERS, default="back-to-back",
                        help="each loader's epochs in a row (the default), or epoch by epoch "
                             "across loaders (see the module's doc)")
    parser.add_argument("--markdown", action="store_true", help="print a Markdown table")
    return parser


def _log(message: str) -> None:
    print(message, file=sys.stderr, flush=True)


if __name__ == "__main__":
    sys.exit(main())
