"""A Ctrl-C that comes while the garbage collection runs one of the loader's finalizers (an
iterator dropped after ``break``, a loader dropped to make the next epoch's) reaches the training
loop as a KeyboardInterrupt: raised inside a finalizer, Python prints it as "Exception ignored"
and drops it, and the loop went on.

The moment is made exact with a profile hook that sends SIGINT as the named function starts, in
a process of its own.
"""

from __future__ import annotations

import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

SRC = str(Path(__file__).resolve().parents[2] / "src")

SCRIPT = """
    import os, signal, sys
    import torch
    import pipeload

    class Small(pipeload.Dataset):
        def __len__(self):
            return 64

        def __getitem__(self, index):
            return torch.zeros(3, 8, 8)

    def press_ctrl_c_as(name):
        def hook(frame, event, arg):
            if event == "call" and frame.f_code.co_name == name:
                sys.setprofile(None)
                os.kill(os.getpid(), signal.SIGINT)
        return hook

    try:
        for epoch in range(6):
            loader = pipeload.DataLoader(Small(), batch_size=4, num_workers=2,
                                         multiprocessing_context="fork")
            for number, batch in enumerate(loader):
                if number == 2:
                    break
            if epoch == 1:
                sys.setprofile(press_ctrl_c_as({name!r}))
        print("went on")
    except KeyboardInterrupt:
        print("interrupted")
"""


@pytest.mark.timeout(120)
@pytest.mark.parametrize("name", ["epoch_ended", "_absorb"])
def test_a_ctrl_c_during_a_finalizer_reaches_the_training_loop(name: str, ctrl_c_raises: None) -> None:
    done = subprocess.run([sys.executable, "-c", textwrap.dedent(SCRIPT).format(name=name)],
                          capture_output=True, text=True, timeout=100, env={"PYTHONPATH": SRC, "PATH": "/usr/bin:/bin"})
    assert done.stdout.split() == ["interrupted"], done.stderr[-2000:]
    assert "Exception ignored" not in done.stderr
