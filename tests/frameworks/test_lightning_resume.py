"""A mid-epoch checkpoint of Lightning's resumes the batches the run had left, in their order.

Lightning loads the loader's state, makes the epoch's iterator, and only then calls the
sampler's ``set_epoch``: torch's ``DistributedSampler`` was still at epoch 0 when the resumed
epoch drew its order, so the batches skipped were epoch 0's and the rest handed out belonged to
another order, silently. The state keeps the sampler's epoch. The fits run in a process of
their own (``lightning_resume.py`` says why).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
from conftest import lacks
from ranks import HERE, RUN_TIMEOUT_S

import pipeload

# Lightning runs in a process of its own: found here, not imported (conftest.lacks says why).
pytestmark = lacks("lightning")


@pytest.mark.timeout(RUN_TIMEOUT_S + 30)
def test_a_mid_epoch_checkpoint_resumes_the_rest_of_that_epochs_order(tmp_path: Path) -> None:
    env = dict(os.environ)
    source_root = str(Path(pipeload.__file__).resolve().parents[1])  # the pipeload under test
    env["PYTHONPATH"] = os.pathsep.join(p for p in (source_root, env.get("PYTHONPATH")) if p)
    done = subprocess.run([sys.executable, str(HERE / "lightning_resume.py"), str(tmp_path)], env=env,
                          cwd=tmp_path, capture_output=True, text=True, timeout=RUN_TIMEOUT_S)
    assert done.returncode == 0, done.stderr[-3000:]
    seen = {name: {int(epoch): batches for epoch, batches in by_epoch.items()}
            for name, by_epoch in json.loads((tmp_path / "seen.json").read_text()).items()}
    whole = seen["whole"]
    assert [len(whole[epoch]) for epoch in range(3)] == [10, 10, 10] and whole[0] != whole[1]
    assert seen["stopped"] == {0: whole[0], 1: whole[1][:3]}
    assert seen["resumed"] == {1: whole[1][3:], 2: whole[2]}
