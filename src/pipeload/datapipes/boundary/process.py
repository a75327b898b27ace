"""A queue boundary's upstream in another process.

The upstream process iterates the upstream part of the graph into the far end of a process
``DataLoaderQueue``. It is started, watched and stopped by the engine's lifecycle helpers, like
a DataLoader worker: it leaves when its parent dies, ignores Ctrl-C, and is stopped by closing
the queue, then terminating, then killing.

Large tensors cross in slabs of a pool the boundary pipe keeps between its runs (its
``SlabKeeper``): each run borrows it, lends it to its queue, and gives it back once the upstream
process is gone, so that no process still writes into a slab the next run may be granted. A run
that ends in a failure (the upstream died or raised) lets the pool go instead.
"""

from __future__ import annotations

import multiprocessing
import os
import weakref
from typing import Any

import torch

from pipeload.datapipes.boundary.feed import feed
from pipeload.datapipes.boundary.positions import Resume
from pipeload.datapipes.boundary.queue_interface import DataLoaderQueue
from pipeload.datapipes.boundary.seeds import Replica, run_seed, take_seeds
from pipeload.engine.budget import shm_budget_bytes
from pipeload.engine.lifecycle import (
    check_picklable,
    ctrl_c_held,
    exit_now,
    exit_when_creator_dies,
    held_over_a_fork,
    keep_descriptors_from_programs,
    leave_ctrl_c_to_the_main_process,
    release_finished,
    schedule_as_batch_work,
    start_process,
    stop_workers,
)
from pipeload.engine.worker_info import seed_process_worker
from pipeload.transport.slab_keeper import SlabKeeper, SlabSettings
from pipeload.transport.slab_pool import SlabPool

Lent = tuple[SlabKeeper, SlabPool] | None


class ProcessProducer:
    """Owns the upstream process of one run of a process boundary.

    The queue watches the process, so a death is read as one (with its exit status), not as
    a hang. ``keeper``: where the run borrows the slab pool its queue decodes against (None:
    the queue makes one of its own). ``replica``: which copy of the graph this is, mixed into
    the seed of the process's generators (see ``seeds.py``).
    """

    def __init__(self, pipe: Any, queue: DataLoaderQueue, name: str, context: Any,
                 keeper: SlabKeeper | None = None, resume: Resume | None = None,
                 states: bool = False, replica: Replica | None = None) -> None:
        ctx = multiprocessing.get_context(context) if isinstance(context, str) or context is None else context
        if ctx.get_start_method() != "fork":
            check_picklable({"datapipe": pipe}, ctx.get_start_method(), sender="A queue boundary")
        seed = run_seed(pipe, replica)
        lent = _lend_slabs(keeper, queue)
        # A Ctrl-C during the fork comes once the finalizer that stops the process is in place.
        with held_over_a_fork(ctx):
            try:
                # It leaves when its parent dies, so it may be started from a process worker too,
                # a daemon (replica.separate_processes places boundaries there).
                self._process = start_process(ctx, run_upstream_process,
                                              (pipe, seed, queue, resume, states), name,
                                              leaves_with_parent=True)
            except BaseException:
                if lent is not None:
                    lent[0].give_back(lent[1])
                raise
            take_seeds(pipe)  # the process has its copy of them
            queue.watch(self._process)
            self._finalizer = weakref.finalize(self, _stop_process, queue, self._process, lent)

    @property
    def pid(self) -> int:
        return self._process.pid

    def close(self) -> None:
        """Close the queue, then stop the process (it leaves by itself, or is terminated)."""
        self._finalizer()


def _lend_slabs(keeper: SlabKeeper | None, queue: DataLoaderQueue) -> Lent:
    """Borrow the keeper's pool for this run and lend it to the queue's getting end."""
    lend = getattr(queue, "lend_slabs", None)
    if keeper is None or lend is None:
        return None
    in_flight = queue.maxsize + 2  # in flight or waiting, the one the consumer holds, one more
    pool = keeper.lend(SlabSettings(False, shm_budget_bytes(None, keeper.held_bytes), in_flight))
    lend(pool)
    return keeper, pool


def _stop_process(queue: DataLoaderQueue, process: Any, lent: Lent) -> None:
    # Ctrl-C waits until the process is stopped and its slabs given back: this finalizer does
    # not run twice (see ``ctrl_c_held``).
    with ctrl_c_held():
        _stop_and_give_back(queue, process, lent)


def _stop_and_give_back(queue: DataLoaderQueue, process: Any, lent: Lent) -> None:
    failed, stopped = getattr(queue, "ended_in_failure", False), False
    try:
        queue.close()
        stop_workers([process])
        release_finished([process])
        stopped = True
    finally:
        if lent is not None:  # nobody writes into its slabs any more (or they are let go)
            keeper, pool = lent
            keeper.give_back(pool, release=failed or not stopped)


def run_upstream_process(upstream_pipe: Any, seed: int, queue: DataLoaderQueue,
                         resume: Resume | None = None, states: bool = False) -> None:
    """Entry point of a boundary's upstream process (``resume``, ``states``: see ``feed``)."""
    leave_ctrl_c_to_the_main_process()
    keep_descriptors_from_programs()
    exit_when_creator_dies()
    schedule_as_batch_work()  # woken by the consumer, it must not preempt it
    torch.set_num_threads(1)
    seed_process_worker(seed, 0)  # its own random streams, fixed by the parent's generator
    where = f"the upstream process of a queue boundary (pid {os.getpid()})"
    name_this_end = getattr(queue, "name_this_end", None)
    if name_this_end is not None:
        name_this_end(where)
    try:
        feed(upstream_pipe, queue, f"in {where}", resume, states)
    finally:
        queue.close()
    exit_now()
