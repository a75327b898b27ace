"""File descriptors: a shared container keeps one open, a container read out of another keeps
none, and a process that runs out of them is told why and what to do."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest
from shared_datasets import MEMFD_PREFIX, Windows, as_is

from pipeload import DataLoader, SharedMapping, SharedSequence


def _segment_descriptors() -> int:
    """How many of this process's open descriptors are pipeload segments."""
    count = 0
    for fd in os.listdir("/proc/self/fd"):
        try:
            count += os.readlink(f"/proc/self/fd/{fd}").startswith(MEMFD_PREFIX)
        except OSError:
            pass  # the descriptor listdir itself used, closed since
    return count


def test_each_container_keeps_one_descriptor_open() -> None:
    before = _segment_descriptors()
    sequences = [SharedSequence([f"frame{j}" for j in range(5)]) for _ in range(40)]
    mappings = [SharedMapping({f"frame{j}": j for j in range(5)}) for _ in range(40)]
    # Two per container (ours and the mapping's duplicate) halved how many a process could hold.
    assert _segment_descriptors() - before == 80
    for container in sequences + mappings:
        container.close()
    assert _segment_descriptors() == before


def test_a_container_read_out_of_another_holds_no_descriptor_per_read() -> None:
    outer = SharedSequence([SharedSequence(["a", "b"]), SharedMapping({"k": 1})])
    before = _segment_descriptors()
    reads = [outer[0] for _ in range(100)] + [outer[1] for _ in range(100)]
    assert _segment_descriptors() == before
    assert all(read == ["a", "b"] for read in reads[:100])
    assert all(read == {"k": 1} for read in reads[100:])
    reads[0].close()
    assert reads[1] == ["a", "b"], "each read is its own container: closing one leaves the others"
    outer.close()


@pytest.mark.usefixtures("leak_guard")
@pytest.mark.timeout(120)
@pytest.mark.parametrize("context", ["fork", "spawn"])
def test_workers_read_a_container_that_was_read_out_of_another(context: str) -> None:
    outer = SharedSequence([SharedSequence(list(range(24)))])
    tokens = outer[0]
    loader = DataLoader(Windows(tokens), batch_size=None, num_workers=1, collate_fn=as_is,
                        multiprocessing_context=context)
    assert [list(window) for window in loader] == [list(range(i * 4, i * 4 + 4)) for i in range(6)]
    del loader
    tokens.close()
    outer.close()


_RUN_OUT = """
import resource
from pipeload import SharedSequence
resource.setrlimit(resource.RLIMIT_NOFILE, (64, resource.getrlimit(resource.RLIMIT_NOFILE)[1]))
kept = []
try:
    while len(kept) < 1000:
        kept.append(SharedSequence([f"video{len(kept)}/frame{j}.jpg" for j in range(100)]))
except OSError as exc:
    print(exc.errno, len(kept), exc)
"""


def test_running_out_of_descriptors_names_the_container_and_the_remedies() -> None:
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(sys.path)}
    done = subprocess.run([sys.executable, "-c", _RUN_OUT], capture_output=True, text=True, env=env,
                          timeout=60, check=True)
    errno_text, built, message = done.stdout.strip().split(" ", 2)
    assert int(errno_text) == 24, done.stdout + done.stderr  # EMFILE: still an OSError callers know
    assert int(built) > 40, "one descriptor per container: most of the 64 go to containers"
    assert "cannot build a SharedSequence of 100 items" in message
    assert "resource.setrlimit(resource.RLIMIT_NOFILE" in message
    assert "fewer, larger containers" in message
