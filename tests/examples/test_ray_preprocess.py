"""examples/ray_preprocess.py on a local Ray cluster it starts itself: JPEGs decoded and augmented
in two actors reach the training loop once each per epoch, the stats say so, and nothing of Ray
outlives the script."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import psutil
import pytest

sys.path.insert(0, str(Path(__file__).parents[1] / "datapipes"))
from conftest import lacks  # noqa: E402
from ray_testing import RAY_ENV, actor_processes, wait_for  # noqa: E402

# Found, not imported: the example runs in processes of its own (conftest.lacks says why).
pytestmark = [lacks("ray"), lacks("PIL")]

EXAMPLE = Path(__file__).parents[2] / "examples" / "ray_preprocess.py"
DAEMONS = ("raylet", "gcs_server")


def ray_daemons() -> set[int]:
    found = set()
    for process in psutil.process_iter(["cmdline"]):
        try:
            if any(name in " ".join(process.info["cmdline"] or ()) for name in DAEMONS):
                found.add(process.pid)
        except psutil.Error:
            continue
    return found


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_the_example_trains_on_images_made_in_ray_actors(tmp_path: Path) -> None:
    before = ray_daemons()
    src = str(Path(__file__).parents[2] / "src")
    env = {**os.environ, **RAY_ENV, "PYTHONPATH": os.pathsep.join([src, str(EXAMPLE.parent)])}
    env.pop("RAY_ADDRESS", None)
    done = subprocess.run(
        [sys.executable, str(EXAMPLE), "--images-dir", str(tmp_path / "images"), "--images", "48",
         "--epochs", "2", "--batch-size", "8"],
        env=env, capture_output=True, text=True, timeout=280,
    )
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-4000:]
    assert "rank 0 epoch 0: 48 images" in done.stdout and "rank 0 epoch 1: 48 images" in done.stdout
    assert "Ray stage: 96 items from its actors" in done.stdout
    assert wait_for(lambda: not (ray_daemons() - before)), f"Ray left running: {ray_daemons() - before}"
    assert wait_for(lambda: not actor_processes())
