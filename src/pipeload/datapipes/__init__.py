"""DataPipes: small composable nodes chained into a graph, run inside or outside a DataLoader.

    from pipeload.datapipes.iter import IterableWrapper
    pipe = IterableWrapper(urls).shuffle().sharding_filter().map(download).batch(32)
    loader = pipeload.DataLoader(pipe, batch_size=None, num_workers=4)

A pipe is a picklable description with explicit parents; ``iter(pipe)`` starts a run, whose
iterator holds all of that run's state and answers the non-blocking protocol
(``nonblocking_next()`` raises :class:`NotAvailable` while nothing is ready). Parts of a graph
can run in other threads or processes behind a ``queue_boundary``; ``graph`` walks, edits,
shards and seeds whole graphs. ``sources`` reads files, tar shards and WebDataset samples,
local or remote; ``webdataset_pipeline`` builds the common graph in one call. The design note (docs/design/datapipes.md in the source repository) explains the execution model.
"""

# datapipe: torch's path (torch.utils.data.datapipes.datapipe), reachable as an attribute as there
from pipeload.datapipes import datapipe, graph, iter, map, sources
from pipeload.datapipes.base import (
    IterDataPipe,
    MapDataPipe,
    functional_datapipe,
    is_datapipe,
    is_iter_datapipe,
    is_map_datapipe,
)
from pipeload.datapipes.boundary.queue_interface import DataLoaderQueue, QueueError
from pipeload.datapipes.chunk import DataChunk
from pipeload.datapipes.lazy import lazy_init
from pipeload.datapipes.nonblocking import (
    EnsureNonBlockingNextDataPipe,
    NonBlockingIterDataPipe,
    NonBlockingMapDataPipe,
)
from pipeload.datapipes.protocol import NotAvailable, PipeIterator, as_nonblocking
from pipeload.datapipes.sources.pipeline import webdataset_pipeline

def _document_functional_forms() -> None:
    from pipeload.datapipes._docs import document_functional_forms
    from pipeload.datapipes._iter_ops import IterOperations
    from pipeload.datapipes._map_ops import MapOperations

    document_functional_forms(IterOperations, [getattr(iter, name) for name in iter.__all__])
    document_functional_forms(MapOperations, [getattr(map, name) for name in map.__all__])


_document_functional_forms()

__all__ = [
    "DataChunk",
    "DataLoaderQueue",
    "EnsureNonBlockingNextDataPipe",
    "IterDataPipe",
    "MapDataPipe",
    "NonBlockingIterDataPipe",
    "NonBlockingMapDataPipe",
    "NotAvailable",
    "PipeIterator",
    "QueueError",
    "as_nonblocking",
    "functional_datapipe",
    "graph",
    "is_datapipe",
    "is_iter_datapipe",
    "is_map_datapipe",
    "iter",
    "lazy_init",
    "map",
    "sources",
    "webdataset_pipeline",
]
