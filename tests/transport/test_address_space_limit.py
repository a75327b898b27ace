"""A training job run under an address-space limit (``ulimit -v``, a scheduler's memory cap):
every batch the main process views is mapped in it, so the loader keeps what it maps in flight
within that limit, and a batch that cannot be mapped says so and leaves nothing behind.

Each case runs in a process of its own: the limit cannot be lifted once lowered.
"""

from __future__ import annotations

import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

SRC = str(Path(__file__).resolve().parents[2] / "src")

pytestmark = pytest.mark.timeout(120)


def _run(script: str) -> str:
    done = subprocess.run([sys.executable, "-c", textwrap.dedent(script)], capture_output=True,
                          text=True, timeout=100, env={"PYTHONPATH": SRC, "PATH": "/usr/bin:/bin"})
    assert done.returncode == 0, done.stderr[-3000:]
    return done.stdout


PRELUDE = """
    import os, resource
    import torch
    import pipeload

    def memfds():
        found = []
        for name in os.listdir("/proc/self/fd"):
            try:
                if "memfd:" in os.readlink(f"/proc/self/fd/{name}"):
                    found.append(name)
            except OSError:
                pass
        return found

    def vm_size():
        for line in open("/proc/self/status"):
            if line.startswith("VmSize:"):
                return int(line.split()[1]) * 1024

    def limit_address_space_to(more_bytes):
        limit = vm_size() + more_bytes
        resource.setrlimit(resource.RLIMIT_AS, (limit, resource.getrlimit(resource.RLIMIT_AS)[1]))
"""


def test_a_buffer_that_cannot_be_mapped_leaves_no_descriptor_behind():
    # torch's mapping of a received descriptor keeps a duplicate of it, and left that open when
    # the mapping failed: the whole buffer's memory, held until the process ended.
    out = _run(PRELUDE + """
    from pipeload.transport.shared_memory import storage_from_descriptor

    fd = os.memfd_create("pipeload-test")
    os.ftruncate(fd, 1 << 30)
    before = memfds()
    limit_address_space_to(256 << 20)
    try:
        storage_from_descriptor(fd, 1 << 30)
    except RuntimeError as error:
        print("refused:", "Cannot allocate memory" in str(error))
    print("left:", sorted(set(memfds()) - set(before)))
    """)
    assert out.splitlines() == ["refused: True", "left: []"]


def test_large_batches_under_an_address_space_limit_all_arrive_and_leave_nothing():
    # 256 MiB batches, two workers, prefetch 2: a GiB in flight, more with kept slabs, where the
    # process may map 768 MiB more. The loader's budget counts what it may still map.
    out = _run(PRELUDE + """
    class Large(pipeload.Dataset):
        def __len__(self):
            return 64

        def __getitem__(self, index):
            return torch.full((8, 1024, 1024), float(index))  # 32 MiB

    limit_address_space_to(768 << 20)
    loader = pipeload.DataLoader(Large(), batch_size=8, num_workers=2, multiprocessing_context="fork")
    firsts = [float(batch[0, 0, 0, 0]) for batch in loader]
    print("batches:", firsts)
    del loader
    import gc; gc.collect()
    print("left:", memfds())
    """)
    assert out.splitlines() == [f"batches: {[float(8 * n) for n in range(8)]}", "left: []"]


def test_a_process_boundary_whose_consumer_runs_short_of_address_space_mid_run_never_hangs():
    # The run's byte budget was read at its start; the limit comes down after its first item,
    # so a slab for the next items cannot be mapped. That was taken for the far end's death:
    # no credit went, and the upstream waited for one while the consumer waited for an item.
    out = _run(PRELUDE + """
    import faulthandler, sys
    from pipeload.datapipes.iter import IterableWrapper

    faulthandler.dump_traceback_later(60, exit=True, file=sys.stderr)  # a hang fails, and says where

    def large(index):
        return torch.full((16, 1024, 1024), float(index))  # 64 MiB

    pipe = IterableWrapper(range(16)).map(large).queue_boundary("process", buffer_size=8)
    items = iter(pipe)
    firsts = [float(next(items)[0, 0, 0])]
    limit_address_space_to(300 << 20)
    try:
        firsts += [float(item[0, 0, 0]) for item in items]
        print("items:", firsts == [float(n) for n in range(16)])
    except pipeload.errors.SharedMemoryError as error:
        print("error:", "ulimit -v" in str(error))
    del pipe, items
    import gc; gc.collect()
    print("left:", memfds())
    """)
    # Every item, or an error that says why (the buffer an item then travels in cannot be
    # mapped either): never a hang.
    assert out.splitlines() in (["items: True", "left: []"], ["error: True", "left: []"]), out
