"""The main process's memory gathered into huge pages between sets of forked workers: which
windows are chosen (there, ours alone), that gathering keeps every byte, and when a loader asks."""

from __future__ import annotations

import ctypes
import mmap
import os

import pytest
import torch

import pipeload
from pipeload.engine import huge_heap
from pipeload.engine.lifecycle import wait_for_reaped
from pipeload.engine.huge_heap import (
    HUGE_PAGE_BYTES,
    HeapGatherer,
    aligned_windows,
    dense_windows,
    forked_children,
    gather,
    private_anonymous_ranges,
    scan,
    still_ours_alone,
    worth_gathering,
)

PAGE = mmap.PAGESIZE

MAPS = """\
55d0c0a00000-55d0c5e00000 rw-p 00000000 00:00 0                          [heap]
7f1200000000-7f1200800000 rw-p 00000000 00:00 0 
7f1300000000-7f1300400000 rw-p 00000000 00:00 0                          [anon: glibc: malloc arena]
7f1400000000-7f1400400000 rw-s 00000000 00:01 4242                       /memfd:pipeload-batch (deleted)
7f1500000000-7f1500400000 r--p 00000000 08:01 1234                       /usr/lib/libtorch_cpu.so
7f1600000000-7f1600400000 rw-p 00100000 08:01 1234                       /usr/lib/libtorch_cpu.so
7f1700000000-7f1700400000 ---p 00000000 00:00 0 
7ffd00000000-7ffd00800000 rw-p 00000000 00:00 0                          [stack]
"""


def test_only_private_writable_memory_without_a_file_is_considered():
    assert list(private_anonymous_ranges(MAPS)) == [
        (0x55D0C0A00000, 0x55D0C5E00000),
        (0x7F1200000000, 0x7F1200800000),
        (0x7F1300000000, 0x7F1300400000),
    ]


def test_windows_are_whole_huge_pages_inside_the_range():
    assert list(aligned_windows(HUGE_PAGE_BYTES + 1, 4 * HUGE_PAGE_BYTES - 1)) == [2 * HUGE_PAGE_BYTES]
    assert list(aligned_windows(0, HUGE_PAGE_BYTES - 1)) == []


class _Anonymous:
    """A private anonymous mapping holding at least two whole huge-page windows."""

    def __init__(self) -> None:
        self.memory = mmap.mmap(-1, 4 * HUGE_PAGE_BYTES, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
        self.start = ctypes.addressof(ctypes.c_char.from_buffer(self.memory))
        self.windows = list(aligned_windows(self.start, self.start + len(self.memory)))
        assert len(self.windows) >= 2

    def touch(self, window: int, pages: int, value: int = 1) -> None:
        offset = window - self.start
        for page in range(pages):
            self.memory[offset + page * PAGE] = value

    def chosen(self, most: int | None = None) -> list[int]:
        with _pagemap() as pagemap:
            return dense_windows(pagemap, iter([(self.start, self.start + len(self.memory))]), most=most)


class _pagemap:
    def __enter__(self) -> int:
        self.fd = os.open("/proc/self/pagemap", os.O_RDONLY)
        return self.fd

    def __exit__(self, *exc_info: object) -> None:
        os.close(self.fd)


@pytest.fixture
def anonymous():
    mapping = _Anonymous()
    yield mapping
    mapping.memory.close()


def test_a_window_is_chosen_when_nearly_all_its_pages_are_there(anonymous):
    full, half = anonymous.windows[:2]
    anonymous.touch(full, HUGE_PAGE_BYTES // PAGE)
    anonymous.touch(half, HUGE_PAGE_BYTES // PAGE // 2)
    assert anonymous.chosen() == [full]  # gathering the half-empty one would add 1 MiB
    anonymous.touch(half, HUGE_PAGE_BYTES // PAGE)
    assert anonymous.chosen(most=1) == [full]  # a round's budget


class _SharingChild:
    """A forked child that keeps this process's pages shared until it is let go."""

    def __enter__(self) -> None:
        go_on, self.hold = os.pipe()
        self.pid = os.fork()
        if self.pid == 0:
            os.close(self.hold)
            os.read(go_on, 1)
            os._exit(0)
        os.close(go_on)

    def __exit__(self, *exc_info: object) -> None:
        os.close(self.hold)
        os.waitpid(self.pid, 0)


def test_a_window_a_child_still_shares_is_not_chosen_until_it_is_gone(anonymous):
    window = anonymous.windows[0]
    anonymous.touch(window, HUGE_PAGE_BYTES // PAGE)
    with _SharingChild():
        assert anonymous.chosen() == []  # gathering it would copy it for this process alone
    assert anonymous.chosen() == [window]


def test_a_window_chosen_then_shared_or_given_back_is_left_as_it_is(anonymous):
    shared, given_back = anonymous.windows[:2]
    for window in (shared, given_back):
        anonymous.touch(window, HUGE_PAGE_BYTES // PAGE)
    assert anonymous.chosen() == [shared, given_back]
    anonymous.memory.madvise(mmap.MADV_DONTNEED, given_back - anonymous.start, HUGE_PAGE_BYTES // 2)
    settled: list[int] = []
    with _pagemap() as pagemap, _SharingChild():
        assert not still_ours_alone(pagemap, shared) and not still_ours_alone(pagemap, given_back)
        done = gather([shared, given_back], pagemap, settled=settled)
    assert (done.gathered_bytes, done.refused) == (0, 0)  # nothing copied, nothing filled in again
    assert settled == []  # both may be chosen again once they are ours alone and whole


def test_a_choice_reads_a_bounded_share_of_the_page_map_and_the_next_goes_on_from_there():
    first, second = _Anonymous(), _Anonymous()
    try:
        for mapping in (first, second):
            mapping.touch(mapping.windows[0], HUGE_PAGE_BYTES // PAGE)
        ranges = sorted([(m.start, m.start + len(m.memory)) for m in (first, second)])
        low, high = (first, second) if first.start < second.start else (second, first)
        with _pagemap() as pagemap:
            part = scan(pagemap, iter(ranges), scan_most=1)  # a huge reservation: stop reading
            assert part.chosen == [low.windows[0]] and part.resume_at == high.windows[0]
            rest = scan(pagemap, iter(ranges), start_at=part.resume_at, scan_most=1)
            assert rest.chosen == [high.windows[0]] and rest.resume_at == 0  # the end: start over
    finally:
        first.memory.close()
        second.memory.close()


def test_a_stop_that_comes_back_while_windows_are_chosen_never_waits(gatherer):
    # A collection while windows are chosen can close another loader's workers, whose stop calls
    # back into the gatherer from the same thread: it must not wait for itself.
    with gatherer._lock:
        assert gatherer.after_workers_stopped(1) is False


def test_gathering_a_window_puts_it_in_a_huge_page_and_keeps_every_byte(anonymous):
    window = anonymous.windows[0]
    offset = window - anonymous.start
    pattern = bytes(range(256)) * (HUGE_PAGE_BYTES // 256)
    anonymous.memory[offset:offset + HUGE_PAGE_BYTES] = pattern
    if not huge_heap.kernel_gives_huge_pages():
        pytest.skip("transparent huge pages are off on this machine")
    with _pagemap() as pagemap:
        done = gather([window], pagemap)
    if done.refused:
        pytest.skip("this kernel cannot gather on request (MADV_COLLAPSE, Linux 6.1)")
    assert done.gathered_bytes == HUGE_PAGE_BYTES
    assert anonymous.memory[offset:offset + HUGE_PAGE_BYTES] == pattern
    assert _huge_kib_of_mapping(anonymous.start) >= HUGE_PAGE_BYTES // 1024


def _huge_kib_of_mapping(address: int) -> int:
    inside = False
    with open("/proc/self/smaps") as smaps:
        for line in smaps:
            head = line.split()[0]
            if "-" in head and ":" not in head:
                start, end = (int(part, 16) for part in head.split("-"))
                inside = start <= address < end
            elif inside and line.startswith("AnonHugePages:"):
                return int(line.split()[1])
    raise AssertionError("mapping not found")


def test_auto_gathers_only_with_a_cpu_to_spare_and_off_never(monkeypatch):
    if not huge_heap.kernel_gives_huge_pages():
        pytest.skip("transparent huge pages are off on this machine")
    cpus = huge_heap.usable_cpus()
    monkeypatch.setenv(huge_heap.HUGE_HEAP_ENV, "auto")
    assert not worth_gathering(cpus - 1)  # the workers and the main process take every CPU
    assert worth_gathering(cpus - 2) == (cpus - 2 >= 0)
    monkeypatch.setenv(huge_heap.HUGE_HEAP_ENV, "on")
    assert worth_gathering(cpus)
    monkeypatch.setenv(huge_heap.HUGE_HEAP_ENV, "off")
    assert not worth_gathering(0)


class _Numbers(pipeload.Dataset):
    def __len__(self) -> int:
        return 64

    def __getitem__(self, index: int) -> torch.Tensor:
        return torch.full((256,), float(index))


def _epoch(loader: pipeload.DataLoader) -> list[torch.Tensor]:
    return [batch.clone() for batch in loader]


@pytest.fixture
def gatherer(monkeypatch):
    """A fresh gatherer in the engine's place, gathering whatever the CPUs (``on``)."""
    fresh = HeapGatherer()
    monkeypatch.setattr(huge_heap, "GATHERER", fresh)
    monkeypatch.setenv(huge_heap.HUGE_HEAP_ENV, "on")
    if not huge_heap.kernel_gives_huge_pages():
        pytest.skip("transparent huge pages are off on this machine")
    return fresh


def test_a_per_epoch_loader_gathers_beside_its_first_workers_and_batches_stay_the_same(gatherer):
    loader = pipeload.DataLoader(_Numbers(), batch_size=8, num_workers=2,
                                 multiprocessing_context="fork")
    iterator = iter(loader)
    first = [next(iterator).clone()]
    # Started while the epoch's workers live: their reaping comes once the next set has forked.
    assert gatherer._thread is not None
    assert {worker.pid for worker in iterator._workers} <= gatherer._short_lived
    first += [batch.clone() for batch in iterator]
    del iterator
    gatherer.wait()
    assert gatherer.rounds[0].beside_workers
    assert wait_for_reaped(5.0)  # the workers are reaped beside the loop; the round starts then
    done = gatherer.wait()
    # One round beside the workers; a heap above ROUND_BYTES (a whole test session's) that it
    # left windows of goes on at their reaping, in a round of its own (the suite met one).
    assert done is not None and not any(r.beside_workers for r in gatherer.rounds[1:])
    gathered = sum(r.gathered_bytes for r in gatherer.rounds)
    if all(r.refused for r in gatherer.rounds) and not gathered:
        pytest.skip("this kernel cannot gather on request (MADV_COLLAPSE, Linux 6.1)")
    assert gathered > 0
    second = _epoch(loader)
    assert all(torch.equal(a, b) for a, b in zip(first, second, strict=True))
    assert torch.equal(torch.cat(second)[:, 0], torch.arange(64, dtype=torch.float32))
    # Rounds go on at each stop while one left windows for later (a heap above ROUND_BYTES, as a
    # whole test session's); then, the heap not having grown, none is chosen again.
    for _ in range(10):
        assert wait_for_reaped(5.0)
        gatherer.wait()
        if not gatherer._more_to_gather:
            break
        _epoch(loader)
    assert wait_for_reaped(5.0)
    rounds = len(gatherer.rounds)
    _epoch(loader)
    assert wait_for_reaped(5.0)
    gatherer.wait()
    assert len(gatherer.rounds) == rounds and not gatherer._more_to_gather


def test_windows_are_chosen_again_once_the_process_has_grown(monkeypatch):
    gatherer = HeapGatherer()
    monkeypatch.setenv(huge_heap.HUGE_HEAP_ENV, "on")
    if not huge_heap.kernel_gives_huge_pages():
        pytest.skip("transparent huge pages are off on this machine")
    assert gatherer.after_workers_stopped(1)
    gatherer.wait()
    for _ in range(20):  # a heap above ROUND_BYTES (a whole test session's) takes several rounds
        if not gatherer._more_to_gather:
            break
        assert gatherer.after_workers_stopped(1)
        gatherer.wait()
    assert not gatherer.after_workers_stopped(1)
    grown = torch.ones((huge_heap.REGATHER_GROWTH_BYTES + (16 << 20)) // 4)  # touched: resident
    assert gatherer.after_workers_stopped(1)
    gatherer.wait()
    del grown


def test_the_next_fork_waits_for_a_running_round_and_no_page_is_copied_for_the_main_process(gatherer):
    held = torch.ones(128 << 18)  # 128 MiB in the main process, as a dataset held in memory
    per_epoch = pipeload.DataLoader(_Numbers(), batch_size=8, num_workers=2, multiprocessing_context="fork")
    _epoch(per_epoch)  # a round beside its workers; they stop: another once they are reaped
    assert wait_for_reaped(5.0)
    alone = _private_bytes()
    persistent = pipeload.DataLoader(_Numbers(), batch_size=8, num_workers=2, persistent_workers=True,
                                     multiprocessing_context="fork")
    iterator = iter(persistent)  # forks at once, while the round may still run
    next(iterator)
    assert not gatherer._thread.is_alive()  # the round the stop started had ended first
    # The held tensor's pages are shared with the persistent workers now, not copied for the main
    # process by a round that went on after they were forked.
    assert _private_bytes() < alone - (96 << 20)
    del iterator, held


def _private_bytes() -> int:
    with open("/proc/self/smaps_rollup") as rollup:
        fields = dict(line.split(":", 1) for line in rollup if ":" in line)
    return sum(int(fields[name].split()[0]) * 1024 for name in ("Private_Clean", "Private_Dirty"))


def test_a_thread_loader_and_off_never_start_a_round(monkeypatch):
    gatherer = HeapGatherer()
    monkeypatch.setattr(huge_heap, "GATHERER", gatherer)
    monkeypatch.setenv(huge_heap.HUGE_HEAP_ENV, "off")
    _epoch(pipeload.DataLoader(_Numbers(), batch_size=8, num_workers=2, multiprocessing_context="fork"))
    assert wait_for_reaped(5.0)  # its stop has been told, under "off"
    monkeypatch.setenv(huge_heap.HUGE_HEAP_ENV, "on")
    _epoch(pipeload.DataLoader(_Numbers(), batch_size=8, num_workers=2, worker_type="thread"))
    assert gatherer.wait() is None and gatherer.rounds == []


def test_no_round_runs_beside_per_epoch_workers_while_a_persistent_loaders_workers_live(gatherer):
    persistent = pipeload.DataLoader(_Numbers(), batch_size=8, num_workers=1, persistent_workers=True,
                                     multiprocessing_context="fork")
    iterator = iter(persistent)
    next(iterator)  # its worker shares every page for as long as the loader lives
    _epoch(pipeload.DataLoader(_Numbers(), batch_size=8, num_workers=2, multiprocessing_context="fork"))
    assert wait_for_reaped(5.0)
    gatherer.wait()
    # (Memory allocated since the persistent worker forked is ours alone: a stop may gather it.)
    assert not any(done.beside_workers for done in gatherer.rounds)
    del iterator


def test_forked_children_are_the_living_children_of_this_process():
    reader, writer = os.pipe()
    pid = os.fork()
    if pid == 0:  # waits until told, then leaves
        os.close(writer)
        os.read(reader, 1)
        os._exit(0)
    os.close(reader)
    try:
        assert pid in forked_children() and os.getpid() not in forked_children()
    finally:
        os.close(writer)
        os.waitpid(pid, 0)
    assert pid not in forked_children()


def test_memory_shared_with_the_process_that_forked_this_one_is_not_gathered_beside_workers(gatherer):
    # A training rank forked by a launcher that holds a dataset shares those pages with it: a
    # copy gathered for the rank would be held for good.
    held = torch.ones(64 << 18)  # 64 MiB, shared with the child below from its first instant
    reader, writer = os.pipe()
    pid = os.fork()
    if pid == 0:  # the rank: one epoch of a per-epoch loader, then say how its memory grew
        code = 1
        try:
            os.close(reader)
            before = _private_bytes()
            _epoch(pipeload.DataLoader(_Numbers(), batch_size=8, num_workers=2, multiprocessing_context="fork"))
            wait_for_reaped(5.0)
            gatherer.wait()
            beside = [done for done in gatherer.rounds if done.beside_workers]
            os.write(writer, f"{_private_bytes() - before} {len(beside)}".encode())
            code = 0
        finally:
            os._exit(code)
    os.close(writer)
    try:
        grown, rounds = (int(part) for part in os.read(reader, 100).split())
    finally:
        os.close(reader)
        _, status = os.waitpid(pid, 0)
    assert os.waitstatus_to_exitcode(status) == 0
    assert grown < (24 << 20)  # not the 64 MiB held (the rank's own new pages may be gathered)
    del held


def test_a_fork_while_a_round_runs_beside_workers_stops_it_first(gatherer):
    held = torch.ones(256 << 18)  # 256 MiB: a round of ROUND_BYTES, long enough to fork during it
    loader = pipeload.DataLoader(_Numbers(), batch_size=8, num_workers=2, multiprocessing_context="fork")
    iterator = iter(loader)
    next(iterator)
    thread = gatherer._thread
    if thread is None or not thread.is_alive():
        pytest.skip("the round ended before the fork (the kernel gathered faster than the loop)")
    pid = os.fork()  # as a multiprocessing.Process or another library would
    if pid == 0:
        os._exit(0)
    try:
        assert gatherer._stop.is_set() and not thread.is_alive()  # stopped before the child was made
    finally:
        os.waitpid(pid, 0)
    list(iterator)
    del iterator, held
