"""Randomness: the buffered shuffle and torchdata's in-batch shuffle (both seeded by the loader),
and the sampler pipe."""

from __future__ import annotations

import random
from collections.abc import Iterator, Sized
from typing import Any, TypeVar

import torch

from pipeload._state_fields import StateFields, is_int
from pipeload.datapipes.base import IterDataPipe
from pipeload.datapipes.chunk import DataChunk
from pipeload.datapipes.iter._columns import check_int, length_of
from pipeload.datapipes.protocol import PipeIterator
from pipeload.datapipes.torch_loader import seed_in_torch_worker
from pipeload.engine.worker_info import this_workers_torch_generator
from pipeload.errors import bad_state_field
from pipeload import samplers

T_co = TypeVar("T_co", covariant=True)


def draw_seed() -> int:
    """A seed from torch's global generator, drawn as torch's pipes draw theirs; in a thread
    worker, from its own generator (seeded as a process worker's global one), so that the same
    loader seed gives the same epoch; in a worker of torch's own loader, one that every worker
    of the epoch draws alike (see torch_loader.py)."""
    shared = seed_in_torch_worker()
    if shared is not None:
        return shared
    generator = this_workers_torch_generator()
    return int(torch.empty((), dtype=torch.int64).random_(generator=generator).item())


class SeededPipe:
    """A pipe that draws random numbers: the loader seeds it through ``set_seed`` each epoch.

    The seed is a description setting used by the next run only (that run takes it when it reads
    its first item); a run with no seed set draws one from torch's global generator, as torch's
    random pipes do.
    """

    _enabled: bool = True
    _seed: int | None = None

    def set_shuffle(self, shuffle: bool = True) -> Any:
        """Turn the randomness on or off (off: a fixed order)."""
        self._enabled = shuffle
        return self

    def set_seed(self, seed: int) -> Any:
        """Seed the next run."""
        self._seed = seed
        return self

    def _take_seed(self) -> int:
        seed = self._seed if self._seed is not None else draw_seed()
        self._seed = None
        return seed


class Shuffler(SeededPipe, IterDataPipe[T_co]):
    """Shuffle through a buffer (functional name: ``shuffle``).

    The buffer fills with ``buffer_size`` items; each further item takes the place of a random
    buffered one, which is yielded; at the end the buffer empties in random order. A buffer at
    least as long as the pipe gives a full shuffle. The random stream is the same as torch's
    ``ShufflerIterDataPipe``: the same seed gives the same order.

    Seeding: inside a DataLoader the loader calls :meth:`set_seed` every epoch (all workers get
    the same seed, so shuffling before ``sharding_filter`` partitions one permutation). Outside,
    the seed given to :meth:`set_seed` is used by the next run only; later runs draw a seed from
    torch's global generator when they read their first item.

    Args:
        datapipe: the source pipe.
        buffer_size: how many items the buffer holds (> 0).
        unbatch_level: unbatch the source this many levels first.

    Example:
        >>> sorted(IterableWrapper(range(5)).shuffle())
        [0, 1, 2, 3, 4]
    """

    _parent_fields = ("datapipe",)

    def __init__(self, datapipe: IterDataPipe, *, buffer_size: int = 10000, unbatch_level: int = 0) -> None:
        check_int(buffer_size, "buffer_size")
        if buffer_size <= 0:
            raise AssertionError(f"buffer_size should be larger than 0 (got buffer_size={buffer_size!r})")
        self.datapipe = datapipe if unbatch_level == 0 else datapipe.unbatch(unbatch_level=unbatch_level)
        self.buffer_size = buffer_size
        self._enabled = True
        self._seed: int | None = None

    def __iter__(self) -> Iterator[T_co]:
        if not self._enabled:
            return PassThrough(self.datapipe)
        return _ShufflerIterator(self, self.datapipe)

    def __len__(self) -> int:
        return length_of(self.datapipe, self)


class PassThrough(PipeIterator[Any]):
    def __init__(self, source: Any) -> None:
        super().__init__(source)
        (self._source,) = self.upstream

    def nonblocking_next(self) -> Any:
        return self._source.nonblocking_next()


class _SeededRun:
    """The random generator of one run of a :class:`SeededPipe`. It is made from the pipe's seed
    at the first item, as torch's pipes take theirs, so draws from the global generator happen in
    the same order; checkpoints carry its state."""

    _pipe: SeededPipe
    _rng: random.Random | None = None

    def _generator(self) -> random.Random:
        if self._rng is None:  # also when a checkpoint comes first: it fixes the run's seed now
            self._rng = random.Random(self._pipe._take_seed())
        return self._rng

    def _restore_generator(self, state: tuple[Any, ...]) -> None:
        """Set the run's generator to a state :func:`checked_rng_state` read.

        The run that wrote the state had taken its seed first; this one takes it too (and
        throws it away), so that a seed set for this run does not stay pending and seed the
        next run as well (the next round of a ``cycle``, say, which would repeat this order),
        and a seed drawn from the global generator is drawn here as it was there."""
        if self._rng is None:
            self._pipe._take_seed()
        self._rng = random.Random()
        self._rng.setstate(state)


class _ShufflerIterator(_SeededRun, PipeIterator[Any]):
    """The buffer and the random generator of one run."""

    def __init__(self, pipe: Shuffler[Any], source: Any) -> None:
        super().__init__(source)
        (self._source,) = self.upstream
        self._pipe = pipe
        self._capacity = pipe.buffer_size
        self._buffer: list[Any] = []
        self._source_done = False

    def nonblocking_next(self) -> Any:
        buffer, rng = self._buffer, self._rng or self._generator()  # no call per item once made
        while not self._source_done:
            try:
                item = self._source.nonblocking_next()
            except StopIteration:
                self._source_done = True
                break
            if len(buffer) == self._capacity:
                slot = rng.randint(0, len(buffer) - 1)
                chosen, buffer[slot] = buffer[slot], item
                return chosen
            buffer.append(item)
        if not buffer:
            raise StopIteration
        return buffer.pop(rng.randint(0, len(buffer) - 1))

    def _own_state(self) -> Any:
        return {"buffer": list(self._buffer), "rng": self._generator().getstate(), "source_done": self._source_done}

    def _settings(self) -> dict[str, Any]:
        # Another buffer size draws other slots from the same generator: the rest of the
        # epoch would repeat some items and lose others.
        return {"buffer_size": self._capacity}

    def _check_own_state(self, fields: StateFields) -> Any:
        own = fields.fields("own")
        assert own is not None
        capacity = self._capacity
        buffer = own.sequence("buffer", f"a list of at most {capacity} items (the shuffle buffer)")
        if len(buffer) > capacity:  # type: ignore[arg-type]
            raise bad_state_field(own.name("buffer"), buffer, f"a list of at most {capacity} items")
        done = own.boolean("source_done")
        if done and len(buffer) == capacity:  # type: ignore[arg-type]
            # the buffer gives one item back as soon as the source ends: a full one means it has not
            raise bad_state_field(own.name("source_done"), done, "False while the buffer is full")
        rng = checked_rng_state(own, "rng")
        own.finish()
        return list(buffer), done, rng  # type: ignore[arg-type]

    def _load_own_state(self, state: Any) -> None:
        self._buffer, self._source_done, rng = state
        self._restore_generator(rng)


class InBatchShuffler(SeededPipe, IterDataPipe[DataChunk]):
    """Shuffle the items inside each batch; the batches keep their order (functional name:
    ``in_batch_shuffle``). torchdata's operation.

    Seeded like :class:`Shuffler` (by the loader each epoch, by :meth:`set_seed` for the next
    run, else from torch's global generator), with torchdata's random stream: the same seed
    gives torchdata's order. ``set_shuffle(False)`` passes the batches through unchanged.

    Args:
        datapipe: a pipe of batches (lists, tuples or DataChunks).

    Example:
        >>> list(IterableWrapper(range(6)).batch(3).in_batch_shuffle().set_seed(0))
        [[1, 2, 0], [4, 5, 3]]
    """

    _parent_fields = ("datapipe",)

    def __init__(self, datapipe: IterDataPipe) -> None:
        self.datapipe = datapipe
        self._enabled = True
        self._seed: int | None = None

    def __iter__(self) -> Iterator[DataChunk]:
        if not self._enabled:
            return PassThrough(self.datapipe)
        return _InBatchShufflerIterator(self, self.datapipe)

    def __len__(self) -> int:
        return length_of(self.datapipe, self)


class _InBatchShufflerIterator(_SeededRun, PipeIterator[DataChunk]):
    def __init__(self, pipe: InBatchShuffler, source: Any) -> None:
        super().__init__(source)
        (self._source,) = self.upstream
        self._pipe = pipe

    def nonblocking_next(self) -> DataChunk:
        rng = self._rng or self._generator()
        batch = self._source.nonblocking_next()
        return DataChunk(rng.sample(batch, len(batch)))

    def _own_state(self) -> Any:
        return {"rng": self._generator().getstate()}

    def _check_own_state(self, fields: StateFields) -> Any:
        own = fields.fields("own")
        assert own is not None
        rng = checked_rng_state(own, "rng")
        own.finish()
        return rng

    def _load_own_state(self, state: Any) -> None:
        self._restore_generator(state)


RNG_STATE = "a random.Random state: [version, 625 ints, gauss float or None]"


def checked_rng_state(fields: StateFields, key: str) -> tuple[Any, ...]:
    """``fields[key]`` as a ``random.Random`` state (JSON makes its tuples lists), refused unless
    a throwaway generator takes it: a version, 625 ints, and a float or None."""
    value = fields.sequence(key, RNG_STATE, length=3)
    version, words, gauss = value  # type: ignore[misc]
    well_typed = (is_int(version) and isinstance(words, (list, tuple)) and all(is_int(w) for w in words)
                  and (gauss is None or isinstance(gauss, float)))
    if not well_typed:
        raise bad_state_field(fields.name(key), value, RNG_STATE)
    state = (version, tuple(words), gauss)
    try:
        random.Random().setstate(state)
    except (TypeError, ValueError, OverflowError) as error:
        raise bad_state_field(fields.name(key), value, RNG_STATE, str(error)) from None
    return state


class Sampler(IterDataPipe[T_co]):
    """Yield what a sampler over the source yields (torch's ``SamplerIterDataPipe``).

    Note that, as in torch, a sampler yields keys (indices), not the source's items.

    Args:
        datapipe: a source pipe with a length.
        sampler: the sampler class (default :class:`SequentialSampler`); built with
            ``data_source=datapipe``.
        sampler_args: positional arguments for the sampler.
        sampler_kwargs: keyword arguments for the sampler.
    """

    _parent_fields = ("datapipe",)

    def __init__(
        self,
        datapipe: IterDataPipe,
        sampler: type[samplers.Sampler] = samplers.SequentialSampler,
        sampler_args: tuple[Any, ...] | None = None,
        sampler_kwargs: dict[str, Any] | None = None,
    ) -> None:
        if not isinstance(datapipe, Sized):
            raise AssertionError(
                f"Sampler class requires input datapipe implemented `__len__` (got {datapipe!r})"
            )
        self.datapipe = datapipe
        self.sampler_args = () if sampler_args is None else sampler_args
        self.sampler_kwargs = {} if sampler_kwargs is None else dict(sampler_kwargs)
        self.sampler_kwargs["data_source"] = datapipe
        self.sampler = sampler(*self.sampler_args, **self.sampler_kwargs)

    def __iter__(self) -> Iterator[T_co]:
        return iter(self.sampler)

    def __len__(self) -> int:
        return length_of(self.sampler, self)

# torch's long names, for scripts that import them from torch's submodule of this name: the
# same classes (torch's package exports the short names, as ours does).
SamplerIterDataPipe = Sampler
ShufflerIterDataPipe = Shuffler
