"""Every warning pipeload raises in the training loop's process points at the user's line (the
call that made the mistake), not into pipeload: a warning's file and line are how a user finds
what to change.

Each case below makes one typical mistake on a line marked ``# warns here``; the warnings it
raises must name this file and that line.
"""

from __future__ import annotations

import linecache
import os
import warnings
from collections.abc import Callable, Iterator
from typing import Any

import pytest

import pipeload
from pipeload.datapipes.iter import IterableWrapper
from pipeload.datapipes.map import SequenceWrapper

MARK = "# warns here"
CPUS = len(os.sched_getaffinity(0))


class Counted(pipeload.IterableDataset):
    """Says it has 2 samples, yields 4."""

    def __iter__(self) -> Iterator[int]:
        return iter(range(4))

    def __len__(self) -> int:
        return 2


class NoDeepCopy:
    def __iter__(self) -> Iterator[int]:
        return iter(range(3))

    def __getitem__(self, index: int) -> int:
        return index

    def __len__(self) -> int:
        return 3

    def __deepcopy__(self, memo: object) -> NoDeepCopy:
        raise TypeError("no deep copies")


class Plain:
    """A sampler of the user's own, without state_dict()."""

    def __init__(self, n: int) -> None:
        self.n = n

    def __iter__(self) -> Iterator[int]:
        return iter(range(self.n))

    def __len__(self) -> int:
        return self.n


def too_many_workers() -> None:
    loader = pipeload.DataLoader(range(4), num_workers=CPUS + 1)  # warns here (threads would not)
    list(loader)  # warns here (again, as torch does at each epoch)


def iterable_longer_than_its_length() -> None:
    loader = pipeload.DataLoader(Counted(), batch_size=1)
    len(loader)
    for _ in loader:  # warns here
        pass


def pin_memory_without_accelerator() -> None:
    list(pipeload.DataLoader(range(4), pin_memory=True, pin_memory_device="cuda"))  # warns here


def every_rank_loads_everything(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("RANK", "0")
    monkeypatch.setenv("WORLD_SIZE", "2")
    loader = pipeload.DataLoader(range(8), batch_size=4)
    iter(loader)  # warns here


def unsharded_graph() -> None:
    loader = pipeload.DataLoader(IterableWrapper(range(8)), num_workers=2, worker_type="thread")
    list(loader)  # warns here


def shuffle_without_a_shuffle_step() -> None:
    pipeload.DataLoader(IterableWrapper(range(8)).sharding_filter(), shuffle=True)  # warns here


def random_split_with_an_empty_part() -> None:
    pipeload.random_split(range(3), [0.9, 0.05, 0.05])  # warns here


def misspelt_cumulative_sizes() -> None:
    pipeload.ConcatDataset([range(2), range(3)]).cummulative_sizes  # warns here  # noqa: B018


def lambda_in_a_pipe() -> None:
    IterableWrapper(range(3)).map(lambda x: x)  # warns here


def unlimited_fork_buffer() -> None:
    IterableWrapper(range(3)).fork(2, buffer_size=-1)  # warns here


def uncopyable_sequence() -> None:
    SequenceWrapper(NoDeepCopy())  # warns here


def uncopyable_iterable() -> None:
    list(IterableWrapper(NoDeepCopy()))  # warns here


def shuffle_settings_without_shuffle() -> None:
    pipeload.graph_settings.apply_shuffle_settings(IterableWrapper(range(3)), shuffle=True)  # warns here


def copy_on_read_dataset() -> None:
    class Paths(pipeload.Dataset):
        def __init__(self) -> None:
            self.labels = [0] * 1_000_001  # beyond the warning's threshold of a million objects

        def __len__(self) -> int:
            return 2

        def __getitem__(self, index: int) -> int:
            return self.labels[index]

    loader = pipeload.DataLoader(Paths(), num_workers=1, multiprocessing_context="fork")
    list(loader)  # warns here


def resume_with_a_sampler_without_state() -> None:
    loader = pipeload.DataLoader(range(6), sampler=Plain(6), batch_size=2)
    iterator = iter(loader)
    next(iterator)
    state = loader.state_dict()
    fresh = pipeload.DataLoader(range(6), sampler=Plain(6), batch_size=2)
    fresh.load_state_dict(state)  # warns here


def resume_an_iterable_without_state() -> None:
    class Stream(pipeload.IterableDataset):
        def __iter__(self) -> Iterator[int]:
            return iter(range(6))

    loader = pipeload.DataLoader(Stream(), batch_size=2)
    iterator = iter(loader)
    next(iterator)
    state = loader.state_dict()
    fresh = pipeload.DataLoader(Stream(), batch_size=2)
    fresh.load_state_dict(state)  # warns here


def share_containers_with_an_unpicklable_item() -> None:
    class Holder(pipeload.Dataset):
        def __init__(self) -> None:
            self.items = [lambda: None] * 3

    pipeload.share_containers(Holder(), min_items=1)  # warns here


def fork_branch_restarted_unfinished() -> None:
    first, _ = IterableWrapper(range(4)).fork(2)
    iterator = iter(first)
    next(iterator)
    iter(first)  # warns here


def _read_and_close(item: tuple[str, Any]) -> bytes:
    with item[1] as stream:
        return stream.read()


def skipped_unreadable_file(tmp_path_factory: pytest.TempPathFactory) -> None:
    from pipeload.datapipes.sources import FileOpener

    folder = tmp_path_factory.mktemp("files")
    (folder / "present.bin").write_bytes(b"x")  # an epoch in which every file failed is an error
    files = [str(folder / "missing.bin"), str(folder / "present.bin")]
    loader = pipeload.DataLoader(FileOpener(IterableWrapper(files), on_error="skip").map(_read_and_close),
                                 batch_size=None)
    list(loader)  # warns here


CASES: list[Callable[..., None]] = [
    too_many_workers, iterable_longer_than_its_length,
    pin_memory_without_accelerator, every_rank_loads_everything, unsharded_graph,
    shuffle_without_a_shuffle_step, random_split_with_an_empty_part, misspelt_cumulative_sizes,
    lambda_in_a_pipe, unlimited_fork_buffer, uncopyable_sequence, uncopyable_iterable,
    shuffle_settings_without_shuffle, copy_on_read_dataset, resume_with_a_sampler_without_state,
    resume_an_iterable_without_state, share_containers_with_an_unpicklable_item,
    fork_branch_restarted_unfinished, skipped_unreadable_file,
]


@pytest.mark.parametrize("misuse", CASES, ids=[case.__name__ for case in CASES])
def test_the_warning_points_at_the_users_line(misuse: Callable[..., None], monkeypatch: pytest.MonkeyPatch,
                                              tmp_path_factory: pytest.TempPathFactory) -> None:
    if misuse is pin_memory_without_accelerator and pipeload.pin.pinning_available():
        pytest.skip("an accelerator is present: pinning works, nothing to warn about")
    fixtures = {every_rank_loads_everything: (monkeypatch,), skipped_unreadable_file: (tmp_path_factory,)}
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        misuse(*fixtures.get(misuse, ()))
    assert caught, f"{misuse.__name__} raised no warning"
    where = [(os.path.basename(w.filename), w.lineno, str(w.message)[:60]) for w in caught]
    for warning in caught:
        assert warning.filename == __file__, where
        assert MARK in linecache.getline(warning.filename, warning.lineno), where

