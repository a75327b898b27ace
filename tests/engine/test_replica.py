"""torch's DataPipe graphs through our DataLoader: sharded by worker and rank, shuffles seeded
from one shared seed, exactly as torch's DataLoader does it (torch is the oracle)."""

from __future__ import annotations

import gc
import json
import warnings
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.utils.data as tud
from conftest import LeakGuard, run_rank_processes
from torch.utils.data.datapipes.iter import IterableWrapper
from torch.utils.data.datapipes.map import SequenceWrapper

import pipeload

LENGTH = 20


def shuffled_then_sharded() -> Any:
    return IterableWrapper(range(LENGTH)).shuffle().sharding_filter()


def sharded_then_shuffled_twice() -> Any:
    # Two random pipes, seeded in graph order from the one shared seed; sharding before them.
    return IterableWrapper(range(LENGTH)).sharding_filter().shuffle(buffer_size=7).map(_double).shuffle()


def unshuffled() -> Any:
    return IterableWrapper(range(LENGTH)).sharding_filter()


def _double(value: int) -> int:
    return 2 * value


def epochs(module: Any, make_graph: Callable[[], Any], count: int = 3, seed: int | None = None,
           **options: Any) -> tuple[list[list[Any]], float]:
    """``count`` epochs of one loader over a fresh graph, then one draw from the global RNG."""
    torch.manual_seed(1234)
    if seed is not None:
        options["generator"] = torch.Generator().manual_seed(seed)
    loader = module.DataLoader(make_graph(), **options)
    seen = [[_plain(batch) for batch in loader] for _ in range(count)]
    return seen, torch.rand(()).item()


def _plain(batch: Any) -> Any:
    return batch.tolist() if isinstance(batch, torch.Tensor) else batch


def flatten(epoch: list[Any]) -> list[int]:
    return [x for batch in epoch for x in (batch if isinstance(batch, list) else [batch])]


SESSIONS = [
    pytest.param({}, id="inline"),
    pytest.param({"num_workers": 2}, id="2-workers"),
    pytest.param({"num_workers": 2, "persistent_workers": True}, id="2-persistent"),
    pytest.param({"num_workers": 3, "persistent_workers": True, "prefetch_factor": 1}, id="3-persistent"),
]


@pytest.mark.timeout(90)
@pytest.mark.parametrize("seed", [None, 5], ids=["global-rng", "generator"])
@pytest.mark.parametrize("options", SESSIONS)
@pytest.mark.parametrize("make_graph", [shuffled_then_sharded, sharded_then_shuffled_twice])
def test_same_samples_same_order_same_random_stream_as_torch(
    make_graph: Callable[[], Any], options: dict[str, Any], seed: int | None, leak_guard: LeakGuard
) -> None:
    options = {"batch_size": 3, "multiprocessing_context": "fork" if options else None, **options}
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # both warn about 3 workers on a 2-core machine
        theirs = epochs(tud, make_graph, seed=seed, **options)
        ours = epochs(pipeload, make_graph, seed=seed, **options)
    assert ours == theirs
    seen, _ = ours
    for epoch in seen:  # every sample once, each epoch
        assert sorted(flatten(epoch)) == sorted(flatten(seen[0])) and len(flatten(epoch)) == LENGTH
    assert seen[0] != seen[1]  # each epoch is shuffled anew


@pytest.mark.timeout(90)
@pytest.mark.parametrize("worker_type, context", [("thread", None), ("process", "spawn")])
def test_thread_and_spawn_workers_shard_like_torchs_processes(
    worker_type: str, context: str | None, leak_guard: LeakGuard
) -> None:
    options: dict[str, Any] = {"batch_size": 4, "num_workers": 2, "persistent_workers": True}
    theirs = epochs(tud, sharded_then_shuffled_twice, count=2, **options)
    ours = epochs(pipeload, sharded_then_shuffled_twice, count=2, worker_type=worker_type,
                  multiprocessing_context=context, **options)
    assert ours == theirs


@pytest.mark.timeout(60)
@pytest.mark.parametrize("options", [{}, {"num_workers": 2}], ids=["inline", "2-workers"])
def test_shuffle_option_and_other_batching_options_as_torch(
    options: dict[str, Any], leak_guard: LeakGuard
) -> None:
    for extra in ({"shuffle": False}, {"shuffle": True}, {"batch_size": None},
                  {"batch_size": 3, "drop_last": True}):
        assert epochs(pipeload, shuffled_then_sharded, 2, **options, **extra) == epochs(
            tud, shuffled_then_sharded, 2, **options, **extra
        ), extra


def test_shuffle_true_on_a_graph_without_a_shuffle_says_it_shuffles_nothing() -> None:
    with pytest.warns(UserWarning, match="has no shuffle step"):
        ours = epochs(pipeload, unshuffled, 1, shuffle=True, batch_size=5)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        assert ours == epochs(tud, unshuffled, 1, shuffle=True, batch_size=5)


@pytest.mark.timeout(60)
def test_map_style_graph_matches_torch(leak_guard: LeakGuard) -> None:
    def make() -> Any:
        return SequenceWrapper(list(range(LENGTH))).map(_double)

    for options in ({"shuffle": True}, {"num_workers": 2, "shuffle": True}):
        ours = epochs(pipeload, make, 2, batch_size=4, **options)
        assert ours == epochs(tud, make, 2, batch_size=4, **options)


@pytest.mark.timeout(60)
@pytest.mark.parametrize("num_workers", [0, 2])
def test_sharding_twice_fails_as_in_torch(num_workers: int, leak_guard: LeakGuard) -> None:
    def run(module: Any) -> None:
        graph = IterableWrapper(range(LENGTH)).sharding_filter().sharding_filter()
        list(module.DataLoader(graph, num_workers=num_workers))

    theirs = _error_of(run, tud)
    with pytest.raises(type(theirs)) as ours:
        run(pipeload)
    assert "Sharding twice" in str(theirs) and "Sharding twice" in str(ours.value)


def _error_of(run: Callable[[Any], None], module: Any) -> BaseException:
    """The exception ``run(module)`` raises, with its traceback (and torch's workers) let go."""
    try:
        run(module)
    except Exception as error:
        error.__traceback__ = None
        return error
    finally:
        gc.collect()
    raise AssertionError(f"{module.__name__} raised nothing")


def test_worker_init_fn_sees_the_sharded_graph(leak_guard: LeakGuard) -> None:
    loader = pipeload.DataLoader(unshuffled(), batch_size=None, num_workers=2, worker_type="thread",
                                 worker_init_fn=_keep_only_my_first_sample)
    assert sorted(loader) == [0, 1]


def _keep_only_my_first_sample(worker_id: int) -> None:
    graph = pipeload.get_worker_info().dataset
    assert (graph.num_of_instances, graph.instance_id) == (2, worker_id)
    graph.num_of_instances = LENGTH  # this worker's share shrinks to its first sample


WORLD_SIZE = 2
RANK_SESSIONS = [{}, {"num_workers": 2}, {"num_workers": 2, "persistent_workers": True}]


def _run_rank(rank: int, init_file: str, out_dir: str) -> None:
    import torch.distributed as dist

    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=WORLD_SIZE)
    try:
        record = []
        for options in RANK_SESSIONS:
            kwargs = {"batch_size": 2, "multiprocessing_context": "fork" if options else None, **options}
            record.append({
                "theirs": epochs(tud, shuffled_then_sharded, 2, **kwargs),
                "ours": epochs(pipeload, shuffled_then_sharded, 2, **kwargs),
            })
        Path(out_dir, f"{rank}.json").write_text(json.dumps(record))
    finally:
        dist.destroy_process_group()


@pytest.mark.timeout(120)
def test_ranks_take_disjoint_shards_of_one_shared_order(tmp_path: Path, leak_guard: LeakGuard) -> None:
    run_rank_processes(_run_rank, (str(tmp_path / "init"), str(tmp_path)), WORLD_SIZE)
    records = [json.loads((tmp_path / f"{rank}.json").read_text()) for rank in range(WORLD_SIZE)]
    for session, options in enumerate(RANK_SESSIONS):
        per_rank = [record[session] for record in records]
        for mine in per_rank:
            assert mine["ours"] == mine["theirs"], options
        for epoch in range(2):
            shares = [flatten(mine["ours"][0][epoch]) for mine in per_rank]
            assert not set(shares[0]) & set(shares[1]), (options, shares)
            assert sorted(shares[0] + shares[1]) == list(range(LENGTH)), (options, shares)


@pytest.mark.parametrize("options", [{}, {"num_workers": 2, "worker_type": "thread"}],
                         ids=["inline", "threads"])
def test_pipeloads_own_pipes_plug_into_the_same_rules(
    options: dict[str, Any], leak_guard: LeakGuard
) -> None:
    import pipeload.datapipes.iter as our_pipes  # pipeload's own family, not torch's

    pipe = our_pipes.IterableWrapper(list(range(LENGTH))).shuffle().sharding_filter()
    loader = pipeload.DataLoader(pipe, batch_size=None, **options)
    first, second = list(loader), list(loader)
    assert sorted(first) == sorted(second) == list(range(LENGTH))  # every sample once per epoch
    assert first != second and first != list(range(LENGTH))  # shuffled, anew each epoch
