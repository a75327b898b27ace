"""Run by tests/frameworks/test_accelerate.py under ``torchrun --nproc_per_node=2`` (CPU, gloo).

Three ways a user meets accelerate, each over two epochs; every rank writes what it saw to
``<out>/rank<r>.json``:

- ``prepared``: ``accelerator.prepare(loader)`` on our loader. accelerate rebuilds loaders on
  torch's own DataLoader class, so torch's engine loads (our dataset, sampler and collate inside).
- ``recipe``: the recipe that keeps our engine: our loader with our DistributedSampler, and
  ``prepare`` for the model and optimizer only.
- ``forgotten``: our loader with neither: pipeload warns that every rank loads everything.
"""

from __future__ import annotations

import json
import sys
import warnings
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))

import torch  # noqa: E402
from accelerate import Accelerator  # noqa: E402

import pipeload  # noqa: E402
from workload import Witness, describe  # noqa: E402

SEED = 11
EPOCHS = 2


def run_prepared(accelerator: Accelerator) -> dict:
    loader = pipeload.DataLoader(Witness(), batch_size=4, shuffle=True, num_workers=1)
    prepared = accelerator.prepare(loader)
    seen = {}
    for epoch in range(EPOCHS):
        prepared.set_epoch(epoch)
        seen[str(epoch)] = [describe(batch) for batch in prepared]
    return {"loader_class": type(prepared.base_dataloader).__module__, "seen": seen}


def run_recipe(accelerator: Accelerator) -> dict:
    sampler = pipeload.DistributedSampler(Witness(), shuffle=True, seed=SEED)
    loader = pipeload.DataLoader(Witness(), batch_size=4, sampler=sampler, num_workers=1)
    model = torch.nn.Linear(1, 1)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.01)
    model, optimizer = accelerator.prepare(model, optimizer)
    seen = {}
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        for epoch in range(EPOCHS):
            sampler.set_epoch(epoch)
            seen[str(epoch)] = []
            for batch in loader:
                seen[str(epoch)].append(describe(batch))
                loss = model(batch["index"].float().unsqueeze(1)).sum()
                accelerator.backward(loss)
                optimizer.step()
                optimizer.zero_grad()
    return {"loader_class": type(loader).__module__, "seen": seen, "warnings": _ours(caught)}


def run_forgotten() -> dict:
    loader = pipeload.DataLoader(Witness(), batch_size=4, shuffle=True)
    seen = {}
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        for epoch in range(EPOCHS):
            seen[str(epoch)] = [describe(batch) for batch in loader]
    return {"seen": seen, "warnings": _ours(caught)}


def _ours(caught: list) -> list[str]:
    return [str(w.message) for w in caught if "is not split by rank" in str(w.message)]


def main(out_dir: str) -> None:
    accelerator = Accelerator(cpu=True)
    torch.manual_seed(SEED)
    record = {
        "rank": accelerator.process_index,
        "world_size": accelerator.num_processes,
        "backend": str(torch.distributed.get_backend()),
        "seed": SEED,
        "prepared": run_prepared(accelerator),
        "recipe": run_recipe(accelerator),
        "forgotten": run_forgotten(),
    }
    Path(out_dir, f"rank{accelerator.process_index}.json").write_text(json.dumps(record))
    accelerator.end_training()


if __name__ == "__main__":
    main(sys.argv[1])
