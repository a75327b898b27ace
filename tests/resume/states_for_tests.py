"""Real checkpoints from every engine and mode, and what an exact resume from each gives.

Each :class:`Case` builds a loader, runs it to a checkpoint (``taken`` batches into its second
epoch, or between epochs), and takes ``state_dict()`` through JSON or ``torch.save``/``torch.load
(weights_only=True)``, as users keep them. :func:`resume` loads a state into a fresh loader
(of the case's ``resume`` options: map-style states resume alike with any engine) and gives the
rest of that epoch and the next one, every random value included.
"""

from __future__ import annotations

import io
import json
import random
import tarfile
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import torch

import pipeload
from pipeload.datapipes.iter import IterableWrapper

LENGTH = 22
BATCH = 4  # 6 batches, the last one partial


def draw() -> float:
    """A random value, as an augmentation draws it (a thread worker's own generator, else the
    process's global one); per-batch seeding makes it resume exactly."""
    info = pipeload.get_worker_info()
    if info is not None and info.rng is not None:
        return torch.rand(1, generator=info.rng.torch_generator).item()
    return torch.rand(1).item()


class Augmented(pipeload.Dataset):
    def __len__(self) -> int:
        return LENGTH

    def __getitem__(self, i: int) -> tuple[int, float]:
        return (i, draw())


class FirstSampleLate(Augmented):
    """Sample 0 takes a while, so out of order the batches after it are handed out first."""

    def __getitem__(self, i: int) -> tuple[int, float]:
        if i == 0:
            time.sleep(0.3)  # a slow sample, not a wait: nothing polls it
        return super().__getitem__(i)


class PlainStream(pipeload.IterableDataset):
    """An iterable without a state: fast-forwarded on resume."""

    def __iter__(self) -> Any:
        info = pipeload.get_worker_info()
        ids = range(LENGTH) if info is None else range(info.id, LENGTH, info.num_workers)
        return ((i, draw()) for i in ids)


class CountingStream(pipeload.IterableDataset):
    """A torchdata-style iterable: its own state_dict()/load_state_dict() on the dataset."""

    def __init__(self) -> None:
        self.start = 0

    def __iter__(self) -> Any:
        def items() -> Any:
            for i in range(self.start, LENGTH):
                self.start = i + 1
                yield (i, draw())
        return items()

    def state_dict(self) -> dict[str, Any]:
        return {"start": self.start}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.start = state["start"]


class OwnState(pipeload.Sampler[int]):
    """A user's sampler with a generator and a state of its own (no pipeload base)."""

    def __init__(self) -> None:
        self.generator = torch.Generator().manual_seed(9)

    def __iter__(self) -> Any:
        return iter(torch.randperm(LENGTH, generator=self.generator).tolist())

    def __len__(self) -> int:
        return LENGTH

    def state_dict(self) -> dict[str, Any]:
        return {"generator": self.generator.get_state().tolist()}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.generator.set_state(torch.tensor(state["generator"], dtype=torch.uint8))


def double(x: int) -> tuple[int, float]:
    return (2 * x, draw())


def member_text(member: tuple[str, Any]) -> tuple[str, float]:
    return (member[1].decode(), draw())


def write_shards(directory: Path) -> list[str]:
    paths = []
    for number, size in enumerate((5, 7, 6)):
        path = directory / f"shard-{number}.tar"
        with tarfile.open(path, "w") as archive:
            for item in range(size):
                data = f"{number}-{item}".encode()
                info = tarfile.TarInfo(f"{number:02d}{item:02d}.txt")
                info.size = len(data)
                archive.addfile(info, io.BytesIO(data))
        paths.append(str(path))
    return paths


@dataclass(frozen=True)
class Case:
    """One configuration and checkpoint position.

    Attributes:
        build: the loader, from its options (``shards``: tar paths, for the tar case).
        options: the engine options the checkpoint is taken with.
        taken: batches of the checkpoint epoch taken before it (None: between epochs).
        resume: the options an accepted state is resumed with (map-style: any engine).
        through_torch: keep the state with torch.save/torch.load(weights_only=True), else JSON.
    """

    build: Callable[..., pipeload.DataLoader]
    options: dict[str, Any] = field(default_factory=dict)
    taken: int | None = 2
    resume: dict[str, Any] | None = None
    through_torch: bool = False
    needs_shards: bool = False


def map_loader(dataset: Any = None, **options: Any) -> pipeload.DataLoader:
    options.setdefault("batch_size", BATCH)
    return pipeload.DataLoader(dataset if dataset is not None else Augmented(), worker_seeding="per_batch", **options)


def seeded_loader(**options: Any) -> pipeload.DataLoader:
    return map_loader(shuffle=True, generator=torch.Generator().manual_seed(11), **options)


def pipe_loader(**options: Any) -> pipeload.DataLoader:
    pipe = IterableWrapper(range(LENGTH)).shuffle(buffer_size=5).sharding_filter().map(double)
    return pipeload.DataLoader(pipe, batch_size=BATCH, shuffle=True, worker_seeding="per_batch", **options)


def tar_loader(shards: list[str], **options: Any) -> pipeload.DataLoader:
    pipe = IterableWrapper(shards).open_files("b").load_from_tar().map(member_text)
    return pipeload.DataLoader(pipe, batch_size=BATCH, worker_seeding="per_batch", **options)


INLINE: dict[str, Any] = {}
THREADS = {"num_workers": 2, "worker_type": "thread"}
PROCESSES = {"num_workers": 2}

CASES: dict[str, Case] = {
    "inline-global-generator": Case(lambda **o: map_loader(shuffle=True, **o)),
    "inline-own-generator-between-epochs": Case(seeded_loader, taken=None, through_torch=True),
    "processes-own-generator": Case(seeded_loader, PROCESSES, taken=3, resume=INLINE),
    "threads-persistent-between-epochs": Case(seeded_loader, {**THREADS, "persistent_workers": True},
                                              taken=None, through_torch=True),
    "threads-persistent-later-epoch": Case(seeded_loader, {**THREADS, "persistent_workers": True}, taken=1),
    "economic": Case(seeded_loader, {"num_workers": 2, "worker_type": "thread", "mode": "economic",
                                     "num_batch_workers": 1}, taken=2, resume=INLINE),
    "out-of-order": Case(lambda **o: map_loader(FirstSampleLate(), shuffle=True, **o),
                         {**THREADS, "in_order": False}, taken=1, resume=INLINE),
    "distributed-sampler": Case(lambda **o: map_loader(sampler=pipeload.DistributedSampler(
        Augmented(), num_replicas=2, rank=1, seed=3), **o), through_torch=True),
    "batch-sampler-users-sampler": Case(lambda **o: pipeload.DataLoader(
        Augmented(), batch_sampler=pipeload.BatchSampler(OwnState(), 3, False), worker_seeding="per_batch", **o)),
    "weighted-no-batching": Case(lambda **o: map_loader(sampler=pipeload.WeightedRandomSampler(
        [1.0 + i % 3 for i in range(LENGTH)], LENGTH, generator=torch.Generator().manual_seed(2)),
        batch_size=None, **o), taken=5),
    "iterable-without-state": Case(lambda **o: pipeload.DataLoader(PlainStream(), batch_size=BATCH,
                                                                   worker_seeding="per_batch", **o)),
    "iterable-own-state": Case(lambda **o: pipeload.DataLoader(CountingStream(), batch_size=BATCH,
                                                               worker_seeding="per_batch", **o), through_torch=True),
    "pipe-shuffle-inline": Case(pipe_loader),
    "pipe-shuffle-threads": Case(pipe_loader, THREADS, taken=3, through_torch=True),
    "pipe-shuffle-processes": Case(pipe_loader, PROCESSES, taken=3, resume=THREADS),
    "tar-shards": Case(tar_loader, taken=2, needs_shards=True),
}


def seed_everything(seed: int) -> None:
    torch.manual_seed(seed)
    random.seed(seed)
    np.random.seed(seed)


def loader_of(case: Case, shards: list[str] | None, options: dict[str, Any] | None = None) -> pipeload.DataLoader:
    options = dict(case.options if options is None else options)
    return case.build(shards, **options) if case.needs_shards else case.build(**options)


def as_lists(batch: Any) -> Any:
    if isinstance(batch, torch.Tensor):
        return batch.tolist()
    if isinstance(batch, (list, tuple)):
        return [as_lists(part) for part in batch]
    return batch


def epoch_of(loader: pipeload.DataLoader, epoch: int, limit: int | None = None) -> tuple[list[Any], Any]:
    if isinstance(loader.sampler, pipeload.DistributedSampler):
        loader.sampler.set_epoch(epoch)
    iterator = iter(loader)
    batches = []
    for batch in iterator:
        batches.append(as_lists(batch))
        if limit is not None and len(batches) >= limit:
            break
    return batches, iterator


def checkpoint(case: Case, shards: list[str] | None) -> dict[str, Any]:
    """The case's state, taken ``taken`` batches into epoch 1 (or between epochs 1 and 2),
    kept as a user keeps it."""
    seed_everything(0)
    loader = loader_of(case, shards)
    epoch_of(loader, 0)
    if case.taken is None:
        epoch_of(loader, 1)
    else:
        _, iterator = epoch_of(loader, 1, case.taken)
    state = loader.state_dict()
    if case.taken is not None:
        del iterator
    loader._iterator = None  # persistent workers stop now, not when the collector gets round to it
    if case.through_torch:
        buffer = io.BytesIO()
        torch.save(state, buffer)
        buffer.seek(0)
        return torch.load(buffer, weights_only=True)
    return json.loads(json.dumps(state))


def resume(case: Case, shards: list[str] | None, state: dict[str, Any],
           loader: pipeload.DataLoader | None = None) -> list[list[Any]]:
    """What a fresh loader (or ``loader``) given ``state`` yields: the rest of the checkpoint's
    epoch and the next, under the same global generators."""
    if loader is None:
        loader = loader_of(case, shards, case.resume)
        loader.load_state_dict(state)
    seed_everything(5)
    first = 1 if case.taken is not None else 2
    epochs = [epoch_of(loader, epoch)[0] for epoch in (first, first + 1)]
    loader._iterator = None
    return epochs
