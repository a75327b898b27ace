"""Batches made in process workers arrive through shared memory; a /dev/shm too small for them
ends in a SharedMemoryError that says so and leaves no segment behind; pin_memory=True without
an accelerator warns once and hands the batches through unchanged.
"""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
import textwrap
import warnings

import pytest
from faults import (
    ECONOMIC,
    ECONOMIC_SPAWN,
    ECONOMIC_THREAD,
    FORK,
    SPAWN,
    THREAD,
    MakesTensors,
    engine_params,
    loader_kwargs,
)

from pipeload import DataLoader
from pipeload.pin import pinning_available

pytestmark = [pytest.mark.usefixtures("leak_guard"), pytest.mark.timeout(60)]


@pytest.mark.parametrize("engine", engine_params(FORK, SPAWN, ECONOMIC, ECONOMIC_SPAWN))
@pytest.mark.timeout(90)
def test_tensors_made_in_workers_arrive_in_shared_memory(engine):
    loader = DataLoader(MakesTensors(8), batch_size=4, num_workers=2, **loader_kwargs(engine))
    batches = list(loader)
    assert [b[:, 0].tolist() for b in batches] == [[0, 1, 2, 3], [4, 5, 6, 7]]
    assert all(b.untyped_storage().is_shared() for b in batches)


@pytest.mark.parametrize("engine", engine_params(FORK, ECONOMIC))
def test_uncollated_tensors_arrive_in_shared_memory(engine):
    loader = DataLoader(MakesTensors(4), batch_size=None, num_workers=2, **loader_kwargs(engine))
    items = list(loader)
    assert [t[0].item() for t in items] == [0, 1, 2, 3]
    assert all(t.untyped_storage().is_shared() for t in items)


@pytest.mark.parametrize("engine", engine_params(THREAD, ECONOMIC_THREAD))
def test_thread_workers_hand_over_tensors_as_they_are(engine):
    loader = DataLoader(MakesTensors(8), batch_size=4, num_workers=2, **loader_kwargs(engine))
    assert [b[:, 0].tolist() for b in loader] == [[0, 1, 2, 3], [4, 5, 6, 7]]


# -- pin_memory without an accelerator ---------------------------------------------------


@pytest.mark.skipif(pinning_available(), reason="an accelerator is present: batches are really pinned")
@pytest.mark.parametrize("engine", engine_params(FORK, THREAD, ECONOMIC) + [pytest.param(None, id="inline")])
def test_pin_memory_without_accelerator_warns_once_and_passes_batches_through(engine):
    workers = {} if engine is None else {"num_workers": 2, **loader_kwargs(engine)}
    plain = [b.tolist() for b in DataLoader(MakesTensors(6), batch_size=4, **workers)]
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("default")  # what a user sees: each warning once per place
        loader = DataLoader(MakesTensors(6), batch_size=4, pin_memory=True, **workers)
        epochs = [list(loader) for _ in range(3)]
    pin_warnings = [w for w in caught if "pin_memory" in str(w.message)]
    assert len(pin_warnings) == 1, [str(w.message) for w in caught]
    assert "no accelerator" in str(pin_warnings[0].message)
    for batches in epochs:
        assert [b.tolist() for b in batches] == plain
        assert not any(b.is_pinned() for b in batches)


# -- /dev/shm too small ------------------------------------------------------------------

# Runs in a private mount namespace whose /dev/shm is a 1 MiB tmpfs; prints what happened.
_SMALL_SHM_SCRIPT = textwrap.dedent(
    """
    import json, os, sys, torch
    from pipeload import DataLoader
    from pipeload.errors import SharedMemoryError

    class Big:
        def __len__(self): return 8
        def __getitem__(self, index): return torch.ones(1 << 19)  # 2 MiB

    results = {}
    for name, batch_size in (("collated", 4), ("uncollated", None)):
        loader = DataLoader(Big(), batch_size=batch_size, num_workers=1,
                            multiprocessing_context=sys.argv[1])
        try:
            list(loader)
            outcome = {"error": None}
        except Exception as exc:
            outcome = {"error": type(exc).__name__, "message": str(exc),
                       "is_shm_error": isinstance(exc, SharedMemoryError),
                       "is_runtime_error": isinstance(exc, RuntimeError)}
        del loader
        outcome["left_in_shm"] = sorted(os.listdir("/dev/shm"))
        results[name] = outcome
    print(json.dumps(results))
    """
)


def _small_shm_available() -> bool:
    if shutil.which("unshare") is None:
        return False
    probe = subprocess.run(
        ["unshare", "-m", "sh", "-c", "mount -t tmpfs -o size=1m tmpfs /dev/shm"],
        capture_output=True, timeout=30,
    )
    return probe.returncode == 0


@pytest.mark.timeout(120)
@pytest.mark.parametrize("context", ["fork", pytest.param("spawn", marks=pytest.mark.slow)])
def test_too_small_dev_shm_is_a_clear_error_and_leaves_nothing(tmp_path, context):
    if not _small_shm_available():
        pytest.skip("needs root to mount a small tmpfs on /dev/shm in a private mount namespace")
    script = tmp_path / "small_shm.py"
    script.write_text(_SMALL_SHM_SCRIPT)
    command = f"mount -t tmpfs -o size=1m tmpfs /dev/shm && exec {sys.executable} {script} {context}"
    done = subprocess.run(["unshare", "-m", "sh", "-c", command], capture_output=True, text=True, timeout=100)
    assert done.returncode == 0, done.stderr
    results = json.loads(done.stdout.strip().splitlines()[-1])

    for name, outcome in results.items():
        assert outcome["error"] == "SharedMemoryError", (name, outcome)
        assert outcome["is_shm_error"] and outcome["is_runtime_error"]
        assert "shared memory (/dev/shm) is too small" in outcome["message"]
        assert outcome["message"].startswith("Caught RuntimeError in DataLoader worker process 0.")
        assert outcome["left_in_shm"] == [], (name, outcome["left_in_shm"])
