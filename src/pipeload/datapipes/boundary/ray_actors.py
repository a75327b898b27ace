"""Who owns a Ray boundary's actors between runs.

Starting an actor costs seconds (a Python process that imports torch and the pipe's modules),
so a run that ends cleanly hands its actors back to the boundary pipe's :class:`ActorPool`, and
the pipe's next run (the next epoch) starts its shards on them. The pool belongs to the pipe
description and its copies in this process (thread workers' copies share it; a pickled pipe gets
an empty one), and kills its idle actors when they are all freed or :meth:`ActorPool.close` is
called; a run that
failed, or whose actor died, kills its actors instead of keeping them. An idle actor may die in
the pool all the same: the run that takes it finds out from its first reply and replaces it
(``ray_lane.py``).
"""

from __future__ import annotations

import threading
import weakref
from collections.abc import Callable
from typing import Any

from pipeload.datapipes.boundary.ray_dropped import lower_flag, lower_when_answered, raise_flag
from pipeload.datapipes.boundary.ray_shard import ShardRunner

_actor_classes: dict[int, Any] = {}  # one actor class per ray module (tests may reload it)


def actor_class(ray: Any) -> Any:
    """``ShardRunner`` as a Ray actor class (made once per process)."""
    made = _actor_classes.get(id(ray))
    if made is None:
        made = _actor_classes[id(ray)] = ray.remote(ShardRunner)
    return made


def kill(ray: Any, handles: list[Any]) -> None:
    """Kill each actor now (Ray ends its process; what it held is freed). Nothing to do once
    this process has left Ray: its actors went with it (and a call would start a new cluster).

    On a thread Python did not start (Ray's own, where the garbage collector may run a run's
    finalizer while Ray reads a reply), ``ray.kill`` waits for a reply that only that thread
    would deliver: the whole process would hang. The kills are made from a thread of ours."""
    if not handles or not ray.is_initialized():
        return
    if on_a_foreign_thread():
        threading.Thread(target=_kill_each, args=(ray, list(handles)), name="pipeload-ray-kill",
                         daemon=True).start()
        return
    _kill_each(ray, handles)


def on_a_foreign_thread() -> bool:
    """Whether this thread was started outside Python's ``threading`` (Ray's reply threads).
    Asked without ``current_thread()``, which would register such a thread for good."""
    ident = threading.get_ident()
    return not any(thread.ident == ident and not isinstance(thread, threading._DummyThread)
                   for thread in threading.enumerate())


def _kill_each(ray: Any, handles: list[Any]) -> None:
    for handle in handles:
        try:
            ray.kill(handle, no_restart=True)
        except Exception:
            pass  # already gone, or Ray shut down first: nothing left to free


class ActorPool:
    """Idle actors of one boundary pipe, kept for its next run. Its pipe's runs (several at once
    where thread workers run copies of the pipe, which share its pool) and another pipe's run
    letting its idle actors go (``let_other_pools_go``) may come from any thread: the idle list
    changes under ``_lock`` only."""

    def __init__(self) -> None:
        self._held: dict[str, Any] = {"ray": None, "job": None, "idle": []}
        self._lock = threading.Lock()
        self._finalizer = weakref.finalize(self, _kill_held, self._held)
        _POOLS.add(self)

    # The pool goes with the pipe's copies in this process (a thread worker's, made anew each
    # epoch when workers do not persist): they share its actors, as the pipe's own runs do
    # without workers; a copy that made a pool of its own killed its actors when it was freed,
    # and every epoch started new ones. A pickled pipe (a process worker's, an actor's) holds
    # no actors: it gets an empty pool of its own.
    def __copy__(self) -> ActorPool:
        return self

    def __deepcopy__(self, memo: dict[int, Any]) -> ActorPool:
        return self

    def __reduce__(self) -> tuple[Any, ...]:
        return (ActorPool, ())

    @property
    def idle(self) -> int:
        """How many idle actors it keeps."""
        return len(self._held["idle"])

    def let_idle_go(self) -> None:
        """Kill the idle actors now; the pool keeps the next run's (another pipe needs what
        these hold)."""
        with self._lock:
            _kill_held(self._held)

    def take(self, ray: Any, count: int) -> list[Any]:
        """Up to ``count`` idle actors of this connection (none after ``ray.shutdown()`` and a
        new ``ray.init()``: the old cluster's actors went with it)."""
        with self._lock:
            if not self._finalizer.alive or ray is not self._held["ray"] or _job(ray) != self._held["job"]:
                self._held["idle"] = []
                return []
            idle = self._held["idle"]
            taken = idle[:count]
            del idle[:count]
            return taken

    def give(self, ray: Any, handles: list[Any]) -> None:
        """Keep ``handles`` (actors with no run) for a later run."""
        if not self._finalizer.alive:
            kill(ray, handles)
            return
        job = _job(ray)
        with self._lock:
            if self._held["ray"] is not ray or self._held["job"] != job:
                _kill_held(self._held)
                self._held["ray"], self._held["job"] = ray, job
            self._held["idle"].extend(handles)

    def close(self) -> None:
        """Kill the idle actors now. Idempotent."""
        self._finalizer()


_POOLS: weakref.WeakSet[ActorPool] = weakref.WeakSet()  # every pipe's, in this process


def let_other_pools_go(keep: ActorPool | None) -> None:
    """Kill the idle actors every pool of this process but ``keep`` holds. A train pipe's idle
    actors keep their CPUs for as long as training runs: a validation pipe whose actors then did
    not fit waited start_timeout_s and failed, blaming the cluster."""
    for pool in list(_POOLS):
        if pool is not keep and pool.idle:
            pool.let_idle_go()


def _job(ray: Any) -> Any:
    """This process's current connection, or None when not connected: its job on its node (a
    new local cluster numbers its jobs from 1 again, but its node is new)."""
    if not ray.is_initialized():
        return None
    context = ray.get_runtime_context()
    return context.get_job_id(), context.get_node_id()


def _kill_held(held: dict[str, Any]) -> None:
    idle, held["idle"] = held["idle"], []
    if held["ray"] is not None:
        kill(held["ray"], idle)


class RunActors:
    """One run's actors and what becomes of them when the run ends: back to the pool when the
    run went well, killed otherwise. ``release`` is the run's finalizer: it holds no run.
    ``settle`` (set by the run, holding its lanes, not the run) names the actors still in a
    call after a grace (ray_upstream.py), whether the run was closed or dropped (a ``break``:
    only ``close()`` asked, and a hung actor went to the pool, stop 54's Ray skeptic); after a
    ``close()`` (``patient``) it waits longer for a slow actor's chunk. Before that, each
    actor still in a call of the run is told the run was dropped (``drop_flags``, set by the
    run: each actor's flag, None where it has no call pending; see ``ray_dropped.py``), so the
    calls queued behind the one it is in answer at once and that one ends at its next item."""

    def __init__(self, ray: Any, handles: list[Any], pool: ActorPool | None) -> None:
        self.ray = ray
        self.handles = handles
        self.reusable = True
        self.settle: Callable[[bool], set[int]] | None = None
        self.drop_flags: Callable[[], list[str | None]] | None = None
        self.patient = False  # close() asked: settle waits for a slow actor's chunk
        self._pool = weakref.ref(pool) if pool is not None else None

    def replace(self, index: int, handle: Any) -> None:
        """Put ``handle`` in place of actor ``index``, which is killed (it died, or Ray is
        bringing back an actor that no run waits for)."""
        lost, self.handles[index] = self.handles[index], handle
        kill(self.ray, [lost])

    def release(self) -> None:
        pool = self._pool() if self._pool is not None else None
        # On Ray's own thread (the garbage collector there), no call may wait on Ray: the actors
        # are killed from a thread of ours instead of stopped and pooled (see ``kill``).
        if not self.reusable or pool is None or not self.ray.is_initialized() or on_a_foreign_thread():
            kill(self.ray, self.handles)
            return
        flags = self.drop_flags() if self.drop_flags is not None else [None] * len(self.handles)
        for flag in flags:
            raise_flag(flag)
        # One still in a call (a stage that hangs, or a slow one) would make the next run's start
        # wait behind it, up to start_timeout_s, and then blame the cluster's resources.
        in_call = self.settle(self.patient) if self.settle is not None else set()
        busy = [handle for index, handle in enumerate(self.handles) if index in in_call]
        idle = [handle for index, handle in enumerate(self.handles) if index not in in_call]
        kill(self.ray, busy)
        for index, (handle, flag) in enumerate(zip(self.handles, flags)):
            if index in in_call:
                lower_flag(flag)  # killed: none of its run's calls is left to look for it
            else:
                self._stop(handle, flag)
        if self.reusable:
            pool.give(self.ray, idle)
        else:
            kill(self.ray, idle)

    def _stop(self, handle: Any, flag: str | None) -> None:
        """End the actor's run: its iterator closes before the next run begins. The actor takes
        this call after the run's others, so once it is answered no call looks for the flag."""
        try:
            stopped = handle.stop.remote()
        except Exception:
            self.reusable = False  # the actor is killed
            lower_flag(flag)
            return
        lower_when_answered(stopped, flag)
