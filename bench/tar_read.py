"""Reading a local tar shard: ``load_from_tar`` against Python's ``tarfile``, in one run.

    python -m bench.tar_read [--size-mb 256] [--member-kb 100] [--repeats 5]

Writes one uncompressed shard of ``--size-mb`` MiB in members of ``--member-kb`` KiB (random
bytes) in a temporary directory, then reads every member's bytes, in turns: pipeload's
``IterableWrapper([path]).open_files(mode="b").load_from_tar()`` (headers checked, the archive
watched for rewrites, a running CRC-32 of the bytes read kept for the comparison a status change
calls for) and ``tarfile.open(path)`` with ``extractfile(...).read()`` per member. The page cache
holds the file after the first pass: this is the parsing and copying, not the disk. Prints MiB/s
per pass and the medians' ratio.
"""

from __future__ import annotations

import argparse
import os
import statistics
import tarfile
import tempfile
import time
from pathlib import Path

from pipeload.datapipes.iter import IterableWrapper


def write_shard(path: Path, size_mb: int, member_kb: int) -> int:
    """The shard at ``path``; returns its members' bytes in all."""
    member = os.urandom(member_kb << 10)
    count = (size_mb << 20) // len(member)
    with tarfile.open(path, "w") as tar:
        for index in range(count):
            info = tarfile.TarInfo(f"{index:07d}.bin")
            info.size = len(member)
            tar.addfile(info, _Reader(member))
    return count * len(member)


class _Reader:
    """The same bytes for every member (tarfile reads them once each)."""

    def __init__(self, data: bytes) -> None:
        self._data, self._at = data, 0

    def read(self, size: int = -1) -> bytes:
        end = len(self._data) if size < 0 else min(len(self._data), self._at + size)
        chunk, self._at = self._data[self._at:end], end
        return chunk


def pipeload_pass(path: Path) -> int:
    return sum(len(member[1]) for member in IterableWrapper([str(path)]).open_files(mode="b").load_from_tar())


def tarfile_pass(path: Path) -> int:
    total = 0
    with tarfile.open(path) as tar:
        for info in tar:
            if info.isfile():
                total += len(tar.extractfile(info).read())
    return total


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--size-mb", type=int, default=256)
    parser.add_argument("--member-kb", type=int, default=100)
    parser.add_argument("--repeats", type=int, default=5)
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as directory:
        path = Path(directory) / "shard.tar"
        total = write_shard(path, args.size_mb, args.member_kb)
        rates: dict[str, list[float]] = {"pipeload": [], "tarfile": []}
        passes = {"pipeload": pipeload_pass, "tarfile": tarfile_pass}
        for name, read in passes.items():  # warm the page cache and the imports
            read(path)
        for repeat in range(args.repeats):
            order = list(passes) if repeat % 2 == 0 else list(reversed(passes))
            for name in order:
                started = time.perf_counter()
                assert passes[name](path) == total
                rates[name].append(total / (1 << 20) / (time.perf_counter() - started))
        print(f"{total >> 20} MiB in {args.member_kb} KiB members, {args.repeats} passes each, "
              f"load average {os.getloadavg()[0]:.1f}")
        for name, values in rates.items():
            print(f"  {name:<9} median {statistics.median(values):7,.0f} MiB/s  "
                  f"({', '.join(f'{v:,.0f}' for v in values)})")
        print(f"  load_from_tar / tarfile: {statistics.median(rates['pipeload']) / statistics.median(rates['tarfile']):.2f}x")


if __name__ == "__main__":
    main()
