"""Looking for an optional hook on the user's object, where torch looks for none.

pipeload asks samplers and datasets whether they keep a state (``state_dict``), draw from a
generator of their own (``generator``) or wrap another sampler (``sampler``): torch's loader
reads none of these. Python's own ``getattr(obj, name, default)`` gives the default only for
``AttributeError``; an object whose ``__getattr__`` raises something else for a name it does
not know (a dict-backed config raising ``KeyError``) works under torch, which never asks, and
must not fail here either: for such an object the hook is absent.
"""

from __future__ import annotations

from typing import Any


def optional_attribute(obj: Any, name: str) -> Any:
    """``obj.name``, or None where it has none (or its ``__getattr__`` raises for it)."""
    try:
        return getattr(obj, name)
    except Exception:  # noqa: BLE001 (any failure to answer means: no such hook)
        return None
