"""Training scripts written for ``torch.utils.data`` run under pipeload with one textual change:
every ``torch.utils.data`` replaced by ``pipeload``, and ``from torch.utils import data`` by
``import pipeload as data`` (the README's promise, "change one import", held to every import form
scripts use: submodules, private collate helpers, DataPipes, the module under a short name).

Each script in ``torch_scripts/`` prints what it loaded (batches per epoch and rank, a trained
weight); run as written (torch) and with the replacement (pipeload), side by side, the two print
the same: same seed, same batches. Each run is a subprocess marked so that no process or
shared-memory entry it started may outlive it.
"""

from __future__ import annotations

import os
import subprocess
import sys
import uuid
from pathlib import Path

import pytest
from conftest import RUN_MARKER, assert_run_left_nothing, shm_entries

SCRIPTS = Path(__file__).resolve().parent / "torch_scripts"
SRC = Path(__file__).resolve().parents[1] / "src"
RUN_TIMEOUT_S = 150  # a 2-rank DDP run takes ~5 s on a quiet box, 23 s at load 10


def switched(source: str) -> str:
    """The script with torch.utils.data replaced by pipeload, and nothing else changed."""
    return source.replace("from torch.utils import data", "import pipeload as data").replace(
        "torch.utils.data", "pipeload")


def start(script: Path, marker: str) -> subprocess.Popen[str]:
    env = {**os.environ, RUN_MARKER: marker, "PYTHONPATH": str(SRC)}
    return subprocess.Popen([sys.executable, str(script)], cwd=script.parent, env=env, text=True,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE)


@pytest.mark.timeout(320)
# The DDP script is a slow test (~5 s of gloo processes): tests/examples/test_ddp_train.py runs a
# DDP job in the fast suite.
@pytest.mark.parametrize("name", [pytest.param(name, marks=[pytest.mark.slow] if name.startswith("ddp") else [])
                                  for name in sorted(p.name for p in SCRIPTS.glob("*.py"))])
def test_a_torch_script_runs_with_torch_utils_data_replaced_by_pipeload(tmp_path: Path, name: str) -> None:
    original = SCRIPTS / name
    ours = tmp_path / name
    ours.write_text(switched(original.read_text()))
    assert "torch.utils.data" not in ours.read_text() and "pipeload" in ours.read_text()
    marker, shm_before = uuid.uuid4().hex, shm_entries()
    runs = [start(original, marker), start(ours, marker)]  # side by side: half the wall time
    (torch_out, torch_err), (our_out, our_err) = (run.communicate(timeout=RUN_TIMEOUT_S) for run in runs)
    assert_run_left_nothing(marker, shm_before)
    assert runs[0].returncode == 0, torch_err
    assert runs[1].returncode == 0, our_err
    assert torch_out.strip(), torch_err
    assert our_out == torch_out
