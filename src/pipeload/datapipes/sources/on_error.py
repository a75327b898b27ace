"""What a source does when a file, an archive or a sample cannot be read: the ``on_error`` policy.

Skipping is always an explicit choice. ``on_error`` is one of

- ``"raise"`` (the default): the error ends the run, naming the URL and the member;
- ``"skip"``: the broken part is left out, with a :class:`SkippedSampleWarning`;
- a callable ``on_error(error, where) -> None``: called with the exception and a
  :class:`FailureSite`; returning skips (without a warning), raising propagates.

``max_failures`` is the failure budget of one run (one worker's pass over its shard of the
data): once more than that many failures have been skipped, the next one raises
:class:`FailureBudgetExceeded`, so a bucket of corrupt shards cannot silently turn an epoch into
nothing. Every pipe that takes ``on_error`` counts what it skipped: ``pipe.failure_counts()``
(this process's runs of that pipe), and :func:`failure_counts` over a whole graph.
"""

from __future__ import annotations

import threading
import warnings
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Literal

from pipeload._user_frame import first_frame_outside_pipeload

OnError = Literal["raise", "skip"] | Callable[[BaseException, "FailureSite"], None]
_POLICIES = ("raise", "skip")


class SkippedSampleWarning(UserWarning):
    """A file, archive or sample could not be read and was skipped (``on_error="skip"``)."""


class FailureBudgetExceeded(RuntimeError):
    """More failures were skipped in one run than ``max_failures`` allows."""


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
        where = repr(self.url)
        return f"member {self.member!r} of {where}" if self.member is not None else where


@dataclass(frozen=True)
class FailureCounts:
    """How many failures a pipe (or a graph) skipped, and how many it raised."""

    skipped: int = 0
    raised: int = 0

    def __add__(self, other: FailureCounts) -> FailureCounts:
        return FailureCounts(self.skipped + other.skipped, self.raised + other.raised)


class FailureTally:
    """Counts one pipe's failures across its runs in this process. Thread-safe: thread workers
    run copies of a pipe, but one pipe may be iterated by several threads of the user's."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._counts = FailureCounts()

    def add(self, skipped: int = 0, raised: int = 0) -> None:
        with self._lock:
            self._counts = self._counts + FailureCounts(skipped, raised)

    def counts(self) -> FailureCounts:
        with self._lock:
            return self._counts


def check_policy(on_error: Any, max_failures: int | None, owner: str) -> None:
    """Refuse an ``on_error``/``max_failures`` pair that cannot work, naming the argument."""
    if not (on_error in _POLICIES or callable(on_error)):
        raise ValueError(f"{owner}: on_error must be 'raise', 'skip' or a callable(error, where), "
                         f"got on_error={on_error!r}")
    if max_failures is not None and (not isinstance(max_failures, int) or max_failures < 0):
        raise ValueError(f"{owner}: max_failures must be None or a non-negative int, "
                         f"got max_failures={max_failures!r}")


class ErrorPolicyMixin:
    """For pipes that take ``on_error`` and ``max_failures``: their tally and its reading."""

    on_error: OnError
    max_failures: int | None

    def _tally(self) -> FailureTally:
        tally = self.__dict__.get("_transient_tally")
        if tally is None:  # made on first use, and never pickled: each process counts its own
            tally = self.__dict__.setdefault("_transient_tally", FailureTally())
        return tally

    def failure_counts(self) -> FailureCounts:
        """Failures this pipe skipped (and raised) in this process's runs so far.

        In process workers each worker's copy of the pipe counts its own; the loader's stats
        add them up.
        """
        return self._tally().counts()

    def _failure_handler(self, stage: str, skips: str) -> FailureHandler:
        return FailureHandler(self.on_error, self.max_failures, stage, skips, self._tally())


class FailureHandler:
    """One run's use of a policy: decides skip-or-raise for each failure and counts it.

    Used by the run's own thread only; the tally it reports to is thread-safe.
    """

    def __init__(self, on_error: OnError, max_failures: int | None, stage: str, skips: str,
                 tally: FailureTally) -> None:
        self._on_error = on_error
        self._max_failures = max_failures
        self.stage = stage
        self.skips = skips  # what a skip leaves out, in words ("the file", "the sample", ...)
        self._tally = tally
        self.skipped = 0  # in this run

    def site(self, url: str | None, member: str | None = None) -> FailureSite:
        return FailureSite(self.stage, url, member)

    def handle(self, error: Exception, site: FailureSite) -> None:
        """Return if the failure is to be skipped; raise otherwise (``error`` itself, or the
        budget's error chained to it)."""
        if self._on_error == "raise":
            self._tally.add(raised=1)
            raise error
        if self._max_failures is not None and self.skipped >= self._max_failures:
            self._tally.add(raised=1)
            raise FailureBudgetExceeded(
                f"{self.stage}: more than max_failures={self._max_failures} failures in one run; "
                f"the last was {type(error).__name__} reading {site.describe()}: {error}"
            ) from error
        if self._on_error == "skip":
            warnings.warn(f"{self.stage}: skipped {self.skips} after {type(error).__name__}: {error}",
                          SkippedSampleWarning, stacklevel=first_frame_outside_pipeload())
        else:
            try:
                self._on_error(error, site)  # type: ignore[operator]
            except BaseException:
                self._tally.add(raised=1)
                raise
        self.skipped += 1
        self._tally.add(skipped=1)


def failure_counts(datapipe: Any) -> FailureCounts:
    """The failures skipped and raised by every on_error-aware pipe in ``datapipe``'s graph,
    in this process (a worker's copy of the graph counts that worker's runs).

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
