"""Queue boundaries across threads and processes: every item once, in order, bounded; errors
arrive whole; a killed upstream is a clear error; nothing outlives the run."""

from __future__ import annotations

import gc
import multiprocessing
import os
import re
import signal
import threading
from typing import Any

import pytest
import torch
from conftest import _children, _open_fds, in_shared_memory, pid_gone, wait_until
from pipes_for_tests import (
    Counting,
    add_one,
    as_large_tensor,
    as_tensor,
    exit_at_three,
    fail_at_three,
    pid_and_item,
    unpicklable_item,
    with_random_draws,
)

import pipeload
from pipeload.datapipes.iter import IterableWrapper, QueueBoundary
from pipeload.datasets import IterableDataset
from pipeload.errors import WorkerDiedError

pytestmark = [pytest.mark.usefixtures("leak_guard", "no_gc"), pytest.mark.timeout(60)]
KINDS = ["thread", "process"]
DEADLINE_S = 10.0


@pytest.mark.parametrize("kind", KINDS)
def test_every_item_once_and_in_order(kind: str) -> None:
    pipe = IterableWrapper(range(3000)).map(add_one).queue_boundary(kind, buffer_size=7)
    assert list(pipe) == list(range(1, 3001))
    assert list(pipe.batch(1000).map(len)) == [1000, 1000, 1000]  # a second run, afresh


def thread_and_item(x: int) -> tuple[int, int]:
    return threading.get_ident(), x


def test_the_upstream_runs_in_another_thread_or_process() -> None:
    (ident, _), = IterableWrapper([0]).map(thread_and_item).queue_boundary("thread")
    assert ident != threading.get_ident()
    (pid, _), = IterableWrapper([0]).map(pid_and_item).queue_boundary("process")
    assert pid != os.getpid()


def test_a_thread_boundary_holds_at_most_buffer_size_items() -> None:
    counter = [0]
    it = iter(Counting(1000, counter).queue_boundary("thread", buffer_size=5))
    for taken in range(1, 20):
        next(it)
        assert wait_until(lambda: counter[0] >= taken + 5, DEADLINE_S)
        assert counter[0] <= taken + 5 + 1  # the buffer, and the one item in the producer's hand
    it.close()


class CountingMap:
    """Counts, in memory shared with the upstream process, the items the map has produced."""

    def __init__(self, shared: object) -> None:
        self.shared = shared

    def __call__(self, x: int) -> int:
        with self.shared.get_lock():  # type: ignore[attr-defined]
            self.shared.value += 1  # type: ignore[attr-defined]
        return x


def test_a_process_boundary_holds_at_most_buffer_size_items() -> None:
    produced = multiprocessing.get_context("fork").Value("i", 0)
    pipe = IterableWrapper(range(1000)).map(CountingMap(produced))
    it = iter(pipe.queue_boundary("process", buffer_size=6, multiprocessing_context="fork"))
    for taken in range(1, 20):
        assert next(it) == taken - 1
        assert wait_until(lambda: produced.value >= taken + 3, DEADLINE_S)  # the credit refills
        assert produced.value <= taken + 6 + 1  # never beyond the window (and the item in hand)
    it.close()


@pytest.mark.parametrize("kind", KINDS)
def test_an_upstream_error_arrives_whole_after_the_items_before_it(kind: str) -> None:
    # The run goes on after it, as the pipe alone would: a loop that catches the error gets the
    # items after it (a read-ahead that ended there lost every later shard of its worker,
    # uncounted). Between processes the error crosses as data, rebuilt with its type.
    it = iter(IterableWrapper(range(10)).map(fail_at_three).queue_boundary(kind))
    assert [next(it), next(it), next(it)] == [0, 1, 2]
    with pytest.raises(KeyError) as error:
        next(it)
    if kind == "thread":  # the very exception object, with its own traceback
        assert any("thread queue boundary" in note for note in error.value.__notes__)
        assert error.traceback[-1].name == "fail_at_three"
    else:
        text = str(error.value)
        assert "Caught KeyError in the upstream process of a queue boundary (pid" in text
        assert "in fail_at_three" in text and "no item 3" in text
    assert list(it) == [4, 5, 6, 7, 8, 9]


class NotImportable(Exception):
    """Defined where the consumer cannot find it by name (see the test below)."""


def fail_with_a_local_class(x: int) -> int:
    if x == 1:
        raise NotImportable("a class pickle cannot name")
    return x


def test_an_upstream_error_whose_class_cannot_cross_arrives_as_a_runtime_error_and_the_run_goes_on() -> None:
    NotImportable.__qualname__ = "somewhere.NotImportable"  # pickle cannot find it by this name
    try:
        it = iter(IterableWrapper(range(4)).map(fail_with_a_local_class)
                  .queue_boundary("process", multiprocessing_context="fork"))
        assert next(it) == 0
        with pytest.raises(RuntimeError, match="NotImportable: a class pickle cannot name"):
            next(it)
        assert list(it) == [2, 3]
    finally:
        NotImportable.__qualname__ = "NotImportable"


def test_an_item_that_cannot_cross_is_an_error_naming_the_stage() -> None:
    with pytest.raises(TypeError, match="while sending an item to the consumer"):
        list(IterableWrapper([2]).map(unpicklable_item).queue_boundary("process"))


@pytest.mark.parametrize("how, says", [("sigkill", "signal 9 (SIGKILL)"), ("exit", "exit code 7")])
def test_a_dead_upstream_process_is_a_clear_error_not_a_hang(how: str, says: str) -> None:
    fn = pid_and_item if how == "sigkill" else exit_at_three
    it = iter(IterableWrapper(range(10**6)).map(fn).queue_boundary("process", buffer_size=4))
    received = [next(it)]
    if how == "sigkill":
        os.kill(received[0][0], signal.SIGKILL)
    with pytest.raises(WorkerDiedError, match=re.escape(says)) as error:
        while True:
            received.append(next(it))
    items = [r[1] if how == "sigkill" else r for r in received]
    assert items == list(range(len(items)))  # whatever arrived came once and in order
    assert f"after {len(items)} items" in str(error.value)


@pytest.mark.parametrize("kind", KINDS)
def test_closing_or_dropping_a_run_stops_its_upstream(kind: str) -> None:
    pipe = IterableWrapper(range(10**6)).map(pid_and_item).queue_boundary(kind, buffer_size=2)
    it = iter(pipe)
    next(it)
    it.close()
    it.close()  # idempotent
    dropped = iter(pipe)
    pid, _ = next(dropped)
    del dropped  # the finalizer stops it, without waiting for the garbage collector
    if kind == "process":
        assert wait_until(lambda: pid_gone(pid), DEADLINE_S)
    for _ in pipe.header(3):
        pass  # a run that ends early is released when the loop drops it


@pytest.mark.parametrize("combine", ["zip", "mux"])
def test_a_zip_or_mux_that_ends_stops_the_boundaries_of_its_other_inputs(combine: str) -> None:
    # the iterator is still held (a persistent worker holds its run until the next epoch):
    # the upstream process is read no further, so it must not idle until the run is dropped
    long_one = IterableWrapper(range(10**6)).map(pid_and_item).queue_boundary("process", buffer_size=2)
    short_one = IterableWrapper([(0, "a"), (0, "b")])
    it = iter(getattr(short_one, combine)(long_one))
    items = [item for item in it]  # noqa: C416  (the run itself is kept below)
    pid = items[0][1][0] if combine == "zip" else items[1][0]
    assert wait_until(lambda: pid_gone(pid), DEADLINE_S)
    assert it is not None


def test_large_tensors_cross_a_process_boundary_as_shared_memory_small_ones_inline() -> None:
    large = list(IterableWrapper(range(5)).map(as_large_tensor).queue_boundary("process"))
    assert [(t[0].item(), t[-1].item()) for t in large] == [(i, i) for i in range(5)]
    assert all(in_shared_memory(t) for t in large)  # mapped from shared memory, not unpickled bytes
    small = list(IterableWrapper(range(5)).map(as_tensor).queue_boundary("process"))
    assert [t.tolist() for t in small] == [[i] * 4 for i in range(5)]
    assert not any(in_shared_memory(t) for t in small)  # inside the message: no shared-memory set-up


def test_spawn_sends_the_description_and_refuses_what_cannot_travel() -> None:
    pipe = IterableWrapper(range(6)).map(add_one).queue_boundary("process", multiprocessing_context="spawn")
    assert list(pipe) == list(range(1, 7))
    lambdas = IterableWrapper(range(3)).map(lambda x: x).queue_boundary(
        "process", multiprocessing_context=multiprocessing.get_context("spawn"))
    with pytest.raises(Exception, match=r"A queue boundary cannot send datapipe=.*because datapipe\.fn "
                                        r"\(a function\) cannot be pickled"):
        list(lambdas)


def test_the_upstream_process_is_seeded_from_the_parent_generator() -> None:
    def run() -> list[int]:
        torch.manual_seed(5)
        return list(IterableWrapper(range(8)).shuffle().queue_boundary("process"))

    first = run()
    assert first == run() and sorted(first) == list(range(8))


@pytest.mark.parametrize("kind", KINDS)
def test_a_loader_without_workers_gives_the_batches_and_random_stream_of_the_same_graph_without_it(
        kind: str) -> None:
    # The loader seeds the shuffle each epoch; a process boundary drew one more number from
    # torch's global generator every run, so epoch 2 on and the loop's own random numbers
    # differed from the same graph without the boundary.
    def epochs(graph: Any) -> tuple[list[list[int]], torch.Tensor]:
        torch.manual_seed(0)
        loader = pipeload.DataLoader(graph, batch_size=5)
        return [batch.tolist() for _ in range(3) for batch in loader], torch.rand(3)

    local = IterableWrapper(range(20)).shuffle().sharding_filter().map(add_one)
    across = IterableWrapper(range(20)).shuffle().sharding_filter().map(add_one).queue_boundary(kind, 4)
    (expected, expected_after), (got, got_after) = epochs(local), epochs(across)
    assert got == expected
    assert torch.equal(got_after, expected_after)


def random_draws_per_item(loader: Any) -> dict[int, tuple[float, float, float]]:
    return {int(item): tuple(draws) for item, draws in loader}  # the loader makes the tuple a list


@pytest.mark.parametrize("worker_type", ["thread", "process"])
def test_the_upstream_processes_of_different_workers_draw_different_random_values_again_for_the_same_seed(
        worker_type: str) -> None:
    # The loader seeds every worker's shuffle alike (one order to shard); the upstream
    # processes were seeded from those seeds alone, so both workers' drew the same values.
    def draws(seed: int) -> dict[int, tuple[float, float, float]]:
        torch.manual_seed(seed)
        graph = (IterableWrapper(range(8)).shuffle().sharding_filter().map(with_random_draws)
                 .queue_boundary("process", 4))
        return random_draws_per_item(pipeload.DataLoader(graph, batch_size=None, num_workers=2,
                                                         worker_type=worker_type))

    first = draws(0)
    assert sorted(first) == list(range(8))
    for generator in range(3):  # torch, random and numpy: each worker's upstream its own values
        assert len({values[generator] for values in first.values()}) == 8, first
    assert draws(0) == first  # reproducible from the loader's seed
    assert draws(1) != first


@pytest.mark.filterwarnings("ignore:This process is rank")  # seeded alike by manual_seed
def test_the_upstream_processes_of_different_ranks_draw_different_random_values(
        monkeypatch: pytest.MonkeyPatch) -> None:
    def draws(rank: int) -> list[tuple[float, float, float]]:
        monkeypatch.setenv("RANK", str(rank))
        monkeypatch.setenv("WORLD_SIZE", "2")
        torch.manual_seed(0)  # the ranks seed alike, and share the shuffle's seed anyway
        graph = (IterableWrapper(range(8)).shuffle().sharding_filter().map(with_random_draws)
                 .queue_boundary("process", 4))
        return list(random_draws_per_item(pipeload.DataLoader(graph, batch_size=None)).values())

    rank_0, rank_1 = draws(0), draws(1)
    assert len(rank_0) == len(rank_1) == 4
    assert not set(rank_0) & set(rank_1), (rank_0, rank_1)


@pytest.mark.parametrize("kind", KINDS)
def test_a_seed_given_with_set_seed_seeds_the_next_run_only_as_without_a_boundary(kind: str) -> None:
    shuffle = IterableWrapper(range(30)).shuffle()
    across = shuffle.queue_boundary(kind, 6)
    shuffle.set_seed(7)
    first, second = list(across), list(across)
    assert first == list(IterableWrapper(range(30)).shuffle().set_seed(7))
    assert sorted(second) == list(range(30)) and second != first  # the next run draws its own


def test_boundaries_nest_and_join_greedily() -> None:
    left = IterableWrapper(range(50)).queue_boundary("process", buffer_size=3)
    right = IterableWrapper(range(100, 150)).prefetch(4).queue_boundary("thread")
    joined = list(left.greedy_join(right))
    assert sorted(joined) == list(range(50)) + list(range(100, 150))
    assert [x for x in joined if x < 100] == list(range(50))  # each input keeps its order


def test_arguments_are_checked() -> None:
    with pytest.raises(ValueError, match="worker_type should be one of"):
        QueueBoundary(IterableWrapper([]), "fiber")
    with pytest.raises(ValueError, match="multiprocessing_context only applies"):
        QueueBoundary(IterableWrapper([]), "thread", multiprocessing_context="spawn")
    with pytest.raises(AssertionError, match="Buffer size is required to be larger than 0"):
        IterableWrapper([]).prefetch(0)
    # A misspelt option ran with the default buffer; a bad start method failed only at the run.
    with pytest.raises(TypeError, match=r"queue_boundary\('thread'\) takes no other options, but got buffersize=1"):
        IterableWrapper([]).queue_boundary("thread", buffersize=1)
    with pytest.raises(TypeError, match=r"queue_boundary\('process'\) takes no other options, but got bufer_size=1"):
        IterableWrapper([]).queue_boundary("process", bufer_size=1)
    with pytest.raises(ValueError, match=r"multiprocessing_context should be None, a context or one of .*'bogus'"):
        IterableWrapper([]).queue_boundary("process", multiprocessing_context="bogus")
    with pytest.raises(ValueError, match=r"size should be None or a positive number of megabytes, but got size=-1"):
        IterableWrapper([]).in_memory_cache(size=-1)
    with pytest.raises(TypeError, match=r"size should be None or a number of megabytes, but got size='x'"):
        IterableWrapper([]).in_memory_cache(size="x")


def test_a_thread_boundary_runs_inside_dataloader_process_workers() -> None:
    pipe = IterableWrapper(range(40)).sharding_filter().map(add_one).prefetch(3)
    loader = pipeload.DataLoader(pipe, batch_size=5, num_workers=2)
    assert sorted(sum((b.tolist() for b in loader), [])) == list(range(1, 41))


def test_a_process_boundary_runs_inside_dataloader_process_workers() -> None:
    """A process worker is a daemon; the boundary's upstream process leaves with its parent, so
    the worker may start it (test_separate_process_in_workers.py kills them)."""
    pipe = IterableWrapper(range(40)).sharding_filter().map(pid_and_item).queue_boundary("process")
    seen = list(pipeload.DataLoader(pipe, batch_size=None, num_workers=2))
    assert sorted(item for _, item in seen) == list(range(40))
    assert len({pid for pid, _ in seen}) == 2 and os.getpid() not in {pid for pid, _ in seen}


class LoaderInside(IterableDataset):
    """An iterable dataset that runs a DataLoader with process workers of its own."""

    def __iter__(self) -> Any:
        return iter(pipeload.DataLoader(list(range(4)), num_workers=1))


def test_other_processes_inside_a_process_worker_are_still_a_clear_error() -> None:
    with pytest.raises(RuntimeError, match="daemon processes may not have children"):
        list(pipeload.DataLoader(LoaderInside(), num_workers=1))


def _boundary(pipe: Any, kind: str) -> Any:
    return pipe.queue_boundary(kind, buffer_size=2,
                               **({"multiprocessing_context": "fork"} if kind == "process" else {}))


def _nested(first: str, second: str, fails: str) -> tuple[Any, list[Any]]:
    """range -> first boundary -> second boundary, ``fail_at_three`` upstream of both, between
    them or downstream of both (``fails``); with the boundary pipes, for their kept slabs."""
    pipe = IterableWrapper(range(40))
    pipe = pipe.map(fail_at_three) if fails == "upstream" else pipe
    inner = _boundary(pipe, first)
    outer = _boundary(inner.map(fail_at_three) if fails == "between" else inner, second)
    return (outer.map(fail_at_three) if fails == "downstream" else outer), [inner, outer]


LOADER_ENGINES = [pytest.param({}, id="no-workers"),
                  pytest.param({"num_workers": 2, "worker_type": "thread"}, id="thread-workers")]


@pytest.mark.parametrize("engine", LOADER_ENGINES)
@pytest.mark.parametrize("fails", ["upstream", "between", "downstream"])
@pytest.mark.parametrize(("first", "second"), [("process", "thread"), ("thread", "thread"),
                                               ("thread", "process"), ("process", "process")])
def test_an_error_past_a_boundary_stops_every_boundary_before_it_while_the_loader_lives(
        first: str, second: str, fails: str, engine: dict[str, Any], leak_guard: Any) -> None:
    # The error (a thread boundary hands on the very exception, traceback and all) holds the
    # frames that read the graph, and they hold the error: a cycle only the collector frees.
    # The feed went on putting, the upstream process went on producing, until the loader went.
    pipe, boundaries = _nested(first, second, fails)
    loader = pipeload.DataLoader(pipe, batch_size=None, **engine)
    with pytest.raises(KeyError, match="no item 3"):
        for _ in loader:
            pass
    for boundary in boundaries:  # the slabs a stopped run gave back (kept for the next run)
        boundary.release_shared_memory()
    assert leak_guard.leftovers() == []  # the loader (and the error's frames) still live
    with pytest.raises(KeyError, match="no item 3"):  # a second epoch: the same, not a hang
        list(loader)
    assert loader is not None


def fail_at_three_keeping_the_error(x: int) -> int:
    """``fail_at_three``, written as user code often is: the error in a local of the frame its
    traceback keeps (a reference cycle only the collector frees)."""
    if x == 3:
        error = KeyError(f"no item {x}")
        raise error
    return x


@pytest.mark.parametrize("engine", LOADER_ENGINES)
@pytest.mark.parametrize("kind", KINDS)
def test_an_epoch_left_by_an_error_that_user_code_keeps_in_a_cycle_stops_the_boundaries_of_its_graph(
        kind: str, engine: dict[str, Any], leak_guard: Any) -> None:
    # The error's traceback holds every frame from the loop down to the user's function, the
    # loader's own among them: the run over the graph stayed, and its upstream kept producing,
    # for as long as the cycle lived. The epoch's end must stop it, not the collector.
    boundary = _boundary(IterableWrapper(range(40)), kind)
    loader = pipeload.DataLoader(boundary.map(fail_at_three_keeping_the_error), batch_size=None, **engine)
    with pytest.raises(KeyError, match="no item 3"):
        for _ in loader:
            pass
    # The loader still lives, and so does the cycle: what it holds of the graph (a thread
    # worker's copy, with the slabs its boundary keeps for a next run) is the collector's, but
    # no upstream may still run, nor any channel to one stay open.
    assert wait_until(lambda: not _producers_left(leak_guard), DEADLINE_S), _producers_left(leak_guard)
    assert loader is not None
    gc.collect()  # the user's cycle, for the leak guard


def _producers_left(guard: Any) -> list[str]:
    """The processes, threads and pipes or sockets started since ``guard``'s snapshot."""
    before = guard.before
    children = [text for pid, text in _children().items() if pid not in before.children]
    threads = [t.name for t in threading.enumerate() if t not in before.threads and t.is_alive()]
    channels = [target for fd, target in _open_fds().items()
                if before.fds.get(fd) != target and target.startswith(("pipe:", "socket:"))]
    return children + threads + channels
