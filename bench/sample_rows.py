"""What writing each sample into its rows as it is fetched saves, by sample size.

    PYTHONPATH=src:. python -m bench.sample_rows [--sizes-kib 16,64,256,600] [--epochs 5]
                                                 [--num-workers 2] [--persistent]

Two pipeload loaders over the same float32 samples, batch 64, ``--epochs`` epochs each, epoch by
epoch and turn by turn: one as shipped (a classic worker writes each sample of 256 KiB or more
into its rows of the batch's slab as it fetches it: transport/sample_rows.py), one whose workers
hold every sample of a batch and stack them at the end (``rows_for`` turned off for it alone).
The loop reads one value per 4 KiB page of every batch. Printed per size: the median samples/s
of epochs 2+ for each, their ratio, and the first batch's time (a worker set's first batch pays
for its heap; without ``--persistent`` every epoch has a new set). Below 256 KiB both loaders
run the same code (the placing stops at the first sample): their ratio is the noise.
"""

from __future__ import annotations

import argparse
import contextlib
import statistics
import time
from collections.abc import Iterator

import pipeload
from bench.epoch_costs import FloatItems
from pipeload.engine import fetch

BATCH = 64
PAGE_FLOATS = 1024


@contextlib.contextmanager
def samples_stacked_at_the_end() -> Iterator[None]:
    """Workers forked meanwhile hold a batch's samples and stack them at the end."""
    usual = fetch.rows_for
    fetch.rows_for = lambda count: None
    try:
        yield
    finally:
        fetch.rows_for = usual


def one_epoch(loader: pipeload.DataLoader, stacked: bool) -> tuple[float, float]:
    """(samples/s, ms to the first batch) of one pass over ``loader``."""
    with samples_stacked_at_the_end() if stacked else contextlib.nullcontext():
        started = time.perf_counter()
        first = None
        samples = 0
        for batch in loader:
            if first is None:
                first = time.perf_counter()
            float(batch.reshape(-1)[::PAGE_FLOATS].sum())
            samples += batch.shape[0]
        ended = time.perf_counter()
    return samples / (ended - started), ((first or ended) - started) * 1e3


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--sizes-kib", default="16,64,256,600",
                        help="sample sizes in KiB, comma-separated")
    parser.add_argument("--epochs", type=int, default=5)
    parser.add_argument("--num-workers", type=int, default=2)
    parser.add_argument("--items", type=int, default=2048, help="samples an epoch")
    parser.add_argument("--persistent", action="store_true", help="persistent_workers=True")
    args = parser.parse_args()
    if args.epochs < 2:
        parser.error("--epochs must be at least 2: epoch 1 makes the slabs")
    sizes = [int(part) for part in args.sizes_kib.split(",") if part]
    print(f"batch {BATCH}, {args.items} samples an epoch, {args.num_workers} workers, "
          f"persistent_workers={args.persistent}; medians of epochs 2-{args.epochs}")
    print(f"{'sample':>8} {'rows/s':>10} {'stacked/s':>10} {'ratio':>7} "
          f"{'first batch ms (rows / stacked)':>32}")
    for kib in sizes:
        dataset = FloatItems(args.items, (kib * 256,))
        loaders = {variant: pipeload.DataLoader(dataset, batch_size=BATCH,
                                                num_workers=args.num_workers,
                                                persistent_workers=args.persistent)
                   for variant in ("rows", "stacked")}
        runs: dict[str, list[tuple[float, float]]] = {variant: [] for variant in loaders}
        for number in range(args.epochs):
            order = list(loaders) if number % 2 else list(reversed(loaders))
            for variant in order:
                runs[variant].append(one_epoch(loaders[variant], variant == "stacked"))
        rate = {v: statistics.median(r for r, _ in runs[v][1:]) for v in runs}
        first = {v: statistics.median(f for _, f in runs[v][1:]) for v in runs}
        print(f"{kib:>5}KiB {rate['rows']:>10,.0f} {rate['stacked']:>10,.0f} "
              f"{rate['rows'] / rate['stacked']:>6.2f}x {first['rows']:>15.1f} / {first['stacked']:.1f}")
        del loaders


if __name__ == "__main__":
    main()
