"""``torch.utils.data.graph``'s path under pipeload: ``from pipeload.graph import traverse_dps``.

A thin re-export of the DataPipes room's graph functions (``pipeload.datapipes.graph``: walk,
find, replace, copy, shard and seed a pipe graph), which work on pipeload's pipes and torch's
alike. Every name is the same object as in ``pipeload.datapipes.graph``.

Example:
    >>> from pipeload.datapipes.iter import IterableWrapper
    >>> from pipeload.graph import traverse_dps
    >>> pipe = IterableWrapper(range(4)).map(abs)
    >>> [type(p).__name__ for p, _ in traverse_dps(pipe).values()]
    ['Mapper']
"""

from pipeload.datapipes import graph as _graph
from pipeload.datapipes.base import IterDataPipe, MapDataPipe
from pipeload.datapipes.graph import DataPipeGraph, traverse_dps


def _graph_names() -> list[str]:
    """The graph module's public names: its ``__all__``, else the functions it defines."""
    declared = getattr(_graph, "__all__", None)
    if declared is not None:
        return list(declared)
    return [name for name, value in vars(_graph).items()
            if not name.startswith("_") and callable(value) and getattr(value, "__module__", None) == _graph.__name__]


__all__ = sorted({*_graph_names(), "DataPipeGraph", "IterDataPipe", "MapDataPipe", "traverse_dps"})
globals().update({name: getattr(_graph, name) for name in __all__ if hasattr(_graph, name)})
