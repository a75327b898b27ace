"""``pipeload bench`` and ``python -m bench.run``: they run, print both loaders and a ratio, and
leave no process or /dev/shm entry behind."""

from __future__ import annotations

import os
import re
import subprocess
import sys
import time
import uuid
from pathlib import Path

import psutil
import pytest

from pipeload import cli

REPO_ROOT = Path(__file__).resolve().parents[1]
SHM_DIR = Path("/dev/shm")
SUBPROCESS_TIMEOUT_S = 90
LEFTOVER_GRACE_S = 5.0
# Every process a run starts inherits this variable, so survivors can be found by it.
RUN_MARKER = "PIPELOAD_TEST_CLI_RUN"


def _run_marked(args: list[str], cwd: Path) -> tuple[subprocess.CompletedProcess[str], str]:
    marker = uuid.uuid4().hex
    env = {**os.environ, RUN_MARKER: marker}
    completed = subprocess.run(
        [sys.executable, *args], cwd=cwd, env=env, capture_output=True, text=True,
        timeout=SUBPROCESS_TIMEOUT_S,
    )
    return completed, marker


def _marked_processes(marker: str) -> list[psutil.Process]:
    found = []
    for process in psutil.process_iter():
        try:
            if process.environ().get(RUN_MARKER) == marker:
                found.append(process)
        except (psutil.NoSuchProcess, psutil.AccessDenied, psutil.ZombieProcess):
            continue
    return found


def _shm_entries() -> set[str]:
    return {entry.name for entry in SHM_DIR.iterdir()} if SHM_DIR.is_dir() else set()


def _assert_nothing_left(marker: str, shm_before: set[str]) -> None:
    # The machine is shared: entries made by others come and go, so allow a grace period.
    deadline = time.monotonic() + LEFTOVER_GRACE_S
    while True:
        survivors = _marked_processes(marker)
        new_shm = _shm_entries() - shm_before
        if not survivors and not new_shm:
            return
        if time.monotonic() > deadline:
            break
        time.sleep(0.1)
    assert not survivors, f"processes outlived the run: {survivors}"
    assert not new_shm, f"/dev/shm entries outlived the run: {sorted(new_shm)}"


@pytest.mark.parametrize("num_workers", [0, 2])
def test_bench_prints_both_loaders_and_a_ratio(num_workers: int) -> None:
    shm_before = _shm_entries()
    completed, marker = _run_marked(
        ["-m", "pipeload", "bench", "--samples", "256", "--batch-size", "32",
         "--num-workers", str(num_workers)],
        cwd=REPO_ROOT,
    )
    assert completed.returncode == 0, completed.stderr
    rows = {line.split()[0]: line.split()[1:] for line in completed.stdout.splitlines() if line}
    # Two epochs by default, so each loader saw the 256 samples twice.
    assert rows["pipeload"][0] == "512"
    assert rows["torch"][0] == "512"
    assert re.fullmatch(r"\d+\.\d\dx", rows["pipeload/torch"][0])
    _assert_nothing_left(marker, shm_before)


def test_bench_rejects_a_bad_argument_by_name(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as exit_info:
        cli.main(["bench", "--batch-size", "0"])
    assert exit_info.value.code == 2
    error = capsys.readouterr().err
    assert "--batch-size" in error and "'0'" in error


def test_bench_alternates_which_loader_goes_first() -> None:
    config = cli.BenchConfig(samples=64, batch_size=16, epochs=3)
    loaders = {"first": cli.make_pipeload_loader, "second": cli.make_pipeload_loader}
    timings = cli.run_bench(config, loaders, progress=False)
    assert [t.loader_name for t in timings] == [
        "first", "second", "second", "first", "first", "second",
    ]
    summaries = cli.summarise(timings, list(loaders))
    assert [s.samples for s in summaries] == [192, 192]
    table = cli.format_table(summaries)
    assert re.search(r"^first/second\s+\d+\.\d\dx$", table, re.MULTILINE)


@pytest.mark.slow
def test_bench_run_quick_on_the_tiny_workload() -> None:
    shm_before = _shm_entries()
    completed, marker = _run_marked(
        ["-m", "bench.run", "--quick", "--workload", "tiny"], cwd=REPO_ROOT
    )
    assert completed.returncode == 0, completed.stderr
    table = [line.split() for line in completed.stdout.splitlines()]
    loaders = [row[1] for row in table if row and row[0] == "tiny"]
    assert loaders == ["pipeload", "torch", "pipeload/torch"]
    ratio_row = next(row for row in table if row[:2] == ["tiny", "pipeload/torch"])
    assert re.fullmatch(r"\d+\.\d\dx", ratio_row[2])  # samples/s
    assert re.fullmatch(r"\d+\.\d\dx", ratio_row[3])  # time to first batch
    _assert_nothing_left(marker, shm_before)


def test_without_the_checkout_baseline_only_pipeload_runs(monkeypatch, tmp_path, capsys) -> None:
    monkeypatch.setattr(cli, "BASELINE_PATH", tmp_path / "missing.py")
    assert list(cli.available_loaders()) == ["pipeload"]
    assert "source checkout" in capsys.readouterr().err


def test_the_checkout_baseline_is_torch_own_loader() -> None:
    import torch.utils.data

    loaders = cli.available_loaders()
    assert list(loaders) == ["pipeload", "torch"]
    config = cli.BenchConfig(samples=8, batch_size=4, num_workers=0)
    assert isinstance(loaders["torch"]([0, 1, 2, 3], config), torch.utils.data.DataLoader)
