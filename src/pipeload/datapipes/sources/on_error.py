"""What a source does when a file, an archive or a sample cannot be read: the ``on_error`` policy.

Skipping is always an explicit choice. ``on_error`` is one of

- ``"raise"`` (the default): the error ends the run, naming the URL and the member;
- ``"skip"``: the broken part is left out, with a :class:`SkippedSampleWarning`;
- a callable ``on_error(error, where) -> None``: called with the exception and a
  :class:`FailureSite`; returning skips (without a warning), raising propagates.

``max_failures`` is the failure budget: once more than that many failures have been skipped, the
next one raises :class:`FailureBudgetExceeded`, so a bucket of corrupt shards cannot silently
turn an epoch into nothing. In a DataLoader it is one budget for the loader's epoch, counted
over all of its workers at once (on the loader's failure board, ``stats/skips.py``); under
``torch.distributed`` each rank's loader has its own. Iterated directly, it is the budget of
one run. Every pipe that takes ``on_error`` counts what it skipped and what that left out:
``pipe.failure_counts()`` (a loader's totals while one runs it, else this process's runs), and
:func:`failure_counts` over a whole graph.
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Literal

from pipeload.datapipes.sources.errors import SourceError, redact_url
from pipeload.stats.skips import BoardSlot, Counts
from pipeload._user_frame import warn_user

OnError = Literal["raise", "skip"] | Callable[[BaseException, "FailureSite"], None]
_POLICIES = ("raise", "skip")
FILE, SAMPLE = "file", "sample"  # what one skip leaves out


class SkippedSampleWarning(UserWarning):
    """A file, archive or sample could not be read and was skipped (``on_error="skip"``)."""


class FailureBudgetExceeded(RuntimeError):
    """More failures happened than ``max_failures`` allows (in a loader's epoch, or one run)."""

    # The run is over: a thread queue boundary (a read-ahead) ends its run here, rather than
    # read on past it as it does past an error for one item (boundary/feed.py).
    ends_the_run = True


@dataclass(frozen=True)
class FailureSite:
    """Where a failure happened.

    Attributes:
        stage: the pipe that met it (``"open_files"``, ``"load_from_tar"``, ``"decode"``, ...).
        url: the file or archive.
        member: the archive member or sample key, when there is one.
    """

    stage: str
    url: str | None
    member: str | None = None

    def describe(self) -> str:
        where = repr(redact_url(self.url) if self.url is not None else None)
        return f"member {self.member!r} of {where}" if self.member is not None else where


@dataclass(frozen=True)
class FailureCounts:
    """What on_error-aware pipes met: failures skipped and raised, and what the skips left out.

    Attributes:
        skipped: failures the policy skipped (each one counts against ``max_failures``).
        raised: failures that ended a run (``on_error="raise"``, a callback that raised, or the
            budget's error).
        files: files or archives left out, wholly or from where they broke.
        samples: samples left out: one that failed (a duplicate key, a failed decode), or one
            cut short when its archive broke.
    """

    skipped: int = 0
    raised: int = 0
    files: int = 0
    samples: int = 0

    def __add__(self, other: FailureCounts) -> FailureCounts:
        return FailureCounts(self.skipped + other.skipped, self.raised + other.raised,
                             self.files + other.files, self.samples + other.samples)


class FailureTally:
    """Counts one pipe's failures across its runs in this process. Thread-safe: thread workers
    run copies of a pipe, but one pipe may be iterated by several threads of the user's."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._counts = FailureCounts()

    def add(self, counts: FailureCounts) -> None:
        with self._lock:
            self._counts = self._counts + counts

    def counts(self) -> FailureCounts:
        with self._lock:
            return self._counts


def check_policy(on_error: Any, max_failures: int | None, owner: str) -> None:
    """Refuse an ``on_error``/``max_failures`` pair that cannot work, naming the argument."""
    if not (on_error in _POLICIES or callable(on_error)):
        raise ValueError(f"{owner}: on_error must be 'raise', 'skip' or a callable(error, where), "
                         f"got on_error={on_error!r}")
    if max_failures is not None and (isinstance(max_failures, bool) or not isinstance(max_failures, int)
                                     or max_failures < 0):
        raise ValueError(f"{owner}: max_failures must be None or a non-negative int, "
                         f"got max_failures={max_failures!r}")


class ErrorPolicyMixin:
    """For pipes that take ``on_error`` and ``max_failures``: their counts and their budget.

    ``failure_budget``: pipes of one graph that name the same budget share one ``max_failures``
    (``webdataset_pipeline``'s stages do); None, the default, gives the pipe its own.
    """

    on_error: OnError
    max_failures: int | None
    failure_budget: str | None = None

    def _tally(self) -> FailureTally:
        tally = self.__dict__.get("_transient_tally")
        if tally is None:  # made on first use, and never pickled: each process counts its own
            tally = self.__dict__.setdefault("_transient_tally", FailureTally())
        return tally

    def failure_counts(self) -> FailureCounts:
        """Failures this pipe skipped and raised, and what the skips left out.

        Inside a DataLoader's run (and while that loader lives), the loader's totals: every
        worker's copy of the pipe counted, over every epoch. Otherwise this process's runs of
        this pipe.
        """
        slot = self.__dict__.get("_transient_board_slot")
        totals = slot.totals() if slot is not None else None
        return FailureCounts(*totals) if totals is not None else self._tally().counts()

    def bind_failures(self, slot: BoardSlot) -> None:
        """Count on a loader's failure board from now on (``stats/skips.py``)."""
        self.__dict__["_transient_board_slot"] = slot

    def budget_group(self, index: int) -> Any:
        """What this pipe's budget is shared with: its ``failure_budget``, else itself."""
        return self.failure_budget if self.failure_budget is not None else index

    def _failure_handler(self, stage: str, skips: str, unit: str) -> FailureHandler:
        return FailureHandler(self, stage, skips, unit)


class FailureHandler:
    """One run's use of a policy: decides skip-or-raise for each failure and counts it.

    Within a DataLoader, ``max_failures`` is one budget for the whole loader's epoch: failures
    of every worker (process or thread), read-ahead threads included, count together on the
    loader's failure board, and the one that takes the total past it raises at once. Elsewhere
    it is the budget of one run. Used by the run's own thread; what it counts on is thread-safe.
    """

    def __init__(self, pipe: ErrorPolicyMixin, stage: str, skips: str, unit: str) -> None:
        self._on_error = pipe.on_error
        self._max_failures = pipe.max_failures
        self.stage = stage
        self.skips = skips  # what a skip leaves out, in words ("the file", "the sample", ...)
        self._unit = unit  # FILE or SAMPLE: what one skip leaves out
        self._tally = pipe._tally()
        self._slot: BoardSlot | None = pipe.__dict__.get("_transient_board_slot")
        self.failures = 0  # in this run

    def site(self, url: str | None, member: str | None = None) -> FailureSite:
        return FailureSite(self.stage, url, member)

    def handle(self, error: Exception, site: FailureSite) -> None:
        """Return if the failure is to be skipped; raise otherwise (``error`` itself, or the
        budget's error chained to it)."""
        note = f"{self.stage}: {type(error).__name__} reading {site.describe()}: {error}"
        if self._on_error == "raise":
            self._count(FailureCounts(raised=1), note=note)
            raise error
        self.failures += 1
        # Counted as a skip as it is published against the budget, in one step: a loader that
        # another worker's failure ends a moment later reads this one whole (counted only after
        # the warning, it could be read as a failure that was neither skipped nor raised).
        # Turned into a raise below if it is not skipped after all.
        skip = FailureCounts(skipped=1, files=1) if self._unit == FILE else FailureCounts(skipped=1, samples=1)
        used = self._budget_used(skip, note)
        if self._max_failures is not None and used > self._max_failures:
            self._raised_instead(skip)
            raise FailureBudgetExceeded(
                f"{self.stage}: more than max_failures={self._max_failures} failures "
                f"{self._budget_scope()}; the last was {type(error).__name__} reading "
                f"{site.describe()}: {error}"
            ) from error
        try:
            if self._on_error == "skip":
                notes = "".join(f" ({note.removeprefix('pipeload: ')})" for note in getattr(error, "__notes__", ()))
                # Raises where warnings are errors: then the failure ends the run.
                warn_user(f"{self.stage}: skipped {self.skips} after {type(error).__name__}: {error}{notes}",
                          SkippedSampleWarning)
            else:
                self._on_error(error, site)  # type: ignore[operator]
        except BaseException:
            self._raised_instead(skip)
            raise

    def dropped(self, samples: int) -> None:
        """``samples`` left out because of a failure already counted (a sample its archive cut
        short): counted as left out, not as failures."""
        self._count(FailureCounts(samples=samples))

    def _budget_used(self, counts: FailureCounts, note: str) -> int:
        """Count ``counts`` for this failure, and return the failures so far, this one
        included: the loader's this epoch, else this run's."""
        self._tally.add(counts)
        if self._slot is not None:
            # Published first: a worker failing at the same moment sees this one in its own sum.
            self._slot.add(_board_counts(counts), failures=1, note=note)
            used = self._slot.budget_used()
            if used is not None:
                return used
        return self.failures

    def _raised_instead(self, skip: FailureCounts) -> None:
        """A failure counted as ``skip`` that ends the run after all: counted as raised."""
        self._count(FailureCounts(-skip.skipped, 1, -skip.files, -skip.samples))

    def _budget_scope(self) -> str:
        if self._slot is not None and self._slot.row is not None:
            return "this epoch, counted over all of the loader's workers"
        return "in one run"

    def _count(self, counts: FailureCounts, note: str | None = None) -> None:
        self._tally.add(counts)
        if self._slot is not None:
            self._slot.add(_board_counts(counts), note=note)


def _board_counts(counts: FailureCounts) -> Counts:
    return Counts(counts.skipped, counts.raised, counts.files, counts.samples)


def failure_counts(datapipe: Any) -> FailureCounts:
    """The failures skipped and raised by every on_error-aware pipe in ``datapipe``'s graph, and
    the files and samples their skips left out: while a DataLoader runs the graph (and lives),
    the loader's totals from every worker; otherwise this process's runs.

    Example:
        >>> failure_counts(pipe).skipped
        0
    """
    from pipeload.datapipes.graph import list_dps

    total = FailureCounts()
    for pipe in list_dps(datapipe):
        if isinstance(pipe, ErrorPolicyMixin):
            total = total + pipe.failure_counts()
    return total


def epoch_end_error(board: Any, batches: int) -> Exception | None:
    """What ends a DataLoader epoch that ran on ``board`` and handed out ``batches``, if anything
    should: a budget found over its ``max_failures`` only now (two workers that failed at the
    same moment may each have missed the other's failure), or an epoch in which everything read
    failed (no batch, files left out): an error, not an empty epoch."""
    for pipes, limit in board.budgets:
        used = board.epoch_failures(pipes)
        if limit is not None and used > limit:
            return FailureBudgetExceeded(
                f"more than max_failures={limit} failures this epoch, counted over all of the "
                f"loader's workers ({used}){_latest(board)}")
    files = board.epoch_files()
    if batches == 0 and files:
        return SourceError(
            f"the epoch ended without a batch: every file read failed ({files} left out under "
            f"on_error){_latest(board)}. Check the shard paths or URLs and what the failures say.")
    return None


def _latest(board: Any) -> str:
    notes = board.epoch_notes()
    return f"; the latest: {' | '.join(notes[:3])}" if notes else ""
