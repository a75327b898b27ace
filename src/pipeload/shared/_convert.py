"""Finding the large lists and dicts a dataset holds: to share them, or to warn about them.

The search starts at the dataset and follows attributes (``vars()``) into anything that looks
like a dataset (an object with ``__getitem__`` or ``__iter__`` and a ``__dict__``), a few levels
deep. A small container that holds datasets (``ConcatDataset.datasets``) or large containers (the
dict ``json.load`` returns: ``{"images": [...], "annotations": [...]}``) is a *holder*: the search
goes into it, and what it holds is converted where it sits, never the holder itself (a shared
copy of it would pickle its members, then unpickle a whole dataset or list on every read). Only
exact ``list``, ``tuple`` and ``dict`` objects are considered: a subclass (``defaultdict``, a
custom list) may behave in ways a read-only copy would not.
"""

from __future__ import annotations

import warnings
import weakref
from dataclasses import dataclass
from itertools import islice
from types import ModuleType
from typing import Any

from pipeload._user_frame import first_frame_outside_pipeload
from pipeload.shared._mapping import SharedMapping
from pipeload.shared._sequence import SharedSequence

CONVERT_MIN_ITEMS = 10_000
"""share_containers' default: smaller containers cost workers little and stay as they are."""
WARN_MIN_OBJECTS = 1_000_000
"""Estimated Python objects in one container above which process workers get a warning."""
SAMPLE_ITEMS = 64  # items looked at to estimate how many objects each one holds
MAX_DEPTH = 4
MAX_HOLDER_ITEMS = 64  # a container this small may be a holder; a member this large is not small
_CONTAINERS = (list, tuple, dict)


class CopyOnReadWarning(UserWarning):
    """A dataset handed to worker processes holds millions of Python objects (pytorch#13246)."""


@dataclass(frozen=True)
class _Found:
    path: str  # how a user would spell it: "dataset.samples", "dataset.data['paths']"
    owner: Any  # the object whose attribute (or the holder whose item) it is; None for the dataset
    name: Any  # the attribute's name, or its key or index in the holder
    container: Any
    in_holder: bool = False

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


def _find_containers(dataset: Any) -> list[_Found]:
    if type(dataset) in _CONTAINERS:
        return [_Found("dataset", None, "", dataset)]
    found: list[_Found] = []
    _visit(dataset, "dataset", 0, found, set())
    return found


def _visit(obj: Any, path: str, depth: int, found: list[_Found], seen: set[int]) -> None:
    if id(obj) in seen or depth > MAX_DEPTH:
        return
    seen.add(id(obj))
    attributes = getattr(obj, "__dict__", None)
    if not isinstance(attributes, dict):
        return  # a range, a tensor, a class with __slots__: no attributes of ours to look at
    for name, value in list(attributes.items()):
        _consider(value, _Found(f"{path}.{name}", obj, name, value), depth, found, seen)


def _consider(value: Any, place: _Found, depth: int, found: list[_Found], seen: set[int]) -> None:
    """Record a container (or go into it, if it is a holder); go into a dataset."""
    if type(value) in _CONTAINERS:
        if not _visit_holder(value, place.path, depth, found, seen):
            found.append(place)
    elif _looks_like_dataset(value):
        _visit(value, place.path, depth + 1, found, seen)


def _visit_holder(container: Any, path: str, depth: int, found: list[_Found], seen: set[int]) -> bool:
    """Go into ``container`` if it is a holder (small, holding datasets or large containers)."""
    if id(container) in seen:
        return True  # a holder gone into already: held twice, or holding itself
    if len(container) > MAX_HOLDER_ITEMS or depth >= MAX_DEPTH:
        return False
    members = list(container.items() if type(container) is dict else enumerate(container))
    if not any(_looks_like_dataset(member) or (type(member) in _CONTAINERS and len(member) > MAX_HOLDER_ITEMS)
               for _, member in members):
        return False  # a small table of small things: converted (or not) as one container
    seen.add(id(container))
    for key, member in members:
        _consider(member, _Found(f"{path}[{key!r}]", container, key, member, in_holder=True), depth + 1, found, seen)
    return True


def _looks_like_dataset(value: Any) -> bool:
    if isinstance(value, (type, ModuleType)) or not isinstance(getattr(value, "__dict__", None), dict):
        return False
    kind = type(value)
    return hasattr(kind, "__getitem__") or hasattr(kind, "__iter__")


def estimated_objects(container: Any) -> int:
    """About how many Python objects ``container`` holds, from a sample of its first items."""
    length = len(container)
    if not length:
        return 0
    if type(container) is dict:
        sample, per_item = list(islice(container.values(), SAMPLE_ITEMS)), 2  # key and value
    else:
        sample, per_item = list(container[:SAMPLE_ITEMS]), 1
    inside = sum(_size(item) for item in sample) / len(sample)
    return int(length * (per_item + inside))


def _size(item: Any) -> int:
    kind = type(item)
    if kind is dict:
        return 2 * len(item)
    if kind in (list, tuple, set, frozenset):
        return len(item)
    return 0


class _WarnedDatasets:
    """Datasets already warned about, so each is named once however many loaders use it."""

    def __init__(self) -> None:
        self._weak: weakref.WeakSet[Any] = weakref.WeakSet()
        self._ids: set[int] = set()  # lists and dicts cannot be weakly referenced

    def first_time(self, dataset: Any) -> bool:
        try:
            if dataset in self._weak:
                return False
            self._weak.add(dataset)
        except TypeError:
            if id(dataset) in self._ids:
                return False
            self._ids.add(id(dataset))
        return True


_warned = _WarnedDatasets()


def warn_if_copy_on_read(dataset: Any, worker_type: str) -> None:
    """Warn (once per dataset) if process workers would copy its Python objects page by page."""
    if worker_type != "process":
        return  # thread workers share the main process's objects: nothing is copied
    try:
        found = _find_containers(dataset)
    except Exception:  # an advisory look must never stop a loader (a proxy's odd __getattr__, say)
        return
    heavy = [(item, n) for item in found if (n := estimated_objects(item.container)) > WARN_MIN_OBJECTS]
    if not heavy or not _warned.first_time(dataset):
        return
    warnings.warn(_message(heavy), CopyOnReadWarning, stacklevel=first_frame_outside_pipeload())


def _message(heavy: list[tuple[_Found, int]]) -> str:
    named = "; ".join(
        f"{found.path} is a {type(found.container).__name__} of {len(found.container):,} items "
        f"(about {objects:,} Python objects)"
        for found, objects in heavy
    )
    if heavy[0][0].owner is None:
        fix = f"pass {_shared_name(heavy[0][0].container)}(dataset) to the DataLoader instead"
    else:
        fix = ("call pipeload.share_containers(dataset) before iterating, or build those attributes "
               "as pipeload.SharedSequence / pipeload.SharedMapping")
    return (
        f"DataLoader worker processes will each end up with a private copy of this dataset's Python "
        f"objects: {named}. Under fork, merely reading an object writes its reference count and so "
        f"copies its memory page into the worker; spawn and forkserver pickle a whole copy into every "
        f"worker. Memory then grows with num_workers (pytorch#13246). To share one read-only copy, {fix}."
    )


