"""Economic mode's pieces: finely cut against the rule that cuts cheap items coarser.

    PYTHONPATH=src:. python -m bench.piece_sizes [--rounds 2] [--workers 2,8,14] [--epochs 3]

A batch is cut into about two pieces per item worker; where the main process measures items so
cheap that those pieces' messages would keep it busy, later batches go in pieces of 8 items or
more (``engine/item_scheduler.py``). Two workloads, each run with the rule and with fine pieces
forced (``MESSAGES_SHARE`` raised out of reach), in turns, the order swapped every round, on a
persistent loader after a first epoch:

  * ``cheap``: 3x32x32 float32 items made at once (a few microseconds each), batch 64, at each
    ``--workers``: the main process's CPU a sample and the samples a second;
  * ``slow``: items that wait 10 ms (storage far away), batch 16, 8 item workers: the rule
    must leave them finely cut (pieces of 8 kept half of the workers idle there).

The loop reads one value of each batch. Ratios are "rule / fine" of the medians.
"""

from __future__ import annotations

import argparse
import statistics
import time
import warnings
from collections.abc import Callable
from typing import Any

import torch

import pipeload
from pipeload.engine import item_scheduler

SLOW_ITEM_S = 0.010


class CheapItems(torch.utils.data.Dataset):
    def __len__(self) -> int:
        return 4096

    def __getitem__(self, index: int) -> torch.Tensor:
        return torch.full((3, 32, 32), float(index))


class SlowItems(torch.utils.data.Dataset):
    def __len__(self) -> int:
        return 480

    def __getitem__(self, index: int) -> torch.Tensor:
        time.sleep(SLOW_ITEM_S)  # the item's own cost: a wait on storage
        return torch.full((256,), float(index))


def measure(make: Callable[[], Any], epochs: int, rule: bool) -> tuple[float, float]:
    """(main process's CPU in us a sample, samples a second) over ``epochs`` after a first."""
    share = item_scheduler.MESSAGES_SHARE
    item_scheduler.MESSAGES_SHARE = share if rule else float("inf")
    try:
        with warnings.catch_warnings():  # more workers than CPUs: known
            warnings.simplefilter("ignore")
            loader = make()
        for _ in loader:
            pass
        samples, cpu, wall = 0, time.process_time(), time.perf_counter()
        for _ in range(epochs):
            for batch in loader:
                samples += len(batch)
                float(batch[-1].flatten()[0])
        result = ((time.process_time() - cpu) / samples * 1e6, samples / (time.perf_counter() - wall))
        del loader
        return result
    finally:
        item_scheduler.MESSAGES_SHARE = share


def compare(label: str, make: Callable[[], Any], rounds: int, epochs: int) -> str:
    found: dict[bool, list[tuple[float, float]]] = {True: [], False: []}
    for round_number in range(rounds):
        for rule in ((True, False) if round_number % 2 == 0 else (False, True)):
            found[rule].append(measure(make, epochs, rule))
    main = {rule: statistics.median(us for us, _ in runs) for rule, runs in found.items()}
    rate = {rule: statistics.median(per_s for _, per_s in runs) for rule, runs in found.items()}
    return (f"{label:<28} main us/sample: rule {main[True]:5.1f}, fine {main[False]:5.1f} "
            f"({main[True] / main[False]:.2f}x); samples/s: rule {rate[True]:8,.0f}, fine "
            f"{rate[False]:8,.0f} ({rate[True] / rate[False]:.2f}x)")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--epochs", type=int, default=3, help="measured epochs a loader, after its first")
    parser.add_argument("--workers", default="2,8,14", help="item worker counts for the cheap items")
    args = parser.parse_args(argv)
    if args.rounds < 1 or args.epochs < 1:
        parser.error("--rounds and --epochs must be 1 or more")
    print(f"economic mode, persistent loaders; rule against fine pieces, {args.rounds} rounds in turns")
    for workers in (int(count) for count in args.workers.split(",")):
        make = (lambda workers=workers: pipeload.DataLoader(
            CheapItems(), batch_size=64, num_workers=workers, mode="economic", persistent_workers=True))
        print(compare(f"cheap, {workers} item workers", make, args.rounds, args.epochs), flush=True)
    make = (lambda: pipeload.DataLoader(SlowItems(), batch_size=16, num_workers=8, mode="economic",
                                        persistent_workers=True))
    print(compare("slow (10 ms), 8 item workers", make, args.rounds, 1), flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
