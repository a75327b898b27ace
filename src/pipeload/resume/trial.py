"""Trying a state's replica positions on copies of the graph, before loading it.

A version-2 state carries a digest over everything in it, the replicas' own states included, so
what a pipe's ``state_dict()`` wrote is what its ``load_state_dict()`` will read; but not that
this loader's graph takes it (another shuffle buffer size, another stage), and a version-1 state
has no digest at all. So each replica's state (a pipe's, written by that pipe) is checked by the
one code that can read it, the pipe's own ``load_state_dict()``, on a copy of the DataPipe graph
sharded as that worker's replica, and the copy's run is closed at once. Catches what those
loads refuse (a missing key, a count that is text); a well-formed wrong value, and whatever a
pipe only finds when it reads on (a tar reader seeks when its archive opens), are beyond it.
Other iterable datasets are not tried: their ``__iter__`` may open anything.
"""

from __future__ import annotations

import contextlib
from typing import Any

from pipeload.datapipes.graph import list_dps
from pipeload.distributed import current_placement
from pipeload.engine import replica
from pipeload._rng_state import global_rngs_kept
from pipeload.engine.fetch import StreamPosition, resumed_iterator
from pipeload.engine.plan import ReplicaSetup
from pipeload.errors import IncompatibleStateError


def try_replica_states(loader: Any, streams: dict[int, StreamPosition]) -> None:
    """Load each replica's state into a fresh copy of the loader's DataPipe graph.

    Raises:
        IncompatibleStateError: a pipe's ``load_state_dict()`` refused its replica's state
            (the field ``epoch.streams.<worker>.snapshot`` and the pipe's error are named).
    """
    rules = replica.graph_rules(loader.dataset)
    if rules is None or rules.copy_graph is None or _starts_far_ends(loader.dataset):
        return
    # A copy's first iteration may draw from the process's generators (a shuffle's seed): the
    # trial must leave them as the user's checkpoint restored them.
    with global_rngs_kept():
        _try_each(loader, streams, rules)


def _starts_far_ends(dataset: Any) -> bool:
    """Whether iterating a copy of the graph would start what lives elsewhere: a Ray boundary
    connects to its cluster and makes its actors as its run begins, and a main process once
    connected could no longer fork workers that use Ray (its copy is tried in the workers, as
    it loads there)."""
    from pipeload.datapipes.boundary.ray_pipe import RayQueueBoundary  # imports no Ray

    try:
        return any(isinstance(pipe, RayQueueBoundary) for pipe in list_dps(dataset))
    except Exception:
        return True  # a graph that cannot be walked is not tried


def _try_each(loader: Any, streams: dict[int, StreamPosition], rules: Any) -> None:
    placement = current_placement()
    setup = ReplicaSetup(placement.rank, placement.world_size)
    for worker, position in sorted(streams.items()):
        state = position.snapshot[1] if position.snapshot is not None else None
        if state is None:
            continue  # a replica without a state: fast-forwarded, nothing to load
        graph = rules.copy_graph(loader.dataset)
        replica.prepare(graph, setup, worker, max(loader.num_workers, 1))
        try:
            iterator = resumed_iterator(graph, state)
        except Exception as error:
            raise IncompatibleStateError(
                f"cannot load this state: epoch.streams.{worker}.snapshot is not a state that worker "
                f"{worker}'s replica of {type(loader.dataset).__name__} takes: its load_state_dict() "
                f"raised {type(error).__name__}: {error}") from error
        close = getattr(iterator, "close", None)
        if callable(close):
            with contextlib.suppress(Exception):
                close()
