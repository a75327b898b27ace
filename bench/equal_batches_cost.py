"""What ``equal_batches`` costs per batch on two gloo ranks of one machine: a map-style loader
whose sampler's length is exact (the ranks agree on the count once per epoch) against an
iterable one (they agree batch by batch, one ``all_reduce`` each), each against the same loader
without ``equal_batches`` and against torch.utils.data, all measured in the same run.

    PYTHONPATH=src python -m bench.equal_batches_cost
"""

from __future__ import annotations

import json
import multiprocessing
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import torch.distributed as dist
import torch.utils.data as tud

import pipeload

BATCHES = 20_000
ROUNDS = 3


class Stream(pipeload.IterableDataset):
    def __iter__(self) -> Any:
        return iter(range(BATCHES))


def _epoch_s(make: Any) -> float:
    best = float("inf")
    for _ in range(ROUNDS):
        loader = make()
        dist.barrier()  # the ranks start together, as training steps would
        started = time.perf_counter()
        for _ in loader:
            pass
        best = min(best, time.perf_counter() - started)
    return best


def _rank(rank: int, init: str, out: str) -> None:
    dist.init_process_group("gloo", init_method=f"file://{init}", rank=rank, world_size=2)
    data = list(range(2 * BATCHES))  # each rank's DistributedSampler takes half
    cases = {
        "torch map-style": lambda: tud.DataLoader(data, batch_size=1, sampler=tud.DistributedSampler(data)),
        "map-style": lambda: pipeload.DataLoader(data, batch_size=1, sampler=pipeload.DistributedSampler(data)),
        "map-style, pad (agreed once per epoch)": lambda: pipeload.DataLoader(
            data, batch_size=1, sampler=pipeload.DistributedSampler(data), equal_batches="pad"),
        "iterable": lambda: pipeload.DataLoader(Stream(), batch_size=1),
        "iterable, pad (agreed per batch)": lambda: pipeload.DataLoader(Stream(), batch_size=1, equal_batches="pad"),
    }
    found = {name: _epoch_s(make) for name, make in cases.items()}
    Path(out, f"{rank}.json").write_text(json.dumps(found))
    dist.destroy_process_group()


def main() -> None:
    with tempfile.TemporaryDirectory() as directory:
        context = multiprocessing.get_context("spawn")
        ranks = [context.Process(target=_rank, args=(r, f"{directory}/init", directory)) for r in range(2)]
        for process in ranks:
            process.start()
        for process in ranks:
            process.join()
        if any(process.exitcode for process in ranks):
            sys.exit("a rank failed")
        found = json.loads(Path(directory, "0.json").read_text())
    torch_s = found["torch map-style"]
    print(f"{BATCHES:,} batches of one int, 2 gloo ranks, num_workers=0, best of {ROUNDS} (rank 0):")
    for name, seconds in found.items():
        print(f"  {name:40s} {seconds * 1e6 / BATCHES:7.1f} us/batch   ratio to torch {seconds / torch_s:5.2f}")


if __name__ == "__main__":
    main()
