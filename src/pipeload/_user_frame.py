"""Where a warning should point: the first frame of the user's code, above pipeload's own."""

from __future__ import annotations

import sys


def first_frame_outside_pipeload() -> int:
    """The stacklevel, for the caller's ``warnings.warn``, that points a warning at the user's
    code, however deep pipeload's calls go."""
    frame, level = sys._getframe(1), 1
    while frame is not None and frame.f_globals.get("__name__", "").partition(".")[0] == "pipeload":
        frame, level = frame.f_back, level + 1
    return level
