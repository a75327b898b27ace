"""``BatchSampler``, and what an index sampler says about its batches without iterating them."""

from __future__ import annotations

import copy
import itertools
from collections.abc import Iterable, Iterator
from typing import Any

import torch.utils.data as torch_data  # torch's classes: bases for identity, never called

from pipeload._optional import optional_attribute
from pipeload.errors import bad_state_field, exact_value
from pipeload.samplers._base import Sampler
from pipeload.samplers._distributed import DistributedSampler
from pipeload.samplers._own_generators import (
    generators_state,
    keeps_a_shape,
    own_generators,
    read_generators_state,
    set_generators,
)
from pipeload.samplers._random import RandomSampler, SubsetRandomSampler, WeightedRandomSampler
from pipeload.samplers._sequential import SequentialSampler
from pipeload._state_fields import StateFields
from pipeload.samplers._state import StatefulSampler, load_users_state


class BatchSampler(StatefulSampler, Sampler[list[int]], torch_data.BatchSampler):
    """Groups the keys of ``sampler`` into lists of ``batch_size``.

    Args:
        sampler: any iterable of keys (a Sampler, a list, a generator...).
        batch_size: keys per batch, a positive int.
        drop_last: drop a final batch shorter than ``batch_size``.

    Raises:
        ValueError: ``batch_size`` is not a positive int (bools refused) or ``drop_last`` is
            not a bool.

    Example:
        >>> list(BatchSampler(range(5), batch_size=2, drop_last=False))
        [[0, 1], [2, 3], [4]]
    """

    # A user's sampler inside with a state of its own, or one drawing from a generator of its own
    # (torch's RandomSampler(generator=g)): that state as the latest iteration began.
    _user_inner_start: Any = None

    def __init__(
        self,
        sampler: Sampler[int] | Iterable[int],
        batch_size: int,
        drop_last: bool,
    ) -> None:
        if not isinstance(batch_size, int) or isinstance(batch_size, bool) or batch_size <= 0:
            raise ValueError(
                f"batch_size should be a positive integer value, but got batch_size={batch_size}"
                f"{exact_value('batch_size', batch_size)}"
            )
        if not isinstance(drop_last, bool):
            raise ValueError(
                f"drop_last should be a boolean value, but got drop_last={drop_last}"
                f"{exact_value('drop_last', drop_last)}"
            )
        self.sampler = sampler
        self.batch_size = batch_size
        self.drop_last = drop_last

    def _keys(self) -> Iterator[list[int]]:
        inner = self.sampler
        if not isinstance(inner, StatefulSampler) and callable(optional_attribute(inner, "state_dict")):
            # A user's sampler with a state of its own: where it stood as this iteration began
            # is what a checkpoint of the iteration replays it from.
            self._user_inner_start = copy.deepcopy(inner.state_dict())
        elif not isinstance(inner, StatefulSampler):
            self._user_inner_start = generators_state(inner)
        keys = inner._uncounted_iter() if isinstance(inner, StatefulSampler) else iter(inner)
        while batch := list(itertools.islice(keys, self.batch_size)):
            if self.drop_last and len(batch) < self.batch_size:
                return
            yield batch

    def _config(self) -> dict[str, Any]:
        return {"batch_size": self.batch_size, "drop_last": self.drop_last}

    def _replay_abandoned_because(self) -> str | None:
        inner = self.sampler
        return inner._replay_abandoned_because() if isinstance(inner, StatefulSampler) else None

    def _inner_state(self, fresh: bool = False) -> dict[str, Any]:
        # Mid-iteration, the keys inside are replayed from their start and regrouped; the sampler
        # inside has often finished already (batches are taken ahead), so ask for its start.
        # Fresh, it is where the sampler inside is now (an iteration left unfinished began
        # earlier: the next one begins here).
        inner = self.sampler
        latest = self._latest
        in_progress = not fresh and latest is not None and not latest.finished
        if isinstance(inner, StatefulSampler):
            return {"sampler": inner._replay_state() if in_progress else inner.state_dict()}
        if callable(optional_attribute(inner, "state_dict")):
            return {"sampler": self._user_inner_start if in_progress else inner.state_dict()}
        return {"sampler": self._user_inner_start if in_progress else generators_state(inner)}

    def _read_inner_state(self, fields: StateFields) -> Any:
        """The sampler inside: ours is checked whole; a user's state is its own business (its
        load_state_dict decides); one without a state must have None."""
        inner = self.sampler
        path = fields.name("sampler")
        if isinstance(inner, StatefulSampler):
            state = fields.raw("sampler", f"the state of a {type(inner).__name__}")
            return inner._read_state(state, path)
        state = fields.raw("sampler", "its sampler's state, or None")
        if state is None or callable(optional_attribute(inner, "load_state_dict")):
            return (state, path)
        if keeps_a_shape(inner):
            return (read_generators_state(inner, state, path), None)
        raise bad_state_field(path, state, f"None ({type(inner).__name__} keeps no state)")

    def _load_inner_state(self, inner: Any, replay: bool) -> None:
        if isinstance(self.sampler, StatefulSampler):
            self.sampler._apply(inner)
            return
        state, path = inner
        if path is None:  # the states of its own generators
            set_generators(self.sampler, state)
        elif state is not None:
            load_users_state(self.sampler, state, path)

    def __len__(self) -> int:
        count = len(self.sampler)  # type: ignore[arg-type]
        if self.drop_last:
            return count // self.batch_size
        return -(-count // self.batch_size)


def _is_exact(sampler: Any) -> bool:
    """Whether ``len(sampler)`` is exactly what iterating yields and iterating cannot fail
    midway: torch's samplers and ours, as they are (a subclass may yield otherwise)."""
    kind = type(sampler)
    if kind in (BatchSampler, torch_data.BatchSampler):
        return _is_exact(sampler.sampler)
    return kind in _EXACT_SAMPLERS


def exact_length(sampler: Any) -> int | None:
    """``len(sampler)`` when it is exactly what iterating yields and iterating cannot fail
    midway (see ``_is_exact``); else None."""
    return len(sampler) if _is_exact(sampler) else None


def batch_sizes(index_sampler: Any, auto_collation: bool,
                count_batches: bool = True) -> tuple[int, int | None] | None:
    """What every batch of an epoch holds, when that is known without looking at each:
    ``(samples in every batch but the last, the last batch's number or None)``. One sample per
    task without auto-collation; torch's or our ``BatchSampler`` over an exact sampler holds
    ``batch_size`` in each but the last, which may be shorter. None for other batch samplers
    (their batches may hold anything). ``count_batches=False``: the last batch's number is left
    None, and no length is asked (it may run the user's code: ``samplers/_lengths.py``)."""
    if not auto_collation:
        return 1, None
    if type(index_sampler) not in (BatchSampler, torch_data.BatchSampler) or not _is_exact(index_sampler):
        return None
    return index_sampler.batch_size, (len(index_sampler) - 1 if count_batches else None)


_EXACT_SAMPLERS = frozenset({
    SequentialSampler, RandomSampler, SubsetRandomSampler, WeightedRandomSampler, DistributedSampler,
    torch_data.SequentialSampler, torch_data.RandomSampler, torch_data.SubsetRandomSampler,
    torch_data.WeightedRandomSampler, torch_data.DistributedSampler,
})
