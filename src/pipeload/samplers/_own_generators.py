"""The state of a sampler that keeps none but draws from a generator of its own.

torch's ``RandomSampler``, ``SubsetRandomSampler`` and ``WeightedRandomSampler`` given
``generator=`` (and a user's sampler built the same way, or a batch sampler over one) have no
``state_dict()``, and the order they give depends on where that generator stood when their
iteration began. A checkpoint keeps the state of each such generator, as the epoch began; a
resumed epoch sets them back before the sampler is iterated again, so that it draws the same
order (pipeload then skips what was handed out). A sampler with a ``state_dict()`` of its own
keeps its state that way instead.

The state is ``{"generators": {"generator": text, "sampler.generator": text}}``, one entry for
each ``torch.Generator`` found at those two places (the sampler's, and its inner sampler's).

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

from typing import Any

import torch

from pipeload._rng_state import encode_state
from pipeload._state_fields import GENERATOR_TEXT, StateFields
from pipeload.errors import bad_state_field

_PLACES = ("generator", "sampler.generator")


def own_generators(sampler: Any) -> dict[str, torch.Generator]:
    """The CPU generators ``sampler`` draws from itself, by place: its ``generator``, its inner
    sampler's (a batch sampler's ``sampler``). Empty for one with a ``state_dict()``: it keeps
    its own state."""
    if sampler is None or callable(getattr(sampler, "state_dict", None)):
        return {}
    found = {}
    for place, holder in zip(_PLACES, (sampler, getattr(sampler, "sampler", None))):
        generator = getattr(holder, "generator", None) if holder is not None else None
        if isinstance(generator, torch.Generator) and generator.device.type == "cpu":
            found[place] = generator
    return found


def generators_state(sampler: Any) -> dict[str, Any] | None:
    """The states of ``sampler``'s own generators now (None: it has none)."""
    generators = own_generators(sampler)
    if not generators:
        return None
    return {"generators": {place: encode_state(g.get_state()) for place, g in generators.items()}}


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
    fields.finish()
    return states  # type: ignore[return-value]


def set_generators(sampler: Any, states: dict[str, torch.Tensor]) -> None:
    """Set ``sampler``'s own generators to ``states`` (from :func:`read_generators_state`)."""
    generators = own_generators(sampler)
    for place, state in states.items():
        generators[place].set_state(state)

