"""A group of workers (processes or threads) with their channels, as every pooled engine runs them.

The classic pool and economic mode differ only in what their workers run, which a
:class:`LaunchPlan` says. Starting them, sending tasks without ever blocking for good, waiting for
reports while watching for deaths and the timeout, naming a dead worker, and stopping everything
are the same for both, and live here.
"""

from __future__ import annotations

import multiprocessing
import os
import threading
import time
import warnings
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Protocol

from pipeload._user_frame import first_frame_outside_pipeload
from pipeload.engine import huge_heap
from pipeload.engine.lifecycle import (
    GoneBeforeStarting,
    ThreadWorkerHandle,
    WorkerLaunch,
    check_picklable,
    ctrl_c_held,
    reap_in_background,
    release_finished,
    start_processes,
    start_threads,
    stop_workers,
)
from pipeload.engine.main_module import started_outside_main_guard, unreachable_in_workers
from pipeload.errors import LoaderTimeoutError, WorkerDiedError, worker_died_message
from pipeload.stats.recorder import carries_totals, count_by_worker
from pipeload.transport.channel import ProcessChannels, ThreadChannels
from pipeload.transport.messages import Command, Report, WorkerCommand, WorkerReport
from pipeload.transport.slab_keeper import SlabKeeper, SlabSettings
from pipeload.transport.slab_pool import SlabPool

__all__ = ["SlabSettings", "WorkerGroup", "WorkerLabel"]

WAIT_SLICE_S = 1.0
EXIT_STATUS_WAIT_S = 1.0
THREAD_CHECK_INTERVAL_S = 0.1
REAP_WAIT_S = 0.1


@dataclass(frozen=True)
class WorkerLabel:
    """How messages name one worker: its kind ("" in classic mode, "item" or "batch") and its id
    among the workers of that kind."""

    kind: str
    id: int

    def name(self, what: str = "worker") -> str:
        """E.g. "worker 3", "item worker 3", "batch worker thread 1"."""
        return f"{self.kind} {what} {self.id}".lstrip()


class LaunchPlan(Protocol):
    """What an engine's workers run. One channel slot per label, in the same order."""

    @property
    def labels(self) -> list[WorkerLabel]: ...

    def picklable_parts(self) -> dict[str, Any]:
        """Objects spawn and forkserver must pickle, by the argument name the user knows."""
        ...

    def process_launches(self, ctx: Any, channels: ProcessChannels) -> list[WorkerLaunch]: ...

    def thread_launches(self, channels: ThreadChannels, stop: threading.Event) -> list[WorkerLaunch]: ...


class GrowingPlan(LaunchPlan, Protocol):
    """A plan whose group can grow and shrink in place (the classic pool's, under "auto")."""

    def resize(self, count: int, epoch: int | None = None) -> None:
        """From now on the group has ``count`` workers; workers started from now on begin in
        session epoch ``epoch`` (None: as before). The launches then cover workers ``first``
        up to ``count``."""
        ...

    def process_launches(self, ctx: Any, channels: ProcessChannels, first: int = 0) -> list[WorkerLaunch]: ...

    def thread_launches(self, channels: ThreadChannels, stop: threading.Event,
                        first: int = 0) -> list[WorkerLaunch]: ...

    def close(self) -> None:
        """Release what the plan owns besides the group's channels (idempotent)."""
        ...


class WorkerGroup:
    """Owns the workers' handles and channels; closing it stops and releases everything.

    Process workers send their results through the transport: the group borrows the slab pool
    (``slabs``) their batches are written into from the loader's :class:`SlabKeeper`, and gives
    it back when it stops (the next set of workers finds the slabs ready); it owns the main
    process's ends of the channels that decode against it. Thread workers pass objects as they
    are (``slabs`` is None).

    Kept apart from the engines so an engine's finalizer can hold the group without holding the
    engine. Used by one thread at a time (whoever drives the engine), and by ``close()``.
    """

    def __init__(
        self, plan: LaunchPlan, worker_type: str, mp_context: Any, timeout_s: float,
        slab_settings: SlabSettings, stats: Any = None, start_first: int | None = None,
        counted_by_engine: bool = False, keeper: SlabKeeper | None = None,
        on_demand_from: int | None = None, short_lived: bool = False,
    ) -> None:
        """``start_first``: process workers of the first slots to start now (None: all but those
        that start on demand); the others start on the first command sent to them, or
        ``start_all()``. Economic mode forks its item workers one by one as their first pieces
        go out, where the sampler's draws allow, so that the first ones fetch while the rest are
        forked. ``on_demand_from``: process workers of this slot and up start only when a
        command is first sent to one of them, all of them then, never with ``start_all()``
        (None: none): economic mode's batch workers, which a loader whose batches the main
        process assembles never needs. ``counted_by_engine``: the engine counts each worker's
        answers itself and records the reports with totals (a classic pool's ledger); the group
        records only those it reads itself, between epochs. ``keeper``: where the slab pool is
        borrowed from (None: a pool of the group's own, closed with it). ``short_lived``: the
        workers stop with the epoch (no persistent workers)."""
        self.plan = plan
        self._keeper = keeper if keeper is not None else SlabKeeper(keep=False)
        self.stats = stats  # a SessionStats, fed every report (pipeload.stats.recorder)
        # ... except by thread workers that lend their clocks to it (a classic pool's): their
        # reports carry nothing for it.
        self._record = (stats is not None and not counted_by_engine
                        and not (worker_type == "thread" and getattr(plan, "lends_clocks", False)))
        self._records_between_epochs = stats is not None and counted_by_engine
        self._lag = stats.lag if self._record else None  # reports counted per worker: see receive
        self._count_key = stats.count_key if self._record else None
        self.labels = plan.labels
        self.timeout_s = timeout_s
        self.stop_event: threading.Event | None = None
        self.slabs: SlabPool | None = None
        self.closed = False
        self.failed = False  # an error was raised from this set: its slab pool goes with it
        self._unstarted: list[WorkerLaunch] = []  # process workers of the last slots, in order
        self._eager = len(plan.labels) if on_demand_from is None else on_demand_from
        self._retired: set[int] = set()  # slots asked to stop early: their exit is no death
        self._idle = False  # every task answered, none to come (see all_answered)
        self.start_failed = False  # a worker could not be started: the group cannot go on
        self._short_lived = short_lived
        self._ctx: Any = None
        self._owner_pid = os.getpid()
        count = len(self.labels)
        try:
            if worker_type == "thread":
                self.stop_event = threading.Event()
                self.channels: Any = ThreadChannels(count)
                self.handles = start_threads(plan.thread_launches(self.channels, self.stop_event),
                                             self.stop_event)
                self._tell_started(0)
            else:
                self._start_processes(plan, mp_context, count, slab_settings, start_first)
        except BaseException:
            plan.close()
            raise

    def _start_processes(
        self, plan: LaunchPlan, mp_context: Any, count: int, settings: SlabSettings,
        start_first: int | None,
    ) -> None:
        ctx = self._ctx = mp_context or multiprocessing.get_context()
        sent = ctx.get_start_method() != "fork"  # pickled to each worker (spawn, forkserver)
        if sent:
            _warn_if_started_outside_main_guard()
        self.slabs = self._keeper.lend(settings)
        self.channels = ProcessChannels(ctx, count, self.slabs)
        self.handles = []
        try:
            self._unstarted = list(plan.process_launches(ctx, self.channels))
            try:
                self._start_up_to(self._eager if start_first is None else max(1, start_first))
            except Exception:
                if sent and not self.handles:
                    # The first start pickles what every worker is sent: if that failed, say
                    # which argument could not be (raises). Checked only then: a check before
                    # every start pickled a dataset once more per set of workers.
                    check_picklable(plan.picklable_parts(), ctx.get_start_method())
                raise
        except BaseException:
            self.channels.forget_worker_ends()
            self.channels.close()
            self._keeper.give_back(self.slabs, release=True)  # a failed start: see give_back
            raise

    def started(self, slot: int) -> bool:
        """Whether the worker in ``slot`` has started (a process worker may start on demand)."""
        return slot < len(self.handles)

    def start_all(self) -> None:
        """Start the process workers not started yet (see ``start_first``), less those that
        start on demand (``on_demand_from``)."""
        self._start_up_to(self._eager)

    def _start_up_to(self, count: int) -> None:
        """Start the process workers of the slots below ``count`` that have not started, in order
        (a worker forked earlier inherits the main process's copies of the later ones' ends, as
        when all start at once). The parent's copies of every worker end go once all started."""
        launches = self._unstarted[:max(0, count - len(self.handles))]
        if not launches:
            return
        del self._unstarted[:len(launches)]
        last = not self._unstarted
        first_slot = len(self.handles)
        beside = self._short_lived and self._ctx.get_start_method() == "fork"
        if beside and first_slot == 0:
            huge_heap.GATHERER.before_short_lived_workers(self._eager)
        try:
            self.handles += start_processes(self._ctx, launches,
                                            self.channels.forget_worker_ends if last else _nothing)
        except GoneBeforeStarting as gone:
            self.start_failed = True
            slot = first_slot + [launch.name for launch in launches].index(gone.name)
            deaths = [(self.labels[slot].name(), gone.pid, gone.exitcode)]
            raise WorkerDiedError(worker_died_message(deaths, self._why_workers_could_not_start(deaths))) from gone
        except BaseException:  # (unnamed: a name would hold its traceback, and the loader, in a cycle)
            self.start_failed = True
            raise
        self._tell_started(first_slot)
        if beside and len(self.handles) >= self._eager:
            # Every worker the epoch needs has forked: the next set forks from huge pages
            # (engine/huge_heap.py), gathered beside these workers, which go with the epoch.
            huge_heap.GATHERER.beside_short_lived_workers([handle.pid for handle in self.handles])

    def _tell_started(self, first: int) -> None:
        """The workers of slots ``first`` and up have just started: the stats list each from now
        on, whether or not a task ever comes to it (``SessionStats.started``)."""
        if self.stats is not None:
            self.stats.started(self.labels[first:len(self.handles)])

    @property
    def wait_slice_s(self) -> float:
        # Process deaths wake the wait through their sentinels; threads have none, so look often.
        return THREAD_CHECK_INTERVAL_S if self.stop_event is not None else WAIT_SLICE_S

    def sentinels(self) -> list[int]:
        """Exit sentinels of the process workers (empty for threads), less the retired ones'."""
        handles = self._living_handles() if self._retired else self.handles
        return [h.sentinel for h in handles if getattr(h, "sentinel", None) is not None]

    def _living_handles(self) -> list[Any]:
        return [h for slot, h in enumerate(self.handles) if slot not in self._retired]

    def retire(self, slot: int) -> None:
        """Ask the process worker in ``slot``, which has answered every task it was sent and will
        be sent no more, to stop now (once): it exits while the others finish, and its exit is
        not a death. ``close()`` still waits for it."""
        if slot in self._retired or self.stop_event is not None or slot >= len(self.handles):
            return
        self._retired.add(slot)
        if self.handles[slot].is_alive():
            self._ask_to_stop(slot)

    def all_alive(self) -> bool:
        if self.stop_event is None:
            return True  # process deaths are reported by their sentinels, without a syscall each
        return all(handle.is_alive() for handle in self.handles)

    def deadline(self) -> float | None:
        """When a wait that starts now must give up (None: the loader has no timeout)."""
        return time.monotonic() + self.timeout_s if self.timeout_s > 0 else None

    # -- talking to workers ----------------------------------------------------------------

    def send(self, slot: int, command: WorkerCommand) -> None:
        """Send a task (starting its worker if it has not started); never blocks for good on a
        worker that stopped reading."""
        if slot >= len(self.handles):
            # Workers that start on demand start together: once one is needed, the others will
            # be, and each one's start (its worker_init_fn) then overlaps the others'.
            self._start_up_to(len(self.labels) if slot >= self._eager else slot + 1)
        try:
            self.channels.send(slot, command, self._while_pipe_full(slot))
        except (BrokenPipeError, ConnectionResetError, EOFError):
            # The worker's end closed because it is dying; its exit status comes a moment later.
            handle = self.handles[slot]
            handle.join(EXIT_STATUS_WAIT_S)
            self.raise_for_dead_workers()
            raise WorkerDiedError(
                f"DataLoader worker (pid(s) {handle.pid}) exited unexpectedly: "
                f"{self.labels[slot].name()} stopped reading its tasks"
            ) from None

    def _while_pipe_full(self, slot: int) -> Callable[[], None]:
        """What to check while a worker's task pipe is full: that it lives, and the timeout."""
        deadline = self.deadline()
        handle = self.handles[slot]

        def check() -> None:
            if not handle.is_alive():
                self.raise_for_dead_workers()
            if deadline is not None and time.monotonic() >= deadline:
                raise LoaderTimeoutError(
                    f"DataLoader timed out after {self.timeout_s} seconds: "
                    f"{self.labels[slot].name()} is not taking new tasks"
                )

        return check

    def receive(self, deadline: float | None) -> list[WorkerReport]:
        """Wait for reports until ``deadline``; raise on timeout or as soon as a worker has died."""
        while True:
            slice_s = self.wait_slice_s
            if deadline is not None:
                slice_s = min(slice_s, max(0.0, deadline - time.monotonic()))
            reports, fired = self.channels.wait(slice_s, self.sentinels())
            if fired or not self.all_alive():
                reports.clear()  # about to raise: the traceback keeps this frame and its batches
                self.raise_for_dead_workers()
            if reports:
                if self._record:  # one step per burst, in C, unless one carries totals
                    if any(map(carries_totals, reports)):
                        self.stats.record(reports)
                    else:
                        count_by_worker(self._lag, map(self._count_key, reports))
                return reports
            if deadline is not None and time.monotonic() >= deadline:
                raise LoaderTimeoutError(f"DataLoader timed out after {self.timeout_s} seconds")

    def raise_for_dead_workers(self) -> None:
        """Raise WorkerDiedError naming every worker that is no longer running, if any: torch's
        sentence first for processes, then which workers and how they ended."""
        dead = []
        for slot, (label, handle) in enumerate(zip(self.labels, self.handles)):
            if slot not in self._retired and not handle.is_alive():
                handle.join(REAP_WAIT_S)  # reap it, so its exit code is known
                dead.append((label, handle))
        if not dead:
            return
        if isinstance(dead[0][1], ThreadWorkerHandle):
            raise WorkerDiedError("DataLoader " + "; ".join(_how_thread_ended(label) for label, _ in dead))
        deaths = [(label.name(), h.pid, h.exitcode) for label, h in dead]
        raise WorkerDiedError(worker_died_message(deaths, self._why_workers_could_not_start(deaths)))

    def _why_workers_could_not_start(self, deaths: list[tuple[str, int | None, int | None]]) -> str:
        """What is known of why a 'spawn' or 'forkserver' worker ended with exit code 1, the
        code of a worker that could not unpickle what it was sent (a class or function the main
        script defines where a worker importing it does not look), or that the import itself
        started workers (a script without a main guard); "" if neither."""
        if self._ctx is None or self._ctx.get_start_method() == "fork":
            return ""
        if not any(code == 1 for _, _, code in deaths):
            return ""
        return unreachable_in_workers(self.plan.picklable_parts()) or started_outside_main_guard()

    def tell_last_batch(self, number: int) -> None:
        """Tell every started worker that the first epoch's last batch is ``number`` (for the
        classic workers' stats); workers started later have it in their setup."""
        told = WorkerCommand(Command.LAST_BATCH, number)
        for slot in range(len(self.handles)):
            self.send(slot, told)

    def start_epoch(self, epoch: int, shared_seed: int | None = None, last_batch: int = -1) -> None:
        """Persistent workers: tell every worker that epoch ``epoch`` begins (``shared_seed``
        reseeds their DataPipe graphs; ``last_batch``: the epoch's last batch number, for the
        classic workers' stats, -1 when unknown), and wait until all have answered. Reports of the old
        epoch that arrive meanwhile are dropped: a worker's reports come in order, so after its
        answer none of them can follow."""
        self.start_all()  # an epoch that sent nothing may have left some unstarted
        # Workers that start on demand and have not been needed yet begin in whatever epoch that
        # is: each command they get names its epoch.
        start = WorkerCommand(Command.START_EPOCH, last_batch, epoch=epoch, shared_seed=shared_seed)
        for slot in range(len(self.handles)):
            self.send(slot, start)
        waiting = len(self.handles)  # each worker answers exactly once
        while waiting:
            reports = self.receive(self.deadline())
            if self._records_between_epochs:  # the old epoch's last answers, and the new one's
                self.stats.record(reports)
            for report in reports:
                if report.report is Report.EPOCH_STARTED and report.batch_number == epoch:
                    waiting -= 1
        if self.slabs is not None:
            self.slabs.cancel_all_grants()  # their tasks were answered or dropped by now

    # -- growing and shrinking in place ----------------------------------------------------

    def grow(self, count: int, epoch: int) -> None:
        """Start workers until there are ``count``, beside the running ones (which go on
        working); the new ones begin in session epoch ``epoch``. Needs a :class:`GrowingPlan`.
        If a start fails, the workers started here are stopped and the group is as it was."""
        if self.stop_event is None:
            self._start_up_to(len(self.labels))  # the new ones are numbered after every slot
        first = len(self.handles)
        plan: GrowingPlan = self.plan  # type: ignore[assignment]
        plan.resize(count, epoch)
        try:
            with ctrl_c_held():  # a pipe made and not yet kept in the channels would stay open
                self.channels.add_workers(count - first)
            if self.stop_event is not None:
                added = start_threads(plan.thread_launches(self.channels, self.stop_event, first),
                                      self.stop_event)
            else:
                added = start_processes(self._ctx, plan.process_launches(self._ctx, self.channels, first),
                                        lambda: self.channels.forget_worker_ends(first))
        except BaseException:
            self.channels.drop_workers(first)
            plan.resize(first, epoch)
            raise
        self.handles = self.handles + added
        self.labels = plan.labels
        self._tell_started(first)

    def shrink(self, count: int) -> None:
        """Stop workers ``count`` and up, which must have nothing in flight, and forget them:
        the group is as if it had started with ``count`` workers."""
        gone = self.handles[count:]
        stop_workers(gone, lambda index: self._ask_to_stop(count + index), force=self.stop_event is None)
        self.channels.drop_workers(count)
        for slot in range(count, count + len(gone)):
            if self.slabs is not None:
                self.slabs.forget_producer(slot)
            if self.stats is not None:
                self.stats.retire(slot)
        self.handles = self.handles[:count]
        plan: GrowingPlan = self.plan  # type: ignore[assignment]
        plan.resize(count)
        self.labels = plan.labels
        release_finished(gone)

    # -- stopping --------------------------------------------------------------------------

    def mark_failed(self) -> None:
        """An error was raised to the training loop from this set (a failed batch, a timeout, a
        dead worker, Ctrl-C). Its traceback may keep the loader alive for as long as it is kept:
        when the set stops, its slab pool is released rather than kept for a next set."""
        self.failed = True

    def close(self) -> None:
        # Ctrl-C waits until everything below is done: once ``closed`` is set nothing would
        # finish the rest (see ``ctrl_c_held``).
        with ctrl_c_held():
            self._close()

    def all_answered(self) -> None:
        """Every task sent to this set has been answered and no more will be (a clean end of the
        epoch): its process workers write nothing more, so ``close()`` need not wait for them to
        exit before it gives their slabs back (``reap_in_background``)."""
        self._idle = True

    def _close(self) -> None:
        if self.closed:
            return
        self.closed = True
        if os.getpid() != self._owner_pid:
            # A copy of this group in a child made by a plain os.fork(), closed as that child
            # exits: the workers are its parent's, who goes on using them. Its copies of the
            # channels and slabs go with its exit.
            return
        if self.stop_event is not None:
            self.stop_event.set()
        idle = self._idle and not self.failed and self.stop_event is None
        if idle:
            for slot in range(len(self.handles)):
                self.retire(slot)  # asks those not asked yet: their exits are waited for below
        else:
            stop_workers(self.handles, self._ask_to_stop, force=self.stop_event is None)
        self._unstarted = []
        self.channels.forget_worker_ends()  # the ends of workers that never started
        self.channels.close()
        if self.slabs is not None:
            # The workers are gone, or idle and asked to stop: their grants are over.
            self._keeper.give_back(self.slabs, release=self.failed)
            self.slabs = None  # the next set may borrow it now
        self.plan.close()
        if idle and self.handles:
            reap_in_background(list(self.handles), self._after_stopped)
        else:
            self._after_stopped()

    def _after_stopped(self) -> None:
        release_finished(self.handles)
        if self.handles and self._ctx is not None and self._ctx.get_start_method() == "fork":
            # This process forks workers again (the next epoch, the next loader): cheaper once
            # its memory lies in huge pages (engine/huge_heap.py).
            huge_heap.GATHERER.after_workers_stopped(len(self.handles))

    def _ask_to_stop(self, slot: int) -> None:
        try:
            self.channels.send(slot, WorkerCommand(Command.STOP), while_full=_give_up)
        except _PipeFull:
            pass  # a worker that is not reading is stopped by the escalation instead


class _PipeFull(Exception):
    """Closing never waits for room in a task pipe."""


def _warn_if_started_outside_main_guard() -> None:
    """Say it before the workers start, so that the cause comes first whatever the start method
    makes of a worker that dies of it (with the line to move, ``GoneBeforeStarting`` or
    ``WorkerDiedError`` say it again)."""
    unguarded = started_outside_main_guard()
    if unguarded:
        warnings.warn(f"pipeload: {unguarded}.", stacklevel=first_frame_outside_pipeload())


def _nothing() -> None:
    pass


def _give_up() -> None:
    raise _PipeFull


def _how_thread_ended(label: WorkerLabel) -> str:
    return (f"{label.name('worker thread')} ended unexpectedly: something that is not an "
            "Exception (SystemExit, for example) escaped the dataset or collate code")

