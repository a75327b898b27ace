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

Which readings: ``module:factory``, called as ``factory(root, sampler_pid)`` at each ``start``
(so baselines are taken then), returning an object whose ``take(tick)`` gives a dict of readings
(``tick`` 0 is the window's first reading and the last one at ``stop``: every reading is taken
then). ``pipeload bench`` reads RSS and shared memory (``measure.BasicReadings``); the source
checkout's benchmarks read more (``bench/measure.py``).
"""

from __future__ import annotations

import importlib
import json
import os
import select
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
          "from pipeload.cli.sampler import serve\n"
          "serve(config)\n")
START_TIMEOUT_S = 60.0  # the child imports pipeload (and so torch) once
ANSWER_TIMEOUT_S = 30.0


class TreeSampler:
    """A sampler process reading the memory of this process's tree (itself left out).

    Owned by the thread that made it; ``start``/``stop`` alternate. Example:

        >>> sampler = TreeSampler("pipeload.cli.measure:BasicReadings")
        >>> sampler.start(); data = bytearray(10**7); peaks = sampler.stop()
        >>> sampler.close()
    """

    def __init__(self, readings: str, interval_s: float = 0.05) -> None:
        config = {"path": sys.path, "root": os.getpid(), "readings": readings, "interval_s": interval_s}
        self._child = subprocess.Popen([sys.executable, "-c", _CHILD, json.dumps(config)],
                                       stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
        self._finalizer = weakref.finalize(self, _end, self._child)
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
        self._say("start")

    def stop(self) -> dict[str, int]:
        """End the window: a last reading, then the peak of each reading over the window."""
        self._say("stop")
        answer = self._answers.next_line(ANSWER_TIMEOUT_S)
        if not answer:
            raise RuntimeError("the memory sampler process did not answer")
        return json.loads(answer)

    def close(self) -> None:
        self._finalizer()

    def _say(self, command: str) -> None:
        assert self._child.stdin is not None
        self._child.stdin.write(command + "\n")
        self._child.stdin.flush()


def _end(child: subprocess.Popen) -> None:
    try:
        child.stdin.close()  # type: ignore[union-attr]
        child.wait(timeout=ANSWER_TIMEOUT_S)
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

    def has_line(self) -> bool:
        return b"\n" in self._pending


_shared: dict[str, TreeSampler] = {}
_shared_lock = threading.Lock()


def shared_sampler(readings: str) -> TreeSampler:
    """One sampler process per kind of readings for the whole command (started on first use,
    ended at exit by its finalizer)."""
    with _shared_lock:
        sampler = _shared.get(readings)
        if sampler is None or not sampler.alive:
            sampler = _shared[readings] = TreeSampler(readings)
        return sampler


# --- the sampler process's side ---------------------------------------------------------------

def serve(config: dict[str, Any]) -> None:
    """Read the tree between ``start`` and ``stop`` until stdin closes."""
    import psutil  # the `bench` extra

    module, name = config["readings"].split(":")
    factory = getattr(importlib.import_module(module), name)
    root, interval_s = psutil.Process(config["root"]), config["interval_s"]
    commands = LineReader(sys.stdin.fileno())
    _answer(READY)
    readings, peaks, tick = None, {}, 0
    while True:
        # Wait for a command, or (in a window) until the next reading is due.
        command = commands.next_line(interval_s if readings is not None else None)
        if commands.closed and not command:
            return  # the measuring process closed the pipe (or exited)
        if command:
            if command == "start":
                readings, peaks, tick = factory(root, os.getpid()), {}, 0
            elif command == "stop" and readings is not None:
                _keep_peaks(peaks, readings.take(0))
                _answer(json.dumps(peaks))
                readings = None
                continue
        if readings is not None:
            _keep_peaks(peaks, readings.take(tick))
            tick += 1


def _keep_peaks(peaks: dict[str, int], reading: dict[str, int]) -> None:
    for key, value in reading.items():
        peaks[key] = max(peaks.get(key, 0), value)


def _answer(line: str) -> None:
    sys.stdout.write(line + "\n")
    sys.stdout.flush()


def tree_pids_by_proc(root_pid: int, leave_out: int) -> list[int]:
    """``root_pid`` and its live descendants, ``leave_out`` and its descendants excepted.

    Read from each thread's ``/proc/PID/task/TID/children`` (a few small files): psutil's
    ``children(recursive=True)`` reads every process's status on the machine, ~2 ms a call.
    """
    if not os.path.exists(f"/proc/{root_pid}/task/{root_pid}/children"):
        return _tree_pids_by_psutil(root_pid, leave_out)  # a kernel without CONFIG_PROC_CHILDREN
    pids, todo = [], [root_pid]
    while todo:
        pid = todo.pop()
        if pid == leave_out:
            continue
        pids.append(pid)
        try:
            tasks = os.listdir(f"/proc/{pid}/task")
        except OSError:
            continue  # it exited meanwhile
        for task in tasks:
            try:
                with open(f"/proc/{pid}/task/{task}/children", "rb") as children:
                    todo.extend(int(child) for child in children.read().split())
            except OSError:
                continue
    return pids


def _tree_pids_by_psutil(root_pid: int, leave_out: int) -> list[int]:
    import psutil  # the `bench` extra

    def descendants(pid: int) -> set[int]:
        try:
            return {child.pid for child in psutil.Process(pid).children(recursive=True)}
        except psutil.Error:
            return set()

    left_out = {leave_out} | descendants(leave_out)
    return [root_pid, *(pid for pid in descendants(root_pid) if pid not in left_out)]
