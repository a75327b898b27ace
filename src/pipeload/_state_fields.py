"""Reading a checkpoint's fields, each one checked before anything is set from it.

A state comes back from a file, through JSON or ``torch.save``, sometimes damaged. Whatever
reads one (the loader's, a sampler's) reads it through :class:`StateFields`: a field that is
missing, of another type, out of range or undecodable is an ``IncompatibleStateError`` naming
the field by its path in the state (``epoch.sampler.generator``) and the value received, and a
field nobody asked for is one too (a renamed or stray field is damage, not news). Ints are ints:
``True`` and ``5.0`` are refused where a count is expected, though Python finds them equal.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch

from pipeload._rng_state import checked_state
from pipeload.errors import MISSING, bad_state_field

GENERATOR_TEXT = "a torch generator state (base64 text from state_dict())"


def is_int(value: object) -> bool:
    """An int, not a bool (``True == 1`` in Python, never in a state)."""
    return isinstance(value, int) and not isinstance(value, bool)


def join(path: str, name: str | int) -> str:
    """``epoch`` + ``consumed`` -> ``epoch.consumed``; the root's fields are named alone."""
    return f"{path}.{name}" if path else str(name)


class StateFields:
    """One dict of a state, read field by field; :meth:`finish` refuses the fields left unread.

    Example:
        >>> fields = StateFields({"consumed": 3}, "epoch")
        >>> fields.integer("consumed")
        3
        >>> fields.finish()
    """

    def __init__(self, state: object, path: str, expected: str = "a dict") -> None:
        if not isinstance(state, dict):
            raise bad_state_field(path or "the state", state, expected)
        self.state: dict[Any, Any] = state
        self.path = path
        self._read: set[Any] = set()

    def name(self, key: str) -> str:
        """The path of field ``key``."""
        return join(self.path, key)

    def raw(self, key: str, expected: str, default: Any = MISSING) -> Any:
        """The field as it is; missing, it is ``default`` (refused when there is none)."""
        self._read.add(key)
        value = self.state.get(key, MISSING)
        if value is MISSING and default is MISSING:
            raise bad_state_field(self.name(key), MISSING, expected)
        return default if value is MISSING else value

    def integer(self, key: str, low: int | None = 0, high: int | None = None, none: bool = False,
                default: Any = MISSING) -> Any:
        """An int in ``[low, high]`` (None: no bound that side), or None when ``none``."""
        expected = _int_range(low, high) + (" or None" if none else "")
        value = self.raw(key, expected, default)
        if value is None and none:
            return None
        if not is_int(value) or (low is not None and value < low) or (high is not None and value > high):
            raise bad_state_field(self.name(key), value, expected)
        return value

    def boolean(self, key: str, default: Any = MISSING) -> Any:
        """True or False; missing, ``default`` (refused when there is none)."""
        value = self.raw(key, "True or False", default)
        if value is default and default is not MISSING:
            return value
        if not isinstance(value, bool):
            raise bad_state_field(self.name(key), value, "True or False")
        return value

    def choice(self, key: str, choices: Sequence[Any]) -> Any:
        """One of ``choices`` (compared by type too: ``1`` is not ``True``)."""
        expected = "one of " + ", ".join(repr(c) for c in choices)
        value = self.raw(key, expected)
        if not any(type(value) is type(c) and value == c for c in choices):
            raise bad_state_field(self.name(key), value, expected)
        return value

    def generator(self, key: str, none: bool = False) -> torch.Tensor | None:
        """A generator state, decoded and tried on a throwaway generator (None when ``none``)."""
        expected = GENERATOR_TEXT + (" or None" if none else "")
        value = self.raw(key, expected)
        if value is None and none:
            return None
        try:
            return checked_state(value)
        except ValueError as error:
            raise bad_state_field(self.name(key), value, expected, str(error)) from None

    def fields(self, key: str, none: bool = False, default: Any = MISSING) -> StateFields | None:
        """A dict inside this one, read the same way (None when ``none`` and it is None)."""
        value = self.raw(key, "a dict" + (" or None" if none else ""), default)
        if value is None and none:
            return None
        return StateFields(value, self.name(key), "a dict" + (" or None" if none else ""))

    def sequence(self, key: str, expected: str, length: int | None = None, none: bool = False,
                 default: Any = MISSING) -> Sequence[Any] | None:
        """A list (or a tuple: ``torch.load`` keeps them, JSON makes them lists) of ``length``
        items when given."""
        value = self.raw(key, expected, default)
        if value is None and none:
            return None
        if not isinstance(value, (list, tuple)) or (length is not None and len(value) != length):
            raise bad_state_field(self.name(key), value, expected)
        return value

    def listed(self, key: str, expected: str, length: int | None = None, none: bool = False,
               default: Any = MISSING) -> StateFields | None:
        """A list (or tuple) inside this one whose items are read as fields named by their
        index (``own.0``), with :meth:`sequence`'s checks (None when ``none`` and it is None)."""
        items = self.sequence(key, expected, length, none, default)
        if items is None:
            return None
        return StateFields(dict(enumerate(items)), self.name(key))

    def finish(self) -> None:
        """Refuse a field no reader asked for (a stray or renamed field: the state was changed)."""
        for key in self.state:
            if key not in self._read:
                raise bad_state_field(
                    join(self.path, key), self.state[key], "absent",
                    f"no such field in {'this state' if not self.path else self.path}")


def _int_range(low: int | None, high: int | None) -> str:
    if low is None:
        return "an int" if high is None else f"an int <= {high}"
    if high is None:
        return f"an int >= {low}"
    if high == low:
        return f"the int {low}"
    return f"an int from {low} to {high}"
