"""Pipe iterators' checkpoints, as the DataLoader uses them to resume: a fresh iterator loaded
with a state taken after k items yields exactly what the original went on to yield; iterators
that keep no checkpoint say so, and the loader skips instead."""

from __future__ import annotations

import json
import warnings
from collections.abc import Callable
from typing import Any

import pytest
import torch

import pipeload
from pipeload.datapipes.iter import Cycler, IterableWrapper
from pipeload.datapipes.map import SequenceWrapper

PIPES: dict[str, Callable[[], Any]] = {
    "flatmap": lambda: IterableWrapper(["ab", "cde", "", "fghi"]).flatmap(list),
    "unbatch": lambda: IterableWrapper([[1, 2, 3], [4], [5, 6]]).unbatch(),
    "batch-unbatch": lambda: IterableWrapper(range(10)).batch(3).unbatch(),
    "shuffle-shard": lambda: IterableWrapper(range(12)).shuffle(buffer_size=4).set_seed(5).sharding_filter(),
}


@pytest.mark.parametrize("name", PIPES)
@pytest.mark.parametrize("taken", [0, 1, 2, 4])
def test_a_loaded_iterator_goes_on_where_the_original_was(name: str, taken: int) -> None:
    pipe = PIPES[name]()
    iterator = iter(pipe)
    head = [next(iterator) for _ in range(taken)]
    state = json.loads(json.dumps(iterator.state_dict()))
    rest = list(iterator)
    resumed = iter(PIPES[name]())
    resumed.load_state_dict(state)
    assert head + list(resumed) == head + rest


def test_iterators_without_a_checkpoint_say_so() -> None:
    zipped = iter(IterableWrapper(range(3)).zip(IterableWrapper(range(3))))
    next(zipped)
    with pytest.raises(NotImplementedError, match="can only be resumed by skipping"):
        zipped.state_dict()


def test_the_loader_skips_through_a_pipe_without_a_checkpoint() -> None:
    make = lambda: pipeload.DataLoader(IterableWrapper(range(9)).zip(IterableWrapper(range(9))),  # noqa: E731
                                       batch_size=2)
    loader = make()
    iterator = iter(loader)
    head = [next(iterator) for _ in range(2)]
    state = loader.state_dict()
    rest = list(iterator)
    resumed = make()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        resumed.load_state_dict(state)
        again = list(resumed)
    assert [str(b) for b in head + again] == [str(b) for b in head + rest]
    assert any("reads the 2 batches already handed out" in str(w.message) for w in caught)


def write_shards(directory: Any) -> list[str]:
    import io
    import tarfile

    paths = []
    for number, size in enumerate((3, 5, 4)):
        path = directory / f"shard-{number}.tar"
        with tarfile.open(path, "w") as archive:
            for item in range(size):
                data = f"{number}-{item}".encode()
                info = tarfile.TarInfo(f"{number:02d}{item:02d}.txt")
                info.size = len(data)
                archive.addfile(info, io.BytesIO(data))
        paths.append(str(path))
    return paths


@pytest.mark.parametrize("lister", [False, True], ids=["paths", "file-lister"])
@pytest.mark.parametrize("taken", [0, 1, 3, 5])
def test_tar_shards_resume_mid_archive_through_their_state(tmp_path: Any, lister: bool, taken: int) -> None:
    """The tar reader's checkpoint is its archive's source position and the bytes read into it:
    resuming seeks there, re-reads nothing, and yields exactly what an unbroken run yields."""
    paths = write_shards(tmp_path)
    source = (lambda: pipeload.datapipes.iter.FileLister(str(tmp_path), "*.tar")) if lister else (
        lambda: IterableWrapper(paths))
    make = lambda: pipeload.DataLoader(  # noqa: E731
        source().open_files("b").load_from_tar().map(lambda member: member[1].decode()),
        batch_size=2, num_workers=0)
    expected = list(make())
    loader = make()
    iterator = iter(loader)
    head = [next(iterator) for _ in range(taken)]  # taken=3: the middle of the second archive
    state = json.loads(json.dumps(loader.state_dict()))
    del iterator
    resumed = make()
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # no fast-forwarding: a warning would say so
        resumed.load_state_dict(state)
        again = list(resumed)
    assert head + again == expected
    assert sum(len(batch) for batch in expected) == 12


def test_a_tar_member_offset_is_a_seek_not_a_read(tmp_path: Any) -> None:
    paths = write_shards(tmp_path)
    pipe = IterableWrapper(paths).open_files("b").load_from_tar()
    iterator = iter(pipe)
    head = [next(iterator) for _ in range(5)]  # 3 of the first archive, 2 of the second
    state = iterator.state_dict()
    assert state["own"][1] == 2 and state["own"][0] > 0  # members and bytes into shard 1
    resumed = iter(IterableWrapper(paths).open_files("b").load_from_tar())
    resumed.load_state_dict(json.loads(json.dumps(state)))
    assert [m[1] for m in head] + [m[1] for m in resumed] == [m[1] for m in pipe]


# -- a seeded pipe run again after a resume ------------------------------------------------------

CYCLED_SHUFFLES: dict[str, Callable[[], Any]] = {
    "shuffle": lambda: IterableWrapper(range(8)).shuffle().set_seed(11).cycle(2),
    "in_batch_shuffle": lambda: IterableWrapper(range(8)).batch(4).in_batch_shuffle().set_seed(11).cycle(2),
    "map shuffle": lambda: Cycler(SequenceWrapper(range(8)).shuffle().set_seed(11), 2),
}


@pytest.mark.parametrize("name", CYCLED_SHUFFLES)
def test_a_resumed_round_uses_its_seed_so_the_next_round_draws_a_new_order(name: str) -> None:
    torch.manual_seed(5)
    whole = list(CYCLED_SHUFFLES[name]())
    torch.manual_seed(5)
    iterator = iter(CYCLED_SHUFFLES[name]())
    head = [next(iterator)]
    state = json.loads(json.dumps(iterator.state_dict()))
    global_stream = torch.get_rng_state()  # the next round draws its seed there, as in torch
    torch.manual_seed(999)
    resumed = iter(CYCLED_SHUFFLES[name]())
    resumed.load_state_dict(state)
    torch.set_rng_state(global_stream)
    assert head + list(resumed) == whole


@pytest.mark.usefixtures("leak_guard")
@pytest.mark.timeout(60)
@pytest.mark.parametrize("worker_type", ["process", "thread"])
def test_the_loader_resumes_a_cycled_shuffle_and_its_next_epoch_exactly(worker_type: str) -> None:
    def make() -> pipeload.DataLoader:
        pipe = IterableWrapper(range(12)).shuffle().cycle(2).sharding_filter().batch(3)
        return pipeload.DataLoader(pipe, batch_size=None, num_workers=2, worker_type=worker_type,
                                   generator=torch.Generator().manual_seed(123))

    loader = make()
    whole = [list(loader) for _ in range(2)]
    loader = make()
    iterator = iter(loader)
    head = [next(iterator) for _ in range(3)]  # mid round 1
    state = json.loads(json.dumps(loader.state_dict()))
    del iterator
    resumed = make()
    resumed.load_state_dict(state)
    assert [head + list(resumed), list(resumed)] == whole
