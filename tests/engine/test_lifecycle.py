"""Launches: what the parent does before a fork."""

from __future__ import annotations

import multiprocessing
import platform
import re
import time

import pytest

from pipeload.engine import lifecycle


def _anonymous_mib() -> float:
    with open("/proc/self/smaps_rollup") as rollup:
        return int(re.search(r"^Anonymous:\s+(\d+) kB", rollup.read(), re.M).group(1)) / 1024


@pytest.mark.skipif(platform.libc_ver()[0] != "glibc", reason="malloc_trim is glibc's")
def test_release_free_heap_gives_freed_heap_pages_back():
    # Blocks under glibc's mmap threshold live in the heap; small ones kept between them stop
    # the heap's top from shrinking on its own when the large ones are freed.
    blocks, keepers = [], []
    for _ in range(512):
        blocks.append(bytearray(100_000))  # written: resident
        keepers.append(bytearray(64))
    held = _anonymous_mib()
    del blocks
    lifecycle.release_free_heap()
    assert _anonymous_mib() < held - 24
    del keepers


class _Recorder:
    def __init__(self, events: list[str]) -> None:
        self.events = events

    def __call__(self) -> None:
        self.events.append("trim")


class _FakeContext:
    """Stands in for a multiprocessing context: records trims and starts instead of forking."""

    def __init__(self, method: str, events: list[str]) -> None:
        self.method, self.events = method, events

    def get_start_method(self) -> str:
        return self.method

    def Process(self, **kwargs):  # noqa: N802 (multiprocessing's name)
        events = self.events

        class _Started:
            def start(self) -> None:
                events.append("start")

        return _Started()


@pytest.mark.parametrize("method, expected", [("fork", ["trim", "start"]),
                                              ("spawn", ["start"]), ("forkserver", ["start"])])
def test_only_a_fork_gives_the_free_heap_back_first(monkeypatch, method, expected):
    # A forked worker would map the free pages too; a spawned one inherits nothing.
    events: list[str] = []
    monkeypatch.setattr(lifecycle, "release_free_heap", _Recorder(events))
    lifecycle.start_process(_FakeContext(method, events), time.sleep, (0,), "w")
    assert events == expected


def test_a_forked_worker_still_starts_and_ends():
    process = lifecycle.start_process(multiprocessing.get_context("fork"), time.sleep, (0,), "w")
    process.join(10)
    assert process.exitcode == 0
