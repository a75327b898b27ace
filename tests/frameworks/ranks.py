"""Running training frameworks in real processes: start the ranks, read what each one saw."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import psutil

import pipeload

HERE = Path(__file__).parent
RUN_TIMEOUT_S = 240
LEFTOVER_DEADLINE_S = 10.0


def run_ranks(command: list[str], out_dir: Path, world_size: int) -> list[dict[str, Any]]:
    """Run ``command`` (which starts ``world_size`` ranks) and return each rank's record.

    The ranks import the pipeload under test, whichever way this test process found it.
    """
    env = dict(os.environ)
    source_root = str(Path(pipeload.__file__).resolve().parents[1])
    env["PYTHONPATH"] = os.pathsep.join(p for p in (source_root, env.get("PYTHONPATH")) if p)
    env.pop("PL_GLOBAL_SEED", None)
    done = subprocess.run(command, env=env, cwd=out_dir, capture_output=True, text=True,
                          timeout=RUN_TIMEOUT_S)
    assert done.returncode == 0, f"{command} failed:\n{done.stdout[-4000:]}\n{done.stderr[-8000:]}"
    return [json.loads((out_dir / f"rank{rank}.json").read_text()) for rank in range(world_size)]


def no_rank_left(out_dir: Path) -> bool:
    """True once no process started for this run (ranks, their workers) is still running."""
    marker = str(out_dir)
    for process in psutil.process_iter(["cmdline", "status"]):
        try:
            if process.info["status"] != psutil.STATUS_ZOMBIE and marker in " ".join(
                process.info["cmdline"] or ()
            ):
                return False
        except psutil.Error:
            continue
    return True

