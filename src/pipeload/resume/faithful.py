"""The states of a dataset's replicas, written so that a JSON round trip gives them back as they were.

A DataPipe's state can hold samples (a shuffle buffer's, a batch being filled), and samples hold
tuples and dicts with int keys, which JSON turns into lists and text. The loader's digest takes
both forms as one (so that a checkpoint kept as JSON loads), and the state then loaded: the
resumed samples came out as ``{'0': 11, '1': [11, -11]}`` where the run had ``{0: 11, 1: (11,
-11)}``, and ``batch[0]`` became ``batch['0']``. So such containers are written in a form JSON
keeps, and read back as they were:

- a tuple as ``{"pipeload:tuple": [items]}``;
- a dict whose keys are not all text (or one of whose keys starts with ``pipeload:``) as
  ``{"pipeload:pairs": [[key, value], ...]}``.

Everything else is left as it is: lists, text-keyed dicts and scalars are what JSON keeps; a
subclass (a namedtuple, a ``defaultdict``, an ``OrderedDict``) is left to ``torch.save``, which
keeps it (JSON cannot), and is given back untouched. Plain data only, so loading runs no code.
"""

from __future__ import annotations

from typing import Any

TUPLE = "pipeload:tuple"
PAIRS = "pipeload:pairs"
_OURS = "pipeload:"


def written(value: Any) -> Any:
    """``value`` with its tuples and its dicts of other keys in the forms above."""
    if type(value) is tuple:
        return {TUPLE: [written(item) for item in value]}
    if type(value) is list:
        return [written(item) for item in value]
    if type(value) is dict:
        if all(type(key) is str and not key.startswith(_OURS) for key in value):
            return {key: written(item) for key, item in value.items()}
        return {PAIRS: [[written(key), written(item)] for key, item in value.items()]}
    return value


def read_back(value: Any) -> Any:
    """What :func:`written` was given, from what it wrote (after JSON or ``torch.save``)."""
    # Exact types only, as written() converts: a defaultdict, OrderedDict or Counter that
    # torch.save kept is given back as it is (rebuilt as a dict, a defaultdict raised KeyError).
    if type(value) is list:
        return [read_back(item) for item in value]
    if type(value) is dict:
        if len(value) == 1 and isinstance(value.get(TUPLE), list):
            return tuple(read_back(item) for item in value[TUPLE])
        pairs = value.get(PAIRS) if len(value) == 1 else None
        if isinstance(pairs, list) and all(isinstance(pair, list) and len(pair) == 2 for pair in pairs):
            return {_key(read_back(key)): read_back(item) for key, item in pairs}
        return {key: read_back(item) for key, item in value.items()}
    return value


def _key(key: Any) -> Any:
    """A key read back: a list (JSON's form of a tuple written before the tuple form) cannot
    be one, and becomes the tuple it was."""
    return tuple(key) if isinstance(key, list) else key
