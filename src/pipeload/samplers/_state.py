"""Checkpoints for samplers: ``state_dict()`` / ``load_state_dict()``, without storing indices.

A sampler's order is a function of the generator it draws from, so a checkpoint keeps that
generator's state instead of the order itself:

- ``generator``: the sampler's own generator as it is now (None when it draws from torch's global
  generator, which belongs to the user: their checkpoint restores it);
- ``iteration``: the iteration in progress, if any: the state of the generator it draws from
  (own or global) when it began, and how many keys it has handed out.

Loading it makes the next ``iter(sampler)`` replay that iteration from its beginning, skipping
what was handed out (draws from the global generator are replayed on a borrowed copy, and the
user's global stream is left as it is); iterations after it are fresh. Without an iteration in
progress, loading sets the own generator and the next iteration is fresh. Keys, not data, are
skipped: nothing is loaded.

``config`` records what makes two samplers interchangeable (length, batch size, world size, ...);
a state is refused, naming the difference, by a sampler whose settings differ.
"""

from __future__ import annotations

import itertools
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import torch

from pipeload._rng_state import borrowed_global_rng, generator_state, set_generator_state
from pipeload.errors import IncompatibleStateError, state_mismatch

STATE_VERSION = 1
_END = object()


@dataclass
class _Iteration:
    """One run over a sampler: where its generator stood when it began, how far it got."""

    start: str | None
    yielded: int = 0
    finished: bool = False


class StatefulSampler:
    """Mixin for pipeload's samplers. Subclasses define ``_keys()`` (one iteration's keys, drawn
    lazily as torch draws them), ``_config()`` and, if random, ``_draws_from()``."""

    _latest: _Iteration | None = None
    _pending: dict[str, Any] | None = None

    def _keys(self) -> Iterator[Any]:
        raise NotImplementedError

    def _config(self) -> dict[str, Any]:
        return {}

    def _draws_from(self) -> tuple[bool, torch.Generator | None]:
        """(whether iterations draw random numbers, from which generator: None is the global one)."""
        return False, None

    def _inner_state(self) -> dict[str, Any]:
        return {}  # extra fields (a DistributedSampler's epoch, a BatchSampler's sampler)

    def _load_inner_state(self, state: dict[str, Any], replay: bool) -> None:
        pass

    def __iter__(self) -> Iterator[Any]:
        pending, self._pending = self._pending, None
        # What torch computes when ``iter()`` is called (a DistributedSampler's order, for one)
        # is computed now too; random samplers draw when their first key is asked for.
        return self._iterate(self._keys(), pending, counted=True)

    def _uncounted_iter(self) -> Iterator[Any]:
        """``iter(self)`` for a BatchSampler around it: the batches are counted, not the keys
        (the BatchSampler replays this sampler from its start), which saves a step per key."""
        pending, self._pending = self._pending, None
        return self._iterate(self._keys(), pending, counted=False)

    def state_dict(self) -> dict[str, Any]:
        """This sampler's position: small, JSON-serialisable, versioned (see the module doc)."""
        latest = self._latest
        iteration = None
        if latest is not None and not latest.finished:
            iteration = {"start": latest.start, "yielded": latest.yielded}
        return self._state_with(iteration)

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Resume from ``state``: the next iteration continues the one recorded in it.

        Raises:
            IncompatibleStateError: the state is from another kind of sampler or another
                configuration (the message names what differs), or from a newer format.
        """
        self._check(state)
        draws, generator = self._draws_from()
        if draws and generator is not None and state.get("generator") is not None:
            set_generator_state(generator, state["generator"])
        iteration = state.get("iteration")
        self._load_inner_state(state, replay=iteration is not None)
        self._pending = dict(iteration) if iteration is not None else None

    def _replay_state(self) -> dict[str, Any] | None:
        """The latest iteration from its start (finished or not): what a BatchSampler needs of
        the sampler inside it, which often finishes before the batches do."""
        latest = self._latest
        if latest is None:
            return None
        return self._state_with({"start": latest.start, "yielded": 0})

    def _state_with(self, iteration: dict[str, Any] | None) -> dict[str, Any]:
        draws, generator = self._draws_from()
        own = generator_state(generator) if draws and generator is not None else None
        return {"version": STATE_VERSION, "type": type(self).__name__, "config": self._config(),
                "generator": own, "iteration": iteration, **self._inner_state()}

    def _check(self, state: dict[str, Any]) -> None:
        name = type(self).__name__
        if state.get("version") != STATE_VERSION:
            raise IncompatibleStateError(
                f"cannot load this state into a {name}: it has version {state.get('version')!r}, "
                f"this pipeload reads version {STATE_VERSION}")
        if state.get("type") != name:
            raise state_mismatch(f"a {name}", {"sampler type": (state.get("type"), name)})
        here = self._config()
        saved = state.get("config", {})
        differences = {k: (saved.get(k), v) for k, v in here.items() if saved.get(k) != v}
        draws, generator = self._draws_from()
        own_before = state.get("generator") is not None
        if draws and own_before != (generator is not None):
            # A replay from the other generator would draw another order.
            named = {True: "its own", False: "torch's global"}
            differences["generator"] = (named[own_before], named[generator is not None])
        if differences:
            raise state_mismatch(f"this {name}", differences)

    def _iterate(self, keys: Iterator[Any], pending: dict[str, Any] | None, counted: bool) -> Iterator[Any]:
        draws, generator = self._draws_from()
        start = pending.get("start") if pending is not None else None
        if draws and start is None:
            start = generator_state(generator)
        elif draws and generator is not None:
            set_generator_state(generator, start)
        record = self._latest = _Iteration(start)
        # The global generator is drawn from when the first key is asked for (as torch does):
        # a replay draws from a borrowed copy at the recorded state.
        with borrowed_global_rng(start if draws and generator is None and pending is not None else None):
            first = next(keys, _END)
        if first is _END:
            record.finished = True
            return
        skip = pending.get("yielded", 0) if pending is not None else 0
        keys = itertools.chain([first], keys)
        if skip:
            record.yielded = sum(1 for _ in itertools.islice(keys, skip))
        if counted:
            for key in keys:
                record.yielded += 1
                yield key
        else:
            yield from keys
        record.finished = True
