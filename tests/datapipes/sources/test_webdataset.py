"""webdataset: members grouped into samples by key as WebDataset groups them; duplicates refused or
skipped; the grouping survives NotAvailable from upstream."""

from __future__ import annotations

import io
import pickle
import tarfile
from pathlib import Path

import pytest
from sources_for_tests import Gate, GatedPipe, tar_bytes

from pipeload.datapipes import NotAvailable
from pipeload.datapipes.iter import IterableWrapper
from pipeload.datapipes.sources import (ArchiveError, ArchiveMember, FailureBudgetExceeded, FailureCounts,
                                        MemberLeftOutWarning, SkippedSampleWarning, SourceError, split_key)


# every stream opened is closed when its archive ends, fails or is dropped
pytestmark = pytest.mark.usefixtures("leak_guard")

def test_keys_and_extensions_follow_webdatasets_convention() -> None:
    assert split_key("a/b/000123.seg.png") == ("a/b/000123", "seg.png")
    assert split_key("x.y/abc.JPG") == ("x.y/abc", "JPG")
    assert split_key("README") is None


def test_consecutive_members_of_one_key_make_one_sample(tmp_path: Path) -> None:
    members = [("d/k1.jpg", b"j1"), ("d/k1.CLS", b"1"), ("d/k1.seg.png", b"p1"), ("README", b"x"),
               ("d/.hidden.cls", b"h"), ("d/k2.jpg", b"j2"), ("d/k2.cls", b"2")]
    (tmp_path / "a.tar").write_bytes(tar_bytes(members))
    (tmp_path / "b.tar").write_bytes(tar_bytes([("d/k2.jpg", b"j3")]))  # same key, next archive
    urls = [str(tmp_path / "a.tar"), str(tmp_path / "b.tar")]
    with pytest.warns(MemberLeftOutWarning) as said:  # README and .hidden.cls are in no sample
        samples = list(IterableWrapper(urls).open_files(mode="b").load_from_tar().webdataset())
    assert [str(w.message) for w in said if w.category is MemberLeftOutWarning] == [
        f"pipeload: member 'README' of {urls[0]!r} is left out of every sample: its name has no key and "
        "extension (WebDataset's convention: the key runs to the first dot of the file's own name, which "
        "must not begin with one, and an extension follows it); this is said once an archive"]
    assert samples == [
        {"__key__": "d/k1", "__url__": urls[0], "jpg": b"j1", "cls": b"1", "seg.png": b"p1"},
        {"__key__": "d/k2", "__url__": urls[0], "jpg": b"j2", "cls": b"2"},
        {"__key__": "d/k2", "__url__": urls[1], "jpg": b"j3"},
    ]


def test_plain_path_pairs_group_by_their_paths() -> None:
    pairs = IterableWrapper([("p/a.x", 1), ("p/a.y", 2), ("p/b.x", 3)])
    assert list(pairs.webdataset()) == [{"__key__": "p/a", "x": 1, "y": 2}, {"__key__": "p/b", "x": 3}]


def test_a_repeated_extension_is_refused_or_skipped() -> None:
    members = [ArchiveMember("u", name, b"") for name in ("a.jpg", "a.jpg", "b.jpg", "c.jpg", "c.jpg", "d.jpg")]
    with pytest.raises(ValueError, match="'a' of archive 'u' has two files with extension 'jpg'"):
        list(IterableWrapper(members).webdataset())
    grouped = IterableWrapper(members).webdataset(on_error="skip")
    with pytest.warns(SkippedSampleWarning):
        assert [s["__key__"] for s in grouped] == ["b", "d"]
    assert grouped.failure_counts() == FailureCounts(skipped=2, samples=2)


def test_grouping_carries_on_across_not_available() -> None:
    gate = Gate()
    it = iter(GatedPipe(gate).webdataset())
    got: list[dict] = []

    def drain() -> None:
        while True:
            try:
                got.append(it.nonblocking_next())
            except NotAvailable:
                return

    for i in range(6):  # k0.a k0.b k1.a k1.b k2.a k2.b, one at a time, NotAvailable in between
        gate.release(ArchiveMember("u", f"k{i // 2}.{'ab'[i % 2]}", bytes([i])))
        drain()
    assert [s["__key__"] for s in got] == ["k0", "k1"]  # k2 may still grow
    gate.ended = True
    got.extend(it)
    assert got[2] == {"__key__": "k2", "__url__": "u", "a": b"\x04", "b": b"\x05"} and len(got) == 3


def test_a_sample_its_archive_cut_short_is_dropped_and_counted(tmp_path: Path) -> None:
    members = [(f"k{index}.{ext}", bytes([index])) for index in range(4) for ext in ("jpg", "cls")]
    whole = tar_bytes(members)
    cut = tmp_path / "cut.tar"
    with tarfile.open(fileobj=io.BytesIO(whole)) as tar:
        cut.write_bytes(whole[:tar.getmember("k2.cls").offset_data - 1])  # in k2.cls's header
    (tmp_path / "next.tar").write_bytes(tar_bytes([("k2.jpg", b"x"), ("k2.cls", b"y")]))
    urls = [str(cut), str(tmp_path / "next.tar")]
    tar = IterableWrapper(urls).open_files(mode="b").load_from_tar(on_error="skip")
    grouped = tar.webdataset(on_error="skip")
    with pytest.warns(SkippedSampleWarning, match="cut.tar"):
        samples = list(grouped)
    # k2 of the cut archive had its jpg only: dropped; k2 of the next archive (same key) is whole
    assert [(s["__key__"], s["__url__"]) for s in samples] == [("k0", urls[0]), ("k1", urls[0]), ("k2", urls[1])]
    assert grouped.failure_counts() == FailureCounts(samples=1)
    assert tar.failure_counts() == FailureCounts(skipped=1, files=1)


def _interleaved_shard(path: Path) -> str:
    """A mis-packed shard: sample a's members split by sample b's (a.jpg, b.jpg, a.cls, b.cls)."""
    path.write_bytes(tar_bytes([("a.jpg", b"ja"), ("b.jpg", b"jb"), ("a.cls", b"0"), ("b.cls", b"1")]))
    return str(path)


def test_a_key_that_comes_back_after_another_keys_members_is_an_error(tmp_path: Path) -> None:
    url = _interleaved_shard(tmp_path / "mixed.tar")
    run = iter(IterableWrapper([url]).open_files(mode="b").load_from_tar().webdataset())
    first = next(run)  # a.jpg alone: nothing has shown yet that the shard is mis-packed
    assert first == {"__key__": "a", "__url__": url, "jpg": b"ja"}
    with pytest.raises(SourceError, match=r"key 'a' of archive '.*mixed\.tar' comes back") as caught:
        next(run)
    run.close()  # the error leaves the run open, as any error raised by a later stage does
    assert isinstance(caught.value, ArchiveError) and caught.value.url == url and caught.value.member == "a"


def test_a_returning_key_is_skipped_and_counted_under_on_error_skip(tmp_path: Path) -> None:
    url = _interleaved_shard(tmp_path / "mixed.tar")
    grouped = IterableWrapper([url]).open_files(mode="b").load_from_tar().webdataset(on_error="skip")
    with pytest.warns(SkippedSampleWarning, match="comes back after another key's members"):
        samples = list(grouped)
    # a.jpg and b.jpg went out before the shard showed it was mis-packed; the returning members
    # (a.cls, then b.cls) are refused, never yielded as samples of their own
    assert [sorted(s) for s in samples] == [["__key__", "__url__", "jpg"]] * 2
    assert grouped.failure_counts() == FailureCounts(skipped=2, samples=2)
    budgeted = IterableWrapper([url]).open_files(mode="b").load_from_tar().webdataset(on_error="skip", max_failures=1)
    run = iter(budgeted)
    with pytest.warns(SkippedSampleWarning), pytest.raises(FailureBudgetExceeded, match="key 'b'"):
        list(run)
    run.close()


def test_the_same_shard_twice_in_a_row_is_two_readings_not_a_returning_key(tmp_path: Path) -> None:
    (tmp_path / "s.tar").write_bytes(tar_bytes([("a.jpg", b"1"), ("a.cls", b"0"), ("b.jpg", b"2")]))
    urls = [str(tmp_path / "s.tar")] * 2
    samples = list(IterableWrapper(urls).open_files(mode="b").load_from_tar().webdataset())
    assert [s["__key__"] for s in samples] == ["a", "b", "a", "b"]
    # also when the members crossed a process boundary (their reading's outcome is not pickled)
    pickled = [pickle.loads(pickle.dumps(m)) for m in IterableWrapper(urls).open_files(mode="b").load_from_tar()]
    assert [s["__key__"] for s in IterableWrapper(pickled).webdataset()] == ["a", "b", "a", "b"]


def test_a_sample_split_across_two_shards_is_refused_not_yielded_as_two_halves(tmp_path: Path) -> None:
    # The last sample of one shard and the first of the next share a key and have different
    # files: one sample cut in two by a mis-packed writer. Both halves went out as samples.
    (tmp_path / "1.tar").write_bytes(tar_bytes([("a.jpg", b"1"), ("a.cls", b"0"), ("k.jpg", b"2")]))
    (tmp_path / "2.tar").write_bytes(tar_bytes([("k.cls", b"1"), ("z.jpg", b"3"), ("z.cls", b"2")]))
    urls = [str(tmp_path / "1.tar"), str(tmp_path / "2.tar")]
    run = iter(IterableWrapper(urls).open_files(mode="b").load_from_tar().webdataset())
    assert next(run)["__key__"] == "a"
    with pytest.raises(SourceError, match=r"key 'k' of archive '.*2\.tar' continues the sample of that key "
                                          r"which ended archive '.*1\.tar' \(its jpg there, 'cls' here\)"):
        next(run)
    run.close()
    grouped = IterableWrapper(urls).open_files(mode="b").load_from_tar().webdataset(on_error="skip")
    with pytest.warns(SkippedSampleWarning, match="continues the sample"):
        assert [s["__key__"] for s in grouped] == ["a", "z"]
    assert grouped.failure_counts() == FailureCounts(skipped=1, samples=2)  # both halves left out


def test_shards_that_number_their_keys_alike_give_a_sample_each(tmp_path: Path) -> None:
    # The same key, with the same files, at the end of one shard and the start of the next:
    # two samples (keys reused from shard to shard), not one split.
    (tmp_path / "1.tar").write_bytes(tar_bytes([("0.jpg", b"1"), ("0.cls", b"0")]))
    (tmp_path / "2.tar").write_bytes(tar_bytes([("0.jpg", b"2"), ("0.cls", b"1")]))
    urls = [str(tmp_path / "1.tar"), str(tmp_path / "2.tar")]
    samples = list(IterableWrapper(urls).open_files(mode="b").load_from_tar().webdataset())
    assert [(s["jpg"], s["cls"]) for s in samples] == [(b"1", b"0"), (b"2", b"1")]
