"""Memory peaks of a process tree, read by a process of its own.

A sampling thread inside the measured process parses ``/proc`` while holding that process's GIL:
milliseconds a reading, more for every process the loader runs. It slowed the very main process
it measured, and unevenly: on ``pipeload bench``'s JPEGs a thread reading every 50 ms took ~7%
off economic mode's samples/s (five processes) and ~2% off classic mode's (three), so the bench
read economic mode's ratio low by ~5%. So the readings run in a sampler process, started once per
command before anything is timed, left out of the tree it reads, and told over a pipe when a
measured window starts and ends.

Protocol (one line each way): ``start`` begins a window; ``stop`` takes a last reading and
answers one JSON line, the peak of each reading over the window. Closing its stdin ends it.

Which readings: ``where:factory``, ``where`` a module name or the path of a ``.py`` file (loaded
alone, without its package: ``pipeload bench``'s readings, tree_memory.py, import nothing of
pipeload or torch, so the process starts in a tenth of a second). ``factory(root, sampler_pid)``
is called at each ``start`` (so baselines are taken then) and returns an object whose
``take(tick)`` gives a dict of readings (``tick`` 0 is the window's first reading and the last
one at ``stop``: every reading is taken then). The source checkout's benchmarks read more
(``bench/measure.py``, a module: their process imports torch once per command).

This file too is loaded by path in the sampler process, and imports nothing of pipeload.
"""

from __future__ import annotations

import importlib
import importlib.util
import json
import os
import select
import signal
import subprocess
import sys
import threading
import time
import weakref
from typing import Any

READY = "ready"
# The child: the parent's import path, so that the readings' module (pipeload's or the source
# checkout's bench) is found as the parent finds it.
_CHILD = ("import json, sys\n"
          "config = json.loads(sys.argv[1])\n"
          "sys.path[:] = config['path']\n"
          "import importlib.util\n"
          "spec = importlib.util.spec_from_file_location('_pipeload_sampler', config['sampler'])\n"
          "sampler = importlib.util.module_from_spec(spec)\n"
          "spec.loader.exec_module(sampler)\n"
          "sampler.serve(config)\n")
START_TIMEOUT_S = 60.0  # readings from a module may import torch (~2 s; more on a busy box)
ANSWER_TIMEOUT_S = 30.0
END_TIMEOUT_S = 5.0  # from its stdin's end to its exit: a reading at most
PARENT_CHECK_S = 1.0  # between windows, how often the sampler looks whether its owner lives


class TreeSampler:
    """A sampler process reading the memory of this process's tree (itself left out).

    Owned by the thread that made it; ``start``/``stop`` alternate (``busy`` between them). A
    ``stop`` that gets no answer ends the process (its late answer would be the next window's),
    and raises. Example:

        >>> from pipeload.cli.measure import BASIC_READINGS  # tree_memory.py's, by path
        >>> sampler = TreeSampler(BASIC_READINGS)
        >>> sampler.start(); data = bytearray(10**7); peaks = sampler.stop()
        >>> sampler.close()
    """

    def __init__(self, readings: str, interval_s: float = 0.05) -> None:
        config = {"path": sys.path, "root": os.getpid(), "readings": readings, "interval_s": interval_s,
                  "sampler": __file__}
        # The interpreter's own flags (-I, -E, ...) too, so that the child finds what we find.
        command = [sys.executable, *subprocess._args_from_interpreter_flags(), "-c", _CHILD, json.dumps(config)]
        self._child = subprocess.Popen(command, stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
        self._finalizer = weakref.finalize(self, _end, self._child)
        _all_samplers.add(self)
        self.busy = False
        assert self._child.stdout is not None
        self._answers = LineReader(self._child.stdout.fileno())
        line = self._answers.next_line(START_TIMEOUT_S)
        if line != READY:
            self.close()
            raise RuntimeError(f"the memory sampler process did not start (it said {line!r})")

    @property
    def pid(self) -> int:
        return self._child.pid

    @property
    def alive(self) -> bool:
        return self._child.poll() is None

    def start(self) -> None:
        """Begin a window: the peaks are reset and a first reading is taken."""
        if self.busy:
            raise RuntimeError("this memory sampler's window is open already")
        self._say("start")
        self.busy = True

    def stop(self) -> dict[str, int]:
        """End the window: a last reading, then the peak of each reading over the window."""
        self._say("stop")
        self.busy = False
        answer = self._answers.next_line(ANSWER_TIMEOUT_S)
        if not answer:
            self.close()
            raise RuntimeError("the memory sampler process did not answer")
        return json.loads(answer)

    def close(self) -> None:
        self._finalizer()

    def disown(self) -> None:
        """In a process forked from the owner: let go of the pipes without ending the sampler
        (it ends when its owner closes them; a copy held here would keep it waiting)."""
        self._finalizer.detach()
        for stream in (self._child.stdin, self._child.stdout):
            if stream is not None:
                try:
                    stream.close()
                except OSError:
                    pass

    def _say(self, command: str) -> None:
        assert self._child.stdin is not None
        self._child.stdin.write(command + "\n")
        self._child.stdin.flush()


def _end(child: subprocess.Popen) -> None:
    try:
        child.stdin.close()  # type: ignore[union-attr]
        child.wait(timeout=END_TIMEOUT_S)
    except (OSError, subprocess.TimeoutExpired):
        child.kill()
        child.wait()
    finally:
        if child.stdout is not None:
            child.stdout.close()


class LineReader:
    """Lines from a pipe, read unbuffered: a buffered reader can hold a second line that
    ``select`` then no longer sees. Both sides of the pipe use one."""

    def __init__(self, fd: int) -> None:
        self._fd = fd
        self._pending = b""
        self.closed = False

    def next_line(self, timeout_s: float | None) -> str:
        """The next line (stripped); "" if none came within ``timeout_s`` or the pipe closed."""
        deadline = None if timeout_s is None else time.monotonic() + timeout_s
        while b"\n" not in self._pending:
            left = None if deadline is None else max(0.0, deadline - time.monotonic())
            if self.closed or not select.select([self._fd], [], [], left)[0]:
                return ""
            chunk = os.read(self._fd, 4096)
            if not chunk:
                self.closed = True
                return ""
            self._pending += chunk
        line, _, self._pending = self._pending.partition(b"\n")
        return line.decode().strip()


_shared: dict[str, TreeSampler] = {}
_shared_lock = threading.Lock()
_all_samplers: weakref.WeakSet[TreeSampler] = weakref.WeakSet()


def shared_sampler(readings: str) -> TreeSampler:
    """One sampler process per kind of readings for the whole command (started on first use,
    ended at exit by its finalizer)."""
    with _shared_lock:
        sampler = _shared.get(readings)
        if sampler is None or not sampler.alive:
            sampler = _shared[readings] = TreeSampler(readings)
        return sampler


class Window:
    """One measured window: the peak of each reading between opening and ``close()``, in
    ``peaks``. Taken by the command's sampler for ``readings``; a window opened inside one still
    open gets a sampler process of its own, ended with it.

    Example:
        >>> with Window(BASIC_READINGS) as window:  # pipeload.cli.measure's
        ...     data = bytearray(10**7)
        >>> window.peaks["rss"] > 0
        True
    """

    def __init__(self, readings: str) -> None:
        self.peaks: dict[str, int] = {}
        shared = shared_sampler(readings)
        self._own = shared.busy
        self._sampler = TreeSampler(readings) if self._own else shared
        self._sampler.start()
        self._open = True

    def close(self) -> None:
        """Take a last reading and end the window. Safe to call more than once."""
        if self._open:
            self._open = False
            try:
                self.peaks.update(self._sampler.stop())
            finally:
                if self._own:
                    self._sampler.close()

    def __enter__(self) -> Window:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def close_shared() -> None:
    """End every shared sampler process now (a test that checks for leftover children)."""
    with _shared_lock:
        samplers = list(_shared.values())
        _shared.clear()
    for sampler in samplers:
        sampler.close()


def _forget_in_forked_child() -> None:
    # A worker forked while a sampler runs would hold its stdin open, and the sampler would
    # outlive the command (and the command's exit would wait for it).
    global _shared_lock
    for sampler in list(_all_samplers):
        sampler.disown()
    _shared.clear()
    _shared_lock = threading.Lock()  # another thread may have held it at the fork


os.register_at_fork(after_in_child=_forget_in_forked_child)


# --- the sampler process's side ---------------------------------------------------------------

def serve(config: dict[str, Any]) -> None:
    """Read the tree between ``start`` and ``stop`` until stdin closes."""
    import psutil  # the `bench` extra

    # Ctrl-C reaches the whole process group: the measuring process answers it, and its exit
    # closes our stdin, which ends this loop (a traceback from here would only add noise).
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    where, _, name = config["readings"].rpartition(":")
    factory = getattr(_load(where), name)
    root, interval_s = psutil.Process(config["root"]), config["interval_s"]
    commands = LineReader(sys.stdin.fileno())
    _answer(READY)
    readings, peaks, tick = None, {}, 0
    while True:
        # Wait for a command, or (in a window) until the next reading is due.
        command = commands.next_line(interval_s if readings is not None else PARENT_CHECK_S)
        if commands.closed and not command:
            return  # the measuring process closed the pipe (or exited)
        if os.getppid() != config["root"]:
            return  # the measuring process is gone (killed): its pipe may be held elsewhere
        if command:
            if command == "start":
                readings, peaks, tick = factory(root, os.getpid()), {}, 0
            elif command == "stop":
                if readings is not None:  # else: no window open; every stop is answered
                    _keep_peaks(peaks, readings.take(0))
                _answer(json.dumps(peaks))
                readings, peaks = None, {}
                continue
        if readings is not None:
            _keep_peaks(peaks, readings.take(tick))
            tick += 1


def _load(where: str) -> Any:
    """The module named ``where``, or the ``.py`` file at that path loaded on its own."""
    if not where.endswith(".py"):
        return importlib.import_module(where)
    spec = importlib.util.spec_from_file_location(f"_pipeload_readings_{len(sys.modules)}", where)
    module = importlib.util.module_from_spec(spec)  # type: ignore[arg-type]
    spec.loader.exec_module(module)  # type: ignore[union-attr]
    return module


def _keep_peaks(peaks: dict[str, int], reading: dict[str, int]) -> None:
    for key, value in reading.items():
        peaks[key] = max(peaks.get(key, 0), value)


def _answer(line: str) -> None:
    sys.stdout.write(line + "\n")
    sys.stdout.flush()
