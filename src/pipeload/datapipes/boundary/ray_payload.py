"""Tensors through Ray's object store without copies.

Ray stores numpy arrays out of band and hands the reader a view of the store's shared memory;
a torch tensor it pickles into the stream, bytes and all (zero-copy tensors are a process-wide
opt-in there, ``RAY_ENABLE_ZERO_COPY_TORCH_TENSORS``, that also changes a user's other Ray
code). So an actor hands each large CPU tensor over as a flat uint8 numpy view of its bytes
(:func:`pack`), and the reading side makes a tensor of the same dtype and shape over the store's
memory (:func:`unpack`): no copy on either side but the one into the store.

The tensor read that way is the only reader of its object, which lives as long as the tensor;
it is writable (the store maps it read-write), so a training loop may change it in place.
"""

from __future__ import annotations

import copy
import warnings
from typing import Any, NamedTuple

import numpy as np
import torch

PACK_MIN_BYTES = 16 * 1024  # smaller tensors ride inside the pickle: a view costs more than it saves
MAX_DEPTH = 3
MAX_ITEMS_WALKED = 256  # a container bigger than this is data, not a sample's structure


class TensorBytes(NamedTuple):
    """A tensor as its bytes (a numpy view, stored out of band by Ray), dtype and shape."""

    data: np.ndarray
    dtype: torch.dtype
    shape: tuple[int, ...]


def pack(item: Any) -> tuple[Any, bool]:
    """``item`` with its large CPU tensors (inside lists, tuples and dicts, a few levels deep)
    replaced by :class:`TensorBytes`; and whether anything was replaced (else ``item`` itself).
    A tensor that shares its storage with another found in those containers stays for Ray's
    pickle (which keeps one tensor referenced twice as one; views of one storage it sends
    apart too). One also referenced from inside another object (an attribute) is not seen
    there, and arrives as two copies."""
    counts: dict[int, int] = {}
    _count_storages(item, counts, 0)
    shared = {pointer for pointer, count in counts.items() if count > 1}
    return _packed(item, 0, shared)


def _count_storages(item: Any, counts: dict[int, int], depth: int) -> None:
    if isinstance(item, torch.Tensor):
        if item.layout is torch.strided and item.device.type == "cpu":
            pointer = item.untyped_storage().data_ptr()
            counts[pointer] = counts.get(pointer, 0) + 1
        return
    if depth >= MAX_DEPTH:
        return
    if isinstance(item, (list, tuple)) and len(item) <= MAX_ITEMS_WALKED:
        for part in item:
            _count_storages(part, counts, depth + 1)
    elif isinstance(item, dict) and len(item) <= MAX_ITEMS_WALKED:
        for value in item.values():
            _count_storages(value, counts, depth + 1)


def _packed(item: Any, depth: int, shared: set[int]) -> tuple[Any, bool]:
    if isinstance(item, torch.Tensor):
        if (not _plain_bytes(item) or item.nbytes < PACK_MIN_BYTES
                or item.untyped_storage().data_ptr() in shared):
            return item, False
        flat = item.contiguous().reshape(-1)  # a copy only when it is not contiguous already
        return TensorBytes(flat.view(torch.uint8).numpy(), item.dtype, tuple(item.shape)), True
    if depth >= MAX_DEPTH:
        return item, False
    if isinstance(item, (list, tuple)) and len(item) <= MAX_ITEMS_WALKED:
        parts = [_packed(part, depth + 1, shared) for part in item]
        if not any(changed for _, changed in parts):
            return item, False
        values = [value for value, _ in parts]
        if isinstance(item, list):
            return values, True
        return (type(item)(*values) if hasattr(item, "_fields") else type(item)(values)), True
    if isinstance(item, dict) and len(item) <= MAX_ITEMS_WALKED:
        packed = {key: _packed(value, depth + 1, shared) for key, value in item.items()}
        if not any(changed for _, changed in packed.values()):
            return item, False
        return _same_mapping(item, {key: value for key, (value, _) in packed.items()}), True
    return item, False


def _plain_bytes(tensor: torch.Tensor) -> bool:
    """Whether ``tensor`` is all its bytes, dtype and shape say: a dense CPU tensor of torch's
    own class, with nothing a reader would have to know besides. A subclass (its class and
    attributes), a sparse, nested or quantized tensor (their layouts, scales), a conjugate or
    negative view (a bit on the tensor, not in its bytes) and one that requires grad travel in
    Ray's pickle whole, as torch pickles them."""
    return (type(tensor) is torch.Tensor and tensor.layout is torch.strided and tensor.device.type == "cpu"
            and not tensor.requires_grad and not tensor.is_quantized and not tensor.is_nested
            and not tensor.is_conj() and not tensor.is_neg() and _whole_and_dense(tensor))


def _whole_and_dense(tensor: torch.Tensor) -> bool:
    """Contiguous in the standard layout, over its whole storage: the bytes sent are the
    tensor. A channels-last tensor came back in the standard layout, and an expanded one (4
    bytes of storage seen as 16 MB) was sent as 16 MB; a view into a larger storage is left to
    torch's pickle too, as the rest of its storage is what its pickle carries."""
    return (tensor.is_contiguous() and tensor.storage_offset() == 0
            and tensor.untyped_storage().nbytes() == tensor.nbytes)


def _same_mapping(original: dict[Any, Any], values: dict[Any, Any]) -> dict[Any, Any]:
    """A mapping of ``original``'s class and attributes (a ``defaultdict``'s factory, which
    its class cannot be called without) holding ``values``."""
    if type(original) is dict:
        return values
    try:
        same = copy.copy(original)
        same.clear()
        same.update(values)
        return same
    except Exception:
        return values


def unpack(item: Any, depth: int = 0) -> Any:
    """The inverse of :func:`pack` for an item that :func:`pack` changed."""
    if isinstance(item, TensorBytes):
        with warnings.catch_warnings():
            # The store's memory reaches us read-only as numpy sees it; it is mapped writable
            # and this object is ours alone (see the module docstring).
            warnings.simplefilter("ignore", UserWarning)
            raw = torch.from_numpy(item.data)
        return raw.view(item.dtype).reshape(item.shape)
    if depth >= MAX_DEPTH:
        return item
    if isinstance(item, list):
        return [unpack(part, depth + 1) for part in item]
    if isinstance(item, tuple):
        values = [unpack(part, depth + 1) for part in item]
        return type(item)(*values) if hasattr(item, "_fields") else type(item)(values)
    if isinstance(item, dict):
        return _same_mapping(item, {key: unpack(value, depth + 1) for key, value in item.items()})
    return item
