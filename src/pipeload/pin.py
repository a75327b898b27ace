"""Copying a batch into page-locked (pinned) host memory, structure and all.

``pin_memory`` walks a batch the way torch's pin-memory thread does: tensors and any object with
a ``pin_memory()`` method are pinned, mappings, namedtuples, tuples and sequences are rebuilt with
their own type where possible, and everything else (strings, numbers, None) passes through.
The loader's pin stage runs this on a thread after the engine; this module holds only the walk.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import torch

from pipeload.collate import rebuild_mapping, rebuild_sequence

__all__ = ["pin_memory", "pinning_available"]


def pinning_available() -> bool:
    """Whether pinned memory is useful here: an accelerator (CUDA, XPU, ...) is present."""
    accelerator = getattr(torch, "accelerator", None)  # torch >= 2.6
    if accelerator is not None:
        return bool(accelerator.is_available())
    return bool(torch.cuda.is_available())


def pin_memory(data: Any, device: str | None = None) -> Any:
    """Return ``data`` with every tensor in it in pinned memory.

    Tensors already pinned (batches that arrived in page-locked slabs) are returned as they are;
    the others are copied. Objects with their own ``pin_memory()`` method (custom batch types) are
    always asked to pin themselves. Mappings keep their type (``defaultdict``, ``OrderedDict``, ...) when it can be
    rebuilt, namedtuples and tuples keep theirs, other sequences fall back to ``list``.

    Args:
        data: a collated batch of any structure.
        device: accepted for compatibility with torch's signature and ignored, as in torch
            2.13: the memory is pinned for the current accelerator.

    Returns:
        The same structure holding pinned tensors.

    Raises:
        RuntimeError: from ``Tensor.pin_memory()`` when no accelerator is available.

    Example:
        >>> batch = pin_memory({"x": torch.zeros(4)})  # doctest: +SKIP
        >>> batch["x"].is_pinned()  # doctest: +SKIP
        True
    """
    if isinstance(data, torch.Tensor):
        # Batches from pinned slabs are page-locked already: hand them on, no copy.
        return data if data.is_pinned() else data.pin_memory()
    if hasattr(data, "pin_memory"):
        return data.pin_memory()
    if isinstance(data, (str, bytes)):
        return data
    if isinstance(data, Mapping):
        pinned = {key: pin_memory(value, device) for key, value in data.items()}
        return rebuild_mapping(data, pinned)
    if isinstance(data, tuple):
        return _pin_tuple(data, device)
    if isinstance(data, Sequence):
        return rebuild_sequence(data, [pin_memory(item, device) for item in data])
    return data


def _pin_tuple(data: tuple[Any, ...], device: str | None) -> tuple[Any, ...]:
    # Unlike collate, pinning keeps plain tuples (and tuple subclasses) as tuples.
    pinned = (pin_memory(item, device) for item in data)
    if hasattr(data, "_fields"):  # a namedtuple takes its fields as arguments
        return type(data)(*pinned)
    return type(data)(pinned)
