"""load_from_tar over real archives written here: every compression, in order, and broken archives
(truncated in a member, at a member boundary, in a header; corrupt headers; garbage) named by
archive and member, raised or skipped by the on_error policy."""

from __future__ import annotations

import gzip
import io
import os
import re
import shutil
import sys
import tarfile
import warnings
from pathlib import Path
from collections.abc import Iterator
from typing import Any

import pytest
from sources_for_tests import compress, sample_files, tar_bytes, write_shards

import pipeload
from pipeload.datapipes.iter import FileLister, IterableWrapper
from pipeload.datapipes.sources import (
    ArchiveError,
    ArchiveMember,
    FailureBudgetExceeded,
    FailureCounts,
    LinkLeftOutWarning,
    SkippedSampleWarning,
    SourceChangedError,
    failure_counts,
)

# every stream opened is closed when its archive ends, fails or is dropped
pytestmark = pytest.mark.usefixtures("leak_guard")

MEMBERS = [m for index in range(4) for m in sample_files(0, index)]


def members_of(*paths: Path, **policy: object) -> list[tuple[str, bytes]]:
    pipe = IterableWrapper([str(p) for p in paths]).open_files(mode="b").load_from_tar(**policy)
    return list(pipe)


@pytest.mark.parametrize("compression", ["", "gz", "bz2", "xz", "zst"])
def test_every_member_in_archive_order_whatever_the_compression(tmp_path: Path, compression: str) -> None:
    path = tmp_path / ("a.tar" + (f".{compression}" if compression else ""))
    path.write_bytes(compress(tar_bytes(MEMBERS), compression))
    got = members_of(path)
    assert [(p, data) for p, data in got] == [(f"{path}/{name}", data) for name, data in MEMBERS]
    assert all(isinstance(m, ArchiveMember) and m.archive == str(path) for m in got)


def test_a_member_larger_than_one_read_comes_whole(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    from pipeload.datapipes.sources import _tar_stream

    monkeypatch.setattr(_tar_stream, "_MAX_READ_BYTES", 100)  # reads are bounded; members are not
    big = bytes(range(256)) * 20
    path = tmp_path / "big.tar.gz"
    path.write_bytes(compress(tar_bytes([("big.bin", big), *MEMBERS[:2]]), "gz"))
    assert [(m.name, m[1]) for m in members_of(path)] == [("big.bin", big), *MEMBERS[:2]]


def test_directories_and_links_out_of_the_archive_are_left_out_and_members_pickle(tmp_path: Path) -> None:
    import io
    import pickle

    buffer = io.BytesIO()
    with tarfile.open(fileobj=buffer, mode="w") as tar:
        directory = tarfile.TarInfo("dir")
        directory.type = tarfile.DIRTYPE
        tar.addfile(directory)
        link = tarfile.TarInfo("dir/link")
        link.type = tarfile.SYMTYPE
        link.linkname = "x"
        tar.addfile(link)
        info = tarfile.TarInfo("dir/a.txt")
        info.size = 2
        tar.addfile(info, io.BytesIO(b"hi"))
    (tmp_path / "d.tar").write_bytes(buffer.getvalue())
    with pytest.warns(LinkLeftOutWarning, match="'dir/link' is a symbolic link to 'dir/x', whose data is not in"):
        (member,) = members_of(tmp_path / "d.tar")
    assert member.name == "dir/a.txt" and member[1] == b"hi"
    copy = pickle.loads(pickle.dumps(member))
    assert copy == member and copy.archive == member.archive and copy.name == "dir/a.txt"


def test_a_hard_linked_member_comes_with_its_targets_data(tmp_path: Path) -> None:
    # tar (and tarfile.add) store a second name of one file as a hard link: left out, the
    # sample came without that member, and nothing said so.
    import io

    label = tmp_path / "label.cls"
    label.write_bytes(b"7")
    os.link(label, tmp_path / "second.cls")
    with tarfile.open(tmp_path / "s.tar", "w") as tar:
        tar.add(label, "a.cls")
        tar.add(tmp_path / "second.cls", "b.cls")  # the same inode: stored as a link to a.cls
        assert tar.getmember("b.cls").islnk()
        info = tarfile.TarInfo("c.cls")
        info.type, info.linkname = tarfile.SYMTYPE, "a.cls"
        tar.addfile(info)
    assert [(m.name, m[1]) for m in members_of(tmp_path / "s.tar")] == [
        ("a.cls", b"7"), ("b.cls", b"7"), ("c.cls", b"7")]
    big = io.BytesIO()
    with tarfile.open(fileobj=big, mode="w") as tar:
        info = tarfile.TarInfo("a.bin")
        info.size = 1 << 20
        tar.addfile(info, io.BytesIO(bytes(1 << 20)))
        link = tarfile.TarInfo("b.bin")
        link.type, link.linkname = tarfile.LNKTYPE, "a.bin"
        tar.addfile(link)
    (tmp_path / "big.tar").write_bytes(big.getvalue())
    # over what is kept for links: read again where it lies in a local archive...
    assert [(m.name, len(m[1])) for m in members_of(tmp_path / "big.tar")] == [("a.bin", 1 << 20),
                                                                              ("b.bin", 1 << 20)]
    # ...and left out, said, where the stream cannot be read again
    (tmp_path / "big.tar.gz").write_bytes(gzip.compress(big.getvalue()))
    with pytest.warns(LinkLeftOutWarning, match="'b.bin' is a hard link to 'a.bin', whose data is over"):
        assert [m.name for m in members_of(tmp_path / "big.tar.gz")] == ["a.bin"]


def _archive(*infos: tuple[tarfile.TarInfo, bytes], tar_format: int = tarfile.USTAR_FORMAT) -> bytes:
    buffer = io.BytesIO()
    with tarfile.open(fileobj=buffer, mode="w", format=tar_format) as archive:
        for info, data in infos:
            info.size = len(data)
            archive.addfile(info, io.BytesIO(data))
    return buffer.getvalue()


def _info(name: str, kind: bytes = tarfile.REGTYPE, **pax: str) -> tarfile.TarInfo:
    info = tarfile.TarInfo(name)
    info.type, info.pax_headers = kind, pax
    return info


def test_a_member_of_a_type_no_writer_here_makes_is_read_as_a_regular_file(tmp_path: Path) -> None:
    # POSIX, tar and tarfile read an unknown type as a regular file; it was dropped, silently,
    # and the sample came without that field.
    path = tmp_path / "a.tar"
    path.write_bytes(_archive((_info("k0.jpg"), b"JJ"), (_info("k0.cls", b"A"), b"7"),
                              (_info("k0.dir", tarfile.DIRTYPE), b""), (_info("k0.fifo", tarfile.FIFOTYPE), b"")))
    assert [(m.name, m[1]) for m in members_of(path)] == [("k0.jpg", b"JJ"), ("k0.cls", b"7")]
    assert [m.name for m in tarfile.open(path) if m.isfile() or m.type not in tarfile.SUPPORTED_TYPES] == ["k0.jpg", "k0.cls"]


@pytest.mark.parametrize("record", ["GNU.sparse.size", "GNU.sparse.map", "GNU.sparse.major"])
def test_a_sparse_member_in_pax_format_is_refused_by_name(tmp_path: Path, record: str) -> None:
    # tar --sparse --format=pax: the data is the file's non-hole parts (its map in front, from
    # format 1.0 on), which were handed out as the file's bytes.
    sparse = _info("GNUSparseFile.0/k0.bin", **{record: "1", "GNU.sparse.name": "k0.bin"})
    path = tmp_path / "a.tar"
    path.write_bytes(_archive((_info("k0.cls"), b"7"), (sparse, b"packed"), tar_format=tarfile.PAX_FORMAT))
    with pytest.raises(ArchiveError, match=r"TarFormatError: member 'k0\.bin' is a GNU sparse file \(pax format\), "
                                           r"which is not supported"):
        members_of(path)


@pytest.mark.parametrize("compression", ["", "gz"])
def test_a_symbolic_link_beside_its_target_under_dot_slash_names_comes_with_its_data(
        tmp_path: Path, compression: str) -> None:
    # `tar -C dir -cf x.tar .` names members ./a.txt; a link ./link -> a.txt was left out, its
    # target "not in this archive".
    link = _info("./link", tarfile.SYMTYPE)
    link.linkname = "a.txt"
    path = tmp_path / ("a.tar" + (f".{compression}" if compression else ""))
    path.write_bytes(compress(_archive((_info("./a.txt"), b"A"), (link, b"")), compression))
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert [(m.name, m[1]) for m in members_of(path)] == [("./a.txt", b"A"), ("./link", b"A")]


def test_a_multi_volume_continuation_is_refused_by_name(tmp_path: Path) -> None:
    path = tmp_path / "a.tar"
    path.write_bytes(_archive((_info("k0.bin", b"M"), b"the rest of a file")))
    with pytest.raises(ArchiveError, match="member 'k0.bin' continues a file from another volume"):
        members_of(path)


@pytest.mark.parametrize("name", ["BZh91AY.jpg", "BZh91AY&SY_000.jpg"])
def test_a_plain_archive_whose_first_name_begins_as_bzip2_data_is_read(tmp_path: Path, name: str) -> None:
    # A tar's first bytes are its first member's name, and bzip2's magic, even with its block
    # magic after it ("1AY&SY"), is printable.
    path = tmp_path / "a.tar"
    path.write_bytes(_archive((_info(name), b"J"), (_info("k.cls"), b"3")))
    assert [(m.name, m[1]) for m in members_of(path)] == [(name, b"J"), ("k.cls", b"3")]
    empty = tmp_path / "empty.tar.bz2"
    empty.write_bytes(compress(tar_bytes([]), "bz2"))
    assert members_of(empty) == []


def _in_records_of(data: bytes, record: int) -> bytes:
    """``data`` padded with zeros to whole records of ``record`` bytes (tar -b record/512)."""
    return data + bytes(-len(data) % record)


def test_archives_joined_end_to_end_are_read_on_as_tar_does_with_ignore_zeros(tmp_path: Path) -> None:
    # `cat a.tar b.tar`: the first archive's end-of-archive marker and padding, then the second
    # archive. Read only to the first marker, b.tar's members vanished without a word.
    (tmp_path / "joined.tar").write_bytes(tar_bytes(MEMBERS[:3]) + tar_bytes(MEMBERS[3:]))
    assert [(m.name, m[1]) for m in members_of(tmp_path / "joined.tar")] == MEMBERS


@pytest.mark.parametrize("compression", ["gz", "bz2", "xz"])
def test_compressed_archives_joined_end_to_end_are_read_on_and_a_damaged_second_is_an_error(
        tmp_path: Path, compression: str) -> None:
    # `cat a.tar.bz2 b.tar.bz2`: bz2's and lzma's own readers took a second stream whose first
    # byte was damaged for garbage after the data, and stopped: b's members vanished without a
    # word (stop 54's sources skeptic). gzip's raised.
    first, second = compress(tar_bytes(MEMBERS[:3]), compression), compress(tar_bytes(MEMBERS[3:]), compression)
    (tmp_path / f"joined.tar.{compression}").write_bytes(first + second + bytes(100))  # padding too
    assert [(m.name, m[1]) for m in members_of(tmp_path / f"joined.tar.{compression}")] == MEMBERS
    damaged = tmp_path / f"damaged.tar.{compression}"
    damaged.write_bytes(first + bytes([second[0] ^ 0x01]) + second[1:])
    with pytest.raises(ArchiveError, match=f"after member '{MEMBERS[2][0]}'"):
        members_of(damaged)


def _ending_with_the_marker_alone(data: bytes) -> bytes:
    """A tarfile archive as Go's and Rust's writers end one: the marker, no record padding."""
    end = len(data.rstrip(b"\0"))
    return data[:end + -end % 512 + 1024]


@pytest.mark.parametrize("joined", ["marker alone", "an empty archive between", "20 KiB records"])
def test_archives_joined_where_a_zeroed_stretch_could_be_are_refused(tmp_path: Path, joined: str) -> None:
    # Joined after one that ends with its marker alone, after an empty archive (10 KiB of
    # zeros), or padded to other records, the next header sits where a stretch zeroed on disk
    # would leave one: allowed, such holes read as joins and lost their members silently.
    first, second = tar_bytes(MEMBERS[:3]), tar_bytes(MEMBERS[3:])
    data = {"marker alone": _ending_with_the_marker_alone(first) + second,
            "an empty archive between": first + tar_bytes([]) + second,
            "20 KiB records": first + bytes(-len(first) % 20480) + second}[joined]
    (tmp_path / "joined.tar").write_bytes(data)
    with pytest.raises(ArchiveError, match="a stretch was zeroed"):
        members_of(tmp_path / "joined.tar")


def test_streams_are_closed_when_their_archive_ends(tmp_path: Path) -> None:
    (path,) = write_shards(tmp_path, 1, 2)
    opened = list(IterableWrapper([str(path)]).open_files(mode="b"))
    (_, stream), = opened
    list(IterableWrapper(opened, deepcopy=False).load_from_tar())
    assert stream.closed


def _broken_archives(tmp_path: Path) -> dict[str, tuple[Path, int, str]]:
    """name -> (path, members readable before the damage, what the error must say)."""
    whole = tar_bytes(MEMBERS)
    sizes = [512 + (len(data) + 511) // 512 * 512 for _, data in MEMBERS]
    second_header = sizes[0]
    cases = {
        # cut inside the 4th member's data (an image)
        "in a member": (whole[: sum(sizes[:3]) + 512 + 3], 3, "in member 's00_001.jpg'"),
        # cut exactly after the 3rd member: tarfile alone would end quietly here
        "at a member boundary": (whole[: sum(sizes[:3])], 3, "truncated"),
        "in a header": (whole[: sum(sizes[:3]) + 100], 3, "truncated"),
        "corrupt header": (whole[:second_header] + b"\x07" * 512 + whole[second_header + 512:], 1, "corrupt"),
        "garbage": (b"not a tar archive at all" * 50, 0, "at its first header"),
        "truncated gzip": (compress(whole, "gz")[: len(compress(whole, "gz")) // 2], None, "cannot read tar archive"),
        # a shard cut off while a 1 TiB member was written: its header promises more than exists
        "huge member cut off": (whole[: sum(sizes[:3])] + _header("huge.bin", 1 << 40) + bytes(1000), 3,
                                "in member 'huge.bin'"),
        # one header zeroed on disk reads as the end-of-archive marker: the members after it
        # vanished without a word (a lone zero block, as GNU tar warns)
        "zeroed header": (whole[:second_header] + bytes(512) + whole[second_header + 512:], 1,
                          "a header was zeroed"),
        # a stretch zeroed on disk (two members' headers and data; a 4 KiB page): it read as
        # the end of one archive and the start of another joined after it, and the members it
        # held vanished without a word (a skeptic's probe at stop 53)
        "zeroed members": (whole[:second_header] + bytes(sum(sizes[1:3])) + whole[second_header + sum(sizes[1:3]):],
                           1, "a stretch was zeroed"),
        "zeroed page": (whole[:4096] + bytes(4096) + whole[8192:], None, "a stretch was zeroed"),
        # a file preallocated and written only in part: zeros where the rest should be
        "zeroed tail": (whole[: sum(sizes[:3])] + bytes(17 << 20), 3, "MiB of zeros follow"),
    }
    written = {}
    for name, (data, readable, says) in cases.items():
        path = tmp_path / (name.replace(" ", "_") + ".tar")
        path.write_bytes(data)
        written[name] = (path, readable, says)
    return written


def _header(name: str, size: int) -> bytes:
    info = tarfile.TarInfo(name)
    info.size = size
    return info.tobuf(format=tarfile.GNU_FORMAT)  # GNU: sizes past 8 GiB in base-256


@pytest.mark.parametrize("case", ["in a member", "at a member boundary", "in a header", "corrupt header",
                                  "garbage", "truncated gzip", "huge member cut off", "zeroed header",
                                  "zeroed members", "zeroed page", "zeroed tail"])
def test_a_broken_archive_raises_naming_the_archive_and_where(tmp_path: Path, case: str) -> None:
    path, readable, says = _broken_archives(tmp_path)[case]
    pipe = IterableWrapper([str(path)]).open_files(mode="b").load_from_tar()
    it = iter(pipe)
    got = []
    with pytest.raises(ArchiveError) as raised:
        for member in it:
            got.append(member)
    assert str(path) in str(raised.value) and says in str(raised.value)
    assert raised.value.url == str(path)
    if readable is not None:
        assert [m.name for m in got] == [name for name, _ in MEMBERS[:readable]]
    assert failure_counts(pipe) == FailureCounts(skipped=0, raised=1)


def _with_long_names(tar_format: int) -> bytes:
    """Two members under a directory whose name takes 120 bytes (kept past the header: a GNU
    long-name record or a pax ``path``, which no checksum covers), the first 1000 bytes long."""
    buffer = io.BytesIO()
    with tarfile.open(fileobj=buffer, mode="w", format=tar_format) as archive:
        for name, size in (("k0.bin", 1000), ("k0.cls", 1)):
            info = tarfile.TarInfo("d" * 120 + "/" + name)
            info.size = size
            archive.addfile(info, io.BytesIO(b"7" * size))
    return buffer.getvalue()


def _replaced_once(data: bytes, old: bytes, new: bytes) -> bytes:
    assert data.count(old) >= 1 and len(old) == len(new)
    return data.replace(old, new, 1)


def _read_members(path: Path) -> list[tuple[str, int]]:
    return [(member.name, len(member[1])) for member in members_of(path)]


@pytest.mark.parametrize("damage", ["pax size", "pax record", "gnu long name start"])
def test_damage_to_the_names_and_sizes_kept_past_a_header_is_found(tmp_path: Path, damage: str) -> None:
    path = tmp_path / "shard.tar"
    if damage == "gnu long name start":
        # one bit of the long name's first 100 bytes, which the member's own header repeats
        data = _replaced_once(_with_long_names(tarfile.GNU_FORMAT), b"d" * 120 + b"/k0.bin", b"e" + b"d" * 119 + b"/k0.bin")
    else:
        pax = _with_long_names(tarfile.PAX_FORMAT)
        record = re.search(rb"\d+ path=d+/k0\.bin\n", pax).group()
        if damage == "pax size":  # a size record as long as the path record it replaces
            digits = len(record) - len(b"%d size=\n" % len(record))
            replacement = b"%d size=%s\n" % (len(record), b"0" * (digits - 4) + b"1008")
        else:  # a record whose length no longer reaches its end
            replacement = b"9" + record[1:]
        data = _replaced_once(pax, record, replacement)
    path.write_bytes(data)
    with pytest.raises(ArchiveError, match="corrupt"):
        _read_members(path)


@pytest.mark.parametrize("tar_format", [tarfile.GNU_FORMAT, tarfile.PAX_FORMAT])
def test_long_names_kept_past_a_header_read_as_written(tmp_path: Path, tar_format: int) -> None:
    path = tmp_path / "shard.tar"
    path.write_bytes(_with_long_names(tar_format))
    assert _read_members(path) == [("d" * 120 + "/k0.bin", 1000), ("d" * 120 + "/k0.cls", 1)]


@pytest.mark.timeout(60)
@pytest.mark.parametrize("worker_type", ["process", "thread"])
def test_a_broken_archive_in_a_worker_is_still_an_archive_error(tmp_path: Path, worker_type: str) -> None:
    # a worker's failure is rebuilt in the main process from its type and message alone
    paths = write_shards(tmp_path, 2, 3)
    paths[1].write_bytes(paths[1].read_bytes()[:1500])
    pipe = IterableWrapper([str(p) for p in paths]).sharding_filter().open_files(mode="b").load_from_tar()
    loader = pipeload.DataLoader(pipe, batch_size=None, num_workers=2, worker_type=worker_type)
    with pytest.raises(ArchiveError, match="shard-0001.tar' in member 's01_000.jpg'"):
        list(loader)


def test_a_compressed_archive_is_checked_to_its_checksum(tmp_path: Path) -> None:
    # gzip's stored (level 0) blocks carry bytes as they are: a flipped byte decompresses fine and
    # only the CRC-32 at the very end, past the tar's end-of-archive marker, tells
    whole = tar_bytes(MEMBERS)
    flipped = bytearray(gzip.compress(whole, compresslevel=0))
    flipped[flipped.index(MEMBERS[3][1][100:140]) + 10] ^= 0xFF
    path = tmp_path / "flipped.tar.gz"
    path.write_bytes(bytes(flipped))
    with pytest.raises(ArchiveError, match=r"flipped.tar.gz' after member .* CRC check failed"):
        members_of(path)
    cut = tmp_path / "cut-in-its-trailer.tar.gz"
    cut.write_bytes(gzip.compress(whole)[:-4])
    with pytest.raises(ArchiveError, match="cut-in-its-trailer.tar.gz' after member"):
        members_of(cut)


def test_a_zstd_archive_cut_inside_a_frame_is_truncated_not_short(tmp_path: Path) -> None:
    # zstandard's stream reader ends quietly inside a frame: cut inside the last frame's checksum
    # (every content byte there, the check gone) the shard read as whole; cut inside a frame's
    # data, as a shorter shard
    import zstandard

    whole = tar_bytes(MEMBERS)
    first = zstandard.ZstdCompressor(write_checksum=True).compress(whole[:2048])
    second = zstandard.ZstdCompressor(write_checksum=True).compress(whole[2048:])
    two_frames = tmp_path / "two-frames.tar.zst"
    two_frames.write_bytes(first + second)
    assert [(m.name, m[1]) for m in members_of(two_frames)] == MEMBERS  # frames one after another
    cases = {"cut-in-its-checksum": (first + second)[:-2], "cut-between-frames-data": first + second[:40]}
    for name, data in cases.items():
        path = tmp_path / f"{name}.tar.zst"
        path.write_bytes(data)
        with pytest.raises(ArchiveError, match=f"{name}.tar.zst'.*zstd data ends inside a frame"):
            members_of(path)


def _flipped_gzip(tmp_path: Path) -> Path:
    """A .tar.gz whose stored block has a flipped byte in member 3: it decompresses, and only the
    CRC-32 at the end of the stream tells."""
    flipped = bytearray(gzip.compress(tar_bytes(MEMBERS), compresslevel=0))
    flipped[flipped.index(MEMBERS[3][1][100:140]) + 10] ^= 0xFF
    path = tmp_path / "flipped.tar.gz"
    path.write_bytes(bytes(flipped))
    return path


def test_a_compressed_archive_held_until_checked_yields_nothing_of_a_bad_stream(tmp_path: Path) -> None:
    flipped = _flipped_gzip(tmp_path)
    good = tmp_path / "good.tar.gz"
    good.write_bytes(compress(tar_bytes(MEMBERS[:2]), "gz"))
    paths = [str(flipped), str(good)]
    held = IterableWrapper(paths).open_files(mode="b").load_from_tar(on_error="skip", hold_until_checked=True)
    with pytest.warns(SkippedSampleWarning, match="CRC check failed"):
        assert [(m.name, m[1]) for m in held] == MEMBERS[:2]  # the good archive's only
    assert held.failure_counts() == FailureCounts(skipped=1, files=1)
    streamed = IterableWrapper(paths).open_files(mode="b").load_from_tar(on_error="skip")
    with pytest.warns(SkippedSampleWarning, match=rf"its {len(MEMBERS)} members already delivered were "
                                                  "not yet checked.*hold_until_checked=True"):
        assert len(list(streamed)) == len(MEMBERS) + 2  # delivered, and flagged in the warning
    assert members_of(good, hold_until_checked=True) == members_of(good)


def test_a_held_archive_checkpoints_at_the_member_it_hands_out_next(tmp_path: Path) -> None:
    path = tmp_path / "a.tar.gz"
    path.write_bytes(compress(tar_bytes(MEMBERS), "gz"))
    def make() -> object:
        return IterableWrapper([str(path)]).open_files(mode="b").load_from_tar(hold_until_checked=True)

    iterator = iter(make())
    head = [next(iterator) for _ in range(5)]
    resumed = iter(make())
    resumed.load_state_dict(iterator.state_dict())
    assert [m[1] for m in head] + [m[1] for m in resumed] == [data for _, data in MEMBERS]


def test_bad_compressed_data_is_an_archive_error(tmp_path: Path) -> None:
    broken = bytearray(compress(tar_bytes(MEMBERS), "bz2"))
    broken[5] ^= 0xFF  # bzip2's block magic: "Invalid data stream", an OSError
    path = tmp_path / "broken.tar.bz2"
    path.write_bytes(bytes(broken))
    with pytest.raises(ArchiveError, match="broken.tar.bz2' at its first header"):
        members_of(path)


def test_skip_keeps_what_was_read_and_goes_on_with_the_next_archive(tmp_path: Path) -> None:
    broken = _broken_archives(tmp_path)
    good = tmp_path / "good.tar"
    good.write_bytes(tar_bytes(MEMBERS[:2]))
    paths = [broken["in a member"][0], good, broken["garbage"][0], good]
    pipe = IterableWrapper([str(p) for p in paths]).open_files(mode="b").load_from_tar(on_error="skip")
    with pytest.warns(SkippedSampleWarning, match="skipped the rest of the archive") as caught:
        got = [m.name for m in pipe]
    assert got == [n for n, _ in MEMBERS[:3]] + [n for n, _ in MEMBERS[:2]] * 2
    assert len(caught) == 2
    assert pipe.failure_counts() == FailureCounts(skipped=2, files=2) == failure_counts(pipe.map(len))


def test_a_callback_sees_the_error_and_where_and_the_budget_ends_the_run(tmp_path: Path) -> None:
    garbage = _broken_archives(tmp_path)["garbage"][0]
    seen = []
    pipe = IterableWrapper([str(garbage)] * 3).open_files(mode="b").load_from_tar(
        on_error=lambda error, where: seen.append((type(error), where.url, where.stage)), max_failures=2)
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # a callback replaces the warning
        with pytest.raises(FailureBudgetExceeded, match="max_failures=2") as raised:
            list(pipe)
    assert seen == [(ArchiveError, str(garbage), "load_from_tar")] * 2
    assert isinstance(raised.value.__cause__, ArchiveError)
    assert pipe.failure_counts() == FailureCounts(skipped=2, raised=1, files=2)


def test_missing_files_are_named_and_can_be_skipped(tmp_path: Path) -> None:
    good = tmp_path / "good.tar"
    good.write_bytes(tar_bytes(MEMBERS[:1]))
    missing = str(tmp_path / "missing.tar")
    with pytest.raises(FileNotFoundError, match="missing.tar"):
        members_of(Path(missing))
    opener = IterableWrapper([missing, str(good)]).open_files(mode="b", on_error="skip")
    with pytest.warns(SkippedSampleWarning, match="missing.tar"):
        assert [m.name for m in opener.load_from_tar()] == [MEMBERS[0][0]]
    assert opener.failure_counts().skipped == 1


def test_text_streams_are_refused_with_what_to_do(tmp_path: Path) -> None:
    (path,) = write_shards(tmp_path, 1, 1)
    with pytest.raises(TypeError, match="mode='b'"):
        list(FileLister(str(tmp_path), "*.tar").open_files().load_from_tar())


def test_zst_without_zstandard_names_the_extra(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    (path,) = write_shards(tmp_path, 1, 1, compression="zst")
    monkeypatch.setitem(sys.modules, "zstandard", None)
    with pytest.raises(ImportError, match=r"pipeload\[zstd\]"):
        members_of(path)


def test_bad_arguments_name_themselves() -> None:
    source = IterableWrapper([])
    with pytest.raises(ValueError, match="on_error"):
        source.load_from_tar(on_error="ignore")
    with pytest.raises(ValueError, match="max_failures"):
        source.load_from_tar(on_error="skip", max_failures=-1)
    with pytest.raises(ValueError, match="mode"):
        source.load_from_tar(mode="w")


@pytest.mark.parametrize("tar_format", [tarfile.USTAR_FORMAT, tarfile.GNU_FORMAT, tarfile.PAX_FORMAT])
def test_long_and_non_ascii_names_in_every_tar_format(tmp_path: Path, tar_format: int) -> None:
    import io

    names = ["d" * 60 + "/" + "n" * 80 + ".jpg", "short.cls"]
    if tar_format != tarfile.USTAR_FORMAT:  # ustar has no room for names past 255 bytes or UTF-8
        names += ["x" * 300 + ".txt", "dossier/été.json"]
    buffer = io.BytesIO()
    with tarfile.open(fileobj=buffer, mode="w", format=tar_format) as tar:
        for index, name in enumerate(names):
            info = tarfile.TarInfo(name)
            info.size = index + 1
            info.mtime = 1.5  # a float mtime makes pax writers add an extended header
            tar.addfile(info, io.BytesIO(bytes(index + 1)))
    (tmp_path / "names.tar").write_bytes(buffer.getvalue())
    got = members_of(tmp_path / "names.tar")
    assert [(m.name, m[1]) for m in got] == [(name, bytes(i + 1)) for i, name in enumerate(names)]


def _same_layout_other_bytes(path: Path) -> None:
    """``path`` rewritten as a shard regenerated in place: the same member names and sizes (so
    the same offsets), other bytes, written a second later."""
    before = path.stat()
    path.write_bytes(tar_bytes([(name, bytes(len(data))) for name, data in MEMBERS]))
    assert path.stat().st_size == before.st_size
    os.utime(path, ns=(before.st_atime_ns, before.st_mtime_ns + 1_000_000_000))


def _checkpoint_after(path: Path, members: int, **policy: object) -> tuple[list[bytes], dict]:
    iterator = iter(IterableWrapper([str(path)]).open_files(mode="b").load_from_tar(**policy))
    head = [next(iterator)[1] for _ in range(members)]
    state = iterator.state_dict()
    iterator.close()
    return head, state


@pytest.mark.parametrize("compression", ["", "gz"])
def test_a_run_resumed_after_a_links_target_still_gives_the_link_its_data(tmp_path: Path,
                                                                          compression: str) -> None:
    # Moving to the checkpoint reads the headers up to it: a link after it finds its target
    # (a small one kept; a large one read again, or read through in a compressed stream).
    import io

    buffer = io.BytesIO()
    with tarfile.open(fileobj=buffer, mode="w") as tar:
        large = 50_000 if compression else 200_000  # compressed: kept (it cannot be read again)
        for name, size in [("a.cls", 1), ("a.bin", large), ("b.jpg", 10)]:
            info = tarfile.TarInfo(name)
            info.size = size
            tar.addfile(info, io.BytesIO(bytes([len(name)]) * size))
        for name, target in [("b.cls", "a.cls"), ("b.bin", "a.bin")]:
            link = tarfile.TarInfo(name)
            link.type, link.linkname = tarfile.LNKTYPE, target
            tar.addfile(link)
    path = tmp_path / f"links.tar{'.gz' if compression else ''}"
    path.write_bytes(gzip.compress(buffer.getvalue()) if compression else buffer.getvalue())
    whole = [(m.name, m[1]) for m in members_of(path)]
    assert [name for name, _ in whole] == ["a.cls", "a.bin", "b.jpg", "b.cls", "b.bin"]
    for taken in range(1, 5):
        head, state = _checkpoint_after(path, taken)
        resumed = iter(IterableWrapper([str(path)]).open_files(mode="b").load_from_tar())
        resumed.load_state_dict(state)
        assert [(m.name, m[1]) for m in resumed] == whole[taken:], taken


def test_a_checkpoint_does_not_resume_in_an_archive_replaced_since(tmp_path: Path) -> None:
    # Resuming seeks to the byte the checkpoint recorded: in a regenerated shard with the same
    # layout that splices the new version's members to the old one's, without a word.
    path = tmp_path / "a.tar"
    path.write_bytes(tar_bytes(MEMBERS))
    head, state = _checkpoint_after(path, 5)
    _same_layout_other_bytes(path)
    resumed = iter(IterableWrapper([str(path)]).open_files(mode="b").load_from_tar())
    resumed.load_state_dict(state)
    with pytest.raises(SourceChangedError, match=rf"{re.escape(repr(str(path)))} changed since the "
                                                 r"checkpoint was taken \(its first and last 64 KiB"):
        next(resumed)
    resumed.close()


def test_an_archive_replaced_since_the_checkpoint_is_skipped_and_counted_under_skip(tmp_path: Path) -> None:
    path, other = tmp_path / "a.tar", tmp_path / "b.tar"
    path.write_bytes(tar_bytes(MEMBERS))
    other.write_bytes(tar_bytes(MEMBERS[:2]))
    pipe = IterableWrapper([str(path), str(other)]).open_files(mode="b").load_from_tar(on_error="skip")
    iterator = iter(pipe)
    [next(iterator) for _ in range(5)]
    state = iterator.state_dict()
    iterator.close()
    _same_layout_other_bytes(path)
    resumed = iter(pipe)
    resumed.load_state_dict(state)
    with pytest.warns(SkippedSampleWarning, match="changed since the checkpoint"):
        rest = [data for _, data in resumed]
    assert rest == [data for _, data in MEMBERS[:2]]  # only the next archive's
    assert pipe.failure_counts() == FailureCounts(skipped=1, files=1)


def test_an_unchanged_archive_resumes_and_a_state_without_its_version_still_loads(tmp_path: Path) -> None:
    path = tmp_path / "a.tar"
    path.write_bytes(tar_bytes(MEMBERS))
    head, state = _checkpoint_after(path, 5)
    offset, members, url, version = state["own"]
    assert url == str(path) and version["size"] == path.stat().st_size
    assert set(version) == {"size", "content"}  # not the modification time: see the next test
    for saved in (state, {**state, "own": [offset, members]}):  # the previous form: no check
        resumed = iter(IterableWrapper([str(path)]).open_files(mode="b").load_from_tar())
        resumed.load_state_dict(saved)
        assert head + [data for _, data in resumed] == [data for _, data in MEMBERS]


def test_a_copy_of_the_archive_with_another_modification_time_resumes(tmp_path: Path) -> None:
    # cp without -p, a fresh download, another machine: the same bytes, a new time.
    path = tmp_path / "a.tar"
    path.write_bytes(tar_bytes(MEMBERS))
    head, state = _checkpoint_after(path, 5)
    copy = tmp_path / "copied" / "a.tar"
    copy.parent.mkdir()
    shutil.copyfile(path, copy)
    os.utime(copy, ns=(path.stat().st_atime_ns, path.stat().st_mtime_ns + 5_000_000_000))
    resumed = iter(IterableWrapper([str(copy)]).open_files(mode="b").load_from_tar())
    resumed.load_state_dict(state)
    assert head + [data for _, data in resumed] == [data for _, data in MEMBERS]


@pytest.mark.parametrize(("url", "version", "named"), [
    (5, {}, "own.2 should be the archive's URL (text)"),
    (None, "size 9", "own.3 should be a dict or None"),
    (None, {"size": "9"}, "own.3.size should be an int >= 0"),
    (None, {"etag": 5}, "own.3.etag should be text"),
    (None, {"crc": 5}, "own.3.crc should be absent"),
])
def test_a_damaged_archive_version_in_a_checkpoint_is_refused_by_name(tmp_path: Path, url: object,
                                                                      version: object, named: str) -> None:
    path = tmp_path / "a.tar"
    path.write_bytes(tar_bytes(MEMBERS))
    _, state = _checkpoint_after(path, 5)
    resumed = iter(IterableWrapper([str(path)]).open_files(mode="b").load_from_tar())
    own = [*state["own"][:2], str(path) if url is None else url, version]
    with pytest.raises(pipeload.IncompatibleStateError, match=re.escape(named)):
        resumed.load_state_dict({**state, "own": own})
    resumed.close()


def test_a_checkpoint_does_not_resume_in_another_archive_than_its_own(tmp_path: Path) -> None:
    # Shards written together can have the same length and modification time (the clock's tick
    # is coarse): a list that changed before the archive (a shard added) replays the upstream to
    # another archive, which only its name tells apart. A dataset moved elsewhere still resumes.
    first, second = tmp_path / "a.tar", tmp_path / "b.tar"
    for path in (first, second):
        path.write_bytes(tar_bytes(MEMBERS))
    os.utime(second, ns=(first.stat().st_atime_ns, first.stat().st_mtime_ns))
    # A list of paths has its names checked at load; an upstream that is no list of paths
    # (here: an iterable of them) leaves it to the archive.
    states = {}
    for listing in (list, Listing):
        iterator = iter(IterableWrapper(listing([str(second)])).open_files(mode="b").load_from_tar())
        [next(iterator) for _ in range(5)]
        states[listing] = iterator.state_dict()
        iterator.close()
        resumed = iter(IterableWrapper(listing([str(first)])).open_files(mode="b").load_from_tar())
        if listing is list:
            with pytest.raises(pipeload.IncompatibleStateError, match="names_in_order differs"):
                resumed.load_state_dict(states[listing])
        else:
            resumed.load_state_dict(states[listing])
            with pytest.raises(SourceChangedError, match=r"checkpoint was taken \d+ bytes into '.*b\.tar'"):
                next(resumed)
        resumed.close()
    moved = tmp_path / "moved"
    moved.mkdir()
    os.rename(second, moved / "b.tar")  # the same file (a rename keeps its length and time)
    for listing, state in states.items():
        resumed = iter(IterableWrapper(listing([str(moved / "b.tar")])).open_files(mode="b").load_from_tar())
        resumed.load_state_dict(state)
        assert [data for _, data in resumed] == [data for _, data in MEMBERS[5:]]


class Listing:
    """An iterable of paths that is no list: its names are not recorded in a checkpoint."""

    def __init__(self, paths: list[str]) -> None:
        self.paths = paths

    def __iter__(self) -> Iterator[str]:
        return iter(self.paths)


@pytest.mark.parametrize("on_error", ["raise", "skip"])
def test_a_local_archive_rewritten_while_it_is_read_is_never_spliced(tmp_path: Path, on_error: str) -> None:
    # A local file is read through the OS: rewritten in place, its new bytes followed the old
    # ones already buffered, and the rest of the archive came from the new version unseen.
    old = [(f"k{index:04d}.bin", b"old-%04d" % index) for index in range(500)]
    path = tmp_path / "a.tar"
    path.write_bytes(tar_bytes(old))
    before = path.stat()
    pipe = IterableWrapper([str(path)]).open_files(mode="b").load_from_tar(on_error=on_error)
    iterator = iter(pipe)
    got = [next(iterator) for _ in range(3)]
    with open(path, "r+b") as rewrite:  # the same layout, other bytes, as a regenerating job would
        rewrite.write(tar_bytes([(name, data.replace(b"old", b"new")) for name, data in old]))
    os.utime(path, ns=(before.st_atime_ns, before.st_mtime_ns + 1_000_000_000))
    if on_error == "raise":
        with pytest.raises(SourceChangedError, match=rf"{re.escape(repr(str(path)))} changed while it "
                                                     r"was read \(its modification time"):
            got.extend(iterator)
    else:
        with pytest.warns(SkippedSampleWarning, match="changed while it was read"):
            got.extend(iterator)
        assert pipe.failure_counts().skipped == 1
    iterator.close()
    assert [(m.name, m[1]) for m in got] == old[:len(got)]  # the old version's, and only whole


def test_a_rewrite_whose_modification_time_was_set_back_is_never_spliced(tmp_path: Path) -> None:
    # `cp -p` or `rsync --inplace -t` onto the file: the same length and modification time, other
    # bytes; only the status-change time, which nobody can set back, tells.
    old = [(f"k{index:04d}.bin", b"old-%04d" % index) for index in range(500)]
    path = tmp_path / "a.tar"
    path.write_bytes(tar_bytes(old))
    before = path.stat()
    iterator = iter(IterableWrapper([str(path)]).open_files(mode="b").load_from_tar())
    got = [next(iterator) for _ in range(3)]
    with open(path, "r+b") as rewrite:
        rewrite.write(tar_bytes([(name, data.replace(b"old", b"new")) for name, data in old]))
    os.utime(path, ns=(before.st_atime_ns, before.st_mtime_ns))
    assert (path.stat().st_size, path.stat().st_mtime_ns) == (before.st_size, before.st_mtime_ns)
    with pytest.raises(SourceChangedError, match=r"changed while it was read \(its first and last 64 KiB"):
        got.extend(iterator)
    iterator.close()
    assert [(m.name, m[1]) for m in got] == old[:len(got)]


def test_a_rewrite_set_back_in_the_middle_of_what_was_read_is_never_spliced(tmp_path: Path) -> None:
    # The fingerprint covers 64 KiB at each end: a rewrite (mtime set back) of members in the
    # middle, some already read and some not, got through, and the archive went out as the old
    # version's first members and the new version's last ones. The bytes read are compared now.
    old, whole, path, iterator = _distinct_members_opened(tmp_path)
    got = [next(iterator) for _ in range(200)]  # ~300 KiB read, past the first 64 KiB
    middle = slice(len(whole) // 4, 3 * len(whole) // 4)  # members read and members not yet read
    # member 120 (read: within the first 200) and member 260 (not yet read)
    _rewrite_set_back(path, middle.start, whole[middle].replace(bytes([120]) * 1000, bytes([1]) * 1000)
                      .replace(bytes([9]) * 1000, bytes([2]) * 1000))
    with pytest.raises(SourceChangedError, match="the bytes already read differ from the file's now"):
        got.extend(iterator)
    iterator.close()
    assert [(m.name, m[1]) for m in got] == old[:len(got)]


def test_a_rewrite_set_back_only_where_nothing_was_read_yet_reads_on_as_the_new_version(tmp_path: Path) -> None:
    # Every byte handed out is then the file's as it is now: the same version throughout.
    _, whole, path, iterator = _distinct_members_opened(tmp_path)
    got = [next(iterator) for _ in range(10)]
    at = len(whole) // 2
    new = whole[:at] + whole[at:].replace(bytes([250]) * 1000, bytes([9]) * 1000)
    assert len(new) == len(whole) and new[-(64 << 10):] == whole[-(64 << 10):]
    _rewrite_set_back(path, at, new[at:])
    got.extend(iterator)
    assert b"".join(m[1] for m in got) == b"".join(data for _, data in tarfile_members(new))


def test_a_stream_that_decompresses_a_file_is_not_compared_with_the_files_bytes(tmp_path: Path) -> None:
    # A gzip.open() stream's fileno() is the compressed file's: its bytes read were compared
    # with the file's after a chmod, and the archive was taken for rewritten.
    members = [(f"k{index:04d}.bin", bytes([index % 251]) * 1000) for index in range(40)]
    path = tmp_path / "a.tar.gz"
    path.write_bytes(gzip.compress(tar_bytes(members)))
    with gzip.open(path, "rb") as stream:
        iterator = iter(IterableWrapper([(str(path), stream)], deepcopy=False).load_from_tar())
        got = [next(iterator) for _ in range(5)]
        os.chmod(path, 0o600)
        got.extend(iterator)
    assert [(m.name, m[1]) for m in got] == members


def test_an_archive_replaced_by_a_rename_or_given_other_permissions_is_read_on_whole(tmp_path: Path) -> None:
    # Its status-change time moves, its bytes do not: the reader holding it open reads on.
    old = [(f"k{index:04d}.bin", b"old-%04d" % index) for index in range(500)]
    path, replacement = tmp_path / "a.tar", tmp_path / "new.tar"
    path.write_bytes(tar_bytes(old))
    replacement.write_bytes(tar_bytes([(name, b"new") for name, _ in old]))
    iterator = iter(IterableWrapper([str(path)]).open_files(mode="b").load_from_tar())
    got = [next(iterator) for _ in range(3)]
    os.chmod(path, 0o600)
    got.extend(next(iterator) for _ in range(3))
    os.replace(replacement, path)
    got.extend(iterator)
    assert [(m.name, m[1]) for m in got] == old


def tarfile_members(data: bytes) -> list[tuple[str, bytes]]:
    """The regular members of an archive in ``data``, read by Python's tarfile."""
    import io

    with tarfile.open(fileobj=io.BytesIO(data)) as archive:
        return [(info.name, archive.extractfile(info).read()) for info in archive if info.isfile()]


def _distinct_members_opened(tmp_path: Path) -> tuple[list[tuple[str, bytes]], bytes, Path, Any]:
    """An archive of 400 members of 1,000 bytes, each of one byte value: its members, its bytes,
    its path, and a run of load_from_tar over it, started."""
    members = [(f"k{index:04d}.bin", bytes([index % 251]) * 1000) for index in range(400)]
    path = tmp_path / "a.tar"
    whole = tar_bytes(members)
    path.write_bytes(whole)
    return members, whole, path, iter(IterableWrapper([str(path)]).open_files(mode="b").load_from_tar())


def _rewrite_set_back(path: Path, at: int, data: bytes) -> None:
    """Write ``data`` into ``path`` at byte ``at``, then set its times back (``rsync --inplace -t``)."""
    before = path.stat()
    with open(path, "r+b") as rewrite:
        rewrite.seek(at)
        rewrite.write(data)
    os.utime(path, ns=(before.st_atime_ns, before.st_mtime_ns))


def _with_junk_padding(data: bytes, member_end: int) -> bytes:
    """``data`` with the padding after a member's data (up to its next 512-byte block) not zeros:
    tar and tarfile leave its contents unspecified and never read them."""
    padded_to = -(-member_end // 512) * 512
    return data[:member_end] + b"\xa5" * (padded_to - member_end) + data[padded_to:]


def test_a_members_padding_is_not_read_whatever_it_holds(tmp_path: Path) -> None:
    # POSIX leaves the bytes after a member's data unspecified; tarfile and GNU tar read such an
    # archive whole. A version that asked for zeros refused it (the diff review's probe).
    archive = _with_junk_padding(tar_bytes([("a.txt", b"hello"), ("a.cls", b"1")]), 512 + 5)
    path = tmp_path / "junk-padding.tar"
    path.write_bytes(archive)
    with tarfile.open(path) as reference:
        expected = [(m.name, reference.extractfile(m).read()) for m in reference.getmembers()]
    assert expected == [("a.txt", b"hello"), ("a.cls", b"1")]
    assert [(name.rsplit("/", 1)[1], data) for name, data in members_of(path)] == expected


def test_a_compressed_archive_cut_inside_a_member_says_how_many_members_went_out_unchecked(tmp_path: Path) -> None:
    # gzip's stored blocks: a cut lands where chosen, here in the data of member 5 (a JSON, whose
    # bytes occur once), and in the first member's. The note counted one member fewer than had
    # gone out (-1 for none).
    stored = gzip.compress(tar_bytes(MEMBERS), compresslevel=0)
    for members_before in (5, 0):
        cut = stored.index(MEMBERS[members_before][1]) + 10
        path = tmp_path / f"cut-in-member-{members_before}.tar.gz"
        path.write_bytes(stored[:cut])
        pipe = IterableWrapper([str(path)]).open_files(mode="b").load_from_tar(on_error="skip")
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            delivered = list(pipe)
        assert len(delivered) == members_before
        (message,) = [str(w.message) for w in caught if issubclass(w.category, SkippedSampleWarning)]
        assert f"in member {MEMBERS[members_before][0]!r}" in message
        if members_before:
            assert f"its {members_before} members already delivered were not yet checked" in message
        else:
            assert "already delivered" not in message
