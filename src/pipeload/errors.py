"""Errors that cross from workers to the main process.

A failure in a worker is captured as a :class:`RemoteFailure` (plain data, always picklable) and
re-raised in the main process as the *same* exception type, so ``except KeyError`` written for
torch.utils.data keeps working. The message names the worker and the stage, and carries the
original message and the worker's traceback text.
"""

from __future__ import annotations

import signal
import sys
import traceback
from dataclasses import dataclass


class WorkerError(RuntimeError):
    """Base class for loader failures that are not the user's own exception type."""


class WorkerDiedError(WorkerError):
    """A worker process exited without being asked to (killed, crashed, ``os._exit``)."""


class LoaderTimeoutError(WorkerError):
    """No batch arrived within the loader's ``timeout``."""


class SharedMemoryError(WorkerError):
    """Shared memory (``/dev/shm``) is too small for the batches in flight."""


class _KeyErrorMessage(str):
    """A str whose repr is itself, so a KeyError shows the traceback text readably."""

    def __repr__(self) -> str:
        return str(self)


@dataclass(frozen=True)
class RemoteFailure:
    """An exception raised in a worker, reduced to data that survives pickling.

    Attributes:
        exc_type: the original exception class (classes pickle by reference).
        message: ``str()`` of the original exception.
        traceback_text: the formatted traceback, as the worker saw it.
        worker_id: which worker raised it.
        stage: what the worker was doing ("fetching a batch", "running worker_init_fn", ...).
        indices: the sample indices of the batch, when known.
    """

    exc_type: type[BaseException]
    message: str
    traceback_text: str
    worker_id: int
    stage: str
    indices: object = None

    @classmethod
    def capture(cls, worker_id: int, stage: str, indices: object = None) -> RemoteFailure:
        """Describe the exception being handled right now."""
        exc_type, exc, tb = sys.exc_info()
        assert exc_type is not None and exc is not None, "capture() needs an active exception"
        text = "".join(traceback.format_exception(exc_type, exc, tb))
        return cls(exc_type, str(exc), text, worker_id, stage, _small(indices))

    def headline(self) -> str:
        where = f"in DataLoader worker {self.worker_id} while {self.stage}"
        if self.indices is not None:
            where += f" (sample indices {self.indices})"
        return f"Caught {self.exc_type.__name__} {where}."

    def to_exception(self) -> BaseException:
        """Rebuild an exception of the original type whose str() tells the whole story."""
        text = f"{self.headline()}\nOriginal {self.traceback_text}"
        if self.exc_type is KeyError:
            text = _KeyErrorMessage(text)
        try:
            exc = self.exc_type(text)
        except Exception:  # the type needs other constructor arguments
            exc = RuntimeError(text)
        if hasattr(exc, "add_note"):
            exc.add_note(f"pipeload: raised {self.headline()[len('Caught '):]}")
        return exc


def _small(indices: object, limit: int = 64) -> object:
    """Keep index lists short enough to print in an error message."""
    if isinstance(indices, list) and len(indices) > limit:
        return indices[:limit] + ["..."]
    return indices


def describe_exit(exitcode: int | None) -> str:
    """Say how a process ended, in words: 'exit code 3' or 'signal 9 (SIGKILL)'."""
    if exitcode is None:
        return "no exit code (still running)"
    if exitcode < 0:
        try:
            name = signal.Signals(-exitcode).name
        except ValueError:
            name = "unknown signal"
        hint = _SIGBUS_HINT if -exitcode == signal.SIGBUS else ""
        return f"signal {-exitcode} ({name}){hint}"
    return f"exit code {exitcode}"


# A bus error in a data loader worker is most often a write to shared memory that /dev/shm
# could not back.
_SIGBUS_HINT = (
    "; a bus error in a DataLoader worker usually means shared memory (/dev/shm) ran out: "
    "give it more room, or lower num_workers, prefetch_factor or batch_size"
)
