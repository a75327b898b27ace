"""NaN in shared containers: a value read back is a new object, so identity cannot stand in for it.

A list finds a NaN it holds because ``x in list`` and ``list == list`` try identity before
``==``, and a dict finds a NaN key the same way. A shared container decodes a fresh float on
every read, never the object it was built from, so ``==`` alone would never match a stored NaN:
a mapping could list a NaN key that no lookup finds. Here a NaN therefore matches any NaN, in
tuples and lists too, where ``==`` has already said no.
"""

from __future__ import annotations

from typing import Any


def equal_with_nan(stored: Any, wanted: Any) -> bool:
    """Whether ``stored`` and ``wanted`` are equal once every NaN counts as equal to every NaN.

    For callers whose ``==`` was False: floats (numpy's float64 too), and tuples or lists of
    one type holding them, item by item. Anything else is left unequal.
    """
    if isinstance(stored, float) and isinstance(wanted, float):
        return stored != stored and wanted != wanted
    kind = type(stored)
    if kind is not type(wanted) or not isinstance(stored, (tuple, list)) or len(stored) != len(wanted):
        return False
    return all(mine == theirs or equal_with_nan(mine, theirs) for mine, theirs in zip(stored, wanted))


def holds_nan(value: Any) -> bool:
    """Whether ``value`` is a NaN float or a tuple or list holding one (at any depth)."""
    if isinstance(value, float):
        return value != value
    return isinstance(value, (tuple, list)) and any(map(holds_nan, value))
