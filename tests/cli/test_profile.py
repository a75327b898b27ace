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


_STARTED: dict[str, str] = {}


def _note_the_start(worker_id: int) -> None:
    _STARTED["by"] = f"worker {worker_id}"


class NeedsItsWorkerInit(torch_data.Dataset):
    """Reads what the loader's worker_init_fn set up in each worker (as datasets that open a
    file or a connection per worker do)."""

    def __len__(self) -> int:
        return 8

    def __getitem__(self, index: int) -> torch.Tensor:
        return torch.tensor([index, len(_STARTED["by"])])


def test_torch_loader_is_rebuilt_with_every_setting_it_was_made_with() -> None:
    # Rebuilt without them, a loader that needs its worker_init_fn failed with a KeyError, and
    # one with persistent workers was told to try persistent_workers=True.
    generator = torch.Generator().manual_seed(3)
    theirs = torch_data.DataLoader(NeedsItsWorkerInit(), batch_size=2, shuffle=True, num_workers=2,
                                   worker_init_fn=_note_the_start, persistent_workers=True,
                                   prefetch_factor=3, timeout=30, generator=generator,
                                   multiprocessing_context="fork")
    rebuilt = as_loader(theirs, ProfileOptions(target="m:f"))
    for name in ("worker_init_fn", "persistent_workers", "prefetch_factor", "timeout", "generator"):
        assert getattr(rebuilt, name) == getattr(theirs, name), name
    assert rebuilt.multiprocessing_context.get_start_method() == "fork"
    assert sorted(torch.cat([batch[:, 0] for batch in rebuilt]).tolist()) == list(range(8))
    del rebuilt


def test_flags_for_a_dataset_given_for_a_dataloader_are_said_to_be_left_aside(capsys) -> None:
    loader = as_loader(torch_data.DataLoader(DATASET, batch_size=4),
                       ProfileOptions(target="m:f", num_workers=4, given=("num_workers",)))
    assert loader.num_workers == 0 and loader.batch_size == 4
    assert ("--num-workers set a dataset's loader; m:f returned a DataLoader, profiled with its own "
            "settings (num_workers=0)") in capsys.readouterr().err
    # torch's loader has no mode: it loads as classic mode does, which the setup line says too
    as_loader(torch_data.DataLoader(DATASET, batch_size=4),
              ProfileOptions(target="m:f", mode="economic", given=("mode",)))
    assert "profiled with its own settings (mode='classic')" in capsys.readouterr().err
