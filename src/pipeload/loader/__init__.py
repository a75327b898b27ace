"""The DataLoader room: the loader (``_dataloader``), the checks of its arguments
(``_arguments``), which engine runs an epoch (``_engine_choice``) and the epoch's iterator
(``_epoch_iterator``).

The loader is a description; what runs an epoch is an engine (inline, or a pool of workers),
optionally followed by a pin stage. ``iter(loader)`` returns an epoch iterator that owns the
engine (or borrows the loader's, with ``persistent_workers=True``).
"""

from pipeload.loader._dataloader import DataLoader

__all__ = ["DataLoader"]

DataLoader.__module__ = __name__  # defined in a private module, named by its public one
