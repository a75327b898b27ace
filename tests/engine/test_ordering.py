"""Exactly once, in order: under uneven worker speed every index appears once per epoch, in sampler
order (``in_order=True``) or in any order (``in_order=False``).
"""

from __future__ import annotations

import multiprocessing
from collections import Counter

import pytest
import torch
from faults import (
    ECONOMIC,
    ECONOMIC_SPAWN,
    ECONOMIC_THREAD,
    FORK,
    SPAWN,
    THREAD,
    Numbers,
    Shards,
    Uneven,
    engine_params,
    flatten,
    loader_kwargs,
)

from pipeload import DataLoader

pytestmark = [
    pytest.mark.usefixtures("leak_guard"),
    pytest.mark.timeout(60),
    # More workers than this 2-core machine has CPUs is the point of several tests here.
    pytest.mark.filterwarnings("ignore:This DataLoader will create:UserWarning"),
]

OVERTAKE_WAIT_S = 30.0  # far beyond any start-up, well within the test's timeout
FAST = engine_params(FORK, THREAD, ECONOMIC, ECONOMIC_THREAD)
CLASSIC_FAST = engine_params(FORK, THREAD)  # iterable datasets: economic mode refuses them


def _items(loader: DataLoader) -> list[int]:
    return flatten(list(loader))


@pytest.mark.parametrize("engine", FAST)
@pytest.mark.parametrize(("num_workers", "batch_size", "prefetch_factor"), [(3, 2, 2), (2, 3, 1), (4, 1, 3)])
def test_in_order_under_uneven_speed(engine, num_workers, batch_size, prefetch_factor):
    loader = DataLoader(Uneven(60), batch_size=batch_size, num_workers=num_workers,
                        prefetch_factor=prefetch_factor, **loader_kwargs(engine))
    assert _items(loader) == list(range(60))


@pytest.mark.parametrize("engine", FAST)
def test_out_of_order_delivers_every_index_exactly_once(engine):
    loader = DataLoader(Uneven(60), batch_size=2, num_workers=3, in_order=False, **loader_kwargs(engine))
    items = _items(loader)
    assert Counter(items) == Counter(range(60))


@pytest.mark.parametrize("engine", FAST)
def test_out_of_order_does_not_wait_for_a_slow_batch(engine):
    # Index 0 is not ready until the training loop has received a batch: with in_order=False the
    # others must overtake it. (A fixed sleep here lost the race to worker start-up on a loaded box.)
    loaded_a_batch = multiprocessing.get_context("fork").Event()  # fork and thread workers see it

    class SlowFirst(Uneven):
        def __getitem__(self, index: int) -> int:
            if index == 0:
                # bounded: if nothing overtakes index 0, the batch holding it comes first and fails
                loaded_a_batch.wait(OVERTAKE_WAIT_S)
            return super().__getitem__(index)

    # Economic mode: an item worker holds up to two pieces, so with 2 item workers batch 1's
    # index 2 would wait behind index 0; with 4, batch 1 is fetched by the others.
    loader = DataLoader(SlowFirst(24, unit_s=0.0), batch_size=2, num_workers=4 if engine.economic else 2,
                        in_order=False, **loader_kwargs(engine))
    items = []
    for batch in loader:
        items += flatten([batch])
        loaded_a_batch.set()
    assert Counter(items) == Counter(range(24))
    assert items[0] != 0


class _FirstWaits(torch.utils.data.Dataset):
    """Item 0 waits until the training loop has received the 8 others; each item says who
    fetched it (the worker id), as torch's own test of this does."""

    def __init__(self, others_received) -> None:
        self.others_received = others_received

    def __len__(self) -> int:
        return 10

    def __getitem__(self, index: int) -> tuple[int, int]:
        if index == 0:
            self.others_received.wait(OVERTAKE_WAIT_S)
        return torch.utils.data.get_worker_info().id, index


def _out_of_order_run(loader_class) -> list[tuple[int, int]]:
    others_received = multiprocessing.get_context("fork").Event()
    loader = loader_class(_FirstWaits(others_received), num_workers=2, prefetch_factor=2,
                          in_order=False, multiprocessing_context="fork")
    got = []
    for worker_id, index in loader:
        got.append((int(worker_id), int(index)))
        if len(got) == 8:
            others_received.set()
    return got


def test_out_of_order_spreads_tasks_as_torchs_loader_does():
    # torch gives the next task to the next worker in the rotation that holds fewer than
    # prefetch_factor: worker 0, stuck on index 0, keeps index 2 queued behind it, and worker 1
    # takes everything else (torch's test_out_of_order_index_ds holds this order).
    ours = _out_of_order_run(DataLoader)
    assert ours == _out_of_order_run(torch.utils.data.DataLoader)
    assert [index for _, index in ours] == [1, 3, 4, 5, 6, 7, 8, 9, 0, 2]


@pytest.mark.parametrize("engine", FAST)
def test_sampler_order_is_kept(engine):
    order = torch.randperm(50, generator=torch.Generator().manual_seed(7)).tolist()
    loader = DataLoader(Uneven(50), batch_size=4, sampler=order, num_workers=3, **loader_kwargs(engine))
    assert _items(loader) == order


@pytest.mark.parametrize("engine", FAST)
def test_shuffled_epochs_are_each_a_permutation(engine):
    loader = DataLoader(Uneven(40, unit_s=0.001), batch_size=3, shuffle=True, num_workers=2,
                        generator=torch.Generator().manual_seed(0), **loader_kwargs(engine))
    first, second = _items(loader), _items(loader)
    assert sorted(first) == sorted(second) == list(range(40))
    assert first != second


@pytest.mark.parametrize("engine", FAST)
def test_without_batching_every_index_once_in_order(engine):
    loader = DataLoader(Uneven(30), batch_size=None, num_workers=3, **loader_kwargs(engine))
    assert [int(x) for x in loader] == list(range(30))


@pytest.mark.parametrize("engine", CLASSIC_FAST)
@pytest.mark.parametrize("in_order", [True, False])
def test_iterable_shards_each_item_exactly_once(engine, in_order):
    loader = DataLoader(Shards(50, unit_s=0.002), batch_size=4, num_workers=3, in_order=in_order,
                        **loader_kwargs(engine))
    assert Counter(_items(loader)) == Counter(range(50))


@pytest.mark.parametrize("engine", CLASSIC_FAST)
def test_iterable_in_order_alternates_workers_like_torch(engine):
    # Each worker's replica gives every 3rd item; batches come round-robin from workers 0, 1, 2,
    # and a worker that runs dry is skipped (its share here is uneven: 17, 17, 16 items).
    loader = DataLoader(Shards(50), batch_size=4, num_workers=3, **loader_kwargs(engine))
    batches = [b.tolist() for b in loader]
    worker_of_batch = [batch[0] % 3 for batch in batches]
    assert worker_of_batch[:12] == [0, 1, 2] * 4
    assert Counter(flatten(batches)) == Counter(range(50))


@pytest.mark.parametrize("engine", FAST)
def test_more_workers_than_batches(engine):
    loader = DataLoader(Numbers(5), batch_size=2, num_workers=4, **loader_kwargs(engine))
    assert [b.tolist() for b in loader] == [[0, 1], [2, 3], [4]]


@pytest.mark.parametrize("engine", FAST)
def test_empty_dataset(engine):
    loader = DataLoader(Numbers(0), batch_size=2, num_workers=2, **loader_kwargs(engine))
    assert list(loader) == []


@pytest.mark.timeout(120)
@pytest.mark.parametrize("engine", engine_params(SPAWN, ECONOMIC_SPAWN, slow=(ECONOMIC_SPAWN,)))
def test_in_order_under_spawn(engine):
    loader = DataLoader(Uneven(40), batch_size=2, num_workers=2, **loader_kwargs(engine))
    assert _items(loader) == list(range(40))
