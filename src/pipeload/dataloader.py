"""``torch.utils.data.dataloader``'s path under pipeload: ``from pipeload.dataloader import
DataLoader, default_collate``.

A thin re-export, for scripts that import from torch's submodule: the loader itself lives in the
``pipeload.loader`` room, the collate functions in ``pipeload.collate``, the samplers in
``pipeload.samplers``. Every name here is the same object as ``pipeload.<name>``.

Example:
    >>> from pipeload.dataloader import DataLoader, default_collate
    >>> import pipeload
    >>> DataLoader is pipeload.DataLoader
    True
"""

from pipeload.collate import default_collate, default_convert
from pipeload.engine.worker_info import get_worker_info
from pipeload.loader import DataLoader

# Also importable from here, as from torch's module (which imports them for its own use): the
# datasets, samplers and pipe bases, and the private names that DataLoader subclasses read.
from pipeload.datapipes.base import IterDataPipe, MapDataPipe  # noqa: F401
from pipeload.datasets import Dataset, IterableDataset  # noqa: F401
from pipeload.engine.plan import DatasetKind as _DatasetKind  # noqa: F401
from pipeload.samplers import (  # noqa: F401
    BatchSampler,
    RandomSampler,
    Sampler,
    SequentialSampler,
    _InfiniteConstantSampler,
)

__all__ = ["DataLoader", "default_collate", "default_convert", "get_worker_info"]  # torch's, exactly
