"""A DataLoader copies and pickles as torch's does: ``copy.deepcopy`` and ``pickle`` of a loader
between epochs work in torch (frameworks deep-copy loaders; spawn-based launchers pickle them),
and the copy yields what the original would have.

The copy is a new loader with the same configuration: what runs (persistent workers, the stats
counted so far, the tuner) stays with the original.
"""

from __future__ import annotations

import copy
import pickle
from collections.abc import Callable
from types import ModuleType
from typing import Any

import pytest
import torch
import torch.utils.data as tud

import pipeload

pytestmark = [pytest.mark.usefixtures("leak_guard"), pytest.mark.timeout(60)]

FORK = {"multiprocessing_context": "fork"}


def seeded(seed: int) -> torch.Generator:
    generator = torch.Generator()
    generator.manual_seed(seed)
    return generator


def batches(loader: Any) -> list[list[int]]:
    return [batch.tolist() for batch in loader]


LOADERS: dict[str, Callable[[ModuleType], Any]] = {
    "sequential": lambda m: m.DataLoader(list(range(7)), batch_size=2),
    "shuffled-with-a-generator": lambda m: m.DataLoader(list(range(7)), batch_size=3, shuffle=True,
                                                        generator=seeded(4)),
    "tensor-dataset-drop-last": lambda m: m.DataLoader(m.TensorDataset(torch.arange(9)), batch_size=4,
                                                       drop_last=True, collate_fn=lambda b: torch.stack([x for (x,) in b])),
    "workers": lambda m: m.DataLoader(list(range(7)), batch_size=2, num_workers=2, **FORK),
    "persistent-workers-not-started": lambda m: m.DataLoader(list(range(7)), batch_size=2, num_workers=1,
                                                             persistent_workers=True, **FORK),
    "stats-off": lambda m: m.DataLoader(list(range(5)), batch_size=2, **({"stats": False} if m is pipeload else {})),
}
PICKLABLE = [name for name in LOADERS if name != "tensor-dataset-drop-last"]  # a lambda collate_fn


def used(make: Callable[[ModuleType], Any], module: ModuleType, epochs: int) -> Any:
    loader = make(module)
    for _ in range(epochs):
        batches(loader)
    return loader


def cases(names: list[str]) -> list[Any]:
    # torch cannot copy a loader whose persistent workers run (after an epoch): see the last test.
    return [pytest.param(name, epochs, id=f"{name}-after-{epochs}")
            for name in names for epochs in (0, 1) if not (epochs and name.startswith("persistent"))]


@pytest.mark.parametrize(("name", "epochs"), cases(list(LOADERS)))
def test_a_deep_copy_yields_what_torchs_copy_yields(name: str, epochs: int) -> None:
    theirs = copy.deepcopy(used(LOADERS[name], tud, epochs))
    mine = copy.deepcopy(used(LOADERS[name], pipeload, epochs))
    assert isinstance(mine, pipeload.DataLoader)
    assert batches(mine) == batches(theirs)
    assert len(mine) == len(theirs)


@pytest.mark.parametrize(("name", "epochs"), cases(PICKLABLE))
def test_a_pickled_loader_yields_what_torchs_yields(name: str, epochs: int) -> None:
    theirs = pickle.loads(pickle.dumps(used(LOADERS[name], tud, epochs)))
    mine = pickle.loads(pickle.dumps(used(LOADERS[name], pipeload, epochs)))
    assert batches(mine) == batches(theirs)


def test_a_copy_keeps_the_settings_and_refuses_frozen_attributes() -> None:
    mine = copy.deepcopy(pipeload.DataLoader(list(range(5)), batch_size=2, num_workers=1, prefetch_factor=3,
                                             timeout=7, mode="economic", **FORK))
    assert (mine.batch_size, mine.num_workers, mine.prefetch_factor, mine.timeout, mine.mode) == (2, 1, 3, 7, "economic")
    assert mine.multiprocessing_context.get_start_method() == "fork"
    with pytest.raises(ValueError, match="batch_size attribute should not be set"):
        mine.batch_size = 3


def test_the_copy_counts_its_own_stats() -> None:
    original = used(LOADERS["sequential"], pipeload, 1)
    duplicate = copy.deepcopy(original)
    assert (original.stats().epochs, duplicate.stats().epochs) == (1, 0)
    batches(duplicate)
    assert (original.stats().batches, duplicate.stats().batches) == (4, 4)


def test_a_loader_with_running_persistent_workers_copies_without_them() -> None:
    # torch refuses here (its live iterator cannot be pickled); the copy starts its own workers.
    original = pipeload.DataLoader(list(range(5)), batch_size=2, num_workers=1, persistent_workers=True, **FORK)
    duplicate = None
    try:
        first = batches(original)
        running = iter(original)  # the second epoch, on the same workers
        assert next(running).tolist() == first[0]
        duplicate = copy.deepcopy(original)
        assert duplicate._iterator is None and original._iterator is running
        assert batches(duplicate) == first
        assert [batch.tolist() for batch in running] == first[1:]
    finally:
        original._iterator = None  # stops the workers
        if duplicate is not None:
            duplicate._iterator = None
