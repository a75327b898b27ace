"""What page-locking slabs for the GPU costs on this host, step by step (issue 24).

    python -m bench.pin_costs [--slabs 18] [--megabytes 38.75] [--threads 1,4,18]

A pinned loader's first epoch makes its slabs and page-locks each one (``cudaHostRegister``) before
a batch in it can be handed out; torch's loader copies every batch into page-locked blocks that its
caching allocator keeps for the whole process. This prints, for ``--slabs`` slabs of the given size
(the default: what eight workers with ``prefetch_factor=2`` hold, each a batch of 64 float32
3x224x224 items plus headroom):

    make + populate        memfd, mmap and MADV_POPULATE_READ (pages allocated and zeroed)
    register, N threads    cudaHostRegister of every slab, spread over N threads (wall time)
    unregister             cudaHostUnregister of every slab
    pool's slabs           SlabMemory as the pool makes them, until every one is prepared
    torch pinned alloc     torch.empty(pin_memory=True) of the same sizes (cudaHostAlloc)
    pin_memory() copy      one slab's bytes copied into torch's pinned memory (its pin thread's job)
    to GPU from ...        copy bandwidth to the device from a registered slab, from torch's
                           pinned memory, and from pageable memory

and the transparent huge page settings, which decide how many pages a slab has. Needs CUDA.
"""

from __future__ import annotations

import argparse
import mmap
import os
import sys
import threading
import time
from collections.abc import Callable, Sequence

import numpy as np
import torch

from pipeload.transport import host_pinning
from pipeload.transport.slab_memory import (
    THP_SHMEM_SETTING,
    SlabMemory,
    huge_page_bytes,
    populate,
    slab_size_for,
    thp_setting,
)

MIB = 1 << 20


def _timed(action: Callable[[], object]) -> float:
    started = time.perf_counter()
    action()
    return time.perf_counter() - started


def _made_slabs(count: int, size: int) -> list[tuple[int, mmap.mmap, np.ndarray]]:
    slabs = []
    for _ in range(count):
        fd = os.memfd_create("pipeload-bench", os.MFD_CLOEXEC)
        os.ftruncate(fd, size)
        mapping = mmap.mmap(fd, size)
        array = np.frombuffer(mapping, dtype=np.uint8)
        populate(array.ctypes.data, size, write=False)
        slabs.append((fd, mapping, array))
    return slabs


def _register_all(addresses: list[int], size: int, threads: int) -> bool:
    results: list[bool] = []

    def work(chunk: list[int]) -> None:
        results.extend(host_pinning.register(address, size, 0) for address in chunk)

    workers = [threading.Thread(target=work, args=(addresses[i::threads],)) for i in range(threads)]
    for worker in workers:
        worker.start()
    for worker in workers:
        worker.join()
    return all(results)


def _copy_rate(source: torch.Tensor, rounds: int = 5) -> float:
    target = torch.empty(source.numel(), dtype=torch.uint8, device="cuda")
    target.copy_(source, non_blocking=True)
    torch.cuda.synchronize()
    started = time.perf_counter()
    for _ in range(rounds):
        target.copy_(source, non_blocking=True)
    torch.cuda.synchronize()
    return rounds * source.numel() / (time.perf_counter() - started) / 1e9


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench.pin_costs", description=__doc__.split("\n")[0])
    parser.add_argument("--slabs", type=int, default=18)
    parser.add_argument("--megabytes", type=float, default=38.75)
    parser.add_argument("--threads", default="1,4,18", help="thread counts for registering")
    args = parser.parse_args(argv)
    if not torch.cuda.is_available():
        print("no CUDA device: nothing to page-lock for")
        return 0
    torch.cuda.init()
    torch.empty(1, device="cuda")
    size = slab_size_for(int(args.megabytes * MIB), mmap.PAGESIZE)
    total_mb = args.slabs * size / MIB
    print(f"{args.slabs} slabs of {size / MIB:.2f} MiB ({total_mb:,.0f} MiB); shmem huge pages: "
          f"{thp_setting(THP_SHMEM_SETTING)} (slabs get {huge_page_bytes() // 1024} KiB pages, 0: none); "
          f"anonymous: {thp_setting('/sys/kernel/mm/transparent_hugepage/enabled')}; "
          f"{os.cpu_count()} CPUs, {torch.cuda.get_device_name(0)}")

    def line(name: str, seconds: float) -> None:
        print(f"  {name:<28} {seconds * 1e3:9.1f} ms  {total_mb / 1024 / seconds:6.2f} GiB/s")

    holder: list = []
    line("make + populate", _timed(lambda: holder.extend(_made_slabs(args.slabs, size))))
    addresses = [array.ctypes.data for _, _, array in holder]
    for threads in (int(text) for text in args.threads.split(",")):
        registered: list[bool] = []
        line(f"register, {threads} threads",
             _timed(lambda: registered.append(_register_all(addresses, size, min(threads, args.slabs)))))
        if not all(registered):
            print("  (cudaHostRegister failed for some slab: the time above is not page-locking's)")
        line("unregister", _timed(lambda: [host_pinning.unregister(a) for a in addresses]))
    while holder:
        fd, mapping, array = holder.pop()
        del array  # the last view: the mapping can close
        mapping.close()
        os.close(fd)

    def pool_slabs() -> None:
        slabs = [SlabMemory(size, 0) for _ in range(args.slabs)]
        for slab in slabs:
            slab.wait_prepared()
        holder.extend(slabs)

    line("pool's slabs (made, pinned)", _timed(pool_slabs))
    slab = holder[0]
    registered = torch.from_numpy(slab.array)
    pinned_blocks: list[torch.Tensor] = []
    line("torch pinned alloc", _timed(lambda: pinned_blocks.extend(
        torch.empty(size, dtype=torch.uint8, pin_memory=True) for _ in range(args.slabs))))
    pageable = torch.ones(size, dtype=torch.uint8)
    copy_s = _timed(lambda: pageable.pin_memory())
    print(f"  pin_memory() copy, one slab   {copy_s * 1e3:9.1f} ms  {size / MIB / 1024 / copy_s:6.2f} GiB/s")
    print(f"  to GPU from a registered slab {_copy_rate(registered):6.1f} GB/s, from torch's pinned "
          f"memory {_copy_rate(pinned_blocks[0]):6.1f} GB/s, from pageable memory "
          f"{_copy_rate(pageable):6.1f} GB/s")
    for slab in holder:
        slab.unpin()
        slab.close_fd()
    return 0


if __name__ == "__main__":
    sys.exit(main())
