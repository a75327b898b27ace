"""A pipe that asks for a process of its own (``is_separate_process()``) gets one inside each
process worker too: the worker, a daemon, starts it (multiprocessing's no-children rule is lifted
for that start only, since the process leaves when its parent dies). Nothing is left behind when a
worker or the main process is killed."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import textwrap
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from conftest import LeakGuard, gone_or_fail, pid_gone, wait_until
from pipes_for_tests import add_one

import pipeload
from pipeload.datapipes import IterDataPipe
from pipeload.datapipes.iter import IterableWrapper
from pipeload.errors import WorkerDiedError

pytestmark = pytest.mark.timeout(120)
GONE_S = 10.0  # how long a process whose parent died may take to notice (on a loaded box)


class OwnProcess(IterDataPipe):
    """Asks for a process of its own; yields (its pid, its parent's pid, item)."""

    def __init__(self, source: Any) -> None:
        self.source = source

    def is_separate_process(self) -> bool:
        return True

    def __iter__(self) -> Iterator[tuple[int, int, Any]]:
        for item in self.source:
            yield os.getpid(), os.getppid(), item


@pytest.mark.parametrize("context", ["fork", pytest.param("forkserver", marks=pytest.mark.slow),
                                     pytest.param("spawn", marks=pytest.mark.slow)])
def test_each_process_worker_starts_the_process_a_pipe_asks_for(context: str, leak_guard: LeakGuard) -> None:
    pipe = OwnProcess(IterableWrapper(range(20)).sharding_filter())
    loader = pipeload.DataLoader(pipe, batch_size=None, num_workers=2, multiprocessing_context=context)
    seen = list(loader)
    assert sorted(item for _, _, item in seen) == list(range(20))
    producers = {(pid, parent) for pid, parent, _ in seen}
    assert len(producers) == 2  # one for each worker's copy of the graph
    assert all(parent != os.getpid() for _, parent in producers)  # started in the workers, not here
    assert loader.stats().separate_processes == (
        "OwnProcess: its own process (a process boundary after it) (one for each process worker's copy)",)


@pytest.mark.parametrize("persistent", [False, True], ids=["classic", "persistent"])
def test_an_epoch_left_early_stops_the_separate_processes(persistent: bool, leak_guard: LeakGuard) -> None:
    """Leaving an epoch stops each worker's run and its process; persistent workers keep their
    run until the next epoch replaces it (so processes never pile up), or the loader goes."""
    pipe = OwnProcess(IterableWrapper(range(10**6)).sharding_filter())
    loader = pipeload.DataLoader(pipe, batch_size=None, num_workers=2, persistent_workers=persistent)
    before: set[int] = set()
    for _ in range(3):
        producers = set()
        for producer, _, _ in loader:
            producers.add(producer)
            if len(producers) == 2:
                break
        stopped = before if persistent else producers
        assert wait_until(lambda: all(pid_gone(pid) for pid in stopped), GONE_S)  # noqa: B023
        before = producers
    del loader


@pytest.mark.timeout(60)
def test_a_process_boundary_behind_a_thread_boundary_in_a_worker_starts(leak_guard: LeakGuard) -> None:
    # The boundary's process is started from the worker's helper thread: the worker had the
    # process-start lock as its parent held it (owned by the forking thread), and that thread
    # waited for it for ever (stop 54's review of the lock).
    from pipeload.datapipes.boundary.pipes import QueueBoundary

    inner = QueueBoundary(IterableWrapper(range(4)).map(add_one), "process", 2, "fork")
    loader = pipeload.DataLoader(QueueBoundary(inner, "thread", 2), batch_size=None, num_workers=1,
                                 multiprocessing_context="fork", timeout=20)
    assert list(loader) == [1, 2, 3, 4]


def test_killing_a_worker_ends_its_separate_process_too(leak_guard: LeakGuard) -> None:
    pipe = OwnProcess(IterableWrapper(range(10**6)).sharding_filter())
    iterator = iter(pipeload.DataLoader(pipe, batch_size=None, num_workers=2))
    producer, worker, _ = next(iterator)
    os.kill(worker, signal.SIGKILL)
    with pytest.raises(WorkerDiedError):
        for _ in iterator:
            pass
    assert wait_until(lambda: pid_gone(producer), GONE_S), "the separate process outlived its worker"


_DRIVER = textwrap.dedent(
    """
    import json, os, signal, sys
    import pipeload
    from pipeload.datapipes import IterDataPipe
    from pipeload.datapipes.iter import IterableWrapper

    class OwnProcess(IterDataPipe):
        def __init__(self, source):
            self.source = source

        def is_separate_process(self):
            return True

        def __iter__(self):
            for item in self.source:
                yield os.getpid(), os.getppid(), item

    if __name__ == "__main__":
        pipe = OwnProcess(IterableWrapper(range(10**6)).sharding_filter())
        iterator = iter(pipeload.DataLoader(pipe, batch_size=None, num_workers=2))
        pids = set()
        while len(pids) < 4:  # both workers and both of their separate processes
            producer, worker, _ = next(iterator)
            pids |= {producer, worker}
        with open(sys.argv[1] + ".tmp", "w") as out:
            json.dump(sorted(pids), out)
        os.replace(sys.argv[1] + ".tmp", sys.argv[1])
        signal.pause()  # the test kills us
    """
)


def test_killing_the_main_process_ends_the_workers_and_their_separate_processes(tmp_path: Path) -> None:
    script, pid_file = tmp_path / "driver.py", tmp_path / "pids.json"
    script.write_text(_DRIVER)
    driver = subprocess.Popen([sys.executable, str(script), str(pid_file)],
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        if not wait_until(lambda: pid_file.exists() or driver.poll() is not None, 60.0) or driver.poll() is not None:
            pytest.fail(f"the driver never published its pids: {driver.communicate(timeout=10)}")
        pids = json.loads(pid_file.read_text())
    finally:
        driver.kill()
        driver.communicate()
    gone_or_fail(pids, GONE_S, "workers and their separate processes")
