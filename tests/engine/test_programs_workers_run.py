"""A program that the user's code runs from a worker (``os.system``, ``subprocess`` with
``close_fds=False``) inherits none of the worker's channels or shared memory.

A spawn or forkserver worker receives its pipes, sockets and segments as inheritable
descriptors (that is how they cross ``exec``); such a program held them open for as long as it
ran: a channel the main process waits on to close, a segment it freed. Workers now mark them
close-on-exec as they start, as Python makes its own descriptors.
"""

from __future__ import annotations

import subprocess
import sys

import pytest
import torch
from faults import ECONOMIC_SPAWN, FORK, SPAWN, EngineChoice, engine_params, loader_kwargs

from pipeload import DataLoader

pytestmark = [pytest.mark.usefixtures("leak_guard"), pytest.mark.timeout(90),
              pytest.mark.filterwarnings("ignore:This DataLoader will create:UserWarning")]

LIST_DESCRIPTORS = "import os; print(sorted(int(f) for f in os.listdir('/proc/self/fd')))"


class ListsWhatAProgramInherits(torch.utils.data.Dataset):
    """Item i: the descriptors a program run from the worker finds open (its stdio, and the
    one its own listing opens, besides anything inherited)."""

    def __len__(self) -> int:
        return 2

    def __getitem__(self, index: int) -> list[int]:
        run = subprocess.run([sys.executable, "-S", "-I", "-c", LIST_DESCRIPTORS], close_fds=False,
                             capture_output=True, text=True, check=True)
        return eval(run.stdout)  # a list of ints, printed by the line above


def as_is(item: list[int]) -> list[int]:
    return item


@pytest.mark.parametrize("engine", engine_params(SPAWN, FORK, ECONOMIC_SPAWN, slow=(ECONOMIC_SPAWN,)))
def test_a_program_run_from_a_worker_inherits_nothing_of_the_worker(engine: EngineChoice) -> None:
    loader = DataLoader(ListsWhatAProgramInherits(), batch_size=None, num_workers=1,
                        collate_fn=as_is, **loader_kwargs(engine))
    for inherited in loader:
        assert inherited == [0, 1, 2, 3], inherited  # stdio, and the listing's own
