"""pipeload: a drop-in replacement for ``torch.utils.data`` with its own loading engine.

Switch by changing one import::

    import pipeload as data
    loader = data.DataLoader(dataset, batch_size=32, shuffle=True, num_workers=4)

torch's submodule paths work too, with ``torch.utils.data`` replaced by ``pipeload``:
``pipeload.dataloader``, ``.dataset``, ``.sampler``, ``.distributed``, ``._utils.collate``,
``._utils.worker``, ``.graph``, ``.graph_settings``, ``.datapipes``; each name in them is the same
object as here.
"""

from pipeload.collate import collate, default_collate, default_convert
from pipeload.datapipes import DataChunk, IterDataPipe, MapDataPipe, functional_datapipe
from pipeload.datasets import (
    ChainDataset,
    ConcatDataset,
    Dataset,
    IterableDataset,
    StackDataset,
    Subset,
    TensorDataset,
    random_split,
)
from pipeload.engine.plan import DatasetKind as _DatasetKind
from pipeload.engine.worker_info import WorkerInfo, get_worker_info
from pipeload.errors import IncompatibleStateError, WorkerError
from pipeload.loader import DataLoader
from pipeload.samplers import (
    BatchSampler,
    DistributedSampler,
    RandomSampler,
    Sampler,
    SequentialSampler,
    SubsetRandomSampler,
    WeightedRandomSampler,
)
from pipeload.shared import CopyOnReadWarning, SharedMapping, SharedSequence, share_containers
from pipeload.stats import LoaderStats

# torch.utils.data's submodules, under the same paths (thin re-exports of the rooms above), as
# attributes of the package once it is imported, as torch's are.
from pipeload import _utils, dataloader, dataset, distributed, graph, graph_settings, sampler  # noqa: E402, I001

__all__ = [
    "BatchSampler",
    "ChainDataset",
    "ConcatDataset",
    "CopyOnReadWarning",
    "DataChunk",
    "DataLoader",
    "Dataset",
    "DistributedSampler",
    "IncompatibleStateError",
    "IterDataPipe",
    "IterableDataset",
    "LoaderStats",
    "MapDataPipe",
    "RandomSampler",
    "Sampler",
    "SequentialSampler",
    "SharedMapping",
    "SharedSequence",
    "StackDataset",
    "Subset",
    "SubsetRandomSampler",
    "TensorDataset",
    "WeightedRandomSampler",
    "WorkerError",
    "WorkerInfo",
    "_DatasetKind",
    "collate",
    "default_collate",
    "default_convert",
    "functional_datapipe",
    "get_worker_info",
    "random_split",
    "share_containers",
]

__version__ = "0.1.0"
