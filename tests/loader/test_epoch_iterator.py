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


class InterruptsOnce:
    """Item 5, the first time only, sends Ctrl-C to the training process (a worker's parent)."""

    def __init__(self) -> None:
        import multiprocessing

        self.sent = multiprocessing.get_context("fork").Value("b", 0)

    def __len__(self) -> int:
        return 24

    def __getitem__(self, index: int) -> int:
        import os
        import signal

        if index == 5:
            with self.sent.get_lock():
                if not self.sent.value:
                    self.sent.value = 1
                    os.kill(os.getppid(), signal.SIGINT)
        return index


def _epochs_after_a_caught_ctrl_c(module: ModuleType, **options: Any) -> tuple[list[int], float]:
    """Seeded: one epoch cut by a Ctrl-C that the caller catches, then the next epoch's order
    and the loop's next draw from torch's generator."""
    import torch

    torch.manual_seed(0)
    loader = module.DataLoader(InterruptsOnce(), batch_size=None, shuffle=True, num_workers=1,
                               persistent_workers=True, multiprocessing_context="fork", **options)
    with pytest.raises(KeyboardInterrupt):
        for _ in loader:
            pass
    order = list(loader)
    return order, float(torch.rand(()))


@pytest.mark.timeout(60)
@pytest.mark.parametrize("mode", ["classic", "economic"])
def test_a_caught_ctrl_c_leaves_the_persistent_sessions_random_stream_as_torchs(mode: str, ctrl_c_raises: None) -> None:
    # The workers stopped at the Ctrl-C (none is left half alive) were started again with a
    # new base seed drawn from torch's generator: one draw torch never makes, and every later
    # epoch's order, and the loop's own draws, differed from torch's.
    ours = _epochs_after_a_caught_ctrl_c(pipeload, mode=mode)
    theirs = _epochs_after_a_caught_ctrl_c(tud)
    assert ours == theirs


def epochs_through_one_kept_iterator(module: ModuleType, persistent: bool) -> tuple[bool, list[list[int]]]:
    """Whether each ``iter(loader)`` returned the first epoch's iterator, and the batches read
    through that first iterator in each of three epochs (the first abandoned after one batch)."""
    loader = module.DataLoader(list(range(6)), batch_size=2, num_workers=1,
                               persistent_workers=persistent, multiprocessing_context="fork")
    kept = iter(loader)
    try:
        read = [[next(kept).tolist()]]
        same = True
        for _ in range(2):
            same = same and iter(loader) is kept
            read.append([batch.tolist() for batch in kept])
        return same, read
    finally:
        del kept
        loader._iterator = None
        gc.collect()


def test_a_persistent_loader_hands_out_its_one_iterator_each_epoch_as_torchs() -> None:
    # torch resets its persistent iterator at each iter(): the same object reads the new epoch.
    ours = epochs_through_one_kept_iterator(pipeload, persistent=True)
    assert ours == epochs_through_one_kept_iterator(tud, persistent=True)
    assert ours == (True, [[[0, 1]], [[0, 1], [2, 3], [4, 5]], [[0, 1], [2, 3], [4, 5]]])


def test_a_loader_without_persistent_workers_hands_out_a_new_iterator_each_epoch() -> None:
    same, read = epochs_through_one_kept_iterator(pipeload, persistent=False)
    assert (same, read) == epochs_through_one_kept_iterator(tud, persistent=False)
    assert not same
    assert read == [[[0, 1]], [[2, 3], [4, 5]], []]  # the kept one goes on with its own epoch
