"""``torch.utils.data.dataset``'s path under pipeload: ``from pipeload.dataset import Subset``.

A thin re-export, for scripts that import from torch's submodule: the datasets live in
``pipeload.datasets``. Every name here is the same object as ``pipeload.<name>``.

Example:
    >>> from pipeload.dataset import TensorDataset, random_split
    >>> import pipeload
    >>> TensorDataset is pipeload.TensorDataset
    True
"""

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

__all__ = ["ChainDataset", "ConcatDataset", "Dataset", "IterableDataset", "StackDataset", "Subset",
           "TensorDataset", "random_split"]
