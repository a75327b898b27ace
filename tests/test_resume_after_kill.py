"""Kill a training process mid-epoch (SIGKILL, workers running, batches in flight), start it
again from its last checkpoint, and get exactly what an uninterrupted run gets."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
from pathlib import Path

import psutil
import pytest
from conftest import LeakGuard, wait_until

import pipeload

SCRIPT = Path(__file__).parent / "resume_training.py"
RUN_TIMEOUT_S = 120
STOP_DEADLINE_S = 60.0
LEFTOVER_DEADLINE_S = 10.0
BATCHES_PER_EPOCH = 8  # 30 samples in batches of 4


def environment() -> dict[str, str]:
    env = dict(os.environ)
    source_root = str(Path(pipeload.__file__).resolve().parents[1])
    env["PYTHONPATH"] = os.pathsep.join(p for p in (source_root, env.get("PYTHONPATH")) if p)
    return env


def run(out: Path, *extra: str) -> None:
    done = subprocess.run([sys.executable, str(SCRIPT), str(out), *extra], env=environment(),
                          capture_output=True, text=True, timeout=RUN_TIMEOUT_S)
    assert done.returncode == 0, done.stderr[-4000:]


def nothing_left_of(out: Path) -> bool:
    marker = str(out)
    for process in psutil.process_iter(["cmdline", "status"]):
        try:
            if process.info["status"] != psutil.STATUS_ZOMBIE and marker in " ".join(process.info["cmdline"] or ()):
                return False
        except psutil.Error:
            continue
    return True


@pytest.mark.timeout(300)
@pytest.mark.parametrize("stop_after", [
    BATCHES_PER_EPOCH + 3,
    # after the epoch's last batch, before the loop saw its end
    pytest.param(BATCHES_PER_EPOCH * 2, marks=pytest.mark.slow),
])
def test_sigkill_mid_epoch_then_resume_from_the_last_checkpoint(stop_after: int, tmp_path: Path,
                                                                 leak_guard: LeakGuard) -> None:
    whole, killed = tmp_path / "whole", tmp_path / "killed"
    whole.mkdir()
    killed.mkdir()
    run(whole)

    victim = subprocess.Popen([sys.executable, str(SCRIPT), str(killed), "--stop-after", str(stop_after)],
                              env=environment(), stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    try:
        assert wait_until(lambda: (killed / "stopped").exists() or victim.poll() is not None, STOP_DEADLINE_S)
        assert victim.poll() is None, victim.stderr.read().decode()[-4000:]
        victim.send_signal(signal.SIGKILL)
        victim.wait(RUN_TIMEOUT_S)
    finally:
        if victim.poll() is None:
            victim.kill()
            victim.wait()
        victim.stderr.close()
    # Its workers notice their parent is gone and leave by themselves.
    assert wait_until(lambda: nothing_left_of(killed), LEFTOVER_DEADLINE_S)
    assert len(json.loads((killed / "checkpoint.json").read_text())["seen"]) == stop_after

    run(killed, "--resume")
    expected = json.loads((whole / "result.json").read_text())
    resumed = json.loads((killed / "result.json").read_text())
    assert len(expected) == 3 * BATCHES_PER_EPOCH
    assert resumed == expected
