"""The Ray kind of :class:`~pipeload.datapipes.boundary.queue_interface.DataLoaderQueue`.

The RFC's queue "in distributed env": this end is the reading one, in the process that runs the
downstream part of a graph; the far end is the Ray actors that :meth:`RayQueue.start_producer`
starts, each running a shard of the upstream pipe. They do not push: as in the RFC's own
request/response loop, this end asks each actor for chunks of items and the replies travel
through Ray's object store (large tensors and numpy arrays without copies), so ``put`` has no
place at this end. Items come out of :meth:`RayQueue.get` in order (round-robin over the
actors' interleaved shards), each once, with at most ``maxsize`` asked for and not yet taken.

Example:
    >>> queue = DataLoaderQueue(kind="ray", maxsize=16, num_actors=2, num_cpus=1)
    >>> producer = RayQueue.start_producer(pipe.sharding_filter(), queue, "decode", {})
    >>> first = queue.get()                 # waits for the first item
    >>> queue.get(blocking=False)           # an item, or NotAvailable
    >>> queue.close()                       # the actors stop (or go back to the pipe's pool)
"""

from __future__ import annotations

import dataclasses
import time
from typing import Any

from pipeload.datapipes.boundary.feed import is_one_items_error
from pipeload.datapipes.boundary.queue_interface import (
    DEFAULT_MAXSIZE,
    DataLoaderQueue,
    QueueError,
    check_blocking,
    check_maxsize,
    check_timeout,
)
from pipeload.datapipes.boundary.ray_options import check_actor_options
from pipeload.datapipes.boundary.ray_pipe import check_actors_fit_the_pipe, check_ray_arguments, check_room
from pipeload.datapipes.boundary.ray_upstream import RayOptions, RayUpstream
from pipeload.datapipes.protocol import NotAvailable, Notifier, PipeIterator, WaitCancelled, wait_for_next
from pipeload.errors import WorkerDiedError


class RayQueue(DataLoaderQueue, kind="ray"):
    """Read, in order, what Ray actors running a pipe's shards make.

    Args:
        maxsize: items asked for and not yet taken, over all actors.
        kind: ``"ray"`` (given by ``DataLoaderQueue(kind="ray")``).
        num_actors, chunk_size, address, init_options, start_timeout_s, **actor_options: as for
            ``queue_boundary("ray")`` (see ``RayQueueBoundary``).
    """

    def __init__(self, maxsize: int = DEFAULT_MAXSIZE, kind: str = "ray", *, num_actors: int = 1,
                 chunk_size: int | None = None, address: str | None = None,
                 init_options: dict[str, Any] | None = None, start_timeout_s: float = 300.0,
                 **actor_options: Any) -> None:
        self._maxsize = check_maxsize(maxsize)
        self._options = _options(num_actors, chunk_size, address, init_options, start_timeout_s, **actor_options)
        if chunk_size is not None and self._maxsize >= num_actors:  # (the rest when the actors start)
            check_room(self._maxsize, num_actors, chunk_size, size_name="maxsize")
        self._upstream: RayUpstream | None = None
        self._closed = False

    @classmethod
    def start_producer(cls, pipe: Any, queue: DataLoaderQueue, name: str, options: dict[str, Any]) -> RayUpstream:
        """Start ``queue``'s actors on ``pipe``. ``options``: the boundary's options for this
        kind (``num_actors``, ``chunk_size``, ``address``, actor options: they replace the
        queue's own), ``pool``, an ``ActorPool`` to take actors from and give them back to, and
        ``replica``, which copy of the graph this is (see ``seeds.py``)."""
        if not isinstance(queue, RayQueue):
            raise TypeError(f"RayQueue.start_producer needs a RayQueue, but got {type(queue).__name__}")
        if queue._upstream is not None:
            raise RuntimeError("this RayQueue already has its actors: a queue is between two ends")
        given = {key: value for key, value in options.items()
                 if key not in ("pool", "multiprocessing_context", "replica")}
        settings = _options(**given) if given else queue._options
        settings = queue._options = dataclasses.replace(settings, replica=options.get("replica"))
        # (What queue_boundary("ray") checks as it is built: a queue made by hand meets its pipe here.)
        check_actors_fit_the_pipe(pipe, queue.maxsize, settings.num_actors, settings.chunk_size, size_name="maxsize")
        queue._upstream = RayUpstream(pipe, queue.maxsize, settings, name, options.get("pool"))
        return queue._upstream

    def put(self, data: Any, blocking: bool = True, timeout: float | None = None) -> None:
        raise NotImplementedError(
            "a RayQueue is read at this end only: its far end is the actors start_producer() "
            "starts, which answer this end's requests rather than put"
        )

    def get(self, blocking: bool = True, timeout: float | None = None) -> Any:
        blocking, seconds = check_blocking(blocking), check_timeout(timeout)
        reading = _Reading(self._reading_end())
        try:
            if not blocking:
                return reading.nonblocking_next()
            deadline = None if seconds is None else time.monotonic() + seconds
            timed_out = None if deadline is None else (lambda: time.monotonic() >= deadline)
            return wait_for_next(reading, timed_out)
        except NotAvailable:
            raise
        except WaitCancelled:
            raise QueueError(f"no item from {self._far_end()} within {timeout} s",
                             far_end=self._far_end(), reason=QueueError.TIMED_OUT) from None
        except BaseException as error:
            if is_one_items_error(error):
                raise  # in its item's place: the queue goes on
            raise self._ended_by(error) from None

    def _reading_end(self) -> RayUpstream:
        if self._closed or self._upstream is None:
            why = "was closed" if self._closed else "has no actors yet (start_producer starts them)"
            raise QueueError(f"this RayQueue {why}", far_end=self._far_end(), reason=QueueError.CLOSED,
                             by_this_end=self._closed)
        return self._upstream

    def _ended_by(self, error: BaseException) -> QueueError:
        """The queue's end: every item taken (``StopIteration``), an actor dead, or the pipe
        failed over there (its error is the ``cause``)."""
        self.close()
        far_end = self._far_end()
        if isinstance(error, StopIteration):
            return QueueError(f"{far_end} put its last item", far_end=far_end, reason=QueueError.CLOSED)
        if isinstance(error, WorkerDiedError):
            return QueueError(str(error), far_end=far_end, reason=QueueError.DIED, cause=error)
        return QueueError(f"{far_end} failed: {type(error).__name__}: {error}", far_end=far_end,
                          reason=QueueError.CLOSED, cause=error)

    def _far_end(self) -> str:
        name = self._upstream.name if self._upstream is not None else "(not started)"
        return f"Ray actors of {name!r} ({self._options.num_actors})"

    def close(self, error: BaseException | None = None) -> None:
        """Stop reading: the actors stop (back to their pool, or killed). Idempotent."""
        self._closed = True
        if self._upstream is not None:
            self._upstream.close()

    @property
    def closed(self) -> bool:
        return self._closed

    @property
    def maxsize(self) -> int:
        return self._maxsize

    def notifiers(self) -> list[Notifier]:
        return self._upstream.notifiers() if self._upstream is not None else []


def _options(num_actors: int = 1, chunk_size: int | None = None, address: str | None = None,
             init_options: dict[str, Any] | None = None, start_timeout_s: float = 300.0,
             **actor_options: Any) -> RayOptions:
    check_ray_arguments(num_actors, chunk_size, address, init_options, start_timeout_s)
    check_actor_options(actor_options)
    return RayOptions(num_actors, chunk_size, address, tuple(actor_options.items()),
                      tuple((init_options or {}).items()), start_timeout_s=start_timeout_s)


class _Reading(PipeIterator[Any]):
    """A run's reading end seen through the protocol, for ``wait_for_next``."""

    def __init__(self, upstream: RayUpstream) -> None:
        super().__init__()
        self._upstream = upstream

    def nonblocking_next(self) -> Any:
        return self._upstream.take_nowait()

    def notifiers(self) -> list[Notifier]:
        return self._upstream.notifiers()
