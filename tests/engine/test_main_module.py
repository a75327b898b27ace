"""A 'spawn' worker that cannot find the dataset's class in the main script: the error says which
class, where it is defined, and what to do, after torch's words (which alone send the reader to
``num_workers=0``, where the same code works)."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from pipeload.engine.main_module import _top_level_names

pytestmark = pytest.mark.timeout(120)

SRC = str(Path(__file__).resolve().parents[2] / "src")

SCRIPT = """
import os, sys
import torch
import pipeload

{top}

def main():
    try:
        for batch in pipeload.DataLoader(Numbers(), batch_size=2, num_workers=1,
                                         multiprocessing_context="spawn"):
            print("batch", batch.tolist())
    except RuntimeError as error:
        print("ERROR", error)

if __name__ == "__main__":
{guarded}
    main()
"""

NUMBERS = """
class Numbers(torch.utils.data.Dataset):
    def __len__(self):
        return 4
    def __getitem__(self, index):
        {body}
        return index
"""


def _run(tmp_path: Path, top: str, guarded: str) -> str:
    script = tmp_path / "train.py"
    script.write_text(SCRIPT.format(top=top, guarded=textwrap.indent(guarded, "    ")))
    env = dict(os.environ, PYTHONPATH=SRC + os.pathsep + os.environ.get("PYTHONPATH", ""))
    done = subprocess.run([sys.executable, str(script)], capture_output=True, text=True, env=env,
                          timeout=90, cwd=tmp_path)
    assert done.returncode == 0, done.stderr
    return done.stdout


def test_a_dataset_class_defined_under_the_main_guard_is_named_with_where_and_what_to_do(tmp_path):
    out = _run(tmp_path, top="", guarded=NUMBERS.format(body="pass"))
    assert out.startswith("ERROR DataLoader worker (pid "), out  # torch's words first
    assert "exited unexpectedly with exit code 1" in out
    assert (f"dataset: Numbers is defined in {tmp_path / 'train.py'} inside "
            "`if __name__ == '__main__':`") in out
    assert "Can't get attribute 'Numbers'" in out
    assert "Define Numbers at the top level of the script or in a module of its own" in out


@pytest.mark.slow  # ~4 s of spawned interpreters; the test above names the class in the fast suite
def test_a_worker_that_exits_with_code_1_for_another_reason_blames_no_class(tmp_path):
    out = _run(tmp_path, top=NUMBERS.format(body="os._exit(1)"), guarded="")
    assert "exited unexpectedly with exit code 1" in out
    assert "is defined in" not in out and "Define Numbers" not in out


def test_the_names_a_worker_finds_are_those_bound_outside_the_main_guard(tmp_path):
    script = tmp_path / "names.py"
    script.write_text(textwrap.dedent("""
        import numpy as np, os.path
        from torch.utils.data import Dataset as Base
        try:
            import yaml
        except ImportError:
            fallback = None
        with open(__file__) as source:
            pass
        for index in range(2):
            pass
        if True:
            class Kept(Base): pass
        else:
            def other(): pass
        if "__main__" == __name__:
            class Guarded(Base): pass
        else:
            class ImportedOnly(Base): pass
        def top(): local = 1
        total: int = 0
    """))
    assert _top_level_names(str(script)) == {
        "np", "os", "Base", "yaml", "fallback", "source", "index", "Kept", "other",
        "ImportedOnly", "top", "total"}


def test_a_script_that_cannot_be_read_gives_no_names(tmp_path):
    assert _top_level_names(str(tmp_path / "missing.py")) is None
    broken = tmp_path / "broken.py"
    broken.write_text("def (:\n")
    assert _top_level_names(str(broken)) is None


UNGUARDED = """
import sys
import torch
import pipeload

class Numbers(torch.utils.data.Dataset):
    def __init__(self, length):
        self.values = [float(i) for i in range(length)]
    def __len__(self):
        return len(self.values)
    def __getitem__(self, index):
        return torch.tensor(self.values[index])

try:
    for batch in pipeload.DataLoader(Numbers({length}), batch_size=2, num_workers=1, mode="{mode}",
                                     multiprocessing_context="{method}"):
        pass
    print("DONE")
except pipeload.errors.WorkerDiedError as error:  # the worker's own error is multiprocessing's
    print("ERROR", error)
"""


def _run_unguarded(tmp_path: Path, **fields: object) -> str:
    script = tmp_path / "train.py"
    script.write_text(UNGUARDED.format(**fields))
    env = dict(os.environ, PYTHONPATH=SRC + os.pathsep + os.environ.get("PYTHONPATH", ""))
    done = subprocess.run([sys.executable, "-W", "ignore", str(script)], capture_output=True,
                          text=True, env=env, timeout=60, cwd=tmp_path)
    assert done.returncode == 0, done.stderr
    return done.stdout


def test_a_script_without_a_main_guard_gets_the_line_to_move_not_a_hang(tmp_path):
    # Economic mode's batch worker was sent 526 KB (two read buffers) at start: past a pipe's
    # 64 KiB, its death during the import left the main process blocked in the write for good.
    out = _run_unguarded(tmp_path, length=8, mode="economic", method="spawn")
    assert out.startswith("ERROR DataLoader worker (pid "), out  # torch's words first
    assert "exited unexpectedly with exit code 1" in out
    assert (f"line 15 of {tmp_path / 'train.py'} starts the DataLoader's workers outside "
            "`if __name__ == '__main__':`") in out
    assert "bootstrapping phase" in out


@pytest.mark.slow  # the spawn case runs fast enough to stay; the same path under forkserver (~3 s)
def test_a_forkserver_worker_gone_before_reading_a_large_dataset_is_a_worker_death(tmp_path):
    # 200,000 floats pickle to ~1.8 MB: the write of the worker's start-up data breaks when it
    # dies importing the script (multiprocessing's BrokenPipeError, torch's error too).
    out = _run_unguarded(tmp_path, length=200_000, mode="classic", method="forkserver")
    assert out.startswith("ERROR DataLoader worker (pid "), out
    assert "worker 0 (pid " in out and "ended with exit code 1" in out
    assert "line 15 of" in out and "bootstrapping phase" in out


def test_a_spawned_worker_gone_before_reading_a_large_dataset_is_a_worker_death_not_a_hang(tmp_path):
    # multiprocessing's spawn writes the ~1.8 MB while the parent still holds the child's end of
    # the pipe: the write waited for good (torch's loader hangs there too). Ours lets go of it
    # first, so the write breaks (engine/spawn_launch.py).
    out = _run_unguarded(tmp_path, length=200_000, mode="classic", method="spawn")
    assert out.startswith("ERROR DataLoader worker (pid "), out
    assert "worker 0 (pid " in out and "ended with exit code 1" in out
    assert "line 15 of" in out and "bootstrapping phase" in out


def test_a_loader_started_under_a_main_guard_of_any_form_is_not_blamed_on_it(tmp_path):
    # Better silent than blaming a guarded line: any top-level statement that mentions
    # __name__ counts as a guard.
    script = tmp_path / "guarded.py"
    script.write_text(textwrap.dedent("""
        from pipeload.engine.main_module import started_outside_main_guard
        def main():
            print(repr(started_outside_main_guard()))
        if __name__ == "__main__":
            main()
        if __name__ == "__main__" and True:
            main()
        try:
            if __name__ == "__main__":
                main()
        finally:
            pass
        main() if __name__ == "__main__" else None
        __name__ == "__main__" and main()
        main()
    """))
    env = dict(os.environ, PYTHONPATH=SRC + os.pathsep + os.environ.get("PYTHONPATH", ""))
    done = subprocess.run([sys.executable, str(script)], capture_output=True, text=True, env=env,
                          timeout=60, cwd=tmp_path)
    *guarded, unguarded = done.stdout.splitlines()
    assert guarded == ["''"] * 5, done.stdout + done.stderr
    assert f"line 16 of {script} starts the DataLoader" in unguarded
