"""The reading side of a Ray queue boundary: N actors, one shard each, read back in order.

Each actor runs its shard of the upstream graph (``ray_shard.py``) and answers requests for
chunks of items. This side keeps up to ``MAX_IN_FLIGHT`` requests queued at each actor, each
for ``chunk`` items, while the items asked for and not yet handed downstream stay within the
actor's share of ``buffer_size``: that is the backpressure, and the pipelining (an actor goes
from one chunk to the next while the previous one travels).

Order: item ``k`` of actor ``a`` comes before item ``k`` of actor ``a + 1`` and after item
``k - 1`` of the last actor: round-robin, as the shards were cut (interleaved), so a graph that
maps one to one after its sharding pipe yields the same order as in one process. A shard that
ends drops out of the round. Nothing here waits: an item not there yet is ``NotAvailable``, and
every request's future notifies the boundary's notifier when it completes.

Each actor's position is counted in items handed downstream; with the upstream states the
actors send every few chunks, that is the checkpoint (:meth:`RayUpstream.state_dict`) and what a
restarted actor resumes from: its latest state, then the items after it made again and
dropped, so every item is handed out exactly once.
"""

from __future__ import annotations

import concurrent.futures
import functools
import sys
import time
import weakref
from dataclasses import dataclass
from typing import Any

from pipeload._state_fields import StateFields
from pipeload.datapipes.boundary.feed import RaisedUpstream
from pipeload.datapipes.boundary.ray_actors import (
    ActorPool,
    RunActors,
    actor_class,
    let_other_pools_go,
)
from pipeload.datapipes.boundary.ray_cluster import check_actors_fit, connect, fit_now
from pipeload.datapipes.boundary.ray_dropped import flag_for
from pipeload.datapipes.boundary.ray_lane import Lane, ShardEnded
from pipeload.datapipes.boundary.seeds import Replica, run_seed, take_seeds
from pipeload.datapipes.protocol import NotAvailable, Notifier
from pipeload.engine.worker_info import get_worker_info
from pipeload.errors import IncompatibleStateError, bad_state_field
from pipeload.stats.report import RayStageStats

STATE_KIND = "pipeload.ray_boundary"


class RayTally:
    """What every run of one boundary pipe measured in this process, added as it goes (the
    loader's stats read it through the pipe's ``ray_stage_totals()``). One writer at a time:
    the thread reading the run."""

    __slots__ = ("items", "actor_s", "transfer_s", "wait_s", "restarts")

    def __init__(self) -> None:
        self.items = self.restarts = 0
        self.actor_s = self.transfer_s = self.wait_s = 0.0

    def totals(self) -> RayStageStats:
        return RayStageStats(self.items, self.actor_s, self.transfer_s, self.wait_s, self.restarts)


@dataclass(frozen=True)
class RayOptions:
    """A Ray boundary's settings (see ``RayQueueBoundary``)."""

    num_actors: int = 1
    chunk_size: int | None = None
    address: str | None = None
    actor_options: tuple[tuple[str, Any], ...] = ()
    init_options: tuple[tuple[str, Any], ...] = ()
    snapshot_every: int = 64
    start_timeout_s: float = 300.0
    replica: Replica | None = None  # which copy of the graph (mixed into the actors' seed)

    @property
    def restarts_allowed(self) -> int:
        """How often Ray restarts a dead actor (-1: always), from ``max_restarts``."""
        return int(dict(self.actor_options).get("max_restarts", 0))


class RayUpstream:
    """Owns one run's actors and the requests in flight to them; read by one thread.

    Invariants: for each actor, items asked for and not yet handed out stay within its share of
    the capacity; items are handed out in round-robin order over the shards that have not ended;
    each actor's ``delivered`` count is exact, whatever failed or restarted.
    """

    def __init__(self, upstream_pipe: Any, capacity: int, options: RayOptions, name: str,
                 pool: ActorPool | None = None, tally: RayTally | None = None) -> None:
        self._ray = connect(options.address, dict(options.init_options))
        self.name = name
        self.notifier = Notifier()
        self.tally = tally if tally is not None else RayTally()
        self._pipe = upstream_pipe
        self._options = options
        self._seed = run_seed(upstream_pipe, options.replica)
        share = max(1, capacity // options.num_actors)
        chunk = min(options.chunk_size or max(1, share // 2), share)
        check_actors_fit(self._ray, options.num_actors, dict(options.actor_options), options.start_timeout_s,
                         _copies_on_this_cluster())
        handles = pool.take(self._ray, options.num_actors) if pool is not None else []
        pooled = len(handles)
        missing = options.num_actors - pooled
        if missing and not fit_now(self._ray, missing, dict(options.actor_options)):
            let_other_pools_go(pool)  # their idle actors hold what these need
        handles += [self._made_actor() for _ in range(missing)]
        self._pool = weakref.ref(pool) if pool is not None else None
        self._actors = RunActors(self._ray, handles, pool)
        self._lanes = [Lane(weakref.proxy(self), index, handle, share, chunk, from_pool=index < pooled)
                       for index, handle in enumerate(handles)]
        self._actors.settle = functools.partial(_wait_for_calls, self._lanes)
        self._actors.drop_flags = functools.partial(_flags_of_the_runs, self._lanes)
        self._active = list(range(options.num_actors))
        self._turn = 0
        self._started = self._closed = False
        self._resume: dict[str, Any] | None = None
        self._graph_ref: Any = None
        self._waiting_since: float | None = None
        self._wait_s = 0.0
        self._finalizer = weakref.finalize(self, self._actors.release)

    def notifiers(self) -> list[Notifier]:
        return [self.notifier]

    def take_nowait(self) -> Any:
        """The next item in order; NotAvailable if it is not here yet; StopIteration at the end."""
        if self._closed:
            raise StopIteration
        if not self._started:
            self._start()
        while self._active:
            lane = self._lanes[self._active[self._turn]]
            try:
                item = lane.take_nowait()
            except NotAvailable:
                if self._waiting_since is None:
                    self._waiting_since = time.perf_counter()
                self.check_connected(lane)
                raise
            except ShardEnded:
                del self._active[self._turn]
                if self._turn >= len(self._active):
                    self._turn = 0
                continue
            self._turn = (self._turn + 1) % len(self._active)
            if self._waiting_since is not None:
                waited = time.perf_counter() - self._waiting_since
                self._wait_s += waited
                self.tally.wait_s += waited
                self._waiting_since = None
            if type(item) is RaisedUpstream:  # an item's error in its place: the run goes on
                raise item.exception()
            return item
        raise StopIteration

    def check_connected(self, lane: Lane) -> None:
        """Raise when Ray was shut down in this process while ``lane`` waited: the replies asked
        for never came then, and the loop waited for good; or they failed as the actors' deaths,
        which is not what happened (a cluster stopped from outside is a death the lane sees)."""
        if self._ray.is_initialized():
            return
        self.failed()
        raise RuntimeError(f"{lane.describe()}: Ray was shut down in this process (ray.shutdown()) "
                           f"while {self.name} waited for its items; the run cannot go on")

    def _start(self) -> None:
        self._started = True
        _send_the_scripts_functions_by_value(self._ray)
        try:
            self._graph_ref = self._ray.put(self._pipe)
        except Exception as error:
            self.failed()
            raise TypeError(
                f"queue_boundary('ray') could not send its upstream pipe to the Ray actors: {error}"
            ) from error
        take_seeds(self._pipe)
        shards = self._resume["shards"] if self._resume is not None else None
        for lane in self._lanes:
            if shards is None:
                lane.begin(None, 0)
            elif lane.index in self._active:
                lane.begin(shards[lane.index]["state"], shards[lane.index]["skip"])

    def run_shard(self, lane: Lane, generation: int, state: Any, state_at: int, skip_to: int) -> Any:
        """Ask ``lane``'s actor to begin run ``generation``; the future of where it runs."""
        shard = (self.name, lane.index, len(self._lanes))
        return lane.handle.start.remote(generation, self._graph_ref, self._seed, shard, state, state_at,
                                        skip_to, self._options.snapshot_every, flag_for(generation)).future()

    def _made_actor(self) -> Any:
        return actor_class(self._ray).options(**dict(self._options.actor_options)).remote()

    def idle_actor_for(self, index: int) -> Any:
        """An idle actor of this pipe's pool in place of actor ``index`` (killed: it had not
        started), or None when the pool has none (see ``Lane._adopt_an_idle_actor``)."""
        pool = self._pool() if self._pool is not None else None
        taken = pool.take(self._ray, 1) if pool is not None and pool.idle else []
        if not taken:
            return None
        self._actors.replace(index, taken[0])
        return taken[0]

    def new_actor(self, index: int) -> Any:
        """A new actor in place of actor ``index``, taken from the pool and found dead there
        (killed for good now, in case Ray was restarting it)."""
        handle = self._made_actor()
        self._actors.replace(index, handle)
        return handle

    @property
    def num_actors(self) -> int:
        return len(self._lanes)

    @property
    def restarts_allowed(self) -> int:
        return self._options.restarts_allowed

    @property
    def start_timeout_s(self) -> float:
        return self._options.start_timeout_s

    @property
    def actor_options(self) -> dict[str, Any]:
        return dict(self._options.actor_options)

    def failed(self) -> None:
        """Something went wrong with an actor: kill them all when the run ends, keep none."""
        self._actors.reusable = False

    # -- checkpoints ---------------------------------------------------------------------------

    def state_dict(self) -> dict[str, Any]:
        """Where each shard stands downstream: its latest upstream state and the items after it.

        Raises:
            NotImplementedError: an actor's upstream pipe keeps no state (it can only be
                resumed by skipping).
        """
        if self._resume is not None and not self._started:
            return self._resume
        shards = [lane.position() for lane in self._lanes]
        return {"kind": STATE_KIND, "num_actors": len(self._lanes), "active": list(self._active),
                "turn": self._turn, "shards": shards}

    def checked_state(self, fields: StateFields) -> dict[str, Any]:
        """The state in ``fields``, checked against this run (nothing is set).

        Raises:
            IncompatibleStateError: a field is missing, of another type or out of range; the
                message names it by its path and the value received.
            RuntimeError: this run has handed out an item already.
        """
        fields.choice("kind", [STATE_KIND])
        num_actors = fields.integer("num_actors", 1)
        if num_actors != len(self._lanes):
            raise IncompatibleStateError(
                f"Ray queue boundary state: num_actors differs (state: {num_actors}, "
                f"here: {len(self._lanes)})"
            )
        last = num_actors - 1
        listed = fields.listed("active", f"a list of actor indices in [0, {last}]")
        active = [listed.integer(index, 0, last) for index in range(len(listed.state))]  # type: ignore[union-attr]
        if len(set(active)) != len(active):
            raise bad_state_field(fields.name("active"), active, "a list of different actor indices")
        turn = fields.integer("turn", 0, max(0, len(active) - 1))
        shards = fields.listed("shards", f"a list of {num_actors} shard positions", length=num_actors)
        positions = []
        for index in range(num_actors):
            shard = shards.fields(index)  # type: ignore[union-attr]
            positions.append({"state": shard.raw("state", "the shard's upstream state, or None"),  # type: ignore[union-attr]
                              "skip": shard.integer("skip", 0)})  # type: ignore[union-attr]
            shard.finish()  # type: ignore[union-attr]
        fields.finish()
        if self._started:
            raise RuntimeError("load_state_dict() must come before the Ray boundary's first item")
        return {"kind": STATE_KIND, "num_actors": num_actors, "active": active, "turn": turn, "shards": positions}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Continue from ``state``: call before the first item (checked as :meth:`checked_state`)."""
        state = self.checked_state(StateFields(state, ""))
        self._resume = state
        self._active = list(state["active"])
        self._turn = state["turn"]

    # -- stats ---------------------------------------------------------------------------------

    def stats(self) -> RayStageStats:
        """This run's totals so far."""
        total = RayStageStats(wait_s=self._wait_s)
        for lane in self._lanes:
            total = total.plus(RayStageStats(lane.delivered - lane.first_position, lane.actor_s,
                                             lane.transfer_s, 0.0, lane.restarts))
        return total

    def close(self) -> None:
        """End the run: its actors go back to the pipe's pool (or are killed, after a failure,
        or when still in a call), and the replies it holds leave the object store now, not when
        this object is freed. Idempotent; the run hands out nothing more. A run dropped without
        it (a ``break``) ends the same way, in its finalizer, with a shorter wait."""
        self._actors.patient = True
        self._closed = True
        self._finalizer()
        self._graph_ref = None
        for lane in self._lanes:
            lane.let_go()


# How long a run's end waits for the call each actor is in to be answered: this, or one and a
# half of the actor's longest chunk so far, whichever is longer.
CLOSE_GRACE_S = 1.0
CLOSE_GRACE_CHUNKS = 1.5


def _wait_for_calls(lanes: list[Lane], patient: bool = True) -> set[int]:
    """The lanes whose actors are still in the call they were in, after waiting for it up to
    ``CLOSE_GRACE_S`` or (``patient``: an explicit ``close()``) ``CLOSE_GRACE_CHUNKS`` of the
    actor's longest chunk. A run ended mid-epoch leaves the chunks it asked ahead for in flight;
    an actor that answers the one it is in works, whatever is queued behind (a slow stage's
    actor, given 1 s for all of them, was killed on every close, and each next run waited for a
    new one). A run dropped (a loop's ``break``: its finalizer, on whatever thread lets go of
    it) waits ``CLOSE_GRACE_S`` at most: a loop's break blocked 1.5 chunks, 3 s and more
    (stop 54's review), and a slower actor is killed and made anew for the next run. An actor
    on this machine, told first by the run's flag (``ray_dropped.py``), ends its call at the
    item it is making."""
    running = {lane.index: lane.call_running() for lane in lanes}
    waiting = [future for future in running.values() if future is not None]
    if waiting:
        longest = max(lane.longest_chunk_s for lane in lanes) if patient else 0.0
        concurrent.futures.wait(waiting, timeout=max(CLOSE_GRACE_S, CLOSE_GRACE_CHUNKS * longest))
    return {index for index, future in running.items() if future is not None and not future.done()}


def _flags_of_the_runs(lanes: list[Lane]) -> list[str | None]:
    """Where each actor's run (its latest generation) has its dropped-run flag, in actor order;
    None for an actor that has answered every call of the run (nothing to tell it)."""
    return [flag_for(lane.generation) if lane.call_running() is not None else None for lane in lanes]


def _copies_on_this_cluster() -> int:
    """The copies of the graph whose actors run at once on this rank's cluster: its DataLoader
    workers (one without workers: this process's own copy). Other ranks may have clusters of
    their own, so they are not counted."""
    info = get_worker_info()
    return max(1, info.num_workers) if info is not None else 1


def _send_the_scripts_functions_by_value(ray: Any) -> None:
    """In a spawned DataLoader worker the training script is ``__mp_main__``, which Ray's
    pickler sends by reference, and no actor can import it: every actor failed with "Can't get
    attribute 'square' on <module '__main__'>" where the same graph ran without workers (the
    script as ``__main__`` is sent by value). Sent by value from here too."""
    script = sys.modules.get("__mp_main__")
    if script is None or getattr(script, "__name__", None) != "__mp_main__":
        return  # not a spawned process (or the parent's main module under both names)
    register = getattr(getattr(ray, "cloudpickle", None), "register_pickle_by_value", None)
    if register is not None:
        try:
            register(script)
        except ValueError:
            pass  # registered already (an earlier run in this worker)
