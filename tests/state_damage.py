"""Random damage of a checkpoint, as storage, transfer or a careless edit would do it.

:func:`damaged` picks a place in a state (a field, an item, a nested state's field) and one of:
delete it, swap it for a value of another type (a list kept as a tuple counts, as ``torch.load``
keeps tuples), truncate it (text, list, dict), or flip one bit (of an int, a float, a bool, a
character). The state itself is never changed: the containers on the way are copied.
"""

from __future__ import annotations

import random
import struct
from collections.abc import Callable
from typing import Any

from pipeload.errors import IncompatibleStateError

REMOVE = object()
Path_ = tuple[Any, ...]


def places(value: Any, path: Path_ = ()) -> list[Path_]:
    """Every place inside ``value`` (long lists sampled: a generator's 625 words would crowd out
    the state's own fields)."""
    if isinstance(value, dict):
        children = list(value.items())
    elif isinstance(value, (list, tuple)):
        children = list(enumerate(value))
    else:
        return []
    if len(children) > 12:
        children = children[:3] + children[len(children) // 2:len(children) // 2 + 2] + children[-3:]
    found = []
    for key, child in children:
        found.append((*path, key))
        found.extend(places(child, (*path, key)))
    return found


def value_at(value: Any, path: Path_) -> Any:
    for key in path:
        value = value[key]
    return value


def edited(value: Any, path: Path_, change: Callable[[Any], Any]) -> Any:
    """``value`` with the item at ``path`` replaced by ``change(item)`` (``REMOVE``: deleted);
    containers on the way are copied, the original is untouched."""
    if not path:
        return change(value)
    key, rest = path[0], path[1:]
    if isinstance(value, dict):
        copy = dict(value)
        new = edited(value[key], rest, change)
        copy.pop(key) if new is REMOVE else copy.__setitem__(key, new)
        return copy
    items = list(value)
    new = edited(items[key], rest, change)
    items.pop(key) if new is REMOVE else items.__setitem__(key, new)
    return tuple(items) if isinstance(value, tuple) else items


def swapped(value: Any, rng: random.Random) -> Any:
    """A value of another type (a list kept as a tuple counts: torch.load keeps tuples)."""
    candidates: list[Any] = [None, True, 0, 7, -1, 2.5, "", "5", [], {}, [value], {"value": value}]
    if isinstance(value, bool):
        candidates.append(int(value))
    elif isinstance(value, int):
        candidates += [float(value), str(value)]
    elif isinstance(value, str) and value.isdigit():
        candidates.append(int(value))
    elif isinstance(value, list):
        candidates.append(tuple(value))
    elif isinstance(value, tuple):
        candidates.append(list(value))
    return rng.choice([c for c in candidates if type(c) is not type(value)])


def truncated(value: Any, rng: random.Random) -> Any:
    if isinstance(value, dict):
        keys = list(value)[:rng.randrange(len(value))]
        return {k: value[k] for k in keys}
    return value[:rng.randrange(len(value))]


def flipped(value: Any, rng: random.Random) -> Any:
    if isinstance(value, bool):
        return not value
    if isinstance(value, int):
        return value ^ (1 << rng.randrange(max(8, value.bit_length() + 1)))
    if isinstance(value, float):
        (bits,) = struct.unpack("<Q", struct.pack("<d", value))
        return struct.unpack("<d", struct.pack("<Q", bits ^ (1 << rng.randrange(64))))[0]
    i = rng.randrange(len(value))
    return value[:i] + chr(ord(value[i]) ^ (1 << rng.randrange(7))) + value[i + 1:]


def _can_truncate(value: Any) -> bool:
    return isinstance(value, (str, list, tuple, dict)) and len(value) > 0


def _can_flip(value: Any) -> bool:
    return isinstance(value, (int, float)) or (isinstance(value, str) and len(value) > 0)


KINDS: dict[str, tuple[Callable[[Any], bool], Callable[[Any, random.Random], Any]]] = {
    "delete": (lambda value: True, lambda value, rng: REMOVE),
    "swap type": (lambda value: True, swapped),
    "truncate": (_can_truncate, truncated),
    "flip a bit": (_can_flip, flipped),
}


def damaged(state: dict[str, Any], rng: random.Random) -> tuple[str, dict[str, Any]]:
    """One random damage of ``state``, and what it was."""
    kind = rng.choice(sorted(KINDS))
    applies, damage = KINDS[kind]
    where = [p for p in places(state) if applies(value_at(state, p))]
    path = rng.choice(where)
    new = damage(value_at(state, path), rng)
    shown = "<deleted>" if new is REMOVE else repr(new)[:60]
    return f"{kind} at {'.'.join(map(str, path))} -> {shown}", edited(state, path, lambda _: new)


def try_load(load: Callable[[], None], what: str, as_before: Callable[[], bool]) -> tuple[bool, str | None]:
    """Load a damaged state (``what`` says how): whether it was accepted, and the failure if any.
    A refusal is ``IncompatibleStateError`` with the target as it was (``as_before()``); any other
    exception, or a refusal that changed the target, is a failure."""
    try:
        load()
    except IncompatibleStateError:
        return False, None if as_before() else f"{what}: refused, but it changed"
    except Exception as error:  # noqa: BLE001 - the failure a fuzz exists to find
        return False, f"{what}: {type(error).__name__}: {error}"[:300]
    return True, None
