"""Loader stats: every stage counts and times itself, cheaply enough to stay on.

``loader.stats()`` returns a :class:`LoaderStats`; ``print(loader.stats())`` prints its summary
in words, naming the bottleneck and what to try. Design note: docs/design/stats.md in the source
repository.
"""

from pipeload.stats.report import LoaderStats, QueueStats, RayStageStats, StageStats, TuningDecision, WorkerStats

__all__ = ["LoaderStats", "QueueStats", "RayStageStats", "StageStats", "TuningDecision", "WorkerStats"]
