"""The DataPipes RFC's (pytorch#49440) own examples, run as the RFC writes them against our names:
a Prefetcher over a non-blocking source, a pipe served from another process by request and
response over two DataLoaderQueues, and GreedyJoin over three branches of one source (directly
and through the DataLoader). Where the RFC's text has a typo (``self._souce_pd``, ``dp2`` for
``dp3``) the evident meaning is used; where it used multiprocessing.Queue's ``block=``, the
DataLoaderQueue's ``blocking=``. Two changes go beyond spelling, in the process loop: it answers
each request with one item and then reads the next request (``break``), and ends with ``return``
where the RFC raises StopIteration inside a generator (an error since PEP 479). As written, the
loop answers one request with every item: over a bounded queue (a DataLoaderQueue holds 8 by
default) both ends then wait for good once the answers fill it, while the RFC's unbounded
multiprocessing.Queue would take them all. The RFC's Prefetcher keeps its run on the pipe and
defines no ``reset()``: a second ``iter()`` of it yields nothing (here, as it would in torch)."""

from __future__ import annotations

import functools
import multiprocessing
import time

import pytest

import pipeload
from pipeload import datapipes
from pipeload.datapipes import DataLoaderQueue, NotAvailable, QueueError

pytestmark = [pytest.mark.usefixtures("leak_guard"), pytest.mark.timeout(60)]
DELAY = 0.0005  # the RFC's polling delay in its process loop


# -- a non-blocking source and the RFC's Prefetcher ------------------------------------------


class SlowNumbers(datapipes.iter.NonBlockingIterDataPipe):
    """A source written by hand with nonblocking_next() alone: each number needs three asks
    (a request in flight), then it is there."""

    def __init__(self, count: int) -> None:
        self.count = count
        self.asked = 0

    def reset(self) -> None:
        self.asked = 0

    def nonblocking_next(self) -> int:
        self.asked += 1
        if self.asked % 3:
            raise NotAvailable
        number = self.asked // 3 - 1
        if number >= self.count:
            raise StopIteration
        return number


class Prefetcher(datapipes.iter.NonBlockingIterDataPipe):
    def __init__(self, source_dp, buffer_size=10):
        self._source_dp = source_dp
        self._buffer_size = buffer_size
        self._buffer = []
        self._source_depleted = False

    def nonblocking_next(self):
        if not self._source_depleted:
            while len(self._buffer) < self._buffer_size:
                try:
                    data = self._source_dp.nonblocking_next()
                except NotAvailable:
                    # break or put more requests, depends from implementation
                    break
                except StopIteration:
                    self._source_depleted = True
                    break
                self._buffer.append(data)
        if len(self._buffer):
            data = self._buffer.pop(0)
            return data
        else:
            if self._source_depleted:
                raise StopIteration
            else:
                raise NotAvailable


def double(x: int) -> int:
    return 2 * x


def test_the_prefetcher_over_a_non_blocking_source() -> None:
    prefetched = Prefetcher(SlowNumbers(12), buffer_size=4)
    assert list(prefetched) == list(range(12))
    # over any pipe's own nonblocking_next(), chained on like any pipe
    assert list(Prefetcher(datapipes.iter.IterableWrapper(range(5)).map(double)).map(double)) == [0, 4, 8, 12, 16]


def test_the_prefetcher_over_a_queue_boundary() -> None:
    source = datapipes.iter.IterableWrapper(range(30)).map(double).queue_boundary("process", buffer_size=4)
    assert list(Prefetcher(source, buffer_size=8)) == [2 * i for i in range(30)]


# -- a pipe in another process, by request and response ----------------------------------------


def IteratableDataPipeToQueuesLoop(source_datapipe, req_queue, res_queue):  # noqa: N802 (the RFC's name)
    steps = 0
    for _ in IteratableDataPipeBehindQueues(source_datapipe, req_queue, res_queue, raise_stop=True):
        steps += 1
        time.sleep(DELAY)


def IteratableDataPipeBehindQueues(source_datapipe, req_queue, res_queue, raise_stop=False):  # noqa: N802
    source_datapipe = datapipes.EnsureNonBlockingNextDataPipe(source_datapipe)
    while True:
        try:
            req_queue.get(blocking=False)
        except NotAvailable:
            yield True
            continue
        while True:
            try:
                value = source_datapipe.nonblocking_next()
            except NotAvailable:
                yield True
                continue
            except StopIteration:
                res_queue.put(StopIteration())
                if raise_stop:
                    return  # the RFC raises StopIteration here, which a generator may no longer do
                else:
                    yield True
                continue
            res_queue.put(value)
            yield True  # Returns control
            break  # one answer per request


class QIteratableDataPipe(datapipes.iter.NonBlockingIterDataPipe):
    def __init__(self, request_queue, response_queue, response_wait_time=0.00001):
        self._req_q = request_queue
        self._res_q = response_queue
        self._req_sent = False
        self.counter = 0
        self._stop_iteration = False
        self._response_wait_time = response_wait_time

    def nonblocking_next(self):
        if self._stop_iteration:
            raise Exception('next called after receiving StopIteration')
        if not self._req_sent:
            self._req_q.put(self.counter)
            self.counter += 1
            self._req_sent = True
        try:
            value = self._res_q.get(blocking=True, timeout=self._response_wait_time)
        except QueueError:  # timed out: not there yet
            raise NotAvailable
        self._req_sent = False
        if isinstance(value, StopIteration):
            self._stop_iteration = True
            raise StopIteration
        return value


@pytest.mark.parametrize("method", ["fork", pytest.param("spawn", marks=pytest.mark.slow)])  # spawn: ~2 s
def test_a_pipe_served_from_another_process_by_request_and_response(method: str) -> None:
    source_datapipe = datapipes.iter.IterableWrapper(range(20)).map(double)
    req_queue = DataLoaderQueue(kind="process", maxsize=2)
    res_queue = DataLoaderQueue(kind="process", maxsize=2)
    p2 = multiprocessing.get_context(method).Process(
        target=IteratableDataPipeToQueuesLoop, args=(source_datapipe, req_queue, res_queue))
    p2.start()
    separated_source_datapipe = QIteratableDataPipe(req_queue, res_queue)
    assert list(separated_source_datapipe.map(double)) == [4 * i for i in range(20)]
    p2.join(30)
    assert p2.exitcode == 0
    req_queue.close()
    res_queue.close()
    p2.close()


# -- GreedyJoin over three branches -----------------------------------------------------------


def mult100(x):
    return x * 100


def mult111(x):
    return x * 111


def joined_numbers(count: int = 5):
    numbers_dp = datapipes.iter.IterableWrapper(range(count))  # Returns range of integers
    dp1, dp2, dp3 = numbers_dp.fork(3)  # Creates 3 copies of input data
    dp2_modified = datapipes.iter.Mapper(dp2, mult100)
    dp3_modified = datapipes.iter.Mapper(dp3, mult111)
    return datapipes.iter.GreedyJoiner(dp1, dp2_modified, dp3_modified)


def test_greedy_join_of_three_branches_directly_and_through_the_dataloader() -> None:
    joined_dp = joined_numbers()
    direct = [i for i in iter(joined_dp)]
    assert direct[:6] == [0, 0, 0, 1, 100, 111]  # every branch gets its turn
    assert sorted(direct) == sorted([i * k for i in range(5) for k in (1, 100, 111)])
    assert [i for i in DataLoader_items(joined_dp)] == direct  # the DataLoader yields the same


def DataLoader_items(pipe):  # noqa: N802
    return [int(batch) for batch in pipeload.DataLoader(pipe)]


def tagged(name: str):
    return functools.partial(_tag, name)


def _tag(name: str, x: int) -> tuple[str, int]:
    return name, x


def test_greedy_join_over_branches_in_other_threads_keeps_each_branchs_order() -> None:
    dp1, dp2, dp3 = datapipes.iter.IterableWrapper(range(30)).fork(3)
    joined = datapipes.iter.GreedyJoiner(
        dp1.map(tagged("a")).queue_boundary("thread"),
        dp2.map(tagged("b")).queue_boundary("thread", buffer_size=2),
        dp3.map(tagged("c")),
    )
    got = list(joined)
    for name in "abc":
        assert [x for tag, x in got if tag == name] == list(range(30))
