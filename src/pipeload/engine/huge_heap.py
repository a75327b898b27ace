"""The main process's own memory in huge pages, so that forking the next workers costs less.

A fork copies the parent's page table entry by entry and takes a reference on every private page
it maps; the child's exit drops them again. With torch imported, the main process holds ~150 MiB
of private memory (its heap and Python's arenas, ~37,000 pages of 4 KiB), and one fork plus the
child's exit cost 6 to 10 ms on the development box, in the main process, one fork after another.
A loader without persistent workers pays that for every worker at every epoch, before any batch
is built: 8 workers, ~50 ms an epoch. Where the same memory lies in 2 MiB pages, the fork copies
one entry per 2 MiB: measured there, 9.6 ms fell to 2.6 ms per fork and exit (``bench.worker_churn
--huge-heap on``).

Linux (6.1 and later) lets a process gather its populated memory into huge pages on request
(``MADV_COLLAPSE``): the kernel copies each 2 MiB window into a huge page, without changing a byte
of what it holds. That copy costs ~20 to 300 ms for the whole heap (it varies with how readily the
kernel finds free huge pages), so it is done once, by a short-lived thread that releases the GIL in
the kernel, when a set of forked workers has stopped: a process that forks workers once forks them
again (the next epoch of a loader without persistent workers, the next loader). The round goes on
while the next workers start: stopping it at their fork would stop it for good in a loop that
starts the next epoch at once.

Only windows whose pages are nearly all there, and mapped by this process alone when the set
stops, are gathered: the resident set grows by a few pages at most, and no page that another
process still shares (the workers of a persistent loader, say) is copied for this one. Workers
forked while a round runs keep the small pages they were forked with, freed when they exit.

``PIPELOAD_HUGE_HEAP``: ``auto`` (the default) gathers where the kernel has transparent huge pages
(not ``never``) and the machine has a CPU to spare beside the workers; ``on`` gathers wherever the
kernel can; ``off`` never does.
"""

from __future__ import annotations

import os
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass

import numpy as np

from pipeload.transport.slab_memory import madvise

HUGE_HEAP_ENV = "PIPELOAD_HUGE_HEAP"
MADV_COLLAPSE = 25  # Linux 6.1
THP_SETTING = "/sys/kernel/mm/transparent_hugepage/enabled"
HUGE_PAGE_BYTES = 2 << 20  # x86-64 and arm64 (4 KiB base pages) PMD size
PAGE_BYTES = os.sysconf("SC_PAGE_SIZE") if hasattr(os, "sysconf") else 4096
DENSE_PAGES_SHARE = 0.875  # a window with more holes than this would grow the resident set
REGATHER_GROWTH_BYTES = 64 << 20  # private memory grown by this much since: choose again
ROUND_BYTES = 4 << 30  # at most this much copied a round: a dataset held in memory waits its turn
SCAN_WINDOWS = 512  # windows read from the page map at a time (2 MiB of it)
_OURS_ALONE = np.uint64((1 << 63) | (1 << 62) | (1 << 56))  # present, swapped, mapped once
_OURS_ALONE_MASKED = np.uint64((1 << 63) | (1 << 56))  # present, not swapped, mapped once


@dataclass(frozen=True)
class Round:
    """What one gathering round did: bytes of the windows now in huge pages (gathered, or found so
    already), windows the kernel refused, and how long it took."""

    gathered_bytes: int
    refused: int
    seconds: float


def setting() -> str:
    """``auto``, ``on`` or ``off``, from ``PIPELOAD_HUGE_HEAP`` (an unknown value reads ``auto``)."""
    value = os.environ.get(HUGE_HEAP_ENV, "auto").strip().lower()
    if value in ("0", "off", "false", "no", "never"):
        return "off"
    if value in ("1", "on", "true", "yes", "always"):
        return "on"
    return "auto"


def kernel_gives_huge_pages() -> bool:
    """Whether transparent huge pages are on at all (``always`` or ``madvise``)."""
    try:
        with open(THP_SETTING) as file:
            text = file.read()
    except OSError:
        return False
    return "[never]" not in text and "[" in text


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


def dense_windows(pagemap_fd: int, ranges: Iterator[tuple[int, int]]) -> list[int]:
    """The huge-page windows of ``ranges`` whose pages are nearly all in memory and mapped by this
    process alone, from ``/proc/self/pagemap`` (a 64-bit word a page; bit 63 present, 62 swapped,
    56 mapped once: none needs privilege)."""
    per_window = HUGE_PAGE_BYTES // PAGE_BYTES
    least = int(per_window * DENSE_PAGES_SHARE)
    chosen: list[int] = []
    for start, end in ranges:
        windows = aligned_windows(start, end)
        for first in range(0, len(windows), SCAN_WINDOWS):
            part = windows[first:first + SCAN_WINDOWS]
            try:
                words = np.frombuffer(os.pread(pagemap_fd, len(part) * per_window * 8,
                                               part.start // PAGE_BYTES * 8), dtype=np.uint64)
            except OSError:
                break
            if words.size != len(part) * per_window:
                break  # the mapping went away meanwhile
            ours = (words & _OURS_ALONE) == _OURS_ALONE_MASKED
            counts = ours.reshape(len(part), per_window).sum(axis=1)
            chosen.extend(window for window, count in zip(part, counts.tolist()) if count >= least)
    return chosen


def gather(windows: list[int], budget: int = ROUND_BYTES) -> Round:
    """Ask the kernel for each window in huge pages, one window a call: a call holds this
    process's memory map locked while it copies, and a fork waits for one window at most."""
    started = time.perf_counter()
    gathered = refused = 0
    for window in windows:
        if gathered >= budget:
            break
        if madvise(window, HUGE_PAGE_BYTES, MADV_COLLAPSE):
            gathered += HUGE_PAGE_BYTES
        else:
            refused += 1
    return Round(gathered, refused, time.perf_counter() - started)


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


def windows_to_gather() -> list[int] | None:
    """Every window worth gathering now, or None where the page map cannot be read."""
    try:
        with open("/proc/self/maps") as maps:
            ranges = list(private_anonymous_ranges(maps.read()))
        pagemap = os.open("/proc/self/pagemap", os.O_RDONLY)
    except OSError:
        return None
    try:
        return dense_windows(pagemap, iter(ranges))
    finally:
        os.close(pagemap)


class HeapGatherer:
    """Chooses the windows to gather when a set of forked workers stops, and gathers them on a
    daemon thread.

    One per process (``GATHERER``), owned by this module; the engine calls
    ``after_workers_stopped``. The choice is made at once, in the calling thread (2 to 3 ms for
    torch's ~150 MiB): the next epoch's workers may be forked a moment later, and pages they share
    are no longer this process's alone. It is made again only once the process's private memory
    has grown by ``REGATHER_GROWTH_BYTES`` (a dataset loaded since, say). A kernel that refuses
    every window (``MADV_COLLAPSE`` is unknown before Linux 6.1) turns gathering off for the
    process.
    """

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._thread: threading.Thread | None = None
        self._unsupported = False
        self._chosen_at_bytes = -1  # RssAnon when windows were last chosen (-1: never)
        self.rounds: list[Round] = []  # every finished round, first first

    def after_workers_stopped(self, workers: int) -> bool:
        """A set of ``workers`` forked workers has stopped: start a round if it is worth it and
        none runs; returns whether one started."""
        if self._unsupported or not worth_gathering(workers):
            return False
        with self._lock:
            if self._thread is not None and self._thread.is_alive():
                return False
            private = anonymous_bytes()
            if private < 0 or (self._chosen_at_bytes >= 0
                               and private < self._chosen_at_bytes + REGATHER_GROWTH_BYTES):
                return False
            self._chosen_at_bytes = private
            windows = windows_to_gather()
            if windows is None:
                self._unsupported = True
                return False
            if not windows:
                return False
            self._thread = threading.Thread(target=self._round, args=(windows,),
                                            name="pipeload-huge-heap", daemon=True)
            self._thread.start()
        return True

    def wait(self, timeout: float | None = None) -> Round | None:
        """Wait for a running round to end; the last finished round (None if none ran)."""
        thread = self._thread
        if thread is not None:
            thread.join(timeout)
        return self.rounds[-1] if self.rounds else None

    def forget_in_child(self) -> None:
        """In a forked child: the round (if any) ran in its parent; start afresh."""
        self.__init__()  # type: ignore[misc]

    def _round(self, windows: list[int]) -> None:
        result = gather(windows)
        if result.gathered_bytes == 0:
            self._unsupported = True  # the kernel refused every window: it cannot do it
        self.rounds.append(result)


GATHERER = HeapGatherer()
if hasattr(os, "register_at_fork"):
    # A child forked while the parent chose windows would inherit the lock taken.
    os.register_at_fork(after_in_child=lambda: GATHERER.forget_in_child())
