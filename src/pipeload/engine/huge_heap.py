"""The main process's own memory in huge pages, so that forking the next workers costs less.

A fork copies the parent's page table entry by entry and takes a reference on every private page
it maps; the child's exit drops them again. With torch imported, the main process holds ~150 MiB
of private memory (its heap and Python's arenas, ~37,000 pages of 4 KiB), and one fork plus the
child's exit cost 6 to 10 ms on the development box, in the main process, one fork after another.
A loader without persistent workers pays that for every worker at every epoch, before any batch
is built: 8 workers, ~50 ms an epoch. Where the same memory lies in 2 MiB pages, the fork copies
one entry per 2 MiB: measured there, 7 to 16 ms fell to 3.6 to 4.7 ms per fork and exit
(``python -m bench.huge_heap``).

Linux (6.1 and later) lets a process gather its populated memory into huge pages on request
(``MADV_COLLAPSE``): the kernel copies each 2 MiB window into a huge page, without changing a byte
of what it holds. That copy costs ~20 to 450 ms for torch's heap (it varies with how readily the
kernel finds free huge pages), so it is done once, by a short-lived thread that releases the GIL in
the kernel, when a set of forked workers has stopped: a process that forks workers once forks them
again (the next epoch of a loader without persistent workers, the next loader), and meanwhile
the loop may well have other work (validation, a checkpoint).

The kernel copies a window even where a child shares its pages, which would leave this process
a private copy of them for as long as the child lives (a 512 MiB dataset held in memory: 512 MiB
more, for as long as a persistent loader's workers live). So only windows whose pages are nearly
all there and mapped by this process alone are gathered, each checked again just before it is
(the resident set grows by a few pages at most, even where memory was given back meanwhile), and
the next fork of workers waits for a running round rather than share pages with it
(``before_fork``): for ``FORK_WAITS_S`` at most, then the round stops after its window in hand
and goes on at the next stop (a round gathers at most ``ROUND_BYTES``: a dataset held in memory
is gathered over several). Windows are chosen again once the process has grown by 64 MiB (a
dataset loaded since).

A loader without persistent workers rarely leaves such a stop: the last epoch's workers are
reaped beside the loop, by which time the next epoch's have forked and share every page again.
Its workers go with their epoch, though: the windows ours alone are chosen just before such a
set forks (``before_short_lived_workers``) and gathered beside it once it has
(``beside_short_lived_workers``): this process holds its own copy of them (``ROUND_BYTES`` at
most) until the set exits, and the next set forks from huge pages. Never while another child
lives that is not such a worker (a persistent loader's), and any fork stops such a round first
(``stop_round_beside``): that copy would be held for as long as the child lives.

``PIPELOAD_HUGE_HEAP``: ``auto`` (the default) gathers where the kernel has transparent huge pages
(not ``never``) and the machine has a CPU to spare beside the workers; ``on`` gathers wherever the
kernel can; ``off`` never does. With every CPU taken by the workers, the copy and the waits come out
of the next epochs: on the 2-CPU development box it paid for itself only after ~20 epochs.
"""

from __future__ import annotations

import os
import sys
import threading
import time
from collections.abc import Collection, Iterator, Set
from dataclasses import dataclass
from typing import Any

import numpy as np

from pipeload.transport.slab_memory import madvise, pmd_huge_page_bytes, thp_setting

HUGE_HEAP_ENV = "PIPELOAD_HUGE_HEAP"
MADV_COLLAPSE = 25  # Linux 6.1
THP_SETTING = "/sys/kernel/mm/transparent_hugepage/enabled"
HUGE_PAGE_BYTES = 2 << 20  # x86-64 and arm64 (4 KiB base pages) PMD size
PAGE_BYTES = os.sysconf("SC_PAGE_SIZE") if hasattr(os, "sysconf") else 4096
DENSE_PAGES_SHARE = 0.875  # a window with more holes than this would grow the resident set
REGATHER_GROWTH_BYTES = 64 << 20  # private memory grown by this much since: choose again
# At most this much chosen a round (0.3 s of copying at the slowest rate seen, 2.5 ms a window):
# a dataset held in memory is gathered over several stops.
ROUND_BYTES = 256 << 20
# How long the next fork of workers waits for a running round before stopping it: the epoch's
# start is held up by this much at most (once, or once a stop while a dataset held in memory is
# gathered), against a few milliseconds saved per worker at every later epoch.
FORK_WAITS_S = 0.05
SCAN_WINDOWS = 512  # windows read from the page map at a time (2 MiB of it)
# Windows whose page map one choice reads at most: 4 GiB of address space, ~15 ms in the loop's
# thread; a larger process is chosen from over several stops, from where the last choice ended.
SCAN_MOST_WINDOWS = 2048
_OURS_ALONE = np.uint64((1 << 63) | (1 << 62) | (1 << 56))  # present, swapped, mapped once
_OURS_ALONE_MASKED = np.uint64((1 << 63) | (1 << 56))  # present, not swapped, mapped once
_THERE = np.uint64((1 << 63) | (1 << 62))  # present, swapped
_THERE_MASKED = np.uint64(1 << 63)  # present, not swapped (mapped by others too, or not)


@dataclass(frozen=True)
class Round:
    """What one gathering round did: bytes of the windows now in huge pages (gathered, or found so
    already), windows the kernel refused, and how long it took."""

    gathered_bytes: int
    refused: int
    seconds: float
    windows_done: int  # of those chosen, in order (the rest: stopped for a fork)
    beside_workers: bool = False  # run beside short-lived workers (windows they shared)


def setting() -> str:
    """``auto``, ``on`` or ``off``, from ``PIPELOAD_HUGE_HEAP`` (an unknown value reads ``auto``)."""
    value = os.environ.get(HUGE_HEAP_ENV, "auto").strip().lower()
    if value in ("0", "off", "false", "no", "never"):
        return "off"
    if value in ("1", "on", "true", "yes", "always"):
        return "on"
    return "auto"


def kernel_gives_huge_pages() -> bool:
    """Whether transparent huge pages are on at all (``always`` or ``madvise``), 2 MiB each over
    pages of 4 KiB (what the windows here are cut for; arm64 with 64 KiB pages has 512 MiB ones)."""
    return (thp_setting(THP_SETTING) in ("always", "madvise") and pmd_huge_page_bytes() == HUGE_PAGE_BYTES
            and PAGE_BYTES == 4096)


def usable_cpus() -> int:
    return len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)


def worth_gathering(workers: int) -> bool:
    """Whether a round should run after a set of ``workers`` forked workers stopped."""
    chosen = setting()
    if chosen == "off" or not kernel_gives_huge_pages():
        return False
    # The copy takes a CPU for up to a few hundred milliseconds; where the next workers take every
    # CPU there is (2 workers on 2 CPUs), it would come out of their first batches.
    return chosen == "on" or usable_cpus() >= workers + 2


def private_anonymous_ranges(maps_text: str) -> Iterator[tuple[int, int]]:
    """(start, end) of every writable private mapping with no file behind it (the heap, Python's
    arenas, large allocations), from ``/proc/self/maps``. Stacks and shared memory are left out."""
    for line in maps_text.splitlines():
        fields = line.split()
        if len(fields) < 5 or "w" not in fields[1] or "p" not in fields[1]:
            continue
        name = " ".join(fields[5:])
        anonymous = name in ("", "[heap]") or name.startswith("[anon:")  # (named by prctl)
        if not anonymous or fields[4] != "0":  # inode 0: no file behind it
            continue
        start, end = (int(part, 16) for part in fields[0].split("-"))
        yield start, end


def aligned_windows(start: int, end: int) -> range:
    first = -(-start // HUGE_PAGE_BYTES) * HUGE_PAGE_BYTES
    last = end // HUGE_PAGE_BYTES * HUGE_PAGE_BYTES
    return range(first, max(first, last), HUGE_PAGE_BYTES)


def dense_windows(pagemap_fd: int, ranges: Iterator[tuple[int, int]], skip: Set[int] = frozenset(),
                  most: int | None = None, shared: bool = False) -> list[int]:
    """The huge-page windows of ``ranges`` whose pages are nearly all in memory and mapped by this
    process alone (``shared``: or by short-lived workers too), from ``/proc/self/pagemap`` (a
    64-bit word a page; bit 63 present, 62 swapped, 56 mapped once: none needs privilege); at most
    ``most`` of them, none of ``skip``."""
    return scan(pagemap_fd, ranges, skip, most, shared=shared).chosen


@dataclass(frozen=True)
class Scan:
    """What a scan of the page map chose, and the address to scan from next (0: from the start,
    the scan having reached the end)."""

    chosen: list[int]
    resume_at: int


def scan(pagemap_fd: int, ranges: Iterator[tuple[int, int]], skip: Set[int] = frozenset(),
         most: int | None = None, start_at: int = 0, scan_most: int | None = None,
         shared: bool = False) -> Scan:
    """``dense_windows``, from address ``start_at`` on, reading the page map of ``scan_most``
    windows at most (a large reservation never touched costs its whole page map to read:
    ~4 ms a GiB)."""
    per_window = HUGE_PAGE_BYTES // PAGE_BYTES
    least = int(per_window * DENSE_PAGES_SHARE)
    chosen: list[int] = []
    scanned = 0
    for start, end in ranges:
        if end <= start_at:
            continue
        windows = [w for w in aligned_windows(max(start, start_at), end) if w not in skip]
        for first in range(0, len(windows), SCAN_WINDOWS):
            done_choosing = most is not None and len(chosen) >= most
            if done_choosing or (scan_most is not None and scanned >= scan_most):
                return Scan(chosen[:most] if most is not None else chosen, windows[first])
            part = windows[first:first + SCAN_WINDOWS]
            counts = _dense_counts(pagemap_fd, part, per_window, shared)
            scanned += len(part)
            if counts is None:
                break  # the mapping went away meanwhile
            chosen.extend(window for window, count in zip(part, counts) if count >= least)
    return Scan(chosen if most is None else chosen[:most], 0)


def _dense_counts(pagemap_fd: int, windows: list[int], per_window: int, shared: bool) -> list[int] | None:
    """For each window, how many of its pages are present and mapped by this process alone (or,
    ``shared``, present); read in one call when the windows are consecutive, one call each
    otherwise."""
    if not windows:
        return []
    if windows[-1] - windows[0] == (len(windows) - 1) * HUGE_PAGE_BYTES:
        runs = [(windows[0], len(windows))]
    else:
        runs = [(window, 1) for window in windows]
    counts: list[int] = []
    for first, count in runs:
        try:
            raw = os.pread(pagemap_fd, count * per_window * 8, first // PAGE_BYTES * 8)
        except OSError:
            return None
        words = np.frombuffer(raw, dtype=np.uint64)
        if words.size != count * per_window:
            return None
        ours = (words & _THERE) == _THERE_MASKED if shared else (words & _OURS_ALONE) == _OURS_ALONE_MASKED
        counts += ours.reshape(count, per_window).sum(axis=1).tolist()
    return counts


def still_ours_alone(pagemap_fd: int, window: int, shared: bool = False) -> bool:
    """Whether ``window`` is still nearly all there and ours alone (``shared``: still nearly all
    there; one 4 KiB read)."""
    return bool(dense_windows(pagemap_fd, iter([(window, window + HUGE_PAGE_BYTES)]), shared=shared))


def gather(windows: list[int], pagemap_fd: int, stop: threading.Event | None = None,
           settled: list[int] | None = None, shared: bool = False) -> Round:
    """Ask the kernel for each window in huge pages, one window a call (a call holds this
    process's memory map locked while it copies), each checked just before: pages another process
    has come to share (unless ``shared``), or that were given back since the choice, are left as
    they are (and may be chosen again later). Ends early once ``stop`` is set. ``settled``
    collects the windows gathered or refused by the kernel: no later round need ask for them
    again."""
    started = time.perf_counter()
    gathered = refused = done = 0
    for window in windows:
        if stop is not None and stop.is_set():
            break
        done += 1
        if not still_ours_alone(pagemap_fd, window, shared):
            continue
        if madvise(window, HUGE_PAGE_BYTES, MADV_COLLAPSE):
            gathered += HUGE_PAGE_BYTES
        else:
            refused += 1
        if settled is not None:
            settled.append(window)
    return Round(gathered, refused, time.perf_counter() - started, done, shared)


def anonymous_bytes() -> int:
    """This process's resident private memory (``RssAnon``), or -1 where it cannot be read."""
    try:
        with open("/proc/self/status") as status:
            for line in status:
                if line.startswith("RssAnon:"):
                    return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        pass
    return -1


def windows_to_gather(skip: Set[int], most: int, start_at: int = 0) -> Scan | None:
    """Up to ``most`` windows worth gathering now, none of ``skip``, from address ``start_at``
    (``SCAN_MOST_WINDOWS`` of page map read at most); None where the page map cannot be read."""
    try:
        with open("/proc/self/maps") as maps:
            ranges = list(private_anonymous_ranges(maps.read()))
        pagemap = os.open("/proc/self/pagemap", os.O_RDONLY)
    except OSError:
        return None
    try:
        return scan(pagemap, iter(ranges), skip, most, start_at, SCAN_MOST_WINDOWS)
    finally:
        os.close(pagemap)


class HeapGatherer:
    """Chooses the windows to gather when a set of forked workers stops, gathers them on a daemon
    thread, and holds the next fork of workers while it runs (``FORK_WAITS_S`` at most).

    One per process (``GATHERER``), owned by this module; the engine calls
    ``after_workers_stopped`` and ``before_fork``, and around a set of workers that ends with its
    epoch ``before_short_lived_workers`` (the choice) and ``beside_short_lived_workers`` (the
    round); every fork of this process calls ``stop_round_beside``. The choice is made at once, in the calling
    thread (2 to 3 ms for torch's ~150 MiB; ~2 ms more per 256 MiB chosen), before the next
    epoch's workers can share the pages. It is made again at the next stop while a round left
    windows for later (``ROUND_BYTES``), then only once the process's private memory has grown by
    ``REGATHER_GROWTH_BYTES``. A kernel that refuses every window (``MADV_COLLAPSE`` is unknown
    before Linux 6.1) turns gathering off for the process.
    """

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._thread: threading.Thread | None = None
        self._unsupported = False
        self._chosen_at_bytes = -1  # RssAnon when windows were last chosen (-1: never)
        self._more_to_gather = False  # the last choice stopped at ROUND_BYTES
        self._gathered: set[int] = set()  # windows gathered or refused (a later round skips them)
        self._scan_from = 0  # where the next choice reads the page map from (see SCAN_MOST_WINDOWS)
        self._stop = threading.Event()  # the running round's: set by a fork that waited enough
        self._short_lived: set[int] = set()  # pids of workers that stop with their epoch
        self._chosen_beside: list[int] = []  # windows chosen before such a set forked
        self._beside = False  # the last round started runs beside short-lived workers
        self.rounds: list[Round] = []  # every finished round, first first

    def after_workers_stopped(self, workers: int) -> bool:
        """A set of ``workers`` forked workers has stopped: start a round if it is worth it and
        none runs; returns whether one started."""
        if self._unsupported or not worth_gathering(workers) or _exiting():
            return False
        # Not waited for: a collection while windows are chosen here may close another loader's
        # workers, whose stop comes back here in this very thread (a round is being chosen then).
        if not self._lock.acquire(blocking=False):
            return False
        try:
            return self._choose_and_start()
        finally:
            self._lock.release()

    def before_short_lived_workers(self, workers: int) -> None:
        """A set of ``workers`` workers that stop with their epoch (a map-style loader without
        persistent workers) is about to fork: if a round is due, choose its windows now, among
        those mapped by this process alone (2 to 3 ms for torch's heap), for
        ``beside_short_lived_workers`` to gather once they have forked. Chosen after the forks,
        pages shared with this process's parent or siblings (a launcher that forked it) could not
        be told from pages shared with these workers."""
        self._chosen_beside = []
        if self._unsupported or not worth_gathering(workers) or _exiting():
            return
        if not self._lock.acquire(blocking=False):
            return
        try:
            if self._due():
                self._chosen_beside = self._choose() or []
        finally:
            self._lock.release()

    def beside_short_lived_workers(self, pids: Collection[int]) -> bool:
        """The set of workers announced by ``before_short_lived_workers`` (``pids``) has forked:
        gather the windows chosen then, beside them; returns whether a round started.

        Those windows are now shared with these workers alone, which are gone at the epoch's end:
        this process holds its own copy of what is gathered (``ROUND_BYTES`` at most) until they
        exit, and the next set forks from huge pages. Not where another child lives that shares
        this process's memory (a persistent loader's workers): the copy would be held for as long
        as it lives. A fork while the round runs stops it first (``stop_round_beside``)."""
        windows, self._chosen_beside = self._chosen_beside, []
        if not windows or not self._lock.acquire(blocking=False):
            return False
        try:
            if self._thread is not None and self._thread.is_alive():
                return False
            self._short_lived = {pid for pid in self._short_lived if _alive(pid)} | set(pids)
            return self._start(self._round_beside, (windows, frozenset(self._short_lived)))
        finally:
            self._lock.release()

    def stop_round_beside(self) -> None:
        """This process is about to fork (any fork: another loader's workers, a
        ``multiprocessing.Process``, ``os.fork``): a round beside short-lived workers stops after
        the window in hand, so that no window the new child shares is gathered after it."""
        thread = self._thread
        if self._beside and thread is not None and thread.ident != threading.get_ident() and thread.is_alive():
            self._stop.set()
            thread.join()

    def _due(self) -> bool:
        """Whether windows should be chosen: never yet, some left by the last round, or the
        process grew by ``REGATHER_GROWTH_BYTES`` since; and no round runs."""
        if self._thread is not None and self._thread.is_alive():
            return False
        private = anonymous_bytes()
        grown = private >= self._chosen_at_bytes + REGATHER_GROWTH_BYTES
        return private >= 0 and (self._chosen_at_bytes < 0 or self._more_to_gather or grown)

    def _choose(self) -> list[int] | None:
        """The windows of the next round, ours alone (None: the page map cannot be read)."""
        self._chosen_at_bytes = anonymous_bytes()
        most = ROUND_BYTES // HUGE_PAGE_BYTES
        found = windows_to_gather(self._gathered, most, self._scan_from)
        if found is None:
            self._unsupported = True
            return None
        windows, self._scan_from = found.chosen, found.resume_at
        # More later: this choice stopped at its budget, or did not read the page map to its end.
        self._more_to_gather = len(windows) >= most or found.resume_at != 0
        return windows

    def _choose_and_start(self) -> bool:
        if not self._due():
            return False
        windows = self._choose()
        return bool(windows) and self._start(self._round, (windows,))

    def _start(self, target: Any, args: tuple[Any, ...]) -> bool:
        self._stop = stop = threading.Event()
        self._beside = target == self._round_beside
        thread = threading.Thread(target=target, args=(*args, stop), name="pipeload-huge-heap", daemon=True)
        try:
            thread.start()
        except RuntimeError:
            return False  # the interpreter is shutting down
        self._thread = thread
        return True

    def _round_beside(self, windows: list[int], short_lived: frozenset[int], stop: threading.Event) -> None:
        """A round beside short-lived workers, unless another child shares this process's pages
        (then the windows are left for a later round)."""
        if forked_children() - short_lived:
            self._more_to_gather = True
            return
        self._round(windows, stop, shared=True)

    def before_fork(self) -> None:
        """This process is about to fork a worker: let a running round end first (for
        ``FORK_WAITS_S`` at most, then stop it after its window in hand). Gathered while the
        child shares them, its pages would be copied for this process alone."""
        thread = self._thread
        if thread is None or thread.ident == threading.get_ident():
            return
        thread.join(FORK_WAITS_S)
        if thread.is_alive():
            self._stop.set()
            thread.join()

    def wait(self, timeout: float | None = None) -> Round | None:
        """Wait for a running round to end; the last finished round (None if none ran)."""
        thread = self._thread
        if thread is not None:
            thread.join(timeout)
        return self.rounds[-1] if self.rounds else None

    def forget_in_child(self) -> None:
        """In a forked child: the round (if any) ran in its parent; start afresh."""
        self.__init__()  # type: ignore[misc]

    def _round(self, windows: list[int], stop: threading.Event, shared: bool = False) -> None:
        try:
            pagemap = os.open("/proc/self/pagemap", os.O_RDONLY)
        except OSError:
            self._unsupported = True
            return
        settled: list[int] = []
        try:
            result = gather(windows, pagemap, stop, settled, shared)
        finally:
            os.close(pagemap)
        if result.gathered_bytes == 0 and result.refused:
            self._unsupported = True  # the kernel refused every window it was asked for
        self._gathered.update(settled)
        if len(settled) < len(windows):
            self._more_to_gather = True  # stopped for a fork, or some were shared: at a next stop
        self.rounds.append(result)


def forked_children() -> set[int]:
    """The pids of this process's living children that share its memory: forked, not started
    over with a new program (a fork server, a resource tracker, a subprocess). Read from each
    process's ``/proc/PID/stat`` (a few milliseconds on a machine of a thousand processes): a
    forked child keeps its parent's addresses, where a new program's heap and arguments lie
    elsewhere (where addresses are not randomised, every child counts)."""
    me = os.getpid()
    mine = _stat_fields(me)
    children: set[int] = set()
    try:
        names = os.listdir("/proc")
    except OSError:
        return children
    for name in names:
        if not name.isdigit():
            continue
        fields = _stat_fields(int(name))
        if fields is None or len(fields) <= _ARG_START or int(fields[_PARENT]) != me or fields[0] in (b"Z", b"X"):
            continue
        where = fields[_BRK_START:_ARG_START + 1]
        if mine is None or where == mine[_BRK_START:_ARG_START + 1] or not any(int(f) for f in where):
            children.add(int(name))
    return children


# /proc/PID/stat after the command's closing parenthesis: state, parent, ..., the heap's start
# (field 47 of the whole line) and the arguments' (48).
_PARENT, _BRK_START, _ARG_START = 1, 44, 45


def _stat_fields(pid: int) -> list[bytes] | None:
    try:
        with open(f"/proc/{pid}/stat", "rb") as stat:
            return stat.read().rsplit(b")", 1)[1].split()
    except (OSError, IndexError):
        return None  # gone meanwhile


def _alive(pid: int) -> bool:
    return os.path.exists(f"/proc/{pid}")


def _exiting() -> bool:
    """The interpreter is on its way out (an iterator closed by ``weakref.finalize``'s exit hook
    comes before ``sys.is_finalizing()`` says so, once the main thread has ended)."""
    return sys.is_finalizing() or not threading.main_thread().is_alive()


GATHERER = HeapGatherer()
if hasattr(os, "register_at_fork"):
    # A child forked while the parent chose windows would inherit the lock taken.
    os.register_at_fork(before=lambda: GATHERER.stop_round_beside(),
                        after_in_child=lambda: GATHERER.forget_in_child())
