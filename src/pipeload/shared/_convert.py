"""Finding the large lists and dicts a dataset holds: to share them, or to warn about them.

The search starts at the dataset and follows attributes (``vars()`` and ``__slots__``) into
anything that looks like a dataset (an object with ``__getitem__`` or ``__iter__`` and
attributes), a few levels deep. A small container that holds datasets (``ConcatDataset.datasets``) or large containers (the
dict ``json.load`` returns: ``{"images": [...], "annotations": [...]}``) is a *holder*: the search
goes into it, and what it holds is converted where it sits, never the holder itself (a shared
copy of it would pickle its members, then unpickle a whole dataset or list on every read). Only
exact ``list``, ``tuple`` and ``dict`` objects are converted: a subclass (``defaultdict``, a
custom list) may behave in ways a read-only copy would not.

The warning's search goes further, since it only names what to change: into helper objects that
are not datasets (``dataset.index = Index(paths)``), and it counts sets, subclasses and numpy
arrays of Python objects too, naming for each a container to build. It opens at most
``MAX_OPENED`` objects, so it stays cheap at iter() however wide the dataset's object graph.
"""

from __future__ import annotations

import functools
import warnings
import weakref
from dataclasses import dataclass
from itertools import islice
from types import ModuleType
from typing import Any

import numpy as np

from pipeload._user_frame import first_frame_outside_pipeload
from pipeload.shared._mapping import SharedMapping
from pipeload.shared._segment import SegmentBacked
from pipeload.shared._sequence import SharedSequence

CONVERT_MIN_ITEMS = 10_000
"""share_containers' default: smaller containers cost workers little and stay as they are."""
WARN_MIN_OBJECTS = 1_000_000
"""Estimated Python objects in one container above which process workers get a warning."""
SAMPLE_ITEMS = 64  # items looked at to estimate how many objects each one holds
MAX_DEPTH = 4
MAX_HOLDER_ITEMS = 64  # a container this small may be a holder; a member this large is not small
MAX_OPENED = 1_000  # objects whose attributes one search reads: a bound on what it costs at iter()
_CONTAINERS = (list, tuple, dict)
_UNSET = object()


class CopyOnReadWarning(UserWarning):
    """A dataset handed to worker processes holds millions of Python objects (pytorch#13246)."""


@dataclass(frozen=True)
class _Found:
    path: str  # how a user would spell it: "dataset.samples", "dataset.data['paths']"
    owner: Any  # the object whose attribute (or the holder whose item) it is; None for the dataset
    name: Any  # the attribute's name, or its key or index in the holder
    container: Any
    in_holder: bool = False
    in_helper: bool = False  # reached through an object that is not a dataset: not converted

    def replace_with(self, shared: Any) -> None:
        """Put ``shared`` where the container was (TypeError/AttributeError if it cannot go there)."""
        if not self.in_holder:
            setattr(self.owner, self.name, shared)
        elif type(self.owner) is tuple:
            raise TypeError(f"it sits in a tuple, whose items cannot be replaced; build it as "
                            f"{_shared_name(self.container)} instead")
        else:
            self.owner[self.name] = shared


def share_containers(dataset: Any, *, min_items: int = CONVERT_MIN_ITEMS) -> list[str]:
    """Replace a dataset's large list, tuple and dict attributes with shared containers, in place.

    Lists and tuples become :class:`SharedSequence`, dicts :class:`SharedMapping`, if they hold
    at least ``min_items`` items. Call it once, before the DataLoader starts its workers; the
    dataset code keeps working unchanged as long as it only reads those attributes. An attribute
    that cannot be converted (unpicklable items, unsupported dict keys, a read-only attribute) is
    left as it is, with a warning that says why. The same list held by two attributes (as
    torchvision's ``ImageFolder`` holds ``samples`` and ``imgs``) becomes one shared container.

    Args:
        dataset: the dataset; nested datasets (``Subset.dataset``, ``ConcatDataset.datasets``)
            are converted too.
        min_items: containers with fewer items are left alone.

    Returns:
        The converted attributes, e.g. ``["dataset.samples", "dataset.imgs"]``.

    Raises:
        TypeError: ``dataset`` is itself a list, tuple or dict (wrap it instead:
            ``SharedSequence(dataset)``), or ``min_items`` is not a non-negative int.

    Example:
        >>> share_containers(image_folder)
        ['dataset.samples', 'dataset.imgs', 'dataset.targets']
    """
    if type(min_items) is not int or min_items < 0:
        raise TypeError(f"min_items should be a non-negative integer, but got min_items={min_items!r}")
    if type(dataset) in _CONTAINERS:
        raise TypeError(
            f"share_containers cannot convert a dataset that is itself a {type(dataset).__name__}: "
            f"use {_shared_name(dataset)}(dataset) as the dataset instead"
        )
    shared_by_id: dict[int, Any] = {}
    converted = []
    for found in _find_containers(dataset):  # the list holds every container: ids stay unique
        if len(found.container) < min_items:
            continue
        try:
            shared = shared_by_id.get(id(found.container))
            if shared is None:
                shared = shared_by_id[id(found.container)] = _to_shared(found.container)
            found.replace_with(shared)
        except (TypeError, AttributeError) as exc:
            warnings.warn(f"share_containers left {found.path} as it is: {exc}",
                          stacklevel=first_frame_outside_pipeload())
            continue
        converted.append(found.path)
    return converted


def _to_shared(container: Any) -> Any:
    if type(container) is dict:
        return SharedMapping(container)
    return SharedSequence(container)


def _shared_name(container: Any) -> str:
    return "pipeload.SharedMapping" if type(container) is dict else "pipeload.SharedSequence"


def _find_containers(dataset: Any, *, into_helpers: bool = False) -> list[_Found]:
    """The containers the dataset holds, found as the module's note says.

    With ``into_helpers`` (the warning) the search also goes into objects that are not datasets
    (``dataset.index = Index(paths)``) and reports containers share_containers would not convert
    (sets, dict and list subclasses, numpy object arrays).
    """
    walk = _Walk(into_helpers)
    if type(dataset) in _CONTAINERS or (into_helpers and _is_container(dataset)):
        walk.found.append(_Found("dataset", None, "", dataset))
    else:
        walk.visit(dataset, "dataset", 0, in_helper=False)
    return walk.found


class _Walk:
    """One search: what it found, what it has been into, and how many objects it has opened.

    Invariant: ``opened`` never passes ``MAX_OPENED``, however wide the dataset's object graph,
    so the look the loader takes at iter() stays cheap.
    """

    def __init__(self, into_helpers: bool) -> None:
        self.into_helpers = into_helpers
        self.found: list[_Found] = []
        self.seen: set[int] = set()
        self.opened = 0

    def visit(self, obj: Any, path: str, depth: int, in_helper: bool) -> None:
        if id(obj) in self.seen or depth > MAX_DEPTH or self.opened >= MAX_OPENED:
            return
        self.seen.add(id(obj))
        self.opened += 1
        for name, value in _attributes(obj):
            self.consider(value, _Found(f"{path}.{name}", obj, name, value, in_helper=in_helper), depth)

    def consider(self, value: Any, place: _Found, depth: int) -> None:
        """Record a container (or go into it, if it is a holder); go into a dataset (or helper)."""
        if type(value) in _CONTAINERS:
            if not self.visit_holder(value, place, depth):
                self.found.append(place)
        elif _is_container(value):
            if self.into_helpers:
                self.found.append(place)
        elif _looks_like_dataset(value):
            self.visit(value, place.path, depth + 1, place.in_helper)
        elif self.into_helpers and _may_hold_containers(value):
            self.visit(value, place.path, depth + 1, in_helper=True)

    def visit_holder(self, container: Any, place: _Found, depth: int) -> bool:
        """Go into ``container`` if it is a holder (small, holding datasets or large containers)."""
        if id(container) in self.seen:
            return True  # a holder gone into already: held twice, or holding itself
        if len(container) > MAX_HOLDER_ITEMS or depth >= MAX_DEPTH:
            return False
        members = list(container.items() if type(container) is dict else enumerate(container))
        if not any(_looks_like_dataset(member) or (type(member) in _CONTAINERS and len(member) > MAX_HOLDER_ITEMS)
                   for _, member in members):
            return False  # a small table of small things: converted (or not) as one container
        self.seen.add(id(container))
        for key, member in members:
            inside = _Found(f"{place.path}[{key!r}]", container, key, member, in_holder=True, in_helper=place.in_helper)
            self.consider(member, inside, depth + 1)
        return True


def _attributes(obj: Any) -> list[tuple[str, Any]]:
    """``obj``'s attributes: its ``__dict__`` and its ``__slots__``, where set."""
    attributes = getattr(obj, "__dict__", None)
    pairs = list(attributes.items()) if isinstance(attributes, dict) else []
    for name in _slot_names(type(obj)):
        value = getattr(obj, name, _UNSET)
        if value is not _UNSET:
            pairs.append((name, value))
    return pairs


@functools.lru_cache(maxsize=256)
def _slot_names(kind: type) -> tuple[str, ...]:
    names = []
    for klass in kind.__mro__:
        slots = klass.__dict__.get("__slots__", ())
        for name in (slots,) if isinstance(slots, str) else slots:
            if name in ("__dict__", "__weakref__"):
                continue
            if name.startswith("__") and not name.endswith("__"):
                name = f"_{klass.__name__.lstrip('_')}{name}"  # stored under its mangled name
            names.append(name)
    return tuple(names)


def _is_container(value: Any) -> bool:
    """A list, tuple, dict or set (subclasses too), or a numpy array of Python objects."""
    if isinstance(value, SegmentBacked):
        return False
    if isinstance(value, np.ndarray):
        return value.dtype.hasobject
    return isinstance(value, (list, tuple, dict, set, frozenset))


def _may_hold_containers(value: Any) -> bool:
    """An object with attributes of its own: classes, modules and functions are not data."""
    if isinstance(value, (type, ModuleType, SegmentBacked)) or callable(getattr(value, "__get__", None)):
        return False  # a function or method (descriptors) belongs to code, not to the dataset
    return bool(getattr(value, "__dict__", None)) or bool(_slot_names(type(value)))


def _looks_like_dataset(value: Any) -> bool:
    if isinstance(value, (type, ModuleType, SegmentBacked)):
        return False
    kind = type(value)
    has_attributes = isinstance(getattr(value, "__dict__", None), dict) or bool(_slot_names(kind))
    return has_attributes and (hasattr(kind, "__getitem__") or hasattr(kind, "__iter__"))


def estimated_objects(container: Any) -> int:
    """About how many Python objects ``container`` holds, from a sample of its first items."""
    if isinstance(container, np.ndarray):
        length, sample, per_item = container.size, islice(container.flat, SAMPLE_ITEMS), 1
    elif isinstance(container, dict):
        length, sample, per_item = len(container), islice(container.values(), SAMPLE_ITEMS), 2  # key and value
    else:
        length, sample, per_item = len(container), islice(container, SAMPLE_ITEMS), 1
    sizes = [_size(item) for item in sample]
    if not length or not sizes:
        return 0
    return int(length * (per_item + sum(sizes) / len(sizes)))


def _size(item: Any) -> int:
    kind = type(item)
    if kind is dict:
        return 2 * len(item)
    if kind in (list, tuple, set, frozenset):
        return len(item)
    return 0


class _WarnedDatasets:
    """Datasets already warned about, so each is named once however many loaders use it.

    Known by identity, not by ``==`` (two equal datasets are two datasets), and forgotten when
    collected, so that a new dataset given a freed one's ``id()`` is warned about too. A list or
    dict cannot be referenced weakly: it is known by its id and length, which a new one of the
    same length at the same address would match (it is then not named again)."""

    def __init__(self) -> None:
        self._weak: dict[int, weakref.ref[Any]] = {}
        self._plain: set[tuple[int, int]] = set()

    def first_time(self, dataset: Any) -> bool:
        key = id(dataset)
        try:
            known = self._weak.get(key)
            if known is not None and known() is dataset:
                return False
            self._weak[key] = weakref.ref(dataset, lambda _ref, key=key: self._forget(key, _ref))
        except TypeError:
            plain = (key, _length(dataset))
            if plain in self._plain:
                return False
            self._plain.add(plain)
        return True

    def _forget(self, key: int, ref: weakref.ref[Any]) -> None:
        if self._weak.get(key) is ref:
            del self._weak[key]


def _length(dataset: Any) -> int:
    try:
        return len(dataset)
    except Exception:
        return -1


_warned = _WarnedDatasets()


def warn_if_copy_on_read(dataset: Any, worker_type: str) -> None:
    """Warn (once per dataset) if process workers would copy its Python objects page by page."""
    if worker_type != "process":
        return  # thread workers share the main process's objects: nothing is copied
    try:
        found = _find_containers(dataset, into_helpers=True)
    except Exception:  # an advisory look must never stop a loader (a proxy's odd __getattr__, say)
        return
    heavy = [(item, n) for item in found if (n := estimated_objects(item.container)) > WARN_MIN_OBJECTS]
    if not heavy or not _warned.first_time(dataset):
        return
    warnings.warn(_message(heavy), CopyOnReadWarning, stacklevel=first_frame_outside_pipeload())


def _message(heavy: list[tuple[_Found, int]]) -> str:
    named = "; ".join(
        f"{found.path} is a {_kind_name(found.container)} of {_length(found.container):,} items "
        f"(about {objects:,} Python objects)"
        for found, objects in heavy
    )
    return (
        f"DataLoader worker processes will each end up with a private copy of this dataset's Python "
        f"objects: {named}. Under fork, merely reading an object writes its reference count and so "
        f"copies its memory page into the worker; spawn and forkserver pickle a whole copy into every "
        f"worker. Memory then grows with num_workers (pytorch#13246). To share one read-only copy, "
        f"{'; '.join(_fixes([found for found, _ in heavy]))}."
    )


def _fixes(heavy: list[_Found]) -> list[str]:
    """What to do: share_containers where it would convert them, a container to build otherwise."""
    if heavy[0].owner is None:
        return [_build_as(heavy[0].container, "dataset", "pass {}") + " to the DataLoader instead"]
    fixes = []
    if any(_convertible(found) for found in heavy):
        fixes.append("call pipeload.share_containers(dataset) before iterating, or build those attributes "
                     "as pipeload.SharedSequence / pipeload.SharedMapping")
    fixes.extend(_build_as(found.container, found.path, "build " + found.path + " as {}")
                 for found in heavy if not _convertible(found))
    return fixes


def _convertible(found: _Found) -> bool:
    """Whether share_containers would convert it: an exact list, tuple or dict of a dataset."""
    return type(found.container) in _CONTAINERS and not found.in_helper


def _build_as(container: Any, name: str, template: str) -> str:
    kind = type(container)
    if kind in _CONTAINERS:
        fix = template.format(f"{_shared_name(container)}({name})")
        return fix if name == "dataset" else fix + " (share_containers only goes into datasets' attributes)"
    if isinstance(container, np.ndarray):
        return template.format(f"pipeload.SharedSequence({name}.tolist())")
    if isinstance(container, (set, frozenset)):
        return template.format(f"pipeload.SharedMapping(dict.fromkeys({name})), whose `in` works the same")
    if isinstance(container, dict):
        return template.format(f"pipeload.SharedMapping(dict({name}))") + (
            " (a missing key then raises KeyError instead of getting a default)" if hasattr(container, "default_factory") else "")
    return template.format(f"pipeload.SharedSequence(list({name}))")


def _kind_name(container: Any) -> str:
    if isinstance(container, np.ndarray):
        return f"numpy array of {container.dtype}"
    return type(container).__name__


def _length(container: Any) -> int:
    return container.size if isinstance(container, np.ndarray) else len(container)
