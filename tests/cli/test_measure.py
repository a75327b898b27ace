"""``pipeload bench``'s memory readings (``pipeload.cli.measure``): its shared-memory column must
see pipeload's memfd slabs as well as torch's ``/dev/shm`` files, and count a segment once however
many processes of the tree map it."""

from __future__ import annotations

import mmap
import os
import subprocess
import sys
from collections.abc import Iterator

import numpy as np
import psutil
import pytest
import torch

import pipeload
from pipeload.cli import measure

SEGMENT_BYTES = 4 << 20
# A child that maps the segment it inherited (fd in argv), says so, and holds it until stdin closes.
MAPPING_CHILD = (
    "import mmap, sys\n"
    "view = mmap.mmap(int(sys.argv[1]), 0)\n"
    "print('mapped', flush=True)\n"
    "sys.stdin.read()\n"
)


@pytest.fixture
def memfd() -> Iterator[int]:
    """A written memfd segment (as pipeload's slabs are), mapped by this process."""
    fd = os.memfd_create("pipeload-test-segment")
    os.ftruncate(fd, SEGMENT_BYTES)
    view = mmap.mmap(fd, SEGMENT_BYTES)
    view[:] = b"\1" * SEGMENT_BYTES
    yield fd
    view.close()
    os.close(fd)


def test_bench_sees_a_memfd_segment_the_process_holds(memfd: int) -> None:
    # /dev/shm does not show memfd segments: its growth read 0 MiB for pipeload's slabs
    run = measure.time_one_pass("classic", 0, lambda: [[0]] * 3, len, lambda: None)
    assert run.peak_shm_bytes >= SEGMENT_BYTES


class _Filled(pipeload.Dataset):
    def __len__(self) -> int:
        return 4

    def __getitem__(self, index: int) -> torch.Tensor:
        return torch.full((2048,), float(index))


def test_a_pass_is_timed_until_its_workers_are_gone() -> None:
    # torch joins its workers as the pass ends; pipeload's leave beside the loop, which a pass
    # timed to its last batch never paid for.
    with measure.PeakSampler():  # its sampler process starts on first use, and stays
        before = measure.child_pids()
    run = measure.time_one_pass("classic", 0, lambda: pipeload.DataLoader(_Filled(), batch_size=2, num_workers=2),
                                len, lambda: None)
    assert run.samples == 4
    alive = [pid for pid in measure.child_pids() - before if psutil.pid_exists(pid)
             and psutil.Process(pid).status() != psutil.STATUS_ZOMBIE
             and not measure._is_helper(psutil.Process(pid))]
    assert not alive, "workers outlived the timed pass"


def test_one_byte_of_every_page_of_a_batch_is_read() -> None:
    # 3 x 4096 uint8 ones: 3 pages; a 0-d tensor; an empty one; a string; a numpy array.
    batch = {"image": torch.ones(3, 4096, dtype=torch.uint8), "label": [torch.tensor(2), torch.zeros(0)],
             "name": "x", "mask": np.ones(4096, dtype=np.uint8)}
    assert measure.read_every_page(batch) == 3 + 2 + 1


@pytest.mark.parametrize("dtype", [torch.float8_e4m3fn, torch.bool, torch.complex64, torch.bfloat16])
def test_a_batch_of_any_dtype_can_be_read(dtype: torch.dtype) -> None:
    assert measure.read_every_page(torch.zeros(2, 4096, dtype=dtype).t()) == 0.0  # a view, too
    assert measure.read_every_page(torch.quantize_per_tensor(torch.zeros(8), 0.1, 0, torch.quint8)) == 0.0


def test_a_segment_mapped_by_two_processes_counts_once(memfd: int) -> None:
    before = measure.tree_shared_memory_bytes(psutil.Process())
    child = subprocess.Popen([sys.executable, "-c", MAPPING_CHILD, str(memfd)], stdin=subprocess.PIPE,
                             stdout=subprocess.PIPE, text=True, pass_fds=(memfd,))
    try:
        assert child.stdout.readline().strip() == "mapped"
        # the parent already counted it (mapped and held open); the child adds a second mapping
        assert measure.tree_shared_memory_bytes(psutil.Process()) == before
    finally:
        child.stdin.close()
        child.wait(timeout=30)
    assert child.returncode == 0


def test_each_shared_mapping_line_is_read_once() -> None:
    maps = (
        b"7f00-7f10 r--p 00000000 08:01 1234     /usr/lib/libc.so.6\n"
        b"7f10-7f30 rw-s 00000000 00:01 77       /memfd:pipeload-slab (deleted)\n"
        b"7f30-7f40 rw-s 00000000 00:19 88       /dev/shm/torch_1_2 (deleted)\n"
        b"7f40-7f50 rw-s 00000000 00:01 99       /memfd:odd/dev/shm/name (deleted)\n"  # two paths' words
        b"7f50-7f60 rw-p 00000000 00:00 0 \n"
    )
    assert list(measure._shared_mappings(maps)) == [
        (b"7f10", b"7f30", b"00", b"01", b"77"),
        (b"7f30", b"7f40", b"00", b"19", b"88"),
        (b"7f40", b"7f50", b"00", b"01", b"99"),
    ]
