"""Equality in shared containers: a value read back is a new object, so identity cannot stand in
for it.

A list finds an item it holds because ``x in list`` and ``list == list`` try identity before
``==``: a NaN equals itself there, and a numpy array or tensor (whose ``==`` answers element by
element, which ``bool()`` refuses) is found without ``==`` being asked. A dict finds a NaN key the
same way. A shared container decodes a fresh object on every read, never the one it was built
from, so ``==`` alone would never match a stored NaN, and would raise for arrays: a mapping could
list a NaN key that no lookup finds, and a sequence would not equal the list it was built from.
Here a value read back matches what an identical object would: NaN matches NaN (floats, complex,
numpy's scalars), arrays and tensors match by dtype, shape and every element (NaN where NaN is),
and tuples, lists and dicts item by item.
"""

from __future__ import annotations

from typing import Any

import numpy as np
import torch

_NAN_KINDS = (float, complex, np.floating, np.complexfloating)


def same_value(stored: Any, wanted: Any) -> bool:
    """Whether ``stored`` (read back) equals ``wanted`` as the object it was made from would:
    ``==``, or, where that says no or cannot say, as identity would have said yes."""
    kind = type(stored)
    if kind is str or kind is bytes or kind is int:  # the common case, at the cost of one ==
        result = stored == wanted
        if type(result) is bool:
            return result
    arrays = (np.ndarray, torch.Tensor)
    if isinstance(stored, arrays) and type(wanted) is kind:
        return _same_elements(stored, wanted)
    if kind is type(wanted) and isinstance(stored, (tuple, list)):  # item by item, as == does,
        return len(stored) == len(wanted) and all(map(same_value, stored, wanted))  # each as here
    if kind is type(wanted) and isinstance(stored, dict):
        return stored.keys() == wanted.keys() and all(same_value(stored[k], wanted[k]) for k in stored)
    try:
        result = stored == wanted
        if type(result) is not bool:
            result = bool(result)  # a one-element array or tensor beside a number, say
    except Exception:  # an == that raises (an array of several elements): only identity could match
        return False
    if result:
        return True
    return isinstance(stored, _NAN_KINDS) and isinstance(wanted, _NAN_KINDS) and _is_nan(stored) and _is_nan(wanted)


def _is_nan(value: Any) -> bool:
    return value != value


def _same_elements(stored: Any, wanted: Any) -> bool:
    if type(stored) is not type(wanted):
        return False
    if isinstance(stored, np.ndarray):
        if stored.dtype != wanted.dtype or stored.shape != wanted.shape:
            return False
        try:
            return bool(np.array_equal(stored, wanted, equal_nan=stored.dtype.kind in "fc"))
        except TypeError:  # object or structured dtypes
            return all(same_value(a, b) for a, b in zip(stored.ravel().tolist(), wanted.ravel().tolist()))
    if stored.dtype != wanted.dtype or stored.shape != wanted.shape or stored.layout != wanted.layout:
        return False
    if stored.layout is not torch.strided:
        return bool(torch.equal(stored.to_dense(), wanted.to_dense()))
    if stored.is_floating_point() or stored.is_complex():
        return bool(((stored == wanted) | (stored.isnan() & wanted.isnan())).all())
    return bool(torch.equal(stored, wanted))


def holds_nan(value: Any) -> bool:
    """Whether ``value`` is a NaN or a tuple or list holding one (at any depth): a key a dict
    finds only by identity."""
    if isinstance(value, _NAN_KINDS):
        return _is_nan(value)
    return isinstance(value, (tuple, list)) and any(map(holds_nan, value))
