"""What a dataset's Ray queue boundaries measured, as a worker's stats count it.

Each Ray boundary pipe tallies its runs in the process that reads it (``RayQueueBoundary
.ray_stage_totals()``: items its actors made, seconds in them, in transfer, and waited for). A
worker finds those pipes in its own copy of the dataset once, as it does the on_error pipes
(``stats/skips.py``), and its clock reads their tallies with its totals, so a graph without a
Ray boundary costs nothing.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from pipeload.stats.report import RayStageStats


def ray_stage_counter(dataset: Any, before: tuple[float, ...] = ()) -> Callable[[], tuple[float, ...]] | None:
    """A function returning (as a tuple) what ``dataset``'s Ray boundaries measured in this
    process since this call, plus ``before`` (counted earlier); None when it has none."""
    try:  # the family that plugs into the loader may be a stand-in without Ray boundaries
        from pipeload.datapipes.base import IterDataPipe
        from pipeload.datapipes.graph import list_dps
    except ImportError:
        return None
    if not isinstance(dataset, IterDataPipe):
        return None
    try:
        pipes = [pipe for pipe in list_dps(dataset) if callable(getattr(pipe, "ray_stage_totals", None))]
    except Exception:
        return None  # a graph that cannot be walked still loads; it only goes uncounted
    if not pipes:
        return None

    def measured() -> RayStageStats:
        total = RayStageStats()
        for pipe in pipes:
            total = total.plus(pipe.ray_stage_totals())
        return total

    # A pipe's tally lives as long as the pipe, and a forked worker inherits the parent's:
    # count from where it stands now.
    already = measured().minus(RayStageStats.from_tuple(before))
    return lambda: measured().minus(already).as_tuple()
