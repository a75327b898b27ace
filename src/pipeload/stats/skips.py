"""The loader's failure board: what the sources' ``on_error`` policies skipped and raised, counted
exactly in every copy of the dataset, and the one ``max_failures`` budget they share.

A loader over a graph with on_error-aware pipes (``datapipes/sources/on_error.py``) owns one
board: a small table of 64-bit counters in shared memory that its process workers map (a forked
worker inherits the mapping; a spawned one receives the descriptor as it starts), its thread
workers and read-ahead threads share, and the main process reads. Each copy of the dataset has
its own row and writes only there: the main process's copy (without workers) row 1, worker
``i``'s row ``2 + i``; row 0 holds the epoch's number. A copy's pipes are bound to their row
(:func:`bind`) before its iterator is made, so a read-ahead thread that the iterator starts counts
from its first failure. Summing a column over the rows gives the loader's total at once: the
budget is checked against it the moment a failure happens, and ``loader.stats()`` and
``failure_counts()`` read it exact, not sampled.

Per pipe, a row holds: failures skipped, failures raised, files left out, samples left out, and
this epoch's failures and files left out. A row is tagged with the epoch it counts for; the
main process starts an epoch by raising the number in row 0, and a copy re-tags its row (zeroing
its epoch counters) when it is bound for that epoch, so an epoch's sums skip rows still counting
an earlier one. Each row also keeps the latest failure's description, for the error that ends an
epoch in which everything failed.
"""

from __future__ import annotations

import mmap
import os
import sys
import threading
import weakref
from collections.abc import Sequence
from multiprocessing import reduction
from multiprocessing.context import get_spawning_popen
from typing import Any, NamedTuple

import numpy as np

from pipeload.transport.shared_memory import create_buffer

MAX_WORKERS = 1024  # workers with a higher id count in their own process only
HEADER_ROW, MAIN_ROW = 0, 1
ROWS = 2 + MAX_WORKERS
# Per pipe: the columns of one row, after the row's epoch tag in column 0.
SKIPPED, RAISED, FILES, SAMPLES, EPOCH_FAILURES, EPOCH_FILES = range(6)
PER_PIPE = 6
NOTE_BYTES = 240  # the latest failure's description, per row (UTF-8, cut to fit)


def worker_row(worker_id: int) -> int | None:
    """The board row of worker ``worker_id`` (None past ``MAX_WORKERS``)."""
    return 2 + worker_id if worker_id < MAX_WORKERS else None


class Counts(NamedTuple):
    """Totals of one pipe, or of every pipe (what ``FailureCounts`` is made from)."""

    skipped: int = 0
    raised: int = 0
    files: int = 0
    samples: int = 0


class FailureBoard:
    """Failure counters for every copy of one loader's dataset, in shared memory.

    Held by the loader, its engines' fetch specs and its epochs' iterators, and released with
    the last of them. Process workers hold their own mapping of the same memory: anonymous
    shared memory, which forked workers inherit and which holds no descriptor, or
    (``shareable``) a nameless file, whose descriptor spawned ones receive. The counters are
    viewed afresh by each call (no view outlives it), so ``close()`` (idempotent) can unmap
    them whatever still refers to the board. Invariants: a row other than 0 is written only by
    the copy it belongs to, under that process's ``lock``; row 0 only by the main process; a
    row's epoch counters count the epoch its tag names.

    Example:
        >>> board = FailureBoard(pipes=2)
        >>> board.new_epoch()
        1
    """

    def __init__(self, pipes: int, *, shareable: bool = False, _fd: int | None = None) -> None:
        self.pipes = pipes
        self.columns = 1 + PER_PIPE * pipes
        self._counter_bytes = ROWS * self.columns * 8
        self.nbytes = self._counter_bytes + ROWS * NOTE_BYTES
        self._fd = -1  # the owner's descriptor, for spawned workers (see shareable)
        if _fd is not None:  # a spawned worker's copy: its mapping is all it needs
            try:
                self._mapping = mmap.mmap(_fd, self.nbytes)
            finally:
                os.close(_fd)
        elif shareable:
            self._fd = create_buffer(self.nbytes, allocate=True)
            self._mapping = mmap.mmap(self._fd, self.nbytes)  # keeps a descriptor of its own
            self._fd_closer = weakref.finalize(self, os.close, self._fd)
        else:  # anonymous and shared: threads and forked workers see it, and it holds no descriptor
            self._mapping = mmap.mmap(-1, self.nbytes)
        self.lock = threading.Lock()  # this process's writers (a worker thread, its read-ahead)
        self._pid = os.getpid()
        self.budgets: list[tuple[list[int], int | None]] = []  # the main process's: board_for

    @property
    def closed(self) -> bool:
        return self._mapping.closed

    @property
    def shareable(self) -> bool:
        """Whether a spawned (not forked) worker can be given it: only a board made with a
        descriptor can (it costs two while it lives: the board's and its mapping's)."""
        return self._fd >= 0

    def made_shareable(self) -> FailureBoard:
        """A shareable board holding what this one counted (this one is closed)."""
        board = FailureBoard(self.pipes, shareable=True)
        with self.lock:
            board._mapping[:] = self._mapping[:]
        board.budgets = self.budgets
        self.close()
        return board

    def _counters(self) -> np.ndarray:
        return np.frombuffer(self._mapping, np.int64, ROWS * self.columns).reshape(ROWS, self.columns)

    def _notes(self) -> np.ndarray:
        view = np.frombuffer(self._mapping, np.uint8, ROWS * NOTE_BYTES, self._counter_bytes)
        return view.reshape(ROWS, NOTE_BYTES)

    @property
    def generation(self) -> int:
        """The current epoch's number (0 before the first)."""
        return int(self._counters()[HEADER_ROW, 0])

    def new_epoch(self) -> int:
        """The main process starts an epoch: rows tagged with an older number stop counting
        towards this epoch's sums. Returns the new number."""
        self._counters()[HEADER_ROW, 0] += 1
        return self.generation

    def enter_epoch(self, row: int) -> None:
        """A copy starts the current epoch in ``row``: its epoch counters restart at zero."""
        if os.getpid() != self._pid:  # a forked worker: the parent's lock may have been held
            self.lock, self._pid = threading.Lock(), os.getpid()
        with self.lock:
            counters = self._counters()
            for pipe in range(self.pipes):
                base = 1 + PER_PIPE * pipe
                counters[row, base + EPOCH_FAILURES] = counters[row, base + EPOCH_FILES] = 0
            counters[row, 0] = counters[HEADER_ROW, 0]

    def add(self, row: int, pipe: int, counts: Counts, failures: int, note: str | None = None) -> None:
        """Count ``counts`` (and ``failures`` of this epoch) for ``pipe`` in ``row``."""
        base = 1 + PER_PIPE * pipe
        with self.lock:
            if self.closed:
                return  # the loader is gone: nobody reads this any more
            cells = self._counters()[row]
            cells[base + SKIPPED] += counts.skipped
            cells[base + RAISED] += counts.raised
            cells[base + FILES] += counts.files
            cells[base + SAMPLES] += counts.samples
            cells[base + EPOCH_FAILURES] += failures
            cells[base + EPOCH_FILES] += counts.files
            if note is not None:
                encoded = note.encode("utf-8", "replace")[:NOTE_BYTES - 1]
                notes = self._notes()
                notes[row, :] = 0
                notes[row, :len(encoded)] = np.frombuffer(encoded, np.uint8)

    def _this_epoch(self) -> np.ndarray:
        """The copies' rows that count for the current epoch."""
        counters = self._counters()
        return counters[1:][counters[1:, 0] == counters[HEADER_ROW, 0]]

    def epoch_failures(self, pipes: Sequence[int]) -> int:
        """Failures of ``pipes`` this epoch, in every copy that counts for it."""
        columns = [1 + PER_PIPE * pipe + EPOCH_FAILURES for pipe in pipes]
        return int(self._this_epoch()[:, columns].sum())

    def epoch_files(self) -> int:
        """Files left out this epoch, by every pipe in every copy."""
        columns = [1 + PER_PIPE * pipe + EPOCH_FILES for pipe in range(self.pipes)]
        return int(self._this_epoch()[:, columns].sum())

    def totals(self, pipe: int | None = None) -> Counts:
        """What ``pipe`` (None: every pipe) counted in every copy, over every epoch."""
        pipes = range(self.pipes) if pipe is None else [pipe]
        summed = self._counters()[1:].sum(axis=0)
        return Counts(*(int(sum(summed[1 + PER_PIPE * p + kind] for p in pipes))
                        for kind in (SKIPPED, RAISED, FILES, SAMPLES)))

    def epoch_notes(self) -> list[str]:
        """The latest failure's description of each copy that failed this epoch."""
        counters, notes = self._counters(), self._notes()
        rows = np.nonzero(counters[1:, 0] == counters[HEADER_ROW, 0])[0] + 1
        texts = (bytes(notes[row]).rstrip(b"\0").decode("utf-8", "replace") for row in rows)
        return [text for text in texts if text]

    def close(self) -> None:
        """Unmap the counters and close the descriptor now (idempotent): the loader is gone.
        Process workers keep their own mappings until they exit."""
        with self.lock:
            self._mapping.close()
            if self._fd >= 0:
                self._fd = -1
                self._fd_closer()

    def __reduce__(self) -> Any:
        if get_spawning_popen() is None or self._fd < 0:
            raise TypeError("a FailureBoard travels only from its owner to a worker process being started")
        return (_attach, (reduction.DupFd(self._fd), self.pipes))


def _attach(fd: Any, pipes: int) -> FailureBoard:
    descriptor = fd.detach() if hasattr(fd, "detach") else fd
    return FailureBoard(pipes, _fd=descriptor)


# -- the pipes' side --------------------------------------------------------------------------

def error_policy_pipes(dataset: Any) -> list[Any]:
    """The pipes of ``dataset``'s graph that take an ``on_error`` policy, in graph order (the same
    in every copy); empty for anything that is not one of pipeload's own graphs."""
    if "pipeload.datapipes" not in sys.modules:  # no pipe can exist before its module is imported
        return []
    try:  # the family that plugs into the loader may be a stand-in without on_error pipes
        from pipeload.datapipes.base import IterDataPipe, MapDataPipe
        from pipeload.datapipes.graph import list_dps
        from pipeload.datapipes.sources.on_error import ErrorPolicyMixin
    except ImportError:
        return []

    if not isinstance(dataset, (IterDataPipe, MapDataPipe)):
        return []
    try:
        return [pipe for pipe in list_dps(dataset) if isinstance(pipe, ErrorPolicyMixin)]
    except Exception:
        return []  # a graph that cannot be walked still loads; it only goes uncounted


def board_for(dataset: Any, shareable: bool = False) -> FailureBoard | None:
    """A new board for a loader over ``dataset`` (its pipes bound to it, read only), or None
    when it has no on_error pipes. The board knows each budget: which pipes share it and their
    ``max_failures`` (``budgets``), for the main process's check when an epoch ends."""
    pipes = error_policy_pipes(dataset)
    if not pipes:
        return None
    board = FailureBoard(len(pipes), shareable=shareable)
    groups: dict[Any, list[int]] = {}
    for index, pipe in enumerate(pipes):
        groups.setdefault(pipe.budget_group(index), []).append(index)
    board.budgets = [(members, pipes[members[0]].max_failures) for members in groups.values()]
    bind(dataset, board, None)
    return board


def bind(dataset: Any, board: FailureBoard | None, row: int | None) -> None:
    """Make ``dataset``'s on_error pipes count on ``board`` in ``row`` (None: read only, the main
    process's copy while workers run it), and tag the row with the current epoch. Call before
    the copy's iterator is made."""
    if board is None:
        return
    pipes = error_policy_pipes(dataset)
    if len(pipes) != board.pipes:
        return  # not the graph the board was made for: it counts in its process alone
    if row is not None:
        board.enter_epoch(row)
    groups: dict[Any, list[int]] = {}
    for index, pipe in enumerate(pipes):
        groups.setdefault(pipe.budget_group(index), []).append(index)
    for index, pipe in enumerate(pipes):
        pipe.bind_failures(BoardSlot(board, row, index, groups[pipe.budget_group(index)]))


class BoardSlot:
    """One pipe's place on a board: its row (None: it only reads) and the pipes whose failures
    share its budget. Held by the pipe as a transient attribute; any thread may use it."""

    def __init__(self, board: FailureBoard, row: int | None, pipe: int, budget: list[int]) -> None:
        self._board = weakref.ref(board)  # the loader owns the board; a pipe outlives it
        self.row = row
        self.pipe = pipe
        self.budget = budget

    @property
    def board(self) -> FailureBoard | None:
        board = self._board()
        return None if board is None or board.closed else board

    def add(self, counts: Counts, failures: int = 0, note: str | None = None) -> None:
        board = self.board
        if board is not None and self.row is not None:
            board.add(self.row, self.pipe, counts, failures, note)

    def budget_used(self) -> int | None:
        """Failures of this budget's pipes this epoch, across the loader (None: no board)."""
        board = self.board
        return None if board is None or self.row is None else board.epoch_failures(self.budget)

    def totals(self) -> Counts | None:
        board = self.board
        return None if board is None else board.totals(self.pipe)
