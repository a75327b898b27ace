"""The same shards as s3:// URLs, from moto's S3 server on 127.0.0.1 reached through s3fs: found by
glob and FileLister, every sample once with 0 and 2 process workers, credentials and endpoint
from the standard AWS_* environment variables or from storage_options; a key overwritten between
two ranged reads is a SourceChangedError (or a skipped shard), never spliced."""

from __future__ import annotations

import os
import re
import time
import warnings
from collections.abc import Iterator
from pathlib import Path

import pytest
from sources_for_tests import all_keys, free_port, sample_key, tar_bytes, write_shards

import pipeload
from pipeload.datapipes import webdataset_pipeline
from pipeload.datapipes.iter import FileLister, IterableWrapper
from pipeload.datapipes.sources import FileReader, SourceChangedError, SourceError, _storage

pytestmark = [pytest.mark.usefixtures("leak_guard"), pytest.mark.timeout(90), pytest.mark.imports_large_libraries]

BUCKET = "pipeload-shards"
SHARDS, SAMPLES = 4, 5
CREDENTIALS = {"AWS_ACCESS_KEY_ID": "testing", "AWS_SECRET_ACCESS_KEY": "testing",
               "AWS_DEFAULT_REGION": "us-east-1"}


@pytest.fixture(scope="module")
def s3_endpoint(tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    """moto's S3 server on 127.0.0.1, holding the shards; AWS_* variables point at it."""
    import fsspec.asyn
    from moto.server import ThreadedMotoServer

    fsspec.asyn.get_loop()  # fsspec's IO thread lives as long as the process: not a test's leak
    port = free_port()
    server = ThreadedMotoServer(ip_address="127.0.0.1", port=port, verbose=False)
    server.start()
    endpoint = f"http://127.0.0.1:{port}"
    with pytest.MonkeyPatch.context() as env:
        for name, value in {**CREDENTIALS, "AWS_ENDPOINT_URL": endpoint}.items():
            env.setenv(name, value)
        _upload(tmp_path_factory.mktemp("s3-shards"), endpoint)
        # s3fs resolves hosts and credentials in the IO loop's executor thread, which then lives
        # as long as the loop: start it here, before any test's leak check.
        list(FileLister(f"s3://{BUCKET}/train", "*.tar"))
        yield endpoint
        _forget_s3_clients()
    server.stop()


def _upload(directory: Path, endpoint: str) -> None:
    import boto3

    client = boto3.client("s3", endpoint_url=endpoint)
    client.create_bucket(Bucket=BUCKET)
    for path in write_shards(directory, SHARDS, SAMPLES):
        client.upload_file(str(path), BUCKET, f"train/{path.name}")
    client.put_object(Bucket=BUCKET, Key="train/README.txt", Body=b"not a shard")


def _forget_s3_clients() -> None:
    import s3fs

    s3fs.S3FileSystem.clear_instance_cache()


@pytest.fixture
def fresh_s3_clients(s3_endpoint: str) -> Iterator[str]:
    """Each test starts and ends without cached s3fs clients (their pooled sockets are fds)."""
    _forget_s3_clients()
    yield s3_endpoint
    _forget_s3_clients()


@pytest.mark.parametrize("num_workers", [0, 2])
def test_every_sample_once_from_s3_with_the_environment_credentials(fresh_s3_clients: str, num_workers: int) -> None:
    pipe = webdataset_pipeline(f"s3://{BUCKET}/train/shard-*.tar", image="numpy").map(sample_key)
    loader = pipeload.DataLoader(pipe, batch_size=None, num_workers=num_workers)
    assert sorted(loader) == all_keys(SHARDS, SAMPLES)


def test_storage_options_carry_the_endpoint_and_keys_into_workers(
    fresh_s3_clients: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    for name in ("AWS_ENDPOINT_URL", *CREDENTIALS):
        monkeypatch.delenv(name)
    options = {"key": "testing", "secret": "testing",
               "client_kwargs": {"endpoint_url": fresh_s3_clients, "region_name": "us-east-1"}}
    urls = [f"s3://{BUCKET}/train/shard-{{0000..{SHARDS - 1:04d}}}.tar"]
    pipe = webdataset_pipeline(urls, storage_options=options, shuffle_buffer=4).map(sample_key)
    assert sorted(pipeload.DataLoader(pipe, batch_size=None, num_workers=2)) == all_keys(SHARDS, SAMPLES)


def test_file_lister_finds_the_shards_by_mask(fresh_s3_clients: str) -> None:
    listed = list(FileLister(f"s3://{BUCKET}/train", "*.tar"))
    assert listed == [f"s3://{BUCKET}/train/shard-{shard:04d}.tar" for shard in range(SHARDS)]
    everything = list(IterableWrapper([f"s3://{BUCKET}"]).list_files(recursive=True))
    assert f"s3://{BUCKET}/train/README.txt" in everything and len(everything) == SHARDS + 1


def test_a_lister_iterated_again_lists_the_bucket_as_it_is_now(fresh_s3_clients: str) -> None:
    # fsspec keeps a listing for the life of the process: the next epoch of a lister kept a
    # deleted shard (its read then failed) and missed a new one.
    import boto3

    client = boto3.client("s3", endpoint_url=fresh_s3_clients, region_name="us-east-1")
    lister = FileLister(f"s3://{BUCKET}/extra", "*.tar")
    client.put_object(Bucket=BUCKET, Key="extra/a.tar", Body=b"a")
    client.put_object(Bucket=BUCKET, Key="extra/b.tar", Body=b"b")
    assert list(lister) == [f"s3://{BUCKET}/extra/a.tar", f"s3://{BUCKET}/extra/b.tar"]
    client.delete_object(Bucket=BUCKET, Key="extra/a.tar")
    client.put_object(Bucket=BUCKET, Key="extra/c.tar", Body=b"c")
    try:
        assert list(lister) == [f"s3://{BUCKET}/extra/b.tar", f"s3://{BUCKET}/extra/c.tar"]
        assert list(FileLister(f"s3://{BUCKET}/extra", "*.tar")) == list(lister)
    finally:
        for key in ("extra/b.tar", "extra/c.tar"):
            client.delete_object(Bucket=BUCKET, Key=key)


def test_a_missing_object_is_named_by_its_whole_url(fresh_s3_clients: str) -> None:
    url = f"s3://{BUCKET}/train/no-such-shard.tar"
    with pytest.raises(FileNotFoundError, match=re.escape(repr(url))):
        list(IterableWrapper([url]).open_files(mode="b"))
    with pytest.raises(FileNotFoundError, match=re.escape(repr(url))):
        FileReader([url])[0]


@pytest.mark.parametrize("root", [f"s3://{BUCKET}/no-such-prefix", "s3://no-such-bucket/train"])
def test_a_missing_prefix_or_bucket_is_named_as_a_missing_local_directory_is(
    fresh_s3_clients: str, root: str
) -> None:
    with pytest.raises(FileNotFoundError, match=re.escape(repr(root))):
        list(FileLister(root, "*.tar"))
    assert list(FileLister(f"s3://{BUCKET}/train", "*.zip")) == []  # there, but nothing matches


# Reads in ranges of about 1 MiB (the stream's buffer) plus this: a 3 MiB shard takes several.
SMALL_BLOCKS = {"default_block_size": 64 * 1024}


def _overwrite(key: str, data: bytes) -> None:
    import boto3

    boto3.client("s3").put_object(Bucket=BUCKET, Key=key, Body=data)


def _big_members() -> list[tuple[str, bytes]]:
    return [(f"k{index:03d}.bin", os.urandom(256 * 1024)) for index in range(12)]


@pytest.mark.parametrize("on_error", ["raise", "skip"])
@pytest.mark.parametrize("new_length", ["same", "other"])
def test_a_key_overwritten_between_two_ranges_is_never_spliced(
    fresh_s3_clients: str, on_error: str, new_length: str
) -> None:
    members = _big_members()
    key = f"changing/{on_error}-{new_length}.tar"
    _overwrite(key, tar_bytes(members))
    replaced = [(name, bytes(len(data))) for name, data in members]
    if new_length == "other":
        replaced.append(("extra.bin", bytes(30_000)))
    url = f"s3://{BUCKET}/{key}"
    pipe = IterableWrapper([url]).open_files(mode="b", storage_options=SMALL_BLOCKS, on_error=on_error)
    tar = pipe.load_from_tar(on_error=on_error)
    got = []
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        samples = iter(tar)
        got.append(next(samples))  # the first range read
        _overwrite(key, tar_bytes(replaced))
        if on_error == "raise":
            with pytest.raises(SourceChangedError, match=re.escape(repr(url))):
                got.extend(samples)
        else:
            got.extend(samples)
            assert tar.failure_counts().skipped == 1
            assert any("changed while it was read" in str(w.message) for w in caught)
    pairs = [(m.name, m[1]) for m in got]
    assert pairs == members[:len(pairs)] and len(pairs) < len(members)


def test_a_key_replaced_after_the_listing_and_before_its_first_read_is_read_whole_as_it_is_now(
    fresh_s3_clients: str,
) -> None:
    # The listing saw the first version; nothing of it was read: the new one is whole and
    # consistent, not "changed while it was read" (s3fs pinned reads to the listing's ETag).
    first = [(f"k{index:03d}.bin", bytes([index]) * 3000) for index in range(4)]
    now = [(name, bytes([9]) * 5000) for name, _ in first]
    _overwrite("relisted/a.tar", tar_bytes(first))
    shards = FileLister(f"s3://{BUCKET}/relisted", "*.tar")
    listed = list(shards)
    _overwrite("relisted/a.tar", tar_bytes(now))
    got = list(IterableWrapper(listed).open_files(mode="b").load_from_tar())
    assert [(m.name, m[1]) for m in got] == now


def test_an_endpoint_that_refuses_connections_is_said_within_seconds(fresh_s3_clients: str) -> None:
    # botocore's five attempts inside s3fs's retries inside ours took ~35 s to say it
    refused = {"client_kwargs": {"endpoint_url": f"http://127.0.0.1:{free_port()}"}}
    url = f"s3://{BUCKET}/train/shard-0000.tar"
    started = time.monotonic()
    with pytest.raises(SourceError, match=re.escape(repr(url)) + ".*EndpointConnectionError"):
        list(IterableWrapper([url]).open_files(mode="b", storage_options=refused).load_from_tar())
    assert time.monotonic() - started < 12


def test_a_reopened_read_of_an_overwritten_key_is_refused(fresh_s3_clients: str) -> None:
    members = _big_members()
    key = "changing/reopened.tar"
    _overwrite(key, tar_bytes(members))
    url = f"s3://{BUCKET}/{key}"
    file, first, _ = _storage.open_remote(url, SMALL_BLOCKS)
    file.close()
    again, _, _ = _storage.open_remote(url, SMALL_BLOCKS, 4096, first)  # unchanged: accepted
    again.close()
    _overwrite(key, tar_bytes(members[1:] + members[:1]))  # the same length, other bytes
    with pytest.raises(SourceChangedError, match="ETag"):
        _storage.open_remote(url, SMALL_BLOCKS, 4096, first)


def test_a_key_overwritten_between_a_checkpoint_and_its_resume_is_refused(fresh_s3_clients: str) -> None:
    # The resume opens the key afresh and seeks to the byte the checkpoint recorded: without
    # the version in the checkpoint, a same-length rewrite was read on from there, spliced.
    members = [(f"k{index:03d}.bin", bytes([index]) * 3000) for index in range(6)]
    key = "changing/checkpointed.tar"
    _overwrite(key, tar_bytes(members))
    url = f"s3://{BUCKET}/{key}"
    def make() -> Iterator:
        return iter(IterableWrapper([url]).open_files(mode="b").load_from_tar())

    iterator = make()
    [next(iterator) for _ in range(3)]
    state = iterator.state_dict()
    iterator.close()
    unchanged = make()
    unchanged.load_state_dict(state)
    assert [(m.name, m[1]) for m in unchanged] == members[3:]
    _overwrite(key, tar_bytes([(name, bytes(len(data))) for name, data in members]))
    resumed = make()
    resumed.load_state_dict(state)
    with pytest.raises(SourceChangedError, match=rf"{re.escape(repr(url))} changed since the checkpoint "
                                                 r"was taken \(its ETag was"):
        next(resumed)
    resumed.close()
