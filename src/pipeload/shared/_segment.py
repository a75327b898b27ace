"""One anonymous, sealed, read-only memory file that holds the bytes of shared containers.

The file comes from ``memfd_create``: it has no name anywhere in the file system, so it cannot
be left behind. The kernel frees it when the last descriptor and the last mapping of it are gone,
whichever process held them and however that process ended (a SIGKILL included). Once written,
it is sealed against writes, growth and shrinking, and mapped read-only in every process.

A :class:`Segment` owns this process's descriptor and mapping. Pickling one while multiprocessing
starts a process (spawn, forkserver) hands the descriptor itself to the child; pickling it at any
other time (a queue, a file) carries the bytes, and the receiver gets its own private copy.
"""

from __future__ import annotations

import fcntl
import mmap
import os
import struct
import tempfile
import weakref
from itertools import count
from multiprocessing import reduction
from multiprocessing.context import get_spawning_popen
from collections.abc import Iterator
from typing import Any

MAGIC = b"PLSHARE1"  # also keeps every segment non-empty: mmap refuses an empty file
ALIGNMENT = 8  # packed int64/float64 arrays start on their natural boundary
_POPULATE = getattr(mmap, "MAP_POPULATE", 0)  # map every page now: no fault per first read
_SEALS = sum(getattr(fcntl, name, 0) for name in ("F_SEAL_SEAL", "F_SEAL_SHRINK", "F_SEAL_GROW", "F_SEAL_WRITE"))
_serial = count()


def _anonymous_file() -> int:
    """A descriptor of a new, empty file that has no name (closed on exec unless passed on)."""
    if hasattr(os, "memfd_create"):
        name = f"pipeload-shared:{os.getpid()}:{next(_serial)}"  # shown in /proc/<pid>/maps
        return os.memfd_create(name, os.MFD_CLOEXEC | getattr(os, "MFD_ALLOW_SEALING", 0))
    with tempfile.TemporaryFile() as unnamed:  # unlinked at once on POSIX systems without memfd
        return os.dup(unnamed.fileno())


class SegmentWriter:
    """Writes a segment front to back, then seals it. Used by one thread, once.

    Invariant: ``position`` is the file's size and the offset of the next byte written.
    """

    def __init__(self, content: Any = MAGIC) -> None:
        """Start a segment with ``content``: the header, or a whole segment's bytes to copy."""
        self._fd = _anonymous_file()
        self._finalizer = weakref.finalize(self, os.close, self._fd)  # a writer dropped half-way
        self.position = 0
        try:
            self.write(content)
        except BaseException:
            self.abandon()
            raise

    def write(self, data: Any) -> int:
        """Append ``data`` (any buffer) where the last write ended; returns where it starts."""
        start = self.position
        view = memoryview(data).cast("B")
        while view:
            written = os.write(self._fd, view)
            view = view[written:]
        self.position = start + memoryview(data).nbytes
        return start

    def align(self) -> int:
        """Pad to the next ``ALIGNMENT`` boundary; returns the new position."""
        padding = -self.position % ALIGNMENT
        if padding:
            self.write(bytes(padding))
        return self.position

    def finish(self) -> Segment:
        """Seal the file and map it; the writer is spent."""
        self._finalizer.detach()
        fd, self._fd = self._fd, -1
        try:
            if _SEALS and hasattr(fcntl, "F_ADD_SEALS"):
                try:
                    fcntl.fcntl(fd, fcntl.F_ADD_SEALS, _SEALS)
                except OSError:
                    pass  # a file system without seals (the tempfile fallback): read-only mapping only
            return Segment(fd, self.position)
        except BaseException:
            os.close(fd)
            raise

    def abandon(self) -> None:
        """Drop a half-written segment (an item could not be encoded)."""
        self._finalizer()
        self._fd = -1


class Segment:
    """This process's descriptor and read-only mapping of one sealed segment.

    Closing (or dropping the last reference) unmaps it and closes the descriptor here; other
    processes keep their own. Readers use ``data`` (the mapping: slicing it returns ``bytes``)
    and the typed views from ``array``, which closing releases.
    """

    def __init__(self, fd: int, size: int) -> None:
        self.size = size
        self._fd = fd
        self.data = mmap.mmap(fd, size, flags=mmap.MAP_SHARED | _POPULATE, prot=mmap.PROT_READ)
        if self.data[: len(MAGIC)] != MAGIC:
            self.data.close()
            raise ValueError(f"file descriptor {fd} does not hold a pipeload shared segment")
        self._arrays: dict[tuple[int, int, str], memoryview] = {}
        self._finalizer = weakref.finalize(self, _release, self.data, fd, self._arrays)

    @property
    def closed(self) -> bool:
        return not self._finalizer.alive

    def array(self, start: int, length: int, typecode: str) -> memoryview:
        """A read-only view of ``length`` packed items of ``typecode`` (struct codes) at ``start``.

        Made once per place and type: the views and slices of a container ask again each time.
        """
        key = (start, length, typecode)
        view = self._arrays.get(key)
        if view is None:
            end = start + length * struct.calcsize(typecode)
            view = self._arrays[key] = memoryview(self.data)[start:end].cast(typecode)
        return view

    def close(self) -> None:
        """Unmap and close this process's handle now (idempotent)."""
        self._finalizer()

    def __reduce__(self) -> Any:
        if self.closed:
            raise ValueError("cannot pickle a closed shared container")
        if get_spawning_popen() is not None:
            # A process is being started: the descriptor travels with it, the bytes stay put.
            return (_attach, (reduction.DupFd(self._fd), self.size))
        return (_from_bytes, (self.data[:],))


class SegmentBacked:
    """What every shared container does with the one segment it reads: copies are the container
    itself (it is read-only, so a copy could never differ), and closing releases this process's
    mapping. Subclasses set ``_segment``."""

    __slots__ = ()  # the containers keep theirs: no per-object dict
    _segment: Segment

    def __copy__(self) -> Any:
        return self

    def __deepcopy__(self, memo: dict[int, Any]) -> Any:
        return self

    @property
    def nbytes(self) -> int:
        """Bytes of the shared segment (data, offsets and any index), shared by its views."""
        return self._segment.size

    @property
    def closed(self) -> bool:
        return self._segment.closed

    def close(self) -> None:
        """Release this process's mapping now, for this container and every view of its segment.

        Other processes keep theirs; the memory is freed once all have let go. Idempotent.
        """
        self._segment.close()

    def __enter__(self) -> Any:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()

    def _check_open(self) -> None:
        if self._segment.closed:
            raise ValueError(f"I/O operation on a closed {type(self).__name__}")

    def _reading(self, items: Iterator[Any]) -> Iterator[Any]:
        """``items``, read from the segment; closed meanwhile, the next read says so."""
        try:
            yield from items
            return
        except ValueError:
            if not self._segment.closed:
                raise  # an item's own unpickling
        self._check_open()  # outside the handler: the views' "released memoryview" says nothing


def _release(data: mmap.mmap, fd: int, arrays: dict[tuple[int, int, str], memoryview]) -> None:
    for view in arrays.values():
        view.release()
    arrays.clear()
    try:
        data.close()
    except BufferError:
        pass  # someone else holds a view of the mapping: it is unmapped when that view goes
    os.close(fd)


def _attach(handle: Any, size: int) -> Segment:
    fd = handle.detach()
    # Spawn and forkserver hand the descriptor over inheritable; a program the worker runs
    # (os.system, say) would then hold the segment for as long as it lives.
    os.set_inheritable(fd, False)
    return Segment(fd, size)


def _from_bytes(content: bytes) -> Segment:
    return SegmentWriter(content).finish()  # offsets inside the bytes stay valid: same layout
