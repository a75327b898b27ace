"""Tar shards over a real HTTP server on 127.0.0.1: every sample once with 0 and 2 process workers,
a connection cut half-way resumed, one that keeps failing or is refused named in the error, and
a loader whose workers hang on a stalled response still shutting down within a second."""

from __future__ import annotations

import time
from collections.abc import Iterator
from pathlib import Path

import pytest
from conftest import LeakGuard, wait_until
from sources_for_tests import ShardServer, all_keys, refused_url, sample_key, write_shards

import pipeload
from pipeload.datapipes import webdataset_pipeline
from pipeload.datapipes.iter import FileLister, IterableWrapper
from pipeload.datapipes.sources import FailureCounts, RetryPolicy, SkippedSampleWarning, SourceError, _storage

pytestmark = [pytest.mark.usefixtures("leak_guard"), pytest.mark.timeout(60), pytest.mark.imports_large_libraries]  # fsspec and aiohttp: run last (conftest)

FAST_RETRY = RetryPolicy(attempts=3, backoff_s=0.01)
SHUTDOWN_WITHIN_S = 1.0


@pytest.fixture(scope="module", autouse=True)
def fsspec_io_thread() -> None:
    """fsspec runs one IO thread for the life of the process (as Python keeps its resource
    tracker); start it before any test's leak check, so it is not counted as the test's."""
    import fsspec.asyn

    fsspec.asyn.get_loop()


@pytest.fixture
def server(tmp_path: Path) -> Iterator[ShardServer]:
    write_shards(tmp_path, 4, 5)
    with ShardServer(tmp_path) as running:
        yield running


def shard_urls(server: ShardServer, count: int = 4) -> list[str]:
    return [server.url(f"shard-{shard:04d}.tar") for shard in range(count)]


@pytest.mark.parametrize("num_workers", [0, 2])
def test_every_sample_exactly_once_over_http(server: ShardServer, num_workers: int) -> None:
    pipe = webdataset_pipeline(shard_urls(server), image="tensor", shuffle_buffer=8).map(sample_key)
    loader = pipeload.DataLoader(pipe, batch_size=None, num_workers=num_workers)
    for _ in range(2):
        keys = list(loader)
        assert sorted(keys) == all_keys(4, 5)
    assert sum(server.requests.values()) == 8  # each shard read once per epoch, by one worker


def test_a_connection_cut_half_way_is_resumed_and_nothing_is_lost(server: ShardServer, tmp_path: Path) -> None:
    server.drop("shard-0001.tar", times=1)
    over_http = list(IterableWrapper(shard_urls(server)).open_files(mode="b", retry=FAST_RETRY).load_from_tar())
    local = list(IterableWrapper(sorted(str(p) for p in tmp_path.glob("*.tar"))).open_files(mode="b").load_from_tar())
    assert [(m.name, m[1]) for m in over_http] == [(m.name, m[1]) for m in local]
    assert server.requests["shard-0001.tar"] == 2


def test_a_connection_that_keeps_failing_ends_in_an_error_naming_the_url(server: ShardServer) -> None:
    server.drop("shard-0002.tar", times=100)
    urls = shard_urls(server)
    pipe = IterableWrapper(urls).open_files(mode="b", retry=FAST_RETRY).load_from_tar()
    with pytest.raises(SourceError) as raised:
        list(pipe)
    assert urls[2] in str(raised.value) and raised.value.url == urls[2]
    # aiohttp may hand out part of the cut response before it reports the cut, and a read that
    # makes progress starts its attempts afresh: at least `attempts` requests, then the error
    assert server.requests["shard-0002.tar"] >= FAST_RETRY.attempts
    assert "gave up after 3 attempts" in " ".join(getattr(raised.value.__cause__, "__notes__", []))


@pytest.mark.parametrize("chunk", [None, 4096])
def test_a_stream_read_that_keeps_failing_names_the_url(server: ShardServer, chunk: int | None) -> None:
    server.drop("shard-0001.tar", times=100)
    url = server.url("shard-0001.tar")
    with pytest.raises(SourceError, match=url):
        list(IterableWrapper([url]).open_files(mode="b", retry=FAST_RETRY).read_from_stream(chunk=chunk))


def test_the_skip_policy_leaves_out_the_failing_shard_and_counts_it(server: ShardServer) -> None:
    server.drop("shard-0002.tar", times=100)
    pipe = webdataset_pipeline(shard_urls(server), shuffle_shards=False, shuffle_buffer=0,
                               on_error="skip", retry=FAST_RETRY)
    with pytest.warns(SkippedSampleWarning, match="shard-0002.tar"):
        samples = list(pipe)
    keys = [sample["__key__"] for sample in samples]
    # the samples read before the cut stay, whole; the rest of that shard is left out
    assert set(all_keys(4, 5)) - set(keys) and set(keys) >= set(all_keys(2, 5))
    assert all({"jpg", "cls", "json"} <= set(sample) for sample in samples)
    counts = pipeload.datapipes.sources.failure_counts(pipe)
    # and the sample the cut fell in, unless it fell between two samples
    assert counts.skipped == counts.files == 1 and counts.samples <= 1


def test_a_refused_connection_is_named_after_its_retries() -> None:
    url = refused_url("shard-0000.tar")
    started = time.monotonic()
    with pytest.raises(SourceError, match=url):
        list(IterableWrapper([url]).open_files(mode="b", retry=FAST_RETRY))
    assert time.monotonic() - started < 5.0
    opener = IterableWrapper([url]).open_files(mode="b", retry=FAST_RETRY, on_error="skip")
    with pytest.warns(SkippedSampleWarning, match=url):
        assert list(opener) == []


def test_a_missing_shard_is_a_file_not_found_naming_the_url(server: ShardServer) -> None:
    url = server.url("no-such-shard.tar")
    with pytest.raises(FileNotFoundError, match="no-such-shard.tar"):
        list(IterableWrapper([url]).open_files(mode="b"))
    assert server.requests["no-such-shard.tar"] == 1  # a 404 is not retried
    with pytest.raises(FileNotFoundError, match=server.url("no-such-folder")):
        list(FileLister(server.url("no-such-folder"), "*.tar"))


PASSWORD, SIGNATURE, CREDENTIAL = "hunter2pw", "c2lnbmF0dXJlLXNlY3JldA", "AKIAEXAMPLE/20240101"


def _signed(url: str) -> str:
    """``url`` with a password and a presigned URL's query string written into it."""
    with_password = url.replace("http://", f"http://reader:{PASSWORD}@")
    return f"{with_password}?X-Amz-Credential={CREDENTIAL.replace('/', '%2F')}&X-Amz-Signature={SIGNATURE}&part=1"


def _assert_secret_free(text: str) -> None:
    for secret in (PASSWORD, SIGNATURE, CREDENTIAL, CREDENTIAL.replace("/", "%2F")):
        assert secret not in text, f"{secret!r} shown in: {text}"


def test_errors_and_warnings_name_the_url_but_not_the_secrets_in_it(server: ShardServer) -> None:
    server.drop("shard-0001.tar", times=100)  # every response cut half-way
    cut, missing = _signed(server.url("shard-0001.tar")), _signed(server.url("no-such-shard.tar"))
    tar = IterableWrapper([cut]).open_files(mode="b", retry=FAST_RETRY).load_from_tar()
    with pytest.raises(SourceError) as raised:
        list(tar)
    shown = str(raised.value)
    assert "reader:***@127.0.0.1" in shown and "shard-0001.tar?X-Amz-Credential=***&X-Amz-Signature=***&part=1" in shown
    _assert_secret_free(shown)
    assert raised.value.url == cut  # the attribute keeps the URL as given
    with pytest.raises(FileNotFoundError) as not_found:
        list(IterableWrapper([missing]).open_files(mode="b"))
    assert "no-such-shard.tar" in str(not_found.value)
    _assert_secret_free(str(not_found.value))
    skipping = IterableWrapper([cut, missing]).open_files(mode="b", retry=FAST_RETRY, on_error="skip",
                                                          max_failures=0).load_from_tar(on_error="skip")
    with pytest.warns(SkippedSampleWarning) as warned, pytest.raises(pipeload.datapipes.sources.FailureBudgetExceeded) as over:
        list(skipping)
    assert warned and "shard-0001.tar" in str(warned[0].message)
    for text in [str(w.message) for w in warned] + [str(over.value)]:
        _assert_secret_free(text)


def test_an_error_naming_a_second_url_hides_its_secrets_too() -> None:
    # Only the URL an error was raised for was redacted: a sample split across two presigned
    # shards, or a checkpoint taken in another archive, showed the other's signature (stop 54).
    from pipeload.datapipes.sources.errors import SourceError as Raised

    first = _signed("http://127.0.0.1:1/a.tar")
    second = "http://127.0.0.1:1/b.tar?X-Amz-Signature=0ther5ignature&part=2"  # signed apart
    shown = str(Raised(f"sample 'k' of {second!r} continues the one that ended {first!r}", second))
    assert "a.tar?X-Amz-Credential=***&X-Amz-Signature=***&part=1" in shown
    assert "b.tar?X-Amz-Signature=***&part=2" in shown
    _assert_secret_free(shown)


def test_a_token_written_as_the_user_name_is_hidden() -> None:
    from pipeload.datapipes.sources.errors import redact_url

    assert redact_url("https://ghp_abcdef123456@host/data.tar") == "https://***@host/data.tar"
    assert redact_url("https://reader:pw12345@host/data.tar") == "https://reader:***@host/data.tar"
    # Hidden in the URL only: a user name is often a word the rest of the message uses too.
    from pipeload.datapipes.sources.errors import hide_url_secrets

    shown = hide_url_secrets("cannot read https://data@host/data/a.tar (the data bucket)", None)
    assert shown == "cannot read https://***@host/data/a.tar (the data bucket)"


@pytest.mark.timeout(30)
def test_a_stalled_response_is_a_transient_error_not_a_five_minute_wait(
    server: ShardServer, monkeypatch: pytest.MonkeyPatch
) -> None:
    # aiohttp's own default waits 300 s for a whole response, bytes or none, and caps a long
    # shard at 300 s too; a read that brings nothing for HTTP_STALL_S is what fails
    server.stall("shard-0001.tar")
    urls = shard_urls(server, 2)
    raised = _read_failing(urls, monkeypatch)
    assert "Timeout" in str(raised) and server.requests["shard-0001.tar"] >= FAST_RETRY.attempts


def _read_failing(urls: list[str], monkeypatch: pytest.MonkeyPatch) -> SourceError:
    """The error reading ``urls`` ends in (naming the last), with a stall timeout of 0.3 s."""
    monkeypatch.setattr(_storage, "HTTP_STALL_S", 0.3)
    pipe = IterableWrapper(urls).open_files(mode="b", retry=FAST_RETRY).load_from_tar()
    with pytest.raises(SourceError, match=urls[-1]) as raised:
        list(pipe)
    return raised.value


@pytest.mark.timeout(30)
def test_a_server_that_stalls_after_a_few_bytes_each_time_ends_in_an_error_after_its_attempts(
    server: ShardServer, monkeypatch: pytest.MonkeyPatch
) -> None:
    # Each reconnect brings a few bytes: progress, but not enough to start the attempts afresh
    # (followed to the end before, a stall timeout every 4 KiB).
    server.trickle("shard-0000.tar")
    raised = _read_failing(shard_urls(server, 1), monkeypatch)
    assert "Timeout" in str(raised) and f"gave up after {FAST_RETRY.attempts} attempts" in str(raised)
    assert server.requests["shard-0000.tar"] == FAST_RETRY.attempts


@pytest.mark.parametrize("worker_type", ["process", "thread"])
def test_workers_hanging_on_a_stalled_read_do_not_hold_up_shutdown(
    server: ShardServer, leak_guard: LeakGuard, worker_type: str
) -> None:
    for name in ("shard-0000.tar", "shard-0001.tar"):
        server.stall(name)
    pipe = IterableWrapper(shard_urls(server, 2)).sharding_filter().open_files(mode="b", retry=FAST_RETRY)
    loader = pipeload.DataLoader(pipe.load_from_tar(), batch_size=None, num_workers=2, worker_type=worker_type)
    epoch = iter(loader)
    assert wait_until(lambda: server.requests.total() == 2 and server.stalled.is_set(), 20.0)
    pids = [w.pid for w in epoch._workers]
    started = time.monotonic()
    epoch.close()
    assert time.monotonic() - started < SHUTDOWN_WITHIN_S
    if worker_type == "process":
        leak_guard.assert_exited(pids, within_s=SHUTDOWN_WITHIN_S)


def test_files_and_shards_are_asked_for_as_stored_never_compressed_on_the_way(server: ShardServer) -> None:
    # aiohttp asked for gzip and did not notice a gzip body cut short without a Content-Length:
    # a file came back short, silently (and a resumed Range counts the bytes as stored).
    from pipeload.datapipes.map import FileReader

    url = shard_urls(server, 1)[0]
    assert FileReader([url])[0][1] == (server.root / "shard-0000.tar").read_bytes()
    assert len(list(IterableWrapper([url]).open_files(mode="b").load_from_tar())) > 0
    assert server.encodings_asked == ["identity", "identity"]


def test_a_gzip_shard_read_to_its_end_leaves_aiohttp_nothing_to_warn_of(
        tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    # gzip's reader asks for more at the end of its data again and again; each ask went to
    # aiohttp's response, which logs a warning with a stack ("Multiple access to StreamReader in
    # eof state, might be infinite loop") after the fifth: two per shard, on every user's stderr.
    (path,) = write_shards(tmp_path, 1, 40, "gz")
    with ShardServer(tmp_path) as running, caplog.at_level("WARNING"):
        members = list(IterableWrapper([running.url(path.name)]).open_files(mode="b").load_from_tar())
    assert len(members) == 120
    assert [record.getMessage() for record in caplog.records] == []
