"""The on_error policy on its own: arguments checked, budgets per run, counts per pipe and per graph
(a loader's stats read them), callbacks that raise; and the retry rules for remote reads."""

from __future__ import annotations

import errno
import io
import threading
import warnings

import pytest

from pipeload.datapipes import graph
from pipeload.datapipes.iter import IterableWrapper
from pipeload.datapipes.sources import (
    FailureBudgetExceeded,
    FailureCounts,
    RetryPolicy,
    failure_counts,
    is_transient,
)
from pipeload.datapipes.sources import _retry
from pipeload.datapipes.sources._retry import RetryingReader, with_retries
from pipeload.datapipes.sources._versions import ObjectVersion

BROKEN = {"__key__": "bad", "json": b"{not json"}
GOOD = {"__key__": "good", "json": b"{}"}


def test_each_run_has_its_own_budget_and_the_pipe_counts_them_all() -> None:
    pipe = IterableWrapper([BROKEN, GOOD, BROKEN]).decode(on_error="skip", max_failures=2)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        assert len(list(pipe)) == 1
        assert len(list(pipe)) == 1  # a second run starts with the whole budget again
    assert pipe.failure_counts() == FailureCounts(skipped=4, samples=4)
    strict = IterableWrapper([BROKEN, BROKEN]).decode(on_error="skip", max_failures=1)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        with pytest.raises(FailureBudgetExceeded, match="max_failures=1"):
            list(strict)
    assert strict.failure_counts() == FailureCounts(skipped=1, raised=1, samples=1)


def test_a_budget_of_zero_raises_the_first_failure_with_the_budget_error() -> None:
    with pytest.raises(FailureBudgetExceeded) as raised:
        list(IterableWrapper([BROKEN]).decode(on_error="skip", max_failures=0))
    assert "'bad'" in str(raised.value)


def test_a_callback_that_raises_ends_the_run() -> None:
    def refuse(error: BaseException, where: object) -> None:
        raise KeyError("stop here")

    pipe = IterableWrapper([BROKEN]).decode(on_error=refuse)
    with pytest.raises(KeyError, match="stop here"):
        list(pipe)
    assert pipe.failure_counts() == FailureCounts(raised=1)


def test_a_skip_that_warnings_as_errors_turn_into_a_raise_counts_as_raised() -> None:
    pipe = IterableWrapper([GOOD, BROKEN, GOOD]).decode(on_error="skip")
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        with pytest.raises(Warning, match="skipped the sample"):
            list(pipe)
    assert pipe.failure_counts() == FailureCounts(raised=1)


def ignore(error: BaseException, where: object) -> None:
    """A callback that skips quietly (module level, so it pickles)."""


def test_counts_stay_with_the_process_and_copies_count_for_themselves() -> None:
    decode = IterableWrapper([BROKEN, GOOD]).decode(on_error=ignore)
    last = decode.map(len).batch(1)
    copy = graph.copy_graph(last)
    list(copy)
    assert failure_counts(copy) == FailureCounts(skipped=1, samples=1)
    assert failure_counts(last) == FailureCounts()  # a worker's copy counts its own runs
    import pickle

    list(decode)
    assert pickle.loads(pickle.dumps(decode)).failure_counts() == FailureCounts()


@pytest.mark.parametrize("error, transient", [
    (ConnectionResetError(), True), (TimeoutError(), True), (OSError(errno.ECONNREFUSED, "refused"), True),
    (FileNotFoundError("x"), False), (PermissionError("x"), False), (ValueError("x"), False),
    (type("ClientPayloadError", (Exception,), {})(), True),
    (type("HTTPError", (Exception,), {"status": 503})(), True),
    (type("HTTPError", (Exception,), {"status": 403})(), False),
])
def test_what_counts_as_transient(error: Exception, transient: bool) -> None:
    assert is_transient(error) is transient


def raised_while_handling(error: BaseException, handled: BaseException) -> BaseException:
    """``error`` raised inside an ``except`` block that caught ``handled`` (its context)."""
    try:
        try:
            raise handled
        except BaseException:
            raise error
    except BaseException as raised:
        return raised


def test_an_error_raised_while_handling_a_timeout_is_transient_and_says_both() -> None:
    # s3fs, timed out reading a range, raises an IndexError of its own from its handler: it was
    # not retried, and the message said only "IndexError: tuple index out of range".
    from pipeload.datapipes.sources.errors import describe_failure

    error = raised_while_handling(IndexError("tuple index out of range"), TimeoutError("read timed out"))
    assert is_transient(error)
    error.add_note("pipeload: gave up after 4 attempts")
    assert describe_failure(error) == ("IndexError: tuple index out of range (raised while handling "
                                       "TimeoutError: read timed out); gave up after 4 attempts")
    assert not is_transient(raised_while_handling(FileNotFoundError("gone"), TimeoutError()))
    assert not is_transient(raised_while_handling(ValueError("bad"), KeyError("x")))
    hidden = raised_while_handling(ValueError("bad"), TimeoutError())
    hidden.__suppress_context__ = True  # raise ... from None: the timeout is no part of it
    assert not is_transient(hidden) and describe_failure(hidden) == "ValueError: bad"


def test_retry_policy_checks_and_waits() -> None:
    with pytest.raises(ValueError, match="attempts"):
        RetryPolicy(attempts=0)
    with pytest.raises(ValueError, match="backoff_s"):
        RetryPolicy(backoff_s=-1)
    policy = RetryPolicy(attempts=5, backoff_s=0.1, max_backoff_s=0.3)
    assert [policy.wait_s(n) for n in (1, 2, 3, 4)] == [0.1, 0.2, 0.3, 0.3]


def test_with_retries_stops_at_the_attempts_or_a_lasting_error() -> None:
    calls = []

    def flaky() -> str:
        calls.append(1)
        if len(calls) < 3:
            raise ConnectionResetError("reset")
        return "ok"

    assert with_retries(flaky, RetryPolicy(attempts=3, backoff_s=0)) == "ok" and len(calls) == 3
    calls.clear()
    with pytest.raises(ConnectionResetError) as raised:
        with_retries(flaky, RetryPolicy(attempts=2, backoff_s=0))
    assert raised.value.__notes__ == ["pipeload: gave up after 2 attempts"]
    lasting = []
    with pytest.raises(FileNotFoundError):
        with_retries(lambda: lasting.append(1) or open("/no/such/file"), RetryPolicy(attempts=5, backoff_s=0))
    assert len(lasting) == 1
    stop = threading.Event()
    stop.set()
    calls.clear()
    with pytest.raises(ConnectionResetError):  # a stop set ends the back-off at once
        with_retries(flaky, RetryPolicy(attempts=3, backoff_s=60), stop=stop)


class _CutAfter(io.RawIOBase):
    """A stream that fails once it has given ``cut`` bytes (a remote read cut off), for the reader."""

    def __init__(self, data: bytes, cut: int, seekable: bool) -> None:
        self._data, self._cut, self._seekable, self._at = data, cut, seekable, 0

    def readable(self) -> bool:
        return True

    def seekable(self) -> bool:
        return self._seekable

    def seek(self, position: int, whence: int = 0) -> int:
        self._at = position
        return position

    def readinto(self, buffer: bytearray) -> int:
        if self._at >= self._cut:
            raise ConnectionResetError("cut")
        chunk = self._data[self._at:min(self._cut, self._at + len(buffer))]
        buffer[:len(chunk)] = chunk
        self._at += len(chunk)
        return len(chunk)


@pytest.mark.parametrize("seekable", [True, False])
def test_the_reader_resumes_at_the_byte_it_stopped(seekable: bool, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(_retry, "PROGRESS_BYTES", 2000)  # what starts the attempts afresh
    data = bytes(range(256)) * 40
    opened = []

    def opener(at: int, version: ObjectVersion | None) -> tuple[io.RawIOBase, ObjectVersion, int]:
        opened.append(1)
        return _CutAfter(data, cut=3000 * len(opened), seekable=seekable), ObjectVersion(), 0

    with io.BufferedReader(RetryingReader("mem://x", opener, RetryPolicy(attempts=2, backoff_s=0))) as reader:
        assert reader.read() == data
    assert len(opened) == 4  # cut at 3000, 6000 and 9000: three reconnects, each made progress
