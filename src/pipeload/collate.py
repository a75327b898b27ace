"""Turning a list of samples into one batch, and numpy values into tensors.

``collate`` walks the structure of the first sample and recurses into mappings, namedtuples and
sequences; at each leaf it asks a type -> function map what to do (stack tensors, wrap numbers,
keep strings). The behaviour follows ``torch.utils.data.default_collate`` so the same samples give
the same batches, with four deliberate differences:

* a ragged batch (tensors of different shapes) fails with a ``RuntimeError`` that starts with
  torch.stack's message and goes on to name the field and the two shapes;
* a value no handler takes (a PIL image, ``None``, a text array) fails with a ``TypeError``
  that starts with torch's sentence and goes on to name the field and what to return instead;
* each element is collated once: a failure inside a container is not retried through the
  container's fallback path, so custom collate functions are never called twice for one field;
* ``default_convert`` leaves numpy ``bytes_`` scalars alone, as it does ``str_`` (torch raises).

Inside a worker process stacked tensors are written straight into the shared memory the batch
travels in (see ``transport/collate_output.py``), so the engine hands them over without a copy.
"""

from __future__ import annotations

import contextlib
import copy
import math
import re
import sys
import threading
from collections.abc import Callable, Iterator, Mapping, MutableMapping, MutableSequence, Sequence
from typing import Any

import numpy as np
import torch
from torch.utils.data import get_worker_info as _torch_worker_info

from pipeload.engine.worker_info import get_worker_info
from pipeload.transport.collate_output import (
    copied_into_message,
    own_memory_output,
    shared_output,
    stacked_in_place,
)

__all__ = [
    "CollateFnMap",
    "collate",
    "collate_float_fn",
    "collate_int_fn",
    "collate_numpy_array_fn",
    "collate_numpy_scalar_fn",
    "collate_str_fn",
    "collate_tensor_fn",
    "default_collate",
    "default_collate_fn_map",
    "default_convert",
    "rebuild_mapping",
    "rebuild_sequence",
]


# A handler is called as ``handler(batch, collate_fn_map=collate_fn_map)``.
CollateFnMap = dict[type | tuple[type, ...], Callable[..., Any]]

# The wording (and the "found {}" slot) matches torch so that code matching on it keeps working.
_UNSUPPORTED_TYPE_MESSAGE = (
    "default_collate: batch must contain tensors, numpy arrays, numbers, dicts or lists; found {}"
)

# numpy dtype strings that mark text or object arrays, which have no tensor equivalent.
_TEXT_OR_OBJECT_DTYPE = re.compile(r"[SaUO]")

# numpy scalar type names that default_convert leaves alone (text, not numbers).
_NUMPY_TEXT_SCALARS = frozenset({"str_", "string_", "bytes_"})

_SPARSE_LAYOUTS = frozenset(
    {torch.sparse_coo, torch.sparse_csr, torch.sparse_csc, torch.sparse_bsr, torch.sparse_bsc}
)


# --- where in the sample we are: only read when an error message needs it -------------------


class _FieldPath(threading.local):
    """The chain of keys from the batch root to the field being collated, per thread."""

    def __init__(self) -> None:
        self.steps: list[tuple[bool, Any]] = []  # (is_attribute, key)


_field_path = _FieldPath()


def _describe_field() -> str:
    steps = _field_path.steps
    if not steps:
        return "the top level of the batch"
    parts = [f".{key}" if is_attribute else f"[{key!r}]" for is_attribute, key in steps]
    return "field " + "".join(parts)


def _unsupported_type(found: Any, values: str, collate_fn_map: CollateFnMap | None,
                      instead: str, note: str = "") -> TypeError:
    """torch's sentence for a leaf no handler takes, then where it sits and what to do instead.

    torch's sentence names the type alone: a newcomer whose dataset returns PIL images, or
    ``None`` for a sample it could not read, is left to guess which field and what to change.
    """
    if collate_fn_map is default_collate_fn_map:
        remedy = f"{instead}, or pass a collate_fn that handles them{note}"
    else:  # the caller's own map: its handlers, not the dataset, are what is missing
        remedy = "give collate_fn_map a handler for their type, or convert them before collating"
    return TypeError(
        f"{_UNSUPPORTED_TYPE_MESSAGE.format(found)} (pipeload: the values at {_describe_field()} "
        f"are {values}: {remedy})"
    )


def _unsupported_leaf(elem: Any, collate_fn_map: CollateFnMap | None) -> TypeError:
    kind = type(elem)
    name = kind.__qualname__ if kind.__module__ == "builtins" else f"{kind.__module__}.{kind.__qualname__}"
    instead = ("return tensors, numbers, strings or numpy arrays of numbers (in dicts, lists or "
               "tuples) from the dataset's __getitem__")
    note = ("; for PIL images, torchvision's transforms.PILToTensor() or ToTensor() makes the tensor"
            if kind.__module__.startswith("PIL.") else "")
    return _unsupported_type(kind, "None" if elem is None else f"of type {name}", collate_fn_map, instead,
                             note)


def _collate_field(
    samples: Sequence[Any],
    key: Any,
    collate_fn_map: CollateFnMap | None,
    *,
    is_attribute: bool = False,
) -> Any:
    """Collate one field of every sample, remembering the field's key for error messages."""
    steps = _field_path.steps
    steps.append((is_attribute, key))
    try:
        return collate(samples, collate_fn_map=collate_fn_map)
    finally:
        steps.pop()


# --- rebuilding containers with their original type ---------------------------------------


def rebuild_mapping(template: Mapping[Any, Any], values: dict[Any, Any]) -> Mapping[Any, Any]:
    """Return ``values`` in a mapping of ``template``'s type when that type allows it.

    Mutable mappings are shallow-copied and updated, which keeps extra state such as a
    ``defaultdict``'s factory; immutable ones are built from a dict; a plain ``dict`` is the
    fallback when either way raises ``TypeError``.
    """
    try:
        if isinstance(template, MutableMapping):
            clone = copy.copy(template)
            clone.update(values)
            return clone
        return type(template)(values)  # type: ignore[call-arg]
    except TypeError:
        return values


def rebuild_sequence(template: Sequence[Any], values: list[Any]) -> Sequence[Any]:
    """Return ``values`` in a sequence of ``template``'s type when that type allows it.

    Mutable sequences are shallow-copied and assigned item by item; others are built from a
    list; a plain ``list`` is the fallback when either way raises ``TypeError`` (e.g. ``range``).
    """
    try:
        if isinstance(template, MutableSequence):
            clone = copy.copy(template)
            for index, value in enumerate(values):
                clone[index] = value
            return clone
        return type(template)(values)  # type: ignore[call-arg]
    except TypeError:
        return values


def _is_namedtuple(value: object) -> bool:
    return isinstance(value, tuple) and hasattr(value, "_fields")


# --- default_convert ----------------------------------------------------------------------


def default_convert(data: Any) -> Any:
    """Turn numpy arrays and numpy scalars inside ``data`` into tensors; leave the rest.

    Used when automatic batching is off. Mappings, namedtuples and sequences are walked and keep
    their type where it can be rebuilt; plain tuples become lists (as in torch). Text and object
    numpy arrays, and numpy text scalars, are returned unchanged.

    Args:
        data: one sample of any structure.

    Returns:
        The same structure with numpy values replaced by tensors.

    Example:
        >>> default_convert({"x": np.array([1, 2]), "name": "a"})
        {'x': tensor([1, 2]), 'name': 'a'}
    """
    if isinstance(data, torch.Tensor):
        return data
    data_type = type(data)
    if data_type.__module__ == "numpy" and data_type.__name__ not in _NUMPY_TEXT_SCALARS:
        if data_type.__name__ == "ndarray" and _TEXT_OR_OBJECT_DTYPE.search(data.dtype.str):
            return data
        return torch.as_tensor(data)
    if isinstance(data, Mapping):
        return rebuild_mapping(data, {key: default_convert(data[key]) for key in data})
    if _is_namedtuple(data):
        return data_type(*(default_convert(item) for item in data))
    if isinstance(data, tuple):
        return [default_convert(item) for item in data]
    if isinstance(data, Sequence) and not isinstance(data, (str, bytes)):
        return rebuild_sequence(data, [default_convert(item) for item in data])
    return data


# --- collate: the structural walk -----------------------------------------------------------


def _find_handler(elem: Any, collate_fn_map: CollateFnMap) -> Callable[..., Any] | None:
    """The handler for ``elem``: an exact type match first, then the first ``isinstance`` key."""
    handler = collate_fn_map.get(type(elem))
    if handler is not None:
        return handler
    for key, candidate in collate_fn_map.items():
        if isinstance(elem, key):
            return candidate
    return None


def _registered_with_torch(elem: Any) -> Callable[..., Any] | None:
    """A handler that a library registered in torch's ``default_collate_fn_map`` (a separate
    dict from ours) for ``elem``'s type, so that ``default_collate`` takes it as torch's does.

    Asked for every dict, list or tuple of a sample: the keys ours lacks are found again only
    when torch's map has changed its length or its last key, so the usual answer (none) costs
    that check."""
    torch_collate = sys.modules.get("torch.utils.data._utils.collate")
    torch_map = getattr(torch_collate, "default_collate_fn_map", None)
    if not torch_map:
        return None
    seen, keys = _torch_only_keys
    shape = (len(torch_map), next(reversed(torch_map)))  # a registration adds its key last
    if seen != shape:
        keys = tuple(key for key in torch_map if key not in default_collate_fn_map)
        _torch_only_keys[:] = [shape, keys]
    if not keys:
        return None
    return _find_handler(elem, {key: torch_map[key] for key in keys if key in torch_map})


_torch_only_keys: list[Any] = [None, ()]  # torch's map's (length, last key) when last read, its keys ours lacks


def collate(batch: Sequence[Any], *, collate_fn_map: CollateFnMap | None = None) -> Any:
    """Combine a list of samples into one batch, dispatching leaves through ``collate_fn_map``.

    The first sample decides the structure. Its type is looked up in ``collate_fn_map`` exactly,
    then against each key in insertion order with ``isinstance`` (keys may be tuples of types);
    a handler is called as ``handler(batch, collate_fn_map=collate_fn_map)``. Otherwise mappings
    are collated key by key, namedtuples field by field and sequences position by position.

    Args:
        batch: the samples, all shaped like the first one.
        collate_fn_map: type -> handler; ``None`` means structure only, no leaf handlers.

    Returns:
        The batch, with the structure of one sample.

    Raises:
        RuntimeError: sequences of different lengths, or tensors of different shapes (the
            message names the field and the shapes).
        TypeError: a leaf type that no handler accepts.

    Example:
        >>> collate([{"x": 1}, {"x": 2}], collate_fn_map=default_collate_fn_map)
        {'x': tensor([1, 2])}
    """
    elem = batch[0]
    if collate_fn_map is not None:
        handler = _find_handler(elem, collate_fn_map)
        if handler is None and collate_fn_map is default_collate_fn_map:
            handler = _registered_with_torch(elem)
        if handler is not None:
            return handler(batch, collate_fn_map=collate_fn_map)
    if isinstance(elem, Mapping):
        values = {key: _collate_field([s[key] for s in batch], key, collate_fn_map) for key in elem}
        return rebuild_mapping(elem, values)
    if _is_namedtuple(elem):
        fields = zip(elem._fields, zip(*batch))
        return type(elem)(
            *(_collate_field(s, name, collate_fn_map, is_attribute=True) for name, s in fields)
        )
    if isinstance(elem, Sequence):
        return _collate_sequences(batch, elem, collate_fn_map)
    raise _unsupported_leaf(elem, collate_fn_map)


def _collate_sequences(
    batch: Sequence[Any], elem: Sequence[Any], collate_fn_map: CollateFnMap | None
) -> Any:
    expected = len(elem)
    if not all(len(sample) == expected for sample in batch):
        index = next(i for i, sample in enumerate(batch) if len(sample) != expected)
        raise RuntimeError(
            "each element in list of batch should be of equal size "
            f"(at {_describe_field()}: sample 0 has {expected} elements, "
            f"sample {index} has {len(batch[index])})"
        )
    # Each position's samples arrive as a tuple, as in torch: a field of strings therefore comes
    # back as a tuple of strings, not a list.
    values = [
        _collate_field(samples, position, collate_fn_map)
        for position, samples in enumerate(zip(*batch))
    ]
    if isinstance(elem, tuple):
        return values  # torch turns tuples into lists; kept for compatibility
    return rebuild_sequence(elem, values)


# --- leaf handlers --------------------------------------------------------------------------


def _shared_output_like(batch: Sequence[torch.Tensor]) -> torch.Tensor | None:
    """Inside a worker process, room for the stacked batch in the memory it will travel in
    (ordinary memory when it is small enough to travel inside the message); in a thread worker,
    ordinary memory; where the main process collates as a worker (``collating_as_a_worker``),
    memory of its own (``own_memory_output``); None elsewhere (without workers). Stacked into it, the batch has the first sample's dtype
    (float64 samples among float32 ones are cast) and samples that require grad are refused, as
    in torch's worker processes; stacked without, torch promotes the dtype, as torch's loader
    does without workers."""
    elem = batch[0]
    if elem.device.type != "cpu":
        return None
    shape = (len(batch), *elem.shape)
    out = shared_output(shape, elem.dtype)
    if out is not None:
        return out
    info = get_worker_info()  # once: the inline path asks for every tensor of every batch
    if _torch_worker_info() is not None or (info is not None and not _is_thread_worker(info)):
        return _fresh_shared_output(shape, elem.dtype)
    if _COLLATING.as_a_worker:
        return own_memory_output(shape, elem.dtype)
    if info is not None:
        return torch.empty(shape, dtype=elem.dtype)
    return None


class _Collating(threading.local):
    as_a_worker = False


_COLLATING = _Collating()


@contextlib.contextmanager
def collating_as_a_worker() -> Iterator[None]:
    """``default_collate`` stacks as in a worker while the block runs: economic mode's main
    process collating a batch its item workers fetched (the session's first), whose dtype was
    the promoted one, float64 among float32 samples, where batch workers (and torch's workers)
    give the first sample's: a batch's dtype changed with its place and ``num_workers``
    (stop 53's economic skeptic)."""
    before, _COLLATING.as_a_worker = _COLLATING.as_a_worker, True
    try:
        yield
    finally:
        _COLLATING.as_a_worker = before


def _is_thread_worker(info: Any) -> bool:
    """Whether ``get_worker_info()``'s ``info`` is a thread worker's (a process worker, or code
    posing as one, see ``pipeload._utils.worker``, stacks into shared memory)."""
    return getattr(info, "worker_method", "multiprocessing") == "thread"


def _fresh_shared_output(shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
    """A contiguous tensor in new shared memory: where torch's collate stacks inside torch's own
    worker processes (pipeload's collate given to torch's DataLoader, as accelerate rebuilds a
    loader). Its batches then have torch's strides (contiguous, whatever the samples' memory
    format), samples that require grad are refused with torch's words instead of making a batch
    torch's result queue cannot send, and the queue moves no memory."""
    storage = torch.UntypedStorage._new_shared(math.prod(shape) * dtype.itemsize)
    return torch.empty((0,), dtype=dtype).set_(storage, 0, shape)


def _first_shape_mismatch(batch: Sequence[Any]) -> int | None:
    expected = batch[0].shape
    for index, sample in enumerate(batch):
        if getattr(sample, "shape", expected) != expected:
            return index
    return None


def collate_tensor_fn(
    batch: Sequence[torch.Tensor], *, collate_fn_map: CollateFnMap | None = None
) -> torch.Tensor:
    """Stack tensors along a new first dimension (into shared memory inside a worker)."""
    elem = batch[0]
    if elem.is_nested:
        raise RuntimeError(
            "Batches of nested tensors are not currently supported by the default collate_fn; "
            "please provide a custom collate_fn to handle them appropriately."
        )
    if elem.layout in _SPARSE_LAYOUTS:
        raise RuntimeError(
            "Batches of sparse tensors are not currently supported by the default collate_fn; "
            "please provide a custom collate_fn to handle them appropriately. (pipeload: got "
            f"layout {elem.layout})"
        )
    if elem.device.type == "cpu" and (placed := stacked_in_place(list(batch))) is not None:
        return placed
    try:
        return torch.stack(batch, 0, out=_shared_output_like(batch))  # type: ignore[arg-type]
    except RuntimeError as error:
        odd = _first_shape_mismatch(batch)
        if odd is None:
            raise
        # torch.stack's own sentence first: code written for torch matches it.
        raise RuntimeError(
            f"{error} (pipeload: collate cannot stack the tensors at {_describe_field()} because "
            f"their shapes differ: {batch[0].shape} vs {batch[odd].shape} at sample {odd} "
            "(sample 0 sets the expected shape). Pad or crop samples to one shape, or pass a "
            "collate_fn that handles ragged data.)"
        ) from error


def collate_numpy_array_fn(
    batch: Sequence[np.ndarray], *, collate_fn_map: CollateFnMap | None = None
) -> Any:
    """Turn numpy arrays into tensors and collate those; text and object arrays are refused."""
    dtype = batch[0].dtype
    if _TEXT_OR_OBJECT_DTYPE.search(dtype.str) is not None:
        kind = "objects" if dtype.kind == "O" else "text"
        raise _unsupported_type(dtype, f"numpy arrays of {kind} (dtype {dtype.str})", collate_fn_map,
                                "numpy arrays of text or objects have no tensor form: convert them "
                                "to numbers, or to Python strings with .tolist()")
    return collate([torch.as_tensor(array) for array in batch], collate_fn_map=collate_fn_map)


def collate_numpy_scalar_fn(
    batch: Sequence[np.generic], *, collate_fn_map: CollateFnMap | None = None
) -> torch.Tensor:
    """One tensor from numpy scalars (numpy's dtype is kept)."""
    return torch.as_tensor(batch)


def collate_float_fn(
    batch: Sequence[float], *, collate_fn_map: CollateFnMap | None = None
) -> torch.Tensor:
    """Python floats become a float64 tensor (not the default float32)."""
    return torch.tensor(batch, dtype=torch.float64)


_PLAIN_INT = frozenset({int})


def collate_int_fn(
    batch: Sequence[int], *, collate_fn_map: CollateFnMap | None = None
) -> torch.Tensor:
    """Python ints become an int64 tensor; bools (an int subclass) a bool tensor."""
    # A bytes object iterates as ints, but numpy reads it as the text of a number: torch's
    # tensor() refuses it as torch's collate does.
    if not isinstance(batch, (bytes, bytearray)) and set(map(type, batch)) <= _PLAIN_INT:
        try:
            # Through numpy: several times faster than torch.tensor on a list for the same result.
            array = np.array(batch, dtype=np.int64)
        except OverflowError:
            pass  # beyond int64: torch.tensor raises its own error
        else:
            # In a process worker the batch is copied into its message anyway: skip torch's copy.
            return torch.from_numpy(array) if copied_into_message() else torch.tensor(array)
    return torch.tensor(batch)


def collate_str_fn(
    batch: Sequence[str | bytes], *, collate_fn_map: CollateFnMap | None = None
) -> Sequence[str | bytes]:
    """Strings and bytes stay as they are, in the batch's list."""
    return batch


# Insertion order matters for the isinstance pass: numpy scalars before float (np.float64 is a
# float subclass), and int after them so bools reach it as ints.
default_collate_fn_map: CollateFnMap = {
    torch.Tensor: collate_tensor_fn,
    np.ndarray: collate_numpy_array_fn,
    (np.bool_, np.number, np.object_): collate_numpy_scalar_fn,
    float: collate_float_fn,
    int: collate_int_fn,
    str: collate_str_fn,
    bytes: collate_str_fn,
}

# What default_collate_fn_map holds until a user changes it (see collates_as_shipped).
_SHIPPED_HANDLERS: CollateFnMap = dict(default_collate_fn_map)


def collates_as_shipped() -> bool:
    """Whether ``default_collate_fn_map`` holds exactly the handlers pipeload ships with.

    A classic worker writes samples into their rows of the batch's slab as it fetches them only
    while this holds: a handler a user adds or swaps in (torch's way to extend
    ``default_collate``) must be given the dataset's own objects, as torch gives it.
    """
    return default_collate_fn_map == _SHIPPED_HANDLERS


def default_collate(batch: Sequence[Any]) -> Any:
    """Collate samples into a batch with the default handlers, as ``torch.utils.data`` does.

    Tensors are stacked, numpy arrays and numbers become tensors (floats as float64), strings
    and bytes stay lists, and mappings, namedtuples and sequences are collated field by field
    (plain tuples come back as lists). Extend it by adding entries to ``default_collate_fn_map``.

    Args:
        batch: the samples, all shaped like the first one.

    Returns:
        The batch, with the structure of one sample.

    Raises:
        RuntimeError: ragged sequences or tensors; the message names the field and shapes.
        TypeError: a type with no handler.

    Example:
        >>> default_collate([(torch.zeros(2), 1), (torch.ones(2), 2)])
        [tensor([[0., 0.],
                [1., 1.]]), tensor([1, 2])]
    """
    return collate(batch, collate_fn_map=default_collate_fn_map)
