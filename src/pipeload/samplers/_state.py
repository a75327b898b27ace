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

A state is checked whole before anything is set (``_read_state``): each field's presence, type,
range and decoding (named by its path when wrong), the configuration, then the ``digest`` over
the rest (version 2; version 1 states, without one, still load). A sampler that refuses a state
is left as it was. See "Damaged states" in docs/design/resume.md.
"""

from __future__ import annotations

import contextlib
import itertools
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import torch

from pipeload._rng_state import borrowed_global_rng, generator_state, set_generator_state
from pipeload._state_digest import DIGEST_FIELD, check_digest, sealed
from pipeload._state_fields import StateFields, is_int
from pipeload.errors import MISSING, IncompatibleStateError, bad_state_field, state_mismatch

STATE_VERSION = 2  # 2: the state carries a digest of its content (docs/design/resume.md)
READ_VERSIONS = (1, 2)  # states of version 1 (no digest) still load, every field checked
_END = object()


@dataclass(frozen=True)
class _ReadState:
    """A sampler state, checked: what loading it sets."""

    generator: torch.Tensor | None  # the sampler's own generator's state
    iteration: dict[str, Any] | None  # {"start": encoded state or None, "yielded": keys handed out}
    inner: Any  # the subclass's fields, as its _read_inner_state gave them


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

    def _inner_state(self, fresh: bool = False) -> dict[str, Any]:
        # Extra fields (a DistributedSampler's epoch, a BatchSampler's sampler); ``fresh``: as
        # for an iteration not yet begun, whatever the latest one did (see fresh_state_dict).
        return {}

    def _load_inner_state(self, inner: Any, replay: bool) -> None:
        pass  # ``inner``: what _read_inner_state gave

    def _replay_abandoned_because(self) -> str | None:
        """Why a loaded iteration no longer describes the next one (a DistributedSampler moved to
        another epoch since), or None while it does. Asked before ``_keys()``."""
        return None

    def _take_pending(self) -> dict[str, Any] | None:
        pending, self._pending = self._pending, None
        return None if self._replay_abandoned_because() is not None else pending

    def __iter__(self) -> Iterator[Any]:
        pending = self._take_pending()
        # What torch computes when ``iter()`` is called (a DistributedSampler's order, for one)
        # is computed now too; random samplers draw when their first key is asked for.
        return self._iterate(self._keys(), pending, counted=True)

    def _uncounted_iter(self) -> Iterator[Any]:
        """``iter(self)`` for a BatchSampler around it: the batches are counted, not the keys
        (the BatchSampler replays this sampler from its start), which saves a step per key."""
        pending = self._take_pending()
        return self._iterate(self._keys(), pending, counted=False)

    def state_dict(self) -> dict[str, Any]:
        """This sampler's position: small, JSON-serialisable, versioned (see the module doc)."""
        latest = self._latest
        iteration = None
        if self._pending is not None and self._replay_abandoned_because() is None:
            # Loaded and not begun yet: the next iteration is still the loaded one's rest (a
            # framework that saves right after restoring must not skip it).
            iteration = dict(self._pending)
        elif latest is not None and not latest.finished:
            iteration = {"start": latest.start, "yielded": latest.yielded}
        return self._state_with(iteration)

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Resume from ``state``: the next iteration continues the one recorded in it.

        The whole state is checked first; a sampler that refuses one is left as it was.

        Raises:
            IncompatibleStateError: the state is from another kind of sampler or another
                configuration (the message names what differs), from a newer format, or damaged
                (a field missing, mistyped, out of range or undecodable, named by its path; or
                content that does not match its digest).
        """
        self._load_state_at(state, "")

    def _load_state_at(self, state: Any, path: str) -> None:
        """:meth:`load_state_dict` for a state found at ``path`` in a larger one (a loader's)."""
        self._apply(self._read_state(state, path))

    def check_state_dict(self, state: Any, path: str = "") -> None:
        """Raise what :meth:`load_state_dict` would raise for ``state``; change nothing.

        Args:
            state: a state, as :meth:`state_dict` gave it (or not).
            path: where the state sits in a larger one (``epoch.sampler``), to name its fields.

        Raises:
            IncompatibleStateError: as :meth:`load_state_dict`.
        """
        self._read_state(state, path)

    def _apply(self, read: _ReadState) -> None:
        """Set what a checked state says. Only a user's sampler inside (its own
        ``load_state_dict``) can still refuse, before anything here is set."""
        self._load_inner_state(read.inner, replay=read.iteration is not None)
        draws, generator = self._draws_from()
        if draws and generator is not None and read.generator is not None:
            generator.set_state(read.generator)
        self._pending = dict(read.iteration) if read.iteration is not None else None

    def fresh_state_dict(self) -> dict[str, Any]:
        """The state as for an iteration not yet begun: where the next ``iter()`` starts, even
        when the latest iteration was left unfinished (a loop that broke out of its epoch). What
        the loader records as an epoch begins."""
        return fresh_state(self._state_with(None, fresh=True))

    def _replay_state(self) -> dict[str, Any] | None:
        """The latest iteration from its start (finished or not): what a BatchSampler needs of
        the sampler inside it, which often finishes before the batches do."""
        latest = self._latest
        if latest is None:
            return None
        return self._state_with({"start": latest.start, "yielded": 0})

    def _state_with(self, iteration: dict[str, Any] | None, fresh: bool = False) -> dict[str, Any]:
        draws, generator = self._draws_from()
        own = generator_state(generator) if draws and generator is not None else None
        return sealed({"version": STATE_VERSION, "type": type(self).__name__, "config": self._config(),
                       "generator": own, "iteration": iteration, **self._inner_state(fresh)})

    # -- reading a state: every field checked before anything is set ------------------------

    def _read_inner_state(self, fields: StateFields) -> Any:
        """The subclass's extra fields, read and checked (``_load_inner_state`` takes them)."""
        return None

    def _read_state(self, state: Any, path: str) -> _ReadState:
        name = type(self).__name__
        fields = StateFields(state, path)
        version = state.get("version")
        if not (is_int(version) and version in READ_VERSIONS):
            raise IncompatibleStateError(
                f"cannot load this state into a {name}{_at(path)}: it has version {version!r}, this pipeload "
                f"reads versions {' and '.join(map(str, READ_VERSIONS))}")
        fields.raw("version", "")
        if fields.raw("type", repr(name)) != name:
            raise state_mismatch(f"a {name}{_at(path)}", {"sampler type": (state.get("type"), name)})
        config = fields.fields("config")
        for key in config.state:
            config.raw(key, "")
        draws, own_generator = self._draws_from()
        generator = fields.generator("generator", none=True)
        iteration = self._read_iteration(fields, draws)
        inner = self._read_inner_state(fields)
        if version >= 2:
            fields.raw(DIGEST_FIELD, "the digest state_dict() writes")
        fields.finish()
        self._check_config(config.state, generator is not None, path)
        if version >= 2:  # last: the checks above name the field when they can
            check_digest(state, path)
        return _ReadState(generator, iteration, inner)

    def _read_iteration(self, fields: StateFields, draws: bool) -> dict[str, Any] | None:
        iteration = fields.fields("iteration", none=True)
        if iteration is None:
            return None
        if draws:  # replayed from where its generator stood as it began
            iteration.generator("start")
            start = iteration.state["start"]
        else:
            start = iteration.raw("start", "None (this sampler draws no random numbers)")
            if start is not None:
                raise bad_state_field(iteration.name("start"), start, "None (this sampler draws no random numbers)")
        yielded = iteration.integer("yielded", high=_length_or_none(self))
        iteration.finish()
        return {"start": start, "yielded": yielded}

    def _check_config(self, saved: dict[str, Any], own_before: bool, path: str) -> None:
        here = self._config()
        differences = {k: (saved.get(k), here.get(k)) for k in sorted(here.keys() | saved.keys())
                       if not _same(saved.get(k, MISSING), here.get(k, MISSING))}
        draws, generator = self._draws_from()
        if own_before != (draws and generator is not None):
            # A replay from the other generator would draw another order.
            if draws:
                named = {True: "its own", False: "torch's global"}
                differences["generator"] = (named[own_before], named[generator is not None])
            else:
                differences["generator"] = ("a generator state", "None: it draws no random numbers")
        if differences:
            raise state_mismatch(f"this {type(self).__name__}{_at(path)}", differences)

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


def _at(path: str) -> str:
    """Where a nested state sits, for messages (nothing for a state loaded alone)."""
    return f" (its state at {path})" if path else ""


def _same(saved: Any, here: Any) -> bool:
    """Equal and of one type (a state's ``True`` is not a config's ``1``)."""
    return type(saved) is type(here) and saved == here


def _length_or_none(sampler: Any) -> int | None:
    try:
        return len(sampler)
    except TypeError:
        return None


def load_users_state(sampler: Any, state: Any, path: str) -> None:
    """``sampler.load_state_dict(state)`` for a sampler of the user's, whose state only it can
    read: what it raises is an IncompatibleStateError naming ``path``, and it is given back the
    state it had (so a refused state leaves it as it was, as far as its own state says)."""
    try:
        before = sampler.state_dict()
    except Exception:  # noqa: BLE001 - nothing to give back then; its load still decides
        before = MISSING
    try:
        sampler.load_state_dict(state)
    except Exception as error:
        if before is not MISSING:
            with contextlib.suppress(Exception):
                sampler.load_state_dict(before)
        raise IncompatibleStateError(
            f"cannot load this state: {type(sampler).__name__}.load_state_dict() refused "
            f"{path or 'it'} ({type(error).__name__}: {error})") from error


def fresh_state(state: Any) -> Any:
    """``state`` (a sampler's) as for an iteration not yet begun: ``iteration`` None, at every
    level (a BatchSampler's inner sampler too), each of ours sealed again."""
    if not isinstance(state, dict):
        return state
    cleared = dict(state)
    if "iteration" in cleared:
        cleared["iteration"] = None
    if isinstance(cleared.get("sampler"), dict):
        cleared["sampler"] = fresh_state(cleared["sampler"])
    if DIGEST_FIELD in cleared and cleared.get("version") == STATE_VERSION and "type" in cleared:
        sealed(cleared)
    return cleared
