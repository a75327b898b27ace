"""A 'spawn' start that cannot wait for ever on a child that died before reading its start-up data.

multiprocessing's spawn start writes the child's start-up data (its preparation and the pickled
``Process``, the dataset with it) into a pipe while the parent still holds the child's reading
end of that pipe: it closes it only once the write is done. A child that dies before reading it
all (importing a script without a main guard, say) then leaves the parent blocked in the write
for good as soon as the data is larger than the pipe holds (64 KiB): the reader the write waits
for is the parent itself. torch's DataLoader hangs there too.

``SpawnProcess`` starts the same interpreter with the same command line and sends the same bytes,
but the parent closes its copies of the child's ends as soon as the child exists: a child that is
gone breaks the write (``BrokenPipeError``), which ``lifecycle.start_process`` turns into a
worker's death in torch's words.
"""

from __future__ import annotations

import contextlib
import io
import os
import signal
from collections.abc import Iterator
from multiprocessing import context, popen_spawn_posix, resource_tracker, spawn, util
from typing import Any

from pipeload._interrupts import on_the_main_thread


class _SpawnPopen(popen_spawn_posix.Popen):
    """multiprocessing's spawn ``Popen`` with a launch that lets go of the child's pipe ends first."""

    def _launch(self, process_obj: Any) -> None:
        tracker = resource_tracker.getfd()
        self._fds.append(tracker)
        start_up = io.BytesIO()
        context.set_spawning_popen(self)  # descriptors pickled now go to the child with it
        try:
            context.reduction.dump(spawn.get_preparation_data(process_obj._name), start_up)
            context.reduction.dump(process_obj, start_up)
        finally:
            context.set_spawning_popen(None)
        kept: list[int] = []  # the parent's ends, closed with this Popen
        child_ends: list[int] = []  # the child's ends: the parent's copies go once it has its own
        try:
            ended, child_ends_it = os.pipe()  # reads end-of-file once the child is gone
            kept.append(ended)
            child_ends.append(child_ends_it)
            child_reads, writing = os.pipe()
            kept.append(writing)
            child_ends.append(child_reads)
            self._fds += [child_reads, child_ends_it]
            command = spawn.get_command_line(tracker_fd=tracker, pipe_handle=child_reads)
            self.pid = util.spawnv_passfds(spawn.get_executable(), command, self._fds)
            util.close_fds(*child_ends)
            child_ends.clear()
            self.sentinel = ended
            with open(writing, "wb", closefd=False) as pipe, _broken_pipe_raises():
                pipe.write(start_up.getbuffer())
        finally:
            util.close_fds(*child_ends)
            self.finalizer = util.Finalize(self, util.close_fds, kept)


@contextlib.contextmanager
def _broken_pipe_raises() -> Iterator[None]:
    """A write to a child that is gone raises ``BrokenPipeError``, as Python arranges at start,
    even in a script that set ``SIGPIPE`` back to its default, which would end this process
    without a word (main thread only: signal handlers are set there)."""
    restore = None
    if on_the_main_thread():
        try:
            if signal.getsignal(signal.SIGPIPE) == signal.SIG_DFL:
                restore = signal.signal(signal.SIGPIPE, signal.SIG_IGN)
        except (ValueError, OSError):
            restore = None
    try:
        yield
    finally:
        if restore is not None:
            signal.signal(signal.SIGPIPE, restore)


class SpawnProcess(context.SpawnProcess):
    """A ``Process`` of the 'spawn' method started by ``_SpawnPopen``."""

    @staticmethod
    def _Popen(process_obj: Any) -> Any:  # noqa: N802  (the name multiprocessing calls)
        return _SpawnPopen(process_obj)
