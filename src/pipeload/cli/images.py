"""The dataset behind ``pipeload bench``: synthetic JPEG images in tar shards, made on first use.

Nothing is downloaded: images are drawn from a fixed seed (smooth colour fields with noise, so
JPEG has real work to do), encoded with Pillow, and written as ``shard-NNNNN.tar`` files with an
``index.json`` (each image's shard, byte offset, length and label) under the cache directory:
``$PIPELOAD_CACHE``, else ``~/.cache/pipeload``. A second run finds them there.

Two ways to read them, as users do:

- :class:`TarImages`, map-style: seeks to an image's bytes inside its shard and decodes it;
- :func:`shard_pipe`, a DataPipe graph over whole shards (read each tar from start to end,
  WebDataset style), sharded across workers by shard.

Each image is decoded, randomly cropped and flipped (torch's global RNG, which workers seed),
resized to ``OUTPUT_SIDE``, and normalised to a float tensor.
"""

from __future__ import annotations

import io
import json
import os
import shutil
import tarfile
import tempfile
from pathlib import Path
from typing import Any

import numpy as np
import torch

from pipeload.datasets import Dataset

SOURCE_SIDE = 128
OUTPUT_SIDE = 64
CROP_SIDE = 112
IMAGES_PER_SHARD = 256
NUM_CLASSES = 10
JPEG_QUALITY = 85
FORMAT_VERSION = 1  # bump when the files change, so old caches are not reused
MEAN = torch.tensor([0.485, 0.456, 0.406]).view(3, 1, 1)
STD = torch.tensor([0.229, 0.224, 0.225]).view(3, 1, 1)


def cache_dir() -> Path:
    """Where pipeload keeps what it makes: ``$PIPELOAD_CACHE`` or ``~/.cache/pipeload``."""
    configured = os.environ.get("PIPELOAD_CACHE")
    return Path(configured) if configured else Path.home() / ".cache" / "pipeload"


def dataset_dir(images: int) -> Path:
    return cache_dir() / "bench-data" / f"jpeg-{images}-v{FORMAT_VERSION}"


def ensure_images(images: int, progress: Any = None) -> Path:
    """The directory holding ``images`` synthetic JPEGs in tar shards; writes them if missing.

    Written into a temporary directory first and renamed into place, so an interrupted build
    never leaves a half-made dataset behind that a later run would trust.
    """
    target = dataset_dir(images)
    if (target / "index.json").is_file():
        return target
    target.parent.mkdir(parents=True, exist_ok=True)
    scratch = Path(tempfile.mkdtemp(prefix=".building-", dir=target.parent))
    try:
        index = _write_shards(scratch, images, progress)
        (scratch / "index.json").write_text(json.dumps(index))
        os.replace(scratch, target)
    except BaseException:
        shutil.rmtree(scratch, ignore_errors=True)
        raise
    return target


def _write_shards(directory: Path, images: int, progress: Any) -> list[list[Any]]:
    rng = np.random.default_rng(FORMAT_VERSION)
    index: list[list[Any]] = []
    for shard in range(0, images, IMAGES_PER_SHARD):
        name = f"shard-{shard // IMAGES_PER_SHARD:05d}.tar"
        with tarfile.open(directory / name, "w") as tar:
            for number in range(shard, min(images, shard + IMAGES_PER_SHARD)):
                data = _jpeg_bytes(rng)
                info = tarfile.TarInfo(f"{number:08d}.jpg")
                info.size = len(data)
                tar.addfile(info, io.BytesIO(data))
                if progress is not None:
                    progress.update()
        with tarfile.open(directory / name) as tar:
            for member in tar.getmembers():
                number = int(member.name.split(".")[0])
                index.append([name, member.offset_data, member.size, number % NUM_CLASSES])
    return index


def _jpeg_bytes(rng: np.random.Generator) -> bytes:
    from PIL import Image

    ramp = np.linspace(0.0, 1.0, SOURCE_SIDE)
    colours = rng.uniform(0, 255, size=(2, 3))
    field = np.outer(ramp, 1 - ramp)[..., None] * colours[0] + np.add.outer(ramp, ramp)[..., None] * colours[1] / 2
    pixels = np.clip(field + rng.normal(0, 24, size=field.shape), 0, 255).astype(np.uint8)
    buffer = io.BytesIO()
    Image.fromarray(pixels).save(buffer, format="JPEG", quality=JPEG_QUALITY)
    return buffer.getvalue()


def decode(data: bytes, label: int) -> tuple[torch.Tensor, int]:
    """JPEG bytes -> a normalised ``3 x OUTPUT_SIDE x OUTPUT_SIDE`` float tensor, and the label."""
    from PIL import Image

    image = Image.open(io.BytesIO(data)).convert("RGB")
    left, top = (int(v) for v in torch.randint(0, SOURCE_SIDE - CROP_SIDE + 1, (2,)))
    image = image.crop((left, top, left + CROP_SIDE, top + CROP_SIDE))
    image = image.resize((OUTPUT_SIDE, OUTPUT_SIDE), Image.BILINEAR)
    pixels = torch.frombuffer(bytearray(image.tobytes()), dtype=torch.uint8)
    tensor = pixels.view(OUTPUT_SIDE, OUTPUT_SIDE, 3).permute(2, 0, 1).float().div_(255)
    if torch.rand(()) < 0.5:
        tensor = tensor.flip(-1)
    return (tensor - MEAN) / STD, label


class TarImages(Dataset):
    """Map-style access to the shards: item i seeks to image i's bytes and decodes them.

    Holds only the index (plain lists) and the directory, so it pickles for every start method.

    Example:
        >>> images = TarImages(ensure_images(256))  # doctest: +SKIP
        >>> images[0][0].shape  # doctest: +SKIP
        torch.Size([3, 64, 64])
    """

    def __init__(self, directory: Path) -> None:
        self.directory = Path(directory)
        self.index = json.loads((self.directory / "index.json").read_text())

    def __len__(self) -> int:
        return len(self.index)

    def __getitem__(self, position: int) -> tuple[torch.Tensor, int]:
        shard, offset, size, label = self.index[position]
        with open(self.directory / shard, "rb") as file:
            file.seek(offset)
            data = file.read(size)
        return decode(data, label)

    def shards(self) -> list[str]:
        return sorted({entry[0] for entry in self.index})


def read_shard(path: str) -> list[tuple[bytes, int]]:
    """Every (JPEG bytes, label) in one tar shard, in order."""
    samples = []
    with tarfile.open(path) as tar:
        for member in tar:
            number = int(member.name.split(".")[0])
            samples.append((tar.extractfile(member).read(), number % NUM_CLASSES))
    return samples


def _decode_pair(pair: tuple[bytes, int]) -> tuple[torch.Tensor, int]:
    return decode(*pair)


def shard_pipe(images: TarImages) -> Any:
    """A DataPipe graph over the shards: shuffled shards, split across workers, read whole."""
    from pipeload.datapipes.iter import IterableWrapper

    paths = [str(images.directory / shard) for shard in images.shards()]
    return (IterableWrapper(paths).shuffle().sharding_filter()
            .flatmap(read_shard).shuffle(buffer_size=IMAGES_PER_SHARD).map(_decode_pair))
