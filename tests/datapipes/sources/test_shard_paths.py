"""Wrong shard paths are found when the pipeline is built and told plainly: a brace pattern or a
list that names nothing (locally, or over HTTP: the first shards are asked), a directory where a
shard should be, a missing shard under on_error="raise"; a shard that goes missing later is named
in the loader's error in one line, right after torch's sentence, with the worker's traceback
after."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest
from sources_for_tests import ShardServer, sample_key, write_shards

import pipeload
from pipeload.datapipes import webdataset_pipeline
from pipeload.datapipes.sources import expand_urls

pytestmark = [pytest.mark.usefixtures("leak_guard"), pytest.mark.timeout(60), pytest.mark.imports_large_libraries]  # fsspec and aiohttp: run last (conftest)


@pytest.fixture(scope="module", autouse=True)
def fsspec_io_thread() -> None:
    import fsspec.asyn

    fsspec.asyn.get_loop()  # lives as long as the process: not a test's leak


@pytest.fixture
def server(tmp_path: Path) -> Iterator[ShardServer]:
    write_shards(tmp_path, 3, 2)
    with ShardServer(tmp_path) as running:
        yield running


@pytest.mark.parametrize("urls", ["{}/shard-{{0010..0019}}.tar", "{}/shrad-*.tar", ["{}/a.tar", "{}/b.tar"]],
                         ids=["braces", "glob", "list"])
def test_a_pattern_or_list_that_names_nothing_is_refused_when_built(tmp_path: Path, urls: object) -> None:
    write_shards(tmp_path, 2, 2)
    given = [u.format(tmp_path) for u in urls] if isinstance(urls, list) else urls.format(tmp_path)
    with pytest.raises(ValueError, match="no shard matches urls="):
        webdataset_pipeline(given, on_error="skip")


def test_a_directory_given_as_a_shard_is_refused_naming_it(tmp_path: Path) -> None:
    write_shards(tmp_path, 1, 2)
    with pytest.raises(ValueError, match=r"urls names a directory, not a shard: .* e\.g\. '.*\*\.tar'"):
        expand_urls([str(tmp_path)])


def test_a_missing_shard_is_refused_when_built_unless_skipped(tmp_path: Path) -> None:
    paths = [str(p) for p in write_shards(tmp_path, 2, 2)] + [str(tmp_path / "shard-0007.tar")]
    with pytest.raises(FileNotFoundError, match=r"1 of the 3 shards named do not exist.*shard-0007.tar") as raised:
        webdataset_pipeline(paths)
    assert len(str(raised.value).splitlines()) == 1 and raised.value.filename == paths[2]
    webdataset_pipeline(paths, on_error="skip")  # left out when read, and counted


def test_remote_shards_none_of_which_exists_are_refused_when_built(server: ShardServer) -> None:
    with pytest.raises(ValueError, match="no shard matches urls=.*none of the first 3"):
        webdataset_pipeline([server.url(f"trian-{shard:04d}.tar") for shard in range(3)])
    webdataset_pipeline([server.url(f"shard-{shard:04d}.tar") for shard in range(3)])
    assert not any(name.startswith("shard-") for name in server.requests)  # a HEAD: nothing read


def test_a_url_with_a_query_string_is_a_shard_not_a_glob(server: ShardServer) -> None:
    # "?" starts an HTTP URL's query (a presigned URL's signature, ?download=true), as fsspec
    # reads it too: such a URL is kept as given, not matched as a pattern, which had fetched each
    # shard whole at build time and silently left a missing one out of the list
    urls = [server.url(f"shard-{shard:04d}.tar") + "?download=true" for shard in (0, 1, 7)]
    assert expand_urls(urls) == urls
    assert not server.requests  # nothing read
    pipe = webdataset_pipeline(urls, shuffle_shards=False, shuffle_buffer=0)
    with pytest.raises(FileNotFoundError, match=r"shard-0007\.tar\?download=true"):
        list(pipe)  # the missing shard is named when read, not dropped
    assert server.requests["shard-0000.tar"] == server.requests["shard-0001.tar"] == 1


@pytest.mark.parametrize("worker_type", ["process", "thread"])
def test_a_shard_gone_missing_is_named_in_one_line_before_the_traceback(
    server: ShardServer, tmp_path: Path, worker_type: str
) -> None:
    urls = [server.url(f"shard-{shard:04d}.tar") for shard in range(3)]
    pipe = webdataset_pipeline(urls, shuffle_shards=False).map(sample_key)
    (tmp_path / "shard-0001.tar").unlink()  # after the pipeline was built
    loader = pipeload.DataLoader(pipe, batch_size=None, num_workers=2, worker_type=worker_type)
    with pytest.raises(FileNotFoundError) as raised:
        list(loader)
    lines = str(raised.value).splitlines()
    assert lines[0].startswith("Caught FileNotFoundError in DataLoader worker process")
    assert lines[1].startswith("FileNotFoundError: ") and repr(urls[1]) in lines[1]
    assert lines[2].startswith("Original Traceback")
