"""pipeload's classes are torch's classes to anyone who asks isinstance, yet none of torch's
loading code runs: every batch is still built by our engine."""

from __future__ import annotations

import os
import sys
from collections.abc import Iterator
from typing import Any

import pytest
import torch
import torch.utils.data as tud
import torch.utils.data._utils as torch_loader_utils
import torch.utils.data.dataloader as torch_dataloader
from conftest import LeakGuard, pid_gone, wait_until

import pipeload

DATASETS = ["Dataset", "IterableDataset", "TensorDataset", "StackDataset", "ConcatDataset",
            "ChainDataset", "Subset"]
SAMPLERS = ["Sampler", "SequentialSampler", "RandomSampler", "SubsetRandomSampler",
            "WeightedRandomSampler", "BatchSampler", "DistributedSampler"]

# What a class body always holds, whatever it defines: nothing of torch's that could run.
_CLASS_BOOKKEEPING = {
    "__dict__", "__weakref__", "__module__", "__doc__", "__annotations__", "__orig_bases__",
    "__parameters__", "__abstractmethods__", "_abc_impl", "__firstlineno__",
    "__static_attributes__", "_DataLoader__initialized",
    "__slotnames__",  # copyreg's cache, left on a class once one of its instances was copied
}


@pytest.mark.parametrize("name", ["DataLoader", *DATASETS, *SAMPLERS])
def test_each_class_is_a_subclass_of_torchs_namesake(name: str) -> None:
    assert issubclass(getattr(pipeload, name), getattr(tud, name))


@pytest.mark.parametrize("name", ["DataLoader", *DATASETS, *SAMPLERS])
def test_no_method_of_torchs_class_is_inherited(name: str) -> None:
    """Everything torch's class defines is defined again by ours, earlier in the MRO."""
    ours, theirs = getattr(pipeload, name), getattr(tud, name)
    before_torch = ours.__mro__[: ours.__mro__.index(theirs)]
    inherited = [attribute for attribute in vars(theirs)
                 if attribute not in _CLASS_BOOKKEEPING
                 and not any(attribute in vars(cls) for cls in before_torch)]
    assert inherited == []


def test_instances_answer_isinstance_as_torchs_do() -> None:
    data = pipeload.TensorDataset(torch.arange(6))
    loader = pipeload.DataLoader(data, batch_size=2, shuffle=True)
    assert isinstance(loader, tud.DataLoader)
    assert isinstance(loader.sampler, tud.RandomSampler)
    assert isinstance(loader.batch_sampler, tud.BatchSampler)
    assert isinstance(pipeload.DataLoader(data).sampler, tud.SequentialSampler)
    assert isinstance(data, tud.Dataset) and not isinstance(data, tud.IterableDataset)
    assert isinstance(pipeload.ChainDataset([]), tud.IterableDataset)
    assert isinstance(pipeload.DistributedSampler(data, num_replicas=2, rank=0), tud.DistributedSampler)


def test_every_public_name_of_torchs_is_ours_too_but_the_datapipe_helpers() -> None:
    # Left out on purpose (README, "Compatibility"): DataFrame pipes and the typing and
    # determinism helpers of torch's datapipes.
    left_out = {"DFIterDataPipe", "argument_validation", "guaranteed_datapipes_determinism",
                "non_deterministic", "runtime_validation", "runtime_validation_disabled"}
    assert sorted(set(tud.__all__) - left_out - set(dir(pipeload))) == []


@pytest.mark.parametrize("iterable", [False, True], ids=["map-style", "iterable"])
def test_the_loaders_dataset_kind_reads_as_torchs(iterable: bool) -> None:
    # ``_DatasetKind`` is in torch's __all__; DataLoader subclasses compare the loader's kind with it.
    dataset = pipeload.ChainDataset([]) if iterable else pipeload.TensorDataset(torch.arange(3))
    ours, theirs = pipeload.DataLoader(dataset), tud.DataLoader(dataset)
    assert ours._dataset_kind == theirs._dataset_kind
    assert ours._dataset_kind == (tud._DatasetKind.Iterable if iterable else tud._DatasetKind.Map)
    assert ours._dataset_kind == (pipeload._DatasetKind.Iterable if iterable else pipeload._DatasetKind.Map)
    assert (pipeload._DatasetKind.Map, pipeload._DatasetKind.Iterable) == (tud._DatasetKind.Map, tud._DatasetKind.Iterable)


def test_the_length_an_iterable_loader_reported_reads_as_torchs() -> None:
    class Sized(pipeload.IterableDataset):
        def __iter__(self) -> Iterator[int]:
            return iter(range(5))

        def __len__(self) -> int:
            return 5

    ours, theirs = pipeload.DataLoader(Sized(), batch_size=2), tud.DataLoader(Sized(), batch_size=2)
    assert ours._IterableDataset_len_called == theirs._IterableDataset_len_called  # None: not asked yet
    assert len(ours) == len(theirs) == 3
    assert ours._IterableDataset_len_called == theirs._IterableDataset_len_called == 5


def test_adding_datasets_still_gives_ours() -> None:
    data = pipeload.TensorDataset(torch.arange(3))
    assert type(data + data) is pipeload.ConcatDataset
    assert type(data + tud.TensorDataset(torch.arange(2))) is pipeload.ConcatDataset
    stream = pipeload.ChainDataset([])
    assert type(stream + stream) is pipeload.ChainDataset


def test_generic_aliases_still_work() -> None:
    assert pipeload.DataLoader[int] is not None and pipeload.Dataset[int] is not None
    assert pipeload.Sampler[int] is not None and pipeload.IterableDataset[str] is not None


class _Witness(pipeload.Dataset):
    """Sample i: (i, pid, pipeload worker id, whether torch's loader code is on the stack)."""

    def __len__(self) -> int:
        return 12

    def __getitem__(self, index: int) -> tuple[int, int, int, bool]:
        info = pipeload.get_worker_info()
        return index, os.getpid(), -1 if info is None else info.id, _torch_loader_on_stack()


def _torch_loader_on_stack() -> bool:
    frame = sys._getframe(1)
    while frame is not None:
        if frame.f_globals.get("__name__", "").startswith("torch.utils.data"):
            return True
        frame = frame.f_back
    return False


def _trip(*_: Any, **__: Any) -> None:
    raise AssertionError("torch's loading machinery ran")


@pytest.fixture
def torch_machinery_trips(monkeypatch: pytest.MonkeyPatch) -> Iterator[None]:
    """Any use of torch's loader code raises, here and in forked workers."""
    for owner, attribute in (
        (tud.DataLoader, "__init__"),
        (tud.DataLoader, "__iter__"),
        (tud.DataLoader, "_get_iterator"),
        (torch_dataloader._SingleProcessDataLoaderIter, "__init__"),
        (torch_dataloader._MultiProcessingDataLoaderIter, "__init__"),
        (torch_loader_utils.worker, "_worker_loop"),
        (torch_loader_utils.pin_memory, "_pin_memory_loop"),
        (torch_loader_utils.fetch._MapDatasetFetcher, "__init__"),
        (torch_loader_utils.fetch._IterableDatasetFetcher, "__init__"),
    ):
        monkeypatch.setattr(owner, attribute, _trip)
    yield


@pytest.mark.timeout(60)
@pytest.mark.parametrize(
    "options",
    [
        pytest.param({}, id="inline"),
        pytest.param({"num_workers": 2, "multiprocessing_context": "fork"}, id="fork"),
        pytest.param({"num_workers": 2, "worker_type": "thread"}, id="thread"),
        pytest.param({"num_workers": 2, "multiprocessing_context": "fork",
                      "persistent_workers": True}, id="fork-persistent"),
    ],
)
def test_our_engine_builds_every_batch(
    options: dict[str, Any], torch_machinery_trips: None, leak_guard: LeakGuard
) -> None:
    loader = pipeload.DataLoader(_Witness(), batch_size=3, shuffle=True, **options)
    for _ in range(2):
        samples = [sample for batch in loader for sample in zip(*(part.tolist() for part in batch))]
        assert sorted(index for index, *_ in samples) == list(range(12))
        assert not any(on_stack for *_, on_stack in samples)
        worker_ids = {worker for _, _, worker, _ in samples}
        pids = {pid for _, pid, _, _ in samples}
        if "num_workers" in options:
            assert worker_ids == {0, 1}
            assert (pids == {os.getpid()}) == (options.get("worker_type") == "thread")
        else:
            assert worker_ids == {-1} and pids == {os.getpid()}
    loader._iterator = None  # what Lightning does at the end of fit: persistent workers stop


@pytest.mark.timeout(60)
def test_setting_iterator_to_none_stops_persistent_workers(leak_guard: LeakGuard) -> None:
    loader = pipeload.DataLoader(_Witness(), batch_size=4, num_workers=2, persistent_workers=True)
    assert loader._iterator is None
    epoch = iter(loader)
    assert loader._iterator is epoch
    assert len(list(epoch)) == 3
    pids = [handle.pid for handle in epoch._workers]
    assert not any(pid_gone(pid) for pid in pids)  # persistent: alive between epochs
    loader._iterator = None
    assert loader._iterator is None
    assert wait_until(lambda: all(pid_gone(pid) for pid in pids), 5.0)
    assert len(list(loader)) == 3  # a fresh session starts on the next epoch
    with pytest.raises(ValueError, match="_iterator can only be set to None"):
        loader._iterator = iter(loader)

    running = iter(loader)  # let go mid-epoch: the epoch finishes, then its workers stop
    first = next(running)
    pids = [handle.pid for handle in running._workers]
    loader._iterator = None
    assert len([first, *running]) == 3
    assert wait_until(lambda: all(pid_gone(pid) for pid in pids), 5.0)


def test_torchs_frozen_attributes_stay_frozen() -> None:
    loader = pipeload.DataLoader(_Witness(), batch_size=2)
    for name in ("batch_size", "sampler", "dataset", "drop_last", "batch_sampler", "persistent_workers"):
        with pytest.raises(ValueError, match=f"{name} attribute should not be set after"):
            setattr(loader, name, None)
    loader.num_workers = 0  # the others may change, as with torch's
    loader.worker_init_fn = print
