"""Queue boundaries: parts of one graph running in other threads or processes."""

from pipeload.datapipes.boundary.pipes import Prefetcher, QueueBoundary

__all__ = ["Prefetcher", "QueueBoundary"]
