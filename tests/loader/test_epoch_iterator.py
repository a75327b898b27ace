"""The epoch iterator keeps the private counts code written for torch's iterator reads.

``_num_yielded`` (batches handed out this epoch) is read by checkpointing helpers built on torch's
DataLoader to compute how far an epoch went; it counts as torch's does: a batch that raised is
not counted, nor is the end of the epoch.
"""

from __future__ import annotations

import gc
from types import ModuleType
from typing import Any

import pytest
import torch.utils.data as tud

import pipeload

pytestmark = [pytest.mark.usefixtures("leak_guard"), pytest.mark.timeout(60)]


class FailsAtTwo:
    def __len__(self) -> int:
        return 5

    def __getitem__(self, index: int) -> int:
        if index == 2:
            raise KeyError(index)
        return index


def counts_along_an_epoch(module: ModuleType, **options: Any) -> list[Any]:
    """``_num_yielded`` after each step, each step's outcome noted ("batch", an error's type, or
    "end"), two steps past the end."""
    loader = module.DataLoader(FailsAtTwo(), **options)
    iterator = iter(loader)
    try:
        seen: list[Any] = [iterator._num_yielded]
        for _ in range(7):
            try:
                next(iterator)
                outcome = "batch"
            except StopIteration:
                outcome = "end"
            except KeyError:
                outcome = "KeyError"
            seen.append((outcome, iterator._num_yielded))
        return seen
    finally:
        del iterator
        loader._iterator = None  # persistent workers stop, in either library
        gc.collect()  # torch's iterators sit in reference cycles after a worker's error


@pytest.mark.parametrize(
    "options",
    [{}, {"batch_size": 2}, {"batch_size": None},
     {"num_workers": 2, "multiprocessing_context": "fork"},
     # ~5 s, torch's side: its persistent workers take their time to stop
     pytest.param({"num_workers": 1, "persistent_workers": True, "multiprocessing_context": "fork"},
                  marks=pytest.mark.slow)],
    ids=["inline", "batches-of-2", "unbatched", "workers", "persistent-workers"],
)
def test_num_yielded_counts_as_torchs(options: dict[str, Any]) -> None:
    assert counts_along_an_epoch(pipeload, **options) == counts_along_an_epoch(tud, **options)
