"""Local files as pipes: FileLister (masks, recursion, several roots), FileOpener (text and bytes),
FileReader (map-style, through a sampler in the loader), shard URL expansion, and remote URLs
without the remote extra."""

from __future__ import annotations

import inspect
import io
import os
import re
import sys
import threading
from pathlib import Path
from typing import Any

import pytest
import torch.utils.data.datapipes.iter as theirs_iter
from sources_for_tests import write_shards

import pipeload
import pipeload.datapipes.iter as ours_iter
from pipeload.datapipes.iter import FileLister, IterableWrapper
from pipeload.datapipes.map import FileReader
from pipeload.datapipes.sources import SourceChangedError, expand_urls, open_stream

pytestmark = [pytest.mark.usefixtures("leak_guard"), pytest.mark.timeout(60)]


@pytest.fixture
def tree(tmp_path: Path) -> Path:
    (tmp_path / "sub" / "deeper").mkdir(parents=True)
    for name in ("a.txt", "b.tar", "sub/c.txt", "sub/deeper/d.txt"):
        (tmp_path / name).write_text(f"contents of {name}\nsecond line\n")
    return tmp_path


def test_file_lister_masks_recursion_and_several_roots(tree: Path) -> None:
    assert list(FileLister(str(tree))) == [str(tree / "a.txt"), str(tree / "b.tar")]
    assert list(FileLister(str(tree), "*.txt", recursive=True)) == [
        str(tree / name) for name in ("a.txt", "sub/c.txt", "sub/deeper/d.txt")]
    assert list(FileLister(str(tree), ["*.tar", "c.*"], recursive=True)) == [str(tree / "b.tar"), str(tree / "sub/c.txt")]
    roots = IterableWrapper([str(tree / "sub"), str(tree / "a.txt")])
    assert list(roots.list_files("*.txt")) == [str(tree / "sub/c.txt"), str(tree / "a.txt")]
    assert list(FileLister(f"file://{tree}", "*.tar")) == [str(tree / "b.tar")]


def test_file_lister_relative_roots_and_abspath(tree: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.chdir(tree)
    assert list(FileLister("sub", "*.txt")) == ["sub/c.txt"]
    assert list(FileLister("sub", "*.txt", abspath=True)) == [str(tree / "sub/c.txt")]


def test_file_lister_missing_root_is_named(tmp_path: Path) -> None:
    with pytest.raises(FileNotFoundError, match="nowhere"):
        list(FileLister(str(tmp_path / "nowhere")))


def _signature(cls: type) -> list[tuple[str, Any, Any]]:
    return [(p.name, p.kind, p.default) for p in inspect.signature(cls.__init__).parameters.values()]


@pytest.mark.parametrize("name", ["FileLister", "FileOpener", "StreamReader"])
def test_torchs_arguments_come_first_and_ours_are_keyword_only(name: str) -> None:
    theirs, ours = _signature(getattr(theirs_iter, name)), _signature(getattr(ours_iter, name))
    assert ours[:len(theirs)] == theirs
    assert all(kind is inspect.Parameter.KEYWORD_ONLY for _, kind, _ in ours[len(theirs):])


@pytest.mark.parametrize("kwargs", [
    {}, {"recursive": True}, {"masks": "*.txt", "recursive": True}, {"masks": ["*.tar", "c.*"]},
    {"non_deterministic": True, "recursive": True}, {"length": 3},
])
def test_file_lister_lists_what_torchs_lists(tree: Path, kwargs: dict[str, Any]) -> None:
    listed = [list(module.FileLister(str(tree), **kwargs)) for module in (theirs_iter, ours_iter)]
    if kwargs.get("non_deterministic"):
        listed = [sorted(paths) for paths in listed]  # torch's order is then the file system's
    assert listed[1] == listed[0]


@pytest.mark.parametrize("build", [
    lambda m, root: m.FileLister(root),
    lambda m, root: m.IterableWrapper([root]).open_files(),  # the source has a length
    lambda m, root: m.FileLister(root).open_files(mode="b"),
    lambda m, root: m.IterableWrapper([(root, io.BytesIO(b"x"))]).read_from_stream(),
    lambda m, root: m.FileLister(root, length=2),
    lambda m, root: m.FileLister(root).open_files(length=5),
])
def test_lengths_as_torchs(tree: Path, build: Any) -> None:
    lengths = []
    for module in (theirs_iter, ours_iter):
        try:
            lengths.append(len(build(module, str(tree))))
        except TypeError:
            lengths.append("TypeError")
    assert lengths[1] == lengths[0]


def test_file_opener_text_and_bytes(tree: Path) -> None:
    paths = IterableWrapper([str(tree / "a.txt")])
    ((path, stream),) = list(paths.open_files())
    with stream:
        assert path == str(tree / "a.txt") and stream.readline() == "contents of a.txt\n"
    ((_, stream),) = list(paths.open_files(mode="b"))
    with stream:
        assert stream.read(8) == b"contents"
    with pytest.raises(ValueError, match="Invalid mode"):
        paths.open_files(mode="w")
    with pytest.raises(ValueError, match="encoding"):
        paths.open_files(mode="b", encoding="utf-8")
    assert len(paths.open_files(length=1)) == 1


def test_stream_reader_reads_every_file_in_chunks_and_closes_it(tree: Path) -> None:
    opened = FileLister(str(tree), recursive=True).open_files(mode="b")
    pieces = list(opened.read_from_stream(chunk=5))
    assert all(len(data) <= 5 for _, data in pieces)
    joined: dict[str, bytes] = {}
    for path, data in pieces:
        joined[path] = joined.get(path, b"") + data
    assert joined == {path: Path(path).read_bytes() for path in FileLister(str(tree), recursive=True)}
    whole = list(opened.read_from_stream())  # chunk=None: each file in one piece
    assert [data for _, data in whole] == [Path(path).read_bytes() for path, _ in whole]


def test_stream_reader_closes_the_stream_in_hand_when_the_run_is_closed(tree: Path) -> None:
    stream = open(tree / "a.txt", "rb")  # noqa: SIM115  (the pipe owns it)
    run = iter(IterableWrapper([("a", stream)], deepcopy=False).read_from_stream(chunk=4))
    assert next(run) == ("a", b"cont")
    run.close()
    assert stream.closed


@pytest.mark.parametrize("chunk", [0, -1, 2.5, True])
def test_stream_reader_refuses_a_chunk_that_is_not_a_positive_integer(chunk: object) -> None:
    with pytest.raises(ValueError, match=f"chunk=.*{chunk!r}"):
        IterableWrapper([]).read_from_stream(chunk=chunk)  # type: ignore[arg-type]


def test_file_reader_is_a_map_style_source_the_loader_samples(tree: Path) -> None:
    paths = [str(p) for p in sorted(tree.rglob("*.txt"))]
    reader = FileReader(paths)
    assert len(reader) == 3 and reader[1] == (paths[1], Path(paths[1]).read_bytes())
    assert FileReader(paths, mode="r")[0][1].startswith("contents of")
    lengths = pipeload.DataLoader(reader.map(_size), batch_size=None, num_workers=2)
    assert sorted(lengths) == sorted(Path(p).stat().st_size for p in paths)


def _size(item: tuple[str, bytes]) -> int:
    return len(item[1])


def test_shard_urls_from_lists_brace_ranges_and_globs(tmp_path: Path) -> None:
    paths = [str(p) for p in write_shards(tmp_path, 3, 1)]
    assert expand_urls(f"{tmp_path}/shard-*.tar") == paths
    assert expand_urls(f"{tmp_path}/shard-{{0000..0002}}.tar") == paths
    assert expand_urls("s3://b/x-{8..10}.tar") == ["s3://b/x-8.tar", "s3://b/x-9.tar", "s3://b/x-10.tar"]
    assert expand_urls(["http://h/a.tar", "http://h/b.tar"]) == ["http://h/a.tar", "http://h/b.tar"]
    with pytest.raises(ValueError, match="no shard matches"):
        expand_urls(f"{tmp_path}/nothing-*.tar")


def test_brace_lists_expand_as_webdatasets_urls_do() -> None:
    assert expand_urls("s3://b/{train,val}-{0..1}.tar") == [
        "s3://b/train-0.tar", "s3://b/train-1.tar", "s3://b/val-0.tar", "s3://b/val-1.tar"]
    assert expand_urls("http://h/{a}/x-{08..10}.tar") == [
        "http://h/{a}/x-08.tar", "http://h/{a}/x-09.tar", "http://h/{a}/x-10.tar"]  # {a}: no choice, kept


def test_a_remote_url_without_fsspec_names_the_extra(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setitem(sys.modules, "fsspec", None)
    with pytest.raises(ImportError, match=r"pipeload\[remote\]") as raised:
        open_stream("s3://bucket/shard.tar")
    assert "s3://bucket/shard.tar" in str(raised.value)
    with pytest.raises(ImportError, match=r"pipeload\[remote\]"):
        list(FileLister("http://example.invalid/shards", "*.tar"))


def test_a_checkpointed_listing_resumes_where_it_stood(tmp_path: Path) -> None:
    for name in ("b.txt", "c.txt", "d.txt"):
        (tmp_path / name).write_text(name)
    iterator = iter(FileLister(str(tmp_path), "*.txt"))
    head = [next(iterator) for _ in range(2)]
    state = iterator.state_dict()
    (tmp_path / "e.txt").write_text("e")  # added after the paths handed out: the listing goes on
    resumed = iter(FileLister(str(tmp_path), "*.txt"))
    resumed.load_state_dict(state)
    assert head + list(resumed) == [str(tmp_path / n) for n in ("b.txt", "c.txt", "d.txt", "e.txt")]
    previous_form = iter(FileLister(str(tmp_path), "*.txt"))  # a count alone still loads
    previous_form.load_state_dict({**state, "own": 2})
    assert list(previous_form) == [str(tmp_path / n) for n in ("d.txt", "e.txt")]


@pytest.mark.parametrize("change", ["added before", "removed before"])
def test_a_listing_changed_before_the_checkpoints_place_is_refused_not_skipped_by_count(
        tmp_path: Path, change: str) -> None:
    # The checkpoint kept a count: a file added before it made a path handed out come again
    # (c.txt twice, a.txt never), one removed made a path never handed out be skipped (d.txt).
    for name in ("b.txt", "c.txt", "d.txt"):
        (tmp_path / name).write_text(name)
    iterator = iter(FileLister(str(tmp_path), "*.txt"))
    [next(iterator) for _ in range(2)]
    state = iterator.state_dict()
    if change == "added before":
        (tmp_path / "a.txt").write_text("a")
    else:
        (tmp_path / "b.txt").unlink()
    resumed = iter(FileLister(str(tmp_path), "*.txt"))
    resumed.load_state_dict(state)
    with pytest.raises(SourceChangedError, match=r"the listing of .* changed since the checkpoint was "
                                                 r"taken: its path 2 was '.*c\.txt' and it is now"):
        next(resumed)


@pytest.mark.parametrize(("own", "named"), [
    ([2, None], "own.1 should be the last path handed out (text), None when none was"),
    ([0, "x.txt"], "own.1 should be the last path handed out"),
    ([2, 5], "own.1 should be the last path handed out"),
    (["2", "x"], "own.0 should be an int >= 0"),
    ([2], "own should be [paths of the root handed out, the last of them (None when none)]"),
])
def test_a_damaged_listing_checkpoint_is_refused_by_name(tmp_path: Path, own: Any, named: str) -> None:
    (tmp_path / "a.txt").write_text("a")
    iterator = iter(FileLister(str(tmp_path), "*.txt"))
    next(iterator)
    state = iterator.state_dict()
    with pytest.raises(pipeload.IncompatibleStateError, match=re.escape(named)):
        iter(FileLister(str(tmp_path), "*.txt")).load_state_dict({**state, "own": own})


@pytest.mark.parametrize("change", ["rewritten", "cut short", "rewritten, time set back"])
def test_a_local_file_changed_while_read_in_pieces_is_never_spliced(tmp_path: Path, change: str) -> None:
    path = tmp_path / "big.bin"
    path.write_bytes(b"A" * (1 << 20))
    before = path.stat()
    run = iter(FileLister(str(tmp_path)).open_files(mode="b").read_from_stream(chunk=64 << 10))
    pieces = [next(run)[1]]
    if change == "cut short":
        os.truncate(path, 1000)
    else:
        with open(path, "r+b") as rewrite:
            rewrite.write(b"B" * (1 << 20))
        if change == "rewritten, time set back":
            os.utime(path, ns=(before.st_atime_ns, before.st_mtime_ns))
    with pytest.raises(SourceChangedError, match=rf"{re.escape(repr(str(path)))} changed while it was read"):
        pieces.extend(data for _, data in run)
    run.close()
    assert b"".join(pieces) == b"A" * len(b"".join(pieces))


def test_a_file_replaced_by_a_rename_while_read_is_read_whole_from_the_version_opened(tmp_path: Path) -> None:
    path, replacement = tmp_path / "big.bin", tmp_path.parent / f"{tmp_path.name}-new.bin"
    path.write_bytes(b"A" * (1 << 20))
    replacement.write_bytes(b"B" * (1 << 20))
    run = iter(FileLister(str(tmp_path)).open_files(mode="b").read_from_stream(chunk=64 << 10))
    pieces = [next(run)[1]]
    os.replace(replacement, path)
    pieces.extend(data for _, data in run)
    assert b"".join(pieces) == b"A" * (1 << 20)


def test_file_reader_never_hands_out_a_file_rewritten_while_it_was_read(tmp_path: Path) -> None:
    # FileReader read without the check the other sources make after a read: a file rewritten in
    # place while it was read came back whole-length, half old bytes and half new, silently.
    path = tmp_path / "big.bin"
    versions = [bytes([65 + k]) * (16 << 20) for k in range(2)]
    path.write_bytes(versions[0])
    reader = FileReader([str(path)])
    done = threading.Event()
    writes_begun = [0]

    def rewrite_until_done() -> None:
        # In 64 KiB writes, as a regenerating job writes: a write already under way when the
        # reader takes the file's times is seen only by the times of the writes after it (the
        # kernel stamps a write as it begins), which a rewrite of more than one write always has.
        turn, piece = 0, 64 << 10
        while not done.is_set():
            turn += 1
            with open(path, "r+b") as file:
                for start in range(0, len(versions[0]), piece):
                    writes_begun[0] += 1
                    file.write(versions[turn % 2][start:start + piece])
                    file.flush()
                    os.utime(file.fileno(), ns=(turn, start + 1))  # each write a time of its own

    writer = threading.Thread(target=rewrite_until_done)
    writer.start()
    outcomes = []
    try:
        while "refused" not in outcomes and len(outcomes) < 20:
            writes_before = writes_begun[0]
            try:
                _, data = reader[0]
            except SourceChangedError as error:
                assert repr(str(path)) in str(error)
                outcomes.append("refused")
                continue
            if data in versions:
                outcomes.append("whole")
            else:
                # Read between two writes of a rewrite (the writer thread had no CPU meanwhile):
                # the file held that mix, and no reader can know it is half written.
                assert writes_begun[0] == writes_before, "two versions spliced by writes during the read"
                outcomes.append("between writes")
    finally:
        done.set()
        writer.join()
    assert "refused" in outcomes, outcomes


@pytest.mark.parametrize("arguments, message", [
    ({"paths": "/data/a.txt"}, r"FileReader: paths must be a list of paths or URLs, got one path, "
                                r"paths='/data/a.txt' \(give \['/data/a.txt'\]\)"),
    ({"paths": 5}, r"FileReader: paths must be a list of paths or URLs, got paths=5 \(int\)"),
    ({"paths": ["a", 3]}, r"FileReader: paths must be a list of paths or URLs, got paths\[1\]=3 \(int\)"),
    ({"paths": ["a"], "mode": "b", "encoding": "utf-8"},
     r"binary mode doesn't take an encoding argument \(FileReader got mode='b', encoding='utf-8'\)"),
    ({"paths": ["a"], "storage_options": 5},
     r"FileReader: storage_options must be a mapping \(fsspec's options\) or None, got storage_options=5"),
])
def test_file_reader_refuses_bad_arguments_naming_them(arguments: dict[str, Any], message: str) -> None:
    with pytest.raises((TypeError, ValueError), match=message):
        FileReader(**arguments)


def test_file_opener_refuses_storage_options_that_are_no_mapping() -> None:
    with pytest.raises(TypeError, match=r"FileOpener: storage_options must be a mapping .* got storage_options=5"):
        IterableWrapper(["a"]).open_files(mode="b", storage_options=5)
