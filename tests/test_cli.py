"""``pipeload bench`` and ``pipeload profile``, run as a user runs them: in a subprocess, with
tiny sizes, a private cache directory, and nothing left behind; and ``python -m bench.run``."""

from __future__ import annotations

import dataclasses

import os
import re
import subprocess
import sys
import uuid
from pathlib import Path

import pytest
from conftest import RUN_MARKER, assert_run_left_nothing, shm_entries

REPO_ROOT = Path(__file__).resolve().parents[1]
SUBPROCESS_TIMEOUT_S = 100
PNG_MAGIC = b"\x89PNG\r\n\x1a\n"


def pipeload_command(args: list[str], cache: Path, cwd: Path = REPO_ROOT) -> subprocess.CompletedProcess[str]:
    marker = uuid.uuid4().hex
    env = {**os.environ, RUN_MARKER: marker, "PIPELOAD_CACHE": str(cache),
           "PYTHONPATH": str(REPO_ROOT / "src")}
    shm_before = shm_entries()
    completed = subprocess.run([sys.executable, "-m", "pipeload", *args], cwd=cwd, env=env,
                               capture_output=True, text=True, timeout=SUBPROCESS_TIMEOUT_S)
    assert_run_left_nothing(marker, shm_before)
    return completed


def _one_line_error(completed: subprocess.CompletedProcess[str], status: int, words: str) -> None:
    assert completed.returncode == status, (completed.returncode, completed.stderr)
    lines = completed.stderr.strip().splitlines()
    assert len(lines) == 1, completed.stderr
    assert words in lines[0], lines[0]


@pytest.mark.timeout(200)
def test_bench_compares_every_loader_and_writes_a_chart(tmp_path: Path) -> None:
    chart = tmp_path / "chart.png"
    args = ["bench", "--size", "48", "--batch-size", "16", "--workers", "1", "--repeats", "1",
            "--chart", str(chart)]
    completed = pipeload_command(args, tmp_path / "cache")
    assert completed.returncode == 0, completed.stderr
    assert "first run: writing 48 synthetic JPEG images" in completed.stderr
    # Economic mode's processes are said once in the header, not warned about on every pass.
    assert "(1 item worker and up to 2 batch workers, started when a batch needs one" in completed.stderr
    assert "This DataLoader will create" not in completed.stderr
    table = completed.stdout.split("\nwhat each mode is for:")[0]
    rows = {line.split()[0]: line.split() for line in table.splitlines() if line.strip()}
    assert {"torch", "classic", "economic", "threads", "pipes"} <= set(rows)
    assert "(one run)" in " ".join(rows["classic"]) and "note: one run per loader" in completed.stdout
    assert "note: 3 batch(es) per pass: the rates are mostly start-up" in completed.stdout
    legend = completed.stdout.split("\nwhat each mode is for:")[1]
    assert [line.split()[0] for line in legend.splitlines() if line.startswith("  ")] == [
        "torch", "classic", "economic", "threads", "pipes"]
    ratios = {name: [t for t in row if re.fullmatch(r"\d+\.\d\dx", t)] for name, row in rows.items()}
    assert ratios["torch"] == ["1.00x"]
    assert all(len(ratios[name]) == 1 for name in ("classic", "economic", "threads", "pipes"))
    assert f"chart: {chart}" in completed.stdout
    assert chart.read_bytes().startswith(PNG_MAGIC)
    shards = list((tmp_path / "cache" / "bench-data").glob("jpeg-48-v*/shard-*.tar"))
    assert len(shards) == 1


@pytest.mark.slow  # ~5 s; test_bench_compares_every_loader_and_writes_a_chart runs the command fast
@pytest.mark.timeout(200)
def test_bench_reuses_the_cached_dataset_and_picks_loaders(tmp_path: Path) -> None:
    args = ["bench", "--size", "32", "--batch-size", "16", "--workers", "0", "--repeats", "2",
            "--loaders", "classic,threads", "--chart", str(tmp_path / "chart")]
    first = pipeload_command(args, tmp_path)
    second = pipeload_command(args, tmp_path)
    assert first.returncode == second.returncode == 0, second.stderr
    assert "first run" in first.stderr and "first run" not in second.stderr
    loaders = [line.split()[0] for line in second.stdout.splitlines()[1:3]]
    assert loaders == ["classic", "threads"]
    assert second.stderr.count("classic   ") == 2 + 1  # two repeats, and the loader's description
    # A name without ".png" is still the file written (matplotlib would add the suffix).
    assert f"chart: {tmp_path / 'chart'}" in second.stdout
    assert (tmp_path / "chart").read_bytes().startswith(PNG_MAGIC)


def test_bench_says_which_loaders_its_spread_cannot_tell_from_torch_and_that_the_machine_was_busy() -> None:
    # A newcomer's demo on a loaded box ranked threads above torch (1.21x) where the README read
    # 0.79x: the spreads overlapped, and the output said nothing of it or of the load.
    from pipeload.cli.bench import Row, noise_notes

    def row(name: str, lowest: float, highest: float) -> Row:
        return Row(name, (lowest + highest) / 2, lowest, highest, 0.1, 0, 0, runs=3)

    rows = [row("torch", 1_900, 2_100), row("classic", 3_900, 4_100), row("threads", 2_050, 2_600)]
    assert noise_notes(rows, load_before=0.0) == [
        "the spread of threads overlaps torch's (1,900..2,100): this run does not tell them apart from torch"]
    busy = noise_notes(rows, load_before=64.0)
    assert len(busy) == 2 and busy[0].startswith("the machine was busy before the runs (load average 64.0")
    one_run = [dataclasses.replace(r, runs=1) for r in rows]
    assert noise_notes(one_run, load_before=0.0) == []  # no spread to compare (said apart)


@pytest.mark.timeout(120)
def test_the_command_exits_non_zero_with_one_line(tmp_path: Path) -> None:
    completed = pipeload_command(["bench", "--loaders", "classic,nope"], tmp_path)
    _one_line_error(completed, 2, "pipeload bench: error: argument --loaders: unknown loader 'nope'")


@pytest.mark.parametrize("args, status, words", [
    (["bench", "--size", "0"], 2, "expected an integer >= 1, got '0'"),
    (["bench", "--loaders", "economic", "--workers", "0", "--size", "16"], 2, "economic mode needs workers"),
    (["bench", "--loaders", "torch,,classic"], 2, "empty loader name in 'torch,,classic'"),
    (["bench", "--loaders", "classic,"], 2, "empty loader name in 'classic,'"),
    (["bench", "--loaders", "classic,threads,classic"], 2, "loader 'classic' named twice"),
    (["bench", "--chart", "."], 2, "--chart . is a directory"),
    (["bench", "--chart", "factories.py/chart.png"], 2, "cannot write the chart to factories.py/chart.png: factories.py is a file, not a directory"),
    (["bench", "--size", "32", "--batch-size", "32", "--workers", "2"], 2, "makes 1 batch(es) per pass, fewer than the 2 workers"),
    (["profile", "factories:slow_dataset", "--num-workers", "many"], 2, "expected an integer >= 0 or 'auto', got 'many'"),
    (["profile", "factories:slow_dataset", "--step-ms", "-5"], 2, "expected a number of milliseconds >= 0, got '-5'"),
    (["profile", "factories:slow_dataset", "--step-ms", "nan"], 2, "expected a number of milliseconds >= 0, got 'nan'"),
    (["profile", "factories:slow_dataset", "--step-ms", "soon"], 2, "expected a number of milliseconds, got 'soon'"),
    (["profile", "no_colon_here"], 2, "expected MODULE:FACTORY"),
    (["profile", "factories.py:slow_dataset"], 2, "not a file's, got 'factories.py:slow_dataset': try `pipeload profile factories:slow_dataset`"),
    (["profile", "sub/train.py:make"], 2, "try `pipeload profile sub.train:make`"),
    (["profile", "no_such_module_xyz:make"], 2, "cannot import module 'no_such_module_xyz'"),
    (["profile", "factories:missing"], 2, "module 'factories' has no attribute 'missing'"),
    (["profile", "factories:raises"], 1, "factories:raises raised ValueError: no data today"),
    (["profile", "factories:not_a_dataset"], 1, "returned int, expected a dataset or a DataLoader"),
    (["profile", "factories:stats_off"], 1, "returned a DataLoader built with stats=False"),
    (["profile", "factories:the_class"], 1, "returned the class Slow, expected a dataset"),
    (["profile", "factories:exits"], 1, "factories:exits raised SystemExit: 3"),
    (["profile", "factories:broken_len"], 1, "loading failed after 0 batches: RuntimeError: no length"),
    (["profile", "factories:fails_to_load"], 1, "loading failed after 0 batches: KeyError"),
    (["profile", "factories:fails_in_a_worker"], 1, "in DataLoader worker process 0. It was raised while "
     "fetching a batch (sample indices [0, 1, 2, 3]). The original error: ValueError: corrupt sample 0"),
])
@pytest.mark.timeout(60)
def test_bad_input_is_one_line_and_a_non_zero_status(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str],
    args: list[str], status: int, words: str,
) -> None:
    from pipeload import cli

    _write_factories(tmp_path)
    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv("PIPELOAD_CACHE", str(tmp_path / "cache"))
    monkeypatch.setattr(sys, "path", list(sys.path))
    try:
        returned = cli.main(args)
    except SystemExit as exit_:  # argparse's usage errors
        returned = exit_.code
    finally:
        sys.modules.pop("factories", None)  # each test writes its own
    lines = capsys.readouterr().err.strip().splitlines()
    assert returned == status and len(lines) == 1, lines
    assert words in lines[0], lines[0]
    # A mistake in what was asked reads as argparse's own do, whichever check caught it.
    usage_mistake = lines[0].startswith(f"pipeload {args[0]}: error: ")
    assert usage_mistake == (status == 2), lines[0]
    assert not (tmp_path / "cache").exists()  # refused before any dataset was written


@pytest.mark.timeout(120)
@pytest.mark.parametrize("factory, workers", [("slow_dataset", "1"),  # the other two: slow tests (~2 s each)
                                              pytest.param("slow_loader", "1", marks=pytest.mark.slow),
                                              pytest.param("slow_dataset", "auto", marks=pytest.mark.slow)])
def test_profile_with_few_batches_says_it_cannot_judge_yet(tmp_path: Path, factory: str,
                                                           workers: str) -> None:
    _write_factories(tmp_path)
    completed = pipeload_command(["profile", f"factories:{factory}", "--batches", "12",
                                  "--batch-size", "4", "--num-workers", workers], tmp_path, cwd=tmp_path)
    assert completed.returncode == 0, completed.stderr
    out = completed.stdout
    assert f"profiled 12 batches (1 epoch(s)) from factories:{factory}" in out
    assert "the training loop waited" in out and "verdict: too little to judge yet" in out, out
    assert "suggested settings: none yet (too little to judge" in out


@pytest.mark.slow  # judged by the same code with fewer batches in test_profile_with_few_batches_says_it_cannot_judge_yet (~6 s)
@pytest.mark.timeout(120)
def test_profile_loads_until_it_can_judge_by_default(tmp_path: Path) -> None:
    # 7 batches by default gave a confident verdict that was wrong; now it loads (epoch after
    # epoch: the dataset holds 100 batches) until it has twice what a verdict needs.
    _write_factories(tmp_path)
    completed = pipeload_command(["profile", "factories:slow_dataset", "--batch-size", "4",
                                  "--num-workers", "1"], tmp_path, cwd=tmp_path)
    assert completed.returncode == 0, completed.stderr
    out = completed.stdout
    profiled = re.search(r"profiled (\d+) batches \((\d+) epoch\(s\)\)", out)
    assert profiled and int(profiled[1]) >= 100, out
    assert "verdict: the workers limit loading, in the dataset's `__getitem__`" in out, out
    assert "too little" not in out


def _profile_in_process(tmp_path: Path, monkeypatch: pytest.MonkeyPatch, items: int,
                        args: list[str]) -> int:
    """``pipeload profile`` on a TensorDataset of ``items`` numbers, loaded in this process."""
    from pipeload import cli

    (tmp_path / "made.py").write_text(
        f"import torch\n\ndef make():\n    return torch.utils.data.TensorDataset(torch.arange({items}))\n")
    monkeypatch.chdir(tmp_path)
    monkeypatch.setattr(sys, "path", list(sys.path))
    try:
        return cli.main(["profile", "made:make", "--num-workers", "0", *args])
    finally:
        sys.modules.pop("made", None)


def _profile_module(tmp_path: Path, monkeypatch: pytest.MonkeyPatch, name: str, source: str,
                    args: list[str]) -> int:
    """``pipeload profile name:make`` in this process, ``name`` a module of ``source`` written here."""
    from pipeload import cli

    (tmp_path / f"{name}.py").write_text(source)
    monkeypatch.chdir(tmp_path)
    monkeypatch.setattr(sys, "path", list(sys.path))
    try:
        return cli.main(["profile", f"{name}:make", *args])
    finally:
        sys.modules.pop(name, None)


@pytest.mark.timeout(60)
def test_profile_stops_on_epochs_of_one_batch_and_says_why_it_cannot_judge(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str],
) -> None:
    # An epoch's first batch is never judged: epochs of one batch were loaded until
    # --max-seconds (60 s by default) for nothing, then told to "give --batches more".
    returned = _profile_in_process(tmp_path, monkeypatch, 8, ["--batch-size", "8", "--max-seconds", "20"])
    out = capsys.readouterr().out
    assert returned == 0
    assert "profiled 3 batches (3 epoch(s))" in out, out
    assert "none of the 3 epochs handed out more than one batch" in out
    assert "suggested settings: none yet (too little to judge; its epochs hold one batch each" in out, out


@pytest.mark.timeout(60)
def test_profile_stopped_by_its_time_limit_says_to_give_it_more_time(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str],
) -> None:
    # It said "give --batches more, or leave it out" to a run that gave no --batches.
    returned = _profile_in_process(tmp_path, monkeypatch, 400, ["--batch-size", "4", "--step-ms", "20",
                                                                   "--max-seconds", "0.5"])
    out = capsys.readouterr().out
    assert returned == 0
    assert "verdict: too little to judge yet" in out, out
    assert "suggested settings: none yet (too little to judge; it stopped at --max-seconds 0.5: give more)" in out, out


@pytest.mark.timeout(60)
@pytest.mark.parametrize("cache, words", [
    ("a_file", "the cache {cache} is not a directory; set PIPELOAD_CACHE"),
    ("a_file/below", "cannot write the dataset under {cache}: Not a directory; set PIPELOAD_CACHE"),
])
def test_bench_with_an_unusable_cache_is_one_line(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str],
    cache: str, words: str,
) -> None:
    from pipeload import cli

    (tmp_path / "a_file").write_text("")
    monkeypatch.setenv("PIPELOAD_CACHE", str(tmp_path / cache))
    returned = cli.main(["bench", "--size", "8", "--loaders", "threads", "--workers", "0", "--repeats", "1"])
    lines = capsys.readouterr().err.strip().splitlines()
    assert returned == 1 and len(lines) == 1, lines
    assert words.format(cache=tmp_path / cache) in lines[0], lines[0]


@pytest.mark.timeout(120)
def test_a_reader_that_leaves_early_gets_no_traceback(tmp_path: Path) -> None:
    # `pipeload profile ... | head -1`: the output pipe is closed before anything is written.
    _write_factories(tmp_path)
    marker = uuid.uuid4().hex
    env = {**os.environ, RUN_MARKER: marker, "PIPELOAD_CACHE": str(tmp_path / "cache"),
           "PYTHONPATH": str(REPO_ROOT / "src")}
    shm_before = shm_entries()
    process = subprocess.Popen(
        [sys.executable, "-m", "pipeload", "profile", "factories:slow_dataset", "--batches", "4",
         "--batch-size", "4", "--num-workers", "1"],
        cwd=tmp_path, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    process.stdout.close()
    _, stderr = process.communicate(timeout=SUBPROCESS_TIMEOUT_S)
    assert_run_left_nothing(marker, shm_before)
    assert process.returncode == 128 + 13, stderr  # as if SIGPIPE had ended it, as for other tools
    assert stderr == ""


@pytest.mark.slow
def test_bench_run_quick_on_the_tiny_workload(tmp_path: Path) -> None:
    marker = uuid.uuid4().hex
    shm_before = shm_entries()
    completed = subprocess.run(
        [sys.executable, "-m", "bench.run", "--quick", "--workload", "tiny"], cwd=REPO_ROOT,
        env={**os.environ, RUN_MARKER: marker}, capture_output=True, text=True,
        timeout=SUBPROCESS_TIMEOUT_S,
    )
    assert completed.returncode == 0, completed.stderr
    table = [line.split() for line in completed.stdout.splitlines()]
    loaders = [row[1] for row in table if row and row[0] == "tiny"]
    assert loaders == ["pipeload", "torch", "pipeload/torch"]
    ratio_row = next(row for row in table if row[:2] == ["tiny", "pipeload/torch"])
    assert re.fullmatch(r"\d+\.\d\dx", ratio_row[2])  # samples/s
    assert re.fullmatch(r"\d+\.\d\dx", ratio_row[3])  # time to first batch
    assert_run_left_nothing(marker, shm_before)


FACTORIES = '''
import time
import torch
import pipeload

class Slow(pipeload.Dataset):
    def __len__(self):
        return 400
    def __getitem__(self, index):
        until = time.perf_counter() + 0.002
        while time.perf_counter() < until:
            pass
        return torch.tensor([index])

def slow_dataset():
    return Slow()

def slow_loader():
    return pipeload.DataLoader(Slow(), batch_size=4, num_workers=1)

def raises():
    raise ValueError("no data today")

def not_a_dataset():
    return 42

def fails_to_load():
    return {"a": 1}

class Corrupt(torch.utils.data.Dataset):
    def __len__(self):
        return 64

    def __getitem__(self, index):
        raise ValueError(f"corrupt sample {index}")

def fails_in_a_worker():
    return pipeload.DataLoader(Corrupt(), batch_size=4, num_workers=1)

def stats_off():
    return pipeload.DataLoader(Slow(), batch_size=4, stats=False)

def the_class():
    return Slow

def exits():
    raise SystemExit(3)

class BrokenLen(Slow):
    def __len__(self):
        raise RuntimeError("no length")

def broken_len():
    return BrokenLen()
'''


def _write_factories(directory: Path) -> None:
    (directory / "factories.py").write_text(FACTORIES)


@pytest.mark.timeout(60)
def test_profile_says_warnings_in_one_line_each_and_keeps_the_users_place(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str],
) -> None:
    # The DataLoader the command builds has no line of the user's to point at (it read
    # "cli/profile.py:102"); a warning raised in the user's own code keeps its file and line.
    from pipeload import cli

    (tmp_path / "warns.py").write_text(
        "import warnings\nimport torch\n\ndef make():\n    warnings.warn('from the factory')\n"
        "    return torch.utils.data.TensorDataset(torch.arange(8))\n")
    monkeypatch.chdir(tmp_path)
    monkeypatch.setattr(sys, "path", list(sys.path))
    workers = len(os.sched_getaffinity(0)) + 1
    try:
        returned = cli.main(["profile", "warns:make", "--batches", "2", "--batch-size", "4",
                             "--num-workers", str(workers)])  # processes: threads are not warned about
    finally:
        sys.modules.pop("warns", None)
    err = capsys.readouterr().err.splitlines()
    assert returned == 0, err
    assert f"pipeload profile: UserWarning: from the factory ({tmp_path / 'warns.py'}:5)" in err, err
    too_many = [line for line in err if f"will create {workers} worker processes" in line]
    assert too_many and all(line.startswith("pipeload profile: UserWarning: This DataLoader")
                            and line.endswith("if necessary.") for line in too_many), err


@pytest.mark.slow  # ~5 s; tests/stats covers the verdict in process
@pytest.mark.timeout(90)
def test_profile_of_workers_slow_to_start_stops_on_their_start_ups_and_suggests_persistent_workers(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str], leak_guard,
) -> None:
    # Epochs that are mostly workers starting never gather the steady seconds a verdict needs:
    # it loaded until --max-seconds and said "too little to judge", never naming the start-up.
    returned = _profile_module(tmp_path, monkeypatch, "slow_start", (
        "import time\nimport pipeload\n\n"
        "def heavy_set_up(worker_id):\n    time.sleep(1.0)  # each new worker's set-up\n\n"
        "def make():\n    return pipeload.DataLoader(list(range(200)), batch_size=4, num_workers=2,\n"
        "                               multiprocessing_context='fork', worker_init_fn=heavy_set_up)\n"),
        ["--max-seconds", "40"])
    out = capsys.readouterr().out
    assert returned == 0, out
    assert "verdict: the workers start anew each epoch" in out, out
    assert "suggested settings: DataLoader(..., persistent_workers=True)" in out, out
    # Stopped on the start-ups' evidence (twice what is needed: 4 epochs and 4 s, each epoch at
    # least its 1 s start), not at the limit.
    profiled = re.search(r"profiled \d+ batches \((\d+) epoch\(s\)\)", out)
    assert profiled and 4 <= int(profiled[1]) <= 5, out


@pytest.mark.slow  # ~5 s; tests/stats covers the verdict in process
@pytest.mark.timeout(90)
def test_profile_under_auto_judges_once_the_tuner_settles(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str], leak_guard,
) -> None:
    # It stopped on the evidence alone, judging figures that mixed the settings the tuner was
    # still trying (2, 8, 32, 64 workers), and told a tuner at its cap "try num_workers=64".
    returned = _profile_module(tmp_path, monkeypatch, "reads", (
        "import time\nimport torch\n\nclass RemoteReads(torch.utils.data.Dataset):\n"
        "    def __len__(self):\n        return 4000\n\n    def __getitem__(self, index):\n"
        "        time.sleep(0.02)  # a remote read's latency: workers wait, CPUs stay free\n"
        "        return index\n\ndef make():\n    return RemoteReads()\n"),
        ["--num-workers", "auto", "--worker-type", "thread", "--batch-size", "4"])
    out = capsys.readouterr().out
    assert returned == 0, out
    assert "still tuning" not in out and "too little" not in out, out
    assert "try num_workers=64" not in out, out


def test_the_command_tells_its_version(capsys: pytest.CaptureFixture[str]) -> None:
    import torch

    import pipeload
    from pipeload import cli

    with pytest.raises(SystemExit) as exited:
        cli.main(["--version"])
    assert exited.value.code == 0
    assert capsys.readouterr().out.strip() == f"pipeload {pipeload.__version__} (torch {torch.__version__})"


def test_the_command_without_a_subcommand_names_the_subcommands_in_one_line(
    capsys: pytest.CaptureFixture[str],
) -> None:
    from pipeload import cli

    with pytest.raises(SystemExit) as exited:
        cli.main([])
    assert exited.value.code == 2
    lines = capsys.readouterr().err.strip().splitlines()
    assert lines == ["pipeload: error: the following arguments are required: COMMAND "
                     "(choose from 'bench', 'profile'; pipeload --help says more)"]
