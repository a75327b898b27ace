"""How a pool of process workers starts: the first worker builds its first batch while the main
process forks the next (each fork copies the main process's page tables, serially: with many
workers and a large main process, the first batch would otherwise wait for the last fork)."""

from __future__ import annotations

import multiprocessing
import multiprocessing.context
from typing import Any

import pytest
import torch

import pipeload

WAIT_FOR_THE_FIRST_FETCH_S = 30.0  # generous: a loaded machine; the pass comes at once


class _FetchedOnce:
    """Set by the first fetch in any worker (an event the forked workers inherit)."""

    event: Any = None


class SaysWhenFetched(pipeload.Dataset):
    def __len__(self) -> int:
        return 16

    def __getitem__(self, index: int) -> torch.Tensor:
        _FetchedOnce.event.set()
        return torch.tensor(index)


class _SecondWorkerWaits(multiprocessing.context.ForkProcess):
    """Starts the worker of slot 1 only once a worker has fetched: with every worker forked
    before any task goes out, that never happens, and the start gives up."""

    def start(self) -> None:
        if self.name == "pipeload-worker-1" and not _FetchedOnce.event.wait(WAIT_FOR_THE_FIRST_FETCH_S):
            raise AssertionError("worker 1 was forked before worker 0 had a task to fetch")
        super().start()


class _Context(multiprocessing.context.ForkContext):
    Process = _SecondWorkerWaits


@pytest.mark.parametrize("persistent_workers", [False, True])
def test_the_first_worker_fetches_while_the_next_is_forked(persistent_workers: bool) -> None:
    _FetchedOnce.event = multiprocessing.get_context("fork").Event()
    loader = pipeload.DataLoader(SaysWhenFetched(), batch_size=2, num_workers=2,
                                 persistent_workers=persistent_workers, multiprocessing_context=_Context())
    batches = iter(loader)
    assert len(batches._workers) == 2  # every worker runs by the time iter() returns, as torch's
    assert torch.cat(list(batches)).tolist() == list(range(16))
