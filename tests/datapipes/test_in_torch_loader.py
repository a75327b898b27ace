"""pipeload's pipes run by torch's own DataLoader (as accelerate's ``prepare`` rebuilds loaders):
split across its workers and shuffled alike in each, as torch's loader does for its own pipes."""

from __future__ import annotations

import pytest
import torch
import torch.utils.data

from pipeload.datapipes.iter import IterableWrapper

pytestmark = [pytest.mark.usefixtures("leak_guard"), pytest.mark.timeout(120)]


def epochs_of(loader: torch.utils.data.DataLoader, count: int) -> list[list[int]]:
    return [[int(item) for item in loader] for _ in range(count)]


@pytest.mark.parametrize("persistent", [False, True])
def test_each_item_comes_once_an_epoch_in_a_new_order_each_epoch(persistent: bool) -> None:
    torch.manual_seed(5)
    pipe = IterableWrapper(range(40)).shuffle().sharding_filter()
    loader = torch.utils.data.DataLoader(pipe, batch_size=None, num_workers=2, persistent_workers=persistent)
    first, second = epochs_of(loader, 2)
    assert sorted(first) == sorted(second) == list(range(40))
    assert first != second and first != list(range(40))


def test_a_pipe_nobody_shards_outside_a_loader_passes_everything() -> None:
    pipe = IterableWrapper(range(10)).sharding_filter()
    assert list(pipe) == list(range(10))
    loader = torch.utils.data.DataLoader(pipe, batch_size=None, num_workers=0)
    assert [int(x) for x in loader] == list(range(10))
