"""What checkpoint support costs: samplers (counting what they hand out) and pipes (each
replica's state travels with every batch). Prints ours against torch.utils.data where torch has
the same thing, and the pipe figures for two shuffle buffer sizes.

    PYTHONPATH=src python -m bench.resume_costs
    PYTHONPATH=src python -m bench.resume_costs --checkpoints   # state_dict()/load_state_dict() alone

``--checkpoints`` times taking and loading one checkpoint (its checks and digest included), for
a shuffled map-style loader and for pipes with shuffle buffers of 100 and 10,000 items; run it
with another tree's ``src`` on PYTHONPATH to compare two versions.
"""

from __future__ import annotations

import sys
import time
from collections.abc import Callable

import torch
import torch.utils.data as tud

import pipeload
from pipeload.datapipes.iter import IterableWrapper

KEYS = 1_000_000
ITEMS = 200_000


def best_of(run: Callable[[], object], repeats: int = 3) -> float:
    best = float("inf")
    for _ in range(repeats):
        start = time.perf_counter()
        run()
        best = min(best, time.perf_counter() - start)
    return best


def samplers() -> None:
    generator = torch.Generator().manual_seed(0)
    cases = {
        "RandomSampler": (lambda m: m.RandomSampler(range(KEYS), generator=generator)),
        "BatchSampler(SequentialSampler, 64)": (lambda m: m.BatchSampler(m.SequentialSampler(range(KEYS)), 64, False)),
    }
    for name, make in cases.items():
        ours = best_of(lambda: sum(1 for _ in make(pipeload)))
        theirs = best_of(lambda: sum(1 for _ in make(tud)))
        print(f"{name} over {KEYS:,} keys: pipeload {ours * 1e3:.0f} ms, torch {theirs * 1e3:.0f} ms, "
              f"ratio {ours / theirs:.2f}")


def pipes() -> None:
    for buffer in (100, 10_000):
        def epoch() -> None:
            pipe = IterableWrapper(range(ITEMS)).shuffle(buffer_size=buffer).sharding_filter()
            loader = pipeload.DataLoader(pipe, batch_size=64, num_workers=2, worker_type="thread")
            sum(1 for _ in loader)
        print(f"shuffle(buffer_size={buffer}) over {ITEMS:,} items, batch 64, 2 thread workers: "
              f"{best_of(epoch) * 1e3:.0f} ms per epoch")


def checkpoints() -> None:
    def map_loader() -> pipeload.DataLoader:
        return pipeload.DataLoader(list(range(KEYS)), batch_size=64, shuffle=True,
                                   generator=torch.Generator().manual_seed(0))

    def pipe_loader(buffer: int) -> Callable[[], pipeload.DataLoader]:
        return lambda: pipeload.DataLoader(IterableWrapper(range(ITEMS)).shuffle(buffer_size=buffer), batch_size=64)

    cases = {"map-style, shuffled, 1M keys": map_loader, "pipe shuffle(buffer_size=100)": pipe_loader(100),
             "pipe shuffle(buffer_size=10000)": pipe_loader(10_000)}
    for name, make in cases.items():
        loader = make()
        iterator = iter(loader)
        for _ in range(20):
            next(iterator)
        taken = best_of(loader.state_dict, repeats=20)
        state = loader.state_dict()
        fresh = make()
        loaded = best_of(lambda: fresh.load_state_dict(state), repeats=20)
        print(f"{name}: state_dict() {taken * 1e3:.2f} ms, load_state_dict() {loaded * 1e3:.2f} ms")


if __name__ == "__main__":
    if "--checkpoints" in sys.argv[1:]:
        checkpoints()
    else:
        samplers()
        pipes()
