"""Each copy of the dataset, made ready before it yields anything: the one place for it.

A worker (or the main process, without workers) holds its own copy of the dataset. When that
dataset is a DataPipe graph, the copy must

- keep only its share: the graph's sharding pipes are told ``num_workers * world_size`` shards
  and this copy's index ``worker_id * world_size + rank`` (ranks interleave within each worker,
  so the data splits evenly over ranks first), and
- shuffle like every other copy: each random pipe of the graph gets a seed drawn, in graph
  order, from a generator seeded with one seed shared by all workers and ranks. The copies then
  shuffle identically and the sharding pipes after the shuffle split one order, not several.
- know which copy it is, where a pipe runs its upstream elsewhere (a process or Ray queue
  boundary): the far side seeds its own generators from the shared seed and the copy's index,
  so each worker and rank has its own random streams there, as its own process has.

That is what torch's DataLoader does for torch's DataPipes, and doing it the same way gives the
same samples in the same order for the same seed. The main process draws the shared seed
(:func:`draw_shared_seed`); the worker loop and the inline engine call :func:`prepare` once per
session and :func:`reseed` for each later epoch. Thread workers first take their own copy
(:func:`thread_replica`), since threads would otherwise share one graph and its cursors.

The RFC's hooks are honoured for both families: a pipe whose ``is_shardable()`` is True is told
its shard through ``sharding_settings(total_num_of_shards, id_of_shard)`` where torch's pipes get
``apply_sharding``, and a pipe whose ``is_separate_process()`` is True runs, with what feeds it,
behind a process boundary the loader places (:func:`separate_processes`).

Graph families: torch's DataPipes (``torch.utils.data.datapipes``) and pipeload's own
(``pipeload.datapipes``: ``base.IterDataPipe``/``base.MapDataPipe``,
``graph.apply_sharding(pipe, num_shards, shard_id)``, ``graph.apply_random_seed(pipe, generator)``,
``graph.list_dps(pipe)`` and ``graph.copy_graph(pipe)``). Both follow the same rules here,
including what ``shuffle=`` does and the warning for a graph that several copies read whole.
"""

from __future__ import annotations

import copy
import functools
import inspect
import sys
import threading
import warnings
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch

from pipeload._user_frame import first_frame_outside_pipeload
from pipeload.distributed import share_from_rank0
from pipeload.engine.plan import DatasetKind, ReplicaSetup

# torch walks a graph by pickling it with a class-wide hook installed, and refuses a second walk
# while one is in progress; copying a graph during a walk would run that hook. Thread workers of
# one process prepare their copies at the same moment, so every walk and copy here takes turns.
_GRAPH_WALK = threading.Lock()


@dataclass(frozen=True)
class GraphRules:
    """How to shard, seed and (un)shuffle one family of DataPipe graphs.

    Attributes:
        iterable_type: the family's iterable pipe base; only such graphs get a shared seed
            (torch draws none for map-style graphs).
        map_type: the family's map-style pipe base (sharded, never seeded).
        apply_sharding: ``(graph, num_shards, shard_id)``; tells every sharding pipe its share.
        apply_random_seed: ``(graph, generator)``; seeds every random pipe from the generator.
        list_pipes: ``(graph)``; every pipe of the graph, each once (None: the family cannot
            list them, so ``shuffle=`` and the unsharded-graph warning do not apply to it).
        copy_graph: ``(graph)``; a thread worker's copy of the graph (None: ``copy.deepcopy``).
        shards_by_hooks: ``apply_sharding`` leaves the RFC's ``is_shardable()`` pipes to us.
        apply_replica: ``(graph, num_replicas, replica_id)``; tells the pipes that seed a far
            side of their own (queue boundaries) which copy this is (None: the family has none).
    """

    iterable_type: type
    map_type: type
    apply_sharding: Callable[[Any, int, int], Any]
    apply_random_seed: Callable[[Any, torch.Generator], Any]
    list_pipes: Callable[[Any], list[Any]] | None
    copy_graph: Callable[[Any], Any] | None = None
    shards_by_hooks: bool = False
    apply_replica: Callable[[Any, int, int], Any] | None = None


def graph_rules(dataset: Any) -> GraphRules | None:
    """The rules for ``dataset``'s graph family, or None when it is not a DataPipe graph."""
    for rules in _known_families():
        if isinstance(dataset, (rules.iterable_type, rules.map_type)):
            return rules
    return None


def draws_shared_seed(dataset: Any) -> bool:
    """True for iterable DataPipe graphs: each session and epoch draws a seed for their shuffles."""
    rules = graph_rules(dataset)
    return rules is not None and isinstance(dataset, rules.iterable_type)


def draw_shared_seed(generator: torch.Generator | None, share: bool = True) -> int:
    """One int64 from ``generator`` (the global RNG when None), rank 0's value on every rank.

    Every rank draws, so each rank's random stream advances as torch's does. With ``share`` all
    ranks must call this together (it is a broadcast when a process group is initialised);
    ``share=False`` only keeps the stream in step, for a seed torch draws and never uses.
    """
    seed = int(torch.empty((), dtype=torch.int64).random_(generator=generator).item())
    return share_from_rank0(seed) if share else seed


def has_random_pipes(dataset: Any) -> bool:
    """Whether ``dataset`` is a DataPipe graph with a pipe that draws random numbers (one with a
    ``set_seed`` method, the rule both families seed by)."""
    rules = graph_rules(dataset)
    if rules is None or rules.list_pipes is None:
        return False
    with _GRAPH_WALK:
        pipes = rules.list_pipes(dataset)
    return any(inspect.ismethod(getattr(pipe, "set_seed", None)) for pipe in pipes)


def prepare(dataset: Any, replica: ReplicaSetup, worker_id: int, num_workers: int) -> None:
    """Seed and shard this copy of ``dataset`` in place; nothing to do unless it is a graph.

    The inline engine is one worker of one: its copy is sharded by rank alone.
    """
    rules = graph_rules(dataset)
    if rules is None:
        return
    if replica.shared_seed is not None:
        reseed(dataset, replica.shared_seed)
    shards = num_workers * replica.world_size
    index = worker_id * replica.world_size + replica.rank
    with _GRAPH_WALK:
        # A map graph is a map-style dataset: the sampler spreads its indices over the workers
        # and ranks already, and a map pipe that also took its shard split them twice (index
        # 15 of 30 out of range in a worker holding 15). torch shards no map graph either.
        if isinstance(dataset, rules.iterable_type):
            rules.apply_sharding(dataset, shards, index)
            if rules.shards_by_hooks and rules.list_pipes is not None:
                _shard_by_hooks(rules.list_pipes(dataset), shards, index)
        if rules.apply_replica is not None:  # the shared seed alone would seed them alike
            rules.apply_replica(dataset, shards, index)


def _shard_by_hooks(pipes: list[Any], shards: int, index: int) -> None:
    """Tell the pipes that take the RFC's hook (``is_shardable()``) their shard, in a family
    whose ``apply_sharding`` does not (torch's)."""
    for pipe in pipes:
        if _asks(pipe, "is_shardable") and not callable(getattr(pipe, "apply_sharding", None)):
            pipe.sharding_settings(shards, index)


def _asks(pipe: Any, hook: str) -> bool:
    ask = getattr(pipe, hook, None)
    return callable(ask) and bool(ask())


def separate_processes(dataset: Any, worker_type: str | None, context: Any = None) -> tuple[Any, tuple[str, ...]]:
    """The dataset the engine runs, with a process boundary after each pipe that asks for a
    process of its own (``is_separate_process()``), and where each request was answered.

    The boundary is placed with or without workers: each worker's copy of the graph starts its
    own process when it is iterated. A process worker is a daemon, which multiprocessing lets
    start no process; the boundary's upstream process leaves by itself when its parent dies, so
    it is started there all the same (``lifecycle.start_process``), and is stopped with the
    worker's run of the graph.
    """
    if "pipeload.datapipes.base" not in sys.modules or graph_rules(dataset) is None:
        return dataset, ()  # not a graph, or no pipeload pipe exists here: nothing can ask
    from pipeload.datapipes import placement

    with _GRAPH_WALK:
        placed, placements = placement.place_separate_processes(dataset, context)
    each = f" (one for each {worker_type} worker's copy)" if worker_type in ("thread", "process") else ""
    return placed, tuple(f"{p}{each}" for p in placements)


def release_boundary_slabs(dataset: Any) -> None:
    """Free the slabs the process boundaries of ``dataset``'s graph keep between runs, and those
    of the copies thread workers made of them (``QueueBoundary.release_shared_memory``): a
    loader's request to free its shared memory reaches its graph's pools too."""
    rules = graph_rules(dataset) if "pipeload.datapipes.base" in sys.modules else None
    if rules is None or rules.list_pipes is None:
        return  # not a graph, or no pipeload pipe exists here: no boundary keeps slabs
    from pipeload.datapipes.boundary.pipes import QueueBoundary

    with _GRAPH_WALK:
        pipes = rules.list_pipes(dataset)
    for pipe in pipes:
        if isinstance(pipe, QueueBoundary):
            pipe.release_shared_memory()


def reseed(dataset: Any, shared_seed: int | None) -> None:
    """Seed the random pipes of an iterable graph for a new epoch (same seed: same order)."""
    rules = graph_rules(dataset)
    if shared_seed is None or rules is None or not isinstance(dataset, rules.iterable_type):
        return
    generator = torch.Generator()
    generator.manual_seed(shared_seed)
    with _GRAPH_WALK:
        rules.apply_random_seed(dataset, generator)


def thread_replica(dataset: Any, kind: DatasetKind) -> Any:
    """The copy of ``dataset`` a thread worker iterates.

    Process workers each hold a copy by construction; threads would share one object. A graph is
    copied whole (its pipes hold the cursors and the sharding each worker sets); another
    iterable dataset is copied shallowly, which separates ``self`` state kept by ``__iter__``
    while the data it refers to stays shared. Map-style datasets are shared as they are.
    """
    rules = graph_rules(dataset)
    if rules is None and kind is not DatasetKind.ITERABLE:
        return dataset
    try:
        if rules is None:
            return copy.copy(dataset)
        with _GRAPH_WALK:
            return (rules.copy_graph or copy.deepcopy)(dataset)
    except Exception:
        return dataset  # an uncopyable dataset is shared, as it would be without this step


def apply_shuffle_option(dataset: Any, shuffle: bool | None) -> bool | None:
    """Hand the DataLoader's ``shuffle`` to an iterable graph's shuffle pipes.

    Returns what is left for the ordinary argument checks: None when the graph took it, else
    ``shuffle`` unchanged (an iterable dataset that is not a graph refuses ``shuffle=True``).
    """
    rules = graph_rules(dataset)
    if shuffle is None or rules is None or not isinstance(dataset, rules.iterable_type):
        return shuffle
    if rules.list_pipes is None:
        return shuffle
    with _GRAPH_WALK:
        _set_shuffles(rules.list_pipes(dataset), dataset, bool(shuffle))
    return None


def unsharded_warning(dataset: Any, copies_per_rank: int, world_size: int) -> str | None:
    """Why every copy of an iterable graph would yield every sample, or None when it would not.

    Several workers (or ranks) each iterating a graph with no sharding pipe load every sample
    once per copy. torch says nothing; the graph runs, only ``copies`` times over.
    """
    rules = graph_rules(dataset)
    copies = copies_per_rank * world_size
    if copies <= 1 or rules is None or rules.list_pipes is None or not isinstance(dataset, rules.iterable_type):
        return None
    with _GRAPH_WALK:
        pipes = rules.list_pipes(dataset)
    sharding = [pipe for pipe in pipes if callable(getattr(pipe, "apply_sharding", None)) or _asks(pipe, "is_shardable")]
    deaf = [pipe for pipe in sharding if _ignores_default_group(pipe)]
    if sharding and len(deaf) < len(sharding):
        return None
    copies_said = (f"This DataPipe graph is read by {copies} copies at once ({copies_per_rank} per rank × "
                   f"{world_size} ranks)")
    loaded = f"every copy yields every sample, so each sample is loaded {copies} times per epoch"
    if deaf:
        group = _group_name(deaf[0].sharding_group_filter)
        return (
            f"{copies_said}, but its sharding_filter obeys only SHARDING_PRIORITIES.{group}, "
            f"while the DataLoader splits a graph with the DEFAULT group (as torch's does): {loaded}. "
            "Use .sharding_filter() without a group."
        )
    return (
        f"{copies_said} but has no sharding_filter(): {loaded}. Add .sharding_filter() after the "
        "shuffle and before the expensive steps."
    )


def _ignores_default_group(pipe: Any) -> bool:
    """A sharding filter told to obey one group only (``sharding_filter(MULTIPROCESSING)``):
    the loader's split, in the DEFAULT group, leaves it passing everything through."""
    only = getattr(pipe, "sharding_group_filter", None)
    return only is not None and int(only) != _DEFAULT_GROUP


def _group_name(group: Any) -> str:
    return getattr(group, "name", str(group))


_DEFAULT_GROUP = 1  # SHARDING_PRIORITIES.DEFAULT, in torch's family and ours


def stages_without_checkpoint(dataset: Any) -> list[str]:
    """The queue boundaries of a pipeload DataPipe graph whose kind keeps no checkpoint (any but
    thread and process boundaries, ``prefetch`` included: see ``boundary/positions.py``), by class
    name and kind: a replica with one resumes by re-reading. Empty for anything else."""
    rules = graph_rules(dataset)
    if rules is None or rules.list_pipes is None or "pipeload.datapipes" not in sys.modules:
        return []
    try:
        from pipeload.datapipes.boundary.pipes import QueueBoundary
    except ImportError:  # a stand-in family
        return []
    with _GRAPH_WALK:
        pipes = rules.list_pipes(dataset)
    return sorted({f"{type(pipe).__name__} ({pipe.worker_type!r})" for pipe in pipes
                   if isinstance(pipe, QueueBoundary) and not pipe.keeps_checkpoints})


def _known_families() -> tuple[GraphRules, ...]:
    # pipeload's own first: its pipes may also subclass torch's.
    ours = _pipeload_family()
    return (ours, _torch_family()) if ours is not None else (_torch_family(),)


def _pipeload_family() -> GraphRules | None:
    # A pipeload pipe can only exist once its module is imported (unpickling imports it too), so
    # looking in sys.modules is enough, and a loader never imports the DataPipes package itself.
    base = sys.modules.get("pipeload.datapipes.base")
    if base is None:
        return None
    return _pipeload_rules(base)


@functools.cache
def _pipeload_rules(base: Any) -> GraphRules:
    from pipeload.datapipes import graph

    return GraphRules(
        base.IterDataPipe,
        base.MapDataPipe,
        graph.apply_sharding,
        graph.apply_random_seed,
        getattr(graph, "list_dps", None),
        getattr(graph, "copy_graph", None),
        apply_replica=getattr(graph, "apply_replica", None),
    )


@functools.cache
def _torch_family() -> GraphRules:
    from torch.utils.data import graph_settings
    from torch.utils.data.datapipes.datapipe import IterDataPipe, MapDataPipe

    return GraphRules(
        IterDataPipe,
        MapDataPipe,
        graph_settings.apply_sharding,
        graph_settings.apply_random_seed,
        _list_torch_pipes,
        shards_by_hooks=True,
    )


def _list_torch_pipes(graph: Any) -> list[Any]:
    from torch.utils.data.graph import traverse_dps
    from torch.utils.data.graph_settings import get_all_graph_pipes

    return get_all_graph_pipes(traverse_dps(graph))


def _set_shuffles(pipes: list[Any], graph: Any, shuffle: bool) -> None:
    """Turn every shuffle pipe of a graph on or off.

    A graph without one is left as it is: torch's DataLoader then shuffles nothing either (it
    warns that it adds a shuffle, but the pipe it adds is never used), so we say what happens.
    """
    shufflers = [
        pipe for pipe in pipes
        if callable(getattr(pipe, "set_shuffle", None)) and callable(getattr(pipe, "set_seed", None))
    ]
    if shuffle and not shufflers:
        # torch's sentence first (a filter written for it still matches), then what happens.
        warnings.warn(
            "`shuffle=True` was set, but the datapipe does not contain a `Shuffler`. Adding one at "
            "the end. Be aware that the default buffer size might not be sufficient for your task. "
            f"(pipeload: as with torch's loader, none is added after all, and shuffle=True has no "
            f"effect: the DataPipe graph {graph} has no shuffle step, so its samples come in their "
            "own order. Add .shuffle() to the graph where the order should be mixed.)",
            stacklevel=first_frame_outside_pipeload(),
        )
    for pipe in shufflers:
        pipe.set_shuffle(shuffle)
