"""A queue boundary's upstream in a thread of this process."""

from __future__ import annotations

import threading
import weakref
from typing import Any

from pipeload.datapipes.boundary.mailbox import Mailbox
from pipeload.datapipes.protocol import NotAvailable, WaitCancelled, as_nonblocking, wait_for_next
from pipeload.engine.lifecycle import ThreadWorkerHandle, stop_workers


class ThreadUpstream:
    """Owns one thread that runs the upstream part of a graph and fills a mailbox.

    The thread makes, uses and closes the upstream iterator itself, so nothing upstream is ever
    touched from two threads. Items travel as objects (no pickling).
    """

    def __init__(self, upstream_pipe: Any, capacity: int, name: str) -> None:
        self.mailbox = Mailbox(capacity)
        self._stop = threading.Event()
        thread = threading.Thread(
            target=_produce, args=(upstream_pipe, self.mailbox, self._stop), name=name, daemon=True
        )
        self._handle = ThreadWorkerHandle(thread, self._stop)
        self._finalizer = weakref.finalize(self, _stop_thread, self.mailbox, self._handle)
        thread.start()

    def notifiers(self) -> list[Any]:
        return [self.mailbox.notifier]

    def take_nowait(self) -> Any:
        return self.mailbox.take_nowait()

    def close(self) -> None:
        """Stop the thread (joined with a deadline: one stuck in user code is left, as a daemon)."""
        self._finalizer()


def _stop_thread(mailbox: Mailbox, handle: ThreadWorkerHandle) -> None:
    handle.terminate()  # sets the stop event
    mailbox.close()
    stop_workers([handle], force=False)


def _produce(upstream_pipe: Any, mailbox: Mailbox, stop: threading.Event) -> None:
    iterator = None
    try:
        iterator = as_nonblocking(upstream_pipe)
        while mailbox.put(_next_unless_stopped(iterator, stop), stop.is_set):
            pass
    except WaitCancelled:
        pass  # the consumer closed the boundary
    except StopIteration:
        mailbox.finish()
    except BaseException as exc:  # noqa: BLE001  (every failure goes downstream, whole)
        exc.add_note(
            f"pipeload: raised upstream of a thread queue boundary ({threading.current_thread().name})"
        )
        mailbox.fail(exc)
    finally:
        if iterator is not None:
            iterator.close()


def _next_unless_stopped(iterator: Any, stop: threading.Event) -> Any:
    if stop.is_set():
        raise WaitCancelled
    try:
        return iterator.nonblocking_next()
    except NotAvailable:  # a boundary further upstream has nothing yet
        return wait_for_next(iterator, stop.is_set)
