"""The RFC's hooks that the DataLoader answers: ``is_shardable()`` / ``sharding_settings()`` (each
copy of the graph is told its shard, as torch's ``apply_sharding`` pipes are) and
``is_separate_process()`` (the loader places the process boundary itself, and ``stats()`` says
where)."""

from __future__ import annotations

import os
import warnings
from collections.abc import Iterator
from typing import Any

import pytest
import torch.utils.data.datapipes.iter as theirs_iter
from pipes_for_tests import add_one

import pipeload
from pipeload.datapipes import IterDataPipe, graph
from pipeload.datapipes.iter import IterableWrapper, QueueBoundary
from pipeload.datapipes.placement import place_separate_processes
from pipeload.datapipes.map import SequenceWrapper

pytestmark = [pytest.mark.usefixtures("leak_guard"), pytest.mark.timeout(90)]

ENGINES = [
    pytest.param({"num_workers": 0}, id="inline"),
    pytest.param({"num_workers": 2}, id="processes"),
    pytest.param({"num_workers": 2, "worker_type": "thread"}, id="threads"),
]


class StridedHooks:
    """A source that shards itself when told (the RFC's hooks), reading only its own share."""

    count: int
    total: int = 1
    shard: int = 0

    def is_shardable(self) -> bool:
        return True

    def sharding_settings(self, total_num_of_shards: int, id_of_shard: int) -> None:
        self.total, self.shard = total_num_of_shards, id_of_shard

    def __iter__(self) -> Iterator[int]:
        return iter(range(self.shard, self.count, self.total))


class Strided(StridedHooks, IterDataPipe):
    def __init__(self, count: int) -> None:
        self.count = count


class TheirStrided(StridedHooks, theirs_iter.IterableWrapper):
    """The same hooks on a subclass of torch's pipe: a graph of torch's family."""

    def __init__(self, count: int) -> None:
        super().__init__(range(count))
        self.count = count


@pytest.mark.parametrize("engine", ENGINES)
@pytest.mark.parametrize("family", ["ours", "torch's"])
def test_the_loader_tells_shardable_pipes_their_shard(engine: dict[str, Any], family: str) -> None:
    source = Strided(25) if family == "ours" else TheirStrided(25)
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # nor is the graph said to be unsharded
        loader = pipeload.DataLoader(source.map(add_one), batch_size=None, **engine)
        assert sorted(loader) == list(range(1, 26))  # every sample once across the copies


def test_a_shardable_pipe_counts_as_the_place_the_graph_splits() -> None:
    pipe = Strided(9).map(add_one)
    assert graph.has_sharding(pipe)
    assert list(graph.apply_sharding(pipe, 3, 2)) == [3, 6, 9]
    with pytest.raises(RuntimeError, match="Sharding twice on a single pipeline"):
        graph.apply_sharding(Strided(9).sharding_filter(), 2, 0)


class ShardableStage(IterDataPipe):
    """A stage that says it may be sharded (the RFC's Decode and Transform do) and, told its
    shard, keeps every total-th item of what reaches it."""

    def __init__(self, source: IterDataPipe) -> None:
        self.source, self.total, self.shard = source, 1, 0

    def is_shardable(self) -> bool:
        return True

    def sharding_settings(self, total_num_of_shards: int, id_of_shard: int) -> None:
        self.total, self.shard = total_num_of_shards, id_of_shard

    def __iter__(self) -> Iterator[int]:
        return (x for i, x in enumerate(self.source) if i % self.total == self.shard)


@pytest.mark.parametrize("engine", ENGINES)
def test_a_chain_of_shardable_pipes_is_split_once_at_its_source(engine: dict[str, Any]) -> None:
    # The RFC marks LoadFiles, Decode and Transform shardable and lets the DataLoader decide:
    # "Sharding twice on a single pipeline" refused it.
    pipe = ShardableStage(ShardableStage(Strided(20)))
    assert sorted(pipeload.DataLoader(pipe, batch_size=None, **engine)) == list(range(20))
    sharded = graph.apply_sharding(ShardableStage(Strided(9)), 3, 2)
    assert list(sharded) == [2, 5, 8] and sharded.total == 1  # the source's share, whole


class NoSettings(IterDataPipe):
    def is_shardable(self) -> bool:
        return True

    def __iter__(self) -> Iterator[int]:
        return iter(range(3))


def test_a_shardable_pipe_without_sharding_settings_is_a_clear_error() -> None:
    with pytest.raises(TypeError, match=r"is_shardable\(\) is True, but it has no sharding_settings"):
        graph.apply_sharding(NoSettings(), 2, 0)


class OwnProcess(IterDataPipe):
    """Asks to run, with what feeds it, in a process of its own; yields (its pid, item)."""

    def __init__(self, source: Any) -> None:
        self.source = source

    def is_separate_process(self) -> bool:
        return True

    def __iter__(self) -> Iterator[tuple[int, Any]]:
        for item in self.source:
            yield os.getpid(), item


@pytest.mark.parametrize("engine", ENGINES)
def test_the_loader_runs_a_pipe_that_asks_for_it_in_a_process_of_its_own(engine: dict[str, Any]) -> None:
    loader = pipeload.DataLoader(OwnProcess(Strided(12)).map(add_one_to_item), batch_size=None, **engine)
    seen = list(loader)
    assert sorted(item for _, item in seen) == list(range(1, 13))  # sharded by its hooks, once each
    pids = {pid for pid, _ in seen}
    assert os.getpid() not in pids
    (where,) = loader.stats().separate_processes
    if engine["num_workers"]:
        worker_type = engine.get("worker_type", "process")
        assert where == ("OwnProcess: its own process (a process boundary after it) "
                         f"(one for each {worker_type} worker's copy)")
        assert len(pids) == 2
    else:
        assert where == "OwnProcess: its own process (a process boundary after it)"
    assert f"separate process (is_separate_process): {where}" in str(loader.stats())


def add_one_to_item(pair: tuple[int, int]) -> tuple[int, int]:
    return pair[0], pair[1] + 1


def test_placement_builds_a_new_graph_and_answers_nested_requests_in_the_outer_process() -> None:
    inner = OwnProcess(IterableWrapper(range(3)))
    outer = OwnProcess(inner.map(drop_pid))
    pipe = outer.map(drop_pid)
    placed, where = place_separate_processes(pipe)
    assert [str(p) for p in where] == [
        "OwnProcess: its own process (a process boundary after it)",
        "OwnProcess: the process of OwnProcess, which it feeds",
    ]
    boundaries = graph.find_dps(placed, QueueBoundary)
    assert len(boundaries) == 1 and boundaries[0].datapipe is outer
    assert graph.find_dps(pipe, QueueBoundary) == []  # the original is left as it was
    assert list(placed) == [0, 1, 2]


def drop_pid(pair: tuple[int, Any]) -> Any:
    return pair[1]


class MapAsks(SequenceWrapper):
    def is_separate_process(self) -> bool:
        return True


def test_only_iterable_pipes_can_run_in_a_process_of_their_own() -> None:
    with pytest.raises(TypeError, match="only iterable-style pipes can run behind a process boundary"):
        place_separate_processes(MapAsks(range(3)).to_iter_datapipe())


def test_nothing_asks_nothing_changes() -> None:
    pipe = IterableWrapper(range(3)).map(add_one)
    assert place_separate_processes(pipe) == (pipe, [])
    loader = pipeload.DataLoader(pipe, batch_size=None)
    assert list(loader) == [1, 2, 3] and loader.stats().separate_processes == ()


class ShardableKeys(SequenceWrapper):
    """A map pipe that, told its shard, keeps every total-th key (the RFC's map LoadFiles)."""

    def is_shardable(self) -> bool:
        return True

    def sharding_settings(self, total_num_of_shards: int, id_of_shard: int) -> None:
        self.sequence = self.sequence[id_of_shard::total_num_of_shards]


@pytest.mark.parametrize("engine", ENGINES)
def test_a_shardable_map_pipe_is_split_by_the_sampler_alone_as_a_map_style_dataset(engine: dict[str, Any]) -> None:
    # The sampler spreads the indices over the workers already: sharding the pipe as well
    # split them twice (an IndexError at index 15 of 30 in a worker holding 15).
    loader = pipeload.DataLoader(ShardableKeys(list(range(30))), batch_size=None, **engine)
    assert sorted(loader) == list(range(30))


@pytest.mark.parametrize("engine", ENGINES)
def test_a_map_shuffle_over_a_shardable_map_pipe_reads_the_keys_of_its_shard(engine: dict[str, Any]) -> None:
    # The shuffle fixed its keys when built, before the loader told the map pipe its shard.
    loader = pipeload.DataLoader(ShardableKeys(list(range(30))).shuffle(), batch_size=None, **engine)
    assert sorted(loader) == list(range(30))
