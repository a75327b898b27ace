"""Whole-graph functions: walk, find, replace, copy, shard and seed.

They work on our pipes and on torch's (``torch.utils.data.datapipes``), mixed or not. A pipe's
parents are its declared parent fields (built-in pipes) or the pipes found among its attributes
(anything else, as torch finds them), so a user's own pipe class needs nothing special.
``apply_sharding`` and ``apply_random_seed`` behave as torch's ``graph_settings`` functions of
the same names, with the same random draws, so a graph seeded from the same generator shuffles
the same way under either loader. ``traverse_dps`` and ``get_all_graph_pipes`` are torch's
(``torch.utils.data.graph`` and ``graph_settings``), with its representation. Sharding also
reaches pipes that take the RFC's hooks (``is_shardable()`` / ``sharding_settings(total, id)``).
"""

from __future__ import annotations

import copy
import inspect
import warnings
from collections import deque
from typing import Any

import torch

from pipeload._user_frame import first_frame_outside_pipeload
from pipeload.datapipes.base import IterDataPipe, MapDataPipe, is_datapipe, parent_slots
from pipeload.datapipes.iter.sharding import SHARDING_PRIORITIES

__all__ = [
    "DataPipe",
    "DataPipeGraph",
    "apply_random_seed",
    "apply_replica",
    "apply_sharding",
    "apply_shuffle_settings",
    "asks_to_be_sharded",
    "copy_graph",
    "find_dps",
    "get_all_graph_pipes",
    "has_sharding",
    "is_random_datapipe",
    "is_sharding_datapipe",
    "list_dps",
    "parents_of",
    "remove_dp",
    "replace_dp",
    "replaced_in_a_copy",
    "traverse",
    "traverse_dps",
]

DataPipe = Any  # an IterDataPipe or MapDataPipe, ours or torch's
DataPipeGraph = dict[int, tuple[Any, "DataPipeGraph"]]


def parents_of(datapipe: Any) -> list[Any]:
    """The pipes ``datapipe`` reads from, in order (ours declare them; others are scanned)."""
    return [parent for _, parent in parent_slots(datapipe)]


def traverse_dps(datapipe: Any) -> DataPipeGraph:
    """The graph above ``datapipe`` as torch represents it: ``{id: (pipe, {parents' graphs})}``.

    Raises:
        RuntimeError: ``datapipe`` is not a pipe (torch's wording).
    """
    return _traverse(datapipe, frozenset())


def traverse(datapipe: Any, only_datapipe: bool | None = None) -> DataPipeGraph:
    """torch's older name for :func:`traverse_dps` (``only_datapipe`` is accepted and changes
    nothing: pipes are found wherever they are held). Warns, as torch does, that it is going.
    """
    warnings.warn(
        "`traverse` is deprecated, as in torch: use `traverse_dps` (pipeload finds the same "
        f"pipes either way; only_datapipe={only_datapipe!r} changes nothing)",
        FutureWarning,
        stacklevel=2,
    )
    return traverse_dps(datapipe)


def get_all_graph_pipes(graph: DataPipeGraph) -> list[Any]:
    """Every pipe of a :func:`traverse_dps` graph, each once, each before its parents (torch's
    ``graph_settings.get_all_graph_pipes``).

    Example:
        >>> dp = IterableWrapper(range(4)).shuffle().batch(2)
        >>> [type(p).__name__ for p in get_all_graph_pipes(traverse_dps(dp))]
        ['Batcher', 'Shuffler', 'IterableWrapper']
    """
    found: list[Any] = []
    seen: set[int] = set()

    def visit(subgraph: DataPipeGraph) -> None:
        for pipe_id, (pipe, parents) in subgraph.items():
            if pipe_id in seen:
                continue
            seen.add(pipe_id)
            found.append(pipe)
            visit(parents)

    visit(graph)
    return found


def _traverse(datapipe: Any, on_path: frozenset[int]) -> DataPipeGraph:
    if not is_datapipe(datapipe):
        raise RuntimeError(f"Expected `IterDataPipe` or `MapDataPipe`, but {type(datapipe)} is found")
    here = id(datapipe)
    if here in on_path:
        return {}  # a cycle: the pipe is already on this path
    parents: DataPipeGraph = {}
    for parent in parents_of(datapipe):
        parents.update(_traverse(parent, on_path | {here}))
    return {here: (datapipe, parents)}


def _last_pipe(graph: Any, function: str) -> Any:
    """The last pipe of ``graph``: a pipe, or a :func:`traverse_dps` graph of one, which
    torchdata's graph functions take (its result read as a pipe found nothing in it)."""
    if isinstance(graph, dict):
        if len(graph) != 1:
            raise ValueError(f"{function}: a traverse_dps() graph has one last pipe, but this one has "
                             f"{len(graph)}")
        ((last, _),) = graph.values()
        return last
    if not is_datapipe(graph):
        raise TypeError(f"{function}: expected a DataPipe or a traverse_dps() graph, but got "
                        f"{type(graph).__name__}")
    return graph


def list_dps(datapipe: Any, exclude_dps: Any = None) -> list[Any]:
    """Every pipe in the graph above (and including) ``datapipe``, each once, root first
    (depth-first, parents in order: the order torch's graph functions use).

    Args:
        datapipe: the graph's last pipe, or its :func:`traverse_dps` graph (as torchdata takes).
        exclude_dps: a pipe or list of pipes to leave out, with everything above them.
    """
    datapipe = _last_pipe(datapipe, "list_dps")
    excluded = {id(dp) for dp in _as_list(exclude_dps)}
    found: list[Any] = []
    seen: set[int] = set()
    stack = [datapipe]
    while stack:
        node = stack.pop()
        if id(node) in seen or id(node) in excluded:
            continue
        seen.add(id(node))
        found.append(node)
        stack.extend(reversed(parents_of(node)))
    return found


def _as_list(value: Any) -> list[Any]:
    if value is None:
        return []
    return list(value) if isinstance(value, (list, tuple)) else [value]


def find_dps(datapipe: Any, dp_type: type | tuple[type, ...]) -> list[Any]:
    """The pipes of type ``dp_type`` in the graph (a pipe or its :func:`traverse_dps` graph),
    in :func:`list_dps` order."""
    return [dp for dp in list_dps(_last_pipe(datapipe, "find_dps")) if isinstance(dp, dp_type)]


def replace_dp(datapipe: Any, old_dp: Any, new_dp: Any) -> Any:
    """Make every pipe of ``datapipe``'s graph that reads from ``old_dp`` read from ``new_dp``
    instead, in place, as torchdata's ``replace_dp`` does (code written for it keeps using the
    pipe it built). ``new_dp`` may itself read from ``old_dp`` (a pipe put after it). Returns the
    graph's last pipe (``new_dp`` when ``old_dp`` was it), or, given a :func:`traverse_dps`
    graph (as torchdata's takes), that pipe's graph. To leave the graph as it is, replace in a
    :func:`copy_graph` of it, or see :func:`replaced_in_a_copy`.

    Example:
        >>> dp = IterableWrapper(range(9)).shuffle().batch(3)
        >>> (shuffle,) = find_dps(dp, Shuffler)
        >>> dp = replace_dp(dp, shuffle, shuffle.datapipe)  # dp batches in order now
    """
    last = _last_pipe(datapipe, "replace_dp")
    nodes = list_dps(last)
    if not any(node is old_dp for node in nodes):
        raise ValueError(f"replace_dp: {old_dp!r} is not in the graph of {last!r}")
    swap = {id(old_dp): new_dp}
    for node in nodes:  # the graph as it was: new_dp's own reading from old_dp stays
        state = vars(node) if node is not old_dp else {}
        for name in {name for name, parent in parent_slots(node) if parent is old_dp}:
            state[name] = _substitute(state[name], swap)
    result = new_dp if last is old_dp else last
    return traverse_dps(result) if isinstance(datapipe, dict) else result


def replaced_in_a_copy(datapipe: Any, old_dp: Any, new_dp: Any) -> Any:
    """A graph like ``datapipe``'s (its last pipe) with ``old_dp`` replaced by ``new_dp``, the
    original left as it was: the pipes between ``old_dp`` and the end are copied with their new
    parents, the rest shared. The loader places process boundaries so (placement.py): the
    user's graph is never changed."""
    if not any(node is old_dp for node in list_dps(datapipe)):
        raise ValueError(f"replaced_in_a_copy: {old_dp!r} is not in the graph of {datapipe!r}")
    return _rebuild(datapipe, {id(old_dp): new_dp}, {}, copy_all=False)


def remove_dp(datapipe: Any, dp: Any) -> Any:
    """Take ``dp`` out of ``datapipe``'s graph, in place, as torchdata's ``remove_dp`` does: the
    pipes that read from it read from its parent instead. Returns as :func:`replace_dp` does.

    Raises:
        ValueError: ``dp`` has no parent or several (there is nothing to reconnect it to), or it
            is the graph's last pipe.
    """
    parents = parents_of(dp)
    if len(parents) != 1:
        raise ValueError(f"remove_dp needs a pipe with exactly one parent; {dp!r} has {len(parents)}")
    if dp is _last_pipe(datapipe, "remove_dp"):
        raise ValueError(f"remove_dp cannot remove the graph's last pipe {dp!r}; use its parent instead")
    return replace_dp(datapipe, dp, parents[0])


def copy_graph(datapipe: Any) -> Any:
    """A copy of every pipe in the graph, wired the same way; the data they hold is shared.

    Run state (caches, a fork's live run) is not copied. Thread workers each shard and seed
    their own copy.
    """
    return _rebuild(datapipe, {}, {}, copy_all=True)


def _rebuild(node: Any, swap: dict[int, Any], memo: dict[int, Any], copy_all: bool) -> Any:
    if id(node) in memo:
        return memo[id(node)]
    if id(node) in swap:
        memo[id(node)] = swap[id(node)]
        return memo[id(node)]
    parents = parents_of(node)
    rebuilt = {id(p): _rebuild(p, swap, memo, copy_all) for p in parents}
    if copy_all or any(rebuilt[id(p)] is not p for p in parents):
        result = _copy_with_parents(node, rebuilt)
    else:
        result = node
    memo[id(node)] = result
    return result


def _copy_with_parents(node: Any, rebuilt: dict[int, Any]) -> Any:
    fresh = copy.copy(node)
    # Built-in pipes keep no run state on themselves; anyone else's pipe (torch's, a user's
    # subclass of ours) may, and its copy must not share it.
    ours = isinstance(node, (IterDataPipe, MapDataPipe)) and getattr(node, "_parent_fields", None) is not None
    names = {name for name, _ in parent_slots(node)}
    for name, value in list(vars(fresh).items()):
        if name in names:
            setattr(fresh, name, _substitute(value, rebuilt))
        elif not ours and isinstance(value, (dict, list, set, deque)):
            # torch's pipes change such attributes in place (a sharding filter's groups):
            # the copy must not share them with the original.
            setattr(fresh, name, copy.copy(value))
    return fresh


def _substitute(value: Any, rebuilt: dict[int, Any]) -> Any:
    if is_datapipe(value):
        return rebuilt.get(id(value), value)
    if isinstance(value, (list, tuple)):
        items = [_substitute(item, rebuilt) for item in value]
        return type(value)(items) if not hasattr(value, "_fields") else type(value)(*items)
    if isinstance(value, dict):
        return {key: _substitute(item, rebuilt) for key, item in value.items()}
    return value


# -- sharding and seeding ----------------------------------------------------------------------


def is_sharding_datapipe(datapipe: Any) -> bool:
    """A pipe that can be told its shard: ``sharding_filter``, a source with ``apply_sharding``
    (torch's hook), or a pipe whose ``is_shardable()`` says True (the RFC's hook)."""
    return inspect.ismethod(getattr(datapipe, "apply_sharding", None)) or asks_to_be_sharded(datapipe)


def asks_to_be_sharded(datapipe: Any) -> bool:
    """Whether ``datapipe`` answers True to the RFC's ``is_shardable()``."""
    ask = getattr(datapipe, "is_shardable", None)
    return callable(ask) and bool(ask())


def has_sharding(datapipe: Any) -> bool:
    """Whether the graph has a place where it splits across workers and ranks."""
    return any(is_sharding_datapipe(dp) for dp in list_dps(datapipe))


def apply_sharding(
    datapipe: Any,
    num_of_instances: int,
    instance_id: int,
    sharding_group: SHARDING_PRIORITIES = SHARDING_PRIORITIES.DEFAULT,
) -> Any:
    """Tell every sharding pipe in the graph to yield shard ``instance_id`` of ``num_of_instances``.

    Changes the pipes in place (as torch's function does) and returns ``datapipe``.

    The RFC's pipes that answer ``is_shardable()`` say where the data *may* be split: of those
    on one path, only the one furthest upstream is.

    Raises:
        RuntimeError: two sharding pipes of torch's kind on one path (every item would be
            dropped twice over).
    """

    def visit(graph: DataPipeGraph, applied: Any) -> None:
        for pipe, parents in graph.values():
            here = applied
            if _rfc_only(pipe) and _shards_upstream(parents):
                pass  # the RFC's pipes say where sharding may happen: the first on the path does
            elif is_sharding_datapipe(pipe):
                if applied is not None:
                    raise RuntimeError(
                        "Sharding twice on a single pipeline is likely unintended and will cause "
                        f"data loss. Sharding already applied to {applied} while trying to apply "
                        f"to {pipe}"
                    )
                _shard(pipe, num_of_instances, instance_id, sharding_group)
                here = pipe
            visit(parents, here)

    visit(traverse_dps(datapipe), None)
    return datapipe


def _rfc_only(pipe: Any) -> bool:
    """A pipe that may be sharded by the RFC's hooks alone (``is_shardable()``, no torch
    ``apply_sharding``): one place among others where the DataLoader may split the data."""
    return asks_to_be_sharded(pipe) and not inspect.ismethod(getattr(pipe, "apply_sharding", None))


def _shards_upstream(graph: DataPipeGraph) -> bool:
    """Whether a pipe upstream in ``graph`` is (or may be) sharded: the RFC's chain of shardable
    pipes (load, decode, transform) is split once, at its source, where the least work is
    repeated; a torch sharding pipe upstream is sharded in its stead."""
    return any(is_sharding_datapipe(pipe) or _shards_upstream(parents) for pipe, parents in graph.values())


def _shard(pipe: Any, num_of_instances: int, instance_id: int, sharding_group: Any) -> None:
    if not inspect.ismethod(getattr(pipe, "apply_sharding", None)):
        settings = getattr(pipe, "sharding_settings", None)
        if not callable(settings):
            raise TypeError(
                f"{pipe!r}.is_shardable() is True, but it has no sharding_settings("
                "total_num_of_shards, id_of_shard) method to be told its shard"
            )
        settings(num_of_instances, instance_id)
        return
    if len(inspect.signature(pipe.apply_sharding).parameters) < 3:
        pipe.apply_sharding(num_of_instances, instance_id)  # older pipes take no group
    else:
        pipe.apply_sharding(num_of_instances, instance_id, sharding_group=sharding_group)


def is_random_datapipe(datapipe: Any) -> bool:
    """A pipe that draws random numbers and can be seeded (it has ``set_seed``)."""
    return inspect.ismethod(getattr(datapipe, "set_seed", None))


def apply_random_seed(datapipe: Any, rng: torch.Generator) -> Any:
    """Seed every random pipe in the graph with a number drawn from ``rng``, in graph order.

    The draws are torch's (one int64 per random pipe, in :func:`list_dps` order), so the same
    generator state seeds the same graph identically under pipeload and torch.
    """
    for pipe in list_dps(datapipe):
        if is_random_datapipe(pipe):
            pipe.set_seed(int(torch.empty((), dtype=torch.int64).random_(generator=rng).item()))
    return datapipe


def apply_replica(datapipe: Any, num_replicas: int, replica_id: int) -> Any:
    """Tell every pipe of the graph that runs its upstream elsewhere (a process or Ray queue
    boundary: a pipe with ``set_replica``) that this graph is copy ``replica_id`` of
    ``num_replicas`` (the DataLoader's workers x ranks, numbered as for ``apply_sharding``).

    The shared seed that ``apply_random_seed`` gives every copy alike makes a boundary's far
    side seed alike in every copy too; knowing its copy, each one draws its own random streams.
    Changes the pipes in place and returns ``datapipe``.
    """
    for pipe in list_dps(datapipe):
        tell = getattr(pipe, "set_replica", None)
        if inspect.ismethod(tell):
            tell(num_replicas, replica_id)
    return datapipe


def apply_shuffle_settings(datapipe: Any, shuffle: bool | None = None) -> Any:
    """Turn every shuffle in the graph on or off; ``shuffle=True`` with none adds one at the end.

    Returns the (possibly new) last pipe. ``None`` changes nothing.
    """
    if shuffle is None:
        return datapipe
    shufflers = [dp for dp in list_dps(datapipe) if _is_shuffler(dp)]
    if not shufflers and shuffle:
        warnings.warn(
            "`shuffle=True` was set, but the datapipe does not contain a `Shuffler`. Adding one at "
            "the end. Be aware that the default buffer size might not be sufficient for your task.",
            stacklevel=first_frame_outside_pipeload(),
        )
        datapipe = datapipe.shuffle()
        shufflers = [datapipe]
    for shuffler in shufflers:
        shuffler.set_shuffle(shuffle)
    return datapipe


def _is_shuffler(datapipe: Any) -> bool:
    return is_random_datapipe(datapipe) and inspect.ismethod(getattr(datapipe, "set_shuffle", None))

