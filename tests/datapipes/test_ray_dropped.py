"""The flags that tell a Ray boundary's actors a run was dropped (ray_dropped.py): files in this
machine's temporary directory, which no process may leave behind. Plain files: no Ray needed."""

from __future__ import annotations

import os
import subprocess
import sys
import tempfile

from pipeload.datapipes.boundary import ray_dropped


def _flag_of(pid: int) -> str:
    return os.path.join(tempfile.gettempdir(), f"pipeload-dropped-run-{pid}.0123456789abcdef-7")


def test_a_flag_names_its_process_and_is_raised_and_lowered() -> None:
    path = ray_dropped.flag_for(12345)
    assert os.path.basename(path).startswith(f"pipeload-dropped-run-{os.getpid()}.")
    ray_dropped.raise_flag(path)
    assert path in ray_dropped.flags_left()
    assert ray_dropped.seen_raised(path) and not os.path.exists(path)  # seen, taken down
    ray_dropped.lower_flag(path)  # twice is harmless


def test_the_flags_of_a_process_that_is_gone_are_taken_down_by_the_next_flag_raised() -> None:
    # A killed reading process lowers none of its flags: each stayed behind as an empty file.
    gone = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"],
                          capture_output=True, text=True, check=True)
    dead, alive = _flag_of(int(gone.stdout)), _flag_of(os.getppid())
    for path in (dead, alive):
        open(path, "w").close()
    mine = ray_dropped.flag_for(99)
    try:
        ray_dropped.raise_flag(mine)
        assert not os.path.exists(dead)
        assert os.path.exists(alive) and os.path.exists(mine)  # a live process's, and ours
    finally:
        for path in (dead, alive, mine):
            ray_dropped.lower_flag(path)
