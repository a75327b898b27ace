"""Errors that cross from workers to the main process.

A failure in a worker is captured as a :class:`RemoteFailure` (plain data, always picklable) and
re-raised in the main process as the *same* exception type, so ``except KeyError`` written for
torch.utils.data keeps working. The message names the worker and the stage, and carries the
original message and the worker's traceback text.

Where torch.utils.data has a sentence for the same failure, our message starts with that sentence,
word for word (users and their tests match it with regular expressions); our detail follows.
"""

from __future__ import annotations

import dataclasses
import pickle
import signal
import sys
import traceback
from dataclasses import dataclass


SUMMARY_CHARS = 400  # the one-line summary of a worker's error is cut here


class WorkerError(RuntimeError):
    """Base class for loader failures that are not the user's own exception type."""


class WorkerDiedError(WorkerError):
    """A worker process exited without being asked to (killed, crashed, ``os._exit``)."""


class LoaderTimeoutError(WorkerError):
    """No batch arrived within the loader's ``timeout``."""


class SharedMemoryError(WorkerError):
    """Shared memory (``/dev/shm``, or the memory behind it) is too small for the batches in
    flight, or this process cannot map one more of them (its address-space limit)."""


class TooManyOpenFilesError(WorkerError):
    """The main process ran out of file descriptors while receiving a batch from a worker."""


class ArgumentAssertionError(ValueError, AssertionError):
    """An argument torch refuses with an AssertionError (``timeout`` > 0 without workers,
    ``prefetch_factor=0``). It is a ValueError in truth, so it is both: ``except`` clauses
    written for either keep working."""


class IncompatibleStateError(ValueError):
    """A checkpoint (``state_dict()``) that cannot be loaded: taken from another configuration
    (another dataset length, batch size, world size, ...: the message names what differs), or
    damaged (a field missing, of another type, out of range or undecodable: the message names
    the field by its path in the state and the value received; or content that no longer
    matches the state's digest). What refused it is left as it was."""


def state_mismatch(owner: str, differences: dict[str, tuple[object, object]]) -> IncompatibleStateError:
    """The error for a state whose recorded settings differ from ``owner``'s: each difference is
    ``name -> (in the state, here)``."""
    listed = "; ".join(f"{name} differs (state: {saved!r}, here: {here!r})"
                       for name, (saved, here) in differences.items())
    return IncompatibleStateError(f"cannot load this state into {owner}: {listed}")


MISSING = object()  # a field a state does not have (None is a value a field may hold)


def bad_state_field(path: str, value: object, expected: str, why: str = "") -> IncompatibleStateError:
    """The error for a field of a state that cannot be what it claims: ``path`` names it
    (``epoch.sampler.generator``), ``value`` is what the state holds (``MISSING``: nothing),
    ``expected`` says what it should be, ``why`` what was found wrong with it (optional)."""
    if value is MISSING:
        return IncompatibleStateError(f"cannot load this state: it has no {path} (expected {expected})")
    detail = f" ({why})" if why else ""
    return IncompatibleStateError(
        f"cannot load this state: {path} should be {expected}, but got {path}={shortened(value)}{detail}")


def shortened(value: object, limit: int = 72) -> str:
    """``repr(value)``, cut to about ``limit`` characters with its size said when longer (a
    generator state is 6,700 characters of base64)."""
    try:
        shown = repr(value)
    except Exception:  # noqa: BLE001 - a value whose repr fails is still named
        return f"<{type(value).__name__}>"
    if len(shown) <= limit:
        return shown
    try:
        size = f"{len(value)} {'characters' if isinstance(value, str) else 'items'}"  # type: ignore[arg-type]
    except TypeError:
        size = f"{len(shown)} characters shown"
    return f"{shown[:limit - 12]}... ({type(value).__name__} of {size})"


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
        where: replaces torch's "in DataLoader worker process N" (the pin memory thread).
        caught_name: the type name torch's sentence shows when ``exc_type`` is our refinement
            of the type actually raised (SharedMemoryError for a RuntimeError).
        worker_kind: "" for a classic process worker, "thread" for a classic thread worker; "item"
            or "batch" for an economic-mode worker, whose ``worker_id`` counts the workers of
            that kind.
        notes: the original exception's ``__notes__`` (a DataPipe's "raised by `fn` of
            Mapper(...)" among them), added again to the rebuilt one before ours.
    """

    exc_type: type[BaseException]
    message: str
    traceback_text: str
    worker_id: int
    stage: str
    indices: object = None
    where: str | None = None
    caught_name: str | None = None
    worker_kind: str = ""
    notes: tuple[str, ...] = ()

    @classmethod
    def capture(
        cls, worker_id: int, stage: str, indices: object = None, where: str | None = None,
        worker_kind: str = "",
    ) -> RemoteFailure:
        """Describe the exception being handled right now.

        ``where`` replaces torch's "in DataLoader worker process N" for failures elsewhere (the
        pin memory thread); ``worker_kind`` names an economic-mode worker's kind.
        """
        exc_type, exc, tb = sys.exc_info()
        assert exc_type is not None and exc is not None, "capture() needs an active exception"
        text = _traceback_text(traceback.TracebackException(exc_type, exc, tb))
        return cls(exc_type, str(exc), text, worker_id, stage, _small(indices), where,
                   worker_kind=worker_kind, notes=_notes_of(exc))

    @classmethod
    def of(cls, error: BaseException, worker_id: int, stage: str, where: str | None = None) -> RemoteFailure:
        """``error`` as data that crosses to another process (its traceback's text, not its
        frames), for errors caught where no handler runs (``capture`` reads the one being
        handled). A class that cannot be pickled by reference (defined where the reader cannot
        import it) goes as a ``RuntimeError`` naming it."""
        failure = cls(type(error), str(error), _traceback_text(traceback.TracebackException.from_exception(error)),
                      worker_id, stage, where=where, notes=_notes_of(error))
        try:
            pickle.dumps(failure.exc_type)
        except Exception:
            failure = dataclasses.replace(failure, exc_type=RuntimeError,
                                          message=f"{type(error).__qualname__}: {error}")
        return failure

    def headline(self) -> str:
        """torch's sentence ("Caught KeyError in DataLoader worker process 0."), then ours."""
        where = self.where or f"in DataLoader worker process {self.worker_id}"
        name = self.caught_name or self.exc_type.__name__
        return f"Caught {name} {where}. It was raised {self._circumstances(name_the_kind=True)}."

    def _worker_name(self) -> str:
        """"worker 3", or in economic mode "item worker 3" / "batch worker 3"."""
        return f"{self.worker_kind} worker {self.worker_id}".lstrip()

    def _circumstances(self, name_the_kind: bool = False) -> str:
        text = f"while {self.stage}"
        if name_the_kind and self.worker_kind:  # torch's sentence cannot say which kind
            text = f"in {self._worker_name()} {text}"
        if self.indices is not None:
            text += f" (sample indices {self.indices})"
        return text

    def summary(self) -> str:
        """The original error in one line (``FileNotFoundError: ... 'shard-0003.tar'``): what a
        user acts on, before the traceback that tells where it came from."""
        first = self.message.strip().splitlines()[0] if self.message.strip() else ""
        if len(first) > SUMMARY_CHARS:
            first = first[:SUMMARY_CHARS] + " ..."
        name = self.exc_type.__name__
        return f"{name}: {first}" if first else name

    def to_exception(self) -> BaseException:
        """Rebuild an exception of the original type whose str() tells the whole story: torch's
        sentence, the original error in one line, then the worker's traceback."""
        text = f"{self.headline()}\n{self.summary()}"
        if self.traceback_text.startswith("Traceback"):
            text += f"\nOriginal {self.traceback_text}"
        # else it was never raised (a producer closing a queue with it): no frames to show, and
        # the summary line has already said what it is.
        if self.exc_type is KeyError:
            text = _KeyErrorMessage(text)
        try:
            exc = self.exc_type(text)
        except Exception:  # the type needs other constructor arguments
            exc = RuntimeError(text)
        if hasattr(exc, "add_note"):
            where = self.where or f"in DataLoader {self._worker_name()}"
            # Once each: a failure passed on from one hop to the next is rebuilt at each.
            for note in dict.fromkeys((*self.notes, f"pipeload: raised {where} {self._circumstances()}")):
                exc.add_note(note)
        return exc


def _traceback_text(formatted: traceback.TracebackException) -> str:
    """The traceback as text, without the exception's own notes: they travel apart (``notes``)
    and are the rebuilt exception's notes, which Python prints after its message (kept in the
    text too, each note was printed twice, and once more at each further hop)."""
    formatted.__notes__ = None
    return "".join(formatted.format())


def _notes_of(exc: BaseException) -> tuple[str, ...]:
    """``exc``'s notes that are strings (``add_note`` takes nothing else; a list filled by hand
    may hold anything, which need not pickle)."""
    notes = getattr(exc, "__notes__", None)
    return tuple(note for note in notes if isinstance(note, str)) if isinstance(notes, list) else ()


def exact_value(name: str, value: object) -> str:
    """`` (pipeload: got name='4')`` when ``str(value)`` hides the type, else nothing.

    torch prints refused values with ``str`` ("batch_size=4" for the string "4"); our messages
    keep its sentence and add the ``repr`` when the two differ.
    """
    try:
        shown, exact = str(value), repr(value)
    except Exception:
        return ""
    return "" if shown == exact else f" (pipeload: got {name}={exact})"


def check_generator(generator: object, name: str = "generator") -> None:
    """Refuse anything but a ``torch.Generator`` (or None) when it is given, not at the first draw.

    torch accepts any value here and fails later, inside ``randperm``, with a message that names
    neither the argument nor the class; ours names both, with the same exception type.
    """
    import torch  # here, not at the top: the rest of this module needs no torch

    if generator is not None and not isinstance(generator, torch.Generator):
        raise TypeError(
            f"{name} should be a torch.Generator or None, but got {name}={generator!r} "
            f"({type(generator).__name__})"
        )


def _small(indices: object, limit: int = 64) -> object:
    """Keep index lists short enough to print in an error message."""
    if isinstance(indices, list) and len(indices) > limit:
        return indices[:limit] + ["..."]
    return indices


def worker_died_message(deaths: list[tuple[str, int | None, int | None]], cause: str = "") -> str:
    """The message for worker processes that ended on their own: ``(name, pid, exitcode)``,
    where ``name`` says which worker ("worker 3", or in economic mode "item worker 3");
    ``cause``: what is known of why, said last.

    torch raises one of two sentences, depending on whether its SIGCHLD handler or its liveness
    check saw the death first: "DataLoader worker (pid 7) is killed by signal: Killed." (or
    "... exited unexpectedly with exit code 3. ...") and "DataLoader worker (pid(s) 7) exited
    unexpectedly". Both are kept, in that order, so either regular expression keeps matching.
    """
    _, first_pid, first_code = deaths[0]
    pids = ", ".join(str(pid) for _, pid, _ in deaths)
    details = "; ".join(
        f"{name} (pid {pid}) ended with {describe_exit(code)}" for name, pid, code in deaths
    )
    return (
        f"{_torch_death_sentence(first_pid, first_code)}"
        f"DataLoader worker (pid(s) {pids}) exited unexpectedly: {details}"
        + (f". {cause}." if cause else "")
    )


def _torch_death_sentence(pid: int | None, exitcode: int | None) -> str:
    """torch's own words for a worker killed by a signal or exiting with a non-zero code."""
    if exitcode is not None and exitcode < 0:
        try:
            name = signal.strsignal(-exitcode) or f"Unknown signal {-exitcode}"
        except ValueError:
            name = f"Unknown signal {-exitcode}"
        sentence = f"DataLoader worker (pid {pid}) is killed by signal: {name}. "
        if -exitcode == signal.SIGBUS:
            sentence += (
                "It is possible that dataloader's workers are out of shared memory. "
                "Please try to raise your shared memory limit. "
            )
        return sentence
    if exitcode:
        return (
            f"DataLoader worker (pid {pid}) exited unexpectedly with exit code {exitcode}. "
            "Details are lost due to multiprocessing. Rerunning with num_workers=0 may give "
            "better error trace. "
        )
    return ""


def cannot_map_message(nbytes: int) -> str:
    """What to say when a batch's memory could not be mapped into the main process."""
    import resource  # POSIX only, as the transport

    soft, _ = resource.getrlimit(resource.RLIMIT_AS)
    limit = ("no address-space limit is set" if soft == resource.RLIM_INFINITY
             else f"this process may map {soft / 2**30:.1f} GiB in all (ulimit -v)")
    return (f"pipeload: a batch of {nbytes / 2**20:.0f} MiB from a worker could not be mapped into "
            f"this process: Cannot allocate memory ({limit}). The batches in flight and the "
            "slabs the loader keeps are all mapped here: lower batch_size or prefetch_factor, "
            "set max_shm_bytes, or raise the limit")


def too_many_open_files(kept_hint: str) -> str:
    """torch's sentence for running out of descriptors, then what our transport needs.

    torch also suggests the 'file_system' sharing strategy; it does not apply here (batches
    travel as descriptors whatever the strategy), so that part of its sentence is left out.
    """
    soft, hard = _fd_limits()
    return (
        "Too many open files. Communication with the workers is no longer possible. Please "
        "increase the limit using `ulimit -n` in the shell. "
        f"This process may have {soft} files open (hard limit {hard}), and all are in use. "
        f"{kept_hint}Raise the limit (`ulimit -n 65536`, or resource.setrlimit(resource."
        "RLIMIT_NOFILE, ...) up to the hard limit), keep fewer batches alive (keep "
        "`tensor.clone()` instead of the batch), or use worker_type='thread', which passes no "
        "descriptors."
    )


def _fd_limits() -> tuple[str, str]:
    try:
        import resource  # POSIX only
    except ImportError:
        return "?", "?"
    limits = resource.getrlimit(resource.RLIMIT_NOFILE)
    soft, hard = ("unlimited" if n == resource.RLIM_INFINITY else str(n) for n in limits)
    return soft, hard


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
