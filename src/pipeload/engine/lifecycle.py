"""Starting, watching and stopping workers. Stopping escalates in one place: ask, join,
terminate, kill. Loader workers and the upstream processes of pipe queue boundaries both start,
watch their parent and stop through here."""

from __future__ import annotations

import _thread
import contextlib
import ctypes
import io
import multiprocessing
import multiprocessing.connection
import multiprocessing.util
import os
import pickle
import reprlib
import select
import signal
import sys
import threading
import time
import traceback
import warnings
import weakref
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from multiprocessing import context as mp_context
from multiprocessing import popen_fork
from multiprocessing.context import set_spawning_popen
from multiprocessing.reduction import ForkingPickler
from typing import Any, Protocol

import torch

from pipeload._interrupts import ctrl_c_held, on_the_main_thread
from pipeload._user_frame import first_frame_outside_pipeload
from pipeload.engine import huge_heap
from pipeload.engine.spawn_launch import SpawnProcess
from pipeload.errors import WorkerDiedError, worker_died_message

JOIN_GRACE_S = 0.5
# A worker asked to stop with nothing left to do may still finish what the user's code started
# (non-daemon threads, multiprocessing's finalizers: see exit_now): torch's loader waits 5 s
# (its MP_STATUS_CHECK_INTERVAL) before it terminates one. Reaped beside the loop, so no loop waits.
FINISHING_GRACE_S = 5.0
TERMINATE_GRACE_S = 0.3
KILL_GRACE_S = 1.0
POLL_SLICE_S = 0.1  # a blocking status read looks again this often (see _one_poll_at_a_time)
# The longest a background reap takes (its escalation), and a margin for the thread to run.
REAPED_WITHIN_S = FINISHING_GRACE_S + TERMINATE_GRACE_S + KILL_GRACE_S + 0.5
PARENT_CHECK_INTERVAL_S = 0.2
REAP_AT_START_S = 5.0  # how long a failed start waits to learn a fork server child's exit
PIDFD_SLICE_MS = 60_000  # the pidfd watcher's wait slice: it is woken by the parent's exit


class WorkerHandle(Protocol):
    """What the pool (and users' tools, through ``iterator._workers``) see of a worker."""

    pid: int | None
    exitcode: int | None

    def is_alive(self) -> bool: ...
    def join(self, timeout: float | None = None) -> None: ...
    def terminate(self) -> None: ...


class ThreadWorkerHandle:
    """A worker thread dressed as a process handle. ``pid`` is this process's pid."""

    def __init__(self, thread: threading.Thread, stop: threading.Event) -> None:
        self._thread = thread
        self._stop = stop
        self.pid = os.getpid()
        self.sentinel = None

    @property
    def thread_id(self) -> int | None:
        """The kernel's id of the thread (``/proc/self/task/ID``), to read its CPU time."""
        return self._thread.native_id

    @property
    def exitcode(self) -> int | None:
        return None if self._thread.is_alive() else 0

    def is_alive(self) -> bool:
        return self._thread.is_alive()

    def join(self, timeout: float | None = None) -> None:
        self._thread.join(timeout)

    def terminate(self) -> None:
        self._stop.set()

    kill = terminate


# Held while a process is started and our copies of its channel ends are dropped: two threads
# starting loaders at once (each iterating one loader) forked in each other's windows, and each
# worker inherited the other's ends.
FORKING = threading.RLock()


def _forking_lock_of_its_own() -> None:
    """A forked child gets the lock as its parent held it, owned by the thread that forked:
    the child's other threads (a thread boundary's, a helper's) waited for it for ever when
    they started a process (stop 54's review)."""
    global FORKING
    FORKING = threading.RLock()


os.register_at_fork(after_in_child=_forking_lock_of_its_own)


def start_process(ctx: Any, target: Callable[..., None], args: tuple[Any, ...], name: str,
                  leaves_with_parent: bool = False) -> Any:
    """Start one daemon process; a clear error when the caller is itself a daemon process.

    Daemonic processes (DataLoader process workers among them) may not have children, and the
    assertion multiprocessing raises says nothing about what to do instead. The rule is there
    because a daemon is terminated without waiting for its children, which would be left
    running; a child that leaves by itself when its creator dies (``exit_when_creator_dies``) is
    not left behind, and with ``leaves_with_parent`` it may be started from a daemon too.
    """
    current = multiprocessing.current_process()
    if current.daemon and not leaves_with_parent:
        raise RuntimeError(
            f"cannot start {name}: this process is a daemon process (a DataLoader process worker, "
            "or another daemon), and daemon processes may not have children. Use threads here "
            "(worker_type='thread'), or run this part of the work in the main process."
        )
    _import_what_workers_seed()
    if ctx.get_start_method() == "fork":
        # A forked worker maps this process's heap as it is, free pages included: in each
        # worker's RSS, and shared with this process until one of them writes there. After a
        # warm-up or another loader's epoch, glibc kept ~30 MiB free on the development box.
        release_free_heap()
        # Pages the kernel gathered while the child shares them would be copied for us alone.
        huge_heap.GATHERER.before_fork()
    # multiprocessing's 'spawn' Process, made by one that a dead child cannot leave blocked
    # (engine/spawn_launch.py); any other context's Process as it is.
    make = SpawnProcess if getattr(ctx, "Process", None) is mp_context.SpawnProcess else ctx.Process
    process = make(target=target, args=args, name=name, daemon=True)
    # The child reads it on its Process object (forked with it, or sent it pickled by spawn and
    # forkserver): see exit_when_creator_dies.
    process.pipeload_started_by_main_thread = on_the_main_thread()
    with FORKING, _children_allowed(current):
        try:
            process.start()
        except BaseException as error:
            ended = _reap_half_started(error)
            if ended is not None and isinstance(error, _BROKEN_WRITE):
                raise GoneBeforeStarting(name, *ended) from error
            raise
    _OURS.add(process)
    return process


def _forget_inherited_workers() -> None:
    """In a child made by a plain ``os.fork()`` (a checkpoint writer, say): our workers are not
    its children. multiprocessing's exit hook, which the child runs when it exits normally,
    would terminate them as its own daemonic children: the parent's persistent workers died of a
    SIGTERM the parent never sent (torch's too)."""
    children = getattr(multiprocessing.process, "_children", None)
    if isinstance(children, set):
        children.difference_update(list(_OURS))


_OURS: weakref.WeakSet[Any] = weakref.WeakSet()  # the processes start_process started
os.register_at_fork(after_in_child=_forget_inherited_workers)


class GoneBeforeStarting(WorkerDiedError):
    """A 'forkserver' child (or a 'spawn' one, should its start-up data break a write) ended
    before it had read what it was sent: usually it failed while importing the main script.
    Raised by :func:`start_process`, in torch's words for a dead worker; a worker group says
    which of its workers it was."""

    def __init__(self, name: str, pid: int, exitcode: int | None) -> None:
        super().__init__(worker_died_message([(name, pid, exitcode)], "it ended before it read its "
                                             "start-up data"))
        self.name, self.pid, self.exitcode = name, pid, exitcode


def _reap_half_started(error: BaseException) -> tuple[int, int | None] | None:
    """End a child that a failed start left behind (a Ctrl-C, or a pickling error, while a
    spawn or forkserver start wrote the child its arguments, or a child that died first), and
    learn its exit code. Returns its pid and exit code (None: no child was found).

    The child exists by then, but the start raised before ``Process`` recorded it: nobody else
    would reap it, and it would stay a zombie for as long as this process lives. Only the
    ``Popen`` in the failed start's frames (``self`` of ``multiprocessing.popen_*``) knows its pid.
    """
    traceback = error.__traceback__
    while traceback is not None:
        if not traceback.tb_frame.f_globals.get("__name__", "").startswith(_POPEN_MODULES):
            # Read only where a Popen can be: a frame's locals, once read, are kept with it, and
            # a caller's that name the error would hold it (and the loader) in a cycle.
            traceback = traceback.tb_next
            continue
        popen = traceback.tb_frame.f_locals.get("self")
        pid = getattr(popen, "pid", None)
        module = type(popen).__module__
        if isinstance(popen, popen_fork.Popen) and isinstance(pid, int) and pid > 0:
            _quietly(os.kill, pid, signal.SIGKILL)  # a child that ended already keeps its status
            return pid, _exit_code_once_reaped(pid)
        if module == "multiprocessing.popen_forkserver" and isinstance(getattr(popen, "sentinel", None), int):
            return _end_forkserver_child(popen.sentinel, ended=isinstance(error, _BROKEN_WRITE))
        traceback = traceback.tb_next
    return None


_BROKEN_WRITE = (BrokenPipeError, ConnectionResetError)
_POPEN_MODULES = ("multiprocessing.popen_", "pipeload.engine.spawn_launch")


def _end_forkserver_child(sentinel: int, ended: bool) -> tuple[int, int | None] | None:
    """The fork server's child of a failed start: the server says its pid on ``sentinel`` as
    it forks it, then reaps it and says its exit status. One whose write broke has ended
    (``ended``); any other (a Ctrl-C in the middle of the write) waits for the rest of its
    start-up data, and is killed. Returns its pid and exit code (None where the server does
    not say them within ``REAP_AT_START_S``)."""
    from multiprocessing.forkserver import read_signed
    pid = _read_within(sentinel, read_signed)
    if pid is None:
        return None
    if not ended:
        _quietly(os.kill, pid, signal.SIGKILL)  # not reaped yet: the server has not said so
    return pid, _read_within(sentinel, read_signed)


def _read_within(fd: int, read: Callable[[int], int]) -> int | None:
    """``read(fd)`` once ``fd`` is readable, or None after ``REAP_AT_START_S`` (``poll``, not
    ``select``: descriptors may be numbered past 1024)."""
    poller = select.poll()
    poller.register(fd, select.POLLIN)
    if not poller.poll(REAP_AT_START_S * 1000):
        return None
    try:
        return read(fd)
    except (OSError, EOFError):
        return None


def _exit_code_once_reaped(pid: int) -> int | None:
    """Reap child ``pid``; its exit code as ``Process.exitcode`` gives it (None if not ours)."""
    try:
        _, status = os.waitpid(pid, 0)
    except OSError:
        return None
    return os.waitstatus_to_exitcode(status)


@contextlib.contextmanager
def _children_allowed(current: Any) -> Iterator[None]:
    """Lift multiprocessing's no-children rule of a daemon process for one start (the callers'
    children leave with their parent: see :func:`start_process`). The flag lives in the
    process's ``_config``, where ``start()`` looks for it; it is set back at once."""
    if not current.daemon:
        yield
        return
    current._config["daemon"] = False
    try:
        yield
    finally:
        current._config["daemon"] = True


def _import_what_workers_seed() -> None:
    """Import ``numpy.random`` here, before a fork, if it is not yet: every process worker seeds
    numpy's global generator, and numpy 2 imports that module on first use only, which in a
    forked worker costs about 4.5 MiB of its own memory each, where here it costs one copy that
    all forked workers share.

    Ctrl-C is held over the import: numpy's compiled modules drop a KeyboardInterrupt raised
    while they are set up, without a word, so a Ctrl-C pressed as the first workers started was
    lost (under spawn and forkserver, which no fork's hold covers) and the loop trained on.

    Imported again when it is there already: another thread may be importing it now (two loaders
    started at once), and an import waits for that one to end, where a look in ``sys.modules``
    did not. A worker forked meanwhile found the module half made, and waited for ever on its
    lock, held by a thread it does not have (stop 54's lifecycle skeptic: one of two threads
    iterating a loader hung, 4 runs in 4)."""
    if "numpy.random" not in sys.modules:
        with ctrl_c_held():
            import numpy.random  # noqa: F401
    import numpy.random  # noqa: F401,F811  (returns at once unless another thread is importing it)


_libc: Any = None
WORKER_HEAP_ENV = "PIPELOAD_WORKER_HEAP"  # "dynamic": keep glibc's moving thresholds
_M_TRIM_THRESHOLD = -1  # glibc's mallopt parameters
_M_MMAP_THRESHOLD = -3
WORKER_MMAP_THRESHOLD_BYTES = 32 << 20  # glibc's own ceiling for the threshold it moves
WORKER_TRIM_THRESHOLD_BYTES = 64 << 20


def _glibc() -> Any:
    global _libc
    if _libc is None:
        try:
            # The symbols already loaded (libc's among them): ``ctypes.util.find_library`` would
            # run ``ldconfig`` in a subprocess and leave ~0.8 MiB of imports in every worker.
            _libc = ctypes.CDLL(None)
            _libc.malloc_trim.argtypes = [ctypes.c_size_t]
            _libc.mallopt.argtypes = [ctypes.c_int, ctypes.c_int]
        except (OSError, AttributeError):
            _libc = False
    return _libc


def release_free_heap() -> None:
    """Return the free pages of this process's heap to the system (glibc's ``malloc_trim``;
    nothing elsewhere). Freed memory stays in a glibc heap otherwise: it raises its trimming
    threshold after large frees, to save page faults when they are allocated again."""
    if libc := _glibc():
        libc.malloc_trim(0)


def steady_heap() -> bool:
    """In a worker process: fix glibc's allocation thresholds, so that memory a batch's samples
    freed is reused by the next batch's instead of given back and faulted in again; returns
    whether they were set.

    glibc moves its thresholds as a process runs: an allocation above the mmap threshold (128 KiB
    at first) gets pages of its own, and freeing one raises the threshold to its size and the
    trim threshold to twice that. Whether a batch's freed samples (64 images of 600 KB, say) then
    stay in the heap or are trimmed away at once, to be faulted in (zeroed) again for the next
    batch, depends on what else lies at the top of the heap, which a forked worker inherits from
    the main process as it was at the fork: measured on the development box, the two workers of a
    non-persistent epoch faulted in either ~40,000 pages or ~550,000, by the luck of the fork,
    nearly tripling the CPU time of the epoch (~26,000 with the thresholds fixed). Fixed thresholds (allocations up to 32 MiB from the heap, up
    to 64 MiB of free heap kept between batches) make every worker reuse its memory. Set
    ``PIPELOAD_WORKER_HEAP=dynamic``, or glibc's ``MALLOC_MMAP_THRESHOLD_`` /
    ``MALLOC_TRIM_THRESHOLD_``, to keep glibc's own behaviour.
    """
    if os.environ.get(WORKER_HEAP_ENV, "").lower() == "dynamic":
        return False
    if "MALLOC_MMAP_THRESHOLD_" in os.environ or "MALLOC_TRIM_THRESHOLD_" in os.environ:
        return False  # the user chose
    libc = _glibc()
    if not libc:
        return False
    return bool(libc.mallopt(_M_MMAP_THRESHOLD, WORKER_MMAP_THRESHOLD_BYTES)
                and libc.mallopt(_M_TRIM_THRESHOLD, WORKER_TRIM_THRESHOLD_BYTES))


@dataclass(frozen=True)
class WorkerLaunch:
    """How to start one worker: what it runs and with what.

    Attributes:
        target: the worker's entry point (a module-level function, so spawn can find it).
        args: its arguments.
        name: the process or thread name.
        parent_copies: channel ends this worker owns; the parent closes its copies right after
            the start (processes only), before the next fork can inherit them.
    """

    target: Callable[..., None]
    args: tuple[Any, ...]
    name: str
    parent_copies: tuple[Any, ...] = ()


def start_processes(
    ctx: Any, launches: Sequence[WorkerLaunch], forget_unstarted: Callable[[], None]
) -> list[Any]:
    """Start one process per launch. Already started ones are stopped if a later start fails.

    ``forget_unstarted`` closes the parent's copies of every worker end at the end, including
    those of workers a failed start never reached.
    """
    workers: list[Any] = []
    try:
        for launch in launches:
            # One thread starts a worker at a time, and drops our copies of its ends before
            # another thread's fork can inherit them (see FORKING).
            with FORKING, held_over_a_fork(ctx):
                process = start_process(ctx, launch.target, launch.args, launch.name)
                workers.append(process)  # before a held Ctrl-C is raised: the except stops it
                # Drop our copies of this worker's ends now, not after the last start: a worker
                # forked later would inherit them, and a task pipe that another process also
                # reads never breaks when its worker dies, so a send to the dead worker could
                # block for ever.
                for end in launch.parent_copies:
                    end.close()
    except BaseException:
        # They have been given nothing to do: a Ctrl-C in the middle of the starts (or a start
        # that failed) need not wait JOIN_GRACE_S for workers that will not leave by themselves.
        stop_workers(workers, patient=False)
        raise
    finally:
        forget_unstarted()
    return workers


def held_over_a_fork(ctx: Any) -> contextlib.AbstractContextManager[None]:
    """Ctrl-C held (:func:`ctrl_c_held`) while a fork start method starts a process, until the
    caller has recorded it; nothing is held for spawn and forkserver.

    The kernel holds a signal that comes during ``fork()`` (milliseconds for a process with
    torch loaded) until it returns, and Python raises it at the first Python code after it: an
    at-fork hook, which prints it as "Exception ignored" and drops it (the Ctrl-C is lost), or
    multiprocessing's start, before it has recorded the child (the worker is lost: it holds its
    own copy of its task pipe's writing end, so it waits for tasks until this process exits).
    A fork start is quick and bounded. A spawn or forkserver start also writes the process's
    pickled arguments to the child, which may wait until the child has imported the main
    module: holding Ctrl-C over that could hold it for as long as that import takes.
    """
    return ctrl_c_held() if ctx.get_start_method() == "fork" else contextlib.nullcontext()


def start_threads(launches: Sequence[WorkerLaunch], stop: threading.Event) -> list[ThreadWorkerHandle]:
    """Start one daemon thread per launch; they all stop when ``stop`` is set."""
    handles = []
    for launch in launches:
        thread = threading.Thread(target=launch.target, args=launch.args, name=launch.name, daemon=True)
        thread.start()
        handles.append(ThreadWorkerHandle(thread, stop))
    return handles


def stop_workers(
    workers: Sequence[Any], ask: Callable[[int], None] | None = None, force: bool = True,
    patient: bool = True,
) -> None:
    """Stop every worker: ask (if given), join with a deadline, then terminate, then kill.

    ``force=False`` stops after the join: threads cannot be terminated, so waiting on through
    the escalation steps would only hold the caller up (a stuck daemon thread is left behind).
    ``patient=False`` terminates at once: workers of a start that failed have nothing to finish.
    Ctrl-C waits until they are stopped (see :func:`ctrl_c_held`).
    """
    with ctrl_c_held():
        _stop_workers(workers, ask, force, patient)


def reap_in_background(workers: Sequence[Any], then: Callable[[], None]) -> None:
    """Join process workers that were asked to stop and have nothing left to do, escalating as
    ``stop_workers`` does, in a thread of their own; then run ``then``.

    A worker's exit tears down its address space (the pages it inherited at the fork, its heap,
    its slab mappings): 6 to 12 ms on the 2-core box for a worker of 38 MiB batches, which the
    training loop waited out at every ``StopIteration`` of a loader without persistent workers.
    The teardown takes the same CPU either way; only the wait moves out of the loop.

    The thread comes from ``_thread``, not ``threading``: ``Thread.start()`` waits until the new
    thread has run, which on a machine whose cores are busy (the exiting workers) took up to
    7 ms, most of what moving the wait out of the loop saves. Such a thread does not hold the
    interpreter's exit; nothing is left unreaped by that: multiprocessing's exit hook joins its
    children, and the workers, asked to stop, need nothing more from this process.
    """
    def reap() -> None:
        try:
            _stop_workers(workers, None, force=True, grace=FINISHING_GRACE_S)  # not asked again: they were
            then()
        finally:
            _REAPING.done()

    for worker in workers:
        _one_poll_at_a_time(worker)
    _REAPING.started()
    try:
        _thread.start_new_thread(reap, ())
    except BaseException:
        _REAPING.done()
        raise


def _one_poll_at_a_time(worker: Any) -> None:
    """Make the process handle's status reads take turns: a training loop that joins the
    handles itself (torch's ``iterator._workers``) while the reaping thread does would lose the
    race for the exit status (its ``waitpid`` answers "no such child"), and ``is_alive()`` then
    said True of a process already gone, until the other thread stored what it read."""
    popen = getattr(worker, "_popen", None)
    poll = getattr(popen, "poll", None)
    sentinel = getattr(popen, "sentinel", None)
    if poll is None or sentinel is None or getattr(poll, "takes_turns", False):
        return
    turn = threading.Lock()

    def poll_in_turn(flag: int = os.WNOHANG) -> int | None:
        # A blocking read (``join()`` without a timeout) waits for the exit outside the turn:
        # held across that wait, the turn kept the reaping thread from ever terminating a
        # worker that did not leave when asked.
        while True:
            with turn:
                status = poll(os.WNOHANG)
            if status is not None or flag == os.WNOHANG:
                return status
            multiprocessing.connection.wait([sentinel], POLL_SLICE_S)

    poll_in_turn.takes_turns = True  # type: ignore[attr-defined]
    popen.poll = poll_in_turn


class _Reaping:
    """How many ``reap_in_background`` threads are still at work (see ``wait_for_reaped``)."""

    def __init__(self) -> None:
        self._changed = threading.Condition(threading.Lock())
        self._running = 0
        self._pid = os.getpid()

    def started(self) -> None:
        with self._changed:
            self._running += 1

    def done(self) -> None:
        with self._changed:
            self._running -= 1
            self._changed.notify_all()

    def wait(self, timeout: float | None) -> bool:
        if os.getpid() != self._pid:
            # A forked child, before ``_reaping_none_in_a_child`` gave it its own (Python's
            # after-fork hooks run first, and a collection inside them runs finalizers that wait
            # here): the parent's reaping threads did not come along, and its lock may be held.
            return True
        with self._changed:
            return self._changed.wait_for(lambda: self._running == 0, timeout)


_REAPING = _Reaping()


def _reaping_none_in_a_child() -> None:
    """A forked child reaps none of its parent's workers: the count it inherited (and the lock,
    perhaps held) belong to reaping threads that did not come along. Kept, a loader dropped in
    a reference cycle and collected in a new worker waited there ``REAPED_WITHIN_S`` (~6.8 s)
    for them before letting go of its slabs: the worker said nothing for 7 s at its start."""
    global _REAPING
    _REAPING = _Reaping()


os.register_at_fork(after_in_child=_reaping_none_in_a_child)


def wait_for_reaped(timeout: float | None = None) -> bool:
    """Wait until every worker handed to ``reap_in_background`` is reaped (and what was to run
    after it has run); returns whether that happened within ``timeout``."""
    return _REAPING.wait(timeout)


def _stop_workers(workers: Sequence[Any], ask: Callable[[int], None] | None, force: bool,
                  patient: bool = True, grace: float = JOIN_GRACE_S) -> None:
    if ask is not None:
        for worker_id, worker in enumerate(workers):
            if worker.is_alive():
                _quietly(ask, worker_id)
    if patient or not force:
        _join_all(workers, grace)
    if not force:
        return
    for step, grace in (("terminate", TERMINATE_GRACE_S), ("kill", KILL_GRACE_S)):
        alive = [w for w in workers if w.is_alive()]
        if not alive:
            return
        for worker in alive:
            _quietly(getattr(worker, step))
        _join_all(alive, grace)


WORKER_SCHEDULING_ENV = "PIPELOAD_WORKER_SCHEDULING"  # "normal": keep the default policy


def schedule_as_batch_work() -> bool:
    """In a worker process: ask the kernel to treat this process as batch work (``SCHED_BATCH``,
    same nice value, so the same share of the CPU); returns whether the policy was set.

    Under the default policy a worker woken by a task preempts the process that woke it: on a
    machine with no idle core, the main process's task ``write`` then returns only once the
    worker has built its batch and gone back to sleep, and the two run one after the other
    instead of side by side (one core's worth of work on two, with the tiny-batch workload). A
    batch-policy process is never woken into the CPU ahead of the running one; it runs when a
    core is free or at the next tick, which a worker that builds batches ahead never notices.
    Set ``PIPELOAD_WORKER_SCHEDULING=normal`` to keep the default policy; where the policy
    cannot be set (not Linux, a seccomp filter), nothing changes.
    """
    if os.environ.get(WORKER_SCHEDULING_ENV, "").lower() == "normal":
        return False
    set_policy = getattr(os, "sched_setscheduler", None)
    batch = getattr(os, "SCHED_BATCH", None)
    if set_policy is None or batch is None:
        return False
    try:
        set_policy(0, batch, os.sched_param(0))
    except OSError:
        return False
    return True


def leave_ctrl_c_to_the_main_process() -> None:
    """In a worker process: Ctrl-C (SIGINT, sent to the whole foreground process group) is the
    main process's to handle; it stops the workers. Caught and dropped here, not ignored: an
    ignored signal stays ignored across ``exec``, and a program the dataset runs (``ffmpeg``
    through ``subprocess``) would then outlive a Ctrl-C too, where under torch's workers it
    stops. A caught one is the default again in any program started from here."""
    signal.signal(signal.SIGINT, _drop_ctrl_c)


def _drop_ctrl_c(signum: int, frame: Any) -> None:
    pass  # the main process stops this worker


def keep_descriptors_from_programs() -> None:
    """In a child process: mark every descriptor past stderr close-on-exec.

    A spawn or forkserver child receives its channels (pipes, sockets, shared memory) as
    inheritable descriptors, which is how they cross ``exec``; left so, a program the user's
    code runs from the worker (``os.system``, ``subprocess`` with ``close_fds=False``) would hold
    them open for as long as it runs: a channel the main process waits on to close, a segment
    it has freed. Python makes its own descriptors non-inheritable (PEP 446); this makes the
    inherited ones so too. ``subprocess``'s ``pass_fds`` still passes what it is given.
    """
    try:
        names = os.listdir("/proc/self/fd")
    except OSError:
        return  # no /proc: nothing to mark by name
    for name in names:
        fd = int(name)
        if fd > 2:
            try:
                os.set_inheritable(fd, False)
            except OSError:
                pass  # the listing's own descriptor, closed by now


def exit_when_creator_dies() -> None:
    """In a child process: leave at once when the process that started it dies, even while user
    code is busy.

    That process (``multiprocessing.parent_process()``: the main process, or the worker that
    started a queue boundary's process) is the parent under fork and spawn. Under forkserver the
    parent is the fork server, which outlives the main process as long as any of its children
    lives (each holds the server's "alive" pipe): a worker watching its parent would then never
    leave, stuck in user code after its main process was killed. So the creator itself is
    watched.

    The watching thread sleeps in ``poll`` on a pidfd of the creator, which wakes it only when
    the creator exits. A thread that woke every few hundred milliseconds instead would take the
    GIL from the worker's own (often GIL-bound) thread each time, and on a crowded machine each
    such hand-over waits for both threads to get a CPU again: a CPU-bound worker lost a tenth of
    its throughput or more that way. Where pidfds are missing, it falls back to checking every
    ``PARENT_CHECK_INTERVAL_S``.
    """
    creator = _creator_pid()
    is_parent = os.getppid() == creator
    if is_parent and _started_by_main_thread():
        _killed_with_parent(creator)
    pidfd = _creator_pidfd(creator, is_parent)

    def watch() -> None:
        if pidfd is not None:
            poller = select.poll()
            poller.register(pidfd, select.POLLIN)
            # In long slices (a wake-up a minute costs nothing), checking the creator each time.
            # Readable once it has exited, even while it waits, a zombie, to be reaped.
            while not poller.poll(PIDFD_SLICE_MS) and _still_there(creator, is_parent):
                pass
            os._exit(0)
        while _still_there(creator, is_parent):
            time.sleep(PARENT_CHECK_INTERVAL_S)
        os._exit(0)

    threading.Thread(target=watch, name="pipeload-parent-watch", daemon=True).start()


_PR_SET_PDEATHSIG = 1


def _started_by_main_thread() -> bool:
    """Whether this child was started by its creator's main thread, as its ``Process`` object
    says (``start_process`` marks it; a spawn's fork and exec run on the thread that started it)."""
    started = getattr(multiprocessing.current_process(), "pipeload_started_by_main_thread", None)
    return started is True


def _killed_with_parent(parent: int) -> None:
    """Have the kernel kill this forked child when its parent dies, even while it holds the
    GIL (a regex backtracking, a C extension's loop), where the watching thread cannot run.

    The kernel's signal follows the thread that forked, not the process: only a child forked
    (or spawned: a fork, then an exec) by its parent's main thread, whose end is the process's,
    asks for it. Any other keeps to the watching thread alone, and so does a fork server's child,
    whose parent is the server.
    """
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        if libc.prctl(_PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0) != 0:
            return
    except (OSError, AttributeError):
        return
    if os.getppid() != parent:
        os._exit(0)  # it died before the request: the kernel will not send it now


def _creator_pid() -> int:
    """The pid of the process that started this one (its ``multiprocessing.Process``'s owner)."""
    creator = multiprocessing.parent_process()
    return creator.pid if creator is not None and creator.pid else os.getppid()


def _still_there(creator: int, is_parent: bool) -> bool:
    """Whether the creator lives: as our parent, until we are given another one; otherwise (a
    fork server's child) while its pid does, which only the pidfd-less fallback relies on."""
    if is_parent:
        return os.getppid() == creator
    try:
        with open(f"/proc/{creator}/stat", "rb") as stat_file:
            state = stat_file.read().rsplit(b")", 1)[1].split()[0]  # after "(name)", which may hold spaces
    except (OSError, IndexError):
        return False
    return state not in (b"Z", b"X")  # exited, not yet reaped by its own parent


def _creator_pidfd(creator: int, is_parent: bool) -> int | None:
    """A pidfd of the creator, or None where the system has none (the watcher then polls)."""
    try:
        pidfd = os.pidfd_open(creator)
    except ProcessLookupError:
        os._exit(0)  # it died before we could watch it
    except (AttributeError, OSError):
        return None
    if is_parent and os.getppid() != creator:
        os.close(pidfd)  # it died before we opened it: the pid may be someone else's now
        os._exit(0)
    return pidfd


def exit_now() -> None:
    """Leave a child process as multiprocessing leaves one, without the interpreter's teardown.

    What the user's code started in it finishes first, as in torch's workers: non-daemon threads
    (a cache writer, a ``ThreadPoolExecutor``'s work) are joined and multiprocessing's finalizers
    run (an ``mp.Queue``'s feeder flushes, daemonic children go, others are joined). Then
    ``os._exit``: with torch imported, the interpreter's teardown takes most of a second in a
    spawn or forkserver child, longer than the parent waits before it terminates a child that
    was asked to stop, and nothing in it matters to the parent. multiprocessing ends its fork
    children the same way, so all start methods behave alike.
    """
    _finish_what_user_code_started()
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except (AttributeError, OSError, ValueError):
            pass  # closed or replaced streams: nothing to flush
    os._exit(0)


def _finish_what_user_code_started() -> None:
    """What ``multiprocessing.Process`` does before its ``os._exit``: join non-daemon threads,
    then run the exit finalizers. Only from the process's main thread (the one that ends it)."""
    if not on_the_main_thread():
        return
    for finish in (threading._shutdown, multiprocessing.util._exit_function):  # type: ignore[attr-defined]
        try:
            finish()
        except Exception:  # noqa: BLE001 (a user's thread or finalizer that failed: exit anyway)
            traceback.print_exc()


def release_finished(workers: Sequence[Any]) -> None:
    """Close the pipes that the handles of finished worker processes still hold open.

    A stopped engine can outlive its epoch (an exception's traceback keeps it), and its handles
    must not pin file descriptors meanwhile. Unlike ``Process.close()``, this keeps ``pid``,
    ``exitcode``, ``is_alive()`` and ``join()`` answering, as users of ``_workers`` expect.
    """
    for worker in workers:
        popen = getattr(worker, "_popen", None)  # thread handles have none
        if popen is not None and popen.returncode is not None:
            popen.close()


def _join_all(workers: Sequence[Any], grace_s: float) -> None:
    deadline = time.monotonic() + grace_s
    for worker in workers:
        worker.join(max(0.0, deadline - time.monotonic()))


def _quietly(action: Callable[..., Any], *args: Any) -> None:
    try:
        action(*args)
    except (OSError, ValueError):
        pass  # the worker or its channel is already gone


class _Discard(io.RawIOBase):
    def writable(self) -> bool:
        return True

    def write(self, data: Any) -> int:
        return len(memoryview(data))


class _PicklabilityProbe(ForkingPickler):
    """Pickles as multiprocessing does when it starts a worker, except tensors, which torch
    moves through shared memory anyway (and probing them would copy them there)."""

    def persistent_id(self, obj: Any) -> Any:
        if isinstance(obj, (torch.Tensor, torch.UntypedStorage, torch.TypedStorage)):
            return id(obj)
        return None


class _StartingProcess:
    """Stands in for the Popen of a process being started while the probe runs.

    Locks, shared values and pipes refuse to be pickled except while a process is being spawned
    (they check for one), and then hand over file descriptors through it. Without this stand-in
    the probe would refuse datasets that spawn sends without trouble, e.g. one holding a
    ``multiprocessing.Value`` counter.
    """

    @staticmethod
    def duplicate_for_child(fd: int) -> int:
        return fd

    @staticmethod
    def DupFd(fd: int) -> int:  # noqa: N802  (the name multiprocessing calls)
        return fd


def check_picklable(
    named_objects: dict[str, Any], start_method: str, sender: str = "DataLoader"
) -> None:
    """Fail before any worker starts if spawn/forkserver could not send these objects to it.

    As torch does when a worker fails to start this way, a DataLoader warns with torch's words,
    then raises the pickling error (its own message first, then which argument could not be
    sent). Other senders (a pipe's queue boundary) only raise, naming themselves.
    """
    for name, obj in named_objects.items():
        set_spawning_popen(_StartingProcess())
        try:
            _PicklabilityProbe(_Discard(), pickle.HIGHEST_PROTOCOL).dump(obj)
        except Exception as exc:
            if sender == "DataLoader" and isinstance(exc, _ERRORS_TORCH_WARNS_ABOUT):
                warnings.warn(PICKLE_WARNING, stacklevel=first_frame_outside_pipeload())
            # One traceback, as torch's: the message carries the pickling error's own, and the
            # probe's frames (and the failed start's, where this runs) would say nothing more.
            raise _unpicklable(exc, name, obj, start_method, sender) from None
        finally:
            set_spawning_popen(None)


# torch's warning, word for word, given where torch gives it (the errors its worker start
# catches, on every Python), then the error, which says what could not be sent and why.
_ERRORS_TORCH_WARNS_ABOUT = (TypeError, AttributeError, pickle.PicklingError)
PICKLE_WARNING = (
    "Got pickle error when attempting to start a worker Process. This might be because the "
    "worker Process arguments are not picklable. Python 3.14+ changed the multiprocessing start "
    "method in non-Mac POSIX platforms to 'forkserver', which requires the worker Process "
    "arguments to be picklable. You can also try multiprocessing.set_start_method('fork')."
)


def _unpicklable(exc: Exception, name: str, obj: Any, start_method: str, sender: str) -> Exception:
    """The error to raise: ``exc``'s type, its message with ours after it, and its notes (pickle's
    own: Python 3.14 names the attribute there). Made here, not in a local of the raising frame:
    the raised error's traceback holds that frame, and a local holding the error makes a cycle
    that keeps the failed start's worker ends and slabs until the collector runs."""
    error = _unpicklable_error(exc, name, obj, start_method, sender)
    for note in getattr(exc, "__notes__", ()):
        error.add_note(note)
    return error


def _unpicklable_error(exc: Exception, name: str, obj: Any, start_method: str, sender: str) -> Exception:
    part = _unpicklable_part(obj, name)
    culprit = "it cannot" if part is None else f"{part[0]} (a {type(part[1]).__qualname__}) cannot"
    message = (
        f"{exc} (pipeload: {sender} cannot send {name}={_short_repr(obj)} to its "
        f"'{start_method}' worker processes because {culprit} be pickled. Define it at module "
        "level (not as a lambda or local function/class), or use multiprocessing_context='fork'.)"
    )
    try:
        return type(exc)(message)
    except Exception:  # an exception type that needs other constructor arguments
        return pickle.PicklingError(message)


# Parts taken as picklable without trying: pickling a tensor for a process moves it into shared
# memory, and a large array would be copied for nothing.
_TAKEN_AS_PICKLABLE = (str, bytes, bytearray, int, float, complex, bool, type(None), torch.Tensor)
_PARTS_LOOKED_AT = 1000  # of a container: its first items only (this runs on a failure path)


def _unpicklable_part(obj: Any, path: str, depth: int = 4) -> tuple[str, Any] | None:
    """The deepest part of ``obj`` (an attribute, a value, an item, within ``depth`` levels) that
    cannot be pickled, with its path (``dataset.transform``); None when no part is to blame (``obj``
    itself is: a lambda, a local class)."""
    if depth == 0:
        return None
    for part_path, part in _parts(obj, path):
        if isinstance(part, _TAKEN_AS_PICKLABLE) or type(part).__module__ == "numpy":
            continue
        try:
            pickle.dumps(part, pickle.HIGHEST_PROTOCOL)  # not ForkingPickler: it shares tensors
        except Exception:
            return _unpicklable_part(part, part_path, depth - 1) or (part_path, part)
    return None


def _parts(obj: Any, path: str) -> list[tuple[str, Any]]:
    if isinstance(obj, dict):
        return [(f"{path}[{key!r}]", value) for key, value in list(obj.items())[:_PARTS_LOOKED_AT]]
    if isinstance(obj, (list, tuple)):
        return [(f"{path}[{index}]", item) for index, item in enumerate(obj[:_PARTS_LOOKED_AT])]
    try:
        attributes = vars(obj)
    except TypeError:
        return []
    return [(f"{path}.{key}", value) for key, value in list(attributes.items())[:_PARTS_LOOKED_AT]]


def _short_repr(obj: Any) -> str:
    # A dataset can be a list of a million items: name it, do not print it.
    shortener = reprlib.Repr()
    shortener.maxother = shortener.maxstring = 160
    try:
        return shortener.repr(obj)
    except Exception:
        return f"<{type(obj).__qualname__} object>"
