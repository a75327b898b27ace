"""The producing side of every queue boundary: run the upstream pipe into a ``DataLoaderQueue``.

Whatever runs the far end (a thread, a process, an actor) calls :func:`feed`: it makes the
upstream iterator, puts each item, and closes the queue at the end, or with the error when the
run fails. An error the upstream raises for one item goes into the queue in that item's place
(``RaisedUpstream``) and the run goes on: the consumer gets every item and every such error in
order, then the end, as it would from the upstream alone (between processes the error travels
as a ``RemoteFailure``: its type, message and traceback text). The iterator is made, used and
closed by the calling thread alone, so nothing upstream is touched from two.

A queue that can take an item's tensors where it will travel (a process queue's slabs) is told
before each item is taken (``prepare_put``), so that ``default_collate`` upstream stacks into
that memory and nothing is copied; the item is dropped once put, as a slab it views could not
be granted again while this process still viewed it.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from pipeload.datapipes.boundary.positions import Carrying, Resume, StateLog, StateTaker, UpstreamState, resumed
from pipeload.datapipes.boundary.queue_interface import DataLoaderQueue, QueueError
from pipeload.datapipes.protocol import NotAvailable, WaitCancelled, as_nonblocking, wait_for_next
from pipeload.errors import RemoteFailure


@dataclass(frozen=True)
class RaisedUpstream:
    """An error the upstream raised for one item, in the queue at that item's place: the
    consumer raises it there and goes on with the next, as a loop over the upstream alone would
    (a source's iterator goes on past an archive it could not read; a generator ends).
    ``error``: the exception itself between threads; between processes its ``RemoteFailure``
    (an exception's traceback does not pickle)."""

    error: BaseException | RemoteFailure

    def exception(self) -> BaseException:
        """The exception the consumer raises in the item's place (marked as one item's: see
        :func:`is_one_items_error`)."""
        error = self.error
        raised = error.to_exception() if isinstance(error, RemoteFailure) else error
        try:
            raised.__pipeload_one_item__ = True  # type: ignore[attr-defined]
        except AttributeError:
            pass  # an exception that takes no attributes: read as the run's end
        return raised


def is_one_items_error(error: BaseException) -> bool:
    """Whether ``error`` was raised in one item's place (``RaisedUpstream``): the run goes on,
    and what reads it must not end the run for it."""
    return getattr(error, "__pipeload_one_item__", False) is True


def feed(pipe: Any, queue: DataLoaderQueue, where: str, resume: Resume | None = None,
         states: StateLog | bool = False) -> None:
    """Put every item of ``pipe`` into ``queue``, then close it (with the error, on a failure).

    Returns early, quietly, when the consumer closes the queue (or dies): nobody wants the
    items any more.

    Args:
        pipe: the upstream part of the graph.
        queue: the producing end.
        where: where this runs, for the note added to an upstream error ("upstream of a thread
            queue boundary (pipeload-queueboundary-3)").
        resume: where a resumed run starts (see ``positions.py``); None: at the start.
        states: take the upstream's state after items (``positions.StateTaker``), for a queue
            boundary's checkpoint: into this ``StateLog`` (a thread consumer reads it), or, when
            True, into the queue after the item (a process consumer); False: none.
    """
    iterator = None
    stage = "iterating the upstream pipe"
    prepare = getattr(queue, "prepare_put", None)
    # A thread consumer's log gets the state before the item is put (so it is there when the
    # item is taken); a process consumer's state rides with its item.
    carried: list[UpstreamState] = []
    taker = None
    # An upstream error for one item goes in its place and the run goes on, as a loop over the
    # upstream alone (or a DataLoader worker over its dataset) would; one whose class says
    # ``ends_the_run`` (a failure budget spent) ends it. Across a process the error goes as data
    # (``RemoteFailure``), so that no traceback keeps this process's frames, and slabs, alive.
    # Other kinds end the run (Ray's lanes do not feed: ray_shard.py goes on the same way).
    kind = getattr(queue, "kind", None)
    goes_on = kind in ("thread", "process")
    as_data = kind == "process"
    if isinstance(states, StateLog):
        taker = StateTaker(states.record, states.no_state)
    elif states:
        taker = StateTaker(lambda _count, state: carried.append(UpstreamState.of(state)),
                           lambda why: carried.append(UpstreamState(unavailable=why)))

    def next_position() -> Any:
        """The upstream's next item, or a ``RaisedUpstream`` holding its error for that item
        (which takes a position, as an item does: counted by the consumer and by the states)."""
        try:
            return _next_unless_closed(iterator, queue)
        except (StopIteration, QueueError, WaitCancelled):
            raise
        except Exception as exc:
            if not goes_on or getattr(exc, "ends_the_run", False):
                raise
            return RaisedUpstream(exc)

    def as_sent(raised: RaisedUpstream) -> RaisedUpstream:
        """``raised`` as it can cross to the consumer (see ``as_data``)."""
        if not as_data:
            return raised
        return RaisedUpstream(RemoteFailure.of(raised.error, 0, "iterating the upstream pipe", where))  # type: ignore[arg-type]

    try:
        iterator = as_nonblocking(pipe)
        if resume is not None:
            stage = "resuming the upstream pipe from its checkpoint"
            resumed(iterator, resume, next_position)  # an error before the checkpoint: its place
        while True:
            if prepare is not None:
                prepare()
            stage = "iterating the upstream pipe"
            item = next_position()
            if type(item) is RaisedUpstream:
                item.error.add_note(f"pipeload: raised {where} while {stage}")
                item = as_sent(item)
            if taker is not None:
                taker.left -= 1
                if taker.left == 0:
                    stage = "taking the upstream pipe's state"
                    taker.take(iterator)
                    if carried:
                        item = Carrying(item, carried.pop())
            stage = "sending an item to the consumer"
            queue.put(item)
            del item
    except StopIteration:
        queue.close()
    except (QueueError, WaitCancelled):
        pass  # the consumer closed the queue, or went away
    except BaseException as exc:  # noqa: BLE001  (every failure goes downstream, whole)
        exc.add_note(f"pipeload: raised {where} while {stage}")
        queue.close(error=exc)
    finally:
        if iterator is not None:
            iterator.close()


def _next_unless_closed(iterator: Any, queue: DataLoaderQueue) -> Any:
    if queue.closed:
        raise WaitCancelled
    try:
        return iterator.nonblocking_next()
    except NotAvailable:  # a boundary further upstream has nothing yet
        pass
    return wait_for_next(iterator, lambda: queue.closed)  # outside the except: no NotAvailable context
