"""How soon a batch's failing item is raised, and when the next batch comes: torch.utils.data
beside pipeload's classic and economic modes.

    PYTHONPATH=src:. python -m bench.error_latency [--item-s 0.5] [--workers 1,2]

Item 0 raises at once; every other item takes ``--item-s`` seconds (a slow decode). Batches of 8,
16 items. torch's worker raises at the first failing item; a loader that waited for the rest of
the batch first would say so here, seconds late.
"""

from __future__ import annotations

import argparse
import time

import torch
import torch.utils.data

import pipeload


class FirstItemFails(torch.utils.data.Dataset):
    def __init__(self, item_s: float) -> None:
        self.item_s = item_s

    def __len__(self) -> int:
        return 16

    def __getitem__(self, index: int) -> torch.Tensor:
        if index == 0:
            raise ValueError("item 0 is damaged")
        time.sleep(self.item_s)  # the workload: a slow item, not a wait for something
        return torch.tensor(index)


def events(loader: object) -> list[str]:
    """What the loop sees, with the seconds since ``iter()``."""
    started = time.monotonic()
    iterator, seen = iter(loader), []
    while True:
        try:
            batch = next(iterator)
            seen.append(f"batch {int(batch[0])} at {time.monotonic() - started:.1f} s")
        except StopIteration:
            return seen
        except ValueError:
            seen.append(f"ValueError at {time.monotonic() - started:.1f} s")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--item-s", type=float, default=0.5)
    parser.add_argument("--workers", default="1,2", help="comma-separated worker counts")
    args = parser.parse_args()
    dataset = FirstItemFails(args.item_s)
    loaders = {
        "torch": lambda n: torch.utils.data.DataLoader(dataset, batch_size=8, num_workers=n),
        "classic": lambda n: pipeload.DataLoader(dataset, batch_size=8, num_workers=n),
        "economic": lambda n: pipeload.DataLoader(dataset, batch_size=8, num_workers=n, mode="economic"),
    }
    for workers in (int(part) for part in args.workers.split(",")):
        for name, make in loaders.items():
            print(f"{name:<9} num_workers={workers}: {'; '.join(events(make(workers)))}", flush=True)


if __name__ == "__main__":
    main()
