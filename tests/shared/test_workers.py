"""Shared containers in real workers: every start method and thread workers read the same
segment the main process built (never a copy), reading copies no page into a forked worker, and
the memory is gone once the last process lets go, even when the main process is SIGKILLed."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch.utils.data
from conftest import pid_gone, wait_until
from shared_datasets import (
    PathsAndLabels,
    ReadsEverything,
    ShellsOut,
    Windows,
    as_is,
    holders_of,
    memfd_names,
)

from pipeload import DataLoader, SharedMapping, SharedSequence

pytestmark = [pytest.mark.usefixtures("leak_guard"), pytest.mark.timeout(120)]

ENGINES = {
    "fork": {"multiprocessing_context": "fork"},
    "spawn": {"multiprocessing_context": "spawn"},
    "forkserver": {"multiprocessing_context": "forkserver"},
    "thread": {"worker_type": "thread"},
}
RELEASE_S = 10.0  # workers and the forkserver drop their handles as they exit


def _paths_and_labels(count: int) -> tuple[SharedSequence, SharedMapping]:
    paths = [f"/data/train/class_{i % 7}/img_{i}.jpg" for i in range(count)]
    return SharedSequence(paths), SharedMapping({path: i % 7 for i, path in enumerate(paths)})


# forkserver: a slow test (~1.4 s); spawn starts its workers the same way, from a pickle
@pytest.mark.parametrize("engine", [pytest.param(engine, id=name, marks=[pytest.mark.slow] if name == "forkserver" else [])
                                    for name, engine in ENGINES.items()])
def test_workers_read_the_segments_the_main_process_built(engine: dict) -> None:
    paths, labels = _paths_and_labels(200)
    ours = memfd_names(os.getpid())
    assert len(ours) == 2
    loader = DataLoader(PathsAndLabels(paths, labels), batch_size=25, num_workers=2, **engine)
    batches = list(loader)
    assert [p for batch in batches for p in batch[0]] == list(paths)
    assert [int(x) for batch in batches for x in batch[1]] == [i % 7 for i in range(200)]
    seen_by = {int(pid): names for batch in batches for pid, *names in zip(batch[2], *batch[3])}
    if "worker_type" in engine:
        assert set(seen_by) == {os.getpid()}
    else:
        assert len(seen_by) == 2 and os.getpid() not in seen_by
    # Each worker maps exactly the main process's two segments: shared, not copied.
    assert all(set(names) == ours for names in seen_by.values())
    del batches, loader
    names = list(ours)
    paths.close()
    labels.close()
    assert wait_until(lambda: not any(holders_of(name) for name in names), RELEASE_S), (
        {name: holders_of(name) for name in names}
    )


def test_torch_dataloader_with_spawn_shares_the_segment_too() -> None:
    paths, labels = _paths_and_labels(40)
    ours = memfd_names(os.getpid())
    loader = torch.utils.data.DataLoader(
        PathsAndLabels(paths, labels), batch_size=10, num_workers=1, multiprocessing_context="spawn"
    )
    batches = list(loader)
    assert [p for batch in batches for p in batch[0]] == list(paths)
    assert all(set(names) == ours for batch in batches for names in zip(*batch[3]))


@pytest.mark.parametrize("shared", [False, True], ids=["list", "shared"])
def test_reading_in_a_forked_worker_copies_no_page_of_the_items(shared: bool) -> None:
    table = [f"/data/train/some/long/directory/name/img_{i:08d}.jpg" for i in range(300_000)]
    if shared:
        table = SharedSequence(table)
    loader = DataLoader(ReadsEverything(table), batch_size=None, num_workers=1, multiprocessing_context="fork")
    (written,) = list(loader)
    mib = int(written) / 2**20
    if shared:
        assert mib < 4, f"the worker wrote {mib:.1f} MiB while reading a shared sequence"
    else:
        # The contrast that makes the check above meaningful: a plain list's objects get copied.
        assert mib > 15, f"the worker wrote only {mib:.1f} MiB while reading a plain list"


_KILLED_MAIN = textwrap.dedent(
    """
    import json, os, sys, time
    sys.path[:0] = json.loads(sys.argv[3])
    from pipeload import DataLoader, SharedSequence
    from shared_datasets import PathsAndLabels, memfd_names

    if __name__ == "__main__":
        out, context = sys.argv[1:3]
        paths = SharedSequence([f"img_{i}.jpg" for i in range(1000)])
        labels = {path: 0 for path in paths}
        loader = DataLoader(PathsAndLabels(paths, labels), batch_size=10, num_workers=2,
                            multiprocessing_context=context, persistent_workers=True)
        iterator = iter(loader)
        next(iterator)
        report = {"workers": [w.pid for w in iterator._workers], "names": sorted(memfd_names(os.getpid()))}
        with open(out + ".tmp", "w") as f:
            json.dump(report, f)
        os.replace(out + ".tmp", out)
        time.sleep(120)  # the test kills us here
    """
)


@pytest.mark.parametrize("context", ["fork", pytest.param("spawn", marks=pytest.mark.slow)])  # spawn: ~3 s
def test_sigkill_of_the_main_process_leaves_no_memory_behind(tmp_path: Path, context: str) -> None:
    out = tmp_path / "report.json"
    here = str(Path(__file__).parent)
    main = subprocess.Popen(
        [sys.executable, "-c", _KILLED_MAIN, str(out), context, json.dumps([here, *sys.path])],
        stdout=subprocess.DEVNULL, stderr=subprocess.PIPE,
    )
    try:
        if not wait_until(lambda: out.exists() or main.poll() is not None, 90.0):
            pytest.fail("the main process never got its first batch")
        assert main.poll() is None, main.stderr.read().decode()
        report = json.loads(out.read_text())
        (name,) = report["names"]
        assert set(holders_of(name)) >= {main.pid, *report["workers"]}
        main.send_signal(signal.SIGKILL)
        main.wait(10)
        assert wait_until(lambda: all(pid_gone(pid) for pid in report["workers"]), 10.0)
        # No name in /dev/shm (leak_guard checks that too), and nobody left holding the segment:
        # the kernel has freed it.
        assert wait_until(lambda: not holders_of(name), RELEASE_S), holders_of(name)
    finally:
        if main.poll() is None:
            main.kill()
            main.wait(10)
        main.stderr.close()


def test_a_slice_a_worker_returns_carries_its_items_not_the_whole_segment() -> None:
    tokens = SharedSequence(list(range(200_000)))  # 1.6 MB of int64
    loader = DataLoader(Windows(tokens), batch_size=None, num_workers=1, collate_fn=as_is,
                        multiprocessing_context="fork")
    windows = list(loader)
    assert [list(window) for window in windows] == [list(range(i * 4, i * 4 + 4)) for i in range(6)]
    # A list slice is a new small list; a view sent to the main process must not be 1.6 MB each.
    assert all(window.nbytes < 4096 for window in windows), [window.nbytes for window in windows]
    del windows, loader
    tokens.close()


@pytest.mark.parametrize("context", ["spawn", pytest.param("forkserver", marks=pytest.mark.slow)])  # ~1.4 s each
def test_a_program_a_worker_runs_does_not_inherit_the_segment(context: str) -> None:
    paths = SharedSequence(["a", "b"])
    loader = DataLoader(ShellsOut(paths), batch_size=None, num_workers=1, collate_fn=as_is,
                        multiprocessing_context=context)
    # An inherited descriptor would keep the segment alive for as long as that program runs.
    assert list(loader) == [[]]
    del loader
    paths.close()
