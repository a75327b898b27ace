"""The two kinds of pipe, the functional registry, and how a pipe names its parents.

A pipe is a description: its constructor arguments and its parents, nothing that runs. Calling
``iter()`` on an iterable pipe makes a fresh run object (a :class:`~.protocol.PipeIterator`) that
holds all of that run's state, so a pipe pickles to a worker as it was described and two
iterators over one pipe do not disturb each other. Attributes whose name starts with
``_transient_`` (caches filled on first use, a fork's live run) are never pickled or copied.
"""

from __future__ import annotations

import functools
import inspect
from collections.abc import Callable, Iterator
from typing import Any, TypeVar

# torch's own pipe classes, so that graphs built from them (or mixing them with ours) are walked,
# sharded and seeded by the same functions. Only the classes are used, for isinstance checks.
from torch.utils.data.datapipes.datapipe import IterDataPipe as _TorchIterDataPipe
from torch.utils.data.datapipes.datapipe import MapDataPipe as _TorchMapDataPipe

from pipeload.datapipes._iter_ops import IterOperations
from pipeload.datapipes._map_ops import MapOperations
from pipeload.datapipes.protocol import STARTS_A_RUN, NotAvailable, as_nonblocking
from pipeload.datasets import Dataset, IterableDataset

T_co = TypeVar("T_co", covariant=True)

TRANSIENT_PREFIX = "_transient_"
# A foreign pipe's attribute that is a long list of data is not scanned past this many items
# unless a pipe turns up among them (graph walks must not cost a pass over the data).
SCAN_PROBE_ITEMS = 8


class _DescribedPipe:
    """What both kinds of pipe share: explicit parents, pickling without run state, a short repr."""

    # Built-in pipes name the attributes that hold their parents (a pipe, or a tuple of pipes).
    # A user's subclass need not: its attributes are scanned for pipes instead. A source's ``()``
    # means its data may hold pipes (IterableWrapper over a map pipe): it is scanned, cheaply.
    _parent_fields: tuple[str, ...] | None = None

    def __init_subclass__(cls, **kwargs: Any) -> None:
        super().__init_subclass__(**kwargs)
        if inspect.isfunction(getattr(cls, "lazy_init", None)):
            _call_lazy_init_first(cls)

    def parents(self) -> tuple[Any, ...]:
        """The pipes this one reads from, in order."""
        return tuple(pipe for _, pipe in parent_slots(self))

    def __getstate__(self) -> dict[str, Any]:
        return {k: v for k, v in self.__dict__.items() if not k.startswith(TRANSIENT_PREFIX)}

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.__dict__.update(state)

    def __repr__(self) -> str:
        """The pipe's class, what it applies (a function's name, a size), and where it reads
        from, briefly: ``Mapper(decode) <- Shuffler(buffer_size=10000) <- IterableWrapper(list of
        200 items)``."""
        return describe_pipe(self)

    __str__ = __repr__

    # -- the RFC's placement and sharding hooks (the DataLoader reads them) ---------------------

    def is_shardable(self) -> bool:
        """Whether the DataLoader should tell this pipe its shard through
        :meth:`sharding_settings` (the RFC's hook; False unless a subclass says otherwise).

        A pipe that answers True must define ``sharding_settings(total_num_of_shards,
        id_of_shard)``; the loader calls it in every copy of the graph (each worker, each rank)
        before the first item, as it calls torch's ``apply_sharding``.
        """
        return False

    def is_separate_process(self) -> bool:
        """Whether this pipe asks to run, with everything that feeds it, in a process of its own
        (the RFC's hook; False unless a subclass says otherwise).

        The DataLoader then places a process boundary right after it (see
        ``pipeload.datapipes.graph.place_separate_processes``); ``loader.stats()`` lists where.
        """
        return False


# The RFC's lazy initialisation: a pipe class that defines a ``lazy_init(self)`` method has it
# called once before the first ``__iter__``, ``__len__``, ``__getitem__``, ``nonblocking_next``
# or ``nonblocking_get`` of each copy of the pipe (the flag is transient: a copy pickled to a
# worker, or a thread worker's copy, calls it again there, which is the point: a file listing is
# made after the workers start, not before). The RFC's own loop reads a non-blocking source
# through ``nonblocking_next()`` alone.
_LAZY_HOOKED = ("__iter__", "__len__", "__getitem__", "nonblocking_next", "nonblocking_get")
_LAZY_DONE = TRANSIENT_PREFIX + "lazy_init_done"


def _call_lazy_init_first(cls: type) -> None:
    for name in _LAZY_HOOKED:
        method = getattr(cls, name, None)
        if method is None or getattr(method, "_calls_lazy_init_first", False):
            continue
        setattr(cls, name, _after_lazy_init(method))


def _after_lazy_init(method: Callable[..., Any]) -> Callable[..., Any]:
    @functools.wraps(method)
    def hooked(self: Any, *args: Any) -> Any:
        if not self.__dict__.get(_LAZY_DONE):
            self.lazy_init()
            self.__dict__[_LAZY_DONE] = True  # after it returned: a failed lazy_init runs again
        return method(self, *args)

    hooked._calls_lazy_init_first = True  # type: ignore[attr-defined]
    return hooked


def _reset_on_iter(cls: type) -> None:
    """torch's IterDataPipe calls a subclass's ``reset()`` every time it is iterated (the
    subclass puts its per-run state there); a pipe written for torch keeps working here."""
    method = cls.__iter__  # type: ignore[attr-defined]
    if getattr(method, "_calls_reset", False):
        return

    @functools.wraps(method)
    def iter_then_reset(self: Any) -> Any:
        iterator = method(self)
        self.reset()  # after: as torch's order (a generator's body has not started yet)
        return iterator

    iter_then_reset._calls_reset = True  # type: ignore[attr-defined]
    cls.__iter__ = iter_then_reset  # type: ignore[attr-defined]


class IterDataPipe(_DescribedPipe, IterableDataset[T_co], IterOperations):
    """An iterable-style pipe: ``iter(pipe)`` starts a run; chain operations as methods.

    Subclass it and write ``__iter__`` (a generator is fine), or use the built-in operations.
    Every built-in iterator also answers ``nonblocking_next()`` (see ``pipeload.datapipes``).

    Example:
        >>> from pipeload.datapipes.iter import IterableWrapper
        >>> list(IterableWrapper(range(10)).filter(lambda x: x % 2 == 1).map(lambda x: x * 10))
        [10, 30, 50, 70, 90]
    """

    functions: dict[str, Callable[..., Any]] = {}
    # Whether this class's own __iter__ calls reset() (NonBlockingIterDataPipe's does).
    _iter_calls_reset = False

    def __init_subclass__(cls, **kwargs: Any) -> None:
        super().__init_subclass__(**kwargs)
        if cls.reset is not IterDataPipe.reset and not cls._iter_calls_reset:
            _reset_on_iter(cls)

    def __iter__(self) -> Iterator[T_co]:
        return self  # type: ignore[return-value]  # a pipe that is its own iterator (defines __next__)

    def nonblocking_next(self) -> T_co:
        """The next item of this pipe's own current run, if one can be had without waiting.

        The RFC puts the non-blocking protocol on the pipe itself: the first call starts a run
        (``iter(self)``), which the pipe keeps (never pickled or copied) and later calls carry
        on. Other iterators over the pipe are independent of it; :meth:`reset` drops it.

        Raises:
            NotAvailable: nothing is ready yet (an upstream thread or process has not
                delivered); ask again later.
            StopIteration: the run has ended (and stays ended until :meth:`reset`).

        Example:
            >>> pipe = IterableWrapper(range(3)).map(lambda x: x * 10)
            >>> pipe.nonblocking_next(), pipe.nonblocking_next()
            (0, 10)
        """
        run = self.__dict__.get("_transient_own_run")
        if run is None:
            run = self._transient_own_run = as_nonblocking(self)
        return run.nonblocking_next()

    setattr(nonblocking_next, STARTS_A_RUN, True)  # noqa: B010  (as_nonblocking reads it)

    def reset(self) -> None:
        """Drop this pipe's own run (the one :meth:`nonblocking_next` reads), releasing what it
        holds (threads, processes) now; the next ``nonblocking_next()`` starts again."""
        run = self.__dict__.pop("_transient_own_run", None)
        if run is not None:
            run.close()

    @classmethod
    def register_function(cls, function_name: str, function: Callable[..., Any]) -> None:
        cls.functions[function_name] = function
        setattr(cls, function_name, function)


class MapDataPipe(_DescribedPipe, Dataset[T_co], MapOperations):
    """A map-style pipe: ``pipe[key]`` reads one item; chain operations as methods.

    Example:
        >>> from pipeload.datapipes.map import SequenceWrapper
        >>> SequenceWrapper(range(10)).map(lambda x: x + 1).batch(4)[1]
        [5, 6, 7, 8]
    """

    functions: dict[str, Callable[..., Any]] = {}

    def nonblocking_get(self, index: Any) -> T_co:
        """The item at ``index``, if it can be had without waiting (the RFC's non-blocking read).

        Pipes that compute synchronously always can: this reads ``self[index]``. A
        :class:`~pipeload.datapipes.NonBlockingMapDataPipe` answers NotAvailable until the
        item is ready; built-in pipes over it pass that on.

        Raises:
            NotAvailable: the item is not ready yet; ask again later.
        """
        return self[index]  # type: ignore[index]

    @classmethod
    def register_function(cls, function_name: str, function: Callable[..., Any]) -> None:
        cls.functions[function_name] = function
        setattr(cls, function_name, function)


def get_nowait(pipe: Any, index: Any) -> Any:
    """``pipe``'s item at ``index`` through the non-blocking read when it has one (ours), else
    by indexing (torch's pipes, plain datasets)."""
    read = getattr(pipe, "nonblocking_get", None)
    return read(index) if read is not None else pipe[index]


class AskEveryOne:
    """Reads several items without blocking, asking for every one even after one is not ready,
    so that all their requests are in flight at once (the RFC schedules requests ahead); says
    NotAvailable at the end if any was missing. Used by pipes that combine items (batch, zip)."""

    def __init__(self) -> None:
        self.missing = False

    def __call__(self, pipe: Any, index: Any) -> Any:
        try:
            return get_nowait(pipe, index)
        except NotAvailable:
            self.missing = True
            return None

    def check(self) -> None:
        if self.missing:
            raise NotAvailable


class functional_datapipe:  # noqa: N801  (torch's name, used as a decorator)
    """Register a pipe class as a chainable method of every pipe of its kind.

    Args:
        name: the method name, e.g. ``"tokenize"`` for ``pipe.tokenize(...)``.

    Raises:
        Exception: the name is already taken (torch raises the same bare Exception).
        TypeError: the decorated class is not an IterDataPipe or MapDataPipe subclass.

    Example:
        >>> @functional_datapipe("double")
        ... class Doubler(IterDataPipe):
        ...     def __init__(self, source): self.source = source
        ...     def __iter__(self): return (2 * x for x in self.source)
        >>> list(IterableWrapper(range(3)).double())
        [0, 2, 4]
    """

    def __init__(self, name: str, enable_df_api_tracing: bool = False) -> None:
        self.name = name
        self.enable_df_api_tracing = enable_df_api_tracing  # accepted for torch compatibility

    def __call__(self, cls: type) -> type:
        if isinstance(cls, type) and issubclass(cls, IterDataPipe):
            base: type[IterDataPipe] | type[MapDataPipe] = IterDataPipe
        elif isinstance(cls, type) and issubclass(cls, MapDataPipe):
            base = MapDataPipe
        else:
            raise TypeError(
                f"`functional_datapipe` can only decorate IterDataPipe, but got {cls!r} "
                "(a MapDataPipe subclass is accepted too)"
            )
        if self.name in base.functions or hasattr(base, self.name):
            raise Exception(  # noqa: TRY002  (torch raises a bare Exception here)
                f"Unable to add DataPipe function name {self.name} as it is already taken "
                f"(by {getattr(base, self.name, base.functions.get(self.name))!r})"
            )
        base.register_function(self.name, _method_building(cls, self.name))
        return cls


def _method_building(cls: type, name: str) -> Callable[..., Any]:
    def method(self: Any, *args: Any, **kwargs: Any) -> Any:
        return cls(self, *args, **kwargs)

    method.__name__ = method.__qualname__ = name
    method.__doc__ = cls.__doc__
    method.__wrapped_datapipe__ = cls  # type: ignore[attr-defined]
    return method


# -- what is a pipe, and where are its parents -------------------------------------------------


def is_iter_datapipe(obj: object) -> bool:
    """Our IterDataPipe or torch's."""
    return isinstance(obj, (IterDataPipe, _TorchIterDataPipe))


def is_map_datapipe(obj: object) -> bool:
    """Our MapDataPipe or torch's."""
    return isinstance(obj, (MapDataPipe, _TorchMapDataPipe))


def is_datapipe(obj: object) -> bool:
    """Any pipe, ours or torch's."""
    return isinstance(obj, (IterDataPipe, MapDataPipe, _TorchIterDataPipe, _TorchMapDataPipe))


REPR_ANCESTORS = 3  # pipes named in a repr above the pipe itself; further ones read "..."
_REPR_SETTINGS = ("batch_size", "buffer_size", "num_instances", "limit")  # shown when set


def describe_pipe(pipe: Any, ancestors: int = REPR_ANCESTORS) -> str:
    """``pipe``'s repr: class, what it applies, then its parents (``a <- b``, or ``(a, b)`` for
    several), ``ancestors`` deep."""
    here = pipe_label(pipe)
    parents = [parent for _, parent in parent_slots(pipe)]
    if not parents:
        return here
    if ancestors == 0:
        return f"{here} <- ..."
    described = [describe_pipe(parent, ancestors - 1) if isinstance(parent, _DescribedPipe)
                 else type(parent).__qualname__ for parent in parents]
    return f"{here} <- {described[0]}" if len(described) == 1 else f"{here} <- ({', '.join(described)})"


def pipe_label(pipe: Any) -> str:
    """The pipe alone, without its parents: ``Mapper(decode)``, ``Batcher(batch_size=64)``."""
    return f"{type(pipe).__qualname__}{_what_it_applies(pipe)}"


def _what_it_applies(pipe: Any) -> str:
    """``(fn_name)``, ``(batch_size=64)``, or a source's data in a few words; "" for nothing."""
    state = _state_of(pipe)
    parts = [_function_name(value) for name, value in state.items()
             if callable(value) and not isinstance(value, (type, _DescribedPipe)) and not name.startswith("_")]
    parts += [f"{name}={state[name]!r}" for name in _REPR_SETTINGS if state.get(name) is not None]
    if not parts and getattr(pipe, "_parent_fields", None) == ():  # a source: its data, briefly
        data = next((value for name, value in state.items() if not name.startswith("_")), None)
        parts = [_data_words(data)] if data is not None else []
    return f"({', '.join(parts)})" if parts else ""


def _function_name(fn: Any) -> str:
    inner = getattr(fn, "func", fn)  # functools.partial
    name = getattr(inner, "__qualname__", None) or type(inner).__qualname__
    return f"partial({name})" if inner is not fn else name


def _data_words(data: Any) -> str:
    if isinstance(data, (str, bytes, range)):
        return repr(data) if len(data) <= 40 else f"{type(data).__name__} of {len(data)}"
    try:
        return f"{type(data).__name__} of {len(data):,} items"
    except TypeError:
        return type(data).__name__


def parent_slots(pipe: Any) -> list[tuple[str, Any]]:
    """``(attribute, parent)`` pairs of ``pipe``, in attribute order; a tuple attribute gives one
    pair per pipe in it. Built-in pipes list their fields; other pipes, and the data of sources
    (``_parent_fields = ()``: an ``IterableWrapper`` over another pipe), are scanned, as torch's
    graph functions find pipes wherever a pipe's state holds them."""
    fields = getattr(pipe, "_parent_fields", None)
    state = _state_of(pipe)
    if not fields:
        fields = [name for name in state if not name.startswith(TRANSIENT_PREFIX)]
    slots = []
    for name in fields:
        slots.extend((name, found) for found in _pipes_in(state.get(name)))
    return slots


def _state_of(pipe: Any) -> dict[str, Any]:
    try:
        return vars(pipe)
    except TypeError:
        return {}  # __slots__ classes: nothing to scan


def _pipes_in(value: Any) -> list[Any]:
    if is_datapipe(value):
        return [value]
    if isinstance(value, dict):
        value = list(value.values())
    if isinstance(value, (list, tuple)):
        found: list[Any] = []
        for position, item in enumerate(value):
            if position == SCAN_PROBE_ITEMS and not found:
                break  # a list of data, not of pipes
            found.extend(_pipes_in(item) if isinstance(item, (list, tuple)) else
                         ([item] if is_datapipe(item) else []))
        return found
    return []
