"""The synthetic image dataset behind ``pipeload bench``.

It lives inside the package (``bench/`` is not installed). It is a pipeload ``Dataset``, which
torch's DataLoader accepts as well, so the demo hands the very same object to both loaders.
"""

from __future__ import annotations

import torch

from pipeload.datasets import Dataset

# Per-channel statistics of ImageNet, the usual choice for this kind of normalisation.
CHANNEL_MEAN = (0.485, 0.456, 0.406)
CHANNEL_STD = (0.229, 0.224, 0.225)
NUM_CLASSES = 10


class SyntheticImages(Dataset):
    """``(image, label)`` pairs that look like a small image-classification dataset.

    Each raw image is a uint8 ``3 x size x size`` tensor computed from its index alone (no files,
    no stored data), then put through a light transform: convert to float, normalise per channel,
    flip left-right with probability 1/2 (drawn from torch's global RNG, which DataLoader workers
    seed). Module-level and holding only ints, so it pickles for fork, spawn and forkserver.

    Args:
        num_samples: how many items the dataset has.
        image_size: height and width of each image in pixels.

    Example:
        >>> image, label = SyntheticImages(8)[3]
        >>> image.shape, image.dtype
        (torch.Size([3, 64, 64]), torch.float32)
    """

    def __init__(self, num_samples: int, image_size: int = 64) -> None:
        if num_samples < 0:
            raise ValueError(f"num_samples must be >= 0, got {num_samples!r}")
        if image_size < 1:
            raise ValueError(f"image_size must be >= 1, got {image_size!r}")
        self.num_samples = num_samples
        self.image_size = image_size

    def __len__(self) -> int:
        return self.num_samples

    def __getitem__(self, index: int) -> tuple[torch.Tensor, int]:
        if not 0 <= index < self.num_samples:
            raise IndexError(f"index {index} out of range for {self.num_samples} samples")
        return _augment(raw_image(index, self.image_size)), index % NUM_CLASSES


def raw_image(index: int, image_size: int) -> torch.Tensor:
    """The uint8 ``3 x image_size x image_size`` image for ``index``; same index, same pixels."""
    # A ramp whose slope and offset depend on the index: cheap, deterministic, and different
    # enough from one index to the next that no two images are alike.
    slope = 1 + (index * 7919) % 253
    ramp = torch.arange(3 * image_size * image_size, dtype=torch.int64)
    pixels = (ramp * slope + index) % 256
    return pixels.to(torch.uint8).view(3, image_size, image_size)


def _augment(image: torch.Tensor) -> torch.Tensor:
    mean = torch.tensor(CHANNEL_MEAN).view(3, 1, 1)
    std = torch.tensor(CHANNEL_STD).view(3, 1, 1)
    normalised = (image.float() / 255.0 - mean) / std
    if torch.rand(()) < 0.5:
        normalised = normalised.flip(-1)
    return normalised
