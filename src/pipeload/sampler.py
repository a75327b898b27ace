"""``torch.utils.data.sampler``'s path under pipeload: ``from pipeload.sampler import Sampler``.

A thin re-export, for scripts that import from torch's submodule: the samplers live in the
``pipeload.samplers`` room, one module a kind. Every name here is the same object as
``pipeload.<name>``; subclass them as you would torch's.

Example:
    >>> from pipeload.sampler import Sampler
    >>> class Evens(Sampler[int]):
    ...     def __init__(self, n): self.n = n
    ...     def __iter__(self): return iter(range(0, self.n, 2))
    ...     def __len__(self): return (self.n + 1) // 2
    >>> list(Evens(5))
    [0, 2, 4]
"""

from pipeload.samplers import (
    BatchSampler,
    RandomSampler,
    Sampler,
    SequentialSampler,
    SubsetRandomSampler,
    WeightedRandomSampler,
)

__all__ = ["BatchSampler", "RandomSampler", "Sampler", "SequentialSampler", "SubsetRandomSampler",
           "WeightedRandomSampler"]
