"""Datasets and hooks that misbehave on purpose, for the engine's fault tests.

They live in an importable module (not inside a test) so that spawn and forkserver workers can
unpickle them by reference.
"""

from __future__ import annotations

import ctypes
import faulthandler
import os
import signal
import threading
import time
from dataclasses import dataclass
from typing import Any

import torch

from pipeload import IterableDataset, get_worker_info

@dataclass(frozen=True)
class EngineChoice:
    """Which engine a behaviour is proven on: the worker type, start method and mode."""

    name: str
    worker_type: str
    context: str | None
    mode: str = "classic"

    @property
    def threads(self) -> bool:
        return self.worker_type == "thread"

    @property
    def economic(self) -> bool:
        return self.mode == "economic"


FORK = EngineChoice("fork", "process", "fork")
SPAWN = EngineChoice("spawn", "process", "spawn")
THREAD = EngineChoice("thread", "thread", None)
ECONOMIC = EngineChoice("economic-fork", "process", "fork", "economic")
ECONOMIC_SPAWN = EngineChoice("economic-spawn", "process", "spawn", "economic")
ECONOMIC_THREAD = EngineChoice("economic-thread", "thread", None, "economic")


def loader_kwargs(engine: EngineChoice) -> dict[str, Any]:
    """DataLoader keyword arguments that select ``engine``."""
    kwargs: dict[str, Any] = {"worker_type": engine.worker_type}
    if not engine.threads:
        kwargs["multiprocessing_context"] = engine.context
    if engine.economic:
        kwargs["mode"] = "economic"
    return kwargs


def engine_params(*engines: EngineChoice, slow: tuple[EngineChoice, ...] = ()) -> list[Any]:
    """pytest params with readable ids, for ``@pytest.mark.parametrize("engine", ...)``; those
    in ``slow`` run only with ``-m slow`` (economic mode under spawn starts four interpreters)."""
    import pytest

    return [pytest.param(engine, id=engine.name, marks=[pytest.mark.slow] if engine in slow else [])
            for engine in engines]


class SampleFailed(Exception):
    """A user exception type the main process must get back unchanged."""


class InitFailed(Exception):
    """Raised by a worker_init_fn."""


class Numbers:
    """Map-style: item i is i."""

    def __init__(self, length: int) -> None:
        self.length = length

    def __len__(self) -> int:
        return self.length

    def __getitem__(self, index: int) -> int:
        return index


class RaisesAt(Numbers):
    """Raises ``SampleFailed`` (or ``exc_type``) at one index."""

    def __init__(self, length: int, bad_index: int, exc_type: type[Exception] = SampleFailed) -> None:
        super().__init__(length)
        self.bad_index = bad_index
        self.exc_type = exc_type

    def __getitem__(self, index: int) -> int:
        if index == self.bad_index:
            raise self.exc_type(f"sample {index} is corrupt")
        return index


def die(how: str) -> None:
    """End this process the way a real crash would, without Python's cleanup."""
    # pytest's faulthandler, inherited through fork, would print a "Fatal Python error" dump
    # for a crash this test means to cause; keep the log for real failures.
    faulthandler.disable()
    if how == "sigkill":
        os.kill(os.getpid(), signal.SIGKILL)
    elif how == "segfault":
        ctypes.string_at(0)
    elif how == "sigbus":
        os.kill(os.getpid(), signal.SIGBUS)
    elif how == "exit3":
        os._exit(3)
    raise AssertionError(f"still alive after {how}")


class DiesAt(Numbers):
    """The worker that fetches ``bad_index`` dies (``how``: sigkill, segfault, sigbus, exit3)."""

    def __init__(self, length: int, bad_index: int, how: str) -> None:
        super().__init__(length)
        self.bad_index = bad_index
        self.how = how

    def __getitem__(self, index: int) -> int:
        if index == self.bad_index:
            die(self.how)
        return index


def delay_for(index: int, unit_s: float = 0.004) -> float:
    """A deterministic, uneven per-index delay: indices differ by up to 6 units."""
    return ((index * 7919) % 7) * unit_s


class Uneven(Numbers):
    """Item i is i, after a deterministic delay that makes some workers fall behind."""

    def __init__(self, length: int, unit_s: float = 0.004) -> None:
        super().__init__(length)
        self.unit_s = unit_s

    def __getitem__(self, index: int) -> int:
        time.sleep(delay_for(index, self.unit_s))
        return index


class Stalls(Numbers):
    """Fetching ``stall_index`` blocks until ``release`` is set, or for ``stall_s``.

    Only thread workers share ``release`` with the test; a process worker has its own copy,
    which nobody sets, so it stays blocked until it is stopped.
    """

    def __init__(self, length: int, stall_index: int = 0, stall_s: float = 60.0) -> None:
        super().__init__(length)
        self.stall_index = stall_index
        self.stall_s = stall_s
        self.release = threading.Event()

    def __getitem__(self, index: int) -> int:
        if index == self.stall_index:
            self.release.wait(self.stall_s)
        return index


class StallsAndSaysSo(Stalls):
    """Stalls (see there), and first creates the file ``notice`` when it reaches ``stall_index``,
    so that a test can tell the worker is stuck in user code."""

    def __init__(self, length: int, stall_index: int, notice: str) -> None:
        super().__init__(length, stall_index)
        self.notice = notice

    def __getitem__(self, index: int) -> int:
        if index == self.stall_index:
            open(self.notice, "w").close()
        return super().__getitem__(index)


class BrokenIter(IterableDataset):
    """``__iter__`` itself raises."""

    def __iter__(self) -> Any:
        raise SampleFailed("cannot open the shard")


class FailsMidStream(IterableDataset):
    """Yields a few items, then raises from inside the generator."""

    def __init__(self, good: int) -> None:
        self.good = good

    def __iter__(self) -> Any:
        yield from range(self.good)
        raise SampleFailed(f"stream broke after {self.good} items")


class Shards(IterableDataset):
    """range(length), split between workers; worker w gets every num_workers-th item from w."""

    def __init__(self, length: int, unit_s: float = 0.0) -> None:
        self.length = length
        self.unit_s = unit_s

    def __iter__(self) -> Any:
        info = get_worker_info()
        start, step = (0, 1) if info is None else (info.id, info.num_workers)
        for item in range(start, self.length, step):
            time.sleep(delay_for(item, self.unit_s))
            yield item


class MakesTensors(Numbers):
    """Item i is a float tensor of ``width`` copies of i, made inside the worker."""

    def __init__(self, length: int, width: int = 16) -> None:
        super().__init__(length)
        self.width = width

    def __getitem__(self, index: int) -> torch.Tensor:
        return torch.full((self.width,), float(index))


class MakesTensorsThenDies(MakesTensors):
    """MakesTensors whose worker dies (``how``) when it fetches ``bad_index``."""

    def __init__(self, length: int, width: int, bad_index: int, how: str) -> None:
        super().__init__(length, width)
        self.bad_index = bad_index
        self.how = how

    def __getitem__(self, index: int) -> torch.Tensor:
        if index == self.bad_index:
            die(self.how)
        return super().__getitem__(index)


def mixed_layout_collate(samples: list[torch.Tensor]) -> dict[str, Any]:
    """A custom collate whose outputs are not plain stacked tensors: a transposed (non-contiguous)
    tensor, two views of one storage, a numpy array, a string and a number."""
    stacked = torch.stack(samples)
    return {
        "transposed": stacked.t(),
        "first_half": stacked[:, : stacked.shape[1] // 2],
        "every_other_row": stacked[::2],
        "numpy": stacked[:, :4].numpy().copy(),
        "name": f"batch of {len(samples)}",
        "count": len(samples),
    }


class PinsItself:
    """A custom batch type: the pin stage must call its own ``pin_memory()``."""

    def __init__(self, data: torch.Tensor, pinned_by_itself: bool = False) -> None:
        self.data = data
        self.pinned_by_itself = pinned_by_itself

    def pin_memory(self) -> PinsItself:
        return PinsItself(self.data.pin_memory(), pinned_by_itself=True)


def pins_itself_collate(samples: list[torch.Tensor]) -> PinsItself:
    return PinsItself(torch.stack(samples))


def failing_collate(samples: list[Any]) -> Any:
    raise KeyError(f"collate could not find key for {len(samples)} samples")


def stalling_init(worker_id: int) -> None:
    """worker_init_fn that never returns in time: the worker reads no task at all."""
    threading.Event().wait(60.0)


def record_pid_then_stall(worker_id: int) -> None:
    """worker_init_fn: say who we are (see record_worker_pid), then read no task at all."""
    record_worker_pid(worker_id)
    stalling_init(worker_id)


def failing_init(worker_id: int) -> None:
    raise InitFailed(f"worker_init_fn refused worker {worker_id}")


def flatten(batches: list[Any]) -> list[int]:
    """Every item of every batch, as ints, in the order received."""
    items: list[int] = []
    for batch in batches:
        if isinstance(batch, torch.Tensor):
            batch = batch.tolist()
        items.extend(int(x) for x in (batch if isinstance(batch, list) else [batch]))
    return items


def record_worker_pid(worker_id: int) -> None:
    """worker_init_fn: write this worker's pid to $PIPELOAD_TEST_PID_DIR/<worker_id>."""
    path = os.path.join(os.environ["PIPELOAD_TEST_PID_DIR"], str(worker_id))
    with open(path + ".tmp", "w") as out:
        out.write(str(os.getpid()))
    os.replace(path + ".tmp", path)  # readers only ever see a whole file


def worker_pids(iterator: Any) -> list[int]:
    """Pids of an epoch iterator's process workers."""
    return [handle.pid for handle in iterator._workers]
