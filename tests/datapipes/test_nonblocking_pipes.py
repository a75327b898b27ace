"""The RFC's non-blocking API on the pipes themselves: ``nonblocking_next()`` on every iterable pipe
(its own run, made on first use), ``nonblocking_get(index)`` on every map pipe, and pipes written
with nothing else working everywhere a pipe does: chained, across boundaries, in DataLoader
workers (processes and threads), sharded, and resumed from a checkpoint."""

from __future__ import annotations

import itertools
import multiprocessing
from collections.abc import Callable
from typing import Any

import pytest
import torch.utils.data.datapipes.iter as theirs_iter
from pipes_for_tests import CountsDown, add_one, double, is_even, normalise, parity

import pipeload
from pipeload.datapipes import (
    EnsureNonBlockingNextDataPipe,
    NonBlockingIterDataPipe,
    NonBlockingMapDataPipe,
    NotAvailable,
    graph,
)
from pipeload.datapipes.iter import IterableWrapper, Sampler
from pipeload.datapipes.map import SequenceWrapper

pytestmark = pytest.mark.timeout(60)


def numbers() -> IterableWrapper:
    return IterableWrapper(range(12))


# Every built-in iterable operation, each built fresh (two copies are compared).
BUILT_IN: dict[str, Callable[[], Any]] = {
    "IterableWrapper": numbers,
    "map": lambda: numbers().map(add_one),
    "filter": lambda: numbers().filter(is_even),
    "flatmap": lambda: numbers().flatmap(lambda x: [x, x]),
    "enumerate": lambda: numbers().enumerate(),
    "batch": lambda: numbers().batch(5),
    "batch-collate": lambda: numbers().batch(4).collate(),
    "unbatch": lambda: numbers().batch(5).unbatch(),
    "padded_batch": lambda: IterableWrapper([[1], [2, 3], [4, 5, 6]]).padded_batch(2),
    "bucketbatch": lambda: numbers().bucketbatch(3, use_in_batch_shuffle=False).set_seed(3),
    "groupby": lambda: numbers().groupby(parity, group_size=3),
    "shuffle": lambda: numbers().shuffle().set_seed(3),
    "in_batch_shuffle": lambda: numbers().batch(4).in_batch_shuffle().set_seed(3),
    "sharding_filter": lambda: graph.apply_sharding(numbers().sharding_filter(), 3, 1),
    "cycle": lambda: numbers().cycle(2),
    "header": lambda: numbers().header(4),
    "in_memory_cache": lambda: numbers().in_memory_cache(),
    "zip": lambda: numbers().zip(numbers()),
    "concat": lambda: numbers().concat(numbers()),
    "mux": lambda: numbers().mux(numbers()),
    "greedy_join": lambda: numbers().greedy_join(numbers()),
    "fork": lambda: numbers().fork(2)[1],
    "demux": lambda: numbers().demux(2, parity)[0],
    "Sampler": lambda: Sampler(numbers()),
    "map-shuffle": lambda: SequenceWrapper(range(9)).shuffle().set_seed(3),
    "to_iter_datapipe": lambda: SequenceWrapper(range(9)).to_iter_datapipe(),
    "prefetch": lambda: numbers().prefetch(3),
    "queue_boundary": lambda: numbers().map(double).queue_boundary("thread", buffer_size=2),
}


def drain_nonblocking(pipe: Any) -> list[Any]:
    """Every item of ``pipe.nonblocking_next()``, asking again after NotAvailable."""
    items = []
    while True:
        try:
            items.append(pipe.nonblocking_next())
        except NotAvailable:
            continue
        except StopIteration:
            return items


# A fork or demux branch read again while the other branch never started warns, as torch's does.
@pytest.mark.filterwarnings("ignore:Some child DataPipes are not exhausted")
@pytest.mark.parametrize("name", BUILT_IN)
def test_every_built_in_pipe_reads_through_its_own_nonblocking_next(name: str) -> None:
    pipe = BUILT_IN[name]()
    assert normalise(drain_nonblocking(pipe)) == normalise(list(BUILT_IN[name]()))
    with pytest.raises(StopIteration):
        pipe.nonblocking_next()  # the run stays ended...
    pipe.reset()  # ...until it is dropped: the next call starts again
    if callable(getattr(pipe, "set_seed", None)):
        pipe.set_seed(3)  # a seed serves one run, as torch's
    first = pipe.nonblocking_next()
    assert normalise(first) == normalise(next(iter(BUILT_IN[name]())))
    pipe.reset()


@pytest.mark.parametrize("engine", [{"num_workers": 0}, {"num_workers": 2, "worker_type": "thread"}],
                         ids=["inline", "threads"])
def test_a_pipe_that_is_its_own_iterator_chains_and_loads(engine: dict[str, Any]) -> None:
    # its inherited nonblocking_next() starts a run over the pipe: reading that run through
    # nonblocking_next() again recursed until RecursionError
    assert list(CountsDown(4).map(double)) == [6, 4, 2, 0]
    assert list(CountsDown(3).batch(2)) == [[2, 1], [0]]
    pipe = CountsDown(3)
    assert [pipe.nonblocking_next(), pipe.nonblocking_next()] == [2, 1]
    loaded = list(pipeload.DataLoader(CountsDown(4).sharding_filter().map(double), batch_size=None, **engine))
    assert sorted(loaded) == [0, 2, 4, 6]


def test_the_own_run_is_independent_of_other_iterators_and_never_pickled() -> None:
    pipe = numbers().map(add_one)
    assert [pipe.nonblocking_next(), pipe.nonblocking_next()] == [1, 2]
    assert list(pipe)[:3] == [1, 2, 3]  # a fresh iterator starts at the start
    assert pipe.nonblocking_next() == 3  # the own run goes on where it was
    assert graph.copy_graph(pipe).nonblocking_next() == 1  # copies start their own
    import pickle

    assert pickle.loads(pickle.dumps(pipe)).nonblocking_next() == 1


MAP_PIPES: dict[str, Callable[[], Any]] = {
    "SequenceWrapper": lambda: SequenceWrapper(range(10)),
    "map": lambda: SequenceWrapper(range(10)).map(double),
    "batch": lambda: SequenceWrapper(range(10)).batch(3),
    "concat": lambda: SequenceWrapper(range(4)).concat(SequenceWrapper(range(4, 10))),
    "zip": lambda: SequenceWrapper(range(10)).zip(SequenceWrapper(range(10, 20))),
}


@pytest.mark.parametrize("name", MAP_PIPES)
def test_every_built_in_map_pipe_answers_nonblocking_get(name: str) -> None:
    pipe = MAP_PIPES[name]()
    assert [pipe.nonblocking_get(i) for i in range(len(pipe))] == [pipe[i] for i in range(len(pipe))]


# -- pipes written with the non-blocking calls alone -------------------------------------------


class Pending(NonBlockingIterDataPipe):
    """Numbers that each need ``asks`` calls before they are there; it shards by the RFC's
    hooks, and keeps a checkpoint of where it is."""

    def __init__(self, count: int, asks: int = 3) -> None:
        self.count, self.asks = count, asks
        self.shards, self.shard = 1, 0
        self.reset()

    def reset(self) -> None:
        self.calls, self.next_number = 0, 0

    def is_shardable(self) -> bool:
        return True

    def sharding_settings(self, total_num_of_shards: int, id_of_shard: int) -> None:
        self.shards, self.shard = total_num_of_shards, id_of_shard

    def nonblocking_next(self) -> int:
        self.calls += 1
        if self.calls % self.asks:
            raise NotAvailable
        number = self.next_number * self.shards + self.shard
        if number >= self.count:
            raise StopIteration
        self.next_number += 1
        return number

    def state_dict(self) -> dict[str, int]:
        return {"next_number": self.next_number}

    def load_state_dict(self, state: dict[str, int]) -> None:
        self.next_number = state["next_number"]


def test_a_non_blocking_pipe_chains_and_waits_without_spinning() -> None:
    pipe = Pending(10)
    assert list(pipe.map(double).batch(4)) == [[0, 2, 4, 6], [8, 10, 12, 14], [16, 18]]
    assert pipe.calls <= 3 * 11 + 2 * 11  # a few asks per item; a busy loop asks thousands of times
    assert list(pipe.filter(is_even)) == [0, 2, 4, 6, 8]  # iter() resets it


@pytest.mark.usefixtures("leak_guard")
@pytest.mark.parametrize("kind", ["thread", "process"])
def test_a_non_blocking_pipe_crosses_a_boundary(kind: str) -> None:
    assert list(Pending(20).map(add_one).queue_boundary(kind, buffer_size=3)) == list(range(1, 21))


@pytest.mark.usefixtures("leak_guard")
@pytest.mark.parametrize("engine", [
    pytest.param({"num_workers": 0}, id="inline"),
    pytest.param({"num_workers": 2}, id="fork"),
    pytest.param({"num_workers": 2, "multiprocessing_context": "spawn"}, id="spawn"),
    pytest.param({"num_workers": 2, "worker_type": "thread"}, id="threads"),
])
def test_a_non_blocking_pipe_in_the_dataloader_is_sharded_by_its_hooks(engine: dict[str, Any]) -> None:
    loader = pipeload.DataLoader(Pending(23).map(double), batch_size=4, **engine)
    samples = sorted(x for batch in loader for x in batch.tolist())
    assert samples == [2 * i for i in range(23)]  # each once: every copy took its own shard


def test_a_non_blocking_pipe_checkpoints_through_a_chain() -> None:
    iterator = iter(Pending(10).map(add_one))
    head = [next(iterator) for _ in range(4)]
    state = iterator.state_dict()
    rest = list(iterator)
    resumed = iter(Pending(10).map(add_one))
    resumed.load_state_dict(state)
    assert head == [1, 2, 3, 4] and list(resumed) == rest == list(range(5, 11))


class Plain(NonBlockingIterDataPipe):
    """No checkpoint of its own: the loader resumes it by skipping."""

    def __init__(self, count: int) -> None:
        self.count = count
        self.reset()

    def reset(self) -> None:
        self.position = 0

    def nonblocking_next(self) -> int:
        if self.position >= self.count:
            raise StopIteration
        self.position += 1
        return self.position - 1


def test_the_loader_resumes_a_non_blocking_pipe_without_a_checkpoint_by_skipping() -> None:
    def make() -> pipeload.DataLoader:
        return pipeload.DataLoader(Plain(11), batch_size=3)

    loader = make()
    iterator = iter(loader)
    head = [next(iterator).tolist() for _ in range(2)]
    state = loader.state_dict()
    rest = [b.tolist() for b in iterator]
    resumed = make()
    with pytest.warns(UserWarning, match="batches already handed out"):
        resumed.load_state_dict(state)
        again = [b.tolist() for b in resumed]
    assert head + again == head + rest == [[0, 1, 2], [3, 4, 5], [6, 7, 8], [9, 10]]


class Prefetcher(NonBlockingIterDataPipe):
    """The RFC's prefetcher: it reads its source through the source's own ``nonblocking_next()``."""

    def __init__(self, source_dp: Any, buffer_size: int = 2) -> None:
        self.source_dp, self.buffer_size = source_dp, buffer_size
        self.reset()

    def reset(self) -> None:
        self.buffer: list[Any] = []
        self.depleted = False

    def nonblocking_next(self) -> Any:
        while not self.depleted and len(self.buffer) < self.buffer_size:
            try:
                self.buffer.append(self.source_dp.nonblocking_next())
            except NotAvailable:
                break
            except StopIteration:
                self.depleted = True
        if self.buffer:
            return self.buffer.pop(0)
        raise StopIteration if self.depleted else NotAvailable


@pytest.mark.usefixtures("leak_guard")
@pytest.mark.parametrize("engine", [
    pytest.param(None, id="list"),
    pytest.param({"num_workers": 0}, id="inline"),
    pytest.param({"num_workers": 1, "persistent_workers": True}, id="persistent-process"),
    pytest.param({"num_workers": 1, "persistent_workers": True, "worker_type": "thread"},
                 id="persistent-thread"),
])
@pytest.mark.parametrize("nested", [False, True], ids=["one", "nested"])
def test_every_epoch_of_a_pipe_reading_its_parent_without_blocking_is_whole(
        engine: dict[str, Any] | None, nested: bool) -> None:
    pipe = Prefetcher(IterableWrapper(range(7)).map(add_one))
    if nested:
        pipe = Prefetcher(pipe.map(double))
    expected = [2 * x if nested else x for x in range(1, 8)]
    if engine is None:
        epochs = [list(pipe) for _ in range(3)]
    else:
        loader = pipeload.DataLoader(pipe, batch_size=None, **engine)
        epochs = [[int(x) for x in loader] for _ in range(3)]
    assert epochs == [expected] * 3


def test_iter_on_a_partly_read_run_goes_on_where_it_stands_as_pythons_iterators_do() -> None:
    # iter() on the pipe's own run started it again: `first = next(it)` then `for x in it`
    # saw `first` twice, and islice over one iterator repeated its first items.
    pipe = Prefetcher(IterableWrapper(range(6)).map(add_one))
    it = iter(pipe)
    first = [next(it), next(it)]
    assert first + list(it) == [1, 2, 3, 4, 5, 6]
    it = iter(pipe)  # iter() on the pipe itself still starts a new run
    assert [list(itertools.islice(it, 2)) for _ in range(3)] == [[1, 2], [3, 4], [5, 6]]
    it = iter(pipe)
    assert it.nonblocking_next() == 1 and next(it) == 2 and next(pipe) == 3  # one run, three ways in
    assert list(zip(it, "ab")) == [(4, "a"), (5, "b")]
    assert list(pipe) == [1, 2, 3, 4, 5, 6]


def test_the_run_iter_gives_copies_pickles_and_tells_its_length_as_the_pipe_did() -> None:
    # It recursed for ever in copy and pickle (its attributes are the pipe's), and had no len().
    import copy
    import pickle

    class Sized(Prefetcher):
        def __len__(self) -> int:
            return len(self.source_dp)

    pipe = Sized(IterableWrapper(range(6)).map(add_one))
    it = iter(pipe)
    assert next(it) == 1
    assert len(it) == len(pipe) == 6
    assert list(copy.deepcopy(iter(pipe))) == [1, 2, 3, 4, 5, 6]  # a copy reads as the pipe's copy
    pickled = iter(Prefetcher(IterableWrapper(range(6)).map(add_one)))  # (a local class does not pickle)
    assert list(pickle.loads(pickle.dumps(pickled))) == [1, 2, 3, 4, 5, 6]
    assert list(IterableWrapper(iter(pipe))) == [1, 2, 3, 4, 5, 6]
    with pytest.raises(AttributeError):
        it.no_such_attribute  # noqa: B018


class Fetched(NonBlockingMapDataPipe):
    """A map-style pipe whose items each need two asks (the first sends the request)."""

    def __init__(self, size: int) -> None:
        self.size = size
        self.requested: set[int] = set()

    def nonblocking_get(self, index: int) -> int:
        if not 0 <= index < self.size:
            raise IndexError(f"Index {index} is out of range.")
        if index not in self.requested:
            self.requested.add(index)
            raise NotAvailable
        return 10 * index

    def __len__(self) -> int:
        return self.size


def test_a_non_blocking_map_pipe_reads_through_built_in_map_pipes() -> None:
    pipe = Fetched(7)
    assert pipe[3] == 30  # waits on top of nonblocking_get
    batched = pipe.map(add_one).batch(3)
    with pytest.raises(NotAvailable):
        batched.nonblocking_get(1)  # items 4 and 5 are both requested at once, not there yet
    assert batched.nonblocking_get(1) == [31, 41, 51]
    assert sorted(pipe.shuffle().set_seed(1)) == [10 * i for i in range(7)]
    assert drain_nonblocking(Fetched(4).to_iter_datapipe()) == [0, 10, 20, 30]


@pytest.mark.usefixtures("leak_guard")
def test_a_non_blocking_map_pipe_in_dataloader_workers() -> None:
    loader = pipeload.DataLoader(Fetched(10).map(add_one), batch_size=4, num_workers=2)
    assert [b.tolist() for b in loader] == [[1, 11, 21, 31], [41, 51, 61, 71], [81, 91]]


class Countdown(pipeload.IterableDataset):
    def __iter__(self) -> Any:
        return iter([3, 2, 1])


def test_ensure_non_blocking_next_gives_any_iterable_pipe_the_call() -> None:
    ours = numbers()
    assert EnsureNonBlockingNextDataPipe(ours) is ours
    theirs = theirs_iter.IterableWrapper([5, 6, 7])
    ensured = EnsureNonBlockingNextDataPipe(theirs)
    assert [ensured.nonblocking_next(), ensured.nonblocking_next()] == [5, 6]
    assert list(ensured.map(add_one)) == [6, 7, 8] and len(ensured) == 3
    assert graph.list_dps(ensured)[1] is theirs  # the graph functions see through it
    assert list(EnsureNonBlockingNextDataPipe(Countdown())) == [3, 2, 1]
    with pytest.raises(TypeError, match="expects an iterable-style DataPipe.*got validated_datapipe=.*nonblocking_get"):
        EnsureNonBlockingNextDataPipe(SequenceWrapper([1]))


def test_the_rfc_names_are_where_its_users_look() -> None:
    import pipeload.datapipes.iter as iter_pipes
    import pipeload.datapipes.map as map_pipes

    assert iter_pipes.NonBlockingIterDataPipe is NonBlockingIterDataPipe
    assert iter_pipes.EnsureNonBlockingNextDataPipe is EnsureNonBlockingNextDataPipe
    assert map_pipes.NonBlockingMapDataPipe is NonBlockingMapDataPipe
    assert iter_pipes.NotAvailable is map_pipes.NotAvailable is NotAvailable
    assert multiprocessing.current_process().name == "MainProcess"
