"""Whether drawing from a loader's sampler changes anything a worker process could see.

A classic pool forks its process workers before the sampler's first draw, as torch does, so that
every worker starts from the main process as ``iter()`` found it. Forking worker 0 first and the
others as their first tasks go out lets worker 0 build while the main process forks the rest
(forks of one process run one after the other: 7-10 ms each with torch imported), but a worker
forked after a draw inherits what the draw changed. For pipeload's own samplers drawing from
torch's global generator (or from none) that is nothing a worker can see: the draw advances the
global generator, which every worker seeds afresh before any user code runs, and it records the
iteration in the sampler, which workers never use, as long as the length it asks for runs none of
the user's code (``samplers/_lengths.py``: a dataset's own ``__len__`` may open a file, or count
its calls). A user's sampler, a subclass, one drawing from a generator of its own (which the
dataset may hold too), or one over a dataset with a ``__len__`` of its own may change anything:
those keep the forks before the first draw, as does a resumed iteration (its draws replay under
a borrowed global generator state).
"""

from __future__ import annotations

from typing import Any

from pipeload._optional import optional_attribute
from pipeload.samplers._batch import BatchSampler
from pipeload.samplers._distributed import DistributedSampler
from pipeload.samplers._lengths import sampler_runs_no_user_code
from pipeload.samplers._random import RandomSampler, SubsetRandomSampler, WeightedRandomSampler
from pipeload.samplers._sequential import SequentialSampler

# Exact types: a subclass may draw from anything.
_DRAWING_FROM_THE_GLOBAL_GENERATOR_AT_MOST = (
    SequentialSampler, RandomSampler, SubsetRandomSampler, WeightedRandomSampler, DistributedSampler,
)


def draws_unseen_by_workers(index_sampler: Any) -> bool:
    """Whether ``index_sampler`` (a loader's: its batch sampler, or its sampler when it does not
    batch) may draw between worker forks without any worker seeing a difference."""
    sampler = index_sampler
    if type(sampler) is BatchSampler:
        if sampler._pending is not None:
            return False
        sampler = sampler.sampler
    return (type(sampler) in _DRAWING_FROM_THE_GLOBAL_GENERATOR_AT_MOST
            and optional_attribute(sampler, "generator") is None
            and sampler._pending is None
            and sampler_runs_no_user_code(sampler))
