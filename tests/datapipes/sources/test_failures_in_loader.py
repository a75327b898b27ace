"""The on_error policy inside a DataLoader: ``max_failures`` is one budget for the whole loader
(inline, 2 and 4 process or thread workers, read-ahead threads included), every skip is counted
exactly and apart (files, samples) in ``loader.stats()`` and ``failure_counts()``, a sample its
archive cut short is never yielded, and an epoch in which every shard failed is an error."""

from __future__ import annotations

import tarfile
import warnings
from pathlib import Path
from typing import Any

import pytest
from sources_for_tests import tar_bytes, write_shards

import pipeload
from pipeload.datapipes import webdataset_pipeline
from pipeload.datapipes.sources import FailureBudgetExceeded, FailureCounts, SourceError, failure_counts

pytestmark = [pytest.mark.usefixtures("leak_guard"), pytest.mark.timeout(120),
              pytest.mark.filterwarnings("ignore::UserWarning")]

SAMPLES = 10
CUT_SAMPLE = 5  # the truncated shard ends inside this sample's second member
ENGINES = {
    "inline": {"num_workers": 0},
    "process-2": {"num_workers": 2},
    "process-4": {"num_workers": 4},
    "thread-2": {"num_workers": 2, "worker_type": "thread"},
    "thread-4": {"num_workers": 4, "worker_type": "thread"},
}


COUNTING = {**ENGINES, "process-2-persistent": {"num_workers": 2, "persistent_workers": True}}


def bad_shards(directory: Path) -> tuple[list[str], list[str]]:
    """In ``directory`` (made if need be): three good shards and three bad ones (missing;
    garbage; truncated inside a sample), and the keys a reader can have from them: every good
    sample, and the truncated shard's samples before the one it cuts short."""
    directory.mkdir(parents=True, exist_ok=True)
    paths = write_shards(directory, 6, SAMPLES)
    paths[3].unlink()
    paths[4].write_bytes(b"not a tar archive at all" * 40)
    with tarfile.open(paths[5]) as tar:
        cut_at = tar.getmember(f"s05_{CUT_SAMPLE:03d}.cls").offset_data + 1
    paths[5].write_bytes(paths[5].read_bytes()[:cut_at])
    keys = [f"s{shard:02d}_{index:03d}" for shard in range(3) for index in range(SAMPLES)]
    keys += [f"s05_{index:03d}" for index in range(CUT_SAMPLE)]
    return [str(p) for p in paths], sorted(keys)


def with_a_bad_sample(directory: Path, urls: list[str]) -> list[str]:
    """``urls`` and one more shard whose one sample's JSON does not decode."""
    path = directory / "bad-sample.tar"
    path.write_bytes(tar_bytes([("bad.json", b"{not json"), ("bad.cls", b"1")]))
    return [*urls, str(path)]


def key_and_class(sample: dict[str, Any]) -> tuple[str, int]:
    return sample["__key__"], sample["cls"]  # a KeyError if a sample came without its class


def loader_over(urls: list[str], engine: dict[str, Any], read_ahead: int = 64,
                **policy: Any) -> tuple[Any, pipeload.DataLoader]:
    pipe = webdataset_pipeline(urls, image="numpy", shuffle_buffer=8, read_ahead=read_ahead,
                               on_error="skip", **policy)
    return pipe, pipeload.DataLoader(pipe.map(key_and_class), batch_size=None, **engine)


def counted_exactly(directory: Path, engine: str, read_ahead: int) -> None:
    urls, keys = bad_shards(directory)
    urls = with_a_bad_sample(directory, urls)
    pipe, loader = loader_over(urls, COUNTING[engine], read_ahead)
    for epoch in (1, 2):
        got = list(loader)
        assert sorted(key for key, _ in got) == keys  # the cut-short sample never arrives
        # three files (missing, garbage, truncated); two samples (the one the truncation cut
        # short, the one that did not decode); four failures skipped (the cut is no new one)
        assert failure_counts(pipe) == FailureCounts(skipped=4 * epoch, files=3 * epoch, samples=2 * epoch)
        stats = loader.stats()
        assert (stats.skipped_files, stats.skipped_samples) == (3 * epoch, 2 * epoch)
    assert "skipped samples: 4, skipped files: 6" in stats.summary()


@pytest.mark.parametrize("read_ahead", [64, 0], ids=["read-ahead", "no read-ahead"])
@pytest.mark.parametrize("engine", list(COUNTING))
def test_every_skip_is_counted_exactly_files_and_samples_apart(tmp_path: Path, engine: str,
                                                               read_ahead: int) -> None:
    counted_exactly(tmp_path, engine, read_ahead)


@pytest.mark.slow
@pytest.mark.parametrize("engine", list(COUNTING))
def test_every_skip_is_counted_exactly_in_every_run(tmp_path: Path, engine: str) -> None:
    for run in range(10):
        counted_exactly(tmp_path / str(run), engine, read_ahead=64)


def budget_is_one_for_the_loader(directory: Path, engine: str, runs: int) -> None:
    urls, _ = bad_shards(directory)
    for _ in range(runs):
        pipe, loader = loader_over(urls, ENGINES[engine], max_failures=2)
        with pytest.raises(FailureBudgetExceeded, match="max_failures=2"):
            list(loader)
        counts = failure_counts(pipe)
        # the three bad shards all failed: two skipped, the third raised (two workers failing
        # at one moment may both see the total past the budget: then both raise)
        assert counts.skipped + counts.raised == 3 and counts.raised >= 1
        assert counts.files == counts.skipped and counts.samples <= 1
        stats = loader.stats()
        assert (stats.skipped_files, stats.skipped_samples) == (counts.files, counts.samples)


@pytest.mark.parametrize("engine", list(ENGINES))
def test_max_failures_is_one_budget_for_the_whole_loader_in_every_run(tmp_path: Path, engine: str) -> None:
    budget_is_one_for_the_loader(tmp_path, engine, runs=10)


def test_the_board_reaches_spawned_workers(tmp_path: Path) -> None:
    urls, _ = bad_shards(tmp_path)
    pipe, loader = loader_over(urls, {"num_workers": 2, "multiprocessing_context": "spawn"}, max_failures=2)
    with pytest.raises(FailureBudgetExceeded):
        list(loader)
    counts = failure_counts(pipe)
    assert counts.skipped + counts.raised == 3 and counts.files == counts.skipped


@pytest.mark.parametrize("engine", ["inline", "process-2", "thread-2"])
def test_an_epoch_in_which_every_shard_failed_is_an_error(tmp_path: Path, engine: str) -> None:
    urls = [str(tmp_path / f"typo-{index}.tar") for index in range(4)]
    for url in urls:
        Path(url).write_bytes(b"garbage" * 100)
    _, loader = loader_over(urls, ENGINES[engine], max_failures=10)
    with pytest.raises(SourceError, match=r"ended without a batch: every file read failed \(4 left out") as raised:
        list(loader)
    assert "typo-" in str(raised.value)  # the latest failure is named
    # The error is kept here (and its traceback keeps this frame and the loader): the loader's
    # slabs go with the failed epoch anyway, as after any failure (the leak guard checks).


def test_a_pipe_read_outside_a_loader_keeps_the_budget_of_one_run(tmp_path: Path) -> None:
    urls, keys = bad_shards(tmp_path)
    pipe = webdataset_pipeline(urls, shuffle_shards=False, shuffle_buffer=0, on_error="skip", max_failures=3)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        assert sorted(s["__key__"] for s in pipe) == keys
        assert sorted(s["__key__"] for s in pipe) == keys  # each run has the whole budget again
    assert failure_counts(pipe) == FailureCounts(skipped=6, files=6, samples=2)


@pytest.mark.parametrize("read_ahead", [64, 0], ids=["read-ahead", "no read-ahead"])
def test_a_skipped_sample_is_said_at_the_users_line_even_from_the_read_ahead_thread(
        tmp_path: Path, read_ahead: int) -> None:
    # The read-ahead thread's stack holds no line of the user's: the warning pointed into
    # threading.py. It now points at the loop that started the thread (this file).
    urls, keys = bad_shards(tmp_path)
    pipe = webdataset_pipeline(urls, shuffle_shards=False, shuffle_buffer=0, on_error="skip",
                               read_ahead=read_ahead)
    with warnings.catch_warnings(record=True) as said:
        warnings.simplefilter("always")
        assert sorted(s["__key__"] for s in pipe) == keys
    skipped = [w for w in said if w.category.__name__ == "SkippedSampleWarning"]
    assert skipped and {w.filename for w in skipped} == {__file__}, [(w.filename, w.lineno) for w in skipped]


@pytest.mark.parametrize("read_ahead", [64, 0], ids=["read-ahead", "no read-ahead"])
@pytest.mark.parametrize("engine", ["inline", "process-2", "thread-2"])
def test_a_loop_that_catches_a_raised_shard_error_gets_every_other_shard(tmp_path: Path, engine: str,
                                                                         read_ahead: int) -> None:
    # README "Errors and the epoch": catch the batch's error and go on. With the read-ahead
    # thread, an archive error ended it, and every later shard of that worker vanished (13 of
    # 20 samples inline), counted nowhere; without it, only the broken shard's rest was lost.
    paths = write_shards(tmp_path, 5, SAMPLES)
    paths[3].write_bytes(b"not a tar archive at all" * 40)
    with tarfile.open(paths[1]) as tar:
        cut_at = tar.getmember(f"s01_{CUT_SAMPLE:03d}.cls").offset_data + 1
    paths[1].write_bytes(paths[1].read_bytes()[:cut_at])
    keys = sorted([f"s{shard:02d}_{index:03d}" for shard in (0, 2, 4) for index in range(SAMPLES)]
                  + [f"s01_{index:03d}" for index in range(CUT_SAMPLE)])
    pipe = webdataset_pipeline([str(p) for p in paths], image="numpy", shuffle_buffer=0,
                               shuffle_shards=False, read_ahead=read_ahead)
    loader = pipeload.DataLoader(pipe.map(key_and_class), batch_size=None, **ENGINES[engine])
    got, errors = [], []
    iterator = iter(loader)
    while True:
        try:
            got.append(next(iterator))
        except StopIteration:
            break
        except SourceError as error:  # the garbage and the cut shard
            errors.append(type(error).__name__)
    assert sorted(key for key, _ in got) == keys
    assert errors == ["ArchiveError"] * 2
