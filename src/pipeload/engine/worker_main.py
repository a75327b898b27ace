"""The worker loop: receive a command, build a batch, report it. Runs in a process or a thread.

A worker never decides anything about order or flow: the main process tells it which batch to
build and it reports what happened, including "my iterable ran dry" and "this raised".
"""

from __future__ import annotations

import dataclasses
import gc
import math
import os
import re
import threading
import time
import weakref
from collections import deque
from collections.abc import Callable
from typing import Any

import torch

from pipeload.engine import replica
from pipeload.engine.batch_seeding import BatchSeeding
from pipeload.engine.fetch import DatasetExhausted, IterableFetcher, make_fetcher, meant_samples
from pipeload.engine.lifecycle import (
    exit_now,
    exit_when_creator_dies,
    keep_descriptors_from_programs,
    leave_ctrl_c_to_the_main_process,
    schedule_as_batch_work,
    steady_heap,
)
from pipeload.engine.plan import DatasetKind, WorkerSetup
from pipeload.engine.worker_info import (
    WorkerInfo,
    get_worker_info,
    make_thread_rng,
    seed_process_worker,
    publish_to_torch,
    set_process_worker_info,
    set_worker_info,
    set_worker_stopping,
)
from pipeload.errors import RemoteFailure, SharedMemoryError
from pipeload.stats.clock import SAMPLE_EVERY, StageClock, count_the_whole_process, now
from pipeload.stats import skips
from pipeload.stats.ray_stage import ray_stage_counter
from pipeload.transport.messages import Command, Report, WorkerCommand, WorkerReport

POLL_INTERVAL_S = 0.1

SHM_DIR = "/dev/shm"  # where POSIX shared memory names live on Linux
# torch: "unable to allocate shared memory(shm) for file </torch_<pid>_<n>_<n>>: No space left ..."
_TORCH_SEGMENT = re.compile(r"for file </(?P<name>torch_(?P<pid>\d+)_[^>/]*)>")

SHM_TOO_SMALL = (
    "shared memory is too small for the batches in flight. Give the container more memory (or "
    "/dev/shm more room: docker run --shm-size=2g), or lower max_shm_bytes, num_workers, "
    "prefetch_factor or batch_size."
)


class WorkerLoop:
    """One worker's life: set up, then serve commands until STOP or ``should_stop()``.

    Owned by the thread or process it runs in; touches nothing shared but its inbox and outbox.
    Economic mode's item worker is this loop with another ``_serve``.
    """

    # Whether it says, after each batch written into a slab, which slabs it still views
    # (``Sender.confirm_views``): a worker that runs the user's collate function does.
    confirms_views = True

    kind = ""  # how failures name this kind of worker: "" for a classic worker

    def __init__(
        self,
        setup: WorkerSetup,
        worker_id: int,
        inbox: Any,
        outbox: Any,
        should_stop: Callable[[], bool],
        share_clock: Callable[[Any], None] | None = None,
    ) -> None:
        self._setup = setup
        self._id = worker_id
        self._inbox = inbox
        self._outbox = outbox
        if self.kind == "" and self.confirms_views:
            # Its first large batches, before the pool knows their size, travel in buffers the
            # pool may take over as slabs (transport/slab_writer.py).
            outbox.offer_buffers()
        self._should_stop = should_stop
        self._fetcher: Any = None
        self._init_failure: RemoteFailure | None = None
        self._init_failure_reported = False
        self._exhausted = False
        self._pending: deque[WorkerCommand] = deque()
        # Every worker (economic mode's too) times one task in SAMPLE_EVERY, fewer when tasks
        # are short (stats/clock.py).
        self._clock = StageClock(SAMPLE_EVERY) if setup.stats else None
        # A thread worker of the classic pool lends its clock to the main process, which reads
        # it when asked: its reports then carry no totals.
        self._lends_clock = self._clock is not None and share_clock is not None
        sizes = setup.batch_sizes if self.kind == "" and setup.fetch.kind is DatasetKind.MAP else None
        if self._clock is not None and sizes is not None:
            # The sampler says what the batches hold: an untimed batch's samples are derived,
            # not counted, and the epoch's last batch (which may be short) is always timed.
            self._clock.untimed_size = sizes[0]
            self._last_batch_is(-1 if sizes[1] is None else sizes[1])
            # The pool's ledger counts this worker's answers: the clock need not count its
            # tasks, and goes by batch numbers (one comparison per task). A lent clock is
            # completed with that count when the main process reads it.
            self._clock.counted_by_receiver(setup.num_workers)
        if self._lends_clock:
            share_clock(self._clock)  # type: ignore[misc]
        # A batch's report: sent as is, unless the clock times the task in hand, which arms the
        # path that adds the totals (so an untimed batch runs the stats-off path exactly). Kept
        # as functions called with self, and the clock's hook holds the loop weakly: no
        # reference cycle keeps a finished thread worker's dataset (its open files) alive.
        self._report_batch = self._plain_report = type(self)._report_plain
        if self._clock is not None:
            self._clock.on_timed = _arming(self)
        self._epoch = setup.first_epoch
        self._drops_superseded_tasks = self.kind != "" or setup.fetch.per_batch_seeding

    def thread_ends(self) -> None:
        """Its thread is about to end: its run over the replica stops (see ``_close_fetcher``)
        and a lent clock takes its last CPU reading now."""
        self._close_fetcher()
        if self._lends_clock:
            self._clock.read_sched_now()  # type: ignore[union-attr]

    def _close_fetcher(self) -> None:
        """Stop the run over the replica (a graph's boundaries) in this thread, which read it:
        an error one of its batches raised may keep it, and them, alive until the collector
        runs (``IterableFetcher.close``)."""
        if isinstance(self._fetcher, IterableFetcher):
            self._fetcher.close()

    def run(self) -> None:
        self._initialise()
        while not self._should_stop():
            command = self._next_command()
            if command is None:
                continue
            if command.command is Command.STOP:
                return
            if command.command is Command.START_EPOCH:
                self._last_batch_is(command.batch_number)
                self._start_epoch(command.epoch, command.shared_seed)
            elif command.command is Command.LAST_BATCH:
                self._last_batch_is(command.batch_number)
            else:
                self._serve(command)
                if self.confirms_views:
                    # The batch sent is let go of by now: which slabs user code here still views (a
                    # collate function keeping its last output), so that no other worker is granted them.
                    self._outbox.confirm_views()

    def _next_command(self) -> WorkerCommand | None:
        """The next command worth doing, after reading everything already waiting.

        When a persistent loader's epoch was abandoned, the tasks it left queued here come before
        the next START_EPOCH. Nobody will read their batches, but under torch's seeding they are
        built all the same, as torch's workers build them: what they draw from the worker's
        generators decides the random values of every later batch, and whether a task is in hand
        or still queued when START_EPOCH comes is a matter of timing. Where a batch's draws do
        not depend on earlier ones (per-batch seeding, economic mode's per-item seeds) they are
        dropped, and the next epoch starts as soon as the task in hand is done.
        """
        pending, receive = self._pending, self._inbox.receive
        restarts = False
        if not pending:
            first = receive(self._idle_wait_s())
            if first is None:
                return None
            pending.append(first)
            restarts = first.command is _START_EPOCH
        while (waiting := receive(0)) is not None:
            pending.append(waiting)
            restarts = restarts or waiting.command is _START_EPOCH
        if restarts and self._drops_superseded_tasks:
            self._pending = pending = _without_superseded_tasks(pending)
        return pending.popleft()

    def _idle_wait_s(self) -> float:
        """How long to wait for a command before ``_next_command`` returns None."""
        return POLL_INTERVAL_S

    def _initialise(self) -> None:
        self._init_failure = prepare_worker(self._setup, self._id, self._kind_in_errors(), self._share())
        if self._init_failure is None:
            self._make_fetcher(first=True)

    def _share(self) -> tuple[int, int]:
        """(this copy's index, how many copies): how a DataPipe graph is sharded across workers."""
        return self._id, self._setup.num_workers

    def _make_fetcher(self, shared_seed: int | None = None, first: bool = False) -> None:
        fetch = self._setup.fetch
        # A resumed session's replicas continue from their checkpoint in its first epoch only.
        resume_from = (fetch.resume_streams or {}).get(self._id) if first else None
        try:
            self._close_fetcher()  # the epoch before's run, before the replica is reseeded
            replica.reseed(fetch.dataset, shared_seed)
            # Before the iterator is made: a read-ahead thread it starts counts from the first.
            skips.bind(fetch.dataset, fetch.failures, skips.worker_row(self._id))
            # A classic worker writes each sample into its rows of the batch's slab as it comes.
            self._fetcher = make_fetcher(fetch, self._clock, self._batch_seeding(), self._id,
                                         resume_from, place_rows=self.kind == "",
                                         copy_states=self._setup.worker_method == "thread")
            if self._clock is not None and self._clock.count_ray_stage is None:
                self._clock.count_ray_stage = ray_stage_counter(fetch.dataset, self._clock.ray_stage)
        except Exception:
            self._init_failure = RemoteFailure.capture(
                self._id, "starting to iterate the dataset", worker_kind=self._kind_in_errors()
            )

    def _batch_seeding(self) -> BatchSeeding | None:
        if not self._setup.fetch.per_batch_seeding:
            return None
        info = get_worker_info()
        return BatchSeeding(self._setup.base_seed, self._epoch, info.rng if info is not None else None)

    def _last_batch_is(self, number: int) -> None:
        """An epoch starts (its batch numbers again from the first) and its last batch is
        numbered ``number`` (-1: unknown)."""
        clock = self._clock
        if clock is not None and clock.untimed_size is not None:
            clock.last_timed = math.inf if number < 0 else number
            clock.restart_numbers()

    def _start_epoch(self, epoch: int, shared_seed: int | None) -> None:
        self._epoch = epoch
        self._exhausted = False
        self._init_failure_reported = False
        if self._init_failure is None:
            self._make_fetcher(shared_seed)
        # It carries the totals, so the main process need not tell it from a task's report
        # (and an economic worker's kind, which its id does not tell).
        totals = self._clock.snapshot() if self._clock is not None and not self._lends_clock else None
        self._outbox.send(WorkerReport(Report.EPOCH_STARTED, self._id, epoch, self.kind or None, totals))

    def _serve(self, command: WorkerCommand) -> None:
        if self._exhausted:
            return  # the main process skips tasks sent to a worker that ran dry
        number = command.batch_number
        self._outbox.prepare(command.grant)  # collation writes where the batch will travel
        if self._init_failure is not None:
            self._serve_failed_setup(number)
            return
        started = time.perf_counter()
        try:
            batch = self._fetcher.fetch(command.indices, number)
        except DatasetExhausted:
            self._report_exhausted(number)
            return
        except Exception as exc:
            self._count_failed_task(command.indices)
            self._report_failure(number, "fetching a batch", command.indices, exc)
            return
        # Setting up shared memory is reported apart: it is a one-off cost of a cold start.
        setup_s = self._outbox.setup_s
        build_s = max(0.0, time.perf_counter() - started - setup_s)
        self._send_batch(number, batch, command.indices, build_s, setup_s)

    def _serve_failed_setup(self, number: int) -> None:
        """An iterable replica whose setup failed has no iterator to read: like a generator that
        raised, it is finished once its error has been reported. A map-style worker reports its
        setup error for every task, as it has nothing else to give."""
        if self._init_failure_reported and self._setup.fetch.kind is DatasetKind.ITERABLE:
            self._report_exhausted(number)
            return
        clock = self._clock
        if clock is not None:  # no fetcher counts it down: a task, timed (no samples derived)
            if clock.numbered:
                clock.start_timed_at(number)
            else:
                clock.left -= 1
                clock.start_timed()
        self._report_with_totals(Report.FAILED, number, self._init_failure)
        self._init_failure_reported = True

    def _report_exhausted(self, number: int) -> None:
        self._exhausted = True
        self._report_with_totals(Report.EXHAUSTED, number)

    def _report(self, report: Report, number: int, payload: Any = None, build_s: float = 0.0,
                setup_s: float = 0.0, finished_at: float = 0.0) -> None:
        """Send a report; with stats on, a timed task's (or a failure's) carries this worker's
        totals, this task counted (the others go without: stats/clock.py).
        ``build_s``, ``setup_s`` and ``finished_at`` feed the pool's in-flight budget (see
        engine/budget.py)."""
        self._report_batch = self._plain_report  # armed for one timed task at most
        clock = self._clock
        if clock is None or not clock.timing:  # an untimed batch (a failure is made timed)
            self._outbox.send(WorkerReport(report, self._id, number, payload, None, build_s, setup_s,
                                           finished_at))
            return
        started = now()
        if self._lends_clock:  # the main process reads the clock itself
            clock.done(payload if report is Report.BATCH else None)
            totals = None
        else:
            totals = clock.finished(payload if report is Report.BATCH else None)
        self._outbox.send(WorkerReport(report, self._id, number, payload, totals, build_s, setup_s,
                                       finished_at))
        # A dry replica's answer hands nothing over: counted, a worker beyond the shards read as
        # busy handing over, every epoch, the news that it had nothing.
        if report is not Report.EXHAUSTED:
            clock.sent(started)

    def _report_plain(self, report: Report, number: int, payload: Any = None, build_s: float = 0.0,
                      setup_s: float = 0.0, finished_at: float = 0.0) -> None:
        """A batch's report with nothing for the stats (an untimed task's, every one with stats
        off): what ``_send_batch`` calls unless the clock armed ``_report``."""
        self._outbox.send(WorkerReport(report, self._id, number, payload, None, build_s, setup_s, finished_at))

    def _send_batch(
        self, number: int, batch: Any, indices: Any, build_s: float, setup_s: float,
        finished_at: float = 0.0,
    ) -> None:
        timed = self._clock is not None and self._clock.timing  # its report counts its bytes
        try:
            self._report_batch(self, Report.BATCH, number, batch, build_s, setup_s, finished_at)
        except (BrokenPipeError, EOFError):
            raise  # the main process is gone; nothing to report to
        except Exception as exc:
            if timed:
                self._clock.unsent(batch)  # type: ignore[union-attr]
            self._count_failed_task(indices)
            self._report_failure(number, "sending the batch to the main process", indices, exc)

    def _count_failed_task(self, indices: Any) -> None:
        """The task for ``indices`` raised, its samples counted already: it moved no tensor."""
        if self._clock is not None:
            self._clock.failed(meant_samples(indices, self._setup.fetch.auto_collation))

    def _report_failure(self, number: int, stage: str, indices: Any, exc: Exception) -> None:
        failure = describe_failure(self._id, self._kind_in_errors(), stage, indices, exc)
        self._report_with_totals(Report.FAILED, number, failure)

    def _kind_in_errors(self) -> str:
        """What an error names this worker as: its economic kind, or "thread" for a classic
        thread worker (torch's sentence, kept for the code that matches it, says "worker process")."""
        return self.kind or ("thread" if self._setup.worker_method == "thread" else "")

    def _report_with_totals(self, report: Report, number: int, payload: Any = None) -> None:
        """A report that is no built batch (a failure, a dry replica): it always carries the
        totals, so that ``_report`` need check nothing but ``timing`` for a batch."""
        if self._clock is not None:
            self._clock.timing = True
        self._report(report, number, payload)


def _arming(loop: WorkerLoop) -> Callable[[], None]:
    """What ``loop``'s clock calls when it times the task in hand: the batch's report then goes
    by ``_report``, which adds the totals (the loop is held weakly: the clock is the loop's)."""
    owner = weakref.ref(loop)
    timed = type(loop)._report

    def arm() -> None:
        armed = owner()
        if armed is not None:
            armed._report_batch = timed

    return arm


def prepare_worker(
    setup: WorkerSetup, worker_id: int, kind: str, share: tuple[int, int]
) -> RemoteFailure | None:
    """Shard and seed this worker's copy of the dataset (``share``: its index among how many
    copies), then call the user's worker_init_fn, in torch's order. Returns what raised, if
    anything, to report for every task."""
    stage = "sharding and seeding its copy of the dataset"
    try:
        replica.prepare(setup.fetch.dataset, setup.replica, *share)
        stage = "running worker_init_fn"
        if setup.worker_init_fn is not None:
            setup.worker_init_fn(worker_id)
    except Exception:
        return RemoteFailure.capture(worker_id, stage, worker_kind=kind)
    return None


def describe_failure(worker_id: int, kind: str, stage: str, indices: Any, exc: Exception) -> RemoteFailure:
    """The exception being handled, as a RemoteFailure; /dev/shm running out gets its own type
    and advice (and the segment torch left behind is removed)."""
    failure = RemoteFailure.capture(worker_id, stage, _indices_for_message(indices), worker_kind=kind)
    if _is_shared_memory_exhaustion(exc):
        _remove_failed_segment(exc)
        failure = dataclasses.replace(
            failure, exc_type=SharedMemoryError, message=SHM_TOO_SMALL,
            traceback_text=f"{SHM_TOO_SMALL}\n{failure.traceback_text}",
            caught_name=type(exc).__name__,
        )
    return failure


_EPOCH_WORK = frozenset({Command.FETCH, Command.FETCH_ITEMS})  # what a new epoch makes pointless
_START_EPOCH = Command.START_EPOCH


def _without_superseded_tasks(commands: deque[WorkerCommand]) -> deque[WorkerCommand]:
    """Drop the fetch commands that a later START_EPOCH makes pointless."""
    starts = [i for i, c in enumerate(commands) if c.command is Command.START_EPOCH]
    if not starts:
        return commands
    last_start = starts[-1]
    return deque(
        c for i, c in enumerate(commands) if i >= last_start or c.command not in _EPOCH_WORK
    )


def _indices_for_message(indices: Any) -> Any:
    if indices is None or (isinstance(indices, list) and all(i is None for i in indices)):
        return None  # iterable datasets have no sample indices
    return indices


def _is_shared_memory_exhaustion(exc: BaseException) -> bool:
    text = str(exc)
    return "No space left on device" in text or ("unable to mmap" in text and "shm" in text)


def _remove_failed_segment(exc: BaseException) -> None:
    """Unlink the segment torch could not fill.

    When /dev/shm runs out, torch has already created the segment's file and raises without
    removing it; each failed batch would leave one behind, filling /dev/shm further. torch names
    the file in its message, with the pid of the process that made it: only ours is touched.
    """
    match = _TORCH_SEGMENT.search(str(exc))
    if match is None or int(match.group("pid")) != os.getpid():
        return
    try:
        os.unlink(os.path.join(SHM_DIR, match.group("name")))
    except OSError:
        pass  # already gone


def run_process_worker(setup: WorkerSetup, worker_id: int, inbox: Any, outbox: Any) -> None:
    """Entry point of a worker process (under spawn/forkserver, its arguments arrive pickled)."""
    seed = enter_worker_process(setup.base_seed, worker_id)
    info = WorkerInfo(worker_id, setup.num_workers, seed, setup.fetch.dataset)
    loop = WorkerLoop(setup, worker_id, inbox, outbox, should_stop=lambda: False)
    serve_in_process(info, loop)


def enter_worker_process(base_seed: int, seed_offset: int) -> int:
    """A worker process's first steps: leave Ctrl-C to the main process, keep the collector off
    the inherited objects, leave when the parent dies, never preempt the main process when woken
    (``schedule_as_batch_work``), reuse the heap samples free (``steady_heap``), one torch
    thread, seeded generators. Returns the seed, ``base_seed + seed_offset``."""
    leave_ctrl_c_to_the_main_process()
    keep_descriptors_from_programs()
    # The cyclic collector never again visits what was here at the start (under fork, the main
    # process's objects): a full collection writes to every object it visits, which would copy
    # each page of the inherited heap into this worker (about 40 MiB with torch imported).
    gc.freeze()
    exit_when_creator_dies()
    schedule_as_batch_work()
    steady_heap()  # the luck of the fork must not decide whether a batch's memory is reused
    torch.set_num_threads(1)
    count_the_whole_process()  # its stats: the CPU of its threads and children too
    return seed_process_worker(base_seed, seed_offset)


def serve_in_process(info: WorkerInfo, loop: Any) -> None:
    """Run ``loop`` as this process's worker, then leave at once.

    Its channels are not closed first: the kernel closes them, and unmaps the slabs, as the
    process exits, in one sweep that the main process waits for anyway at the end of an epoch.
    Closing them here added each slab's unmapping (with a TLB shootdown per slab while the
    worker's helper threads live) and a wait for any slab still being populated: 4 to 8 ms
    more at every ``StopIteration`` of a loader without persistent workers.
    """
    set_worker_info(info)
    set_process_worker_info(info)  # the threads its user's code starts too, as torch's
    publish_to_torch(info)
    try:
        loop.run()
    except (BrokenPipeError, EOFError, ConnectionResetError):
        pass  # the main process closed our channels: it no longer wants anything from us
    exit_now()  # anything else raised ends the process with its traceback, as a crash


def run_thread_worker(
    setup: WorkerSetup, worker_id: int, inbox: Any, outbox: Any, stop: threading.Event,
    share_clock: Callable[[Any], None] | None = None,
) -> None:
    """Entry point of a worker thread. Global RNGs belong to the main thread: this worker gets
    its own generators in ``get_worker_info().rng``, seeded as a process worker's would be.
    ``share_clock``: where to lend its stats clock (see WorkerLoop)."""
    own_copy = replica.thread_replica(setup.fetch.dataset, setup.fetch.kind)
    setup = dataclasses.replace(setup, fetch=dataclasses.replace(setup.fetch, dataset=own_copy))
    rng = make_thread_rng(setup.base_seed, worker_id)
    seed = setup.base_seed + worker_id
    info = WorkerInfo(worker_id, setup.num_workers, seed, setup.fetch.dataset, rng, "thread")
    serve_in_thread(info, WorkerLoop(setup, worker_id, inbox, outbox, should_stop=stop.is_set,
                                     share_clock=share_clock), stop.is_set)


def serve_in_thread(info: WorkerInfo, loop: Any, stopping: Callable[[], bool]) -> None:
    """Run ``loop`` as this thread's worker; ``get_worker_info()`` answers ``info`` meanwhile,
    and pipeload's own waits inside the dataset give up once ``stopping()`` (the loop's stop)."""
    set_worker_info(info)
    set_worker_stopping(stopping)
    try:
        loop.run()
    finally:
        set_worker_stopping(None)
        set_worker_info(None)
        loop.thread_ends()
