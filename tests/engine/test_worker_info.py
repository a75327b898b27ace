"""Worker seeding: what a process worker's generators start from, and what seeding leaves behind."""

from __future__ import annotations

import random
import threading

import numpy as np
import pytest
import torch

import pipeload
from pipeload import DataLoader, IterableDataset, get_worker_info
from pipeload.engine.worker_info import numpy_seed_words, seed_process_worker


@pytest.fixture
def global_generators():
    """Put the test process's global generators back as they were."""
    states = random.getstate(), torch.get_rng_state(), np.random.get_state()
    yield
    random.setstate(states[0])
    torch.set_rng_state(states[1])
    np.random.set_state(states[2])


def test_a_process_worker_seeds_random_torch_and_numpy(global_generators):
    assert seed_process_worker(100, 3) == 103
    assert torch.initial_seed() == 103
    first = (random.random(), torch.rand(1).item(), np.random.random())
    random.seed(103)
    torch.manual_seed(103)
    np.random.seed(numpy_seed_words(100, 3))
    assert first == (random.random(), torch.rand(1).item(), np.random.random())


@pytest.mark.skipif(getattr(torch, "accelerator", None) is None
                    or torch.accelerator.current_accelerator() is not None,
                    reason="with an accelerator (or torch < 2.6), workers call torch.manual_seed")
def test_without_accelerators_a_worker_queues_no_lazy_accelerator_seed(global_generators):
    # torch.manual_seed queues a seed for CUDA with the stack it came from, whose source files
    # linecache then holds: about 1.2 MiB of a forked worker's own pages, for no device.
    tracker = torch.cuda._lazy_seed_tracker
    before = tracker.manual_seed_all_cb
    seed_process_worker(7, 0)
    assert tracker.manual_seed_all_cb is before
    torch.manual_seed(7)  # the test's own witness: torch's call does queue one
    assert tracker.manual_seed_all_cb is not before


def test_a_torch_without_its_accelerator_module_still_seeds_workers(global_generators, monkeypatch):
    # torch.accelerator came with torch 2.6; the project supports torch 2.4 on.
    monkeypatch.delattr(torch, "accelerator")
    assert seed_process_worker(100, 3) == 103
    assert torch.initial_seed() == 103


class _InfoReprs(IterableDataset):
    """Yields, once per worker, the repr of the worker's own info."""

    def __iter__(self):
        yield repr(get_worker_info())

    def __repr__(self) -> str:
        return "InfoReprs()"


@pytest.mark.parametrize("worker_type", ["process", "thread"])
def test_a_workers_info_repr_names_every_field_as_torchs_does(worker_type, leak_guard):
    # torch's WorkerInfo repr shows id, num_workers, seed, dataset and rng; a worker that logs
    # its info must see which copy of the dataset it holds.
    loader = DataLoader(_InfoReprs(), batch_size=None, num_workers=2, worker_type=worker_type)
    reprs = list(loader)
    assert len(reprs) == 2
    for text in reprs:
        for name in ("id=", "num_workers=", "seed=", "dataset=InfoReprs()", "rng="):
            assert name in text, text


class _ReadsInAThread(torch.utils.data.IterableDataset):
    """A stream read by a thread of its own (I/O often is), which shards by the worker's info."""

    def __init__(self, info_of) -> None:
        self.info_of = info_of

    def __iter__(self):
        read = []

        def reader() -> None:
            info = self.info_of()
            first, step = (0, 1) if info is None else (info.id, info.num_workers)
            read.extend(range(first, 8, step))

        thread = threading.Thread(target=reader)
        thread.start()
        thread.join()
        return iter(read)


def test_every_thread_of_a_process_worker_gets_its_info_as_torchs(leak_guard):
    # torch's is one value per worker process: a reader thread sharded by it; pipeload's
    # answered None there, and every worker yielded every item.
    theirs = torch.utils.data.DataLoader(_ReadsInAThread(torch.utils.data.get_worker_info), batch_size=None,
                                         num_workers=2, multiprocessing_context="fork")
    ours = pipeload.DataLoader(_ReadsInAThread(pipeload.get_worker_info), batch_size=None, num_workers=2,
                               multiprocessing_context="fork")
    assert sorted(int(item) for item in ours) == sorted(int(item) for item in theirs) == list(range(8))
