"""A remote shard replaced while it is read is never spliced: the HTTP server cuts the first
response half-way and serves a new version (another ETag, Last-Modified or length) on the
reconnect, whatever it honours of Range, If-Range and If-Match; s3 through moto's server has the
key overwritten between two ranged reads. Every case raises a SourceChangedError naming the URL
(or, under on_error="skip", skips the shard and counts it); an unchanged object resumes with a
range request."""

from __future__ import annotations

import os
import warnings
from collections.abc import Iterator

import pytest
from sources_for_tests import ChangingServer, ServerBehaviour, tar_bytes

from pipeload.datapipes.iter import IterableWrapper
from pipeload.datapipes.sources import FailureCounts, RetryPolicy, SourceChangedError, SourceError

pytestmark = [pytest.mark.usefixtures("leak_guard"), pytest.mark.timeout(60), pytest.mark.imports_large_libraries]  # fsspec and aiohttp: run last (conftest)

FAST_RETRY = RetryPolicy(attempts=3, backoff_s=0.01)
MEMBER_BYTES = 256 * 1024  # large enough that reads before the cut hand out whole members


@pytest.fixture(scope="module", autouse=True)
def fsspec_io_thread() -> None:
    import fsspec.asyn

    fsspec.asyn.get_loop()  # lives as long as the process: not a test's leak


def shard_members(samples: int = 12, seed: int = 1) -> list[tuple[str, bytes]]:
    """Samples of two members each, with random payloads (every member's bytes unique)."""
    members = []
    for index in range(samples):
        payload = os.urandom(MEMBER_BYTES) if seed else bytes(MEMBER_BYTES)
        members += [(f"k{index:03d}.bin", payload), (f"k{index:03d}.cls", str(index).encode())]
    return members


def changed_versions(members: list[tuple[str, bytes]], change: str) -> bytes:
    """A new version of the shard: the same length with other bytes ("bytes"), or longer."""
    if change == "bytes":
        return tar_bytes([(name, bytes(b ^ 0x5A for b in data[:64]) + data[64:]) for name, data in members])
    return tar_bytes(members + [("extra.bin", bytes(30_000))])  # past tar's record padding


def read_members(url: str, on_error: str = "raise") -> list[tuple[str, bytes]]:
    pipe = IterableWrapper([url]).open_files(mode="b", retry=FAST_RETRY, on_error=on_error)
    return [(m.name, m[1]) for m in pipe.load_from_tar(on_error=on_error)]


# (what the server tells and honours, how the new version differs)
CASES = {
    "etag, ranges and conditions": (ServerBehaviour(), "bytes"),
    "etag, ranges, no conditions": (ServerBehaviour(last_modified=False, conditions=False), "bytes"),
    "etag, nothing honoured": (ServerBehaviour(last_modified=False, ranges=False, conditions=False), "bytes"),
    "last-modified, ranges and conditions": (ServerBehaviour(etag=False), "bytes"),
    "last-modified, nothing honoured": (ServerBehaviour(etag=False, ranges=False, conditions=False), "bytes"),
    "length only, ranges": (ServerBehaviour(etag=False, last_modified=False, conditions=False), "length"),
    "length only, no ranges": (ServerBehaviour(etag=False, last_modified=False, ranges=False), "length"),
    # The reconnect's answer says no ETag or Last-Modified, the first one did (another backend):
    # a same-length new version was spliced in, a member half of each (stop 54's sources skeptic).
    "validators dropped on the reconnect, ranges": (
        ServerBehaviour(conditions=False, validators_after_a_cut=False), "bytes"),
    "validators dropped on the reconnect, no ranges": (
        ServerBehaviour(ranges=False, conditions=False, validators_after_a_cut=False), "bytes"),
}


@pytest.fixture(params=list(CASES))
def changing(request: pytest.FixtureRequest) -> Iterator[tuple[ChangingServer, str]]:
    behaviour, change = CASES[request.param]
    with ChangingServer(behaviour) as server:
        yield server, change


def test_a_shard_replaced_between_two_reads_raises_naming_the_url(changing: tuple[ChangingServer, str]) -> None:
    server, change = changing
    members = shard_members()
    server.put("shard.tar", tar_bytes(members))
    server.replace_after_cut("shard.tar", changed_versions(members, change))
    url = server.url("shard.tar")
    with pytest.raises(SourceChangedError, match="changed while it was read") as raised:
        read_members(url)
    assert url in str(raised.value) and isinstance(raised.value, SourceError)


def test_a_replaced_shard_is_skipped_and_nothing_spliced_under_skip(changing: tuple[ChangingServer, str]) -> None:
    server, change = changing
    members = shard_members()
    server.put("shard.tar", tar_bytes(members))
    server.put("after.tar", tar_bytes(members[:2]))
    server.replace_after_cut("shard.tar", changed_versions(members, change))
    pipe = IterableWrapper([server.url("shard.tar"), server.url("after.tar")]).open_files(
        mode="b", retry=FAST_RETRY, on_error="skip")
    tar = pipe.load_from_tar(on_error="skip")
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        got = [(m.name, m[1]) for m in tar]
    read_from_first = got[:-2]
    assert got[-2:] == members[:2]  # the next shard is read
    assert read_from_first == members[:len(read_from_first)] and len(read_from_first) < len(members)
    assert tar.failure_counts().skipped + pipe.failure_counts().skipped == 1
    assert any("changed while it was read" in str(w.message) for w in caught)


@pytest.mark.parametrize("behaviour", [ServerBehaviour(), ServerBehaviour(ranges=False)],
                         ids=["ranges", "no ranges"])
def test_an_unchanged_shard_resumes_where_it_was_cut(behaviour: ServerBehaviour) -> None:
    members = shard_members()
    with ChangingServer(behaviour) as server:
        server.put("shard.tar", tar_bytes(members))
        server.replace_after_cut("shard.tar", tar_bytes(members), generation=1)
        assert read_members(server.url("shard.tar")) == members
        resumed_at = server.ranges_asked[1]
    if behaviour.ranges:
        assert resumed_at is not None and resumed_at != "bytes=0-"  # asked for the rest only


def test_a_checkpoint_resumed_where_the_server_no_longer_gives_the_etag_is_refused() -> None:
    # The checkpoint holds the ETag the shard was read with; the resumed read's answer gives
    # none (another backend) for a new version of the same length: one epoch mixed both
    # versions (stop 54's sources skeptic). A version that cannot be confirmed is refused.
    members = shard_members(samples=4)
    with ChangingServer(ServerBehaviour(conditions=False, validators_after_a_cut=False)) as server:
        server.put("shard.tar", tar_bytes(members))
        make = lambda: IterableWrapper([server.url("shard.tar")]).open_files(mode="b").load_from_tar()  # noqa: E731
        iterator = iter(make())
        head = [next(iterator) for _ in range(3)]
        state = iterator.state_dict()
        iterator.close()
        assert [m.name for m in head] == [name for name, _ in members[:3]]
        server.put("shard.tar", changed_versions(members, "bytes"), generation=2)
        server.cut_was_made = True  # its answers give no validators from now on
        resumed = iter(make())
        resumed.load_state_dict(state)
        with pytest.raises(SourceChangedError, match="ETag was .* and none is given now"):
            list(resumed)
