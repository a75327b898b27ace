"""A Ray node lost mid-epoch: the boundary's actors there die with it.

A real cluster of three nodes on this machine (``ray.cluster_utils.Cluster``: a head with no CPUs,
so the actors go to the worker nodes, and two workers), with health checks every 0.5 s; a node
is removed by killing its processes. Without restarts the next item is an error naming the actor
within seconds; with ``max_restarts`` the actor comes back on the other node and the epoch
completes with every item once.
"""

from __future__ import annotations

import time

import importlib.util

import pytest

import ray_testing  # noqa: F401  (sets Ray's environment before it is imported)
from ray_testing import assert_nothing_left, cluster_python_path, wait_for

from pipeload.datapipes.iter import IterableWrapper  # noqa: E402
from pipeload.errors import WorkerDiedError  # noqa: E402

# Found, not imported (tests/conftest.py, lacks(): Ray stays out of the test process until
# a test needs it). Written out here: Ray's actors import this module, without conftest.
RAY_INSTALLED = pytest.mark.skipif(importlib.util.find_spec("ray") is None, reason="needs ray")
pytestmark = [pytest.mark.slow, pytest.mark.timeout(300), RAY_INSTALLED, pytest.mark.imports_large_libraries]


def slow_square(x: int) -> int:
    time.sleep(0.02)
    return x * x


@pytest.fixture
def cluster():
    import ray
    from ray.cluster_utils import Cluster

    with cluster_python_path():
        nodes = Cluster(initialize_head=True, head_node_args={
            "num_cpus": 0, "include_dashboard": False,
            "_system_config": {"health_check_period_ms": 500, "health_check_failure_threshold": 3},
        })
        doomed, spare = nodes.add_node(num_cpus=2), nodes.add_node(num_cpus=2)
    ray.init(address=nodes.address, log_to_driver=False)
    try:
        yield nodes, doomed, spare
        assert_nothing_left()
    finally:
        ray.shutdown()
        nodes.shutdown()


def on(node, soft: bool):
    from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

    return NodeAffinitySchedulingStrategy(node.node_id, soft=soft)


def test_a_lost_node_is_an_error_naming_the_actor_or_with_restarts_nothing_is_lost(cluster):
    nodes, doomed, spare = cluster
    pipe = IterableWrapper(range(200)).sharding_filter().map(slow_square)
    restarted = iter(pipe.queue_boundary("ray", 4, num_actors=2, max_restarts=1,
                                         scheduling_strategy=on(doomed, soft=True)))
    failing = iter(pipe.queue_boundary("ray", 4, num_actors=2, scheduling_strategy=on(doomed, soft=False)))
    got = [next(restarted) for _ in range(10)]
    assert [next(failing) for _ in range(10)] == got
    nodes.remove_node(doomed, allow_graceful=False)
    lost_at = time.monotonic()
    with pytest.raises(WorkerDiedError, match=r"Ray actor [01] of 2 .*node %s.* died while making items"
                       % doomed.node_id[:8]):
        for _ in failing:
            pass
    assert time.monotonic() - lost_at < 10
    got += list(restarted)
    assert got == [x * x for x in range(200)]
    assert restarted.stats().restarts == 2
    del failing, restarted
    assert wait_for(lambda: ray_testing.objects_held() == 0)
