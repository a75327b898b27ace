"""The sources' public arguments are checked when the pipe is built, by name: a wrong type is a
TypeError, a wrong value a ValueError, each naming the argument and the value received; and a
remote read that fails through ``open_stream`` itself names the URL it was reading."""

from __future__ import annotations

import re
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from sources_for_tests import ShardServer, all_keys, sample_key, write_shards

from pipeload.datapipes import webdataset_pipeline
from pipeload.datapipes.iter import IterableWrapper
from pipeload.datapipes.sources import FileLister, RetryPolicy, SourceError, TarArchiveLoader, open_stream

pytestmark = [pytest.mark.timeout(60), pytest.mark.imports_large_libraries]  # fsspec and aiohttp: run last (conftest)

SHARDS, SAMPLES = 2, 3


@pytest.fixture
def shards(tmp_path: Path) -> list[str]:
    return [str(path) for path in write_shards(tmp_path, SHARDS, SAMPLES)]


# ------------------------------------------------------------------ webdataset_pipeline


@pytest.mark.parametrize("arguments, error, name", [
    ({"urls": 5}, TypeError, "urls"),
    ({"urls": [b"a.tar"]}, TypeError, "urls"),
    ({"shuffle_buffer": -1}, ValueError, "shuffle_buffer"),
    ({"shuffle_buffer": 1.5}, TypeError, "shuffle_buffer"),
    ({"shuffle_buffer": True}, TypeError, "shuffle_buffer"),
    ({"read_ahead": -1}, ValueError, "read_ahead"),
    ({"read_ahead": None}, TypeError, "read_ahead"),
    ({"read_ahead": "64"}, TypeError, "read_ahead"),
    ({"handlers": {"cls": 5}}, TypeError, "handlers"),
    ({"handlers": {1: bytes.decode}}, TypeError, "handlers"),
    ({"handlers": [1]}, TypeError, "handlers"),
    ({"storage_options": "x"}, TypeError, "storage_options"),
    ({"retry": "x"}, TypeError, "retry"),
    ({"retry": {"attempts": 2}}, TypeError, "retry"),
    ({"shuffle_shards": "no"}, TypeError, "shuffle_shards"),
    ({"shuffle_shards": 1}, TypeError, "shuffle_shards"),
    ({"hold_until_checked": "yes"}, TypeError, "hold_until_checked"),
    ({"batch_size": True}, TypeError, "batch_size"),
    ({"batch_size": 0}, ValueError, "webdataset_pipeline: batch_size"),
    ({"batch_size": -2}, ValueError, "webdataset_pipeline: batch_size"),
    ({"batch_size": 2.5}, TypeError, "webdataset_pipeline: batch_size"),
    ({"on_error": "bogus"}, ValueError, "webdataset_pipeline: on_error"),  # not a stage's name
])
def test_a_bad_pipeline_argument_is_refused_by_name(shards: list[str], arguments: dict[str, Any],
                                                    error: type, name: str) -> None:
    arguments = {"urls": shards, **arguments}
    with pytest.raises(error, match=rf"\b{name}\b") as raised:
        webdataset_pipeline(**arguments)
    assert type(raised.value) is error  # not an AssertionError or AttributeError of a stage


def test_pipeline_arguments_are_checked_before_any_shard_is_looked_for(tmp_path: Path) -> None:
    missing = str(tmp_path / "no-such-shard.tar")
    with pytest.raises(TypeError, match="read_ahead"):
        webdataset_pipeline(missing, read_ahead=None)


def test_valid_pipeline_arguments_still_give_every_sample(shards: list[str]) -> None:
    pipe = webdataset_pipeline(tuple(shards), shuffle_shards=False, shuffle_buffer=np.int64(4),
                               read_ahead=0, handlers={"cls": None, "json": bytes}, storage_options={},
                               retry=RetryPolicy(attempts=1), hold_until_checked=True)
    samples = list(pipe)
    assert sorted(sample_key(sample) for sample in samples) == all_keys(SHARDS, SAMPLES)
    assert all(isinstance(sample["cls"], bytes) and isinstance(sample["json"], bytes) for sample in samples)


# ------------------------------------------------------------------ RetryPolicy


@pytest.mark.parametrize("arguments, error, name", [
    ({"attempts": 2.5}, TypeError, "attempts"),
    ({"attempts": "3"}, TypeError, "attempts"),
    ({"attempts": True}, TypeError, "attempts"),
    ({"attempts": 0}, ValueError, "attempts"),
    ({"backoff_s": float("nan")}, ValueError, "backoff_s"),
    ({"backoff_s": float("inf")}, ValueError, "backoff_s"),
    ({"backoff_s": -0.1}, ValueError, "backoff_s"),
    ({"backoff_s": "0.2"}, TypeError, "backoff_s"),
    ({"backoff_s": True}, TypeError, "backoff_s"),
    ({"max_backoff_s": float("nan")}, ValueError, "max_backoff_s"),
    ({"max_backoff_s": None}, TypeError, "max_backoff_s"),
])
def test_a_bad_retry_policy_field_is_refused_by_name(arguments: dict[str, Any], error: type, name: str) -> None:
    with pytest.raises(error, match=rf"\b{name}=") as raised:
        RetryPolicy(**arguments)
    assert type(raised.value) is error


def test_whole_and_fractional_waits_are_accepted() -> None:
    policy = RetryPolicy(attempts=1, backoff_s=0, max_backoff_s=2)
    assert policy.wait_s(1) == 0 and RetryPolicy(backoff_s=np.float64(0.5)).wait_s(1) == 0.5


# ------------------------------------------------------------------ load_from_tar


@pytest.mark.parametrize("arguments, error, name", [
    ({"hold_until_checked": "x"}, TypeError, "hold_until_checked"),
    ({"hold_until_checked": None}, TypeError, "hold_until_checked"),
    ({"mode": 5}, TypeError, "mode"),
    ({"mode": "w"}, ValueError, "mode"),
    ({"length": 1.5}, TypeError, "length"),
])
def test_a_bad_tar_loader_argument_is_refused_by_name(arguments: dict[str, Any], error: type, name: str) -> None:
    with pytest.raises(error, match=rf"\b{name}="):
        TarArchiveLoader(IterableWrapper([]), **arguments)


def test_the_functional_form_checks_hold_until_checked_too(shards: list[str]) -> None:
    with pytest.raises(TypeError, match="hold_until_checked='x'"):
        IterableWrapper(shards).open_files(mode="b").load_from_tar(hold_until_checked="x")


# ------------------------------------------------------------------ FileLister


@pytest.mark.parametrize("arguments, name", [
    ({"masks": 5}, "masks"),
    ({"masks": ["*.tar", 5]}, "masks"),
    ({"masks": b"*.tar"}, "masks"),
    ({"root": 5}, "root"),
    ({"root": [Path(".")]}, "root"),
    ({"recursive": "no"}, "recursive"),
    ({"abspath": 1}, "abspath"),
    ({"non_deterministic": None}, "non_deterministic"),
    ({"length": "3"}, "length"),
    ({"length": True}, "length"),
    ({"storage_options": "x"}, "storage_options"),
])
def test_a_bad_file_lister_argument_is_refused_when_built(tmp_path: Path, arguments: dict[str, Any],
                                                          name: str) -> None:
    arguments = {"root": str(tmp_path), **arguments}
    with pytest.raises(TypeError, match=rf"\b{name}="):
        FileLister(**arguments)  # not iterated: refused where it is built


def test_file_lister_still_takes_masks_and_roots_as_it_did(tmp_path: Path, shards: list[str]) -> None:
    assert list(FileLister(str(tmp_path), ("*.tar",))) == sorted(shards)
    assert list(FileLister((str(tmp_path),), ["*.tgz", "*.tar"], length=2)) == sorted(shards)
    assert list(FileLister(IterableWrapper([str(tmp_path)]), "*.tar", recursive=True)) == sorted(shards)


# ------------------------------------------------------------------ open_stream


@pytest.fixture
def server(tmp_path: Path) -> Iterator[ShardServer]:
    import fsspec.asyn

    fsspec.asyn.get_loop()  # fsspec's IO thread, started once for the process
    write_shards(tmp_path, 1, 5)
    with ShardServer(tmp_path) as running:
        yield running


def test_a_remote_read_through_open_stream_that_keeps_failing_names_the_url(server: ShardServer) -> None:
    server.drop("shard-0000.tar", times=100)  # every response cut half-way
    url = server.url("shard-0000.tar")
    with open_stream(url, retry=RetryPolicy(attempts=2, backoff_s=0)) as stream:
        with pytest.raises(SourceError, match=f"cannot read '{url}'") as raised:
            stream.read()
    assert raised.value.url == url
    cause = raised.value.__cause__
    assert cause is not None and not isinstance(cause, SourceError)  # the network library's own error
    assert "gave up after 2 attempts" in " ".join(getattr(cause, "__notes__", []))


def test_a_remote_read_through_open_stream_that_succeeds_is_unchanged(server: ShardServer, tmp_path: Path) -> None:
    with open_stream(server.url("shard-0000.tar")) as stream:
        assert stream.read() == (tmp_path / "shard-0000.tar").read_bytes()


@pytest.mark.parametrize("build, error, words", [
    # Each refused by a sibling entry point and taken here, to fail later (in a worker, per file,
    # or every sample skipped under on_error="skip").
    (lambda: IterableWrapper(["a"]).open_files(retry=3), TypeError, "FileOpener: retry must be a RetryPolicy"),
    (lambda: IterableWrapper(["a"]).open_files(encoding=3), TypeError, "FileOpener: encoding must be a str"),
    (lambda: IterableWrapper(["a"]).open_files(encoding="no-such-codec"), ValueError, "FileOpener: unknown encoding"),
    (lambda: IterableWrapper(["a"]).open_files(length=1.5), TypeError, "FileOpener: length must be an int"),
    (lambda: IterableWrapper([]).webdataset(length=1.5), TypeError, "WebDataset: length must be an int"),
    (lambda: IterableWrapper([]).webdataset(length=-2), ValueError, "WebDataset: length must be 0 or more"),
    (lambda: IterableWrapper([]).decode(handlers=3), TypeError, "Decoder: handlers must be a mapping"),
    (lambda: IterableWrapper([]).decode(handlers={"cls": 3}, on_error="skip"), TypeError,
     "Decoder: handlers['cls'] must be a callable"),
    (lambda: IterableWrapper([]).prefetch(True), TypeError, "buffer_size should be an int of at least 1"),
    (lambda: IterableWrapper([]).queue_boundary("thread", buffer_size=True), TypeError,
     "buffer_size should be an int of at least 1"),
])
def test_an_option_a_sibling_refuses_is_refused_here_too_by_name(build: Any, error: type, words: str) -> None:
    with pytest.raises(error, match=re.escape(words)):
        build()
