"""The datasets the side-by-side benchmark loads, each limited by a different thing.

Every dataset is a module-level class holding only plain, picklable values, so it works with
``num_workers > 0`` under fork, spawn and forkserver. A workload is a frozen description: its
``make`` builds the dataset for one loader from a :class:`WorkloadContext`.

    tiny          200k Python ints, batch 64: per-batch overhead of the loader itself
    float_images  3x224x224 float32 items, batch 64: moving big tensors between processes
    augmented_images  the same items cropped, flipped and normalised from uint8 images held in
                  memory (~0.7 ms an item here): moving them beside the work of making them
    python_work   ~2 ms of pure-Python work per item: spreading compute over workers
    jpeg          small JPEG files decoded and resized with Pillow: a realistic mix
    iterable      an IterableDataset sharding itself with its loader's get_worker_info()
    slow_consumer 64 items of 4 MB per batch, a training loop taking 200 ms a batch: how much
                  shared memory a loader keeps when the workers are faster than the consumer
    gpu_copy      float_images with pin_memory=True, each batch copied to the GPU with
                  non_blocking=True (needs CUDA; skipped elsewhere)
"""

from __future__ import annotations

import functools
import importlib
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch
import torch.utils.data

# Where each loader's get_worker_info lives. The iterable workload looks it up by loader name
# inside the worker, so the dataset object pickles as a string rather than a function.
WORKER_INFO_FUNCTIONS = {
    "pipeload": ("pipeload", "get_worker_info"),
    "torch": ("torch.utils.data", "get_worker_info"),
}

PYTHON_WORK_PER_ITEM_S = 0.002
JPEG_SOURCE_SIZE = (160, 120)  # width, height of the files written to disk
JPEG_OUTPUT_SIDE = 64  # items are resized to a square of this side
JPEG_QUALITY = 85


@dataclass(frozen=True)
class WorkloadContext:
    """What a workload needs to build its dataset for one loader.

    Attributes:
        items: how many items the dataset has (the workload's full or quick size).
        loader_name: ``"pipeload"`` or ``"torch"``; the iterable workload uses it to pick that
            loader's own ``get_worker_info``.
        scratch_dir: a directory owned by the caller for files a workload writes once (the
            JPEGs); it must outlive every loader built from this context.
    """

    items: int
    loader_name: str
    scratch_dir: Path


@dataclass(frozen=True)
class Workload:
    """One benchmark workload: a name, what limits it, sizes, and how to build its dataset."""

    name: str
    limited_by: str
    batch_size: int
    full_items: int
    quick_items: int
    make: Callable[[WorkloadContext], torch.utils.data.Dataset]
    consumer_s: float = 0.0
    """Seconds the simulated training loop spends on each batch (0: none)."""
    to_gpu: bool = False
    """Load with pin_memory=True and copy each batch to the GPU with non_blocking=True."""

    def items(self, quick: bool) -> int:
        return self.quick_items if quick else self.full_items


# --- tiny -----------------------------------------------------------------------------------


class PythonInts(torch.utils.data.Dataset):
    """Item ``i`` is the int ``i``: almost no work, so the loader's own overhead dominates."""

    def __init__(self, count: int) -> None:
        self.count = count

    def __len__(self) -> int:
        return self.count

    def __getitem__(self, index: int) -> int:
        if not 0 <= index < self.count:
            raise IndexError(f"index {index} out of range for {self.count} items")
        return index


# --- float_images ---------------------------------------------------------------------------


class FloatImages(torch.utils.data.Dataset):
    """Item ``i`` is a float32 ``3 x side x side`` tensor filled with a value derived from ``i``.

    Filling is a memset, so nearly all the cost is in collating and shipping 0.6 MB per item.
    """

    def __init__(self, count: int, side: int = 224) -> None:
        self.count = count
        self.side = side

    def __len__(self) -> int:
        return self.count

    def __getitem__(self, index: int) -> torch.Tensor:
        if not 0 <= index < self.count:
            raise IndexError(f"index {index} out of range for {self.count} items")
        return torch.full((3, self.side, self.side), float(index % 251) / 251.0)


# --- augmented_images -----------------------------------------------------------------------


class AugmentedImages(torch.utils.data.Dataset):
    """Item ``i``: a random 224x224 crop of one of a few uint8 ``3 x 256 x 256`` images held in
    memory, flipped at random, made float32 and normalised per channel: ~0.7 ms of torch ops an
    item on the 2-core box, the work a vision training set does on images already decoded. ``float_images``
    costs a memset an item, so moving the batch is nearly all its work; here it is a part.
    """

    MEAN = (0.485, 0.456, 0.406)
    STD = (0.229, 0.224, 0.225)

    def __init__(self, count: int, side: int = 224, held: int = 8) -> None:
        self.count = count
        self.side = side
        generator = torch.Generator().manual_seed(0)
        self.images = torch.randint(0, 256, (held, 3, 256, 256), dtype=torch.uint8, generator=generator)
        self.mean = torch.tensor(self.MEAN).view(3, 1, 1)
        self.std = torch.tensor(self.STD).view(3, 1, 1)

    def __len__(self) -> int:
        return self.count

    def __getitem__(self, index: int) -> torch.Tensor:
        if not 0 <= index < self.count:
            raise IndexError(f"index {index} out of range for {self.count} items")
        image = self.images[index % len(self.images)]
        top, left = torch.randint(0, 256 - self.side + 1, (2,)).tolist()
        crop = image[:, top:top + self.side, left:left + self.side]
        if torch.rand(()) < 0.5:
            crop = crop.flip(-1)
        return (crop.float().div_(255.0) - self.mean) / self.std


# --- slow_consumer --------------------------------------------------------------------------


class BigItems(torch.utils.data.Dataset):
    """Item ``i`` is a 4 MB float32 tensor, one of a few held in memory (a dataset already loaded).

    Returning stored tensors keeps the workers' own work to collating 256 MB per batch, so a
    200 ms training step is slower than the workers and the loader's memory policy is what shows.
    """

    def __init__(self, count: int, distinct: int = 8, item_floats: int = 1 << 20) -> None:
        self.count = count
        self.items = [torch.full((item_floats,), float(k)) for k in range(distinct)]

    def __len__(self) -> int:
        return self.count

    def __getitem__(self, index: int) -> torch.Tensor:
        if not 0 <= index < self.count:
            raise IndexError(f"index {index} out of range for {self.count} items")
        return self.items[index % len(self.items)]


# --- python_work ----------------------------------------------------------------------------


class PythonWork(torch.utils.data.Dataset):
    """Item ``i`` is the result of a fixed loop of pure-Python arithmetic seeded by ``i``.

    The loop length is chosen once, in the main process, so both loaders do identical work.
    """

    def __init__(self, count: int, loop_iterations: int) -> None:
        self.count = count
        self.loop_iterations = loop_iterations

    def __len__(self) -> int:
        return self.count

    def __getitem__(self, index: int) -> int:
        if not 0 <= index < self.count:
            raise IndexError(f"index {index} out of range for {self.count} items")
        return _busy_loop(index, self.loop_iterations)


def _busy_loop(seed: int, iterations: int) -> int:
    # A linear congruential step: cheap, holds the GIL, cannot be optimised away.
    value = seed
    for step in range(iterations):
        value = (value * 1103515245 + step) & 0xFFFFFFFF
    return value


@functools.cache
def python_work_iterations(target_s: float = PYTHON_WORK_PER_ITEM_S) -> int:
    """How many ``_busy_loop`` steps take about ``target_s`` on this machine (best of 3)."""
    probe_steps = 20_000
    best_s = float("inf")
    for _ in range(3):
        started = time.perf_counter()
        _busy_loop(0, probe_steps)
        best_s = min(best_s, time.perf_counter() - started)
    return max(1, round(probe_steps * target_s / best_s))


# --- jpeg -----------------------------------------------------------------------------------


class JpegFiles(torch.utils.data.Dataset):
    """Item ``i`` decodes JPEG file ``i`` with Pillow, resizes it, and returns a uint8 CHW tensor.

    Returns ``(image, label)``; the label is ``i % 10``.
    """

    def __init__(self, paths: list[str], side: int = JPEG_OUTPUT_SIDE) -> None:
        self.paths = paths
        self.side = side

    def __len__(self) -> int:
        return len(self.paths)

    def __getitem__(self, index: int) -> tuple[torch.Tensor, int]:
        from PIL import Image  # imported here so that importing this module never needs Pillow

        with Image.open(self.paths[index]) as image:
            resized = image.convert("RGB").resize((self.side, self.side), Image.BILINEAR)
        pixels = torch.from_numpy(np.array(resized, dtype=np.uint8))
        return pixels.permute(2, 0, 1).contiguous(), index % 10


def write_jpegs(directory: Path, count: int) -> list[str]:
    """Write ``count`` JPEGs into ``directory`` (once: files already there are reused).

    Returns their paths in index order.
    """
    from PIL import Image

    directory.mkdir(parents=True, exist_ok=True)
    width, height = JPEG_SOURCE_SIZE
    columns = np.arange(width, dtype=np.int64)[None, :]
    rows = np.arange(height, dtype=np.int64)[:, None]
    paths = []
    for index in range(count):
        path = directory / f"{index:06d}.jpg"
        if not path.exists():
            # Smooth gradients with an index-dependent tilt compress like photos, unlike noise.
            channels = [(columns * (1 + (index + c) % 5) + rows * (c + 1) + index) % 256
                        for c in range(3)]
            array = np.stack(channels, axis=-1).astype(np.uint8)
            Image.fromarray(array, mode="RGB").save(path, quality=JPEG_QUALITY)
        paths.append(str(path))
    return paths


# --- iterable -------------------------------------------------------------------------------


class ShardedStream(torch.utils.data.IterableDataset):
    """A stream of ``count`` small float tensors that splits itself among workers.

    Worker ``k`` of ``n`` yields items ``k, k + n, k + 2n, ...``; it learns ``k`` and ``n`` from
    the ``get_worker_info`` of the loader named ``loader_name`` (each loader sets up only its own).
    """

    def __init__(self, count: int, loader_name: str, item_shape: tuple[int, ...] = (1, 64, 64)):
        if loader_name not in WORKER_INFO_FUNCTIONS:
            raise ValueError(
                f"loader_name must be one of {sorted(WORKER_INFO_FUNCTIONS)}, got {loader_name!r}"
            )
        self.count = count
        self.loader_name = loader_name
        self.item_shape = item_shape

    def __iter__(self) -> Iterator[torch.Tensor]:
        module_name, function_name = WORKER_INFO_FUNCTIONS[self.loader_name]
        info = getattr(importlib.import_module(module_name), function_name)()
        first, step = (0, 1) if info is None else (info.id, info.num_workers)
        for index in range(first, self.count, step):
            yield torch.full(self.item_shape, float(index))


# --- the registry ---------------------------------------------------------------------------


def _make_jpeg(context: WorkloadContext) -> JpegFiles:
    return JpegFiles(write_jpegs(context.scratch_dir / "jpeg", context.items))


WORKLOADS: dict[str, Workload] = {
    workload.name: workload
    for workload in [
        Workload("tiny", "loader overhead", 64, 200_000, 20_000,
                 lambda context: PythonInts(context.items)),
        Workload("float_images", "transfer", 64, 4_096, 512,
                 lambda context: FloatImages(context.items)),
        Workload("augmented_images", "transfer + per-item work", 64, 4_096, 512,
                 lambda context: AugmentedImages(context.items)),
        Workload("python_work", "Python compute", 16, 2_000, 200,
                 lambda context: PythonWork(context.items, python_work_iterations())),
        Workload("jpeg", "decode + resize", 32, 3_000, 300, _make_jpeg),
        Workload("iterable", "iterable sharding", 64, 30_000, 3_000,
                 lambda context: ShardedStream(context.items, context.loader_name)),
        Workload("slow_consumer", "shared memory held", 64, 64 * 24, 64 * 12,
                 lambda context: BigItems(context.items), consumer_s=0.2),
        Workload("gpu_copy", "pinned copies to the GPU", 64, 4_096, 512,
                 lambda context: FloatImages(context.items), to_gpu=True),
    ]
}
DEFAULT_WORKLOADS = ("tiny", "float_images", "augmented_images", "python_work", "jpeg", "iterable",
                     "slow_consumer")


def get_workload(name: str) -> Workload:
    """The workload called ``name``; raises ValueError listing the known names otherwise."""
    try:
        return WORKLOADS[name]
    except KeyError:
        raise ValueError(f"unknown workload {name!r}; choose from {sorted(WORKLOADS)}") from None


def batch_length(batch: Any) -> int:
    """How many samples a collated batch holds: the first dimension of its first tensor leaf."""
    while True:
        if isinstance(batch, torch.Tensor):
            return int(batch.shape[0]) if batch.dim() > 0 else 1
        if isinstance(batch, dict):
            batch = next(iter(batch.values()))
        elif isinstance(batch, (list, tuple)):
            batch = batch[0]
        else:
            return 1
