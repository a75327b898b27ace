"""Inside a Ray actor: one shard of a queue boundary's upstream graph, served in chunks.

The actor is request-driven, as the RFC's queue loop is: it computes nothing until asked, and
each request (``next_chunk``) asks for up to ``count`` items. The reading side keeps a few
requests queued at each actor, so the actor goes from one chunk straight to the next while the
previous one travels; the number of items asked for and not yet handed downstream is the
boundary's backpressure.

Every reply is a :class:`Chunk`: the items (large tensors packed for the object store), where
they start in the shard, and, every ``snapshot_every`` items or so, the upstream's
``state_dict()`` taken just before them, which is what a checkpoint or a restart resumes from.
A failure upstream ends the shard's items and travels as a
:class:`~pipeload.errors.RemoteFailure` after the items made before it.

Each request and run carries a generation number: after a restart the reading side bumps it,
so a reply to a request made for the dead run (Ray may retry it on the new actor) is told
apart and dropped. A run the reading side dropped (a loop's ``break``) raises its flag
(``ray_dropped.py``): its calls still queued then answer at once, without making an item, and
the one being made stops at its next item, so the next run's start does not wait behind them.
"""

from __future__ import annotations

import os
import socket
import time
from typing import Any, NamedTuple

import torch

from pipeload.datapipes.boundary.feed import RaisedUpstream
from pipeload.datapipes.boundary.ray_dropped import CHECK_EVERY_S, seen_raised
from pipeload.datapipes.boundary.ray_payload import pack
from pipeload.datapipes.graph import is_random_datapipe, is_sharding_datapipe, list_dps
from pipeload.datapipes.protocol import as_nonblocking
from pipeload.engine.worker_info import seed_process_worker
from pipeload.errors import IncompatibleStateError, RemoteFailure


class Chunk(NamedTuple):
    """One reply of an actor.

    Attributes:
        generation: the run it belongs to (-1: the actor holds no run of that generation, as
            after Ray restarted it, or once the reading side dropped it).
        start: the shard position of its first item (positions count from the run's start).
        items: the items, in order.
        packed: indices of the items whose tensors were packed (see ``ray_payload``).
        snapshot: None, or ``(position, state)``: the upstream's ``state_dict()`` at
            ``position`` (== ``start``), or ``(position, None, reason)`` once it has none.
        ended: the shard has no more items after these.
        failure: the shard failed after these items.
        busy_s: seconds the actor spent making them.
        done_at: wall-clock time (``time.time()``) when they were ready to send.
    """

    generation: int
    start: int
    items: list[Any]
    packed: tuple[int, ...] = ()
    snapshot: tuple[Any, ...] | None = None
    ended: bool = False
    failure: RemoteFailure | None = None
    busy_s: float = 0.0
    done_at: float = 0.0


def split_shards(graph: Any, parts: int, part: int) -> None:
    """Cut every shard the graph's sharding pipes were told into ``parts`` interleaved pieces and
    keep piece ``part``: shard ``i`` of ``n`` becomes shard ``part * n + i`` of ``n * parts``.

    Raises:
        ValueError: a sharding pipe that does not say which shard it has (no
            ``num_of_instances`` / ``instance_id``), so it cannot be split.
    """
    if parts == 1:
        return
    for pipe in list_dps(graph):
        if not is_sharding_datapipe(pipe):
            continue
        count, index = getattr(pipe, "num_of_instances", None), getattr(pipe, "instance_id", None)
        if not isinstance(count, int) or not isinstance(index, int):
            raise ValueError(
                f"queue_boundary('ray', num_actors={parts}) cannot split the shard of {pipe!r}: it "
                "has no num_of_instances/instance_id to say which shard it holds; use "
                "sharding_filter() instead"
            )
        # One flat split, whatever groups it was told before: (count, index) already combines
        # them, and the groups may not mix (a DEFAULT split beside a MULTIPROCESSING one).
        pipe.groups = {}
        if hasattr(pipe, "sharding_group_filter"):
            pipe.sharding_group_filter = None
        pipe.apply_sharding(count * parts, part * count + index)


def seed_unseeded(graph: Any, seed: int) -> None:
    """Give every random pipe that has no seed yet one drawn from ``seed``, in graph order.

    Every actor draws the same numbers, so a shuffle before the sharding pipe shuffles alike in
    all of them and their shards split one order. Pipes already seeded (by the DataLoader, or
    ``set_seed``) keep theirs. One draw per random pipe either way, so which pipes were seeded
    does not move the others' seeds.
    """
    generator = torch.Generator()
    generator.manual_seed(seed)
    for pipe in list_dps(graph):
        if is_random_datapipe(pipe):
            drawn = int(torch.empty((), dtype=torch.int64).random_(generator=generator).item())
            if getattr(pipe, "_seed", None) is None:  # both families keep the next run's seed there
                pipe.set_seed(drawn)


class ShardRunner:
    """The body of one Ray actor of a queue boundary (made into an actor class by
    ``ray.remote``; plain Python otherwise). Serves one run at a time; a run that ended leaves
    the actor ready for the next one (the same boundary's next epoch)."""

    def __init__(self) -> None:
        self._generation = -1
        self._run: _ShardRun | None = None

    def describe(self) -> dict[str, Any]:
        """Where this actor runs, for messages: its pid, host and Ray node."""
        import ray

        node = ray.get_runtime_context().get_node_id()
        return {"pid": os.getpid(), "host": socket.gethostname(), "node": node}

    def start(self, generation: int, graph: Any, seed: int, shard: tuple[str, int, int], state: Any,
              state_at: int, skip_to: int, snapshot_every: int, dropped_flag: str | None = None) -> dict[str, Any]:
        """Begin run ``generation``: shard ``(boundary name, actor index, num_actors)`` of
        ``graph``, from ``state`` (taken at shard position ``state_at``; None: the shard's
        start), the items before ``skip_to`` made and dropped. ``dropped_flag``: where the
        reading side raises the run's flag when it drops it. A failure here is the run's first
        reply, not this call's."""
        self.stop()
        boundary, index, num_actors = shard
        where = f"in Ray actor {index} of {num_actors} of queue boundary {boundary!r}"
        self._generation = generation
        if seen_raised(dropped_flag):
            return self.describe()  # dropped before it began: its calls find no run
        self._run = _ShardRun(where, index, snapshot_every, dropped_flag)
        self._run.begin(graph, num_actors, seed, state, state_at, skip_to)
        return self.describe()

    def next_chunk(self, generation: int, count: int) -> Chunk:
        """Up to ``count`` more items of run ``generation``."""
        run = self._run
        if generation != self._generation or run is None:
            return Chunk(-1, 0, [])
        chunk = run.next_chunk(generation, count)
        if run.dropped:
            # No one reads this run any more: its iterator closes now (not at ``stop``, which
            # waits behind the run's other calls), and those calls find no run.
            self.stop()
            return Chunk(-1, 0, [])
        return chunk

    def stop(self) -> None:
        """End the run (its iterator's close: threads or processes it started)."""
        if self._run is not None:
            run, self._run = self._run, None
            run.close()


class _ShardRun:
    """One run's iterator and position inside the actor."""

    def __init__(self, where: str, index: int, snapshot_every: int, dropped_flag: str | None = None) -> None:
        self._where = where
        self._dropped_flag = dropped_flag
        self.dropped = False  # the reading side dropped the run (its flag was seen raised)
        self._index = index
        self._snapshot_every = snapshot_every
        self._iterator: Any = None
        self._position = 0
        self._last_snapshot: int | None = None
        self._no_state: str | None = None  # why the upstream cannot be checkpointed, once known
        self._failure: RemoteFailure | None = None
        self._ended = False

    def begin(self, graph: Any, num_actors: int, seed: int, state: Any, state_at: int, skip_to: int) -> None:
        stage = "preparing its shard of the upstream pipe"
        try:
            split_shards(graph, num_actors, self._index)
            seed_unseeded(graph, seed)
            seed_process_worker(seed, self._index)  # its own stream for random values in maps
            self._iterator = as_nonblocking(graph)
            self._position = state_at
            if state is not None:
                stage = "loading the upstream pipe's state"
                self._iterator.load_state_dict(state)
            stage = "making again the items before its resume point"
            self._make_again_up_to(skip_to)
        except StopIteration:
            self._ended = True
        except Exception:
            self._failure = RemoteFailure.capture(self._index, stage, where=self._where)

    def _make_again_up_to(self, skip_to: int) -> None:
        """Make and drop the items before ``skip_to``: they were handed out before the resume."""
        while self._position < skip_to:
            try:
                next(self._iterator)
            except StopIteration:
                # A checkpoint of another pipe (or a damaged one): the shard has fewer items.
                raise IncompatibleStateError(
                    f"cannot resume {self._where}: its shard of the upstream pipe ended after "
                    f"{self._position} items, before its resume point ({skip_to} items handed "
                    "out); the state does not belong to this pipe"
                ) from None
            except Exception as error:  # an item's error took its position (see next_chunk)
                if getattr(error, "ends_the_run", False):
                    raise
            self._position += 1

    def next_chunk(self, generation: int, count: int) -> Chunk:
        if self._failure is not None or self._ended:
            return Chunk(generation, self._position, [], ended=self._ended, failure=self._failure)
        started = time.perf_counter()
        if self._seen_dropped():
            return Chunk(generation, self._position, [])
        start = self._position
        snapshot = self._snapshot()
        items = self._make(count, started)
        if self.dropped:
            return Chunk(generation, start, [])  # no one reads it: neither packed nor counted
        self._position += len(items)
        if self._ended or self._failure is not None:
            self.close()
        packed = []
        for number, item in enumerate(items):
            items[number], changed = pack(item)
            if changed:
                packed.append(number)
        return Chunk(generation, start, items, tuple(packed), snapshot, self._ended, self._failure,
                     time.perf_counter() - started, time.time())

    def _make(self, count: int, started: float) -> list[Any]:
        """Up to ``count`` items; fewer when the shard ends or fails, or the run is dropped."""
        items: list[Any] = []
        looked = started
        while len(items) < count:
            if time.perf_counter() - looked >= CHECK_EVERY_S:
                if self._seen_dropped():
                    break
                looked = time.perf_counter()
            try:
                items.append(next(self._iterator))
            except StopIteration:
                self._ended = True
                break
            except Exception as error:
                if getattr(error, "ends_the_run", False):  # a failure budget spent
                    self._failure = RemoteFailure.capture(self._index, "iterating the upstream pipe",
                                                          where=self._where)
                    break
                # One item's error, in its place; the run goes on, as across a thread or process
                # boundary (a source past the archive it could not read). It takes a position.
                items.append(RaisedUpstream(RemoteFailure.of(error, self._index, "iterating the upstream pipe",
                                                             self._where)))
        return items

    def _seen_dropped(self) -> bool:
        """Whether the reading side dropped this run (its flag is raised), once seen for good.
        Never, on a node other than the reading side's: the flag is a file on its machine."""
        self.dropped = self.dropped or seen_raised(self._dropped_flag)
        return self.dropped

    def _snapshot(self) -> tuple[Any, ...] | None:
        """The upstream's state before this chunk, when one is due."""
        due = self._last_snapshot is None or self._position - self._last_snapshot >= self._snapshot_every
        if not due:
            return None
        self._last_snapshot = self._position
        if self._no_state is not None:
            return None
        try:
            return (self._position, self._iterator.state_dict())
        except NotImplementedError as error:
            self._no_state = str(error)
            return (self._position, None, self._no_state)

    def close(self) -> None:
        if self._iterator is not None:
            iterator, self._iterator = self._iterator, None
            iterator.close()
