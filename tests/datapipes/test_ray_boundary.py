"""queue_boundary("ray"): upstream stages in actors of a real local Ray cluster (one per module).

Every test ends with no actor process and no object of ours left in the store
(``assert_nothing_left``); the module's cluster is shut down after and checked gone.
"""

from __future__ import annotations

import collections
import contextlib
import os
import re
import signal
import socket
import subprocess
import sys
import threading
import time

import importlib.util

import pytest

import ray_testing  # noqa: F401  (sets Ray's environment before it is imported)
from ray_testing import actor_processes, assert_nothing_left, in_process_cluster, wait_for

import numpy as np  # noqa: E402
import torch  # noqa: E402

import pipeload  # noqa: E402
from pipeload.datapipes.iter import IterableWrapper  # noqa: E402
from pipeload.errors import WorkerDiedError  # noqa: E402

# Found, not imported (tests/conftest.py, lacks(): Ray stays out of the test process until
# a test needs it). Written out here: Ray's actors import this module, without conftest.
RAY_INSTALLED = pytest.mark.skipif(importlib.util.find_spec("ray") is None, reason="needs ray")
pytestmark = [pytest.mark.timeout(120), RAY_INSTALLED, pytest.mark.imports_large_libraries]


@pytest.fixture(scope="module")
def cluster():
    yield from in_process_cluster()


@pytest.fixture
def clean(cluster):
    yield cluster
    assert_nothing_left()


def square(x: int) -> int:
    return x * x


def fail_at_7(x: int) -> int:
    if x == 7:
        raise ValueError(f"bad item {x}")
    return x


def slow_square(x: int) -> int:
    time.sleep(0.05)
    return x * x


def big_tensor(x: int) -> dict:
    return {"index": x, "pixels": torch.full((256, 1024), float(x)), "array": np.full(1 << 16, x)}


class LogTo:
    """Appends each item it passes to a file: what the actors made, seen from here."""

    def __init__(self, path: str) -> None:
        self.path = path

    def __call__(self, x: int) -> int:
        with open(self.path, "a") as file:
            file.write(f"{x}\n")
        return x


def test_items_come_back_in_order_once_each_and_the_actors_serve_the_next_run(clean, no_gc):
    pipe = IterableWrapper(range(41)).sharding_filter().map(slow_square)
    boundary = pipe.queue_boundary("ray", 8, num_actors=2)
    abandoned = iter(boundary)
    assert [next(abandoned) for _ in range(3)] == [0, 1, 4]
    del abandoned  # dropped, not closed, the collector off: its actors are back at once
    assert len(boundary._ray_actors._held["idle"]) == 2
    iterator = iter(boundary)
    squares = [x * x for x in range(41)]  # what list(pipe) gives, without its 2 s of sleeps
    assert list(iterator) == squares  # round-robin over interleaved shards: the same order
    stats = iterator.stats()
    assert stats.items == 41 and stats.restarts == 0
    assert stats.actor_s >= 41 * 0.05 * 0.9  # what the two actors spent in slow_square
    assert stats.wait_s > 0 and stats.transfer_s >= 0
    first = {process.pid for process in actor_processes()}
    assert len(first) == 2
    assert list(boundary) == squares
    assert {process.pid for process in actor_processes()} == first  # no new actor for a new run
    boundary.release_actors()
    assert wait_for(lambda: not actor_processes())


@pytest.mark.slow  # two actor starts at the least (the first run's, the replacement's): ~2.5 s each here
def test_pooled_actors_that_died_while_idle_are_replaced_and_the_next_run_gives_every_item(clean):
    import ray
    # The next run took them from the pool as they were: its first item was a WorkerDiedError
    # ("Ray actor 0 of 2 ... died ... after 0 items were handed out").
    pipe = IterableWrapper(range(20)).sharding_filter().map(square)
    boundary = pipe.queue_boundary("ray", 4, num_actors=2)
    assert list(boundary) == list(pipe)
    killed, crashed = boundary._ray_actors._held["idle"]
    gone = {ray.get(handle.describe.remote())["pid"] for handle in (killed, crashed)}
    ray.kill(killed)  # killed through Ray, and a process that died (a crash, the OOM killer)
    os.kill(ray.get(crashed.describe.remote())["pid"], signal.SIGKILL)
    assert list(boundary) == list(pipe)
    pids = lambda: {process.pid for process in actor_processes()}  # noqa: E731
    assert wait_for(lambda: len(pids()) == 2 and not pids() & gone), (pids(), gone)
    replacements = pids()
    assert list(boundary) == list(pipe)
    assert pids() == replacements  # pooled in their turn
    boundary.release_actors()


def test_shuffles_upstream_split_one_permutation_over_the_actors(clean):
    shuffle = IterableWrapper(range(30)).shuffle()
    boundary = shuffle.sharding_filter().queue_boundary("ray", 6, num_actors=3)
    shuffle.set_seed(7)  # seeded: the order of one process, cut in three and read back in turn
    assert list(boundary) == list(IterableWrapper(range(30)).shuffle().set_seed(7))
    unseeded = list(boundary)  # every actor draws the same seed, so their shards still partition
    assert sorted(unseeded) == list(range(30)) and unseeded != list(range(30))


def test_backpressure_and_a_checkpoint_resumed_on_the_same_actors(clean, tmp_path):
    import ray
    log = tmp_path / "made.txt"
    log.touch()
    made = lambda: len(log.read_text().split())  # noqa: E731
    shuffle = IterableWrapper(range(60)).shuffle().set_seed(3)
    pipe = shuffle.sharding_filter().map(LogTo(str(log)))
    expected = list(IterableWrapper(range(60)).shuffle().set_seed(3))
    buffer_size, taken = 8, 5
    boundary = pipe.queue_boundary("ray", buffer_size, num_actors=2)
    first = iter(boundary)
    head = [next(first) for _ in range(taken)]
    # The actors make what the budget allows, then stop: once each has answered every request
    # made before a call queued behind them, nothing more is made.
    assert wait_for(lambda: made() >= taken + buffer_size - 2)
    for lane in first._upstream._lanes:
        ray.get(lane.handle.describe.remote())
    assert made() <= taken + buffer_size
    head += [next(first) for _ in range(32)]
    state = first.state_dict()
    first.close()
    shuffle.set_seed(999)  # no matter: the state carries the shuffle's own generator
    second = iter(boundary)
    second.load_state_dict(state)
    assert head + list(second) == expected


def test_large_tensors_and_arrays_come_from_the_object_store_without_copies(clean):
    items = list(IterableWrapper(range(4)).sharding_filter().map(big_tensor).queue_boundary("ray", 4, num_actors=2))
    assert [item["index"] for item in items] == [0, 1, 2, 3]
    with open("/proc/self/maps") as maps:
        store = [line for line in maps if "plasma" in line]
    spans = [tuple(int(bound, 16) for bound in line.split()[0].split("-")) for line in store]
    inside = lambda address: any(low <= address < high for low, high in spans)  # noqa: E731
    for item in items:
        assert torch.equal(item["pixels"], torch.full((256, 1024), float(item["index"])))
        assert inside(item["pixels"].data_ptr()), "the tensor was copied out of the object store"
        assert inside(item["array"].ctypes.data), "the array was copied out of the object store"
        item["pixels"] += 1  # ours alone: writable in place
    del items


class Tagged(torch.Tensor):
    """A tensor subclass with an attribute of its own."""


def odd_tensors(x: int) -> dict:
    """Tensors of 16 KiB or more whose bytes alone do not say what they are."""
    g = torch.Generator().manual_seed(x)
    dense = torch.randn(64, 128, generator=g)
    tagged = dense.clone().as_subclass(Tagged)
    tagged.tag = f"item {x}"
    complex_values = torch.randn(64, 64, dtype=torch.complex64, generator=g)
    return {
        "subclass": tagged,
        "conjugate": complex_values.conj(),
        "negative": complex_values.conj().imag,
        "quantized": torch.quantize_per_tensor(dense, 0.05, 3, torch.quint8),
        "sparse": (dense * (dense > 1)).to_sparse(),
        "requires_grad": dense.clone().requires_grad_(),
        "plain": dense,
        # Came back in the standard layout, and as 16 MB of bytes, until stop 44:
        "channels_last": torch.randn(2, 16, 16, 16, generator=g).to(memory_format=torch.channels_last),
        "expanded": torch.zeros(1).expand(1 << 20),
    }


def test_tensors_whose_bytes_do_not_say_all_arrive_as_they_were_made(clean):
    # A subclass came back a plain tensor without its attribute, a conjugate view without its
    # conjugation (other values), and sparse or quantized tensors failed in the actor.
    items = list(IterableWrapper(range(2)).sharding_filter().map(odd_tensors).queue_boundary("ray", 2, num_actors=2))
    assert len(items) == 2
    for x, item in enumerate(items):
        for name, made in odd_tensors(x).items():
            got = item[name]
            assert type(got) is type(made), name
            assert (got.layout, got.dtype, got.shape, got.requires_grad) == (made.layout, made.dtype, made.shape,
                                                                             made.requires_grad), name
            assert (got.is_conj(), got.is_neg(), got.is_quantized) == (made.is_conj(), made.is_neg(),
                                                                       made.is_quantized), name
            if made.is_quantized:
                assert torch.equal(got.int_repr(), made.int_repr()) and got.q_scale() == made.q_scale(), name
            elif made.is_sparse:
                assert torch.equal(got.to_dense(), made.to_dense()), name
            else:
                assert torch.equal(got.detach().resolve_conj().resolve_neg(),
                                   made.detach().resolve_conj().resolve_neg()), name
        assert item["subclass"].tag == f"item {x}"
        assert item["channels_last"].stride() == odd_tensors(x)["channels_last"].stride()
        assert item["expanded"].untyped_storage().nbytes() == 4
    del items


def with_defaults(x: int) -> collections.defaultdict:
    """A defaultdict beside a tensor large enough to travel apart: it came back a plain dict."""
    return collections.defaultdict(int, {"pixels": torch.full((64, 128), float(x)), "small": collections.defaultdict(list)})


def test_mappings_of_other_classes_arrive_with_their_class_and_default(clean):
    item, = IterableWrapper([3]).sharding_filter().map(with_defaults).queue_boundary("ray", 2)
    assert type(item) is collections.defaultdict and item["missing"] == 0
    assert type(item["small"]) is collections.defaultdict and item["small"]["missing"] == []
    assert torch.equal(item["pixels"], torch.full((64, 128), 3.0))


def test_an_upstream_exception_arrives_in_its_place_and_the_run_goes_on(clean):
    # As across a thread or process boundary: the run ended there, and the other actors' items
    # of the epoch were lost (36 of 100 samples in a loop that caught the error and went on).
    iterator = iter(IterableWrapper(range(20)).sharding_filter().map(fail_at_7).queue_boundary("ray", 4, num_actors=2))
    got = [next(iterator) for _ in range(7)]
    with pytest.raises(ValueError, match="bad item 7") as raised:
        next(iterator)
    assert got == [0, 1, 2, 3, 4, 5, 6]
    assert "Ray actor 1 of 2" in str(raised.value) and "fail_at_7" in str(raised.value)
    assert list(iterator) == list(range(8, 20))



def sets_a_signal_handler(x: int) -> int:
    """A stage that installs a handler (a decode timeout's SIGALRM): Python allows it on the main
    thread only."""
    signal.signal(signal.SIGALRM, signal.getsignal(signal.SIGALRM))
    return x


def test_the_stage_runs_on_the_actors_main_thread(clean):
    # A Ray actor runs its calls on its main thread unless it has concurrency groups: a version
    # that gave the actors one (to hear of a dropped run) broke any stage that sets a signal.
    assert list(IterableWrapper(range(4)).sharding_filter().map(sets_a_signal_handler)
                .queue_boundary("ray", 2)) == [0, 1, 2, 3]


def a_lock(x: int) -> threading.Lock:
    return threading.Lock()


@pytest.mark.slow  # an actor's failure is named in test_an_upstream_exception_arrives_in_its_place_and_the_run_goes_on
def test_an_item_ray_cannot_pickle_is_a_type_error_naming_the_actor_as_across_a_process(clean):
    # The process boundary says the same: TypeError: cannot pickle '_thread.lock' object.
    with pytest.raises(TypeError, match=r"cannot pickle '_thread\.lock' object") as raised:
        list(IterableWrapper(range(4)).map(a_lock).queue_boundary("ray", 2))
    assert "Caught TypeError in Ray actor 0 of 1" in str(raised.value)


def test_a_killed_actor_is_an_error_naming_it_within_seconds(clean):
    import ray
    iterator = iter(IterableWrapper(range(400)).sharding_filter().map(slow_square)
                    .queue_boundary("ray", 4, num_actors=2))
    assert [next(iterator) for _ in range(4)] == [0, 1, 4, 9]
    pid = ray.get(iterator._upstream._lanes[1].handle.describe.remote())["pid"]
    os.kill(pid, signal.SIGKILL)
    started = time.monotonic()
    with pytest.raises(WorkerDiedError, match=r"Ray actor 1 of 2 .*pid %d.* died while making items" % pid):
        for _ in iterator:
            pass
    assert time.monotonic() - started < 10


@pytest.mark.slow
def test_with_max_restarts_a_killed_actor_resumes_and_every_item_comes_once(clean):
    import ray
    pipe = IterableWrapper(range(120)).sharding_filter().map(slow_square)
    iterator = iter(pipe.queue_boundary("ray", 4, num_actors=2, max_restarts=1))
    got = [next(iterator) for _ in range(10)]
    pid = ray.get(iterator._upstream._lanes[0].handle.describe.remote())["pid"]
    os.kill(pid, signal.SIGKILL)
    got += list(iterator)
    assert got == [x * x for x in range(120)]
    assert iterator.stats().restarts == 1


def test_the_ray_kind_of_the_rfcs_queue(clean):
    from pipeload.datapipes import DataLoaderQueue, NotAvailable, QueueError

    queue = DataLoaderQueue(kind="ray", maxsize=4)
    with pytest.raises(QueueError, match="no actors yet"):
        queue.get(blocking=False)
    with pytest.raises(NotImplementedError, match="read at this end only"):
        queue.put(1)
    # As a queue boundary starts its upstream: the boundary's options for this kind.
    options = {"num_actors": 2, "multiprocessing_context": None}
    type(queue).start_producer(IterableWrapper(range(10)).sharding_filter().map(slow_square), queue, "squares", options)
    with pytest.raises(NotAvailable):  # the actors take seconds to start
        queue.get(blocking=False)
    assert [queue.get(timeout=60) for _ in range(10)] == [x * x for x in range(10)]
    with pytest.raises(QueueError, match="put its last item") as ended:
        queue.get()
    assert ended.value.reason == QueueError.CLOSED and queue.closed


def test_the_loaders_stats_show_the_ray_stage(clean):
    import pipeload

    graph = IterableWrapper(range(24)).sharding_filter().map(slow_square).queue_boundary("ray", 4, num_actors=2)
    loader = pipeload.DataLoader(graph, batch_size=4)
    assert len(list(loader)) == 6
    stats = loader.stats()
    assert stats.ray.items == 24 and stats.stages["ray"].count == 24
    assert stats.ray.actor_s >= 24 * 0.05 * 0.9 and stats.ray.wait_s > 0
    assert "Ray stage: 24 items from its actors" in stats.summary()
    assert len(list(loader)) == 6  # a second epoch counts on
    assert loader.stats().ray.items == 48


@pytest.mark.slow  # test_actors_that_cannot_fit_the_cluster_are_said_at_once_with_the_numbers runs fast
def test_an_actor_the_cluster_cannot_place_is_an_error_not_a_hang(clean):
    boundary = IterableWrapper(range(4)).queue_boundary("ray", 2, resources={"no_such_thing": 1}, start_timeout_s=2)
    started = time.monotonic()
    with pytest.warns(UserWarning, match=r"asks for 1 actor with resources=\{'no_such_thing': 1\}"):
        with pytest.raises(TimeoutError, match=r"Ray actor 0 of 1 .* did not start within 2 s.*no_such_thing"):
            list(boundary)
    assert time.monotonic() - started < 10


@pytest.mark.slow
def test_thread_workers_share_this_processs_connection_and_split_the_samples(clean):
    import pipeload

    graph = IterableWrapper(range(40)).shuffle().sharding_filter().map(square).queue_boundary("ray", 4, num_actors=2)
    torch.manual_seed(0)
    loader = pipeload.DataLoader(graph, batch_size=4, num_workers=2, worker_type="thread")
    seen = [x for batch in loader for x in batch.tolist()]
    assert sorted(seen) == [x * x for x in range(40)]
    del loader


def test_thread_workers_that_do_not_persist_take_the_pipes_actors_again_next_epoch(clean, no_gc):
    # Each epoch's thread workers iterate new copies of the graph, and a copy's actor pool was its
    # own: every epoch killed the last one's actors and started new ones (seconds each), where
    # the same loop without workers, in the same process, kept them.
    pipe = IterableWrapper(range(20)).sharding_filter().map(square).queue_boundary("ray", 4, num_actors=1)
    loader = pipeload.DataLoader(pipe, batch_size=None, num_workers=2, worker_type="thread")
    actors = []
    for _ in range(2):
        seen = []
        for x in loader:
            seen.append(int(x))
            if len(seen) == 10:  # both workers have handed out items: their actors run
                actors.append({process.pid for process in actor_processes()})
        assert sorted(seen) == [x * x for x in range(20)]
    assert len(actors[0]) == 2  # one per worker
    assert actors[1] == actors[0]
    pipe.release_actors()
    assert wait_for(lambda: not actor_processes())
    del loader


@pytest.mark.slow  # two runs of actors per worker (~5 s); one run's seeding in test_shuffles_upstream_split_one_permutation_over_the_actors
def test_the_actors_of_different_workers_draw_different_random_values_again_for_the_same_seed(clean):
    # The loader seeds every worker's shuffle alike (one order to shard); the actors were
    # seeded from those seeds alone, so both workers' actors drew the same values.
    import pipeload
    from pipes_for_tests import with_random_draws

    def draws() -> dict[int, tuple[float, ...]]:
        torch.manual_seed(0)
        graph = (IterableWrapper(range(8)).shuffle().sharding_filter().map(with_random_draws)
                 .queue_boundary("ray", 4))
        loader = pipeload.DataLoader(graph, batch_size=None, num_workers=2, worker_type="thread")
        return {int(item): tuple(values) for item, values in loader}

    first = draws()
    assert sorted(first) == list(range(8))
    for generator in range(3):  # torch, random and numpy
        assert len({values[generator] for values in first.values()}) == 8, first
    assert draws() == first  # reproducible from the loader's seed


def test_a_worker_forked_from_a_connected_process_says_how_to_start_workers(clean):
    import pipeload

    loader = pipeload.DataLoader(IterableWrapper(range(4)).queue_boundary("ray", 2), num_workers=1,
                                 multiprocessing_context="fork")
    with pytest.raises(RuntimeError, match="forked from one that is or was connected to Ray.*'spawn' or 'forkserver'"):
        list(loader)


def test_a_pipe_pickled_here_tells_its_reader_which_cluster_to_join(clean):
    import ray
    import pickle

    boundary = IterableWrapper(range(4)).queue_boundary("ray", 2)
    assert boundary.address is None
    assert pickle.loads(pickle.dumps(boundary)).address == ray.get_runtime_context().gcs_address


def test_bad_arguments_are_named():
    pipe = IterableWrapper(range(4))
    with pytest.raises(ValueError, match="needs a sharding_filter"):
        pipe.queue_boundary("ray", 4, num_actors=2)
    with pytest.raises(ValueError, match="buffer_size >= num_actors"):
        pipe.sharding_filter().queue_boundary("ray", 1, num_actors=2)


def _run_python(code: str) -> subprocess.CompletedProcess:
    env = {**os.environ, "PYTHONPATH": "src"}
    return subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=60)


def test_importing_pipeload_does_not_import_ray():
    done = _run_python("import sys, pipeload, pipeload.datapipes; assert 'ray' not in sys.modules, 'ray imported'")
    assert done.returncode == 0, done.stderr


def test_without_ray_the_error_names_the_extra_to_install():
    done = _run_python(
        "import sys; sys.modules['ray'] = None\n"
        "from pipeload.datapipes.iter import IterableWrapper\n"
        "list(IterableWrapper(range(3)).queue_boundary('ray', 2))"
    )
    assert done.returncode != 0
    assert done.stderr.strip().splitlines()[-1] == (
        "ImportError: queue_boundary('ray') needs the ray package: pip install 'pipeload[ray]'"
    )


def test_an_unreachable_cluster_is_one_line_naming_the_address():
    port = ray_testing.free_port()
    done = _run_python(
        "from pipeload.datapipes.iter import IterableWrapper\n"
        f"list(IterableWrapper(range(3)).queue_boundary('ray', 2, address='127.0.0.1:{port}'))"
    )
    assert done.returncode != 0
    last = done.stderr.strip().splitlines()[-1]
    assert last.startswith(f"ConnectionError: could not reach the Ray cluster at address='127.0.0.1:{port}'"), last


@pytest.mark.parametrize("answer, says", [
    pytest.param(b"", r"could not reach the Ray cluster at address='127\.0\.0\.1:\d+' \(no answer within 5 s\)",
                 marks=pytest.mark.slow, id="silent"),  # waits out the 5 s on purpose
    pytest.param(b"HTTP/1.0 400 Bad request\r\n\r\n", r"no Ray cluster at address='127\.0\.0\.1:\d+': something listens there",
                 id="http1"),
])
def test_an_address_where_something_other_than_ray_listens_fails_within_seconds_naming_it(answer, says):
    # The TCP probe passed and ray.init then retried for minutes.
    with socket.create_server(("127.0.0.1", 0)) as server:
        def answer_each() -> None:
            with server.accept()[0] as peer, contextlib.suppress(ConnectionError):
                if answer:
                    peer.sendall(answer)
                while peer.recv(1024):  # until the probe hangs up (a reset, when it left bytes unread)
                    pass

        threading.Thread(target=answer_each, daemon=True).start()
        port = server.getsockname()[1]
        started = time.monotonic()
        done = _run_python(
            "from pipeload.datapipes.iter import IterableWrapper\n"
            f"list(IterableWrapper(range(3)).queue_boundary('ray', 2, address='127.0.0.1:{port}'))"
        )
    assert time.monotonic() - started < 30
    last = done.stderr.strip().splitlines()[-1]
    assert re.match(r"ConnectionError: " + says, last), last


@pytest.mark.slow  # an address refused before any connection; the unreachable and wrong-service cases stay (~3 s)
def test_an_address_without_a_port_number_is_named():
    # In a process of its own: in this one, the module's cluster is connected already, and the
    # boundary uses that connection without reading the address.
    done = _run_python(
        "from pipeload.datapipes.iter import IterableWrapper\n"
        "list(IterableWrapper(range(3)).queue_boundary('ray', 2, address='localhost:head'))"
    )
    last = done.stderr.strip().splitlines()[-1]
    assert last.startswith("ValueError: queue_boundary('ray') address='localhost:head' should be 'host:port' "
                           "with a port number"), last


def test_actors_that_cannot_fit_the_cluster_are_said_at_once_with_the_numbers(clean):
    # The module's cluster was started by the test, not by the boundary: it might grow (an
    # autoscaler), so the boundary warns at once and waits start_timeout_s, as before.
    boundary = (IterableWrapper(range(6)).sharding_filter()
                .queue_boundary("ray", 6, num_actors=3, num_cpus=1, start_timeout_s=2))
    with pytest.warns(UserWarning, match=r"asks for 3 actors with num_cpus=1: 3 x 1 CPU = 3, "
                                         r"the cluster has 2 now\. The actors beyond what fits wait"):
        with pytest.raises(TimeoutError, match="did not start within 2 s"):
            list(boundary)


def test_the_actors_of_every_dataloader_worker_are_counted_against_the_cluster(clean):
    # Each worker's graph has its own actors, all needed at once (the workers take turns batch
    # by batch): 2 workers x 2 actors of 1 CPU on 2 CPUs waited start_timeout_s with no word.
    import pipeload

    boundary = (IterableWrapper(range(8)).sharding_filter()
                .queue_boundary("ray", 4, num_actors=2, num_cpus=1, start_timeout_s=2))
    loader = pipeload.DataLoader(boundary, batch_size=2, num_workers=2, worker_type="thread")
    with pytest.warns(UserWarning, match=r"asks for 4 actors \(2 for each of the 2 DataLoader workers, "
                                         r"whose actors all run at once.*4 x 1 CPU = 4, the cluster has 2"):
        with pytest.raises(TimeoutError, match="did not start within 2 s"):
            list(loader)
    del loader


@pytest.mark.slow  # starts a Ray cluster of its own (~7 s)
def test_ray_shut_down_while_a_boundary_waits_is_an_error_not_a_hang():
    # The replies asked for never came, and the loop waited for good.
    started = time.monotonic()
    done = _run_python(
        "import time, ray\n"
        "ray.init(num_cpus=1, include_dashboard=False, log_to_driver=False)\n"
        "from pipeload.datapipes.iter import IterableWrapper\n"
        "def slow(x):\n"
        "    time.sleep(0.5)\n"
        "    return x\n"
        "it = iter(IterableWrapper(range(100)).map(slow).queue_boundary('ray', 2, num_actors=1, num_cpus=0.5))\n"
        "next(it)\n"
        "ray.shutdown()  # between two items (from another thread, Ray itself may end the process)\n"
        "list(it)"
    )
    last = done.stderr.strip().splitlines()[-1]
    assert last.startswith("RuntimeError: Ray actor 0 of 1") and "Ray was shut down in this process" in last, done.stderr[-3000:]
    assert time.monotonic() - started < 50


@pytest.mark.slow  # starts a Ray cluster of its own (~7 s); the warning above runs the same check
def test_a_local_cluster_the_boundary_started_that_cannot_fit_its_actors_fails_at_once():
    started = time.monotonic()
    done = _run_python(
        "from pipeload.datapipes.iter import IterableWrapper\n"
        "pipe = IterableWrapper(range(4)).sharding_filter().queue_boundary(\n"
        "    'ray', 4, num_actors=2, num_cpus=1,\n"
        "    init_options={'num_cpus': 1, 'include_dashboard': False, 'log_to_driver': False})\n"
        "list(pipe)"
    )
    assert done.returncode != 0
    last = done.stderr.strip().splitlines()[-1]
    assert last.startswith("ValueError: queue_boundary('ray') asks for 2 actors with num_cpus=1: "
                           "2 x 1 CPU = 2, the cluster has 1. This process started"), last
    assert time.monotonic() - started < 60  # not start_timeout_s (300 s)


class FailAt:
    """Squares its items, failing at ``at`` once it is set (set between two runs of one pipe:
    each run sends the pipe as it is then)."""

    def __init__(self) -> None:
        self.at: int | None = None

    def __call__(self, x: int) -> int:
        if x == self.at:
            raise ValueError(f"bad item {x}")
        return x * x


@pytest.mark.slow  # an upstream failure's path runs fast in test_an_upstream_exception_arrives_in_its_place_and_the_run_goes_on
def test_a_failure_while_a_resumed_shard_makes_its_items_again_takes_its_place_there(clean):
    # The checkpoint of a run that went well, resumed by a run that fails at an item the actor
    # makes again (and drops) on its way to the resume point: the failed item takes its place
    # there, as across a thread or process boundary, and the items after the checkpoint come.
    fails = FailAt()
    boundary = IterableWrapper(range(20)).sharding_filter().map(fails).queue_boundary("ray", 4, num_actors=2)
    good = iter(boundary)
    head = [next(good) for _ in range(10)]
    state = good.state_dict()
    good.close()
    assert head == [x * x for x in range(10)]
    fails.at = 7
    failing = iter(boundary)
    failing.load_state_dict(state)
    assert list(failing) == [x * x for x in range(10, 20)]


@pytest.mark.slow  # checkpoints that do not fit: test_a_damaged_checkpoint_is_refused_naming_the_field runs fast
def test_a_shard_that_ends_before_its_resume_point_says_the_state_does_not_fit(clean):
    from pipeload.errors import IncompatibleStateError

    boundary = IterableWrapper(range(20)).sharding_filter().queue_boundary("ray", 4, num_actors=2)
    first = iter(boundary)
    [next(first) for _ in range(4)]
    state = first.state_dict()
    first.close()
    state["own"]["shards"][1]["skip"] = 50  # shard 1 has 10 items
    resumed = iter(boundary)
    resumed.load_state_dict(state)
    with pytest.raises(IncompatibleStateError, match=r"ended after 10 items.*resume point.*50"):
        list(resumed)
    boundary.release_actors()


DAMAGES = [
    (lambda own: own.update(turn=9), r"own\.turn should be an int from 0 to 1, but got own\.turn=9"),
    (lambda own: own.update(active=[0, 5]), r"own\.active\.1 should be an int from 0 to 1, but got own\.active\.1=5"),
    (lambda own: own["shards"][0].update(skip=-3), r"own\.shards\.0\.skip should be an int >= 0"),
    (lambda own: own.pop("shards"), r"it has no own\.shards"),
    (lambda own: own.update(shards=own["shards"][:1]), r"own\.shards should be a list of 2"),
    (lambda own: own.update(stray=1), r"own\.stray should be absent"),
]


def test_a_damaged_checkpoint_is_refused_naming_the_field(clean):
    import copy

    from pipeload.errors import IncompatibleStateError

    boundary = IterableWrapper(range(20)).sharding_filter().queue_boundary("ray", 4, num_actors=2)
    fresh = iter(boundary)  # a refused state sets nothing: one fresh run refuses them all
    state = fresh.state_dict()
    for damage, named in DAMAGES:
        damaged = copy.deepcopy(state)
        damage(damaged["own"])
        with pytest.raises(IncompatibleStateError, match=named):
            fresh.load_state_dict(damaged)
    fresh.load_state_dict(state)  # and the state as it was still loads
    assert list(fresh) == list(range(20))
    boundary.release_actors()


def test_closing_a_run_lets_go_of_its_replies_in_the_object_store(clean):
    iterator = iter(IterableWrapper(range(40)).sharding_filter().map(big_tensor).queue_boundary("ray", 8, num_actors=2))
    [next(iterator) for _ in range(3)]
    iterator.close()  # the iterator itself is still referenced: what it asked for goes anyway
    assert wait_for(lambda: ray_testing.objects_held() == 0), ray_testing._refs()
    with pytest.raises(StopIteration):  # a closed run hands out nothing more
        next(iterator)


@pytest.mark.slow  # the seeding is boundary/seeds.py's, which the process boundary's tests run fast
def test_a_seed_given_with_set_seed_seeds_the_next_run_only_as_without_ray(clean):
    shuffle = IterableWrapper(range(30)).shuffle()
    boundary = shuffle.sharding_filter().queue_boundary("ray", 6, num_actors=2)
    shuffle.set_seed(7)
    first, second = list(boundary), list(boundary)
    assert first == list(IterableWrapper(range(30)).shuffle().set_seed(7))
    assert sorted(second) == list(range(30)) and second != first  # the next run draws its own


def test_a_loader_without_workers_gives_the_batches_and_random_stream_of_the_same_graph_without_ray(clean):
    import pipeload

    def epochs(graph):
        torch.manual_seed(0)
        loader = pipeload.DataLoader(graph, batch_size=5)
        got = [batch.tolist() for _ in range(3) for batch in loader]
        return got, torch.rand(3)

    local = IterableWrapper(range(20)).shuffle().sharding_filter().map(square)
    boundary = IterableWrapper(range(20)).shuffle().sharding_filter().map(square).queue_boundary("ray", 4, num_actors=2)
    (expected, expected_after), (got, got_after) = epochs(local), epochs(boundary)
    assert got == expected
    assert torch.equal(got_after, expected_after)  # the training loop's random numbers too
    boundary.release_actors()


@pytest.mark.parametrize("arguments, error, named", [
    ({"buffer_size": "8"}, TypeError, r"buffer_size should be an int, but got buffer_size='8'"),
    ({"num_actors": 2.5}, TypeError, r"num_actors should be an int, but got num_actors=2\.5"),
    ({"num_actors": True}, TypeError, r"num_actors should be an int, but got num_actors=True"),
    ({"chunk_size": 1.5}, TypeError, r"chunk_size should be an int or None, but got chunk_size=1\.5"),
    # It was cut to each actor's share of buffer_size (4 here) without a word.
    ({"chunk_size": 5}, ValueError, r"chunk_size should be at most each actor's share of (buffer_size|maxsize) .* but got chunk_size=5"),
    ({"start_timeout_s": -1}, ValueError, r"start_timeout_s should be a number of seconds > 0, but got start_timeout_s=-1"),
    ({"start_timeout_s": "x"}, TypeError, r"start_timeout_s should be a number of seconds > 0, but got start_timeout_s='x'"),
    ({"init_options": 5}, TypeError, r"init_options should be a dict of ray\.init\(\) keyword arguments or None, but got init_options=5"),
    ({"address": 5}, TypeError, r"address should be a str or None, but got address=5"),
])
def test_arguments_of_the_wrong_type_are_named_before_anything_starts(arguments, error, named):
    from pipeload.datapipes import DataLoaderQueue

    pipe = IterableWrapper(range(4)).sharding_filter()
    with pytest.raises(error, match=named):
        pipe.queue_boundary("ray", **{"buffer_size": 4, **arguments})
    if "buffer_size" not in arguments:  # the queue's own maxsize has its own check
        with pytest.raises(error, match=named):
            DataLoaderQueue(kind="ray", maxsize=4, **arguments)


@pytest.mark.parametrize("options, error, named", [
    ({"num_cpus": -1}, ValueError, r"num_cpus should be a number >= 0 or None, but got num_cpus=-1"),
    ({"num_gpus": "1"}, TypeError, r"num_gpus should be a number >= 0 or None, but got num_gpus='1'"),
    ({"max_restarts": "3"}, TypeError, r"max_restarts should be an int >= 0, or -1 for no limit, but got max_restarts='3'"),
    ({"max_task_retries": -2}, ValueError, r"max_task_retries should be an int >= 0, or -1 .* but got max_task_retries=-2"),
    ({"resources": {"CPU": 1}}, ValueError, r"resources should be a dict .* but got resources=\{'CPU': 1\} \(key 'CPU'\)"),
    ({"resources": {"disk": -1}}, ValueError, r"but got resources=\{'disk': -1\} \('disk': -1\)"),
    ({"runtime_env": "env"}, TypeError, r"runtime_env should be a dict or None, but got runtime_env='env'"),
    ({"name": "decoder"}, ValueError, r"cannot use the actor option name='decoder': .* a name belongs to one actor"),
    ({"max_concurrency": 4}, ValueError, r"max_concurrency should be 1 .* but got max_concurrency=4"),
    ({"num_cpu": 1}, ValueError, r"cannot use the actor option num_cpu=1: Invalid option keyword num_cpu"),
    ({"lifetime": "forever"}, ValueError, r"cannot use the actor option lifetime='forever': actor `lifetime`"),
    # Passed by Ray's .options(), then refused inside Ray as the first run made its actors (a
    # TypeError naming no option), or outliving a crashed process (detached).
    ({"max_restarts": None}, TypeError, r"max_restarts should be an int >= 0, or -1 for no limit, but got max_restarts=None"),
    ({"max_task_retries": None}, TypeError, r"but got max_task_retries=None"),
    ({"scheduling_strategy": "BAD"}, ValueError, r"scheduling_strategy should be one of .* but got scheduling_strategy='BAD'"),
    ({"lifetime": "detached"}, ValueError, r"cannot use the actor option lifetime='detached': .* outlived a crashed"),
    # Ray asserted its type as the first run made its actors, with an empty AssertionError (stop 54).
    ({"placement_group": "x"}, TypeError, r"placement_group should be a .*PlacementGroup, 'default' or None, but got placement_group='x'"),
])
def test_actor_options_that_cannot_work_are_named_when_the_pipe_is_built(options, error, named):
    # They were Ray's to refuse when the first run started its actors (maybe in a DataLoader
    # worker, an epoch later), in Ray's words.
    from pipeload.datapipes import DataLoaderQueue

    pipe = IterableWrapper(range(4)).sharding_filter()
    with pytest.raises(error, match=r"queue_boundary\('ray'\) .*" + named):
        pipe.queue_boundary("ray", 4, **options)
    with pytest.raises(error, match=named):
        DataLoaderQueue(kind="ray", maxsize=4, **options)


def test_actor_options_that_work_are_kept_as_given():
    options = {"num_cpus": 0.5, "max_restarts": -1, "resources": {"disk": 1}, "scheduling_strategy": "SPREAD"}
    pipe = IterableWrapper(range(4)).sharding_filter().queue_boundary("ray", 4, **options)
    assert pipe.actor_options == options


def test_actors_killed_on_rays_own_thread_go_without_the_thread_waiting(clean):
    # The garbage collector may run a run's finalizer on Ray's own reply thread; a ray.kill made
    # there waits for a reply that only that thread would deliver: the whole process hung.
    import ray

    from pipeload.datapipes.boundary import ray_actors

    @ray.remote(num_cpus=0)
    class Idle:
        def ping(self) -> int:
            return 1

    victim, other = Idle.remote(), Idle.remote()
    ray.get([victim.ping.remote(), other.ping.remote()])
    returned = threading.Event()
    threads: list[str] = []

    def on_reply(_: object) -> None:  # runs on the thread that delivers the reply
        threads.append("ours" if threading.get_ident() in {t.ident for t in threading.enumerate()} else "Ray's")
        ray_actors.kill(ray, [victim])
        returned.set()

    other.ping.remote().future().add_done_callback(on_reply)
    assert returned.wait(30), "ray.kill waited on Ray's own thread"
    assert threads == ["Ray's"]

    def victim_gone() -> bool:  # killed from a thread of ours: a moment later
        try:
            ray.get(victim.ping.remote(), timeout=30)
        except ray.exceptions.RayActorError:
            return True
        return False

    assert wait_for(victim_gone), "the actor was not killed"
    ray.kill(other)


class StuckFrom:
    """Hangs on items from ``first`` on while ``marker`` exists (a hung read, say); once it has
    hung it stays hung, whatever becomes of the marker."""

    def __init__(self, first: int, marker: str) -> None:
        self.first, self.marker = first, marker

    def __call__(self, x: int) -> int:
        if x >= self.first and os.path.exists(self.marker):
            open(self.marker + ".entered", "w").close()  # the test can wait for the hang itself
            time.sleep(600)
        return x


@pytest.mark.slow  # ~5 s; a run left by break, the same settling, runs fast through the loader below
def test_an_actor_stuck_in_an_abandoned_run_is_not_handed_to_the_next(clean, tmp_path):
    # The run ended cleanly (the loop let go of it), so its actor, still inside the hung call, went
    # back to the pool; the next run's start queued behind that call for start_timeout_s and then
    # blamed the cluster's resources ("may lack the resources it asks for").
    marker = tmp_path / "hang"
    marker.touch()
    pipe = IterableWrapper(range(40)).sharding_filter().map(StuckFrom(10, str(marker))).queue_boundary(
        "ray", 8, num_actors=1, start_timeout_s=30)
    first = iter(pipe)
    assert [next(first) for _ in range(8)] == list(range(8))
    first.close()  # its actor is in the hung call for item 10's chunk
    marker.unlink()
    started = time.monotonic()
    assert list(pipe) == list(range(40))
    assert time.monotonic() - started < 20  # a new actor, not the hung one
    pipe.release_actors()


# ~5 s each: the pipe's own run is the same settling as the loader's, run fast
@pytest.mark.parametrize("through", [pytest.param("pipe", marks=pytest.mark.slow), "loader"])
def test_an_actor_stuck_in_a_run_left_by_break_is_not_handed_to_the_next(clean, tmp_path, through):
    # Only close() looked for actors still in a call: a loop's break drops the run, whose
    # finalizer pooled its hung actor, and the next run waited start_timeout_s behind it.
    marker = tmp_path / "hang"
    marker.touch()
    pipe = IterableWrapper(range(40)).sharding_filter().map(StuckFrom(10, str(marker))).queue_boundary(
        "ray", 8, num_actors=1, start_timeout_s=30)
    source = pipe if through == "pipe" else pipeload.DataLoader(pipe, batch_size=None)
    for taken, _ in enumerate(source):
        if taken == 7:
            assert wait_for(lambda: (tmp_path / "hang.entered").exists())  # in item 10's call
            break
    marker.unlink()
    started = time.monotonic()
    assert [int(x) for x in source] == list(range(40))
    assert time.monotonic() - started < 20  # a new actor, not the hung one
    pipe.release_actors()


@pytest.mark.parametrize("through", [pytest.param("pipe", marks=pytest.mark.slow), "loader"])
def test_a_new_run_made_before_the_last_lets_go_takes_its_actors_when_the_cluster_is_full(clean, through):
    import ray
    # it = iter(loader) makes the new run while the old one still holds the cluster's CPUs: its
    # new actors waited to be placed beside the old run's idle ones, and failed after
    # start_timeout_s blaming the cluster.
    cpus = int(ray.cluster_resources()["CPU"])
    pipe = IterableWrapper(range(4 * cpus)).sharding_filter().queue_boundary(
        "ray", 2 * cpus, num_actors=cpus, num_cpus=1, start_timeout_s=30)
    source = pipe if through == "pipe" else pipeload.DataLoader(pipe, batch_size=None)
    it = iter(source)
    next(it)
    started = time.monotonic()
    it = iter(source)
    assert sorted(int(x) for x in it) == list(range(4 * cpus))
    assert time.monotonic() - started < 20
    del it
    pipe.release_actors()


# One round gives way once each way (train's actors to val's, then val's back to train's): ~4
# actor starts. The second round (-m slow) checks that pipes giving way turn by turn settle.
@pytest.mark.parametrize("rounds", [1, pytest.param(2, marks=pytest.mark.slow)])
def test_idle_actors_of_another_pipe_give_way_to_a_pipe_whose_actors_would_not_fit(clean, rounds):
    import ray
    # A train pipe's idle actors kept the cluster's CPUs between its runs: a validation pipe's
    # actors, each of which fits the cluster alone, waited start_timeout_s and failed.
    cpus = int(ray.cluster_resources()["CPU"])
    train = IterableWrapper(range(20)).sharding_filter().queue_boundary(
        "ray", 2 * cpus, num_actors=cpus, num_cpus=1, start_timeout_s=30)
    val = IterableWrapper(range(10)).sharding_filter().queue_boundary(
        "ray", 2 * cpus, num_actors=cpus, num_cpus=1, start_timeout_s=30)
    for _ in range(rounds):
        assert list(train) == list(range(20))
        started = time.monotonic()
        assert list(val) == list(range(10))
        assert time.monotonic() - started < 20
    assert list(train) == list(range(20))  # val's idle actors give way in turn
    train.release_actors()
    val.release_actors()


@pytest.mark.parametrize("pipe, maxsize, named", [
    pytest.param(IterableWrapper(range(10)), 4, r"needs a sharding_filter\(\) upstream", id="unsharded"),
    pytest.param(IterableWrapper(range(10)).sharding_filter(), 1, r"needs maxsize >= num_actors .* maxsize=1, num_actors=2",
                 id="maxsize-below-actors"),
])
def test_a_ray_queue_made_by_hand_is_checked_as_the_boundary_is(pipe, maxsize, named):
    # Its actors started without the boundary's checks: 2 actors over an unsharded pipe gave every
    # item twice, and a maxsize below num_actors was exceeded.
    from pipeload.datapipes import DataLoaderQueue
    from pipeload.datapipes.boundary.ray_queue import RayQueue

    queue = DataLoaderQueue(kind="ray", maxsize=maxsize, num_actors=2)
    with pytest.raises(ValueError, match=named):
        RayQueue.start_producer(pipe, queue, "by-hand", {})


class MadeFor:
    """A slow stage (``pause`` s an item) that writes each item it makes to a file, with the run
    it made it for: ``run`` and ``pause`` are set here before a run sends the pipe (its actors
    get a copy)."""

    def __init__(self, path: str, pause: float) -> None:
        self.path, self.pause, self.run = path, pause, 1

    def __call__(self, x: int) -> int:
        time.sleep(self.pause)
        with open(self.path, "a") as file:
            file.write(f"{self.run}:{x}\n")
        return x


def test_the_run_after_a_break_does_not_wait_for_the_chunks_the_dropped_run_asked_ahead_for(clean, no_gc, tmp_path):
    # An actor answers its calls in order, and ray.cancel leaves a sync actor's queued calls to
    # run: the next epoch's first chunk waited behind every chunk the dropped run had asked for
    # (1.7 s late for a 0.3 s stage in chunks of 2; in chunks of 4 the actor was killed instead).
    from pipeload.datapipes.boundary.ray_dropped import flags_left

    earlier_flags = set(flags_left())  # another test's, if any: not this one's to judge
    log = tmp_path / "made"
    # 0.25 s an item: the break must reach the actor while it still makes items 4-7 (1 s), even
    # on a loaded machine.
    stage = MadeFor(str(log), pause=0.25)
    pipe = IterableWrapper(range(40)).map(stage).queue_boundary("ray", 12, num_actors=1, chunk_size=4)
    for _ in pipe:
        break  # item 0 in hand; the actor is making items 4-7, and 8-11 are asked for behind them
    actor = {process.pid for process in actor_processes()}
    stage.run, stage.pause = 2, 0.0  # what the next run's first item waits for is the first run's
    second = iter(pipe)
    assert next(second) == 0
    made = log.read_text().split()  # the next run's later chunks may be in already
    dropped = [int(entry[2:]) for entry in made if entry.startswith("1:")]
    assert dropped[:4] == [0, 1, 2, 3] and max(dropped) < 8, made  # the chunk queued made nothing
    assert made[len(dropped):len(dropped) + 4] == ["2:0", "2:1", "2:2", "2:3"]
    assert {process.pid for process in actor_processes()} == actor  # pooled, not killed and made anew
    # Taken down: no call of the run looks again.
    assert wait_for(lambda: not set(flags_left()) - earlier_flags), flags_left()
    del second
    pipe.release_actors()
