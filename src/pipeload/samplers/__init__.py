"""Samplers: descriptions of the order in which a map-style dataset is read.

One room, one module a kind: ``_sequential`` (in order), ``_random`` (the random samplers),
``_distributed`` (``DistributedSampler``), ``_batch`` (``BatchSampler`` and what a batch sampler
says about its batches), ``_state`` (their checkpoints), ``_draws`` (whether workers may fork after
a draw), ``_lengths`` (whether a length runs the user's code), ``_epoch_lengths`` (a dataset's
length asked once an epoch), ``_base`` (``Sampler``). Import them from here (or from
``pipeload``).

A sampler yields keys (or, for ``BatchSampler``, lists of keys). Random samplers draw from
torch's generators in exactly the order ``torch.utils.data`` does, so the same seed gives the
same indices, including the lazy seed draw a ``RandomSampler`` without a generator makes when
iteration starts.

Each class also subclasses its namesake in ``torch.utils.data`` for identity alone (frameworks
choose how to shard by ``isinstance``, e.g. Lightning shuffles the DistributedSampler it injects
only if the loader's sampler is a ``RandomSampler``); ours define every method, so none of
torch's runs.
"""

from pipeload.samplers._base import Sampler
from pipeload.samplers._batch import BatchSampler, batch_sizes, exact_length
from pipeload.samplers._distributed import DistributedSampler
from pipeload.samplers._draws import draws_unseen_by_workers
from pipeload.samplers._epoch_lengths import EpochLengths
from pipeload.samplers._lengths import sampler_runs_no_user_code
from pipeload.samplers._random import RandomSampler, SubsetRandomSampler, WeightedRandomSampler
from pipeload.samplers._sequential import SequentialSampler, _InfiniteConstantSampler
from pipeload.samplers._state import StatefulSampler

__all__ = [
    "BatchSampler",
    "DistributedSampler",
    "RandomSampler",
    "Sampler",
    "SequentialSampler",
    "SubsetRandomSampler",
    "WeightedRandomSampler",
]

# Defined in private modules, named by their public one (reprs, pickles, docs).
for _public in (Sampler, SequentialSampler, BatchSampler, RandomSampler, SubsetRandomSampler,
                WeightedRandomSampler, DistributedSampler):
    _public.__module__ = __name__
