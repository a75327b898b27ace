"""Where a warning should point: the first frame of the user's code, above pipeload's own.

A warning raised on one of pipeload's own threads (a queue boundary's upstream, a read-ahead)
has no user frame above it: its stack ends in ``threading``. Such a thread is lent the site of
the user's line that started it (``lend_user_site``), and :func:`warn_user` points there.
"""

from __future__ import annotations

import sys
import threading
import warnings
from dataclasses import dataclass

_NOT_USER_MODULES = ("pipeload", "threading")
_lent = threading.local()


@dataclass(frozen=True)
class UserSite:
    """A line of the user's code: what ``warnings`` shows and files a warning under."""

    filename: str
    lineno: int
    module: str


def _is_users(frame) -> bool:  # type: ignore[no-untyped-def]
    return frame.f_globals.get("__name__", "").partition(".")[0] not in _NOT_USER_MODULES


def first_frame_outside_pipeload() -> int:
    """The stacklevel, for the caller's ``warnings.warn``, that points a warning at the user's
    code, however deep pipeload's calls go."""
    frame, level = sys._getframe(1), 1
    while frame is not None and frame.f_globals.get("__name__", "").partition(".")[0] == "pipeload":
        frame, level = frame.f_back, level + 1
    return level


def user_site() -> UserSite | None:
    """The user's line the calling thread runs under: the first frame outside pipeload (and
    ``threading``), or the site lent to this thread when it started; None if neither."""
    frame, _level = _first_user_frame(sys._getframe(1))
    if frame is None:
        return getattr(_lent, "site", None)
    return UserSite(frame.f_code.co_filename, frame.f_lineno, frame.f_globals.get("__name__", "__main__"))


def _first_user_frame(frame):  # type: ignore[no-untyped-def]
    """The first frame from ``frame`` up that is the user's, and how many up it is (1: itself)."""
    level = 1
    while frame is not None and not _is_users(frame):
        frame, level = frame.f_back, level + 1
    return frame, level


def lend_user_site(site: UserSite | None) -> None:
    """Make ``site`` (taken by the thread that started this one) the calling thread's user line."""
    _lent.site = site


def warn_user(message: str, category: type[Warning]) -> None:
    """``warnings.warn`` pointed at the user's line: the caller's, or, on a thread of
    pipeload's own, the line that started it."""
    frame, level = _first_user_frame(sys._getframe(1))
    site = getattr(_lent, "site", None)
    if frame is not None or site is None:
        warnings.warn(message, category, stacklevel=level + 1)  # + this function's own frame
        return
    module = sys.modules.get(site.module)
    registry = vars(module).setdefault("__warningregistry__", {}) if module is not None else None
    warnings.warn_explicit(message, category, site.filename, site.lineno, site.module, registry)
