"""The DataLoader scenarios of test_ray_in_loader.py, each run in a fresh interpreter.

Ray does not survive fork, even after ``ray.shutdown()``: a test process that was ever connected
(other Ray tests of the session) could not fork workers that join a cluster. So each scenario
runs here, in a process that never touched Ray, and forks its DataLoader workers as a training
job would; they join the cluster named by ``RAY_ADDRESS``. Exits non-zero (an AssertionError)
when a check fails.

    python ray_loader_job.py same-batches-and-resume | ranks | random-streams | spawned-workers
"""

from __future__ import annotations

import sys
import warnings

import torch

import pipeload
from pipeload.datapipes.iter import IterableWrapper


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


def same_batches_and_resume() -> None:
    """rank x worker x actor gives the batches of the same loader without Ray; a checkpoint
    taken mid-epoch resumes from each worker's shard positions."""
    torch.manual_seed(0)
    expected = batches(pipeload.DataLoader(graph(ray=False), batch_size=4, num_workers=2))
    torch.manual_seed(0)
    loader = pipeload.DataLoader(graph(ray=True), batch_size=4, num_workers=2)
    head = batches(loader, 9)
    state = loader.state_dict()
    del loader
    assert "pipeload.ray_boundary" in repr(state), "the state holds no Ray boundary positions"
    resumed = pipeload.DataLoader(graph(ray=True), batch_size=4, num_workers=2)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        resumed.load_state_dict(state)
    assert not [w for w in caught if "cannot say where it stands" in str(w.message)], "resumed by replay"
    rest = batches(resumed)
    assert head + rest == expected, (head + rest, expected)
    ray_stage = resumed.stats().ray  # counted in the workers, read in this process
    assert ray_stage is not None and ray_stage.items >= 64 - 9 * 4, ray_stage


def ranks() -> None:
    """Two ranks (RANK/WORLD_SIZE, seeded alike) x two workers x two actors: each sample once."""
    import os

    seen = []
    for rank in (0, 1):
        os.environ["RANK"], os.environ["WORLD_SIZE"] = str(rank), "2"
        torch.manual_seed(0)
        loader = pipeload.DataLoader(graph(ray=True), batch_size=4, num_workers=2)
        seen.append(sorted(x for batch in batches(loader) for x in batch))
        del loader
    assert len(seen[0]) == len(seen[1]) == 32, seen
    assert sorted(seen[0] + seen[1]) == [x * x for x in range(64)], seen


def random_streams() -> None:
    """The actors of each worker and rank draw their own random values (the loader seeds every
    copy's shuffle alike), the same again for the same loader seed."""
    import os

    from pipes_for_tests import with_random_draws

    def draws(rank: int) -> dict[int, tuple[float, ...]]:
        os.environ["RANK"], os.environ["WORLD_SIZE"] = str(rank), "2"
        torch.manual_seed(0)
        pipe = (IterableWrapper(range(16)).shuffle().sharding_filter().map(with_random_draws)
                .queue_boundary("ray", 4, num_actors=2))
        loader = pipeload.DataLoader(pipe, batch_size=None, num_workers=2)
        return {int(item): tuple(values) for item, values in loader}

    rank_0 = draws(0)
    assert draws(0) == rank_0, "not reproducible from the loader's seed"
    rank_1 = draws(1)
    assert sorted([*rank_0, *rank_1]) == list(range(16)), (rank_0, rank_1)
    every = [*rank_0.values(), *rank_1.values()]
    for generator in range(3):  # torch, random, numpy: 2 ranks x 2 workers x 2 actors, apart
        assert len({values[generator] for values in every}) == 16, every


def spawned_workers() -> None:
    """Spawned workers (as a process connected to Ray must use) with a function of this script
    in the graph: in a spawned worker the script is ``__mp_main__``, which no actor can import;
    every actor failed with "Can't get attribute 'square'" where num_workers=0 worked."""
    torch.manual_seed(0)
    expected = batches(pipeload.DataLoader(graph(ray=False), batch_size=4, num_workers=2,
                                           multiprocessing_context="spawn"))
    torch.manual_seed(0)
    got = batches(pipeload.DataLoader(graph(ray=True), batch_size=4, num_workers=2,
                                      multiprocessing_context="spawn"))
    assert got == expected, (got, expected)


if __name__ == "__main__":
    {"same-batches-and-resume": same_batches_and_resume, "ranks": ranks,
     "random-streams": random_streams, "spawned-workers": spawned_workers}[sys.argv[1]]()
    print("ok")
