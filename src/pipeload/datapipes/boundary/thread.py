"""A queue boundary's upstream in a thread of this process."""

from __future__ import annotations

import threading
import weakref
from typing import Any

from pipeload._user_frame import UserSite, lend_user_site, user_site
from pipeload.datapipes.boundary.feed import feed
from pipeload.datapipes.boundary.positions import Resume, StateLog
from pipeload.datapipes.boundary.queue_interface import DataLoaderQueue
from pipeload.engine.lifecycle import ThreadWorkerHandle, stop_workers


class ThreadProducer:
    """Owns the thread that runs a boundary's upstream into the producing end of its queue.

    Items travel as objects (no pickling). ``close()`` closes the queue, which makes the thread's
    next put (or its wait for the upstream) give up, then joins it with a deadline; a thread
    stuck in user code is left behind, as a daemon.
    """

    def __init__(self, pipe: Any, queue: DataLoaderQueue, name: str, resume: Resume | None = None,
                 states: StateLog | None = None) -> None:
        """``resume``: where the run starts (None: at the start); ``states``: put the upstream's
        state after items, for the consumer (see ``positions.py``)."""
        thread = threading.Thread(
            target=_feed_under, args=(user_site(), pipe, queue, f"upstream of a thread queue boundary ({name})",
                                      resume, states if states is not None else False),
            name=name, daemon=True,
        )
        self._handle = ThreadWorkerHandle(thread, threading.Event())
        queue.watch(thread)
        self._finalizer = weakref.finalize(self, _stop_thread, queue, self._handle)
        thread.start()

    def close(self) -> None:
        self._finalizer()


def _feed_under(site: UserSite | None, *args: Any) -> None:
    """``feed``, with the user's line that started the thread lent to it: a warning the upstream
    raises (a source skipping a broken shard) points there, not into ``threading``."""
    lend_user_site(site)
    feed(*args)


def _stop_thread(queue: DataLoaderQueue, handle: ThreadWorkerHandle) -> None:
    queue.close()
    handle.terminate()
    stop_workers([handle], force=False)
