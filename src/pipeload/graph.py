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

__all__ = sorted({*_graph.__all__, "IterDataPipe", "MapDataPipe"})
globals().update({name: getattr(_graph, name) for name in _graph.__all__})
