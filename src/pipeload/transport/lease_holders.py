"""A slab's lease kept for as long as the storages handed out over it live, whatever memory they
hold by then.

A batch's tensors view their slab through storages that hold the lease; when the last of them
goes, the slab is released and a later batch is written there. Storages are not the only way to
the bytes, though: ``tensor.numpy()``, a ``memoryview`` of it or a DLPack capsule hold the tensor
and its raw address, not its storage. And ``share_memory_()`` (which a ``torch.multiprocessing``
queue calls on every tensor it sends) moves a storage that is not in shared memory as torch
counts it, ours included, into new memory in place: the storage lets go of the slab while the
tensor, and every raw address taken from it before, lives on. Those addresses then read the next
batch written into the slab (a review saw it: a numpy array of batch 2 read batch 9's values).

So each storage made over a slab also keeps its lease until the storage itself goes, by a weak
reference to its Python object: torch keeps that object for as long as the storage lives (a
numpy array of a batch holds a tensor that shares it, a DLPack capsule a tensor too), and moving
it to shared memory swaps its memory but keeps the storage. A tensor built afresh from a batch
(``clone()``, arithmetic) holds nothing of it. Costs a weak reference per storage made over a
slab, a handful a batch.
"""

from __future__ import annotations

import weakref
from typing import Any

import torch

from pipeload._interrupts import ctrl_c_kept_in_weakref_callback

# id of the weak reference -> (the weak reference, the lease). A weak reference dies with its
# storage, and its callback lets go of the lease; the dict only keeps both reachable meanwhile.
_KEPT: dict[int, tuple[weakref.ref[Any], Any]] = {}


def keep_lease_with(storage: torch.UntypedStorage, lease: Any) -> None:
    """Keep ``lease`` (a slab's per-batch view) until ``storage`` is gone."""
    held = weakref.ref(storage, _LET_GO)
    _KEPT[id(held)] = (held, lease)


def _let_go(held: weakref.ref[Any]) -> None:
    _KEPT.pop(id(held), None)  # twice (after a Ctrl-C) is the same as once


# Run as batches die, many times a second: where a Ctrl-C pressed during a loop may land.
_LET_GO = ctrl_c_kept_in_weakref_callback(_let_go)


def leases_kept() -> int:
    """How many storages keep a lease now (for tests)."""
    return len(_KEPT)
