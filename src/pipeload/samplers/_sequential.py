"""Samplers that read a dataset in order: ``SequentialSampler``, and the endless key stream of
an iterable-style dataset."""

from __future__ import annotations

import itertools
from collections.abc import Iterator, Sized
from typing import Any

import torch.utils.data as torch_data  # torch's class: a base for identity, never called

from pipeload.samplers._base import Sampler
from pipeload.samplers._epoch_lengths import length_of
from pipeload.samplers._state import StatefulSampler


class SequentialSampler(StatefulSampler, Sampler[int], torch_data.SequentialSampler):
    """Yields ``0, 1, ..., len(data_source) - 1``.

    Example:
        >>> list(SequentialSampler(range(3)))
        [0, 1, 2]
    """

    data_source: Sized

    def __init__(self, data_source: Sized) -> None:
        self.data_source = data_source

    def _keys(self) -> Iterator[int]:
        return iter(range(length_of(self.data_source)))

    def _config(self) -> dict[str, Any]:
        return {"length": length_of(self.data_source)}

    def __len__(self) -> int:
        return length_of(self.data_source)


class _InfiniteConstantSampler(Sampler[None]):
    """Yields None forever: the key stream for an iterable-style dataset."""

    def __iter__(self) -> Iterator[None]:
        return itertools.repeat(None)
