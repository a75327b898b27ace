"""A run the reading side dropped, told to its actors past their queue of calls: a flag file.

A sync actor answers its calls one at a time, in order, and on Ray 2.60 ``ray.cancel`` does not
spare a queued call of such an actor: after a loop's ``break`` the next run's start waited
behind every chunk the dropped run had asked ahead for. A second concurrency group would hear
of the drop at once, but Ray then runs every call off the actor's main thread, where a stage
calling ``signal.signal`` fails. So, as it lets a run's actors go, the reading side raises a
flag for the run: an empty file, named for the run's generation, in this machine's temporary
directory, for each actor still in a call of the run. Each call of the run looks for it before
making its chunk, and between items every ``CHECK_EVERY_S``; once it is there, the call stops
making items and the actor closes the run, and takes the flag down (no call of the run looks
again). Where the actor never sees it, the reading side takes it down when the actor has
answered its ``stop`` call (which it takes after every call of the run), when it kills the
actor instead, or when this process exits (a DataLoader worker's exit included). A process
that is killed lowers none of its flags: the next flag raised on the machine takes them down.

Only an actor on this machine can see the file. An actor on another node looks on its own
machine, finds none, and works through the dropped run's queued chunks as before (the next run
on it waits for them). Ray's internal key-value store would reach every node, but it is not
public and a read is a round trip to the cluster's one GCS: 0.3 ms on one machine (an actor
call is 0.6 ms). Looking for the file costs 2 us, cheap enough to do between items too (an item
of a light map takes 0.3 us: hence the ``CHECK_EVERY_S`` spacing).
"""

from __future__ import annotations

import glob
import multiprocessing.util
import os
import tempfile
import threading
import uuid
from typing import Any

CHECK_EVERY_S = 0.01  # how often a call making a chunk looks for its run's flag between items
_PREFIX = "pipeload-dropped-run-"
_raised: set[str] = set()  # raised here and not lowered yet: lowered at exit at the latest
_lock = threading.Lock()  # the flags are raised where a run ends and lowered on Ray's threads
_token: str | None = None  # this process's flags' random name
_exit_hook_for: int | None = None  # the pid whose exit takes its flags down


def flag_for(generation: int) -> str:
    """Where the flag of run ``generation`` (a number unique in this process) is raised."""
    return os.path.join(tempfile.gettempdir(), f"{_PREFIX}{_process_token()}-{generation}")


def flags_left() -> list[str]:
    """The flags of this process's runs that are raised now."""
    return glob.glob(os.path.join(tempfile.gettempdir(), f"{_PREFIX}{_process_token()}-*"))


def raise_flag(path: str | None) -> None:
    """Tell the calls of the run whose flag is ``path`` that it was dropped (None: no flag)."""
    if path is None:
        return
    _take_down_at_exit()
    _take_down_the_dead_ones()  # a drop is rare (a loop's break): one look in the directory each
    with _lock:
        _raised.add(path)
    try:
        open(path, "w").close()
    except OSError:
        pass  # no flag: its calls are made as if the run went on, as before flags


def lower_flag(path: str | None) -> None:
    """Take the flag at ``path`` down (the run's calls are all answered, or its actor is gone)."""
    if path is None:
        return
    with _lock:
        _raised.discard(path)
    try:
        os.unlink(path)
    except OSError:
        pass  # not raised (it could not be made), or lowered already


def lower_when_answered(call: Any, path: str | None) -> None:
    """Lower ``path`` once the actor call ``call`` (an ObjectRef) is answered or has failed."""
    if path is None:
        return
    call.future().add_done_callback(lambda _: lower_flag(path))


def seen_raised(path: str | None) -> bool:
    """Whether the flag at ``path`` is up (None: a run with no flag), in an actor. A flag seen is
    taken down at once: the actor closes its run, whose calls then look no more, and the
    reading side may be gone by the time it would."""
    if path is None or not os.path.exists(path):
        return False
    try:
        os.unlink(path)
    except OSError:
        pass  # taken down meanwhile
    return True


def _process_token() -> str:
    # Random, not the pid alone: a flag left by a process that was killed must not be taken by a
    # later process given the same pid (run numbers start at 0 in every process). The pid leads,
    # so that a flag whose process is gone can be told (``_take_down_the_dead_ones``).
    global _token
    if _token is None:
        _token = f"{os.getpid()}.{uuid.uuid4().hex[:16]}"
    return _token


def _take_down_the_dead_ones() -> None:
    """Take down the flags of processes that are gone: one killed (SIGKILL, or the terminate a
    stuck loader's workers get) never lowers its own, and each stayed in the temporary directory
    as an empty file. A flag whose pid is alive is left, whoever's it is."""
    for path in glob.glob(os.path.join(tempfile.gettempdir(), f"{_PREFIX}*")):
        pid = os.path.basename(path)[len(_PREFIX):].split(".", 1)[0]
        if pid.isdigit() and int(pid) != os.getpid() and not _alive(int(pid)):
            try:
                os.unlink(path)
            except OSError:
                pass  # another user's, or taken down meanwhile


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except OSError:
        return True  # another user's process: alive
    return True


def _forget_the_parents_flags() -> None:
    # A forked child's run numbers repeat its parent's, and the parent's flags are not its own
    # to lower when it exits.
    global _token, _lock
    _token, _lock = None, threading.Lock()
    _raised.clear()


def _take_down_at_exit() -> None:
    # multiprocessing's exit finalizers run at the main process's exit and at a worker's, which
    # leaves with os._exit, skipping atexit. Registered by each process that raises a flag: a
    # forked worker's registry starts empty.
    global _exit_hook_for
    if _exit_hook_for != os.getpid():
        _exit_hook_for = os.getpid()
        multiprocessing.util.Finalize(None, _lower_all, exitpriority=0)


def _lower_all() -> None:
    with _lock:
        left = list(_raised)
    for path in left:
        lower_flag(path)


os.register_at_fork(after_in_child=_forget_the_parents_flags)
