"""An exception raised in a worker comes back whole: same type, torch's "Caught X in DataLoader
worker process N." first, message, traceback text, sample indices when known; and the workers are
gone as soon as the iterator is dropped (the error itself does not end the epoch: see
tests/test_skip_bad_batch.py).
"""

from __future__ import annotations

import collections
import re

import pytest
from faults import (
    ECONOMIC,
    ECONOMIC_SPAWN,
    ECONOMIC_THREAD,
    FORK,
    SPAWN,
    THREAD,
    BrokenIter,
    FailsMidStream,
    InitFailed,
    Numbers,
    RaisesAt,
    SampleFailed,
    engine_params,
    failing_collate,
    failing_init,
    loader_kwargs,
    worker_pids,
)

from pipeload import DataLoader

pytestmark = [pytest.mark.usefixtures("leak_guard", "no_gc"), pytest.mark.timeout(60)]

ALL = engine_params(FORK, SPAWN, THREAD, ECONOMIC, ECONOMIC_SPAWN, ECONOMIC_THREAD, slow=(ECONOMIC_SPAWN,))
FAST = engine_params(FORK, THREAD, ECONOMIC, ECONOMIC_THREAD)
CLASSIC_FAST = engine_params(FORK, THREAD)  # iterable datasets: economic mode refuses them


def _first_error(loader: DataLoader) -> tuple[BaseException, list[int]]:
    """Iterate until the loader raises, then drop the iterator; return the error and the worker
    pids it had. The error's traceback keeps this frame, so the iterator is deleted from it."""
    iterator = iter(loader)
    pids = worker_pids(iterator)
    with pytest.raises(BaseException) as caught:
        collections.deque(iterator, maxlen=0)  # keeps no batch alive in this frame
    del iterator
    return caught.value, pids


def _assert_workers_gone(engine: tuple, pids: list[int], leak_guard) -> None:
    if not engine.threads:
        leak_guard.assert_exited(pids, within_s=1.0)


# spawn: a slow test (~1.5 s); spawned workers' errors run fast in test_worker_init_fn_error_is_raised_with_its_type
@pytest.mark.parametrize("engine", engine_params(FORK, SPAWN, THREAD, ECONOMIC, ECONOMIC_SPAWN, ECONOMIC_THREAD,
                                                 slow=(SPAWN, ECONOMIC_SPAWN)))
def test_getitem_error_keeps_type_worker_message_traceback_and_indices(engine, leak_guard):
    # batch_size=4 and 2 workers: indices 4..7 form batch 1, which round-robin gives worker 1.
    # Economic mode: whichever item worker was free fetched index 6; it is named, and the index.
    loader = DataLoader(RaisesAt(16, bad_index=6), batch_size=4, num_workers=2, **loader_kwargs(engine))
    error, pids = _first_error(loader)

    assert type(error) is SampleFailed
    text = str(error)
    if engine.economic:  # torch's sentence names the worker's id among its kind; ours, the kind
        assert text.startswith("Caught SampleFailed in DataLoader worker process ")
        assert re.search(r"in item worker [01] while fetching items \(sample indices \[6\]\)", text), text
    else:
        assert text.startswith("Caught SampleFailed in DataLoader worker process 1.")
        assert "[4, 5, 6, 7]" in text
        # torch's sentence says "process" whatever the worker is; ours says a thread is one
        assert ("It was raised in thread worker 1 while fetching" in text) == engine.threads, text
    assert "sample 6 is corrupt" in text
    assert "Traceback (most recent call last)" in text
    assert "in __getitem__" in text and "faults.py" in text
    _assert_workers_gone(engine, pids, leak_guard)


@pytest.mark.parametrize("engine", FAST)
def test_getitem_error_without_batching_names_the_single_index(engine):
    loader = DataLoader(RaisesAt(6, bad_index=3), batch_size=None, num_workers=2, **loader_kwargs(engine))
    error, _ = _first_error(loader)
    assert type(error) is SampleFailed
    worker = r"in item worker \d while fetching items" if engine.economic else r"worker process 1\b"
    assert re.search(rf"{worker}.*sample indices 3\b", str(error))


@pytest.mark.parametrize("engine", FAST)
def test_builtin_exception_type_is_kept(engine):
    loader = DataLoader(RaisesAt(8, bad_index=0, exc_type=IndexError), batch_size=2, num_workers=2,
                        **loader_kwargs(engine))
    error, _ = _first_error(loader)
    assert type(error) is IndexError
    assert "worker process 0" in str(error) and "sample 0 is corrupt" in str(error)


@pytest.mark.parametrize("engine", CLASSIC_FAST)
def test_error_in_dataset_iter_names_the_worker_and_stage(engine, leak_guard):
    loader = DataLoader(BrokenIter(), batch_size=2, num_workers=2, **loader_kwargs(engine))
    error, pids = _first_error(loader)

    assert type(error) is SampleFailed
    text = str(error)
    assert text.startswith("Caught SampleFailed in DataLoader worker process 0.")
    assert "cannot open the shard" in text
    assert "in __iter__" in text
    assert "sample indices" not in text  # an iterable dataset has none to give
    _assert_workers_gone(engine, pids, leak_guard)


@pytest.mark.parametrize("engine", CLASSIC_FAST)
def test_error_inside_an_iterable_stream(engine):
    loader = DataLoader(FailsMidStream(good=3), batch_size=2, num_workers=1, **loader_kwargs(engine))
    iterator = iter(loader)
    assert next(iterator).tolist() == [0, 1]
    with pytest.raises(SampleFailed) as caught:
        next(iterator)
    text = str(caught.value)
    assert "worker process 0" in text and "stream broke after 3 items" in text and "in __iter__" in text
    del iterator  # the epoch goes on after an error: dropping the iterator is what stops it


@pytest.mark.parametrize("engine", FAST)
def test_collate_fn_error_keeps_keyerror_and_names_indices(engine, leak_guard):
    loader = DataLoader(Numbers(8), batch_size=4, num_workers=2, collate_fn=failing_collate,
                        **loader_kwargs(engine))
    error, pids = _first_error(loader)

    assert type(error) is KeyError
    text = str(error)
    assert text.startswith("Caught KeyError in DataLoader worker process 0.")
    if engine.economic:
        assert "in batch worker 0 while collating a batch" in text
    assert "collate could not find key for 4 samples" in text
    assert "in failing_collate" in text
    assert "[0, 1, 2, 3]" in text
    assert "\\n" not in text  # a KeyError's message must read as text, not as an escaped repr
    _assert_workers_gone(engine, pids, leak_guard)


@pytest.mark.parametrize("engine", ALL)
def test_worker_init_fn_error_is_raised_with_its_type(engine, leak_guard):
    loader = DataLoader(Numbers(8), batch_size=2, num_workers=2, worker_init_fn=failing_init,
                        **loader_kwargs(engine))
    error, pids = _first_error(loader)

    assert type(error) is InitFailed
    text = str(error)
    assert text.startswith("Caught InitFailed in DataLoader worker process 0.")
    if engine.economic:  # the first batch's: batch worker 0's (threads), or item worker 0's
        # (processes: the main process assembles the first batch from its items)
        who = "batch worker 0" if engine.threads else "item worker 0"
        assert f"in {who} while running worker_init_fn" in text
    assert "worker_init_fn refused worker 0" in text
    assert "in failing_init" in text
    assert "worker_init_fn" in text
    _assert_workers_gone(engine, pids, leak_guard)


@pytest.mark.parametrize("engine", FAST)
def test_error_carries_a_note_naming_the_worker(engine):
    loader = DataLoader(RaisesAt(4, bad_index=1), batch_size=2, num_workers=1, **loader_kwargs(engine))
    error, _ = _first_error(loader)
    notes = getattr(error, "__notes__", [])
    where = ("item worker 0", "[1]") if engine.economic else ("worker 0", "[0, 1]")
    assert any(where[0] in note and where[1] in note for note in notes), notes


@pytest.mark.parametrize("engine", FAST)
def test_loader_works_again_after_an_error(engine):
    dataset = RaisesAt(8, bad_index=5)
    loader = DataLoader(dataset, batch_size=2, num_workers=2, **loader_kwargs(engine))
    with pytest.raises(SampleFailed):
        list(loader)
    dataset.bad_index = -1  # nothing fails now; a new epoch starts fresh workers
    assert [b.tolist() for b in loader] == [[0, 1], [2, 3], [4, 5], [6, 7]]


@pytest.mark.parametrize("engine", FAST)
def test_an_error_in_a_persistent_epoch_keeps_the_workers(engine):
    # As in torch, a batch's error ends neither the epoch nor the workers: an abandoned epoch is
    # followed by a full one on the same workers, which still raise for the same sample.
    loader = DataLoader(RaisesAt(8, bad_index=3), batch_size=2, num_workers=2, persistent_workers=True,
                        **loader_kwargs(engine))
    with pytest.raises(SampleFailed):
        list(loader)
    iterator = iter(loader)
    pids = worker_pids(iterator)
    seen = []
    for _ in range(5):
        try:
            seen.append(next(iterator).tolist())
        except SampleFailed:
            seen.append("error")
        except StopIteration:
            break
    assert seen == [[0, 1], "error", [4, 5], [6, 7]]
    assert worker_pids(iter(loader)) == pids
    del iterator, loader


@pytest.mark.parametrize("engine", FAST)
def test_error_when_the_failing_batch_is_not_first_in_line(engine):
    # Batch 3 fails while batches 0..2 are still to be yielded: those come out first, in order.
    loader = DataLoader(RaisesAt(16, bad_index=13), batch_size=4, num_workers=2, **loader_kwargs(engine))
    seen = []
    with pytest.raises(SampleFailed, match=r"item worker \d" if engine.economic else "worker 1"):
        for batch in loader:
            seen.append(batch.tolist())
    assert seen == [[0, 1, 2, 3], [4, 5, 6, 7], [8, 9, 10, 11]]


class SamplerFails:
    """Yields 0..5, then raises: a sampler's own failure, in the main process."""

    def __iter__(self):
        yield from range(6)
        raise SampleFailed("the sampler broke")

    def __len__(self) -> int:
        return 8


def _skip_errors(iterator, error_type) -> list:
    seen = []
    for _ in range(50):
        try:
            seen.append(next(iterator).tolist())
        except error_type:
            seen.append("error")
        except StopIteration:
            return seen
    raise AssertionError(f"no end: {seen}")


@pytest.mark.parametrize("engine", FAST)
def test_a_sampler_error_comes_where_the_sampler_failed(engine):
    # Workers fetch ahead, so the sampler fails before the batches sent earlier are out: they
    # still come, in order, then the error, then the end, as without workers (and in torch).
    import torch.utils.data as tud

    expected = _skip_errors(iter(tud.DataLoader(Numbers(8), batch_size=2, sampler=SamplerFails())), SampleFailed)
    assert expected == [[0, 1], [2, 3], [4, 5], "error"]
    loader = DataLoader(Numbers(8), batch_size=2, sampler=SamplerFails(), num_workers=2, **loader_kwargs(engine))
    assert _skip_errors(iter(loader), SampleFailed) == expected


@pytest.mark.parametrize("engine", CLASSIC_FAST)
def test_an_iterable_whose_iter_raised_is_reported_once_per_worker_then_finished(engine):
    # No iterator was made, so each replica has nothing more to give, like a generator that
    # raised. (torch's workers keep answering every task with an error, for ever.)
    loader = DataLoader(BrokenIter(), batch_size=2, num_workers=2, **loader_kwargs(engine))
    assert _skip_errors(iter(loader), SampleFailed) == ["error", "error"]
