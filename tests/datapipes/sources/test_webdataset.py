"""webdataset: members grouped into samples by key as WebDataset groups them; duplicates refused or
skipped; the grouping survives NotAvailable from upstream."""

from __future__ import annotations

import io
import tarfile
from pathlib import Path

import pytest
from sources_for_tests import Gate, GatedPipe, tar_bytes

from pipeload.datapipes import NotAvailable
from pipeload.datapipes.iter import IterableWrapper
from pipeload.datapipes.sources import ArchiveMember, FailureCounts, SkippedSampleWarning, split_key


# every stream opened is closed when its archive ends, fails or is dropped
pytestmark = pytest.mark.usefixtures("leak_guard")

def test_keys_and_extensions_follow_webdatasets_convention() -> None:
    assert split_key("a/b/000123.seg.png") == ("a/b/000123", "seg.png")
    assert split_key("x.y/abc.JPG") == ("x.y/abc", "JPG")
    assert split_key("README") is None


def test_consecutive_members_of_one_key_make_one_sample(tmp_path: Path) -> None:
    members = [("d/k1.jpg", b"j1"), ("d/k1.CLS", b"1"), ("d/k1.seg.png", b"p1"), ("README", b"x"),
               ("d/k2.jpg", b"j2"), ("d/k2.cls", b"2")]
    (tmp_path / "a.tar").write_bytes(tar_bytes(members))
    (tmp_path / "b.tar").write_bytes(tar_bytes([("d/k2.jpg", b"j3")]))  # same key, next archive
    urls = [str(tmp_path / "a.tar"), str(tmp_path / "b.tar")]
    samples = list(IterableWrapper(urls).open_files(mode="b").load_from_tar().webdataset())
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
    with pytest.raises(ValueError, match="'a' of 'u' has two files with extension 'jpg'"):
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
