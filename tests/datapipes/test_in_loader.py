"""Pipe graphs through the DataLoader: sharded across workers and ranks, seeded as torch's loader
seeds torch's pipes (the same batches for the same seed), with 0 or k process or thread workers,
persistent or not; and the same samples as iterating the pipe directly."""

from __future__ import annotations

import json
import os
import threading
import warnings
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.utils.data as tud
import torch.utils.data.datapipes.iter as theirs_iter
import torch.utils.data.datapipes.map as theirs_map
from conftest import run_rank_processes, wait_until
from pipes_for_tests import ListsWhereUsed, MadeWhereUsed, double, is_even, normalise, parity

import pipeload
import pipeload.datapipes.iter as ours_iter
import pipeload.datapipes.map as ours_map

pytestmark = [pytest.mark.usefixtures("leak_guard"), pytest.mark.timeout(90)]

ENGINES = [
    pytest.param({"num_workers": 0}, id="inline"),
    pytest.param({"num_workers": 2}, id="processes"),
    pytest.param({"num_workers": 2, "worker_type": "thread"}, id="threads"),
]


def shuffled(module: Any, n: int = 30) -> Any:
    return module.IterableWrapper(range(n)).shuffle().sharding_filter().map(double)


def two_shuffles_batched(module: Any) -> Any:
    pipe = module.IterableWrapper(range(40)).shuffle(buffer_size=8).sharding_filter()
    return pipe.filter(is_even).shuffle(buffer_size=3).batch(3)


def epochs(loader_module: Any, pipe: Any, epochs_count: int = 2, seed: int = 0, **kwargs: Any) -> Any:
    torch.manual_seed(seed)
    loader = loader_module.DataLoader(pipe, **kwargs)
    batches = [normalise(list(loader)) for _ in range(epochs_count)]
    return batches, torch.rand(1).item()  # the global stream after, too


@pytest.mark.parametrize("engine", ENGINES)
@pytest.mark.parametrize("graph, batch_size", [(shuffled, 4), (two_shuffles_batched, None)])
@pytest.mark.parametrize("pipes", ["ours", "torch's"])
def test_the_same_batches_as_torchs_loader(engine: dict[str, Any], graph: Any, batch_size: Any, pipes: str) -> None:
    theirs = epochs(tud, graph(theirs_iter), batch_size=batch_size, num_workers=engine["num_workers"])
    module = ours_iter if pipes == "ours" else theirs_iter
    ours = epochs(pipeload, graph(module), batch_size=batch_size, **engine)
    assert ours == theirs
    (first, second), _ = ours
    assert first != second  # a new order every epoch


@pytest.mark.parametrize("worker_type", ["process", "thread"])
def test_persistent_workers_reseed_every_epoch_as_torch(worker_type: str) -> None:
    kwargs = {"batch_size": 3, "num_workers": 2, "persistent_workers": True}
    theirs = epochs(tud, shuffled(theirs_iter), 3, **kwargs)
    ours = epochs(pipeload, shuffled(ours_iter), 3, worker_type=worker_type, **kwargs)
    assert ours == theirs


@pytest.mark.parametrize("engine", ENGINES)
def test_every_sample_exactly_once_and_the_same_order_for_the_same_seed(engine: dict[str, Any]) -> None:
    pipe = ours_iter.IterableWrapper(range(23)).shuffle().sharding_filter()
    runs = [epochs(pipeload, pipe, 1, seed=seed, batch_size=4, **engine) for seed in (1, 1, 2)]
    samples = [sum((batch[1] for batch in batches[0]), []) for batches, _ in runs]  # (tensor, values, dtype)
    assert all(sorted(s) == list(range(23)) for s in samples)
    assert samples[0] == samples[1] and samples[0] != samples[2]
    generators = [torch.Generator().manual_seed(9) for _ in range(2)]
    by_generator = [list(pipeload.DataLoader(pipe, batch_size=None, generator=g, **engine)) for g in generators]
    assert by_generator[0] == by_generator[1]


@pytest.mark.parametrize("engine", ENGINES)
def test_directly_and_through_the_loader_the_same_samples(engine: dict[str, Any]) -> None:
    pipe = ours_iter.IterableWrapper(range(17)).sharding_filter().map(double).batch(4)
    direct = list(pipe)
    loaded = list(pipeload.DataLoader(pipe, batch_size=None, **engine))
    if engine["num_workers"] == 0:
        assert loaded == direct  # one copy: the order is defined
    assert sorted(sum(loaded, [])) == sorted(sum(direct, []))
    shuffled_pipe = ours_iter.IterableWrapper(range(17)).shuffle().sharding_filter()
    assert sorted(pipeload.DataLoader(shuffled_pipe, batch_size=None, **engine)) == sorted(shuffled_pipe)


def demux_read_in_turn() -> Any:
    evens, odds = ours_iter.IterableWrapper(range(30)).shuffle().sharding_filter().demux(2, parity)
    return evens.concat(odds)  # odds are read once evens' iterator has ended


@pytest.mark.parametrize("engine", ENGINES)
def test_demux_branches_read_in_turn_give_every_sample_once_and_resume_exactly(engine: dict[str, Any]) -> None:
    def make() -> pipeload.DataLoader:
        generator = torch.Generator().manual_seed(123)
        return pipeload.DataLoader(demux_read_in_turn(), batch_size=None, generator=generator, **engine)

    loader = make()
    whole = [[int(x) for x in loader] for _ in range(2)]
    assert all(sorted(epoch) == list(range(30)) for epoch in whole)
    loader = make()
    iterator = iter(loader)
    head = [int(next(iterator)) for _ in range(3)]
    state = loader.state_dict()
    del iterator
    resumed = make()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # concat keeps no checkpoint: resumed by skipping
        resumed.load_state_dict(state)
        rest = [[int(x) for x in resumed] for _ in range(2)]
    assert [head + rest[0], rest[1]] == whole


@pytest.mark.parametrize("worker_type", ["process", "thread"])
def test_a_shuffle_run_again_within_an_epoch_gives_the_same_epoch_for_the_same_generator(worker_type: str) -> None:
    # The second round's shuffle seeds itself from the worker's generator, not the loader's:
    # a thread worker's is its own, whatever the training loop's global one is doing.
    pipe = ours_iter.IterableWrapper(range(12)).shuffle().cycle(2).sharding_filter().batch(3)
    runs = []
    for loop_seed in (1, 2):
        torch.manual_seed(loop_seed)
        generator = torch.Generator().manual_seed(123)
        loader = pipeload.DataLoader(pipe, batch_size=None, num_workers=2, worker_type=worker_type,
                                     generator=generator)
        runs.append([list(loader) for _ in range(2)])
    assert runs[0] == runs[1]
    assert runs[0][0] != runs[0][1]


def test_an_unsharded_graph_read_by_several_workers_warns() -> None:
    unsharded = ours_iter.IterableWrapper(range(6)).map(double)
    with pytest.warns(UserWarning, match="has no sharding_filter.*loaded 2 times per epoch"):
        samples = list(pipeload.DataLoader(unsharded, batch_size=None, num_workers=2))
    assert sorted(samples) == sorted(2 * [2 * i for i in range(6)])
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        list(pipeload.DataLoader(unsharded, batch_size=None))
        list(pipeload.DataLoader(unsharded.sharding_filter(), batch_size=None, num_workers=2))


@pytest.mark.parametrize("family", [ours_iter, theirs_iter], ids=["ours", "torchs"])
@pytest.mark.parametrize("group", ["MULTIPROCESSING", "DISTRIBUTED"])
def test_a_sharding_filter_that_obeys_only_a_group_the_loader_never_splits_warns(family: Any, group: str) -> None:
    # The loader splits with the DEFAULT group, as torch's does; a filter told to obey only
    # another group ignores that split, so every copy yields everything (torch's loader too,
    # without a word). It was taken for a sharded graph and nothing was said.
    only_group = getattr(tud.datapipes.iter.sharding.SHARDING_PRIORITIES, group)
    pipe = family.IterableWrapper(range(6)).sharding_filter(only_group)
    with pytest.warns(UserWarning, match=f"obeys only SHARDING_PRIORITIES.{group}.*loaded 2 times per epoch"):
        samples = list(pipeload.DataLoader(pipe, batch_size=None, num_workers=2, worker_type="thread"))
    assert sorted(samples) == sorted(tud.DataLoader(pipe, batch_size=None, num_workers=2)) == sorted(2 * list(range(6)))
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        default = tud.datapipes.iter.sharding.SHARDING_PRIORITIES.DEFAULT
        obeys_default = family.IterableWrapper(range(6)).sharding_filter(default)
        assert sorted(pipeload.DataLoader(obeys_default, batch_size=None, num_workers=2, worker_type="thread")) == list(range(6))


def test_the_loaders_shuffle_argument_switches_the_graphs_shuffles() -> None:
    pipe = ours_iter.IterableWrapper(range(10)).shuffle().sharding_filter()
    assert list(pipeload.DataLoader(pipe, batch_size=None, shuffle=False)) == list(range(10))
    assert sorted(pipeload.DataLoader(pipe, batch_size=None, shuffle=True)) == list(range(10))
    plain = ours_iter.IterableWrapper(range(10))
    with pytest.warns(UserWarning, match=r"^`shuffle=True` was set, but the datapipe does not contain a `Shuffler`"
                                          r"\..*shuffle=True has no effect.*has no shuffle step"):
        loader = pipeload.DataLoader(plain, batch_size=None, shuffle=True)
    assert list(loader) == list(range(10))  # as torch: nothing is shuffled, and we say so
    with pytest.raises(ValueError, match="expected unspecified shuffle option"):
        pipeload.DataLoader(pipeload.ChainDataset([]), shuffle=True)


@pytest.mark.parametrize("engine", ENGINES[:2])
def test_a_map_pipe_through_the_loader_matches_torch(engine: dict[str, Any]) -> None:
    def build(module: Any) -> Any:
        return module.SequenceWrapper(list(range(20))).map(double)

    theirs = epochs(tud, build(theirs_map), batch_size=6, shuffle=True, num_workers=engine["num_workers"])
    assert epochs(pipeload, build(ours_map), batch_size=6, shuffle=True, **engine) == theirs


def sharded_view(worker_id: int) -> None:
    info = pipeload.get_worker_info()
    (sharding,) = [dp for dp in pipeload.datapipes.graph.list_dps(info.dataset)
                   if isinstance(dp, ours_iter.ShardingFilter)]
    assert (sharding.num_of_instances, sharding.instance_id) == (info.num_workers, worker_id)


@pytest.mark.parametrize("worker_type", ["process", "thread"])
def test_workers_shard_before_worker_init_fn(worker_type: str) -> None:
    pipe = ours_iter.IterableWrapper(range(12)).shuffle().sharding_filter().map(double)
    kwargs = {"batch_size": 3, "num_workers": 2, "worker_type": worker_type}
    loader = pipeload.DataLoader(pipe, worker_init_fn=sharded_view, **kwargs)
    torch.manual_seed(4)
    checked = [b.tolist() for b in loader]
    torch.manual_seed(4)
    assert checked == [b.tolist() for b in pipeload.DataLoader(pipe, **kwargs)]


def test_lazy_setup_happens_in_the_worker_not_the_main_process() -> None:
    pipe = MadeWhereUsed(ours_iter.IterableWrapper(range(4)).sharding_filter())
    pids = set(pipeload.DataLoader(pipe, batch_size=None, num_workers=2))
    assert len(pids) == 2 and os.getpid() not in pids
    assert not MadeWhereUsed.resource.is_ready(pipe)


@pytest.mark.parametrize("worker_type", ["process", "thread"])
def test_the_rfcs_lazy_init_lists_in_each_worker_after_it_started(worker_type: str) -> None:
    pipe = ListsWhereUsed(8).sharding_filter()
    loader = pipeload.DataLoader(pipe, batch_size=None, num_workers=2, worker_type=worker_type)
    loaded = [pair for pair in loader]  # not list(loader): its len() would list the files here  # noqa: C416
    assert sorted(number for number, _ in loaded) == list(range(8))
    if worker_type == "process":
        assert len({pid for _, pid in loaded}) == 2 and os.getpid() not in {pid for _, pid in loaded}
    assert pipe.source_datapipe.numbers is None  # the loader's own copy was never listed


@pytest.mark.filterwarnings("ignore:This process is rank")  # seeded alike by manual_seed
@pytest.mark.parametrize("workers", [0, 2])
def test_torchruns_environment_shards_by_rank(monkeypatch: pytest.MonkeyPatch, workers: int) -> None:
    shards = []
    for rank in range(2):
        monkeypatch.setenv("RANK", str(rank))
        monkeypatch.setenv("WORLD_SIZE", "2")
        torch.manual_seed(0)  # ranks seeded alike, as without a process group they must be
        pipe = ours_iter.IterableWrapper(range(21)).shuffle().sharding_filter()
        shards.append(sorted(pipeload.DataLoader(pipe, batch_size=None, num_workers=workers)))
    assert not set(shards[0]) & set(shards[1])
    assert sorted(shards[0] + shards[1]) == list(range(21))
    assert len(shards[0]) == 11


def test_ranks_without_a_process_group_are_warned_that_their_shuffles_may_differ(
        monkeypatch: pytest.MonkeyPatch) -> None:
    # Without a group nothing carries rank 0's shuffle seed to the others: unseeded alike, the
    # ranks' shards overlapped (8 of 30 samples twice, in a review's run) without a word.
    monkeypatch.setenv("RANK", "1")
    monkeypatch.setenv("WORLD_SIZE", "2")
    shuffled = ours_iter.IterableWrapper(range(30)).shuffle().sharding_filter()
    with pytest.warns(UserWarning, match=r"rank 1 of 2 .* no torch.distributed process group") as said:
        loader = pipeload.DataLoader(shuffled, batch_size=None)
        for _ in range(2):
            assert len(list(loader)) == 15
    assert sum("process group" in str(w.message) for w in said) == 1  # once a loader
    assert said[0].filename == __file__  # at the user's line


@pytest.mark.parametrize("quiet", ["generator", "no shuffle", "one rank"])
def test_ranks_that_cannot_shuffle_apart_are_not_warned(monkeypatch: pytest.MonkeyPatch, quiet: str) -> None:
    monkeypatch.setenv("RANK", "0")
    monkeypatch.setenv("WORLD_SIZE", "1" if quiet == "one rank" else "2")
    pipe = ours_iter.IterableWrapper(range(30))
    if quiet != "no shuffle":
        pipe = pipe.shuffle()
    generator = torch.Generator().manual_seed(3) if quiet == "generator" else None
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        list(pipeload.DataLoader(pipe.sharding_filter(), batch_size=None, generator=generator))


@pytest.mark.filterwarnings("ignore:This process is rank")  # seeded alike by manual_seed
@pytest.mark.parametrize("workers", [0, 2])
def test_a_rank_resumes_its_share_of_a_graph_from_its_own_checkpoint(monkeypatch: pytest.MonkeyPatch,
                                                                      workers: int) -> None:
    # Without workers the loader shards the graph in place, in the main process: its state read
    # this rank's share as the dataset's length (20 of 41), which a fresh loader over the same
    # graph (41) refused, so no such loader could resume.
    monkeypatch.setenv("RANK", "1")
    monkeypatch.setenv("WORLD_SIZE", "2")

    def make() -> pipeload.DataLoader:
        pipe = ours_iter.IterableWrapper(range(41)).shuffle().sharding_filter()
        return pipeload.DataLoader(pipe, batch_size=3, num_workers=workers, shuffle=True)

    torch.manual_seed(0)
    whole = [batch.tolist() for batch in make()]
    torch.manual_seed(0)
    loader = make()
    iterator = iter(loader)
    head = [next(iterator).tolist() for _ in range(2)]
    state = loader.state_dict()
    del iterator
    resumed = make()
    resumed.load_state_dict(state)
    assert head + [batch.tolist() for batch in resumed] == whole


WORLD_SIZE = 2


def _run_rank(rank: int, init_file: str, out_dir: str) -> None:
    import torch.distributed as dist

    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=WORLD_SIZE)
    try:
        torch.manual_seed(100 + rank)  # ranks seeded differently: rank 0's shared seed must win
        pipe = ours_iter.IterableWrapper(range(50)).shuffle().sharding_filter()
        # fork: a spawned rank would otherwise spawn its workers too (slow, and not the point)
        loader = pipeload.DataLoader(pipe, batch_size=5, num_workers=2, multiprocessing_context="fork")
        epochs_seen = [sum((b.tolist() for b in loader), []) for _ in range(2)]
        Path(out_dir, f"{rank}.json").write_text(json.dumps(epochs_seen))
    finally:
        dist.destroy_process_group()


@pytest.mark.slow  # ~15 s on the shared box; tests/engine/test_replica.py runs the same hook over gloo
@pytest.mark.timeout(120)
def test_a_gloo_group_shards_by_rank_times_worker_with_rank_zeros_seed(tmp_path: Path) -> None:
    run_rank_processes(_run_rank, (str(tmp_path / "init"), str(tmp_path)), WORLD_SIZE)
    seen = [json.loads((tmp_path / f"{r}.json").read_text()) for r in range(WORLD_SIZE)]
    for epoch in range(2):
        rank0, rank1 = seen[0][epoch], seen[1][epoch]
        assert not set(rank0) & set(rank1) and sorted(rank0 + rank1) == list(range(50))
    assert seen[0][0] != seen[0][1]


def mixed_wrapped_shuffle(iter_module: Any, map_module: Any) -> Any:
    return iter_module.IterableWrapper(map_module.SequenceWrapper(range(20)).shuffle())


def mixed_sharded(iter_module: Any, map_module: Any) -> Any:
    inner = map_module.SequenceWrapper(list(range(20))).map(double).shuffle()
    return iter_module.IterableWrapper(inner).sharding_filter().shuffle(buffer_size=5).batch(3)


def map_shuffle_batched(iter_module: Any, map_module: Any) -> Any:
    return map_module.SequenceWrapper(list(range(16))).shuffle().sharding_filter().batch(4)


@pytest.mark.parametrize("engine", ENGINES)
@pytest.mark.parametrize("graph", [mixed_wrapped_shuffle, mixed_sharded, map_shuffle_batched])
def test_mixed_map_and_iter_graphs_are_seeded_as_torchs_loader_seeds_them(engine: dict[str, Any], graph: Any) -> None:
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # the first graph has no sharding: every worker reads it all
        theirs = epochs(tud, graph(theirs_iter, theirs_map), batch_size=None, num_workers=engine["num_workers"])
        ours = epochs(pipeload, graph(ours_iter, ours_map), batch_size=None, **engine)
    assert ours == theirs
    (first, second), _ = ours
    assert first != second  # the loader's seed reaches the map pipe's shuffle: a new order each epoch


class _NeverReady(pipeload.datapipes.NonBlockingIterDataPipe):
    """A source whose items never come (a remote store that stopped answering)."""

    def nonblocking_next(self) -> int:
        raise pipeload.datapipes.NotAvailable


def test_a_thread_worker_waiting_for_a_source_stops_once_its_iterator_is_gone() -> None:
    # After the timeout, the iterator dropped, the worker thread kept polling the source for the
    # rest of the process (a thread cannot be killed; pipeload's own wait must give up).
    loader = pipeload.DataLoader(_NeverReady(), batch_size=None, num_workers=1, worker_type="thread",
                                 timeout=0.3)
    iterator = iter(loader)
    with pytest.raises(pipeload.errors.LoaderTimeoutError):
        next(iterator)
    del iterator, loader
    assert wait_until(lambda: not any(t.name.startswith("pipeload-worker") for t in threading.enumerate()), 10.0)
