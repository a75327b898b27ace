"""The README's code runs as written and prints what its comments say.

Each example is taken from README.md itself (so an edit there is what is tested), given only what
the text says the reader supplies, and run in a fresh process marked so that nothing it started
may outlive it. Examples that need a cluster, remote storage or the reader's own data are left to
the tests of their rooms.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
import uuid
from pathlib import Path

import pytest
from conftest import RUN_MARKER, assert_run_left_nothing, shm_entries

ROOT = Path(__file__).resolve().parents[1]
README = ROOT / "README.md"
RUN_TIMEOUT_S = 120  # each example takes a few seconds; a loaded 2-core box, several times that

pytestmark = pytest.mark.timeout(2 * RUN_TIMEOUT_S)


def python_blocks() -> list[str]:
    """The README's ```python blocks, in order."""
    return re.findall(r"```python\n(.*?)```", README.read_text(), flags=re.DOTALL)


def block_with(marker: str) -> str:
    (block,) = [block for block in python_blocks() if marker in block]
    return block


def run(code: str) -> str:
    """``code`` run by this Python with pipeload from the source tree; its stdout."""
    marker, shm_before = uuid.uuid4().hex, shm_entries()
    env = {**os.environ, RUN_MARKER: marker, "PYTHONPATH": str(ROOT / "src")}
    done = subprocess.run([sys.executable, "-c", code], env=env, cwd=ROOT, text=True,
                          capture_output=True, timeout=RUN_TIMEOUT_S)
    assert_run_left_nothing(marker, shm_before)
    assert done.returncode == 0, done.stderr
    return done.stdout


def test_the_ten_lines_run_as_written() -> None:
    run(block_with("import pipeload as data"))


def test_the_separate_process_example_prints_what_its_comment_shows() -> None:
    # It printed () before: the loader places the boundary when an epoch starts.
    block = block_with("def is_separate_process(self)")
    # What the reader supplies: the files, and the body the example leaves as `...`.
    supplied = block.replace(
        "        return True\n    ...\n",
        "        return True\n"
        "    def __init__(self, source):\n"
        "        self.source = source\n"
        "    def __iter__(self):\n"
        "        return (name.upper() for name in self.source)\n",
    )
    assert supplied != block
    prelude = ("import pipeload\nfrom pipeload.datapipes.iter import IterableWrapper\n"
               "files = IterableWrapper(['a.jpg', 'b.jpg', 'c.jpg'])\n")
    printed = run(prelude + supplied).strip()
    promised = block.rsplit("# ", 1)[1].strip()
    assert printed == promised


def test_the_stats_example_runs_as_written_and_prints_the_summary() -> None:
    # It named a `dataset` and a `train_step` the reader had to invent: a NameError as written.
    printed = run(block_with("print(loader.stats())"))
    assert printed.startswith("pipeload stats: 128 batches in 4 epoch(s)"), printed
    assert "setup: a map-style dataset, mode=classic, num_workers=2" in printed, printed
    # 124 batches past the epochs' first, 20 ms each at least: enough to judge, on any box.
    assert "\nverdict: " in printed and "too little" not in printed, printed


def test_the_datapipes_example_loads_each_sample_once() -> None:
    printed = run(block_with(".queue_boundary(\"thread\", buffer_size=32)"))
    assert printed.strip() == "True", printed
