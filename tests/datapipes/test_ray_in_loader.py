"""A graph with a Ray boundary inside pipeload.DataLoader, with process workers and ranks.

The cluster is a real head node started with ``ray start --head`` in a subprocess (the test
process stays out of Ray, so its forked workers can each join it as the workers of a training
job would, through ``RAY_ADDRESS``). Each DataLoader worker runs its own actors: the graph is
split rank x worker x actor, seeded by the loader, and checkpointed like any pipe.
"""

from __future__ import annotations

import os
import warnings

import pytest

import ray_testing  # noqa: F401  (sets Ray's environment before it is imported)
from ray_testing import assert_nothing_left, head_node

pytest.importorskip("ray")
import torch  # noqa: E402

import pipeload  # noqa: E402
from pipeload.datapipes.iter import IterableWrapper  # noqa: E402

pytestmark = [pytest.mark.slow, pytest.mark.timeout(300)]


@pytest.fixture(scope="module")
def cluster_address():
    before = os.environ.get("RAY_ADDRESS")
    for address in head_node():
        os.environ["RAY_ADDRESS"] = address
        try:
            yield address
        finally:
            if before is None:
                os.environ.pop("RAY_ADDRESS", None)
            else:
                os.environ["RAY_ADDRESS"] = before


def square(x: int) -> int:
    return x * x


def graph(ray: bool):
    pipe = IterableWrapper(range(64)).shuffle().sharding_filter().map(square)
    return pipe.queue_boundary("ray", 4, num_actors=2) if ray else pipe


def batches(loader, count=None):
    got = []
    for batch in loader:
        got.append(batch.tolist())
        if count is not None and len(got) == count:
            break
    return got


def test_the_same_batches_as_without_ray_and_a_checkpoint_resumes_them(cluster_address):
    torch.manual_seed(0)
    expected = batches(pipeload.DataLoader(graph(ray=False), batch_size=4, num_workers=2))
    torch.manual_seed(0)
    loader = pipeload.DataLoader(graph(ray=True), batch_size=4, num_workers=2)
    head = batches(loader, 9)
    state = loader.state_dict()
    del loader
    assert "pipeload.ray_boundary" in repr(state)  # each worker's shard positions, not a replay
    resumed = pipeload.DataLoader(graph(ray=True), batch_size=4, num_workers=2)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        resumed.load_state_dict(state)
    assert not [w for w in caught if "cannot say where it stands" in str(w.message)]
    assert head + batches(resumed) == expected
    ray_stage = resumed.stats().ray  # counted in the workers, read in the main process
    assert ray_stage is not None and ray_stage.items >= 64 - 9 * 4
    del resumed
    assert_nothing_left()


def test_ranks_workers_and_actors_each_get_their_share(cluster_address, monkeypatch):
    seen = []
    for rank in (0, 1):
        monkeypatch.setenv("RANK", str(rank))
        monkeypatch.setenv("WORLD_SIZE", "2")
        torch.manual_seed(0)  # without a process group the ranks must seed alike
        loader = pipeload.DataLoader(graph(ray=True), batch_size=4, num_workers=2)
        seen.append(sorted(x for batch in batches(loader) for x in batch))
        del loader
    assert len(seen[0]) == len(seen[1]) == 32
    assert sorted(seen[0] + seen[1]) == [x * x for x in range(64)]
    assert_nothing_left()
