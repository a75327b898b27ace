"""Soak: a thousand short epochs leave file descriptors, threads, memory and /dev/shm flat.

Slow (about a minute per engine on two cores): run with ``pytest -m slow``.
"""

from __future__ import annotations

import os
import threading

import psutil
import pytest
from faults import MakesTensors

from pipeload import DataLoader

pytestmark = [pytest.mark.slow, pytest.mark.usefixtures("leak_guard")]

EPOCHS = 1000
WARM_UP_EPOCHS = 50
RSS_GROWTH_LIMIT_BYTES = 8 << 20  # allocator noise; measured growth is ~0.1 MB per 1000 epochs

ENGINES = {
    "fresh-processes": dict(num_workers=2, multiprocessing_context="fork"),
    "persistent-processes": dict(num_workers=2, multiprocessing_context="fork", persistent_workers=True),
    "threads": dict(num_workers=2, worker_type="thread"),
    "persistent-threads": dict(num_workers=2, worker_type="thread", persistent_workers=True),
    "economic-processes": dict(num_workers=2, multiprocessing_context="fork", mode="economic"),
    "persistent-economic-processes": dict(num_workers=2, multiprocessing_context="fork", mode="economic",
                                          persistent_workers=True),
    "economic-threads": dict(num_workers=2, worker_type="thread", mode="economic"),
}


def _usage() -> dict[str, int]:
    return {
        "fds": len(os.listdir("/proc/self/fd")),
        "threads": threading.active_count(),
        "children": len(psutil.Process().children(recursive=True)),
        "shm": len(os.listdir("/dev/shm")),
        "rss": psutil.Process().memory_info().rss,
    }


def _epoch(loader: DataLoader, stop_early: bool) -> None:
    for count, batch in enumerate(loader):
        assert batch.shape == (4, 16) or count == 2
        if stop_early and count == 1:
            break  # every other epoch ends early, with batches still in flight


@pytest.mark.timeout(900)
@pytest.mark.parametrize("name", sorted(ENGINES))
def test_thousand_epochs_stay_flat(name):
    loader = DataLoader(MakesTensors(10), batch_size=4, **ENGINES[name])
    for epoch in range(WARM_UP_EPOCHS):
        _epoch(loader, stop_early=epoch % 2 == 1)
    before = _usage()
    for epoch in range(EPOCHS):
        _epoch(loader, stop_early=epoch % 2 == 1)
    after = _usage()

    for key in ("fds", "threads", "children"):
        assert after[key] <= before[key], (key, before, after)
    # /dev/shm is shared with the rest of the machine: only a steady climb would be ours.
    assert after["shm"] <= before["shm"] + 2, (before, after)
    assert after["rss"] - before["rss"] < RSS_GROWTH_LIMIT_BYTES, (before, after)
