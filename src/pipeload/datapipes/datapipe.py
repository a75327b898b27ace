"""``torch.utils.data.datapipes.datapipe``'s path under pipeload: ``from
pipeload.datapipes.datapipe import IterDataPipe``.

A thin re-export of the pipe bases (``pipeload.datapipes.base``) and ``DataChunk``
(``pipeload.datapipes.chunk``); the same objects as ``pipeload.IterDataPipe`` and the others.
torch's ``DFIterDataPipe`` (DataFrame pipes) is not provided.
"""

from pipeload.datapipes.base import IterDataPipe, MapDataPipe
from pipeload.datapipes.chunk import DataChunk
from pipeload.datasets import Dataset, IterableDataset  # noqa: F401  (torch's module has them too)

__all__ = ["DataChunk", "IterDataPipe", "MapDataPipe"]
