"""Samples skipped by the sources' ``on_error`` policies, as a worker's stats count them.

Each on_error-aware pipe (``datapipes/sources/on_error.py``) tallies what it skipped in the
process that runs it. A worker finds those pipes in its own copy of the dataset once, when it
starts, and its clock reads their tallies with the scheduler counters (at most every 0.1 s), so
a graph without such pipes costs nothing and one with them costs a few additions now and then.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any


def skip_counter(dataset: Any, before: int = 0) -> Callable[[], int] | None:
    """A function returning how many samples ``dataset``'s on_error pipes have skipped in this
    process since this call (plus ``before``, counted earlier), or None when it has none (only
    pipeload's own DataPipe graphs are looked at)."""
    try:  # the family that plugs into the loader may be a stand-in without on_error pipes
        from pipeload.datapipes.base import IterDataPipe, MapDataPipe
        from pipeload.datapipes.graph import list_dps
        from pipeload.datapipes.sources.on_error import ErrorPolicyMixin
    except ImportError:
        return None
    if not isinstance(dataset, (IterDataPipe, MapDataPipe)):
        return None
    try:
        pipes = [pipe for pipe in list_dps(dataset) if isinstance(pipe, ErrorPolicyMixin)]
    except Exception:
        return None  # a graph that cannot be walked still loads; it only goes uncounted
    if not pipes:
        return None

    def skipped() -> int:
        return sum(pipe.failure_counts().skipped for pipe in pipes)

    # A pipe's tally lives as long as the pipe: the main process's copy counts every epoch and
    # every loader run over it, and a forked worker inherits what the parent's copy had counted.
    # Count from where it stands now.
    already = skipped() - before
    return lambda: skipped() - already
