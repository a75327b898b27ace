"""The non-blocking protocol: NotAvailable now, the item later, no item lost or repeated, and
waiting that sleeps instead of spinning."""

from __future__ import annotations

from collections.abc import Iterator

import pytest
from pipes_for_tests import Gate, GatedPipe, add_one, is_even, release_later

import pipeload
from pipeload.datapipes import IterDataPipe, NotAvailable, as_nonblocking
from pipeload.datapipes.iter import IterableWrapper
from pipeload.datapipes.protocol import WaitCancelled, wait_for_next

pytestmark = pytest.mark.timeout(30)


def test_an_async_source_says_not_available_then_delivers_then_ends() -> None:
    gate = Gate()
    it = iter(GatedPipe(gate))
    with pytest.raises(NotAvailable):
        it.nonblocking_next()
    gate.release("a")
    assert it.nonblocking_next() == "a"
    gate.end()
    with pytest.raises(StopIteration):
        it.nonblocking_next()


@pytest.mark.parametrize("build, releases, expected", [
    (lambda p: p.batch(3), [[0, 1], [2, 3, 4, 5]], [[0, 1, 2], [3, 4, 5]]),
    (lambda p: p.map(add_one).filter(is_even), [[1], [3, 4]], [2, 4]),
    (lambda p: p.shuffle(buffer_size=2).set_seed(0), [[0], [1, 2]], None),
    (lambda p: p.header(2).enumerate(), [[7], [8, 9]], [(0, 7), (1, 8)]),
    (lambda p: p.batch(2).unbatch(), [[0], [1, 2]], [0, 1]),
    (lambda p: p.groupby(lambda x: x % 2, group_size=2), [[0, 1], [2]], [[0, 2]]),
])
def test_operations_keep_their_state_across_not_available(build, releases, expected) -> None:
    gate = Gate()
    it = iter(build(GatedPipe(gate)))
    got = []
    for items in releases:
        gate.release(*items)
        while True:
            try:
                got.append(it.nonblocking_next())
            except (NotAvailable, StopIteration):
                break
    if expected is None:  # a shuffle: every item once, whatever the order
        gate.end()
        got.extend(it)
        assert sorted(got) == sorted(x for items in releases for x in items)
    else:
        assert got == expected


def test_zip_and_mux_keep_a_partial_round() -> None:
    left, right = Gate(), Gate()
    zipped = iter(GatedPipe(left).zip(GatedPipe(right)))
    left.release(1, 2)
    with pytest.raises(NotAvailable):
        zipped.nonblocking_next()
    right.release("a")
    assert zipped.nonblocking_next() == (1, "a")
    muxed = iter(GatedPipe(left).mux(GatedPipe(right)))
    right.release("b")
    assert muxed.nonblocking_next() == 2
    assert muxed.nonblocking_next() == "b"


def test_next_waits_by_sleeping_not_spinning() -> None:
    gate = Gate()
    pipe = GatedPipe(gate).map(add_one)
    release_later(gate, list(range(10)), end=True)
    assert list(pipe) == list(range(1, 11))
    # Each wait checks once, sleeps until notified, checks again: a few polls per item, where a
    # busy loop would make thousands in the ~0.1 s the releases take.
    assert gate.polls < 60, gate.polls


def raise_on_two(x: int) -> int:
    if x == 2:
        raise ValueError("bad sample 2")
    return x


def test_an_error_raised_after_a_wait_carries_no_not_available_context() -> None:
    # A sample's error behind a queue boundary reached the training loop (and a worker's
    # traceback text) as "NotAvailable ... During handling of the above exception, another
    # exception occurred": the wait ran inside the `except NotAvailable` that began it.
    gate = Gate()
    it = iter(GatedPipe(gate).map(raise_on_two))
    gate.release(1)
    assert next(it) == 1
    release_later(gate, [2], end=True)
    with pytest.raises(ValueError, match="bad sample 2") as raised:
        next(it)  # NotAvailable first: the error comes from the wait
    assert raised.value.__context__ is None and not raised.value.__suppress_context__


def test_a_wait_can_be_cancelled() -> None:
    it = iter(GatedPipe(Gate()))
    with pytest.raises(WaitCancelled):
        wait_for_next(it, should_stop=lambda: True)


class Squares(IterDataPipe):
    def __init__(self, n: int) -> None:
        self.n = n

    def __iter__(self) -> Iterator[int]:
        for i in range(self.n):
            yield i * i


class Countdown(pipeload.IterableDataset):
    def __iter__(self) -> Iterator[int]:
        return iter([3, 2, 1])


@pytest.mark.parametrize("source, expected", [
    (Squares(3), [0, 1, 4]),
    (Countdown(), [3, 2, 1]),
    ([5, 6], [5, 6]),
    (iter("ab"), ["a", "b"]),
])
def test_one_helper_makes_any_iterable_non_blocking(source, expected) -> None:
    it = as_nonblocking(source)
    got = [it.nonblocking_next() for _ in expected]
    assert got == expected
    with pytest.raises(StopIteration):
        it.nonblocking_next()


def test_a_users_generator_pipe_composes_with_built_in_operations() -> None:
    assert list(Squares(4).map(add_one).batch(2)) == [[1, 2], [5, 10]]
    assert list(IterableWrapper([Squares(2), Squares(3)]).flatmap()) == [0, 1, 0, 1, 4]


class _SelfPaced:
    """A user's own iterator that speaks the protocol without our base class."""

    def __init__(self) -> None:
        self.calls = 0

    def __iter__(self) -> _SelfPaced:
        return self

    def __next__(self) -> int:
        raise AssertionError("the protocol should be used")

    def nonblocking_next(self) -> int:
        self.calls += 1
        if self.calls % 2:
            raise NotAvailable
        if self.calls > 6:
            raise StopIteration
        return self.calls


def test_a_foreign_non_blocking_iterator_is_used_through_its_protocol() -> None:
    assert list(as_nonblocking(_SelfPaced())) == [2, 4, 6]


def test_greedy_join_takes_whichever_input_is_ready() -> None:
    slow, fast = Gate(), Gate()
    joined = iter(GatedPipe(slow).greedy_join(GatedPipe(fast)))
    with pytest.raises(NotAvailable):
        joined.nonblocking_next()
    fast.release("f1", "f2")
    assert [joined.nonblocking_next(), joined.nonblocking_next()] == ["f1", "f2"]
    slow.release("s1")
    fast.release("f3")
    assert sorted([joined.nonblocking_next(), joined.nonblocking_next()]) == ["f3", "s1"]
    fast.end()
    release_later(slow, ["s2", "s3"], end=True)
    assert list(joined) == ["s2", "s3"]


def test_greedy_join_over_ready_inputs_takes_turns_and_outlasts_the_shortest() -> None:
    pipe = IterableWrapper([1, 2, 3]).greedy_join(IterableWrapper("ab"), IterableWrapper([]))
    assert list(pipe) == [1, "a", 2, "b", 3]
    assert len(pipe) == 5


class _YieldsAfterItsEnd:
    """An iterator with a bug: after its StopIteration, it yields again."""

    def __init__(self) -> None:
        self.calls = 0

    def __iter__(self) -> Iterator[int]:
        return self

    def __next__(self) -> int:
        self.calls += 1
        if self.calls == 3:
            raise StopIteration
        return self.calls


@pytest.mark.parametrize("build", [
    lambda source: iter(IterableWrapper(source, deepcopy=False)),
    lambda source: iter(IterableWrapper(source, deepcopy=False).map(add_one).batch(1)),
    lambda source: iter(IterableWrapper(source, deepcopy=False).filter(is_even).enumerate()),
    lambda source: as_nonblocking(source),
], ids=["wrapper", "map-batch", "filter-enumerate", "adapter"])
def test_a_run_that_ended_stays_ended_as_torchs_generators_do(build) -> None:
    # Past its end, the source yielded again and the pipes passed it on; torch's pipes are
    # generators, which end for good.
    run = build(_YieldsAfterItsEnd())
    ahead = list(run)
    for _ in range(3):
        with pytest.raises(StopIteration):
            next(run)
    assert len(ahead) <= 2


class _RefusesAfterItsEnd(pipeload.datapipes.NonBlockingIterDataPipe):
    """The RFC's queue end: any call after its StopIteration is an error."""

    def __init__(self, count: int) -> None:
        self.count, self.given, self.ended = count, 0, False

    def nonblocking_next(self) -> int:
        if self.ended:
            raise RuntimeError("next called after receiving StopIteration")
        if self.given == self.count:
            self.ended = True
            raise StopIteration
        self.given += 1
        return self.given - 1


@pytest.mark.parametrize("build", [
    lambda source: source.batch(2),
    lambda source: source.batch(2).unbatch(),
    lambda source: source.map(add_one).batch(2).collate(),
], ids=["batch", "batch-unbatch", "map-batch-collate"])
def test_a_source_that_ended_is_not_asked_again_by_a_pipe_that_hands_out_a_short_last_batch(build) -> None:
    # The batch handed out short at the end asked its source once more, which the RFC's queue
    # end refuses (stop 53's pipes skeptic).
    assert len(list(build(_RefusesAfterItsEnd(3)))) in (2, 3)
