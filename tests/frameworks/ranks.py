"""Running training frameworks in real processes: start the ranks, read what each one saw."""

from __future__ import annotations

import json
import os
import signal
import subprocess
from pathlib import Path
from typing import Any

import psutil

import pipeload

HERE = Path(__file__).parent
# A 2-rank job of the examples takes ~6 s on a quiet 2-core box, ~25 s at load 10 (tests/test_torch_scripts_switch.py).
RUN_TIMEOUT_S = 150
LEFTOVER_DEADLINE_S = 10.0
STACKS_WITHIN_S = 15.0  # for the ranks (and their workers) to print their stacks once aborted


def run_ranks(command: list[str], out_dir: Path, world_size: int) -> list[dict[str, Any]]:
    """Run ``command`` (which starts ``world_size`` ranks) and return each rank's record.

    The ranks import the pipeload under test, whichever way this test process found it. A run
    that outlives ``RUN_TIMEOUT_S`` fails with every rank's and worker's Python stacks: each is
    sent SIGABRT, on which Python's fault handler (``PYTHONFAULTHANDLER``) prints them.
    """
    env = dict(os.environ)
    source_root = str(Path(pipeload.__file__).resolve().parents[1])
    env["PYTHONPATH"] = os.pathsep.join(p for p in (source_root, env.get("PYTHONPATH")) if p)
    env["PYTHONFAULTHANDLER"] = "1"
    env.pop("PL_GLOBAL_SEED", None)
    with subprocess.Popen(command, env=env, cwd=out_dir, stdout=subprocess.PIPE,
                          stderr=subprocess.PIPE, text=True) as run:
        try:
            out, err = run.communicate(timeout=RUN_TIMEOUT_S)
        except subprocess.TimeoutExpired:
            out, err = _stacks_of_a_stuck_run(run, out_dir)
            raise AssertionError(f"{command} still ran after {RUN_TIMEOUT_S} s; its processes' "
                                 f"stacks:\n{out[-4000:]}\n{err[-30000:]}") from None
    assert run.returncode == 0, f"{command} failed:\n{out[-4000:]}\n{err[-8000:]}"
    return [json.loads((out_dir / f"rank{rank}.json").read_text()) for rank in range(world_size)]


def _stacks_of_a_stuck_run(run: subprocess.Popen, out_dir: Path) -> tuple[str, str]:
    """Abort the launcher's descendants (the ranks, their workers: their fault handlers print
    their stacks), then end whatever is left of the run; what the run printed."""
    try:
        stuck = psutil.Process(run.pid).children(recursive=True)
    except psutil.Error:
        stuck = []
    for process in stuck:
        try:
            process.send_signal(signal.SIGABRT)
        except psutil.Error:
            pass
    try:
        return run.communicate(timeout=STACKS_WITHIN_S)
    except subprocess.TimeoutExpired:
        run.kill()
        for process in processes_of_the_run(out_dir):
            try:
                process.kill()
            except psutil.Error:
                pass
        return run.communicate()


def processes_of_the_run(out_dir: Path) -> list[psutil.Process]:
    """Living processes started for this run (the launcher, the ranks, their forked workers):
    those whose command line names ``out_dir``."""
    marker, found = str(out_dir), []
    for process in psutil.process_iter(["cmdline", "status"]):
        try:
            if process.info["status"] != psutil.STATUS_ZOMBIE and marker in " ".join(
                process.info["cmdline"] or ()
            ):
                found.append(process)
        except psutil.Error:
            continue
    return found


def no_rank_left(out_dir: Path) -> bool:
    """True once no process started for this run (ranks, their workers) is still running."""
    return not processes_of_the_run(out_dir)
