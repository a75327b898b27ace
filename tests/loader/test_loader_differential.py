"""pipeload.DataLoader against torch.utils.data.DataLoader, batch for batch.

Every case builds the same loader twice, once from each module, iterates both from the same
seeds and demands identical batches (values, dtypes, shapes, container types), an identical
``len(loader)``, and identical global RNG states afterwards: the last proves both loaders drew
from the global generators in the same order and the same number of times.

The whole matrix runs inline (``num_workers=0``), with 2 and 3 fork-started worker processes,
and with 2 and 3 worker threads (compared against torch's worker processes).
"""

from __future__ import annotations

import functools
import multiprocessing
import multiprocessing.forkserver
import random
import warnings
from collections import OrderedDict, namedtuple
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass
from types import ModuleType
from typing import Any

import numpy as np
import pytest
import torch
import torch.utils.data as tud

import pipeload
from pipeload.datasets import _is_iterable_dataset

pytestmark = [
    pytest.mark.timeout(60),
    # Three workers on a two-core machine, and unsharded iterables read by several workers
    # with len() called: both libraries warn, and both warnings are expected here.
    pytest.mark.filterwarnings("ignore:This DataLoader will create:UserWarning"),
    pytest.mark.filterwarnings("ignore:Length of IterableDataset:UserWarning"),
]

SEED = 1234
LOADER_SEED = 99

# ------------------------------------------------------------------ hygiene


@pytest.fixture(autouse=True)
def nothing_outlives_the_test(leak_guard: Any) -> Iterator[None]:
    """No worker process, thread, fd or /dev/shm entry started by a test may outlive it
    (tests/conftest.py's ``leak_guard`` checks, at teardown)."""
    yield


# ------------------------------------------------------------------ exact comparison


def assert_identical(mine: Any, theirs: Any, where: str = "batch") -> None:
    """Same container types all the way down, same dtypes and shapes, same values."""
    assert type(mine) is type(theirs), f"{where}: {type(mine).__name__} != {type(theirs).__name__}"
    if isinstance(theirs, torch.Tensor):
        assert mine.dtype == theirs.dtype, f"{where}: dtype {mine.dtype} != {theirs.dtype}"
        assert mine.shape == theirs.shape, f"{where}: shape {tuple(mine.shape)} != {tuple(theirs.shape)}"
        assert torch.equal(mine, theirs), f"{where}: {mine} != {theirs}"
    elif isinstance(theirs, np.ndarray):
        assert mine.dtype == theirs.dtype and mine.shape == theirs.shape, where
        assert np.array_equal(mine, theirs), f"{where}: {mine} != {theirs}"
    elif isinstance(theirs, Mapping):
        assert list(mine) == list(theirs), f"{where}: keys {list(mine)} != {list(theirs)}"
        for key in theirs:
            assert_identical(mine[key], theirs[key], f"{where}[{key!r}]")
    elif isinstance(theirs, (list, tuple)):
        assert len(mine) == len(theirs), f"{where}: length {len(mine)} != {len(theirs)}"
        for position, (a, b) in enumerate(zip(mine, theirs, strict=True)):
            assert_identical(a, b, f"{where}[{position}]")
    else:
        assert mine == theirs, f"{where}: {mine!r} != {theirs!r}"
    if isinstance(theirs, (dict, list)) and hasattr(theirs, "__dict__"):
        assert vars(mine) == vars(theirs), f"{where}: attributes {vars(mine)} != {vars(theirs)}"


# ------------------------------------------------------------------ datasets (module level: picklable)

Point = namedtuple("Point", ["x", "y"])


class RichSamples:
    """Duck-typed map-style dataset whose samples nest every kind of leaf collate knows."""

    def __init__(self, size: int) -> None:
        self.size = size

    def __len__(self) -> int:
        return self.size

    def __getitem__(self, index: int) -> dict[str, Any]:
        i = int(index)
        return {
            "tensor": torch.arange(3) + i,
            "half": torch.full((2, 2), i / 4, dtype=torch.float16),
            "array": np.arange(2, dtype=np.float32) * i,
            "np_scalar": np.int16(i),
            "int": i,
            "float": i / 3,
            "bool": i % 2 == 0,
            "str": f"item-{i}",
            "point": Point(torch.tensor(i), i * 2.5),
            "pair": (i, f"{i}"),
            "list": [np.float64(i), torch.tensor([i, -i])],
            "ordered": OrderedDict([("b", i), ("a", np.array([i], dtype=np.uint8))]),
        }


class BatchFetchRecorder:
    """Map-style dataset with ``__getitems__``: each sample carries the indices of the call that
    fetched it, so a batch proves whether one call received the whole batch."""

    def __init__(self, size: int) -> None:
        self.size = size

    def __len__(self) -> int:
        return self.size

    def __getitem__(self, index: int) -> dict[str, Any]:
        return {"index": int(index), "fetched_with": torch.tensor([-1])}

    def __getitems__(self, indices: list[int]) -> list[dict[str, Any]]:
        call = torch.tensor(list(indices))
        return [{"index": int(i), "fetched_with": call.clone()} for i in indices]


class _CountingStreamBody:
    """Yields ``(tensor(i), {"name": str, "square": np.int64})`` for i in [start, stop)."""

    def __init__(self, start: int, stop: int) -> None:
        self.start = start
        self.stop = stop

    def __iter__(self) -> Iterator[Any]:
        for i in range(self.start, self.stop):
            yield torch.tensor(i), {"name": f"n{i}", "square": np.int64(i * i)}


class TorchStream(_CountingStreamBody, tud.IterableDataset):
    pass


class PipeStream(_CountingStreamBody, pipeload.IterableDataset):
    pass


class _SizedStreamBody(_CountingStreamBody):
    def __len__(self) -> int:
        return self.stop - self.start


class TorchSizedStream(_SizedStreamBody, tud.IterableDataset):
    pass


class PipeSizedStream(_SizedStreamBody, pipeload.IterableDataset):
    pass


def _worker_info() -> Any:
    """The worker info of whichever library runs this code (None in the main process)."""
    return pipeload.get_worker_info() or tud.get_worker_info()


def uneven_shard(total: int, worker_id: int, num_workers: int) -> range:
    """Worker w's contiguous shard; shards grow quadratically, so their sizes all differ."""
    cut = [total * w * w // (num_workers * num_workers) for w in range(num_workers + 1)]
    return range(cut[worker_id], cut[worker_id + 1])


class _ShardedStreamBody:
    """Each worker reads its own uneven shard of ``range(total)``; the main process reads all."""

    def __init__(self, total: int) -> None:
        self.total = total

    def __iter__(self) -> Iterator[Any]:
        info = _worker_info()
        shard = range(self.total) if info is None else uneven_shard(self.total, info.id, info.num_workers)
        for i in shard:
            yield {"x": torch.tensor([i, i * 10]), "tag": f"s{i}"}


class TorchShardedStream(_ShardedStreamBody, tud.IterableDataset):
    pass


class PipeShardedStream(_ShardedStreamBody, pipeload.IterableDataset):
    pass


class TorchShardedOnlyByTorch(tud.IterableDataset):
    """Shards with ``torch.utils.data.get_worker_info()`` only, as torch's documentation and many
    third-party datasets do: handed to pipeload unchanged, it must still be read once, not once
    per worker."""

    def __iter__(self) -> Iterator[int]:
        info = tud.get_worker_info()
        if info is None:
            return iter(range(11))
        return iter(range(info.id, 11, info.num_workers))


class _SelfIteratingBody:
    """An iterable that is its own iterator: its cursor lives on the dataset object, so every
    worker needs its own replica of it (torch's workers each get one)."""

    def __init__(self, stop: int) -> None:
        self.stop = stop
        self.cursor = 0

    def __iter__(self) -> Any:
        self.cursor = 0
        return self

    def __next__(self) -> int:
        if self.cursor >= self.stop:
            raise StopIteration
        self.cursor += 1
        return self.cursor


class TorchSelfIterating(_SelfIteratingBody, tud.IterableDataset):
    pass


class PipeSelfIterating(_SelfIteratingBody, pipeload.IterableDataset):
    pass


class TaggedDict(dict):
    """A dict subclass with state of its own: collate must keep both the type and the state."""

    def __init__(self, *args: Any, tag: str = "", **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.tag = tag


class TaggedList(list):
    def __init__(self, items: Any = (), tag: str = "") -> None:
        super().__init__(items)
        self.tag = tag


class FrozenMap(Mapping):
    """A read-only mapping that can be rebuilt from a dict."""

    def __init__(self, data: dict[str, Any]) -> None:
        self._data = dict(data)

    def __getitem__(self, key: str) -> Any:
        return self._data[key]

    def __iter__(self) -> Iterator[str]:
        return iter(self._data)

    def __len__(self) -> int:
        return len(self._data)


class LeafZoo:
    """Samples with unusual leaves and containers: numpy scalar kinds, empty and 0-d tensors,
    user mapping and sequence types."""

    def __len__(self) -> int:
        return 7

    def __getitem__(self, index: int) -> Any:
        i = int(index)
        return TaggedDict(
            {
                "bool_": np.bool_(i % 2),
                "f64": np.float64(i / 7),
                "u8": np.uint8(i),
                "c64": np.complex64(i + 1j),
                "zero_d": torch.tensor(i * 1.5),
                "empty": torch.zeros(0, 3),
                "u8_tensor": torch.tensor([i, 255 - i], dtype=torch.uint8),
                "bool_tensor": torch.tensor([i > 3]),
                "tagged_list": TaggedList([i, float(i)], tag="L"),
                "frozen": FrozenMap({"k": np.array([i, i], dtype=np.int32)}),
                "int_keys": {1: i, 0: f"{i}"},
                "bytes": bytes([65 + i]),
            },
            tag="D",
        )


class UnbatchedOddities:
    """Leaves that default_convert must hand back as they are (used without batching only)."""

    def __len__(self) -> int:
        return 3

    def __getitem__(self, index: int) -> Any:
        return {
            "text_array": np.array(["a", "bc"][: index + 1]),
            "object_array": np.array([index, "x"], dtype=object),
            "np_str": np.str_(f"s{index}"),
            "bytes": b"xy",
            "none": None,
            "array": np.arange(index + 1, dtype=np.int8),
            "tagged": TaggedList([np.float32(index)], tag="T"),
            "tuple": (np.int32(index), "t"),
        }


STREAM = {tud: TorchStream, pipeload: PipeStream}
SELF_ITERATING = {tud: TorchSelfIterating, pipeload: PipeSelfIterating}
SIZED_STREAM = {tud: TorchSizedStream, pipeload: PipeSizedStream}
SHARDED_STREAM = {tud: TorchShardedStream, pipeload: PipeShardedStream}


class GlobalRandomSamples:
    """Draws from the global torch, random and numpy generators in every ``__getitem__``."""

    def __len__(self) -> int:
        return 12

    def __getitem__(self, index: int) -> dict[str, Any]:
        return {"index": index, "torch": torch.rand(2), "python": random.random(), "numpy": np.random.rand()}


class WorkerRandomSamples:
    """Draws from ``get_worker_info().rng`` in a pipeload thread worker, else from the globals."""

    def __len__(self) -> int:
        return 12

    def __getitem__(self, index: int) -> dict[str, Any]:
        info = pipeload.get_worker_info()
        rng = None if info is None else info.rng
        if rng is None:
            return GlobalRandomSamples()[index]
        return {
            "index": index,
            "torch": torch.rand(2, generator=rng.torch_generator),
            "python": rng.random_generator.random(),
            "numpy": rng.numpy_generator.rand(),
        }


class _RandomStreamBody:
    """An iterable whose samples come from the global generators of the worker that reads it."""

    def __iter__(self) -> Iterator[Any]:
        for _ in range(5):
            yield torch.randint(0, 1000, (1,)), random.randint(0, 1000), np.random.randint(0, 1000)


class TorchRandomStream(_RandomStreamBody, tud.IterableDataset):
    pass


class PipeRandomStream(_RandomStreamBody, pipeload.IterableDataset):
    pass


class WhoAmI:
    """Reports the worker info of the worker that fetched each sample."""

    def __len__(self) -> int:
        return 9

    def __getitem__(self, index: int) -> tuple[int, int, str, bool]:
        info = _worker_info()
        return info.id, info.num_workers, str(info.seed), info.dataset is not None


# ------------------------------------------------------------------ running both loaders


def seed_everything(seed: int) -> None:
    torch.manual_seed(seed)
    random.seed(seed)
    np.random.seed(seed)


def gen(seed: int = LOADER_SEED) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


@dataclass
class Run:
    """What one loader produced, and the global RNG draws taken right after it finished."""

    length: tuple[str, Any]
    batches: list[Any]
    rng_after: tuple[Any, ...]


Builder = Callable[[ModuleType], tuple[Any, dict[str, Any]]]


def worker_kwargs(num_workers: int, worker_type: str, context: str = "fork") -> dict[str, Any]:
    if num_workers == 0:
        return {}
    if worker_type == "thread":
        return {"num_workers": num_workers, "worker_type": "thread"}
    return {"num_workers": num_workers, "multiprocessing_context": context}


def length_of(loader: Any) -> tuple[str, Any]:
    try:
        return ("len", len(loader))
    except Exception as exc:  # an iterable without __len__: the exception type must match
        return ("raises", type(exc))


def move_to_private_memory(value: Any) -> None:
    """Give every tensor in ``value`` a private copy of its data, in place.

    Containers keep their exact types, while the loader's shared-memory segments (an fd each)
    are released as soon as the loader lets go of them: a kept result (a cached reference, or
    the locals of a failed assertion) then holds no fd for the leak check to blame."""
    if isinstance(value, torch.Tensor):
        value.set_(value.clone())
    elif isinstance(value, Mapping):
        for item in value.values():
            move_to_private_memory(item)
    elif isinstance(value, (list, tuple)):
        for item in value:
            move_to_private_memory(item)


def run(module: ModuleType, build: Builder, extra: dict[str, Any]) -> Run:
    seed_everything(SEED)
    dataset, kwargs = build(module)
    loader = module.DataLoader(dataset, **kwargs, **extra)
    length = length_of(loader)
    batches = list(loader)
    rng_after = (torch.rand(1), random.random(), np.random.rand())
    move_to_private_memory(batches)
    return Run(length, batches, rng_after)


def assert_same_run(mine: Run, theirs: Run) -> None:
    assert mine.length == theirs.length
    assert len(mine.batches) == len(theirs.batches), (
        f"{len(mine.batches)} batches, torch gave {len(theirs.batches)}"
    )
    for number, (a, b) in enumerate(zip(mine.batches, theirs.batches, strict=True)):
        assert_identical(a, b, f"batch {number}")
    assert_identical(mine.rng_after, theirs.rng_after, "global RNG draws after the epoch")


def compare(build: Builder, num_workers: int, worker_type: str = "process", context: str = "fork") -> Run:
    """pipeload with (num_workers, worker_type) against torch's process workers; returns torch's run."""
    theirs = run(tud, build, worker_kwargs(num_workers, "process", context))
    mine = run(pipeload, build, worker_kwargs(num_workers, worker_type, context))
    assert_same_run(mine, theirs)
    return theirs


# ------------------------------------------------------------------ the matrix

SIZE = 10


def tensors(m: ModuleType) -> Any:
    return m.TensorDataset(torch.arange(SIZE), torch.arange(SIZE, dtype=torch.float32).mul(0.5).view(SIZE, 1))


def concat(m: ModuleType) -> Any:
    return m.ConcatDataset([m.TensorDataset(torch.arange(4)), m.TensorDataset(torch.arange(100, 106))])


def subset(m: ModuleType) -> Any:
    return m.Subset(tensors(m), [9, 2, 5, 5, 0, 7, 3])


def stack_tuple(m: ModuleType) -> Any:
    return m.StackDataset(tensors(m), RichSamples(SIZE))


def stack_dict(m: ModuleType) -> Any:
    return m.StackDataset(numbers=tensors(m), rich=RichSamples(SIZE))


WEIGHTS = [0.5, 3.0, 0.1, 1.0, 2.0, 0.0, 4.0, 1.5, 0.2, 1.0]

CASES: dict[str, Builder] = {
    # datasets x batch size x shuffle (global seed, explicit generator) x drop_last
    "tensor-seq-b1": lambda m: (tensors(m), {"batch_size": 1}),
    "tensor-seq-b3": lambda m: (tensors(m), {"batch_size": 3}),
    "tensor-seq-b3-drop": lambda m: (tensors(m), {"batch_size": 3, "drop_last": True}),
    "tensor-seq-none": lambda m: (tensors(m), {"batch_size": None}),
    "tensor-shuffle-global-b1": lambda m: (tensors(m), {"batch_size": 1, "shuffle": True}),
    "tensor-shuffle-global-b3": lambda m: (tensors(m), {"batch_size": 3, "shuffle": True}),
    "tensor-shuffle-gen-b3-drop": lambda m: (tensors(m), {"batch_size": 3, "shuffle": True, "drop_last": True, "generator": gen()}),
    "tensor-shuffle-gen-none": lambda m: (tensors(m), {"batch_size": None, "shuffle": True, "generator": gen()}),
    "tensor-seq-loader-gen-b3": lambda m: (tensors(m), {"batch_size": 3, "generator": gen()}),
    "concat-shuffle-gen-b3": lambda m: (concat(m), {"batch_size": 3, "shuffle": True, "generator": gen()}),
    "concat-seq-none": lambda m: (concat(m), {"batch_size": None}),
    "subset-shuffle-global-b3-drop": lambda m: (subset(m), {"batch_size": 3, "shuffle": True, "drop_last": True}),
    "subset-seq-b1": lambda m: (subset(m), {"batch_size": 1}),
    "stack-tuple-b3": lambda m: (stack_tuple(m), {"batch_size": 3}),
    "stack-dict-shuffle-gen-b3": lambda m: (stack_dict(m), {"batch_size": 3, "shuffle": True, "generator": gen()}),
    "stack-dict-none": lambda m: (stack_dict(m), {"batch_size": None}),
    "rich-b1": lambda m: (RichSamples(SIZE), {"batch_size": 1}),
    "rich-shuffle-global-b3-drop": lambda m: (RichSamples(SIZE), {"batch_size": 3, "shuffle": True, "drop_last": True}),
    "rich-none": lambda m: (RichSamples(SIZE), {"batch_size": None}),
    "rich-shuffle-gen-none": lambda m: (RichSamples(SIZE), {"batch_size": None, "shuffle": True, "generator": gen()}),
    "getitems-b3": lambda m: (BatchFetchRecorder(SIZE), {"batch_size": 3}),
    "getitems-shuffle-gen-b3-drop": lambda m: (BatchFetchRecorder(SIZE), {"batch_size": 3, "shuffle": True, "drop_last": True, "generator": gen()}),
    "getitems-none": lambda m: (BatchFetchRecorder(SIZE), {"batch_size": None}),
    "python-list-b3": lambda m: ([f"word{i}" for i in range(7)], {"batch_size": 3, "shuffle": True}),
    "raw-tensor-shuffle-gen-b3": lambda m: (torch.arange(20).view(10, 2), {"batch_size": 3, "shuffle": True, "generator": gen()}),
    "dict-dataset-string-keys-b2": lambda m: ({k: np.float32(len(k)) for k in ("a", "bb", "ccc")}, {"batch_size": 2, "sampler": ["ccc", "a", "bb"]}),
    "leaf-zoo-b3": lambda m: (LeafZoo(), {"batch_size": 3, "shuffle": True}),
    "leaf-zoo-none": lambda m: (LeafZoo(), {"batch_size": None}),
    "unbatched-oddities-none": lambda m: (UnbatchedOddities(), {"batch_size": None}),
    "subset-of-getitems-b3": lambda m: (m.Subset(BatchFetchRecorder(SIZE), [7, 1, 4, 4, 9]), {"batch_size": 3}),
    "concat-negative-indices-b2": lambda m: (concat(m), {"batch_size": 2, "sampler": [-1, -10, 0, -4, 3]}),
    "numpy-index-sampler-b3": lambda m: (tensors(m), {"batch_size": 3, "sampler": np.array([4, 0, 9, 2])}),
    # every sampler
    "sampler-sequential-b3": lambda m: (tensors(m), {"batch_size": 3, "sampler": m.SequentialSampler(range(SIZE))}),
    "sampler-random-global-b3": lambda m: (tensors(m), {"batch_size": 3, "sampler": m.RandomSampler(range(SIZE))}),
    "sampler-random-gen-b1": lambda m: (tensors(m), {"batch_size": 1, "sampler": m.RandomSampler(range(SIZE), generator=gen())}),
    "sampler-random-replacement-gen-b3": lambda m: (
        tensors(m), {"batch_size": 3, "sampler": m.RandomSampler(range(SIZE), replacement=True, num_samples=13, generator=gen())}),
    "sampler-random-replacement-global-none": lambda m: (
        tensors(m), {"batch_size": None, "sampler": m.RandomSampler(range(SIZE), replacement=True, num_samples=7)}),
    "sampler-random-more-samples-global-b3-drop": lambda m: (
        tensors(m), {"batch_size": 3, "drop_last": True, "sampler": m.RandomSampler(range(SIZE), num_samples=23)}),
    "sampler-random-fewer-samples-gen-b3": lambda m: (
        RichSamples(SIZE), {"batch_size": 3, "sampler": m.RandomSampler(range(SIZE), num_samples=4, generator=gen())}),
    "sampler-subset-random-gen-b3": lambda m: (
        tensors(m), {"batch_size": 3, "sampler": m.SubsetRandomSampler([8, 1, 4, 6, 2], generator=gen())}),
    "sampler-subset-random-global-none": lambda m: (
        RichSamples(SIZE), {"batch_size": None, "sampler": m.SubsetRandomSampler([8, 1, 4, 6, 2])}),
    "sampler-weighted-replacement-gen-b3": lambda m: (
        tensors(m), {"batch_size": 3, "sampler": m.WeightedRandomSampler(WEIGHTS, 12, generator=gen())}),
    "sampler-weighted-no-replacement-global-b1": lambda m: (
        tensors(m), {"batch_size": 1, "sampler": m.WeightedRandomSampler(WEIGHTS, 6, replacement=False)}),
    "sampler-plain-list-b3": lambda m: (tensors(m), {"batch_size": 3, "sampler": [5, 3, 3, 1, 8]}),
    "batch-sampler-random-gen": lambda m: (
        tensors(m), {"batch_sampler": m.BatchSampler(m.RandomSampler(range(SIZE), generator=gen()), 4, False)}),
    "batch-sampler-sequential-drop": lambda m: (
        RichSamples(SIZE), {"batch_sampler": m.BatchSampler(m.SequentialSampler(range(SIZE)), 4, True)}),
    "batch-sampler-global-random": lambda m: (
        BatchFetchRecorder(SIZE), {"batch_sampler": m.BatchSampler(m.RandomSampler(range(SIZE)), 3, False)}),
    "batch-sampler-plain-lists": lambda m: (tensors(m), {"batch_sampler": [[3, 1], [0], [9, 8, 7], [2, 2]]}),
    "distributed-shuffle-b2": lambda m: (
        tensors(m), {"batch_size": 2, "sampler": m.DistributedSampler(range(SIZE), num_replicas=3, rank=1, seed=5)}),
    "distributed-sequential-drop-b1": lambda m: (
        RichSamples(SIZE),
        {"batch_size": 1, "sampler": m.DistributedSampler(range(SIZE), num_replicas=4, rank=3, shuffle=False, drop_last=True)}),
    # iterable-style datasets
    "stream-b1": lambda m: (STREAM[m](0, 7), {"batch_size": 1}),
    "stream-b3": lambda m: (STREAM[m](0, 7), {"batch_size": 3}),
    "stream-b3-drop": lambda m: (STREAM[m](0, 7), {"batch_size": 3, "drop_last": True}),
    "stream-none": lambda m: (STREAM[m](0, 5), {"batch_size": None}),
    "sized-stream-b3-drop-gen": lambda m: (SIZED_STREAM[m](3, 11), {"batch_size": 3, "drop_last": True, "generator": gen()}),
    "chain-b2": lambda m: (m.ChainDataset([STREAM[m](0, 3), STREAM[m](50, 54)]), {"batch_size": 2}),
    "chain-sized-none": lambda m: (m.ChainDataset([SIZED_STREAM[m](0, 3), SIZED_STREAM[m](7, 9)]), {"batch_size": None}),
    "self-iterating-b2": lambda m: (SELF_ITERATING[m](5), {"batch_size": 2}),
    # torch's objects handed to pipeload's DataLoader (and, in the torch run, to torch's)
    "torch-objects-random-sampler": lambda m: (
        tud.StackDataset(tud.TensorDataset(torch.arange(SIZE)), RichSamples(SIZE)),
        {"batch_size": 3, "sampler": tud.RandomSampler(range(SIZE), generator=gen())}),
    "torch-objects-batch-sampler": lambda m: (
        tud.Subset(tensors(tud), list(range(SIZE))),
        {"batch_sampler": tud.BatchSampler(tud.WeightedRandomSampler(WEIGHTS, 9), 2, True)}),
    "torch-objects-chain": lambda m: (tud.ChainDataset([TorchStream(0, 4), TorchSizedStream(9, 12)]), {"batch_size": 3}),
    "torch-sharded-by-torch-worker-info-b2": lambda m: (TorchShardedOnlyByTorch(), {"batch_size": 2}),
    # pipeload's objects handed to torch's DataLoader (and, in the pipeload run, to pipeload's)
    "pipeload-objects-subset-random": lambda m: (
        pipeload.ConcatDataset([pipeload.TensorDataset(torch.arange(5), torch.zeros(5, 1)), tensors(pipeload)]),
        {"batch_size": 4, "sampler": pipeload.SubsetRandomSampler(list(range(15)), generator=gen())}),
    "pipeload-objects-batch-sampler": lambda m: (
        pipeload.StackDataset(a=tensors(pipeload), b=BatchFetchRecorder(SIZE)),
        {"batch_sampler": pipeload.BatchSampler(pipeload.DistributedSampler(range(SIZE), 2, 0, seed=3), 2, False)}),
    "pipeload-objects-chain": lambda m: (
        pipeload.ChainDataset([PipeStream(0, 2), PipeSizedStream(5, 9)]), {"batch_size": None}),
}

CASE_IDS = list(CASES)


@functools.cache
def torch_reference(case: str, num_workers: int) -> Run:
    """torch's run of a matrix case. Deterministic (every run starts from SEED), so the thread
    tests reuse what the process tests computed instead of starting torch's workers again."""
    return run(tud, CASES[case], worker_kwargs(num_workers, "process"))


# Three workers (uneven turns) for every case is the slow suite's; the fast one keeps 0 and 2 here
# and three workers in the sharding and RNG tests below.
@pytest.mark.parametrize("num_workers", [0, 2, pytest.param(3, marks=pytest.mark.slow)])
@pytest.mark.parametrize("case", CASE_IDS)
def test_process_workers_match_torch(case: str, num_workers: int) -> None:
    mine = run(pipeload, CASES[case], worker_kwargs(num_workers, "process"))
    assert_same_run(mine, torch_reference(case, num_workers))


# torch.utils.data.get_worker_info() reads one per-process variable, so it cannot tell thread
# workers apart; datasets meant for thread workers use pipeload.get_worker_info() (README).
THREAD_CASE_IDS = [c for c in CASE_IDS if c != "torch-sharded-by-torch-worker-info-b2"]


@pytest.mark.parametrize("num_workers", [2, pytest.param(3, marks=pytest.mark.slow)])
@pytest.mark.parametrize("case", THREAD_CASE_IDS)
def test_thread_workers_match_torch_processes(case: str, num_workers: int) -> None:
    mine = run(pipeload, CASES[case], worker_kwargs(num_workers, "thread"))
    assert_same_run(mine, torch_reference(case, num_workers))


def _records_its_fetches(dataset: Any) -> bool:
    """Whether ``dataset`` is, or wraps, a BatchFetchRecorder."""
    if isinstance(dataset, BatchFetchRecorder):
        return True
    parts = getattr(dataset, "datasets", ())  # a StackDataset's may be a dict
    inner = [getattr(dataset, "dataset", None), *(parts.values() if isinstance(parts, Mapping) else parts)]
    return any(_records_its_fetches(d) for d in inner if d is not None)


# Economic mode takes map-style datasets only, and calls __getitems__ on sub-batches (one per
# item worker) rather than on whole batches: BatchFetchRecorder reports what each call got.
ECONOMIC_CASE_IDS = [
    c for c in CASE_IDS
    if not _is_iterable_dataset(CASES[c](tud)[0]) and not _records_its_fetches(CASES[c](tud)[0])
]


@pytest.mark.parametrize("worker_type", ["process", "thread"])
@pytest.mark.parametrize("case", ECONOMIC_CASE_IDS)
def test_economic_mode_matches_torch(case: str, worker_type: str) -> None:
    kwargs = {**worker_kwargs(2, worker_type), "mode": "economic"}
    mine = run(pipeload, CASES[case], kwargs)
    assert_same_run(mine, torch_reference(case, 2))


# ------------------------------------------------------------------ __getitems__ and default_convert


@pytest.mark.parametrize(("num_workers", "worker_type"), [(0, "process"), (2, "process"), (2, "thread")])
def test_getitems_receives_each_batch_whole(num_workers: int, worker_type: str) -> None:
    build: Builder = lambda m: (BatchFetchRecorder(SIZE), {"batch_size": 4, "shuffle": True})  # noqa: E731
    theirs = compare(build, num_workers, worker_type)
    assert len(theirs.batches) == 3
    for batch in theirs.batches:  # pipeload's are identical; check what that means, once
        for row in batch["fetched_with"]:
            assert row.tolist() == batch["index"].tolist()


def test_getitems_is_not_called_without_batching() -> None:
    theirs = compare(lambda m: (BatchFetchRecorder(4), {"batch_size": None}), 0)
    assert all(batch["fetched_with"].tolist() == [-1] for batch in theirs.batches)


def test_unbatched_samples_go_through_default_convert() -> None:
    loader = pipeload.DataLoader(RichSamples(2), batch_size=None)
    sample = next(iter(loader))
    assert isinstance(sample["array"], torch.Tensor) and sample["array"].dtype == torch.float32
    assert isinstance(sample["np_scalar"], torch.Tensor) and sample["np_scalar"].dtype == torch.int16
    assert isinstance(sample["pair"], list)  # tuples become lists, as in torch
    assert isinstance(sample["point"], Point)
    assert type(sample["ordered"]) is OrderedDict and isinstance(sample["ordered"]["a"], torch.Tensor)
    assert sample["str"] == "item-0" and sample["int"] == 0 and type(sample["int"]) is int


# ------------------------------------------------------------------ randomness inside datasets

# Worker seeds come from the global RNG, or from the loader's generator when one is given.
RANDOM_LOADERS: dict[str, Callable[[], dict[str, Any]]] = {
    "sequential": lambda: {"batch_size": 3},
    "shuffle-global": lambda: {"batch_size": 3, "shuffle": True},
    "shuffle-gen": lambda: {"batch_size": 2, "shuffle": True, "generator": gen(7)},
}


@pytest.mark.parametrize("num_workers", [0, 2, 3])
@pytest.mark.parametrize("loader", list(RANDOM_LOADERS))
def test_global_rng_draws_in_process_workers_match_torch(loader: str, num_workers: int) -> None:
    theirs = compare(lambda m: (GlobalRandomSamples(), RANDOM_LOADERS[loader]()), num_workers, "process")
    if num_workers:  # sanity: workers 0 and 1 (batches 0 and 1) are seeded differently
        assert float(theirs.batches[0]["python"][0]) != float(theirs.batches[1]["python"][0])


def test_global_rng_draws_in_iterable_process_workers_match_torch() -> None:
    compare(lambda m: ({tud: TorchRandomStream, pipeload: PipeRandomStream}[m](), {"batch_size": 2}), 2)


@pytest.fixture
def preloaded_forkserver() -> Iterator[None]:
    """A forkserver that has imported torch already (so the test is quick), stopped afterwards
    so that it outlives neither this test nor its preload setting."""
    server = multiprocessing.forkserver._forkserver
    saved = list(server._preload_modules)
    server._stop()
    multiprocessing.set_forkserver_preload(["torch", "numpy", "pipeload"])
    yield
    server._stop()
    multiprocessing.set_forkserver_preload(saved)


@pytest.mark.timeout(90)
def test_global_rng_draws_in_forkserver_workers_match_torch(preloaded_forkserver: None) -> None:
    # These workers receive their setup by pickle, not by inheriting the parent's memory.
    compare(lambda m: (GlobalRandomSamples(), {"batch_size": 4, "shuffle": True}), 2, "process", "forkserver")


@pytest.mark.parametrize("num_workers", [2, 3])
@pytest.mark.parametrize("loader", list(RANDOM_LOADERS))
def test_thread_worker_rng_matches_torch_process_globals(loader: str, num_workers: int) -> None:
    compare(lambda m: (WorkerRandomSamples(), RANDOM_LOADERS[loader]()), num_workers, "thread")


class DescribeRng:
    def __len__(self) -> int:
        return 4

    def __getitem__(self, index: int) -> tuple[str, ...]:
        rng = pipeload.get_worker_info().rng
        parts = (rng.random_generator, rng.torch_generator, rng.numpy_generator)
        return (type(rng).__name__, *(f"{type(p).__module__}.{type(p).__name__}" for p in parts))


def test_thread_worker_rng_has_the_three_generators() -> None:
    loader = pipeload.DataLoader(DescribeRng(), batch_size=None, num_workers=2, worker_type="thread")
    described = set(map(tuple, loader))
    assert described == {("WorkerRNG", "random.Random", "torch._C.Generator", "numpy.random.mtrand.RandomState")}


@pytest.mark.parametrize("worker_type", ["process", "thread"])
def test_worker_info_ids_and_seeds_match_torch(worker_type: str) -> None:
    compare(lambda m: (WhoAmI(), {"batch_size": 2, "generator": gen(5)}), 3, worker_type)


# ------------------------------------------------------------------ sharded iterables


SHARDED_BATCHING = [(1, False), (3, False), (3, True), (2, True), (None, False)]


@pytest.mark.parametrize(("batch_size", "drop_last"), SHARDED_BATCHING)
@pytest.mark.parametrize(("num_workers", "worker_type"), [(0, "process"), (2, "process"), (3, "process"), (2, "thread"), (3, "thread")])
def test_unevenly_sharded_iterable_matches_torch(
    num_workers: int, worker_type: str, batch_size: int | None, drop_last: bool
) -> None:
    build: Builder = lambda m: (SHARDED_STREAM[m](23), {"batch_size": batch_size, "drop_last": drop_last})  # noqa: E731
    theirs = compare(build, num_workers, worker_type)
    if num_workers == 0:
        return
    sizes = [len(uneven_shard(23, w, num_workers)) for w in range(num_workers)]
    assert len(set(sizes)) == num_workers  # the shards really are uneven
    if not drop_last:
        seen = sorted(int(i) for b in theirs.batches for i in b["x"][..., 0].reshape(-1))
        assert seen == list(range(23))


@pytest.mark.parametrize("worker_type", ["process", "thread"])
@pytest.mark.parametrize(("batch_size", "drop_last"), [(2, False), (2, True)])
def test_iterable_with_an_empty_shard_matches_torch(batch_size: int, drop_last: bool, worker_type: str) -> None:
    # 4 samples over 3 workers: worker 0's shard is empty, worker 1 has one sample, worker 2 three.
    assert [len(uneven_shard(4, w, 3)) for w in range(3)] == [0, 1, 3]
    build: Builder = lambda m: (SHARDED_STREAM[m](4), {"batch_size": batch_size, "drop_last": drop_last})  # noqa: E731
    compare(build, 3, worker_type)


EPOCH_CASES: dict[str, Builder] = {
    "random-map-shuffle": lambda m: (GlobalRandomSamples(), {"batch_size": 5, "shuffle": True}),
    "random-map-shuffle-gen": lambda m: (GlobalRandomSamples(), {"batch_size": 5, "shuffle": True, "generator": gen(3)}),
    "sharded-iterable-drop": lambda m: (SHARDED_STREAM[m](11), {"batch_size": 2, "drop_last": True}),
    "random-iterable": lambda m: ({tud: TorchRandomStream, pipeload: PipeRandomStream}[m](), {"batch_size": 3}),
}


def three_epochs(module: ModuleType, build: Builder, persistent: bool) -> list[Any]:
    """Three epochs of one loader, then a draw from each global RNG."""
    seed_everything(SEED)
    dataset, kwargs = build(module)
    loader = module.DataLoader(
        dataset, num_workers=2, multiprocessing_context="fork", persistent_workers=persistent, **kwargs
    )
    epochs: list[Any] = [list(loader) for _ in range(3)]
    move_to_private_memory(epochs)
    return [*epochs, (torch.rand(1), random.random(), np.random.rand())]


@pytest.mark.parametrize("persistent", [False, True], ids=["fresh-workers", "persistent-workers"])
@pytest.mark.parametrize("case", list(EPOCH_CASES))
def test_several_epochs_match_torch(case: str, persistent: bool) -> None:
    # Persistent workers draw one base seed for the loader's life and keep their RNG state from
    # epoch to epoch; fresh workers are seeded anew every epoch.
    assert_identical(three_epochs(pipeload, EPOCH_CASES[case], persistent), three_epochs(tud, EPOCH_CASES[case], persistent))


def epochs_left_early(module: ModuleType, worker_type: str, stops: tuple[int | None, ...]) -> list[Any]:
    """A persistent loader's epochs, each left after ``stop + 1`` batches (None: run through)."""
    seed_everything(SEED)
    dataset = WorkerRandomSamples() if module is pipeload else GlobalRandomSamples()
    loader = module.DataLoader(dataset, batch_size=2, shuffle=True, persistent_workers=True,
                               **worker_kwargs(2, worker_type))
    epochs: list[Any] = []
    for stop in stops:
        batches = []
        for number, batch in enumerate(loader):
            batches.append(batch)
            if number == stop:
                break
        epochs.append(batches)
    move_to_private_memory(epochs)
    return [*epochs, torch.rand(1)]


@pytest.mark.parametrize("worker_type", ["process", "thread"])
def test_random_values_after_epochs_left_early_match_torch(worker_type: str) -> None:
    # torch's workers build, and throw away, the batches an epoch left early had sent them, and
    # what those draw from a worker's generators shapes every later batch; several stops in a
    # row, so a timing-dependent count of such batches cannot match by chance.
    stops = (2, 0, None, 4, 1, None)
    assert_identical(epochs_left_early(pipeload, worker_type, stops),
                     epochs_left_early(tud, "process", stops))


PARTIAL_CASES: dict[str, Builder] = {
    "shuffle-global": lambda m: (tensors(m), {"batch_size": 2, "shuffle": True}),
    "shuffle-gen": lambda m: (tensors(m), {"batch_size": 2, "shuffle": True, "generator": gen()}),
    "weighted": lambda m: (tensors(m), {"batch_size": 2, "sampler": m.WeightedRandomSampler(WEIGHTS, 8)}),
    "subset-random-none": lambda m: (tensors(m), {"batch_size": None, "sampler": m.SubsetRandomSampler([3, 1, 2])}),
}


@pytest.mark.parametrize("num_workers", [0, 2])
@pytest.mark.parametrize("case", list(PARTIAL_CASES))
def test_rng_draws_of_an_abandoned_epoch_match_torch(case: str, num_workers: int) -> None:
    """Creating the iterator, taking one batch and dropping it leaves the globals as torch does:
    with workers, the sampler is read ahead (prefetching) at the first ``iter()``."""

    def draws(module: ModuleType) -> list[Any]:
        seed_everything(SEED)
        dataset, kwargs = PARTIAL_CASES[case](module)
        loader = module.DataLoader(dataset, **kwargs, **worker_kwargs(num_workers, "process"))
        iterator = iter(loader)
        after_iter = torch.rand(1)
        first = next(iterator)
        del iterator
        move_to_private_memory(first)
        return [after_iter, first, torch.rand(1)]

    assert_identical(draws(pipeload), draws(tud))


# ------------------------------------------------------------------ len(loader)

LEN_CASES: dict[str, Builder] = {
    "map-b1": lambda m: (tensors(m), {}),
    "map-b3": lambda m: (tensors(m), {"batch_size": 3}),
    "map-b3-drop": lambda m: (tensors(m), {"batch_size": 3, "drop_last": True}),
    "map-b4-drop": lambda m: (tensors(m), {"batch_size": 4, "drop_last": True}),
    "map-none": lambda m: (tensors(m), {"batch_size": None}),
    "map-sampler-num-samples": lambda m: (tensors(m), {"batch_size": 4, "sampler": m.RandomSampler(range(SIZE), num_samples=17)}),
    "map-batch-sampler": lambda m: (tensors(m), {"batch_sampler": m.BatchSampler(range(SIZE), 3, True)}),
    "map-distributed": lambda m: (tensors(m), {"batch_size": 2, "sampler": m.DistributedSampler(range(SIZE), 3, 2)}),
    "sized-iterable-b1": lambda m: (SIZED_STREAM[m](0, 10), {}),
    "sized-iterable-b3": lambda m: (SIZED_STREAM[m](0, 10), {"batch_size": 3}),
    "sized-iterable-b3-drop": lambda m: (SIZED_STREAM[m](0, 10), {"batch_size": 3, "drop_last": True}),
    "sized-iterable-b5-drop": lambda m: (SIZED_STREAM[m](0, 10), {"batch_size": 5, "drop_last": True}),
    "sized-iterable-none": lambda m: (SIZED_STREAM[m](0, 10), {"batch_size": None}),
    "sized-chain-b4": lambda m: (m.ChainDataset([SIZED_STREAM[m](0, 3), SIZED_STREAM[m](0, 6)]), {"batch_size": 4}),
    "unsized-iterable-b3": lambda m: (STREAM[m](0, 10), {"batch_size": 3}),
    "unsized-chain-none": lambda m: (m.ChainDataset([STREAM[m](0, 3)]), {"batch_size": None}),
}


@pytest.mark.parametrize("case", list(LEN_CASES))
def test_len_matches_torch(case: str) -> None:
    lengths = []
    for module in (pipeload, tud):
        dataset, kwargs = LEN_CASES[case](module)
        lengths.append(length_of(module.DataLoader(dataset, **kwargs)))
    assert lengths[0] == lengths[1]


@pytest.mark.parametrize("worker_type", ["process", "thread"])
def test_len_of_iterable_matches_torch_with_workers(worker_type: str) -> None:
    # len() is the dataset's length in batches, whatever the number of workers.
    build: Builder = lambda m: (SIZED_STREAM[m](0, 10), {"batch_size": 3})  # noqa: E731
    theirs = run(tud, build, worker_kwargs(2, "process"))
    mine = run(pipeload, build, worker_kwargs(2, worker_type))
    assert mine.length == theirs.length == ("len", 4)


class _ConfiguredSampler(tud.Sampler):
    """A sampler whose unknown attributes come from a config mapping: its ``__getattr__`` raises
    KeyError, not AttributeError, for a name the mapping lacks."""

    def __init__(self) -> None:
        self.config = {"count": 4}

    def __getattr__(self, name: str) -> Any:
        return self.__dict__["config"][name]

    def __iter__(self) -> Iterator[int]:
        return iter(range(self.count))

    def __len__(self) -> int:
        return self.count


@pytest.mark.parametrize("num_workers", [0, 2])
def test_a_sampler_whose_getattr_raises_keyerror_loads_as_with_torch(num_workers: int) -> None:
    # pipeload looks for hooks torch never reads (state_dict, generator, sampler): a lookup that
    # fails otherwise than with AttributeError means the hook is absent.
    def batches(module: ModuleType) -> list[list[int]]:
        loader = module.DataLoader(list(range(4)), batch_size=2, sampler=_ConfiguredSampler(),
                                   num_workers=num_workers)
        return [batch.tolist() for _ in range(2) for batch in loader]

    assert batches(pipeload) == batches(tud)


class _CountsItsLength(tud.Dataset):
    """A dataset that counts the calls to its ``__len__`` made in the main process (a worker
    counts on its own copy)."""

    def __init__(self) -> None:
        self.asked = 0

    def __len__(self) -> int:
        self.asked += 1
        return 6

    def __getitem__(self, index: int) -> int:
        return index


def _length_asked(module: ModuleType, epochs: int, **kwargs: Any) -> int:
    dataset = _CountsItsLength()
    loader = module.DataLoader(dataset, batch_size=2, **kwargs)
    for _ in range(epochs):
        for _ in loader:  # not list(loader), which asks len(loader) first
            pass
    return dataset.asked


@pytest.mark.parametrize("kwargs", [{"num_workers": 2}, {"num_workers": 2, "persistent_workers": True},
                                    {"num_workers": 1, "drop_last": True}], ids=str)
def test_a_datasets_len_is_asked_once_an_epoch_as_torch_asks_it(kwargs: dict[str, Any]) -> None:
    # A __len__ may list a store or open the file it counts in: pipeload's loader needs the
    # length in several places as an epoch starts (last batch, record, stats, draw), and asks once.
    assert _length_asked(pipeload, 3, **kwargs) == _length_asked(tud, 3, **kwargs) == 3


def test_without_workers_the_draw_asks_the_length_again_as_torch_draws() -> None:
    # torch draws at the first next(): the length drawn from is the one the dataset has then,
    # which iter(loader)'s own questions (asked once) may not be.
    assert _length_asked(pipeload, 3) == 2 * _length_asked(tud, 3) == 6


@pytest.mark.parametrize("num_workers", [0, 2])
def test_a_shuffled_datasets_len_is_asked_no_more_often_than_torch_asks_it(num_workers: int) -> None:
    # torch's RandomSampler asks it several times an epoch (its num_samples, then its draw).
    mine = _length_asked(pipeload, 3, shuffle=True, num_workers=num_workers)
    assert mine <= _length_asked(tud, 3, shuffle=True, num_workers=num_workers)
    # RandomSampler checks num_samples when built, as torch's; then once an epoch, or without
    # workers once for iter(loader) and once for the draw at the first next() (its size, its
    # num_samples and the epoch's record of the sampler's state, asked together at the draw)
    assert mine == 1 + 3 * (1 if num_workers else 2)


_BANK: list[int] = []


class _AsksASamplerOfItsBank(tud.Dataset):
    """Each item: how long a per-worker bank that grows with every item is, told by a sampler."""

    def __len__(self) -> int:
        return 8

    def __getitem__(self, index: int) -> int:
        _BANK.append(index)
        return len(list(SAMPLERS_OF[self.module](_BANK)))

    module = "pipeload"


SAMPLERS_OF = {"pipeload": pipeload.SequentialSampler, "torch": tud.SequentialSampler}


@pytest.mark.parametrize("persistent", [False, True], ids=["per-epoch", "persistent"])
def test_lengths_a_forked_worker_asks_are_its_own_as_in_torch(persistent: bool) -> None:
    # Workers forked while the loader's epoch lengths were kept inherited them for life: every
    # length a sampler asked in them came out as the first one ([[1, 1, 1, 1], ...]).
    def batches(module: ModuleType) -> list[list[list[int]]]:
        _BANK.clear()
        dataset = _AsksASamplerOfItsBank()
        dataset.module = module.__name__.split(".")[0]
        loader = module.DataLoader(dataset, batch_size=4, num_workers=1, persistent_workers=persistent,
                                   multiprocessing_context="fork")
        return [[batch.tolist() for batch in loader] for _ in range(2)]

    assert batches(pipeload) == batches(tud)


class _BatchesWithOneBad:
    """Five batches of indices, then ``bad`` (no batch of indices, or an iterator over one), then
    four more: a batch sampler with a bug in one batch, or one that yields iterators."""

    def __init__(self, bad: Callable[[], Any]) -> None:
        self.bad = bad

    def __iter__(self) -> Iterator[Any]:
        yield from ([index, index + 1] for index in range(5))
        yield self.bad()
        yield from ([index] for index in range(4))

    def __len__(self) -> int:
        return 10


def _outcomes(module: ModuleType, batch_sampler: Any, **kwargs: Any) -> list[Any]:
    """What each call of ``next`` gave: a batch as a list, or the type of the error it raised."""
    dataset = module.TensorDataset(torch.arange(8))
    iterator = iter(module.DataLoader(dataset, batch_sampler=batch_sampler, **kwargs))
    outcomes: list[Any] = []
    while True:
        try:
            (batch,) = next(iterator)
        except StopIteration:
            return outcomes
        except Exception as error:  # noqa: BLE001 - the error is the outcome compared
            outcomes.append(type(error))
            continue
        outcomes.append(batch.tolist())


@pytest.mark.parametrize("bad", ["an int", "None", "an iterator", "a map"])
@pytest.mark.parametrize("engine", [{"num_workers": 0}, {"num_workers": 2}, {"num_workers": 2, "worker_type": "thread"},
                                    {"num_workers": 2, "mode": "economic"}],
                         ids=["inline", "process", "thread", "economic"])
def test_a_batch_samplers_odd_batch_is_loaded_or_fails_in_its_turn_as_torchs(bad: str, engine: dict[str, Any]) -> None:
    # With workers, its len() was taken in the main process: an int ended the epoch after 11 of
    # 20 batches, an iterator failed where torch loads it (a skeptic's probe at stop 53).
    make = {"an int": lambda: 3, "None": lambda: None, "an iterator": lambda: iter([6, 7]),
            "a map": lambda: map(int, [6, 7])}[bad]
    expected = _outcomes(tud, _BatchesWithOneBad(make), num_workers=0)
    assert expected[5] in (TypeError, [6, 7]) and len(expected) == 10
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # economic mode's worker count on 2 CPUs
        assert _outcomes(pipeload, _BatchesWithOneBad(make), **engine) == expected


class _NumpyKinds(tud.Dataset):
    """A read-only array (``np.frombuffer`` of bytes) and a big-endian one."""

    def __len__(self) -> int:
        return 4

    def __getitem__(self, index: int) -> tuple[np.ndarray, np.ndarray]:
        return np.frombuffer(bytes(range(index, index + 8)), np.uint8), np.arange(3, dtype=">i4") + index


def _as_given(batch: list[Any]) -> list[Any]:
    return batch


@pytest.mark.parametrize("num_workers", [1, 2])
def test_numpy_arrays_from_process_workers_arrive_as_torchs_do(num_workers: int) -> None:
    # torch's worker queue pickles them with protocol 4: copied, writable, native byte order.
    # Ours kept them read-only and big-endian: `a += 1` and torch.from_numpy failed.
    def arrays(module: ModuleType) -> list[tuple[str, bool, list[int]]]:
        loader = module.DataLoader(_NumpyKinds(), batch_size=2, num_workers=num_workers,
                                   collate_fn=_as_given, multiprocessing_context="fork")
        return [(array.dtype.str, array.flags.writeable, array.tolist())
                for batch in loader for sample in batch for array in sample]
    assert arrays(pipeload) == arrays(tud)
    assert {(kind, writeable) for kind, writeable, _ in arrays(pipeload)} == {("|u1", True), ("<i4", True)}


class _MixedDtypes(tud.Dataset):
    """float32 samples, every fourth float64."""

    def __len__(self) -> int:
        return 16

    def __getitem__(self, index: int) -> torch.Tensor:
        return torch.full((3,), index + 0.1, dtype=torch.float64 if index % 4 == 3 else torch.float32)


def test_thread_workers_collate_as_torchs_worker_processes_do() -> None:
    # torch's workers stack into memory of the first sample's dtype (its shared memory): float64
    # samples among float32 ones are cast. Thread workers stacked without it, and promoted.
    theirs = tud.DataLoader(_MixedDtypes(), batch_size=4, num_workers=2, multiprocessing_context="fork")
    mine = pipeload.DataLoader(_MixedDtypes(), batch_size=4, num_workers=2, worker_type="thread")
    assert [(b.dtype, b.tolist()) for b in mine] == [(b.dtype, b.tolist()) for b in theirs]
    assert {b.dtype for b in mine} == {torch.float32}
    inline = pipeload.DataLoader(_MixedDtypes(), batch_size=4)  # without workers: torch promotes
    assert [b.dtype for b in inline] == [b.dtype for b in tud.DataLoader(_MixedDtypes(), batch_size=4)]
