"""Queue boundaries: parts of one graph running in other threads or processes, connected by a
``DataLoaderQueue`` (the RFC's queue: bounded, ordered, exactly once, between two ends)."""

from pipeload.datapipes.boundary.pipes import Prefetcher, QueueBoundary
from pipeload.datapipes.boundary.queue_interface import DataLoaderQueue, QueueError

__all__ = ["DataLoaderQueue", "Prefetcher", "QueueBoundary", "QueueError"]
