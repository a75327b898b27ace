"""Economic mode raises a batch's failing item as soon as it is decided, as torch's worker raises at
the first failing item: not once the batch's other items have been fetched. Items after it are not
fetched by the item worker that saw it fail, and the batch's slab is never handed to another batch
while item workers may still write into it."""

from __future__ import annotations

import multiprocessing

import pytest
import torch

from pipeload import DataLoader, default_collate
from pipeload.collate import default_collate_fn_map

ITEMS = 32
BATCH = 8


class FirstOfABatchFails(torch.utils.data.Dataset):
    """Item ``failing`` (the first of its batch) raises at once; the other items of its batch
    wait for ``go`` (set by the test once the error is in hand), so a loader that waited for them
    before raising would time out. Every fetch is counted in ``calls`` (shared by the processes)."""

    def __init__(self, shape: tuple[int, ...], failing: int, go: object, calls: object) -> None:
        self.shape = shape
        self.failing = failing
        self.go = go
        self.calls = calls

    def __len__(self) -> int:
        return ITEMS

    def __getitem__(self, index: int) -> torch.Tensor:
        with self.calls.get_lock():
            self.calls[index] += 1
        if index == self.failing:
            raise ValueError(f"item {index} is damaged")
        if self.failing < index < self.failing + BATCH and not self.go.wait(timeout=30):
            raise TimeoutError("the test never said go")
        return torch.full(self.shape, float(index))


def _collate_stacking(samples: list[torch.Tensor]) -> torch.Tensor:
    return torch.stack(samples)  # a collate_fn of its own: batch workers collate


def _run(shape: tuple[int, ...], num_workers: int, collate_fn: object | None,
         failing: int = 0) -> tuple[list[torch.Tensor], list[int], int]:
    """Every batch but the failing one (whose error must come before its other items), how
    often each item was fetched, and how many slabs were given up as still written into."""
    ctx = multiprocessing.get_context("fork")
    go, calls = ctx.Event(), ctx.Array("i", ITEMS)
    extra = {} if collate_fn is None else {"collate_fn": collate_fn}
    loader = DataLoader(FirstOfABatchFails(shape, failing, go, calls), batch_size=BATCH,
                        num_workers=num_workers, mode="economic", multiprocessing_context=ctx,
                        timeout=10, **extra)
    iterator = iter(loader)
    batches = [next(iterator).clone() for _ in range(failing // BATCH)]
    with pytest.raises(ValueError, match=f"item {failing} is damaged"):
        next(iterator)  # before any other item of its batch can come: they wait for ``go``
    go.set()
    batches += [batch.clone() for batch in iterator]
    return batches, list(calls), loader._slab_keeper.counts().busy


def _expected(shape: tuple[int, ...], failing: int) -> list[torch.Tensor]:
    return [torch.stack([torch.full(shape, float(i)) for i in range(start, start + BATCH)])
            for start in range(0, ITEMS, BATCH) if start != failing]


@pytest.mark.parametrize("collate_fn", [None, _collate_stacking], ids=["main-assembles", "batch-workers"])
def test_the_first_failing_item_is_raised_at_once_and_the_epoch_goes_on(collate_fn):
    rest, _, _ = _run((4,), num_workers=2, collate_fn=collate_fn)
    assert [torch.equal(a, b) for a, b in zip(rest, _expected((4,), 0), strict=True)] == [True] * 3


def test_one_item_worker_fetches_nothing_after_the_item_that_failed_as_torch():
    _, calls, _ = _run((4,), num_workers=1, collate_fn=None)
    assert calls[:BATCH] == [1] + [0] * (BATCH - 1)  # torch's worker stops the batch there too
    assert calls[BATCH:] == [1] * (ITEMS - BATCH)


class _Unused:
    """A type the test adds to ``default_collate_fn_map``: an extended ``default_collate``."""


@pytest.fixture
def extended_default_collate(monkeypatch):
    monkeypatch.setitem(default_collate_fn_map, _Unused, lambda batch, **_: batch)


@pytest.mark.parametrize("collate_fn", [None, "extended"], ids=["main-assembles", "batch-workers-place-items"])
def test_items_written_late_into_a_failed_batch_slab_never_reach_another_batch(collate_fn, request):
    # 256 KiB items are written straight into their batch's slab by the item workers (once their
    # size is known: the third batch fails); the failed batch's other items come only after its
    # error was raised and later batches were granted slabs. With default_collate extended, batch workers (not the main process) collate the
    # items from there.
    # The main process keeps the failed batch's grant open until its last piece is in; a batch
    # worker, which answers for its batch once, gives the slab up instead.
    by_batch_workers = collate_fn == "extended"
    if by_batch_workers:
        request.getfixturevalue("extended_default_collate")
        collate_fn = default_collate
    shape = (64, 1024)
    failing = 2 * BATCH  # by then the items' size is known: they are placed in the slab
    batches, _, given_up = _run(shape, num_workers=2, collate_fn=collate_fn, failing=failing)
    assert [torch.equal(a, b) for a, b in zip(batches, _expected(shape, failing), strict=True)] == [True] * 3
    assert given_up == (1 if by_batch_workers else 0)


def test_a_failure_is_decided_only_once_every_slot_before_it_has_come():
    from pipeload.engine.direct_batches import DirectBatch
    from pipeload.errors import RemoteFailure

    def failure(slot: int) -> RemoteFailure:
        try:
            raise ValueError(f"slot {slot}")
        except ValueError:
            return RemoteFailure.capture(0, "fetching items", [slot])

    batch = DirectBatch(batch_worker=0, indices=list(range(8)))
    batch.groups[5] = (3, failure(5))  # the rest of its piece: slots 5 to 7
    assert batch.decided_failure() is None  # slots 0 to 4 may still fail first
    batch.groups[2] = (1, failure(2))  # an earlier one, which torch would raise instead
    assert batch.decided_failure() is None  # slots 0 and 1 may still fail first
    batch.groups[0] = (2, ["a", "b"])
    assert batch.decided_failure() is batch.groups[2][1]  # slots 3 and 4 cannot come first
