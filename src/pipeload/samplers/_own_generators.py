"""The state of a sampler that keeps none but draws from a generator of its own.

torch's ``RandomSampler``, ``SubsetRandomSampler`` and ``WeightedRandomSampler`` given
``generator=`` (and a user's sampler built the same way, or a batch sampler over one) have no
``state_dict()``, and the order they give depends on where that generator stood when their
iteration began. A checkpoint keeps the state of each such generator, as the epoch began; a
resumed epoch sets them back before the sampler is iterated again, so that it draws the same
order (pipeload then skips what was handed out). A sampler with a ``state_dict()`` of its own
keeps its state that way instead.

The state is ``{"generators": {"generator": text, "sampler.generator": text}, "shape": text}``,
one entry for each ``torch.Generator`` found at those two places (the sampler's, and its inner
sampler's), and a digest of what else decides the order (``sampler_shape``), checked on load.

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
from typing import Any

import numpy as np
import torch

from pipeload._optional import optional_attribute
from pipeload._rng_state import encode_state
from pipeload._state_fields import GENERATOR_TEXT, StateFields
from pipeload.errors import bad_state_field

_PLACES = ("generator", "sampler.generator")


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


def keeps_a_shape(sampler: Any) -> bool:
    """Whether a checkpoint keeps ``sampler``'s shape (its state, where it keeps none): it has
    generators of its own, or it is one of torch's random samplers drawing from the global
    generator (whose state the loader's checkpoint keeps), so that its order is fixed by its
    parameters and that state: with other indices, weights or ``num_samples`` it resumed another
    order, silently, where ours and those given ``generator=`` refuse the state."""
    if sampler is None or callable(optional_attribute(sampler, "state_dict")):
        return False
    if own_generators(sampler):
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
    return {"generators": {place: encode_state(g.get_state()) for place, g in generators.items()},
            "shape": sampler_shape(sampler)}


def sampler_shape(sampler: Any) -> str:
    """A digest of what, besides its generators, decides the order a sampler draws: at each of
    the two places, its type, and its ``num_samples``, ``replacement``, ``weights`` and
    ``indices`` where it has them. The same generator state under other weights or another
    ``num_samples`` draws another order, which a resume would have taken for the one it left."""
    digest = hashlib.blake2b(digest_size=8)
    for holder in (sampler, optional_attribute(sampler, "sampler")):
        if holder is None:
            continue
        digest.update(f"{type(holder).__module__}.{type(holder).__qualname__};".encode())
        for name in _SHAPING:
            value = getattr(holder, name, None)
            if isinstance(value, (bool, int)):
                digest.update(f"{name}={value!r};".encode())
        for name in ("weights", "indices"):
            value = getattr(holder, name, None)
            if value is not None:
                digest.update(f"{name}=".encode())
                digest.update(_as_bytes(value))
    return digest.hexdigest()


_SHAPING = ("num_samples", "replacement", "batch_size", "drop_last")


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


def read_generators_state(sampler: Any, state: Any, path: str) -> dict[str, torch.Tensor]:
    """``state`` (from :func:`generators_state`) checked against ``sampler``: the same places,
    each a generator state; nothing is set.

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
    if shape is not None and shape != sampler_shape(sampler):  # None: a state from before stop 43
        raise bad_state_field(
            fields.name("shape"), shape, repr(sampler_shape(sampler)),
            "the sampler's type, num_samples, replacement, weights or indices differ from the "
            "checkpoint's: the same generator state would draw another order")
    fields.finish()
    return states  # type: ignore[return-value]


def set_generators(sampler: Any, states: dict[str, torch.Tensor]) -> None:
    """Set ``sampler``'s own generators to ``states`` (from :func:`read_generators_state`)."""
    generators = own_generators(sampler)
    for place, state in states.items():
        generators[place].set_state(state)

