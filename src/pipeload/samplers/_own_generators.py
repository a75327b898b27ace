"""The state of a sampler that keeps none but draws from a generator of its own.

torch's ``RandomSampler``, ``SubsetRandomSampler`` and ``WeightedRandomSampler`` given
``generator=`` (and a user's sampler built the same way, or a batch sampler over one) have no
``state_dict()``, and the order they give depends on where that generator stood when their
iteration began. A checkpoint keeps the state of each such generator, as the epoch began; a
resumed epoch sets them back before the sampler is iterated again, so that it draws the same
order (pipeload then skips what was handed out). A sampler with a ``state_dict()`` of its own
keeps its state that way instead.

torch's ``DistributedSampler`` draws from a generator it seeds with ``seed + epoch`` as its
iteration begins: its order is decided by its epoch. The checkpoint keeps the epoch of each
sampler that has one (an int ``epoch`` and a ``set_epoch()``, and no ``state_dict()``), and
loading it calls ``set_epoch`` with it. Lightning makes a resumed run's iterator before it calls
``set_epoch`` (torch's loader then draws epoch 0's order, and skipped as many batches of it as
the interrupted epoch had handed out, silently); a loop that calls ``set_epoch`` with another
epoch after loading begins that epoch whole instead (:func:`epochs_moved_on` says why).

The state is ``{"generators": {"generator": text, "sampler.generator": text}, "shape": text}``,
one entry for each ``torch.Generator`` found at those two places (the sampler's, and its inner
sampler's), and a digest of what else decides the order (``sampler_shape``), checked on load;
with ``"epochs": {"epoch": int, "sampler.epoch": int}`` for the samplers there that have one.

Example:
    >>> import torch
    >>> sampler = torch.utils.data.RandomSampler(range(4), generator=torch.Generator().manual_seed(0))
    >>> state = generators_state(sampler)
    >>> first = list(sampler)
    >>> set_generators(sampler, read_generators_state(sampler, state, "sampler"))
    >>> list(sampler) == first
    True
"""

from __future__ import annotations

import hashlib
from typing import Any, NamedTuple

import numpy as np
import torch

from pipeload._optional import optional_attribute
from pipeload._rng_state import encode_state
from pipeload._state_fields import GENERATOR_TEXT, StateFields, is_int
from pipeload.errors import bad_state_field

_PLACES = ("generator", "sampler.generator")
_EPOCH_PLACES = ("epoch", "sampler.epoch")


class KeptDraws(NamedTuple):
    """What a checkpoint keeps of a sampler without a state: its generators' states and its
    epochs, by place (:func:`read_generators_state` checks them, :func:`set_generators` sets them)."""

    generators: dict[str, torch.Tensor]
    epochs: dict[str, int]


def own_generators(sampler: Any) -> dict[str, torch.Generator]:
    """The CPU generators ``sampler`` draws from itself, by place: its ``generator``, its inner
    sampler's (a batch sampler's ``sampler``). Empty for one with a ``state_dict()``: it keeps
    its own state."""
    if sampler is None or callable(optional_attribute(sampler, "state_dict")):
        return {}
    found = {}
    for place, holder in zip(_PLACES, (sampler, optional_attribute(sampler, "sampler"))):
        generator = optional_attribute(holder, "generator") if holder is not None else None
        if isinstance(generator, torch.Generator) and generator.device.type == "cpu":
            found[place] = generator
    return found


def epoch_holders(sampler: Any) -> dict[str, Any]:
    """The samplers at ``sampler`` and inside it (a batch sampler's ``sampler``) whose order an
    epoch decides, by place: those with an int ``epoch`` and a ``set_epoch()``, and no
    ``state_dict()`` (one with a state keeps its epoch there). Empty for one with a
    ``state_dict()``, as :func:`own_generators`."""
    if sampler is None or callable(optional_attribute(sampler, "state_dict")):
        return {}
    found = {}
    for place, holder in zip(_EPOCH_PLACES, (sampler, optional_attribute(sampler, "sampler"))):
        if (holder is not None and callable(optional_attribute(holder, "set_epoch"))
                and is_int(optional_attribute(holder, "epoch"))
                and not callable(optional_attribute(holder, "state_dict"))):
            found[place] = holder
    return found


def epochs_moved_on(sampler: Any, loaded: dict[str, int]) -> str | None:
    """Why the epochs ``loaded`` (set when a state was loaded) no longer decide ``sampler``'s
    next order: ``set_epoch`` was called with another since; None while they still do."""
    for holder, epoch in _with_loaded_epochs(sampler, loaded):
        if holder.epoch != epoch:
            return f"set_epoch({holder.epoch}) was called after loading a state of epoch {epoch}"
    return None


def move_epochs_on(sampler: Any, loaded: dict[str, int]) -> None:
    """Call ``set_epoch(epoch + 1)`` where ``sampler`` still stands at a loaded epoch: the next
    epoch, as the loop that wrote the state would have set it (a state saved after an epoch's
    last batch resumes with the next epoch)."""
    for holder, epoch in _with_loaded_epochs(sampler, loaded):
        if holder.epoch == epoch:
            holder.set_epoch(epoch + 1)


def _with_loaded_epochs(sampler: Any, loaded: dict[str, int]) -> list[tuple[Any, int]]:
    """Each of ``sampler``'s epoch holders with the epoch ``loaded`` holds for its place."""
    return [(holder, loaded[place]) for place, holder in epoch_holders(sampler).items() if loaded.get(place) is not None]


def keeps_a_shape(sampler: Any) -> bool:
    """Whether a checkpoint keeps ``sampler``'s shape (its state, where it keeps none): it has
    generators of its own, or it is one of torch's random samplers drawing from the global
    generator (whose state the loader's checkpoint keeps), so that its order is fixed by its
    parameters and that state: with other indices, weights or ``num_samples`` it resumed another
    order, silently, where ours and those given ``generator=`` refuse the state."""
    if sampler is None or callable(optional_attribute(sampler, "state_dict")):
        return False
    if own_generators(sampler) or epoch_holders(sampler):
        return True
    holders = [h for h in (sampler, optional_attribute(sampler, "sampler")) if h is not None]
    return (all(type(h).__module__.startswith("torch.utils.data") for h in holders)
            and any(getattr(h, name, None) is not None for h in holders for name in _DRAWING))


_DRAWING = ("weights", "indices", "num_samples")


def generators_state(sampler: Any) -> dict[str, Any] | None:
    """The states of ``sampler``'s own generators now (none, for a torch sampler drawing from
    the global generator: see :func:`keeps_a_shape`), and the digest of what else decides its
    order (:func:`sampler_shape`); None: its checkpoint keeps nothing of it."""
    if not keeps_a_shape(sampler):
        return None
    generators = own_generators(sampler)
    state = {"generators": {place: encode_state(g.get_state()) for place, g in generators.items()},
             "shape": sampler_shape(sampler)}
    epochs = {place: holder.epoch for place, holder in epoch_holders(sampler).items()}
    if epochs:  # absent otherwise: a state as it was before epochs were kept
        state["epochs"] = epochs
    return state


def sampler_shape(sampler: Any, shaping: tuple[str, ...] | None = None) -> str:
    """A digest of what, besides its generators, decides the order a sampler draws: at each of
    the two places, its type, and its ``num_samples``, ``replacement``, ``shuffle``, ``seed``,
    ``weights`` and ``indices`` where it has them. The same generator state under other weights
    or another ``num_samples`` (the same epoch of torch's ``DistributedSampler`` under another
    seed) draws another order, which a resume would have taken for the one it left. A
    ``DistributedSampler``'s rank and ``num_replicas`` are no part of it: frameworks load rank
    0's checkpoint on every rank. ``shaping``: the int and bool attributes to digest."""
    digest = hashlib.blake2b(digest_size=8)
    for holder in (sampler, optional_attribute(sampler, "sampler")):
        if holder is None:
            continue
        digest.update(f"{type(holder).__module__}.{type(holder).__qualname__};".encode())
        for name in _SHAPING if shaping is None else shaping:
            value = getattr(holder, name, None)
            if isinstance(value, (bool, int)):
                digest.update(f"{name}={value!r};".encode())
        for name in ("weights", "indices"):
            value = getattr(holder, name, None)
            if value is not None:
                digest.update(f"{name}=".encode())
                digest.update(_as_bytes(value))
    return digest.hexdigest()


_SHAPING = ("num_samples", "replacement", "batch_size", "drop_last", "shuffle", "seed")
# What a state written before stop 55 digested: such a state is still taken (its seed unchecked).
_SHAPING_BEFORE_SEEDS = _SHAPING[:4]


def _as_bytes(values: Any) -> bytes:
    """What identifies the numbers of a tensor, an array or a sequence, as bytes: a range by its
    bounds; a long one (over ``WHOLE_UP_TO``) by its length and ``SAMPLED`` values spread over it,
    as a state is taken at every epoch's start and a sampler over 10^9 indices must not cost
    seconds; values that are no numbers (paths, keys) by their text, never by where they lie in
    memory."""
    if isinstance(values, range):
        return f"range({values.start},{values.stop},{values.step})".encode()
    if isinstance(values, torch.Tensor):
        values = values.detach().cpu()
    try:
        length = len(values)
    except TypeError:
        return repr(values).encode()
    if length > WHOLE_UP_TO:
        step = length // SAMPLED
        values = [values[i] for i in range(0, length, step)] + [values[length - 1]]
    if isinstance(values, torch.Tensor):
        return f"{length};".encode() + values.contiguous().numpy().tobytes()
    try:
        array = np.asarray(values)
    except (TypeError, ValueError):
        array = None
    if array is None or array.dtype == object:
        return f"{length};".encode() + repr(list(values)).encode()
    return f"{length};".encode() + array.tobytes()


WHOLE_UP_TO = 1 << 16
SAMPLED = 4096


def read_generators_state(sampler: Any, state: Any, path: str) -> KeptDraws:
    """``state`` (from :func:`generators_state`) checked against ``sampler``: the same places,
    each a generator state, and the same places of epochs, each an int (a state without epochs,
    written before they were kept, sets none); nothing is set.

    Raises:
        IncompatibleStateError: naming the field at ``path`` that does not fit.
    """
    generators = own_generators(sampler)
    fields = StateFields(state, path, "a dict holding the states of the sampler's own generators")
    saved = fields.fields("generators")
    assert saved is not None
    if set(saved.state) != set(generators):
        raise bad_state_field(saved.path, sorted(saved.state),
                              f"the states of the generators at {sorted(generators)} ({GENERATOR_TEXT} each)")
    states = {place: saved.generator(place) for place in generators}
    saved.finish()
    shape = fields.raw("shape", "the digest of the sampler's type and parameters", default=None)
    if shape is not None and not _same_shape(sampler, shape):  # None: a state from before stop 43
        raise bad_state_field(
            fields.name("shape"), shape, repr(sampler_shape(sampler)),
            "the sampler's type, num_samples, replacement, shuffle, seed, weights or indices "
            "differ from the checkpoint's: the same generator state would draw another order")
    epochs = _read_epochs(sampler, fields)
    fields.finish()
    return KeptDraws(states, epochs)  # type: ignore[arg-type]


def _same_shape(sampler: Any, shape: Any) -> bool:
    """Whether ``shape`` is ``sampler``'s digest, as written now or before seeds were in it."""
    return shape == sampler_shape(sampler) or shape == sampler_shape(sampler, _SHAPING_BEFORE_SEEDS)


def _read_epochs(sampler: Any, fields: StateFields) -> dict[str, int]:
    saved = fields.fields("epochs", none=True, default=None)
    if saved is None:
        return {}
    places = sorted(epoch_holders(sampler))
    if sorted(saved.state) != places:
        raise bad_state_field(saved.path, saved.state, f"the epochs of the samplers at {places} (an int each)")
    # torch's sampler seeds a generator with seed + epoch, which takes a 64-bit number
    epochs = {place: saved.integer(place, low=-(1 << 63), high=(1 << 63) - 1) for place in places}
    saved.finish()
    return epochs


def set_generators(sampler: Any, kept: KeptDraws) -> None:
    """Set ``sampler``'s own generators and epochs to ``kept`` (from :func:`read_generators_state`)."""
    generators = own_generators(sampler)
    for place, state in kept.generators.items():
        generators[place].set_state(state)
    holders = epoch_holders(sampler)
    for place, epoch in kept.epochs.items():
        holders[place].set_epoch(epoch)

