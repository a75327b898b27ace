"""DataLoaderQueue, the RFC's queue between two ends: every item once and in order, bounded,
non-blocking when asked; it travels to a multiprocessing.Process under every start method; once
closed (by either end), dead at the far end, or out of time, it says so with QueueError naming
the far end and why."""

from __future__ import annotations

import multiprocessing
import os
import pickle
import re
import signal
import threading

import pytest
import torch
from conftest import in_shared_memory, wait_until

from pipeload.datapipes import DataLoaderQueue, NotAvailable, QueueError

pytestmark = [pytest.mark.usefixtures("leak_guard"), pytest.mark.timeout(60)]
START_METHODS = ["fork", "spawn", "forkserver"]
DEADLINE_S = 10.0


# -- what runs at the far end (module level: spawn imports it) --------------------------------


def put_range(queue: DataLoaderQueue, count: int) -> None:
    for i in range(count):
        queue.put(i if i % 4 else torch.full((1 << 14,), i))  # every 4th a 128 KiB tensor
    queue.close()


def put_then_fail(queue: DataLoaderQueue) -> None:
    queue.put("before")
    try:
        raise KeyError("no such sample")
    except KeyError as error:
        queue.close(error=error)


def close_at_once(queue: DataLoaderQueue, message: str | None) -> None:
    # never raised: the error has no traceback
    queue.close(error=None if message is None else ValueError(message))


def put_then_die(queue: DataLoaderQueue, code: int) -> None:
    queue.put("last words")
    queue.put("more")
    os._exit(code)


def put_then_raise(queue: DataLoaderQueue) -> None:
    queue.put("last words")
    raise RuntimeError("the producer failed before closing its queue")


def echo_until_closed(requests: DataLoaderQueue, answers: DataLoaderQueue) -> None:
    while True:
        try:
            question = requests.get()
        except QueueError:
            answers.close()
            return
        answers.put(question * 2)


def put_until_refused(queue: DataLoaderQueue, verdict: DataLoaderQueue) -> None:
    sent = 0
    try:
        while True:
            queue.put(sent)
            sent += 1
    except QueueError as error:
        verdict.put((error.reason, error.by_this_end, error.far_end))
    verdict.close()


def put_without_waiting(queue: DataLoaderQueue, count: int) -> None:
    for i in range(count):
        queue.put(i, blocking=False)  # NotAvailable, were there no room
    queue.close()


def as_numbers(items: list) -> list[int]:
    return [int(x[0]) if isinstance(x, torch.Tensor) else x for x in items]


def drain(queue: DataLoaderQueue) -> tuple[list, QueueError]:
    items = []
    while True:
        try:
            items.append(queue.get(timeout=DEADLINE_S))
        except QueueError as error:
            return items, error.with_traceback(None)  # no cycle through this frame: no GC needed


# -- between two processes ------------------------------------------------------------------


# forkserver: a slow test (~1.5 s); it sends the queue as spawn does, from a pickle
@pytest.mark.parametrize("method", [pytest.param(m, marks=[pytest.mark.slow] if m == "forkserver" else [])
                                    for m in START_METHODS])
def test_a_process_queue_travels_to_a_process_under_every_start_method(method: str) -> None:
    queue = DataLoaderQueue(kind="process", maxsize=3)
    child = multiprocessing.get_context(method).Process(target=put_range, args=(queue, 40))
    child.start()
    items, end = drain(queue)
    child.join(DEADLINE_S)
    assert as_numbers(items) == list(range(40))  # each once, in order, tensors whole
    assert isinstance(items[4], torch.Tensor) and in_shared_memory(items[4])  # not pickled bytes
    assert (end.reason, end.by_this_end, end.far_end) == (QueueError.CLOSED, False, f"process {child.pid}")
    assert f"the far end (process {child.pid}) closed the queue" in str(end)
    queue.close()
    child.close()  # its pipes now, not when a traceback's cycle is collected


def test_a_forked_far_end_puts_tensors_after_this_process_used_torchs_threads() -> None:
    # A large copy runs on torch's OpenMP threads; a child forked afterwards hangs in its first
    # parallel region. The queue's own copies into shared memory must not be one.
    torch.empty(1 << 23).copy_(torch.ones(1 << 23))
    queue = DataLoaderQueue(kind="process", maxsize=3)
    child = multiprocessing.get_context("fork").Process(target=put_range, args=(queue, 12))
    child.start()
    items, end = drain(queue)
    child.join(DEADLINE_S)
    assert as_numbers(items) == list(range(12)) and end.reason == QueueError.CLOSED
    queue.close()
    child.close()


def test_requests_and_answers_over_two_queues_and_the_consumer_closing_stops_the_far_end() -> None:
    context = multiprocessing.get_context("fork")  # spawn: test_rfc_examples.py
    requests, answers = DataLoaderQueue(kind="process", maxsize=2), DataLoaderQueue(kind="process", maxsize=2)
    child = context.Process(target=echo_until_closed, args=(requests, answers))
    child.start()
    for question in range(5):
        requests.put(question)
        assert answers.get(timeout=DEADLINE_S) == 2 * question
    requests.close()  # the far end's get raises, it closes the answers and leaves
    with pytest.raises(QueueError, match="closed the queue") as end:
        answers.get(timeout=DEADLINE_S)
    assert end.value.reason == QueueError.CLOSED and not end.value.by_this_end
    child.join(DEADLINE_S)
    assert child.exitcode == 0
    answers.close()
    child.close()


def test_at_most_maxsize_items_are_in_flight() -> None:
    queue = DataLoaderQueue(kind="process", maxsize=4)
    verdict = DataLoaderQueue(kind="process", maxsize=1)
    child = multiprocessing.get_context("fork").Process(target=put_until_refused, args=(queue, verdict))
    child.start()
    assert wait_until(lambda: len(queue) == 4, DEADLINE_S)  # the window is full...
    with pytest.raises(NotAvailable):
        verdict.get(blocking=False)  # ...and the producer waits for room, still putting
    assert [queue.get() for _ in range(4)] == [0, 1, 2, 3]
    assert wait_until(lambda: len(queue) >= 2, DEADLINE_S)  # room given back, in one message
    queue.close()  # the consumer leaves: the producer's next put is refused
    reason, by_this_end, far_end = verdict.get(timeout=DEADLINE_S)
    assert (reason, by_this_end, far_end) == (QueueError.CLOSED, False, f"process {os.getpid()}")
    child.join(DEADLINE_S)
    verdict.close()
    child.close()


def test_an_error_the_far_end_closes_with_arrives_after_its_items() -> None:
    queue = DataLoaderQueue(kind="process")
    child = multiprocessing.get_context("fork").Process(target=put_then_fail, args=(queue,))
    child.start()
    items, end = drain(queue)
    child.join(DEADLINE_S)
    assert items == ["before"]
    assert isinstance(end.cause, KeyError) and end.__cause__ is end.cause
    assert "no such sample" in str(end.cause) and "in put_then_fail" in str(end.cause)  # its traceback
    queue.close()
    child.close()


@pytest.mark.parametrize("message", [None, "the source is gone"], ids=["closed", "closed-with-error"])
def test_a_far_end_sent_the_queue_that_closes_before_its_first_put_ends_it(message: str | None) -> None:
    # It never joined, so the consumer waited for it to join for ever (or for its timeout). A
    # queue sent to its far end (pickled, as spawn sends it) is that end's: it joins to close.
    queue = DataLoaderQueue(kind="process")
    child = multiprocessing.get_context("spawn").Process(target=close_at_once, args=(queue, message))
    child.start()
    items, end = drain(queue)
    child.join(DEADLINE_S)
    assert items == [] and end.reason == QueueError.CLOSED, end
    if message is None:
        assert end.cause is None
    else:  # said once: with no traceback, an "Original ..." line repeated the summary word for word
        said = str(end.cause)
        assert isinstance(end.cause, ValueError) and said.count(message) == 1 and "Original" not in said, said
    queue.close()
    child.close()


def test_a_forked_copy_that_closes_without_a_put_never_takes_the_producers_place() -> None:
    # Any process forked while the queue waits for its far end holds a copy: closing it must not
    # join (a stray child's close ended the queue empty, and the producer was refused).
    fork = multiprocessing.get_context("fork")
    queue = DataLoaderQueue(kind="process")
    stray = fork.Process(target=close_at_once, args=(queue, None))
    stray.start()
    stray.join(DEADLINE_S)
    producer = fork.Process(target=put_range, args=(queue, 6))
    producer.start()
    items, end = drain(queue)
    producer.join(DEADLINE_S)
    assert len(items) == 6 and end.reason == QueueError.CLOSED and end.cause is None
    queue.close()
    stray.close()
    producer.close()


@pytest.mark.parametrize("how", ["exit", "kill"])
def test_a_far_end_that_dies_is_a_queue_error_after_what_it_sent(how: str) -> None:
    queue = DataLoaderQueue(kind="process")
    code = 3 if how == "exit" else 0
    child = multiprocessing.get_context("fork").Process(target=put_then_die, args=(queue, code))
    if how == "kill":
        child = multiprocessing.get_context("fork").Process(target=put_range, args=(queue, 10**9))
    child.start()
    queue.watch(child)  # a watched far end's exit status is in the message
    first = queue.get(timeout=DEADLINE_S)
    if how == "kill":
        os.kill(child.pid, signal.SIGKILL)
    items, end = drain(queue)
    assert end.reason == QueueError.DIED and end.far_end == f"process {child.pid}"
    says = "exit code 3" if how == "exit" else "signal 9 (SIGKILL)"
    assert says in str(end)
    if how == "exit":
        assert [first, *items] == ["last words", "more"]
    else:
        assert as_numbers([first, *items]) == list(range(1 + len(items)))
    child.join(DEADLINE_S)
    queue.close()
    child.close()


@pytest.mark.parametrize("start", ["spawn", "fork"])
def test_a_producer_that_raises_without_closing_is_a_death_not_an_end(start: str) -> None:
    # A spawned producer runs its queue end's finalizer as it exits: that told the consumer "closed",
    # as a finished stream does, and a stream cut short read as whole (a forked one said "died").
    queue = DataLoaderQueue(kind="process")
    child = multiprocessing.get_context(start).Process(target=put_then_raise, args=(queue,))
    child.start()
    items, end = drain(queue)
    child.join(DEADLINE_S)
    assert items == ["last words"] and end.reason == QueueError.DIED, end
    queue.close()
    child.close()


@pytest.mark.parametrize("kind", ["thread", "process"])
def test_closing_twice_before_a_far_end_joined_is_harmless(kind: str) -> None:
    queue = DataLoaderQueue(kind=kind)
    queue.close()
    queue.close()  # a process queue's listener is gone by now: nothing is accepted on it again
    with pytest.raises(QueueError) as end:
        queue.get(blocking=False)
    assert end.value.reason == QueueError.CLOSED and end.value.by_this_end


def test_a_process_queue_closed_before_a_far_end_joined_ends_its_accepting_thread_quietly(
        monkeypatch: pytest.MonkeyPatch) -> None:
    # The accepting thread woke on the closed listener, took the lock close() had let go and
    # accepted on it: "OSError: [Errno 9] Bad file descriptor" printed from a thread.
    failures: list[BaseException] = []
    monkeypatch.setattr(threading, "excepthook", lambda args: failures.append(args.exc_value))
    queue = DataLoaderQueue(kind="process")
    queue.close()  # the queue itself stays alive: its thread looks at it again
    assert wait_until(lambda: not any(t.name == "pipeload-queue-accept" for t in threading.enumerate()),
                      DEADLINE_S)
    assert failures == []
    del queue


def test_a_process_queue_joins_exactly_two_processes() -> None:
    queue = DataLoaderQueue(kind="process")
    first = multiprocessing.get_context("fork").Process(target=put_range, args=(queue, 1))
    first.start()
    assert as_numbers([queue.get(timeout=DEADLINE_S)]) == [0]
    with pytest.raises(TypeError, match="already connected to its far end"):
        pickle.dumps(queue)
    first.join(DEADLINE_S)
    queue.close()
    first.close()


# -- between threads, and in one thread --------------------------------------------------------


def test_a_thread_queue_between_two_threads() -> None:
    queue = DataLoaderQueue(kind="thread", maxsize=2)
    producer = threading.Thread(target=put_range, args=(queue, 30), name="producer")
    producer.start()
    items, end = drain(queue)
    producer.join(DEADLINE_S)
    assert as_numbers(items) == list(range(30))
    assert (end.reason, end.far_end) == (QueueError.CLOSED, "thread 'producer'")


def test_one_thread_at_both_ends_non_blocking_full_and_empty() -> None:
    queue = DataLoaderQueue(kind="thread", maxsize=2)
    queue.put("a")
    queue.put("b")
    with pytest.raises(NotAvailable):
        queue.put("c", blocking=False)
    assert [queue.get(), queue.get(blocking=False)] == ["a", "b"]
    with pytest.raises(NotAvailable):
        queue.get(blocking=False)
    with pytest.raises(QueueError, match="timed out") as waited:
        queue.get(timeout=0.05)
    assert waited.value.reason == QueueError.TIMED_OUT
    queue.put("d")
    queue.close()  # closed by the side that put: what it put is still delivered
    assert queue.get() == "d"
    with pytest.raises(QueueError, match="this end .* closed the queue") as closed:
        queue.get()
    assert closed.value.by_this_end
    with pytest.raises(QueueError):
        queue.put("e")


def test_a_consumer_closing_a_thread_queue_releases_a_waiting_producer() -> None:
    queue = DataLoaderQueue(kind="thread", maxsize=1)
    verdict = DataLoaderQueue(kind="thread", maxsize=1)
    producer = threading.Thread(target=put_until_refused, args=(queue, verdict))
    producer.start()
    assert queue.get(timeout=DEADLINE_S) == 0
    queue.close()
    reason, by_this_end, _ = verdict.get(timeout=DEADLINE_S)
    assert (reason, by_this_end) == (QueueError.CLOSED, False)
    producer.join(DEADLINE_S)


def test_a_dead_producer_thread_is_noticed_when_watched() -> None:
    queue = DataLoaderQueue(kind="thread")
    quiet = threading.Thread(target=lambda: None, name="quiet")
    queue.watch(quiet)
    quiet.start()
    quiet.join()
    with pytest.raises(QueueError, match="died without closing") as end:
        queue.get(timeout=DEADLINE_S)
    assert end.value.reason == QueueError.DIED


def exit_before_joining(queue: DataLoaderQueue) -> None:
    os._exit(3)


@pytest.mark.parametrize("kind", ["thread", "process"])
def test_a_far_end_that_died_is_said_to_a_consumer_that_only_polls(kind: str) -> None:
    # get(blocking=False) answered NotAvailable for ever (a process boundary whose upstream
    # died while importing hung): only a blocking get looked at the far end.
    queue = DataLoaderQueue(kind=kind)
    if kind == "thread":
        far_end = threading.Thread(target=put_two_and_end_without_closing, args=(queue,), name="prod")
    else:
        far_end = multiprocessing.get_context("fork").Process(target=exit_before_joining, args=(queue,))
    queue.watch(far_end)
    far_end.start()
    far_end.join(DEADLINE_S)
    taken = []
    with pytest.raises(QueueError, match="died without closing") as end:
        for _ in range(3):
            taken.append(queue.get(blocking=False))
    assert end.value.reason == QueueError.DIED
    assert taken == ([1, 2] if kind == "thread" else [])
    queue.close()
    if kind == "process":
        far_end.close()  # its exit sentinel, a descriptor


@pytest.mark.parametrize("kind", ["thread", "process"])
def test_polling_before_the_watched_far_end_starts_is_not_a_death(kind: str) -> None:
    # Not started is not alive either: the first version of the poll above called it "died",
    # and the queue ended before its producer put anything.
    queue = DataLoaderQueue(kind=kind)
    if kind == "thread":
        far_end = threading.Thread(target=put_range, args=(queue, 3))
    else:
        far_end = multiprocessing.get_context("fork").Process(target=put_range, args=(queue, 3))
    queue.watch(far_end)
    with pytest.raises(NotAvailable):
        queue.get(blocking=False)
    far_end.start()
    items, end = drain(queue)
    assert as_numbers(items) == [0, 1, 2] and end.reason == QueueError.CLOSED
    far_end.join(DEADLINE_S)
    queue.close()
    if kind == "process":
        far_end.close()  # its exit sentinel, a descriptor


def put_two_and_end_without_closing(queue: DataLoaderQueue) -> None:
    queue.put(1)
    queue.put(2)


def test_the_one_thread_that_put_is_watched_without_being_named() -> None:
    # The README's thread example calls no watch(): a producer thread that ended without
    # close() left the consumer waiting for good (or until its timeout, "timed out").
    queue = DataLoaderQueue(kind="thread", maxsize=4)
    producer = threading.Thread(target=put_two_and_end_without_closing, args=(queue,), name="producer")
    producer.start()
    producer.join()
    assert [queue.get(timeout=DEADLINE_S), queue.get(timeout=DEADLINE_S)] == [1, 2]  # what it put
    with pytest.raises(QueueError, match=r"the far end \(thread 'producer'\) died without closing") as end:
        queue.get(timeout=DEADLINE_S)
    assert end.value.reason == QueueError.DIED
    mine = DataLoaderQueue(kind="thread", maxsize=2)
    mine.put("a")  # the consumer's own puts: it is not a far end that died
    assert mine.get() == "a"
    with pytest.raises(NotAvailable):
        mine.get(blocking=False)


def test_a_thread_queue_stays_in_its_process() -> None:
    with pytest.raises(TypeError, match="kind='thread' cannot be pickled.*kind='process'"):
        pickle.dumps(DataLoaderQueue(kind="thread"))


def test_arguments_are_checked() -> None:
    with pytest.raises(ValueError, match="kind should be one of .*'process'.*'thread'.*got kind='carrier-pigeon'"):
        DataLoaderQueue(kind="carrier-pigeon")
    with pytest.raises(ValueError, match="maxsize should be an int of at least 1, but got maxsize=0"):
        DataLoaderQueue(kind="process", maxsize=0)
    queue = DataLoaderQueue()  # the thread kind by default
    assert queue.kind == "thread" and queue.maxsize == 8 and isinstance(queue, DataLoaderQueue)
    with pytest.raises(ValueError, match="timeout should be None or at least 0"):
        queue.get(timeout=-1)


@pytest.mark.parametrize("kind", ["thread", "process"])
@pytest.mark.parametrize("call", ["get", "put"])
def test_a_nan_timeout_is_refused_instead_of_waiting_for_ever(kind: str, call: str) -> None:
    # a NaN deadline compares False with every clock reading: the wait never ended
    with DataLoaderQueue(kind=kind, maxsize=1) as queue:
        wait = queue.get if call == "get" else lambda timeout: queue.put(0, timeout=timeout)
        with pytest.raises(ValueError, match="timeout should be None or at least 0, but got timeout=nan"):
            wait(timeout=float("nan"))


@pytest.mark.parametrize("kind", ["thread", "process", "ray"])
@pytest.mark.parametrize("timeout", ["1", True, [1], float("nan")])
def test_a_timeout_that_is_not_a_number_of_seconds_is_refused_by_name(kind: str, timeout: object) -> None:
    with DataLoaderQueue(kind=kind) as queue:
        error, expected = ((ValueError, "timeout should be None or at least 0, but got timeout=nan")
                           if timeout != timeout else  # NaN
                           (TypeError, f"timeout should be None or a number of seconds, but got timeout={timeout!r}"))
        with pytest.raises(error, match=re.escape(expected)):
            queue.get(timeout=timeout)


def test_queue_errors_pickle_whole() -> None:
    error = QueueError("gone", far_end="process 7", reason=QueueError.DIED, cause=KeyError(3))
    again = pickle.loads(pickle.dumps(error))
    assert (str(again), again.far_end, again.reason, repr(again.cause)) == ("gone", "process 7", "died", "KeyError(3)")


@pytest.mark.parametrize("kind", ["thread", "process", "ray"])
@pytest.mark.parametrize("blocking", ["no", None, 0, [False]])
def test_blocking_that_is_not_true_or_false_is_refused_by_name(kind: str, blocking: object) -> None:
    # "no" (or a non-empty list) is truthy: the get meant to answer at once waited instead
    with DataLoaderQueue(kind=kind) as queue:
        expected = f"blocking should be True or False, but got blocking={blocking!r}"
        with pytest.raises(TypeError, match=re.escape(expected)):
            queue.get(blocking=blocking)
        if kind != "ray":  # a Ray queue is read at this end only
            with pytest.raises(TypeError, match=re.escape(expected)):
                queue.put(1, blocking=blocking)


@pytest.mark.parametrize("how", ["closed", "dropped"])
def test_a_process_queue_that_no_far_end_joined_stops_listening_at_once(how: str, monkeypatch) -> None:
    # Its accepting thread looked every half second whether the queue was still there, so each
    # queue closed or dropped unjoined left a thread behind for up to 0.5 s. Looking every 30 s
    # here, the thread must end on the close itself, well before its next look.
    from pipeload.datapipes.boundary import process_queue

    monkeypatch.setattr(process_queue, "ACCEPT_SLICE_S", 30.0)
    before = set(threading.enumerate())
    queue = DataLoaderQueue(kind="process")
    accepting = [t for t in threading.enumerate() if t not in before]
    assert [t.name for t in accepting] == ["pipeload-queue-accept"]
    if how == "closed":
        queue.close()
    else:
        del queue
    assert wait_until(lambda: not accepting[0].is_alive(), 5.0)


@pytest.mark.parametrize("kind", ["thread", "process"])
def test_numpys_bool_is_a_bool_for_blocking(kind: str) -> None:
    import numpy as np

    with DataLoaderQueue(kind=kind) as queue:
        with pytest.raises(NotAvailable):
            queue.get(blocking=np.False_)


@pytest.mark.timeout(60)
@pytest.mark.parametrize("blocking", [True, False])
def test_a_far_end_puts_into_the_room_there_is_before_this_end_first_uses_the_queue(blocking: bool) -> None:
    # The RFC's layout, with the consumer busy elsewhere (joining its producer, building a
    # model) before its first get: the producer's puts waited for good (or raised NotAvailable
    # on an empty queue), as the ends met only in this end's own calls.
    queue = DataLoaderQueue(kind="process", maxsize=8)
    target = put_range if blocking else put_without_waiting
    child = multiprocessing.get_context("fork").Process(target=target, args=(queue, 5))
    child.start()
    child.join(30)
    assert child.exitcode == 0  # it put all five and closed, with nobody getting yet
    items, ending = drain(queue)
    assert as_numbers(items) == [0, 1, 2, 3, 4] and ending.reason == QueueError.CLOSED
    queue.close()
