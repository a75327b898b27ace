"""A state's digest: what tells a damaged but well-formed checkpoint from a real one.

Field checks catch a state that cannot be one (a count that is text, a truncated generator
state); they cannot catch a value that is wrong yet well-formed: a bit flip turning ``consumed``
5 into 4, a changed byte inside a generator state, an edited shuffle buffer. Each state pipeload
makes (the loader's, a sampler's) therefore carries ``"digest"``: SHA-256 of its other fields,
taken over a canonical form, and loading recomputes it.

The canonical form is what survives the ways users keep states: JSON (tuples become lists, int
keys become text) and ``torch.save`` (tuples and tensors kept) give the same digest. It covers
None, bools, ints, floats, text, bytes, lists, tuples, dicts, tensors and numpy arrays (dtype,
shape, bytes); any other object in a dataset's own state is covered by its type name only.

What it protects against: accidental change after ``state_dict()`` made the state (storage or
transfer damage, a truncated value, a field lost, retyped or edited, parts of two states put
together). What it does not: a deliberate edit (anyone can compute it again; it is a checksum,
not a signature), or another dataset with the same shape (``config`` covers the shape only).
"""

from __future__ import annotations

import hashlib
from collections.abc import Callable
from typing import Any

import torch

from pipeload.errors import IncompatibleStateError, bad_state_field

DIGEST_FIELD = "digest"
_PREFIX = "sha256:"


def digest_of(state: dict[str, Any]) -> str:
    """``"sha256:<hex>"`` over the canonical form of ``state`` without its digest field."""
    hasher = hashlib.sha256()
    _feed(hasher.update, {k: v for k, v in state.items() if k != DIGEST_FIELD})
    return _PREFIX + hasher.hexdigest()


def sealed(state: dict[str, Any]) -> dict[str, Any]:
    """``state`` with its digest set (in place; returned for convenience)."""
    state.pop(DIGEST_FIELD, None)
    state[DIGEST_FIELD] = digest_of(state)
    return state


def check_digest(state: dict[str, Any], path: str = "") -> None:
    """Refuse ``state`` unless its content is what its digest was taken over.

    Raises:
        IncompatibleStateError: the digest is not ours, or the content changed since.
    """
    where = f"{path}.{DIGEST_FIELD}" if path else DIGEST_FIELD
    saved = state.get(DIGEST_FIELD)
    if not isinstance(saved, str) or not saved.startswith(_PREFIX) or len(saved) != len(_PREFIX) + 64:
        raise bad_state_field(where, saved, "'sha256:' and 64 hex digits, as state_dict() writes it")
    computed = digest_of(state)
    if saved != computed:
        owner = f"the state's {path}" if path else "the state"
        raise IncompatibleStateError(
            f"cannot load this state: {owner} does not match its digest ({where}={saved[:19]}..., "
            f"the content gives {computed[:19]}...): it was changed after state_dict() made it (a "
            "damaged file, or a field lost or edited), so it may resume at another place or in "
            "another order. Load an earlier checkpoint")


def _feed(update: Callable[[bytes], Any], value: Any) -> None:
    """Write ``value`` to ``update`` unambiguously: a type tag, a length where one is needed,
    the content (JSON-equivalent values write the same bytes)."""
    if value is None or isinstance(value, bool):
        update({None: b"N", True: b"T", False: b"F"}[value])
    elif isinstance(value, int):
        update(b"i%d;" % value)
    elif isinstance(value, float):
        update(b"f" + repr(value).encode() + b";")
    elif isinstance(value, str):
        _feed_bytes(update, b"s", value.encode("utf-8", "surrogatepass"))
    elif isinstance(value, (bytes, bytearray, memoryview)):
        _feed_bytes(update, b"b", bytes(value))
    elif isinstance(value, (list, tuple)):
        update(b"l%d:" % len(value))
        for item in value:
            _feed(update, item)
    elif isinstance(value, dict):
        items = sorted(((str(k), v) for k, v in value.items()), key=lambda item: item[0])
        update(b"d%d:" % len(items))
        for key, item in items:
            _feed(update, key)
            _feed(update, item)
    else:
        _feed_other(update, value)


def _feed_bytes(update: Callable[[bytes], Any], tag: bytes, data: bytes) -> None:
    update(tag + b"%d:" % len(data))
    update(data)


def _feed_other(update: Callable[[bytes], Any], value: Any) -> None:
    if isinstance(value, torch.Tensor):
        update(b"t" + f"{value.dtype}{tuple(value.shape)}".encode())
        _feed_bytes(update, b"", _tensor_bytes(value))
        return
    if type(value).__module__ == "numpy" and callable(getattr(value, "tobytes", None)):
        update(b"a" + f"{getattr(value, 'dtype', '')}{getattr(value, 'shape', ())}".encode())
        if getattr(getattr(value, "dtype", None), "kind", "") == "O":  # its bytes are addresses
            _feed(update, value.tolist())
        else:
            _feed_bytes(update, b"", value.tobytes())
        return
    # Anything else a dataset keeps in its state: named, not read (its bytes have no canonical form)
    update(b"o" + f"{type(value).__module__}.{type(value).__qualname__};".encode())


def _tensor_bytes(value: torch.Tensor) -> bytes:
    """A dense tensor's bytes; nothing for the rest (sparse, quantized, meta: named by dtype and
    shape only), so that taking a state never fails on what a dataset keeps in it."""
    try:
        tensor = value.detach().cpu().contiguous().reshape(-1)
        return tensor.view(torch.uint8).numpy().tobytes() if tensor.numel() else b""
    except (RuntimeError, TypeError, NotImplementedError):
        return b""
