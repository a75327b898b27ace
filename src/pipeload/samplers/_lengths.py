"""Whether a sampler's length, and its draws, run code of the user's.

torch's loader starts its workers before its sampler runs: a dataset's ``__len__`` is first
called by the sampler's first draw, after the forks (under spawn, after the dataset was pickled
for the workers). A ``__len__`` may do more than count: it may open the file it counts in (an
HDF5 or LMDB handle, which a forked worker must not share and a spawned one cannot be sent), or
count its calls. pipeload asks such a length no sooner than torch does. A length that runs none
of the user's code (a list's, a ``TensorDataset``'s) may be asked at any time.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.utils.data as torch_data

from pipeload import datasets
from pipeload.samplers._batch import BatchSampler
from pipeload.samplers._distributed import DistributedSampler
from pipeload.samplers._random import RandomSampler, SubsetRandomSampler, WeightedRandomSampler
from pipeload.samplers._sequential import SequentialSampler

# Exact types only: a subclass may define its own __len__.
_PLAIN_SEQUENCES = frozenset({list, tuple, range, torch.Tensor})
_COUNTED_ONCE = frozenset({  # lengths read from what the constructor already counted
    datasets.TensorDataset, datasets.StackDataset, datasets.ConcatDataset,
    torch_data.TensorDataset, torch_data.StackDataset, torch_data.ConcatDataset,
})
_SUBSETS = frozenset({datasets.Subset, torch_data.Subset})
_BATCH_SAMPLERS = frozenset({BatchSampler, torch_data.BatchSampler})
_OVER_A_DATA_SOURCE = frozenset({SequentialSampler, RandomSampler,
                                 torch_data.SequentialSampler, torch_data.RandomSampler})
_OVER_INDICES = frozenset({SubsetRandomSampler, torch_data.SubsetRandomSampler})
_OVER_WEIGHTS = frozenset({WeightedRandomSampler, torch_data.WeightedRandomSampler})
_OVER_A_DATASET = frozenset({DistributedSampler, torch_data.DistributedSampler})


def length_is_plain(source: Any) -> bool:
    """Whether ``len(source)`` runs none of the user's code."""
    kind = type(source)
    if kind in _PLAIN_SEQUENCES or kind in _COUNTED_ONCE:
        return True
    if kind in _SUBSETS:
        return length_is_plain(source.indices)
    return False


def sampler_runs_no_user_code(sampler: Any) -> bool:
    """Whether ``len(sampler)`` and drawing from it run none of the user's code: torch's
    samplers and ours, as they are, over sources whose lengths are plain."""
    kind = type(sampler)
    if kind in _BATCH_SAMPLERS:
        return sampler_runs_no_user_code(sampler.sampler)
    if kind in _OVER_A_DATA_SOURCE:
        return length_is_plain(sampler.data_source)
    if kind in _OVER_INDICES:
        return length_is_plain(sampler.indices)
    if kind in _OVER_A_DATASET:
        return length_is_plain(sampler.dataset)
    return kind in _OVER_WEIGHTS
