"""One anonymous, sealed, read-only memory file that holds the bytes of shared containers.

The file comes from ``memfd_create``: it has no name anywhere in the file system, so it cannot
be left behind. The kernel frees it when the last descriptor and the last mapping of it are gone,
whichever process held them and however that process ended (a SIGKILL included). Once written,
it is sealed against writes, growth and shrinking, and mapped read-only in every process.

A :class:`Segment` owns this process's one descriptor and mapping of it. Pickling one while
multiprocessing starts a process (spawn, forkserver) hands the descriptor itself to the child;
pickling it at any other time (a queue, a file) carries the bytes, and the receiver gets its own
private copy. A container stored inside another container's items is such a pickle: reading it
gives a segment that holds the bytes just read, in this process's own memory, with no file or
descriptor at all (a read makes a fresh object, as every read does).
"""

from __future__ import annotations

import errno
import fcntl
import mmap
import os
import resource
import struct
import sys
import tempfile
import threading
import weakref
from contextlib import contextmanager
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
_OUT_OF_DESCRIPTORS = (errno.EMFILE, errno.ENFILE)
_nesting = threading.local()  # .depth > 0 while a column pickles its values into a segment


def _anonymous_file(what: str) -> int:
    """A descriptor of a new, empty file that has no name (closed on exec unless passed on)."""
    try:
        return _new_anonymous_file()
    except OSError as exc:
        raise _explained(exc, what) from exc


def _new_anonymous_file() -> int:
    if hasattr(os, "memfd_create"):
        name = f"pipeload-shared:{os.getpid()}:{next(_serial)}"  # shown in /proc/<pid>/maps
        return os.memfd_create(name, os.MFD_CLOEXEC | getattr(os, "MFD_ALLOW_SEALING", 0))
    with tempfile.TemporaryFile() as unnamed:  # unlinked at once on POSIX systems without memfd
        return os.dup(unnamed.fileno())


class SegmentWriter:
    """Writes a segment front to back, then seals it. Used by one thread, once.

    Invariant: ``position`` is the file's size and the offset of the next byte written.
    """

    def __init__(self, what: str, content: Any = MAGIC) -> None:
        """Start a segment for ``what`` (named in errors, "a SharedSequence of 3 items") with
        ``content``: the header, or a whole segment's bytes to copy."""
        self._what = what
        self._fd = _anonymous_file(what)
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
        except BaseException:
            os.close(fd)
            raise
        return Segment.mapped(fd, self.position, self._what)  # it owns fd from here, failing or not

    def abandon(self) -> None:
        """Drop a half-written segment (an item could not be encoded)."""
        self._finalizer()
        self._fd = -1


class Segment:
    """This process's read-only view of one sealed segment: a mapping and the one descriptor that
    keeps the file open, or (read out of another container's items) bytes of its own.

    Closing (or dropping the last reference) unmaps it and closes the descriptor here; other
    processes keep their own. Readers use ``data`` (slicing it returns ``bytes``) and the typed
    views from ``array``, which closing releases.

    Invariant: ``_fd`` is a descriptor of the file ``data`` maps, open while the segment is, or
    -1 for a segment of private bytes. Each mapped segment holds exactly one descriptor, so a
    process can hold about as many segments as its descriptor limit allows.
    """

    def __init__(self, data: Any, size: int, fd: int, close_fd: bool) -> None:
        """Use :meth:`mapped` or :meth:`private`; ``close_fd``: whether closing must close ``fd``
        (False where the mapping holds it and closes it itself)."""
        self.size = size
        self.data = data
        self._fd = fd
        if self.data[: len(MAGIC)] != MAGIC:
            _release_data(self.data, fd if close_fd else -1)
            raise ValueError(f"file descriptor {fd} does not hold a pipeload shared segment")
        self._arrays: dict[tuple[int, int, str], memoryview] = {}
        self._finalizer = weakref.finalize(self, _release, self.data, fd if close_fd else -1, self._arrays)

    @classmethod
    def mapped(cls, fd: int, size: int, what: str) -> Segment:
        """Map the sealed file ``fd`` (owned from here on, closed if mapping fails)."""
        try:
            data, kept_fd, close_fd = _map_keeping_one_descriptor(fd, size)
        except OSError as exc:
            os.close(fd)
            raise _explained(exc, what) from exc
        return cls(data, size, kept_fd, close_fd)

    @classmethod
    def private(cls, content: bytes) -> Segment:
        """A segment of ``content`` itself, in this process's memory: no file, no descriptor."""
        return cls(content, len(content), -1, close_fd=False)

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
        if get_spawning_popen() is not None and self._fd >= 0:
            # A process is being started: the descriptor travels with it, the bytes stay put.
            return (_attach, (reduction.DupFd(self._fd), self.size))
        if getattr(_nesting, "depth", 0):
            return (Segment.private, (self.data[:],))  # read back as an item: see the module's note
        return (_from_bytes, (self.data[:],))


@contextmanager
def pickling_into_a_segment() -> Iterator[None]:
    """While a column pickles its values: a shared container among them reads back as private bytes."""
    _nesting.depth = getattr(_nesting, "depth", 0) + 1
    try:
        yield
    finally:
        _nesting.depth -= 1


def _map_keeping_one_descriptor(fd: int, size: int) -> tuple[mmap.mmap, int, bool]:
    """Map ``fd``; returns the mapping, the one descriptor left open, and whether we close it.

    Before Python 3.13 an ``mmap`` keeps a duplicate of the descriptor it maps (for ``size()``
    and ``resize()``), and does not say which: mapped as it is, every segment would hold two. The
    duplicate takes the lowest free number, so we note that number first, check afterwards that
    it now holds our file, and close ours: the mapping's duplicate is then the one we hand to
    spawned workers, and the mapping closes it. Should another thread have taken that number in
    between, we keep ours too (two descriptors, correct all the same).
    """
    flags, prot = mmap.MAP_SHARED | _POPULATE, mmap.PROT_READ
    if sys.version_info >= (3, 13):
        return mmap.mmap(fd, size, flags=flags, prot=prot, trackfd=False), fd, True
    lowest_free = os.dup(fd)
    os.close(lowest_free)
    data = mmap.mmap(fd, size, flags=flags, prot=prot)
    if _same_file(lowest_free, fd):
        os.close(fd)
        return data, lowest_free, False
    return data, fd, True


def _same_file(candidate: int, fd: int) -> bool:
    try:
        theirs, ours = os.fstat(candidate), os.fstat(fd)
    except OSError:
        return False
    return (theirs.st_dev, theirs.st_ino) == (ours.st_dev, ours.st_ino)


def _explained(exc: OSError, what: str) -> OSError:
    """``exc`` as it was, or, if the process ran out of descriptors, saying so and what to do."""
    if exc.errno not in _OUT_OF_DESCRIPTORS:
        return exc
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    raise_to = hard if hard != resource.RLIM_INFINITY else max(soft * 16, 65536)
    return OSError(exc.errno, (
        f"cannot build {what}: this process has no file descriptor left ({exc.strerror}; its soft "
        f"limit RLIMIT_NOFILE is {soft}, the hard limit {hard}). Each shared container keeps one "
        f"descriptor open for its memory, so a process holds at most about that many. Raise the "
        f"soft limit before building them (resource.setrlimit(resource.RLIMIT_NOFILE, ({raise_to}, "
        f"{hard})) or `ulimit -n`), or store the data in fewer, larger containers: one "
        f"SharedSequence of every item rather than one per video, say."
    ))


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


def _release(data: Any, fd: int, arrays: dict[tuple[int, int, str], memoryview]) -> None:
    for view in arrays.values():
        view.release()
    arrays.clear()
    _release_data(data, fd)


def _release_data(data: Any, fd: int) -> None:
    """Unmap ``data`` (a mapping; bytes need nothing) and close ``fd`` unless it is -1."""
    if isinstance(data, mmap.mmap):
        try:
            data.close()  # before Python 3.13 this closes the mapping's own descriptor too
        except BufferError:
            pass  # someone else holds a view of the mapping: it is unmapped when that view goes
    if fd >= 0:
        os.close(fd)


def _attach(handle: Any, size: int) -> Segment:
    fd = handle.detach()
    # Spawn and forkserver hand the descriptor over inheritable; a program the worker runs
    # (os.system, say) would then hold the segment for as long as it lives.
    os.set_inheritable(fd, False)
    return Segment.mapped(fd, size, "a shared container sent by the parent process")


def _from_bytes(content: bytes) -> Segment:
    # offsets inside the bytes stay valid: same layout
    return SegmentWriter("a shared container being unpickled", content).finish()
