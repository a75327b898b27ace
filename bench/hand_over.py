"""When process workers pay off against ``num_workers=0``, by batch size and work a batch.

    python -m bench.hand_over [--seconds 2] [--workers 2] [--sides 16,32,64,128] [--work-us 0,10,30]

The advice (``stats/analysis.py``) keeps ``num_workers=0`` for batches that take less than
``WORKERS_PAY_OFF`` times what a worker adds to each batch it hands over, and that cost grows with
the batch (``hand_over_s``: ``WORKER_BATCH_COST_S`` and ``HAND_OVER_S_PER_MIB``). This measures
what those constants stand for: batches of 32 items of ``3 x side x side`` float32 (each item
busy for ``--work-us`` microseconds first), loaded for ``--seconds`` by ``num_workers=0`` and by
``--workers`` persistent process workers, with a loop that takes each batch and does nothing
else. It prints, per case, the batch's MiB, the main process's time to load one batch inline
(from the loader's stats), both loaders' batches/s, their ratio, and what the advice says at
``num_workers=0`` about those batches (the rule alone, whatever the evidence gathered so far).
"""

from __future__ import annotations

import argparse
import time
import warnings
from collections.abc import Sequence

import torch

import pipeload
from pipeload.stats import analysis

BATCH_SIZE = 32


class CheapItems(pipeload.Dataset):
    """Items of ``3 x side x side`` float32, each after ``work_s`` of a busy loop."""

    def __init__(self, side: int, work_s: float) -> None:
        self.side, self.work_s = side, work_s

    def __len__(self) -> int:
        return 4096

    def __getitem__(self, index: int) -> torch.Tensor:
        if self.work_s:
            until = time.perf_counter() + self.work_s
            while time.perf_counter() < until:
                pass
        return torch.full((3, self.side, self.side), float(index))


def batches_per_s(loader: pipeload.DataLoader, seconds: float) -> float:
    """Batches the loop took in about ``seconds``, per second (epochs restart as needed)."""
    taken, started = 0, time.perf_counter()
    while time.perf_counter() - started < seconds:
        for _ in loader:
            taken += 1
            if time.perf_counter() - started >= seconds:
                break
    return taken / (time.perf_counter() - started)


def inline_rule(stats: pipeload.LoaderStats) -> str:
    """What the num_workers=0 rule says of these batches: keep 0, or try workers."""
    batches, _ = analysis.steady(stats)
    per_batch = stats.wait_s / batches if batches else 0.0
    hand_over = analysis.hand_over_s(stats)
    if per_batch < analysis.WORKERS_PAY_OFF * hand_over:
        return f"keep 0 (hand-over ~{hand_over * 1e6:,.0f} us)"
    return f"try workers (hand-over ~{hand_over * 1e6:,.0f} us)"


def run(sides: Sequence[int], works_us: Sequence[float], workers: int, seconds: float) -> None:
    print(f"batches of {BATCH_SIZE} items; {workers} persistent process workers against "
          f"num_workers=0, {seconds:.0f} s each")
    print(f"{'MiB':>6} {'work/item':>9} {'inline us/batch':>15} {'inline b/s':>10} "
          f"{'workers b/s':>11} {'ratio':>6}  advice at num_workers=0")
    for side in sides:
        for work_us in works_us:
            dataset = CheapItems(side, work_us * 1e-6)
            inline = pipeload.DataLoader(dataset, batch_size=BATCH_SIZE)
            inline_rate = batches_per_s(inline, seconds)
            stats = inline.stats()
            steady, _ = analysis.steady(stats)
            per_batch_us = stats.wait_s / steady * 1e6 if steady else 0.0
            pooled = pipeload.DataLoader(dataset, batch_size=BATCH_SIZE, num_workers=workers,
                                         persistent_workers=True)
            pooled_rate = batches_per_s(pooled, seconds)
            del pooled
            mib = BATCH_SIZE * 3 * side * side * 4 / (1 << 20)
            print(f"{mib:6.2f} {work_us:7.0f}us {per_batch_us:15,.0f} {inline_rate:10,.0f} "
                  f"{pooled_rate:11,.0f} {pooled_rate / inline_rate:5.2f}x  {inline_rule(stats)}",
                  flush=True)


def _numbers(text: str) -> list[float]:
    return [float(part) for part in text.split(",") if part]


def main(argv: Sequence[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seconds", type=float, default=2.0)
    parser.add_argument("--workers", type=int, default=2)
    parser.add_argument("--sides", default="16,32,64,128", help="item sides, comma-separated")
    parser.add_argument("--work-us", default="0,10,30", help="busy microseconds an item, comma-separated")
    options = parser.parse_args(argv)
    warnings.simplefilter("ignore")  # worker counts above the CPUs are what is measured
    run([int(side) for side in _numbers(options.sides)], _numbers(options.work_us), options.workers,
        options.seconds)


if __name__ == "__main__":
    main()
