"""An error raised for one batch does not end the epoch: torch.utils.data is the oracle.

The loop users write to skip bad batches (``try: next(it) except E: continue``) must give the same
batches, in the same order, and the same number of errors as torch's DataLoader, with every
other batch exactly once: for errors in ``__getitem__``, ``__getitems__``, ``collate_fn`` and an
iterable's ``__next__`` (a generator, which is finished once it raised, and a class-based
iterator, which goes on), inline and with 2 and 3 workers, process and thread workers,
persistent or not, ``in_order=False`` and pinning.

What ends the epoch is checked here too: a dead worker, Ctrl-C, and an error nobody catches
(the workers go as soon as the iterator is dropped, however long the error is kept).
"""

from __future__ import annotations

import gc
import os
import signal
import threading
import time
from collections.abc import Callable, Iterator
from types import ModuleType
from typing import Any

import pytest
import torch
import torch.utils.data as tud
from conftest import child_pids, once_the_main_thread_waits, wait_until
from oracle import drain_skipping

import pipeload
from pipeload.errors import WorkerDiedError

pytestmark = [
    pytest.mark.usefixtures("leak_guard"),
    pytest.mark.timeout(120),
    pytest.mark.filterwarnings("ignore:This DataLoader will create:UserWarning"),
]


class BadSample(Exception):
    """Raised for the samples a test marks bad."""


def _worker_id(module: ModuleType) -> int:
    info = module.get_worker_info()
    return 0 if info is None else info.id


class Items:
    """Map-style: item i is i; ``bad`` items raise in ``__getitem__``."""

    def __init__(self, length: int, bad: frozenset[int]) -> None:
        self.length, self.bad = length, bad

    def __len__(self) -> int:
        return self.length

    def __getitem__(self, index: int) -> int:
        if index in self.bad:
            raise BadSample(f"item {index}")
        return index


class BatchedItems(Items):
    """The same, fetched a batch at a time: ``__getitems__`` raises for a batch with a bad item."""

    def __getitems__(self, indices: list[int]) -> list[int]:
        if self.bad.intersection(indices):
            raise BadSample(f"batch {indices}")
        return list(indices)


def collate_refusing_multiples_of_seven(samples: list[int]) -> torch.Tensor:
    if any(sample % 7 == 0 and sample > 0 for sample in samples):
        raise BadSample(f"collate {samples}")
    return torch.tensor(samples)


def _generator_stream(module: ModuleType) -> type:
    class GeneratorStream(module.IterableDataset):
        """Each worker's replica yields 10 items and raises at its 5th: a generator is then done."""

        def __iter__(self) -> Iterator[int]:
            base = 100 * _worker_id(module)
            for step in range(10):
                if step == 4:
                    raise BadSample(f"generator of replica {base}")
                yield base + step

    return GeneratorStream


def _class_stream(module: ModuleType) -> type:
    class Cursor:
        def __init__(self) -> None:
            self.base, self.step = 100 * _worker_id(module), 0

        def __iter__(self) -> Cursor:
            return self

        def __next__(self) -> int:
            self.step += 1
            if self.step > 10:
                raise StopIteration
            if self.step in (4, 8):
                raise BadSample(f"cursor of replica {self.base} at {self.step}")
            return self.base + self.step

    class ClassStream(module.IterableDataset):
        """Each replica's iterator raises at its 4th and 8th items and goes on after each."""

        def __iter__(self) -> Cursor:
            return Cursor()

    return ClassStream


# Each case builds the loader's dataset and keyword arguments for a module (torch's or ours).
CASES: dict[str, Callable[[ModuleType], tuple[Any, dict[str, Any]]]] = {
    "getitem": lambda m: (Items(40, frozenset({6, 21})), {"batch_size": 4}),
    "getitems": lambda m: (BatchedItems(40, frozenset({6, 21, 22})), {"batch_size": 4}),
    "collate_fn": lambda m: (Items(40, frozenset()), {"batch_size": 3, "collate_fn": collate_refusing_multiples_of_seven}),
    "generator-next": lambda m: (_generator_stream(m)(), {"batch_size": 3}),
    "iterator-next": lambda m: (_class_stream(m)(), {"batch_size": 3}),
}

# (num_workers, pipeload-only keyword arguments, keyword arguments for both). Persistent workers
# run two epochs; torch's side runs them without persistent workers, which give the same batches
# in torch (checked by hand) and spare its five-second shutdown of persistent workers.
VARIANTS: dict[str, tuple[int, dict[str, Any], dict[str, Any]]] = {
    "inline": (0, {}, {}),
    "2-processes": (2, {"multiprocessing_context": "fork"}, {}),
    "3-processes": (3, {"multiprocessing_context": "fork"}, {}),
    "2-threads": (2, {"worker_type": "thread"}, {}),
    "3-threads": (3, {"worker_type": "thread"}, {}),
    "2-persistent": (2, {"multiprocessing_context": "fork", "persistent_workers": True}, {}),
    "3-persistent-threads": (3, {"worker_type": "thread", "persistent_workers": True}, {}),
    "2-out-of-order": (2, {"multiprocessing_context": "fork"}, {"in_order": False}),
    "3-out-of-order-threads": (3, {"worker_type": "thread"}, {"in_order": False}),
    "2-economic": (2, {"multiprocessing_context": "fork", "mode": "economic"}, {}),
    "3-economic-threads": (3, {"worker_type": "thread", "mode": "economic"}, {}),
    "2-economic-persistent": (2, {"multiprocessing_context": "fork", "mode": "economic", "persistent_workers": True}, {}),
    "2-economic-out-of-order": (2, {"multiprocessing_context": "fork", "mode": "economic"}, {"in_order": False}),
}
# Economic mode takes map-style datasets only; every other variant runs every case.
ECONOMIC_VARIANTS = [v for v in VARIANTS if "economic" in v]
MAP_STYLE_CASES = ["getitem", "getitems", "collate_fn"]
VARIANT_CASES = [(case, variant) for variant in VARIANTS for case in CASES
                 if variant not in ECONOMIC_VARIANTS or case in MAP_STYLE_CASES]


def _epochs(module: ModuleType, case: str, variant: str, extra: dict[str, Any] | None = None) -> list[tuple[list[Any], int]]:
    num_workers, ours_only, both = VARIANTS[variant]
    dataset, kwargs = CASES[case](module)
    if module is pipeload:
        kwargs = {**kwargs, **ours_only, **(extra or {})}
    loader = module.DataLoader(dataset, num_workers=num_workers, **kwargs, **both)
    epochs = 2 if ours_only.get("persistent_workers") else 1
    result = [drain_skipping(iter(loader), BadSample) for _ in range(epochs)]
    if module is tud:
        # torch re-raises a worker's error from a frame that holds it: a reference cycle that
        # keeps its iterator, pipes and shared memory until the collector runs. Not ours to test.
        del loader
        gc.collect()
    return result


def _comparable(result: list[tuple[list[Any], int]], in_order: bool) -> list[tuple[list[Any], int]]:
    if in_order:
        return result
    return [(sorted(batches), errors) for batches, errors in result]  # arrival order is timing


@pytest.mark.parametrize(("case", "variant"), VARIANT_CASES)
def test_skipping_bad_batches_gives_what_torch_gives(case: str, variant: str) -> None:
    in_order = VARIANTS[variant][2].get("in_order", True)
    theirs = _comparable(_epochs(tud, case, variant), in_order)
    ours = _comparable(_epochs(pipeload, case, variant), in_order)
    assert ours == theirs
    for batches, errors in ours:
        assert errors > 0  # the case does provoke errors...
        values = [value for batch in batches for value in batch]
        assert len(values) == len(set(values))  # ...and no batch comes twice


@pytest.mark.parametrize(("case", "variant"), [
    *((case, variant) for case in CASES for variant in ("2-processes", "3-threads")),
    *((case, "2-economic") for case in MAP_STYLE_CASES),
])
def test_skipping_bad_batches_with_pinning(case: str, variant: str, pretend_accelerator: None) -> None:
    # torch runs unpinned here (the pretend accelerator is for pipeload's pin stage only):
    # pinning changes where a batch lives, not which batches come.
    with pytest.MonkeyPatch.context() as undo:
        undo.setattr(torch.accelerator, "is_available", lambda: False)
        theirs = _epochs(tud, case, variant)
    ours = _epochs(pipeload, case, variant, extra={"pin_memory": True})
    assert ours == theirs


def test_the_iterator_with_an_error_behind_it_keeps_its_workers_until_dropped(leak_guard) -> None:
    loader = pipeload.DataLoader(Items(16, frozenset({2})), batch_size=2, num_workers=2,
                                 multiprocessing_context="fork")
    iterator = iter(loader)
    pids = [worker.pid for worker in iterator._workers]
    assert next(iterator).tolist() == [0, 1]
    with pytest.raises(BadSample):
        next(iterator)
    assert all(worker.is_alive() for worker in iterator._workers)
    assert next(iterator).tolist() == [4, 5]  # the epoch goes on
    del iterator
    leak_guard.assert_exited(pids, within_s=1.0)


def _train(loader: Any, started: list[Any]) -> None:
    for batch in loader:
        del batch  # a training step; the error's traceback keeps this frame, not the batch
        if not started:  # what the epoch runs on: its worker processes and pin thread
            started.extend(child_pids())
            started.extend(t for t in threading.enumerate() if t.name == "pipeload-pin")


@pytest.mark.parametrize("pinned", [False, True], ids=["plain", "pinned"])
def test_an_uncaught_error_lets_the_workers_go_though_the_error_is_kept(pinned, leak_guard, no_gc, request) -> None:
    if pinned:
        request.getfixturevalue("pretend_accelerator")
    loader = pipeload.DataLoader(Items(16, frozenset({5})), batch_size=2, num_workers=2,
                                 multiprocessing_context="fork", pin_memory=pinned)
    started: list[Any] = []
    with pytest.raises(BadSample) as caught:
        _train(loader, started)  # the for loop unwinds: only the error refers to the epoch now
    kept = caught.value  # held, as a logger or a notebook would hold it
    assert kept.__traceback__ is not None
    pids = [item for item in started if isinstance(item, int)]
    threads = [item for item in started if isinstance(item, threading.Thread)]
    assert len(pids) == 2 and len(threads) == (1 if pinned else 0)
    leak_guard.assert_exited(pids, within_s=1.0)
    assert wait_until(lambda: not any(t.is_alive() for t in threads), 1.0)


def test_a_dead_worker_ends_the_epoch(leak_guard) -> None:
    loader = pipeload.DataLoader(Items(40, frozenset()), batch_size=2, num_workers=2,
                                 multiprocessing_context="fork")
    iterator = iter(loader)
    pids = [worker.pid for worker in iterator._workers]
    assert next(iterator).tolist() == [0, 1]
    os.kill(pids[1], signal.SIGKILL)
    assert wait_until(lambda: not iterator._workers[1].is_alive(), 5.0)
    with pytest.raises(WorkerDiedError):
        for _ in range(25):
            next(iterator)
    with pytest.raises(StopIteration):  # unlike a batch's error, nothing comes after it
        next(iterator)
    leak_guard.assert_exited(pids, within_s=1.0)


class StallsAt(Items):
    def __getitem__(self, index: int) -> int:
        if index in self.bad:
            time.sleep(60)  # the test interrupts the wait for it
        return index


def test_ctrl_c_ends_the_epoch(leak_guard, ctrl_c_raises) -> None:
    loader = pipeload.DataLoader(StallsAt(16, frozenset({4})), batch_size=2, num_workers=2,
                                 multiprocessing_context="fork")
    iterator = iter(loader)
    pids = [worker.pid for worker in iterator._workers]
    assert next(iterator).tolist() == [0, 1]
    assert next(iterator).tolist() == [2, 3]
    # Batch 2 stalls in its worker: the main thread waits for it in the pool's receive, and the
    # Ctrl-C goes to the main thread once it is there.
    with once_the_main_thread_waits(lambda: signal.pthread_kill(threading.main_thread().ident, signal.SIGINT)) as seen:
        with pytest.raises(KeyboardInterrupt):
            next(iterator)
    assert seen == [True], "the main thread was never seen waiting for batch 2"
    with pytest.raises(StopIteration):
        next(iterator)
    leak_guard.assert_exited(pids, within_s=1.0)
