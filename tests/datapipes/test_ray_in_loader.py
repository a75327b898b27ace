"""A graph with a Ray boundary inside pipeload.DataLoader, with process workers and ranks.

The cluster is a real head node started with ``ray start --head`` in a subprocess. Each
scenario (``ray_loader_job.py``) runs in a fresh interpreter that has never touched Ray, as a
training job would, and forks its DataLoader workers, which join the cluster through
``RAY_ADDRESS`` and run their own actors: the graph is split rank x worker x actor, seeded by
the loader, and checkpointed like any pipe.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import importlib.util

import pytest

import ray_testing  # noqa: F401  (sets Ray's environment before it is imported)
from ray_testing import RAY_ENV, actor_processes, head_node, wait_for


# Found, not imported (tests/conftest.py, lacks(): Ray stays out of the test process until
# a test needs it). Written out here: Ray's actors import this module, without conftest.
RAY_INSTALLED = pytest.mark.skipif(importlib.util.find_spec("ray") is None, reason="needs ray")
pytestmark = [pytest.mark.slow, pytest.mark.timeout(300), RAY_INSTALLED]
JOB = Path(__file__).with_name("ray_loader_job.py")


@pytest.fixture(scope="module")
def cluster_address():
    yield from head_node()


def run_job(case: str, address: str) -> None:
    env = {**os.environ, **RAY_ENV, "RAY_ADDRESS": address,
           "PYTHONPATH": ray_testing.python_path()}
    done = subprocess.run([sys.executable, str(JOB), case], env=env, capture_output=True, text=True, timeout=280)
    assert done.returncode == 0 and done.stdout.strip().endswith("ok"), done.stdout[-2000:] + done.stderr[-4000:]
    assert wait_for(lambda: not actor_processes()), f"actor processes left: {actor_processes()}"


def test_the_same_batches_as_without_ray_and_a_checkpoint_resumes_them(cluster_address):
    run_job("same-batches-and-resume", cluster_address)


def test_ranks_workers_and_actors_each_get_their_share(cluster_address):
    run_job("ranks", cluster_address)


def test_the_actors_of_each_rank_and_worker_draw_their_own_random_values_again_for_the_same_seed(cluster_address):
    run_job("random-streams", cluster_address)


def test_spawned_workers_send_the_scripts_own_functions_to_the_actors(cluster_address):
    run_job("spawned-workers", cluster_address)
