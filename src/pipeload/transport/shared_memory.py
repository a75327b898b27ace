"""Where shared batch memory comes from: nameless memfd files, or unlinked files as a fallback.

Every buffer is a file descriptor that never has a name anyone can see: ``memfd_create`` where
Linux offers it; otherwise a file created in ``/dev/shm`` and unlinked at once; and when that
file system is full, a file in the temporary directory, unlinked too. Nothing can be left behind
whatever kills whichever process: the memory is freed when the last descriptor and mapping go.

memfd memory is not limited by the size of ``/dev/shm`` (Docker gives containers 64 MiB there by
default); it is still shared memory to the kernel: ``Shmem`` in ``/proc/meminfo``, charged to the
container's memory limit. ``available_bytes`` reports what the chosen backing can still take, and
the loader's default ``max_shm_bytes`` is derived from it.

``PIPELOAD_SHM_BACKING`` (``memfd``, ``dev-shm`` or ``file``) picks the first backing to try; it
exists to test the fallbacks on a machine that has memfd, and to diagnose a host.
"""

from __future__ import annotations

import enum
import errno
import os
import resource
import shutil
import tempfile
import threading

import torch

from pipeload._interrupts import ctrl_c_held
from pipeload._user_frame import warn_user

DEV_SHM = "/dev/shm"
BACKING_ENV = "PIPELOAD_SHM_BACKING"
_MEMINFO = "/proc/meminfo"
_STATUS = "/proc/self/status"
_CGROUP_DIR = "/sys/fs/cgroup"
MIB = 1 << 20


class Backing(enum.Enum):
    """What holds the pages of a shared buffer."""

    MEMFD = "memfd"
    """An anonymous memory file: no name, not bounded by /dev/shm's size."""
    DEV_SHM = "dev-shm"
    """A file in /dev/shm, unlinked as soon as it is created."""
    FILE = "file"
    """A file in the temporary directory, unlinked at once (disk-backed page cache)."""


class _Choice:
    """The backing in use by this process; moves down the list when one fails. Thread-safe.

    Falling back is silent here (it may happen in a worker, whose warnings nobody catches): the
    consumer warns once when a buffer in a fallback backing reaches it (:func:`note_received`).
    """

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._order = _backing_order()
        self.preferred = self._order[0]
        self.warned = False

    @property
    def current(self) -> Backing:
        return self._order[0]

    def give_up_on(self, backing: Backing) -> bool:
        """Stop using ``backing``; returns False when there is nothing left to fall back on."""
        with self._lock:
            if backing in self._order and len(self._order) > 1:
                self._order.remove(backing)
            return self._order[0] is not backing


def _backing_order() -> list[Backing]:
    order = [Backing.MEMFD, Backing.DEV_SHM, Backing.FILE]
    if not hasattr(os, "memfd_create"):
        order.remove(Backing.MEMFD)
    if not os.path.isdir(DEV_SHM):
        order.remove(Backing.DEV_SHM)
    wanted = os.environ.get(BACKING_ENV)
    if wanted:
        try:
            first = Backing(wanted)
        except ValueError:
            raise ValueError(
                f"{BACKING_ENV} should be one of {[b.value for b in Backing]}, got {wanted!r}"
            ) from None
        order = order[order.index(first):] if first in order else order
    return order


_choice = _Choice()


def current_backing() -> Backing:
    """The backing new buffers are made in, in this process."""
    return _choice.current


def _describe(backing: Backing) -> str:
    if backing is Backing.MEMFD:
        return "anonymous shared memory (memfd)"
    if backing is Backing.DEV_SHM:
        return DEV_SHM
    return f"an unlinked file in {tempfile.gettempdir()}"


def describe_backing(backing: Backing | None = None) -> str:
    """Words for a warning: where batches travel."""
    return _describe(backing or current_backing())


def create_buffer(nbytes: int, *, allocate: bool) -> int:
    """A new nameless shared file of ``nbytes``; returns its descriptor (close-on-exec).

    ``allocate=True`` reserves every page now (``posix_fallocate``), so running out of space is an
    ``OSError(ENOSPC)`` here rather than a SIGBUS when a page is first written. The pages must be
    zeroed at some point anyway, so this costs no more than faulting them in later.

    Raises:
        OSError: ENOSPC/ENOMEM when no backing has room.
    """
    while True:
        backing = _choice.current
        try:
            return _create_in(backing, nbytes, allocate)
        except OSError as error:
            if error.errno not in (errno.ENOSPC, errno.ENOMEM, errno.ENOSYS, errno.EPERM,
                                   errno.EACCES, errno.EINVAL):
                raise
            if not _choice.give_up_on(backing):
                raise


BUFFER_PREFIX = "pipeload-"  # the name of every buffer made here, whatever its backing


def _create_in(backing: Backing, nbytes: int, allocate: bool) -> int:
    fd = -1
    try:
        # Ctrl-C held until the descriptor is made and sized: raised just after memfd_create
        # returned, it left a descriptor nobody would close, one per Ctrl-C (stop 53's
        # lifecycle skeptic); held, it is raised at the end of the block, and closes it below.
        with ctrl_c_held():
            if backing is Backing.MEMFD:
                fd = os.memfd_create(BUFFER_PREFIX + "batch", os.MFD_CLOEXEC)
            else:
                directory = DEV_SHM if backing is Backing.DEV_SHM else tempfile.gettempdir()
                fd, path = tempfile.mkstemp(prefix=BUFFER_PREFIX, dir=directory)
                os.unlink(path)  # nameless from here on: nothing to leak
            os.ftruncate(fd, nbytes)
            if allocate and nbytes > 0:
                os.posix_fallocate(fd, 0, nbytes)
    except BaseException:
        if fd >= 0:
            os.close(fd)
        raise
    return fd


def backing_of_descriptor(fd: int) -> Backing | None:
    """Which backing a descriptor's file lives in (from its /proc link), or None if unknown."""
    return _backing_of(_link_of(fd))


def _link_of(fd: int) -> str | None:
    try:
        return os.readlink(f"/proc/self/fd/{fd}")
    except OSError:
        return None


def _backing_of(target: str | None) -> Backing | None:
    if target is None:
        return None
    if target.startswith("/memfd:"):
        return Backing.MEMFD
    if target.startswith(DEV_SHM + "/"):
        return Backing.DEV_SHM
    return Backing.FILE


def note_received(fd: int) -> None:
    """Warn once per process when a buffer made here arrives in a backing below the preferred
    one. Shared memory that user code made says nothing about ours: torch's ``default_collate``
    in a worker (a custom ``collate_fn`` built on it) stacks a batch into torch's own /dev/shm
    file, which reaches us as a descriptor too."""
    if _choice.warned:
        return
    target = _link_of(fd)  # one readlink per batch received by descriptor (torch's, say)
    backing = _backing_of(target)
    if backing is None or backing is _choice.preferred or backing is Backing.MEMFD:
        return
    if not os.path.basename(target or "").startswith(BUFFER_PREFIX):
        return  # not one of our buffers (see BUFFER_PREFIX)
    _choice.warned = True
    warn_user(  # on the pin thread too, which starts at the user's iter(loader)
        f"pipeload: could not make shared memory in {_describe(_choice.preferred)} (full, or not "
        f"allowed here); batches now travel in {_describe(backing)}, which is slower. Give the "
        "container more shared memory, or lower max_shm_bytes.",
        RuntimeWarning,
    )


def warn_if_dev_shm_too_small(batch_bytes: int, batches_in_flight: int) -> None:
    """Say once why loading works where torch's would fail: /dev/shm is not what we use."""
    free = dev_shm_free_bytes()
    backing = current_backing()
    needed = batch_bytes * batches_in_flight
    if free is None or backing is Backing.DEV_SHM or needed <= free:
        return
    warn_user(
        f"pipeload: batches of {batch_bytes / MIB:.1f} MiB, up to {batches_in_flight} in flight, "
        f"do not fit in /dev/shm ({free / MIB:.1f} MiB free), where torch.utils.data would fail; "
        f"pipeload passes them in {_describe(backing)}, which the size of /dev/shm does "
        "not limit. That memory still counts against the container's memory limit; the "
        "DataLoader's max_shm_bytes bounds how much of it the loader keeps.",
        RuntimeWarning,
    )


def available_bytes() -> int | None:
    """How much more shared memory the current backing can take, and this process can map
    (a job run under ``ulimit -v``), or None if unknown."""
    backing = _choice.current
    if backing is Backing.MEMFD:
        available = memory_headroom_bytes()
    else:
        directory = DEV_SHM if backing is Backing.DEV_SHM else tempfile.gettempdir()
        try:
            available = shutil.disk_usage(directory).free
        except OSError:
            available = None
    mappable = address_space_headroom_bytes()
    if mappable is None:
        return available
    return mappable if available is None else min(available, mappable)


def address_space_headroom_bytes() -> int | None:
    """How much more this process may map under its address-space limit (``RLIMIT_AS``,
    ``ulimit -v``); None without one. Every batch the main process views is mapped in it."""
    soft, _ = resource.getrlimit(resource.RLIMIT_AS)
    if soft == resource.RLIM_INFINITY:
        return None
    mapped = _kib_field_bytes(_STATUS, "VmSize")
    return None if mapped is None else max(0, soft - mapped)


def storage_from_descriptor(fd: int, nbytes: int) -> torch.UntypedStorage:
    """A shared CPU storage over the first ``nbytes`` of memory file ``fd``, which the caller
    keeps (the storage holds a duplicate). If the mapping fails, the duplicate torch made is
    closed too: torch leaves it open, and with it the whole buffer's memory, for as long as the
    process lives."""
    try:
        return torch.UntypedStorage._new_shared_fd_cpu(fd, nbytes)
    except RuntimeError:
        _close_other_descriptors_of(fd)
        raise


def _close_other_descriptors_of(fd: int) -> None:
    """Close every descriptor of this process but ``fd`` open on ``fd``'s file (a fresh
    buffer's: nothing else here holds it)."""
    try:
        target = os.fstat(fd)
        names = os.listdir("/proc/self/fd")
    except OSError:
        return
    for name in names:
        other = int(name)
        if other == fd:
            continue
        try:
            found = os.fstat(other)
        except OSError:
            continue  # closed meanwhile, or the listing's own descriptor
        if (found.st_dev, found.st_ino) == (target.st_dev, target.st_ino):
            os.close(other)


def dev_shm_free_bytes() -> int | None:
    """Free space on /dev/shm, or None where there is none."""
    try:
        return shutil.disk_usage(DEV_SHM).free
    except OSError:
        return None


def memory_headroom_bytes() -> int | None:
    """Memory this process's container can still use: MemAvailable, capped by a cgroup v2 limit."""
    available = _kib_field_bytes(_MEMINFO, "MemAvailable")
    limit = _read_int(os.path.join(_cgroup_path(), "memory.max"))
    used = _read_int(os.path.join(_cgroup_path(), "memory.current"))
    if limit is not None and used is not None:
        headroom = max(0, limit - used)
        available = headroom if available is None else min(available, headroom)
    return available


def _kib_field_bytes(path: str, field: str) -> int | None:
    """A ``Field:   123 kB`` line's value in bytes, from a /proc file (None where it is missing)."""
    try:
        with open(path) as lines:
            for line in lines:
                if line.startswith(field + ":"):
                    return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        pass
    return None


def _cgroup_path() -> str:
    try:
        with open("/proc/self/cgroup") as cgroup:
            for line in cgroup:
                if line.startswith("0::"):
                    return _CGROUP_DIR + line[3:].strip()
    except OSError:
        pass
    return _CGROUP_DIR


def _read_int(path: str) -> int | None:
    try:
        with open(path) as handle:
            text = handle.read().strip()
    except OSError:
        return None
    return int(text) if text.isdigit() else None  # "max" means no limit
