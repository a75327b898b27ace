"""One actor of a Ray boundary, seen from the reading side: its requests, its position, its fate.

A :class:`Lane` keeps up to ``MAX_IN_FLIGHT`` requests queued at its actor within the actor's
share of the buffer, hands out the items of the reply in hand, and counts what it handed out:
that count and the latest upstream state the actor sent are the shard's checkpoint.

When the actor dies: without ``max_restarts`` the next item is a ``WorkerDiedError`` naming the
actor and what it was making. With it, Ray restarts the actor process, and the lane begins a
new run there from the shard's latest state, the items after it made again and dropped
(``skip_to``), so nothing is handed out twice or lost. While Ray restarts the actor, calls to
it fail at once ("unavailable"); the lane asks again with a growing pause, for at most
``RESTART_TIMEOUT_S``, sending only the run's start until that succeeds, then its requests.

An actor taken from the pipe's pool (kept since an earlier run) may have died while it waited
there (``ray.kill``, its process or node gone): its run's start then fails as a lost actor. That
is no failure of this run, which has made nothing on it yet: a new actor takes its place and
begins the run, whatever ``max_restarts`` says. So the first reply read from a pooled actor is
its start's.
"""

from __future__ import annotations

import functools
import itertools
import time
from collections import deque
from typing import Any

from pipeload.datapipes.boundary.ray_payload import unpack
from pipeload.datapipes.boundary.ray_shard import Chunk
from pipeload.datapipes.protocol import NotAvailable, Notifier
from pipeload.errors import RemoteFailure, WorkerDiedError

MAX_IN_FLIGHT = 3  # requests queued at one actor: one being made, one travelling, one waiting
RESTART_TIMEOUT_S = 60.0  # a restarting actor not back by then is an error
RETRY_FIRST_S = 0.05
RETRY_MOST_S = 1.0
# Run numbers, unique in this process: an actor reused by a later run (or restarted) can never
# take a request of an earlier one for its own.
_generations = itertools.count()


class ShardEnded(Exception):
    """A shard has handed out its last item."""


class _Request:
    """One request in flight. ``arrival`` is a one-item list the future's callback fills with the
    time it completed (the callback holds the list, not the request: no cycle through the
    future, which holds the reply's ObjectRef)."""

    __slots__ = ("future", "start", "count", "arrival")

    def __init__(self, future: Any, start: int, count: int, arrival: list[float]) -> None:
        self.future, self.start, self.count, self.arrival = future, start, count, arrival


def _arrived(notifier: Notifier, arrival: list[float], _future: Any) -> None:
    """A future completed (Ray's thread): note when, wake the reader."""
    arrival[0] = time.time()
    notifier.notify()


class Lane:
    """One actor's requests in flight, the reply being handed out, and its position downstream.

    ``owner`` (the run) gives ``name``, ``num_actors``, ``restarts_allowed``, ``start_timeout_s``,
    ``actor_options``, ``notifier``, ``tally``, ``run_shard(lane, generation, state, state_at,
    skip_to)``, ``new_actor(index)`` and ``failed()``. ``from_pool``: the actor served an
    earlier run (until its start here is answered, it may turn out dead).
    """

    def __init__(self, owner: Any, index: int, handle: Any, share: int, chunk: int,
                 from_pool: bool = False) -> None:
        self._owner = owner
        self.index = index
        self.handle = handle
        self._from_pool = from_pool
        self._share = share
        self._chunk_size = chunk
        self._notifier = owner.notifier
        self._requests: deque[_Request] = deque()
        self._chunk: Chunk | None = None
        self._cursor = 0
        self.generation = next(_generations)
        self.delivered = self.requested = self.first_position = 0
        self._snapshot: tuple[int, Any] = (0, None)
        self._no_state: str | None = None
        self._started: Any = None  # the future of the run's start: where the actor runs
        self._host = ""
        self.actor_s = self.transfer_s = 0.0
        self.longest_chunk_s = 0.0  # the actor's longest chunk so far (see call_running)
        self.restarts = 0
        self._recovery: _Recovery | None = None
        self._begun_at = time.monotonic()

    def begin(self, state: Any, skip: int) -> None:
        """Start this actor's run: from ``state`` (None: the shard's start), ``skip`` items on."""
        self._snapshot = (0, state)
        self.delivered = self.requested = self.first_position = skip
        self._start_run()
        self._top_up()

    def _start_run(self) -> None:
        at, state = self._snapshot
        self._begun_at = time.monotonic()
        self._started = self._owner.run_shard(self, self.generation, state, at, self.delivered)
        self._started.add_done_callback(functools.partial(_arrived, self._notifier, [0.0]))

    def _top_up(self) -> None:
        # A request sent after ray.shutdown() in this process ends it from inside Ray ("the core
        # worker has already been shutdown"): said as an error here first.
        self._owner.check_connected(self)
        while (len(self._requests) < MAX_IN_FLIGHT
               and self.requested + self._chunk_size - self.delivered <= self._share):
            future = self.handle.next_chunk.remote(self.generation, self._chunk_size).future()
            arrival = [0.0]
            future.add_done_callback(functools.partial(_arrived, self._notifier, arrival))
            self._requests.append(_Request(future, self.requested, self._chunk_size, arrival))
            self.requested += self._chunk_size

    # -- handing out -----------------------------------------------------------------------------

    def take_nowait(self) -> Any:
        """The shard's next item; NotAvailable if not here yet; ShardEnded after its last."""
        while True:
            chunk = self._chunk
            if chunk is not None and self._cursor < len(chunk.items):
                return self._hand_out(chunk)
            if chunk is not None and chunk.failure is not None:
                self._owner.failed()
                raise chunk.failure.to_exception()
            if chunk is not None and chunk.ended:
                raise ShardEnded
            if self._recovery is not None:
                self._recover()
            self._next_chunk()

    def _hand_out(self, chunk: Chunk) -> Any:
        number = self._cursor
        item, chunk.items[number] = chunk.items[number], None  # held here no longer than needed
        self._cursor += 1
        self.delivered += 1
        self._top_up()
        return unpack(item) if number in chunk.packed else item

    def _next_chunk(self) -> None:
        """Move the next reply in (or raise NotAvailable); restart or fail on a dead actor."""
        if self._from_pool:
            self._check_pooled_actor()
        if not self._requests:
            self._top_up()
        request = self._requests[0]
        if not request.future.done():
            if not self._adopt_an_idle_actor():
                self._check_start_deadline()
            raise NotAvailable
        self._requests.popleft()
        try:
            chunk = request.future.result()
        except Exception as error:  # noqa: BLE001  (Ray's errors: the actor, its node, the store)
            self._lost(self._doing(request), error)
            return
        if chunk.generation == -1:  # its run never began, or Ray restarted it (a retried request)
            self._check_started()
            self._lost(self._doing(request), None)
            return
        if chunk.generation == self.generation:  # else: for a run replaced since, already counted
            self._accept(chunk, request)

    def _accept(self, chunk: Chunk, request: _Request) -> None:
        # A run that failed before its resume point (making again the items before it) says
        # where it stopped: its failure is the news, not the position.
        if chunk.start != self.delivered and not (chunk.failure is not None and not chunk.items):
            raise RuntimeError(
                f"Ray queue boundary protocol error: {self.describe()} sent items from "
                f"{chunk.start}, expected {self.delivered}"
            )
        if chunk.snapshot is not None:
            if len(chunk.snapshot) == 3:
                self._no_state = chunk.snapshot[2]
            else:
                self._snapshot = chunk.snapshot
        transfer_s = max(0.0, request.arrival[0] - chunk.done_at)
        self.actor_s += chunk.busy_s
        self.longest_chunk_s = max(self.longest_chunk_s, chunk.busy_s)
        self.transfer_s += transfer_s
        tally = self._owner.tally
        tally.items += len(chunk.items)
        tally.actor_s += chunk.busy_s
        tally.transfer_s += transfer_s
        self._chunk, self._cursor = chunk, 0

    # -- losing the actor ------------------------------------------------------------------------

    def _check_pooled_actor(self) -> None:
        """Wait (NotAvailable) for the pooled actor's start; when the actor turns out lost (it
        died in the pool), begin this run on a new actor in its place."""
        started = self._started
        if not started.done():
            self._check_start_deadline()
            raise NotAvailable
        self._from_pool = False
        error = started.exception()
        if error is None or not (_is_actor_loss(error) or _is_unavailable(error)):
            return  # started, or what kept it from starting is the run's own news
        self._begin_again_on(self._owner.new_actor(self.index), from_pool=False)

    def _begin_again_on(self, handle: Any, from_pool: bool) -> None:
        """Begin this lane's run again on actor ``handle``, from the item it had reached."""
        self.handle, self._from_pool = handle, from_pool
        self.generation = next(_generations)
        self._requests.clear()
        self._chunk = None
        self.requested = self.delivered
        self._start_run()
        self._top_up()

    def _adopt_an_idle_actor(self) -> bool:
        """While this lane's new actor waits to start, an actor of the pipe's earlier run may
        come back to the pool: take it, and the waiting one is killed before it runs. The loop's
        ``it = iter(loader)`` makes the new run before the old one lets its actors go; where the
        cluster had no room for both, the new actors waited start_timeout_s beside idle ones and
        the run failed, blaming the cluster (stop 54's Ray skeptic)."""
        if self._from_pool or self._started is None or self._started.done():
            return False
        handle = self._owner.idle_actor_for(self.index)
        if handle is None:
            return False
        self._begin_again_on(handle, from_pool=True)
        return True

    def _doing(self, request: _Request) -> str:
        return f"making items {request.start} to {request.start + request.count - 1} of its shard"

    def _lost(self, doing: str, error: BaseException | None) -> None:
        """The actor died (or lost its run) while ``doing``: begin again on the restarted actor
        when restarts are allowed, else raise an error naming it and what it was doing."""
        self._owner.failed()
        self._owner.check_connected(self)  # Ray shut down here: said so, not as a death
        if error is not None and not _is_actor_loss(error):
            raise self._failed_in_ray(doing, error) from error
        allowed = self._owner.restarts_allowed
        if self._recovery is None:
            if allowed == 0 or (allowed > 0 and self.restarts >= allowed):
                raise self._died(doing, error)
            self.restarts += 1
            self._owner.tally.restarts += 1
            self._recovery = _Recovery(doing)
        self.generation = next(_generations)
        self._requests.clear()
        self._chunk, self._started = None, None
        self.requested = self.delivered
        self._recovery.wait_more()

    def _recover(self) -> None:
        """Begin again on the restarted actor: its run's start first, its requests once that
        succeeded. NotAvailable meanwhile; an error when Ray gave it up or it stayed away."""
        recovery = self._recovery
        assert recovery is not None
        if time.monotonic() > recovery.deadline:
            raise self._died(recovery.doing, None, f"; not back {RESTART_TIMEOUT_S:.0f} s later")
        if self._started is None:
            if time.monotonic() < recovery.retry_at:
                raise NotAvailable
            self._start_run()
        if not self._started.done():
            raise NotAvailable
        error = self._started.exception()
        if error is None:
            self._recovery = None
            self._top_up()
            return
        if _is_unavailable(error):  # Ray is restarting it: ask again a little later
            self._lost(recovery.doing, error)
            raise NotAvailable
        raise self._died(recovery.doing, error)

    def _failed_in_ray(self, doing: str, error: BaseException) -> BaseException:
        """A request that failed in Ray rather than in the pipe (whose errors come inside the
        reply): most often an item Ray could not pickle for the trip here. The error has the
        type of Ray's cause (a ``TypeError`` for that), as the process boundary's has."""
        cause = getattr(error, "cause", None)
        if not isinstance(cause, Exception):
            return RuntimeError(f"{self.describe()} failed while {doing}: {error}")
        failure = RemoteFailure(type(cause), str(cause), str(error), self.index,
                                f"{doing}, or sending them to the reading side",
                                where=f"in {self.describe()}")
        return failure.to_exception()

    def _died(self, doing: str, error: BaseException | None, more: str = "") -> WorkerDiedError:
        allowed = self._owner.restarts_allowed
        why = "" if error is None else f": {_first_line(error)}"
        died = WorkerDiedError(
            f"{self.describe()} died while {doing} (after {self.delivered - self.first_position} "
            f"items were handed out; restarts: {self.restarts} of {allowed}){more}{why}"
        )
        died.__cause__ = error
        return died

    def _check_start_deadline(self) -> None:
        """An actor Ray cannot place (the cluster lacks what it asks for) never starts; say so
        rather than wait for ever."""
        started, limit = self._started, self._owner.start_timeout_s
        if started is None or started.done() or time.monotonic() - self._begun_at < limit:
            return
        self._owner.failed()
        raise TimeoutError(
            f"{self.describe()} did not start within {limit:.0f} s: the cluster may lack the "
            f"resources it asks for ({self._owner.actor_options or 'Ray defaults'}), or Ray "
            "could not start its process (see Ray's log); start_timeout_s= sets this limit"
        )

    def _check_started(self) -> None:
        """Raise what kept the actor from beginning its run (Ray could not hand it the pipe:
        a module the actor cannot import, say), if that is why it has none."""
        started = self._started
        error = started.exception() if started is not None and started.done() else None
        if error is not None and not _is_actor_loss(error):
            self._owner.failed()
            raise RuntimeError(f"{self.describe()} could not begin its shard: {error}") from error

    def call_running(self) -> Any:
        """The future of the oldest of this actor's calls not answered yet (its start, then its
        chunks, which the actor answers one after another): the one it is in now; None."""
        futures = [request.future for request in self._requests]
        if self._started is not None:
            futures.insert(0, self._started)
        return next((future for future in futures if not future.done()), None)

    def let_go(self) -> None:
        """Drop the replies held and asked for (the run ended): the store frees them now."""
        self.describe()  # where the actor ran, kept for messages
        self._requests.clear()
        self._chunk, self._started = None, None

    # -- what the run reads --------------------------------------------------------------------

    def position(self) -> dict[str, Any]:
        """This shard's checkpoint: its latest upstream state and the items handed out since."""
        if self._no_state is not None:
            raise NotImplementedError(f"{self.describe()}: {self._no_state}")
        at, state = self._snapshot
        return {"state": state, "skip": self.delivered - at}

    def describe(self) -> str:
        """"Ray actor 1 of 2 of queue boundary 'name' (pid 123 on host, node 1a2b3c4d)"."""
        started = self._started
        if started is not None and started.done() and started.exception() is None:
            where = started.result()
            self._host = f" (pid {where['pid']} on {where['host']}, node {where['node'][:8]})"
        return (f"Ray actor {self.index} of {self._owner.num_actors} of queue boundary "
                f"{self._owner.name!r}{self._host}")


class _Recovery:
    """A restart in progress: what the actor was doing, when to ask again, when to give up."""

    def __init__(self, doing: str) -> None:
        self.doing = doing
        self.deadline = time.monotonic() + RESTART_TIMEOUT_S
        self.retry_at = time.monotonic()
        self._pause = RETRY_FIRST_S

    def wait_more(self) -> None:
        self.retry_at = time.monotonic() + self._pause
        self._pause = min(self._pause * 2, RETRY_MOST_S)


def _is_actor_loss(error: BaseException) -> bool:
    """Errors that mean the actor (or the node holding its reply) is gone, not a bug."""
    import ray.exceptions as rex

    return isinstance(error, (rex.RayActorError, rex.ObjectLostError, rex.WorkerCrashedError))


def _is_unavailable(error: BaseException) -> bool:
    import ray.exceptions as rex

    return isinstance(error, getattr(rex, "ActorUnavailableError", ()))


def _first_line(error: BaseException) -> str:
    text = str(error).strip()
    return text.splitlines()[0] if text else type(error).__name__
