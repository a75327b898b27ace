"""``pipe.queue_boundary("ray", buffer_size, num_actors=N, ...)``: upstream stages on a Ray cluster."""

from __future__ import annotations

import itertools
import math
from collections.abc import Iterator
from typing import Any, TypeVar

from pipeload.datapipes.base import IterDataPipe
from pipeload.datapipes.boundary.feed import is_one_items_error
from pipeload.datapipes.boundary.ray_cluster import connected_address
from pipeload.datapipes.boundary.ray_options import check_actor_options
from pipeload.datapipes.graph import has_sharding
from pipeload.datapipes.iter._columns import check_positive, length_of
from pipeload.datapipes.protocol import NotAvailable, Notifier, PipeIterator

T_co = TypeVar("T_co", covariant=True)
_names = itertools.count()


class RayQueueBoundary(IterDataPipe[T_co]):
    """Run everything upstream of this point in Ray actors (functional form:
    ``queue_boundary("ray", ...)``).

    Each run starts ``num_actors`` actors; actor ``a`` runs shard ``a`` of the upstream part of the
    graph (its sharding pipes' shard cut again into ``num_actors`` interleaved pieces, so under
    a DataLoader the split is rank x worker x actor), and this side reads their items back in
    round-robin order: each exactly once, at most ``buffer_size`` asked for and not yet handed
    downstream. Large CPU tensors and numpy arrays come through Ray's object store without
    copies. An exception upstream arrives with its type and the actor's traceback; an actor
    that dies is a ``WorkerDiedError`` naming it and what it was making, unless
    ``max_restarts`` lets Ray restart it: it then resumes from its latest upstream state and
    the epoch completes with every item once.

    Random pipes upstream that have no seed get one drawn (the same in every actor) from a
    number taken from torch's global generator when the run starts; the DataLoader's seeds,
    when it set them, are kept, and then the run draws nothing from the global generator (the
    loop's random numbers are those of the same graph without the boundary). Under a
    DataLoader, each worker's and rank's copy of the graph mixes its place into that number
    (``set_replica``), so the actors of different workers and ranks draw different random
    values (and shuffle unseeded pipes differently), the same again for the same loader seed.
    A seed given with ``set_seed`` seeds the next run only, as in one process.

    Args:
        datapipe: the upstream part of the graph (it needs a ``sharding_filter()`` when
            ``num_actors`` > 1; lambdas are fine, Ray pickles them by value).
        buffer_size: items asked for and not yet handed downstream, over all actors.
        num_actors: actors, one shard each.
        chunk_size: items per request (default: half an actor's share of ``buffer_size``).
        address: the cluster to join when this process is not connected yet (default:
            ``RAY_ADDRESS``, else a new local cluster in a main process).
        init_options: more keyword arguments for ``ray.init`` when the boundary connects.
        start_timeout_s: an actor not started by then (the cluster lacks what it asks for) is
            a ``TimeoutError`` naming it.
        **actor_options: passed to the actor class's ``.options()``: ``num_cpus``,
            ``resources``, ``runtime_env``, ``max_restarts``, ``scheduling_strategy``, ...;
            checked when the pipe is built (``name``, ``get_if_exists`` and a
            ``max_concurrency`` other than 1 cannot work for the boundary's actors).

    Raises:
        TypeError, ValueError: an argument or actor option that cannot work, named with its
            value, before anything connects or starts.

    Example:
        >>> decoded = (IterableWrapper(paths).sharding_filter().map(decode_jpeg)
        ...            .queue_boundary("ray", buffer_size=64, num_actors=4, num_cpus=1))
        >>> batches = decoded.batch(32).collate()
    """

    _parent_fields = ("datapipe",)

    def __init__(
        self,
        datapipe: IterDataPipe,
        buffer_size: int = 8,
        num_actors: int = 1,
        *,
        chunk_size: int | None = None,
        address: str | None = None,
        init_options: dict[str, Any] | None = None,
        start_timeout_s: float = 300.0,
        **actor_options: Any,
    ) -> None:
        check_int(buffer_size, "buffer_size")
        check_positive(buffer_size, "buffer_size", "Buffer size")
        check_ray_arguments(num_actors, chunk_size, address, init_options, start_timeout_s)
        check_actor_options(actor_options)
        check_actors_fit_the_pipe(datapipe, buffer_size, num_actors, chunk_size)
        self.datapipe = datapipe
        self.buffer_size = buffer_size
        self.num_actors = num_actors
        self.chunk_size = chunk_size
        self.address = address
        self.init_options = dict(init_options or {})
        self.start_timeout_s = start_timeout_s
        self.actor_options = actor_options
        from pipeload.datapipes.boundary.ray_actors import ActorPool

        self._ray_actors = ActorPool()  # made here, so the copies made later share it

    def __iter__(self) -> Iterator[T_co]:
        from pipeload.datapipes.boundary.ray_upstream import RayOptions, RayUpstream

        options = RayOptions(self.num_actors, self.chunk_size, self.address,
                             tuple(self.actor_options.items()), tuple(self.init_options.items()),
                             start_timeout_s=self.start_timeout_s, replica=self.__dict__.get("_replica"))
        from pipeload.datapipes.boundary.ray_actors import ActorPool

        pool = self.__dict__.get("_ray_actors")
        if pool is None:  # a pipe unpickled from a state made before pools were shared
            pool = self._ray_actors = ActorPool()
        name = f"pipeload-ray-{next(_names)}"
        upstream = RayUpstream(self.datapipe, self.buffer_size, options, name, pool, self._tally())
        return _RayBoundaryIterator(upstream)

    def set_replica(self, num_replicas: int, replica_id: int) -> None:
        """Say that this graph is copy ``replica_id`` of ``num_replicas`` (a DataLoader's workers
        x ranks; ``graph.apply_replica`` calls this): its actors then seed their generators
        apart from the other copies' actors (see ``boundary/seeds.py``).

        Raises:
            ValueError: not 0 <= ``replica_id`` < ``num_replicas`` (naming both).
        """
        from pipeload.datapipes.boundary.seeds import check_replica

        self._replica = check_replica(num_replicas, replica_id)

    def _tally(self) -> Any:
        from pipeload.datapipes.boundary.ray_upstream import RayTally

        tally = self.__dict__.get("_transient_ray_tally")
        if tally is None:
            tally = self._transient_ray_tally = RayTally()
        return tally

    def ray_stage_totals(self) -> Any:
        """What this pipe's runs in this process measured, as
        :class:`~pipeload.stats.RayStageStats` (the loader's ``stats()`` sums them)."""
        return self._tally().totals()

    def release_actors(self) -> None:
        """Kill the idle actors this pipe keeps for its next run now (they also go when the pipe
        is freed). The pool stays, shared with this pipe's copies, for the runs to come."""
        pool = self.__dict__.get("_ray_actors")
        if pool is not None:
            pool.let_idle_go()

    def __len__(self) -> int:
        return length_of(self.datapipe, self)

    def __getstate__(self) -> dict[str, Any]:
        # A worker that unpickles this joins the cluster this process is on (spawn and
        # forkserver workers inherit no connection).
        state = super().__getstate__()
        if state["address"] is None:
            state["address"] = connected_address()
        return state


def check_int(value: Any, name: str, none: bool = False) -> None:
    """TypeError naming ``name`` unless ``value`` is an int (not a bool; or None when ``none``)."""
    if value is None and none:
        return
    if isinstance(value, bool) or not isinstance(value, int):
        raise TypeError(f"queue_boundary('ray') {name} should be an int{' or None' * none}, "
                        f"but got {name}={value!r}")


def check_ray_arguments(num_actors: Any, chunk_size: Any, address: Any, init_options: Any,
                        start_timeout_s: Any) -> None:
    """Refuse, naming it, an argument of a Ray boundary (or queue) that cannot work, before
    anything connects or starts."""
    check_int(num_actors, "num_actors")
    check_positive(num_actors, "num_actors", "Number of actors")
    check_int(chunk_size, "chunk_size", none=True)
    if chunk_size is not None:
        check_positive(chunk_size, "chunk_size", "Chunk size")
    if address is not None and not isinstance(address, str):
        raise TypeError(f"queue_boundary('ray') address should be a str or None, but got address={address!r}")
    if init_options is not None and not isinstance(init_options, dict):
        raise TypeError("queue_boundary('ray') init_options should be a dict of ray.init() keyword "
                        f"arguments or None, but got init_options={init_options!r}")
    timeout_ok = isinstance(start_timeout_s, (int, float)) and not isinstance(start_timeout_s, bool)
    expected = f"start_timeout_s should be a number of seconds > 0, but got start_timeout_s={start_timeout_s!r}"
    if not timeout_ok:
        raise TypeError(f"queue_boundary('ray') {expected}")
    if not 0 < start_timeout_s < math.inf:
        raise ValueError(f"queue_boundary('ray') {expected}")


def check_room(buffer_size: int, num_actors: int, chunk_size: int | None, size_name: str = "buffer_size") -> None:
    """Refuse room for fewer items than ``num_actors`` (each is asked for one at least), or a
    ``chunk_size`` larger than an actor's share of it (it was cut to the share without a word)."""
    if buffer_size < num_actors:
        raise ValueError(
            f"queue_boundary('ray') needs {size_name} >= num_actors (each actor is asked for at "
            f"least one item at a time), but got {size_name}={buffer_size}, num_actors={num_actors}"
        )
    share = buffer_size // num_actors
    if chunk_size is not None and chunk_size > share:
        raise ValueError(
            f"queue_boundary('ray') chunk_size should be at most each actor's share of {size_name} "
            f"({size_name} // num_actors = {share}), but got chunk_size={chunk_size} "
            f"({size_name}={buffer_size}, num_actors={num_actors})"
        )


def check_actors_fit_the_pipe(datapipe: Any, buffer_size: int, num_actors: int, chunk_size: int | None,
                              size_name: str = "buffer_size") -> None:
    """Refuse ``num_actors`` actors over ``datapipe`` with room for ``buffer_size`` items, asked
    for ``chunk_size`` at a time.

    Raises:
        ValueError: fewer items of room than actors (each is asked for one at least), a chunk
            larger than an actor's share of the room (it was cut to the share without a word),
            or several actors over a pipe with no ``sharding_filter()`` (each would yield every
            item).
    """
    check_room(buffer_size, num_actors, chunk_size, size_name)
    if num_actors > 1 and not has_sharding(datapipe):
        raise ValueError(
            f"queue_boundary('ray', num_actors={num_actors}) needs a sharding_filter() upstream: "
            f"without one every actor would yield every item of {datapipe!r}"
        )


class _RayBoundaryIterator(PipeIterator[Any]):
    """The downstream end of one run: takes from the actors' replies, never waits itself, and
    can say where each shard stands."""

    def __init__(self, upstream: Any) -> None:
        super().__init__()
        self._upstream = upstream

    def nonblocking_next(self) -> Any:
        try:
            return self._upstream.take_nowait()
        except NotAvailable:
            raise
        except BaseException as error:
            # The end, or an error: the actors go now, not when a traceback lets go of this run;
            # one item's error is raised in its place, and the run goes on.
            if not is_one_items_error(error):
                self._upstream.close()
            raise

    def notifiers(self) -> list[Notifier]:
        return self._upstream.notifiers()

    def close(self) -> None:
        self._upstream.close()

    def stats(self) -> Any:
        """This run's :class:`~pipeload.stats.RayStageStats`."""
        return self._upstream.stats()

    def _own_state(self) -> Any:
        return self._upstream.state_dict()

    def _check_own_state(self, fields: Any) -> Any:
        return self._upstream.checked_state(fields.fields("own"))

    def _load_own_state(self, state: Any) -> None:
        self._upstream.load_state_dict(state)
