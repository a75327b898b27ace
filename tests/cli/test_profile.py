"""``pipeload profile``'s rebuild of torch's DataLoader (``pipeload.cli.profile.as_loader``): the
profiled loader must batch and order the samples as the user's loader does, or the figures are
about other batches than theirs."""

from __future__ import annotations

from collections.abc import Callable

import pytest
import torch
import torch.utils.data as torch_data

import pipeload
from pipeload.cli.profile import ProfileOptions, as_loader

DATASET = torch_data.TensorDataset(torch.arange(22))


class Counting(torch_data.IterableDataset):
    def __iter__(self):  # noqa: ANN204
        return iter(range(22))


TORCH_LOADERS: dict[str, Callable[[], torch_data.DataLoader]] = {
    "batch_sampler": lambda: torch_data.DataLoader(DATASET, batch_sampler=torch_data.BatchSampler(
        torch_data.SequentialSampler(DATASET), batch_size=5, drop_last=False)),
    "shuffle_drop_last": lambda: torch_data.DataLoader(DATASET, batch_size=4, shuffle=True, drop_last=True),
    "sampler": lambda: torch_data.DataLoader(DATASET, batch_size=3, sampler=range(21, -1, -2)),
    "unbatched": lambda: torch_data.DataLoader(DATASET, batch_size=None),
    "iterable_drop_last": lambda: torch_data.DataLoader(Counting(), batch_size=4, drop_last=True),
}


@pytest.mark.parametrize("name", list(TORCH_LOADERS))
def test_torch_loader_is_rebuilt_with_the_same_batches(name: str) -> None:
    torch.manual_seed(7)
    theirs = [_flat(batch) for batch in TORCH_LOADERS[name]()]
    torch.manual_seed(7)
    rebuilt = as_loader(TORCH_LOADERS[name](), ProfileOptions(target="m:f"))
    assert isinstance(rebuilt, pipeload.DataLoader)
    assert [_flat(batch) for batch in rebuilt] == theirs


def _flat(batch: object) -> list[int]:
    tensor = batch[0] if isinstance(batch, (list, tuple)) else batch
    return torch.as_tensor(tensor).reshape(-1).tolist()
