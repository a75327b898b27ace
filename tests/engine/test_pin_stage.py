"""The pin stage's thread, seen through the iterator's private handles as torch's is seen.

torch's multi-worker iterator has ``_pin_memory_thread`` only when it pins (``pin_memory=True``
and an accelerator present) and ``_pin_memory`` says whether it pins. Where this machine has no
accelerator, ``pretend_accelerator`` (tests/conftest.py) lets pipeload's pin stage run anyway, so
its thread, its error handling and its shutdown are exercised for real.
"""

from __future__ import annotations

import threading
import time

import pytest
import torch
import torch.utils.data as tud
from conftest import wait_until
from faults import worker_pids

import pipeload
from pipeload.pin import pinning_available

pytestmark = [pytest.mark.usefixtures("leak_guard"), pytest.mark.timeout(60)]

FORK = {"multiprocessing_context": "fork"}


class Refused(RuntimeError):
    pass


class Batch:
    """A user batch type that pins itself, and refuses to when it holds ``refuse``."""

    refuse = 6

    def __init__(self, samples: list[int]) -> None:
        self.samples = samples

    def pin_memory(self) -> Batch:
        if self.refuse in self.samples:
            raise Refused(f"cannot pin {self.samples}")
        return self


def make_batch(samples: list[int]) -> Batch:
    return Batch(samples)


@pytest.mark.skipif(pinning_available(), reason="an accelerator is present: both libraries pin")
@pytest.mark.parametrize("num_workers", [0, 2])
@pytest.mark.filterwarnings("ignore:'pin_memory' argument is set as true")
def test_without_an_accelerator_the_handles_answer_as_torchs(num_workers: int) -> None:
    for module in (tud, pipeload):
        kwargs = FORK if module is pipeload and num_workers else {}
        iterator = iter(module.DataLoader(range(8), batch_size=2, num_workers=num_workers, pin_memory=True, **kwargs))
        next(iterator)
        assert iterator._pin_memory is False, module.__name__
        assert not hasattr(iterator, "_pin_memory_thread"), module.__name__
        del iterator


@pytest.mark.parametrize("pin_memory", [False, True])
def test_inline_loading_has_no_pin_thread(pin_memory: bool, pretend_accelerator: None) -> None:
    iterator = iter(pipeload.DataLoader(range(8), batch_size=2, pin_memory=pin_memory))
    assert next(iterator).tolist() == [0, 1]
    assert iterator._pin_memory is pin_memory
    assert not hasattr(iterator, "_pin_memory_thread")  # torch pins inline too


def test_no_pin_thread_without_pin_memory() -> None:
    iterator = iter(pipeload.DataLoader(range(8), batch_size=2, num_workers=2, **FORK))
    next(iterator)
    assert iterator._pin_memory is False
    assert not hasattr(iterator, "_pin_memory_thread")
    del iterator


@pytest.mark.parametrize("engine", [FORK, {"worker_type": "thread"}], ids=["fork", "thread"])
def test_the_pin_thread_lives_while_pinning_and_ends_within_a_second_of_the_drop(
    engine: dict, pretend_accelerator: None, leak_guard
) -> None:
    iterator = iter(pipeload.DataLoader(torch.arange(40.0), batch_size=2, num_workers=2, pin_memory=True, **engine))
    assert next(iterator).tolist() == [0.0, 1.0]
    thread = iterator._pin_memory_thread
    assert isinstance(thread, threading.Thread) and thread.is_alive()
    assert iterator._pin_memory is True
    pids = worker_pids(iterator) if "multiprocessing_context" in engine else []
    del iterator  # mid-epoch: the thread is pinning ahead, or waiting on the workers
    assert wait_until(lambda: not thread.is_alive(), 1.0)
    if pids:
        leak_guard.assert_exited(pids, within_s=1.0)


def test_each_persistent_epoch_has_a_live_pin_thread(pretend_accelerator: None) -> None:
    loader = pipeload.DataLoader(torch.arange(8.0), batch_size=2, num_workers=2, pin_memory=True,
                                 persistent_workers=True, **FORK)
    threads = []
    for _ in range(2):
        iterator = iter(loader)
        next(iterator)
        threads.append(iterator._pin_memory_thread)
        assert threads[-1].is_alive()
        assert len(list(iterator)) == 3
        assert wait_until(lambda: not threads[-1].is_alive(), 1.0)  # the epoch is over
    assert threads[0] is not threads[1]
    del iterator, loader


@pytest.mark.parametrize("engine", [FORK, {"worker_type": "thread"}], ids=["fork", "thread"])
def test_a_pinning_error_is_torchs_and_the_epoch_goes_on(engine: dict, pretend_accelerator: None) -> None:
    loader = pipeload.DataLoader(range(12), batch_size=2, num_workers=2, pin_memory=True,
                                 collate_fn=make_batch, **engine)
    iterator = iter(loader)
    seen = []
    while True:
        try:
            seen.append(next(iterator).samples)
        except Refused as error:
            assert str(error).startswith("Caught Refused in pin memory thread for device 0.")
            assert "cannot pin [6, 7]" in str(error)
            seen.append("refused")
        except StopIteration:
            break
    assert seen == [[0, 1], [2, 3], [4, 5], "refused", [8, 9], [10, 11]]


class StallsAt:
    def __init__(self, length: int, stall_index: int) -> None:
        self.length, self.stall_index = length, stall_index

    def __len__(self) -> int:
        return self.length

    def __getitem__(self, index: int) -> float:
        if index == self.stall_index:
            time.sleep(60)  # a worker stuck in user code: stopping it is the loader's job
        return float(index)


def test_the_pin_thread_waiting_on_a_stuck_worker_ends_within_a_second(pretend_accelerator: None, leak_guard) -> None:
    iterator = iter(pipeload.DataLoader(StallsAt(40, stall_index=4), batch_size=2, num_workers=2,
                                        pin_memory=True, **FORK))
    assert next(iterator).tolist() == [0.0, 1.0]
    thread = iterator._pin_memory_thread
    pids = worker_pids(iterator)
    started = time.monotonic()
    del iterator  # the pin thread waits for batch 2, which worker 0 never finishes
    assert wait_until(lambda: not thread.is_alive(), 1.0)
    assert time.monotonic() - started < 1.0
    leak_guard.assert_exited(pids, within_s=1.0)
