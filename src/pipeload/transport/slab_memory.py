"""The memory behind one slab: made, mapped, faulted in and page-locked off the critical path.

A new slab costs its pages once: the kernel allocates and zeroes each of them on first touch, and
each process that maps the slab pays a page-table entry per page (a fault per page, or per 16
pages for reads, unless the mapping is populated in one call). With CUDA, page-locking the slab
(``cudaHostRegister``) touches every page too. None of that has to stop the training loop or the
worker about to collate into the slab:

* a producer that writes whole batches populates its mapping on a thread of its own
  (``populate_in_background``: ``MADV_POPULATE_READ``, every page allocated, zeroed and mapped in
  one kernel loop), started when the slab is announced, while it fetches the samples that will
  fill it;
* the owner (the main process) maps a new slab and, to page-lock it for CUDA, hands it to a
  short-lived thread that populates and registers it while the grant is already on its way to a
  worker. An unpinned slab is not populated in the owner: a training loop that never reads a
  batch (one that only hands it on) then does not hold every slab in its resident set, and one
  that reads it faults 16 pages at a time;
* huge pages are asked for where the kernel lets shared memory have them
  (``/sys/kernel/mm/transparent_hugepage/shmem_enabled`` set to ``advise``, ``within_size``,
  ``always`` or ``force``): slabs are then sized in whole huge pages and advised
  ``MADV_HUGEPAGE``, so a slab costs a fault per 2 MiB instead of per 4 KiB.

Populating never changes what a page holds (it only does what a first read would do), so it may
run while another process writes into the slab. The owner waits for a pinned slab's preparation
only where it matters: before handing out a batch of it (it must answer ``is_pinned()``), and
before unpinning it. Where ``MADV_POPULATE_*`` is missing (Linux before 5.14),
pages are simply faulted in on first use, as before.
"""

from __future__ import annotations

import contextlib
import ctypes
import functools
import mmap
import os
import threading
from typing import Any

import numpy as np

from pipeload.transport import host_pinning
from pipeload.transport.shared_memory import Backing, create_buffer, current_backing, note_received

POPULATE_FROM_BYTES = 4 << 20  # smaller slabs are faulted in on use: their headroom stays unpaid
MADV_POPULATE_READ = 22  # Linux 5.14: fault every page in for reading, in one call
MADV_POPULATE_WRITE = 23  # ... for writing (shared memory: allocated and mapped writable)
MADV_HUGEPAGE = 14
THP_SHMEM_SETTING = "/sys/kernel/mm/transparent_hugepage/shmem_enabled"
THP_PMD_SIZE = "/sys/kernel/mm/transparent_hugepage/hpage_pmd_size"
_THP_MODES_FOR_MEMFD = ("always", "within_size", "advise", "force")
SLAB_HEADROOM_BYTES = 256 * 1024  # alignment padding and small extras beyond the largest batch
SIZE_STEP_BYTES = 64 * 1024


@functools.cache
def _libc() -> Any:
    try:
        libc = ctypes.CDLL(None, use_errno=True)  # ctypes releases the GIL during the call
        libc.madvise.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
        libc.madvise.restype = ctypes.c_int
        return libc
    except (OSError, AttributeError):
        return None


def madvise(address: int, nbytes: int, advice: int) -> bool:
    """``madvise(2)``; whether the kernel did it (False where it cannot, or without libc)."""
    libc = _libc()
    return libc is not None and nbytes > 0 and libc.madvise(address, nbytes, advice) == 0


def populate(address: int, nbytes: int, write: bool = True) -> bool:
    """Fault ``nbytes`` at page-aligned ``address`` in now, in one call; returns whether the
    kernel did (False before Linux 5.14: pages then fault in on first use)."""
    return madvise(address, nbytes, MADV_POPULATE_WRITE if write else MADV_POPULATE_READ)


def thp_setting(path: str) -> str | None:
    """The mode chosen in a transparent huge pages setting file (the bracketed word of
    ``always [madvise] never``), or None where it cannot be read."""
    try:
        with open(path) as setting:
            text = setting.read()
    except OSError:
        return None
    return text[text.find("[") + 1:text.find("]")] if "[" in text else text.strip()


def pmd_huge_page_bytes() -> int:
    """The size of a transparent huge page here (``hpage_pmd_size``), or 0 where it is unknown."""
    try:
        with open(THP_PMD_SIZE) as size:
            return int(size.read().strip())
    except (OSError, ValueError):
        return 0


@functools.cache
def huge_page_bytes() -> int:
    """The size of a huge page shared memory may get here, or 0 where the kernel gives it none
    (``shmem_enabled`` set to ``never`` or ``deny``, or no transparent huge pages at all)."""
    return pmd_huge_page_bytes() if thp_setting(THP_SHMEM_SETTING) in _THP_MODES_FOR_MEMFD else 0


def slab_size_for(nbytes: int, step: int) -> int:
    """``nbytes`` rounded up to ``step``, and to whole huge pages where slabs get them."""
    size = -(-nbytes // step) * step
    huge = huge_page_bytes()
    if huge and size >= POPULATE_FROM_BYTES:
        size = -(-size // huge) * huge
    return size


def batch_slab_size(shared_bytes: int) -> int:
    """The size of a slab for batches that need ``shared_bytes`` outside their message: the
    pool's rule, which a worker offering its own buffer as a slab follows too (slab_writer.py)."""
    return slab_size_for(shared_bytes + SLAB_HEADROOM_BYTES, SIZE_STEP_BYTES)


class Preparation:
    """Work on a mapping, done by a short-lived daemon thread; ``wait()`` returns its result.

    The thread holds ``keep`` (the mapping, or an array over it) so that the memory it works on
    cannot be unmapped under it.
    """

    __slots__ = ("_done", "_result", "_keep")

    def __init__(self, work: Any, keep: Any, name: str) -> None:
        self._done = threading.Event()
        self._result = 0
        self._keep = keep
        threading.Thread(target=self._run, args=(work,), name=name, daemon=True).start()

    def _run(self, work: Any) -> None:
        try:
            self._result = work()
        finally:
            self._keep = None
            self._done.set()

    @property
    def done(self) -> bool:
        return self._done.is_set()

    def wait(self) -> int:
        """Block until the work is done; its result (an int)."""
        self._done.wait()
        return self._result


def populate_in_background(mapping: mmap.mmap, address: int, nbytes: int) -> Preparation | None:
    """A producer's mapping of a large slab, populated for writing on a thread (None: too small
    to be worth it). The producer goes on fetching samples meanwhile."""
    if nbytes < POPULATE_FROM_BYTES:
        return None
    huge = huge_page_bytes()

    def work() -> int:
        if huge:
            madvise(address, nbytes, MADV_HUGEPAGE)
        return int(populate(address, nbytes, write=False))

    return Preparation(work, mapping, "pipeload-slab-populate")


class SlabMemory:
    """The owner's mapping of one slab: its descriptor, its bytes as a numpy array, and the
    preparation (populate, page-lock) running or done for it.

    Owned by the slab pool. ``unpin`` may run on any thread but only once the preparation is
    done; the pool serialises it with its ``pin_lock``.
    """

    __slots__ = ("size", "fd", "mapping", "array", "_preparation", "_pinned_address")

    def __init__(self, size: int, pin_device: int | None, fd: int | None = None) -> None:
        """A new slab of ``size`` bytes, or (``fd``) one over a buffer a producer made and
        offered, whose descriptor the memory takes over."""
        self.size = size
        made = fd is None
        if fd is None:
            fd = create_buffer(size, allocate=current_backing() is not Backing.MEMFD)
        self.fd = fd
        self.mapping: mmap.mmap | None = None
        try:
            if made:
                note_received(fd)
            self.mapping = mmap.mmap(self.fd, size)
            self.array = np.frombuffer(self.mapping, dtype=np.uint8)
            self._pinned_address = 0
            self._preparation = self._prepare(pin_device)
        except BaseException:
            # A Ctrl-C, no room to map, no thread to prepare it: nobody else holds a descriptor
            # made here (one taken over is closed by whoever passed it, see SlabPool.adopt).
            self.array = None  # (the mapping closes only once no view of it is left)
            if self.mapping is not None:
                with contextlib.suppress(BufferError):  # a view still held: unmapped with it
                    self.mapping.close()
            if made:
                os.close(fd)
            raise

    def _prepare(self, pin_device: int | None) -> Preparation | None:
        address, size, huge = self.array.ctypes.data, self.size, huge_page_bytes()
        if huge and size >= POPULATE_FROM_BYTES:
            madvise(address, size, MADV_HUGEPAGE)
        if pin_device is None:
            return None

        def work() -> int:
            populate(address, size, write=False)  # page-locking faults every page in anyway
            return address if host_pinning.register(address, size, pin_device) else 0

        return Preparation(work, self.array, "pipeload-slab-prepare")

    @property
    def prepared(self) -> bool:
        """Whether the slab's preparation is over (or it needed none)."""
        return self._preparation is None or self._preparation.done

    def wait_prepared(self) -> None:
        """Block until the slab is populated and, if asked, page-locked."""
        if self._preparation is not None:
            self._pinned_address = self._preparation.wait()
            self._preparation = None

    @property
    def pinned(self) -> bool:
        """Whether the slab is page-locked (waits for its preparation)."""
        self.wait_prepared()
        return self._pinned_address != 0

    def unpin(self) -> None:
        """Undo the page-locking, once (waits for the preparation first)."""
        self.wait_prepared()
        if self._pinned_address:
            host_pinning.unregister(self._pinned_address)
            self._pinned_address = 0

    def close_fd(self) -> None:
        """Close the pool's descriptor; the mapping (and its pages) live on while viewed."""
        if self.fd >= 0:
            os.close(self.fd)
            self.fd = -1
