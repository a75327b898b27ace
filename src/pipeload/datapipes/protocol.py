"""The non-blocking protocol: ``nonblocking_next()`` answers now or raises :class:`NotAvailable`.

Every built-in pipe's iterator is a :class:`PipeIterator`. Its ``nonblocking_next()`` returns the
next item if one can be had without waiting, raises :class:`NotAvailable` if it cannot yet (an
upstream thread or process has not delivered), and raises ``StopIteration`` at the end.
``__next__`` waits on top of it: sources that deliver asynchronously (queue boundaries, prefetch)
own a :class:`Notifier`, and a waiting consumer sleeps on an event those notifiers set, in slices,
instead of spinning.

Synchronous iterators (a user's generator ``__iter__``, a plain ``IterableDataset``, a list) join
the protocol through :func:`as_nonblocking`: their ``nonblocking_next()`` simply blocks in
``next()``, which is correct because they can always make progress by themselves.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Iterable, Iterator
from typing import Any, Generic, TypeVar

from pipeload._state_fields import StateFields, join
from pipeload.errors import MISSING, IncompatibleStateError, bad_state_field, shortened, state_mismatch
from pipeload.engine.worker_info import worker_stopping

T_co = TypeVar("T_co", covariant=True)
R = TypeVar("R")

WAIT_SLICE_S = 0.1  # a waiting consumer re-checks its sources this often, even without a wake-up
# A NotAvailable with no notifier to wait on (a user's own non-blocking iterator): back off
# from a short poll to this ceiling rather than spin.
POLL_FLOOR_S = 0.0005
POLL_CEILING_S = 0.05


class NotAvailable(Exception):
    """No item is ready yet; the iterator is not exhausted. Ask again later."""


class WaitCancelled(Exception):
    """A wait given ``should_stop`` gave up because it returned True (the waiter is closing)."""


class Notifier:
    """Wakes the consumers waiting for items from one asynchronous source.

    The source calls :meth:`notify` after it makes an item (or an end, or an error) available;
    consumers subscribe an event before they re-check, so a notification between their check and
    their wait is never lost. Thread-safe.
    """

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._listeners: set[threading.Event] = set()

    def subscribe(self, event: threading.Event) -> None:
        with self._lock:
            self._listeners.add(event)

    def unsubscribe(self, event: threading.Event) -> None:
        with self._lock:
            self._listeners.discard(event)

    def notify(self) -> None:
        with self._lock:
            listeners = list(self._listeners)
        for event in listeners:
            event.set()


class PipeIterator(Iterator[T_co], Generic[T_co]):
    """One run over a pipe: owns the run's state and its upstream iterators.

    Subclasses implement :meth:`nonblocking_next`. ``upstream`` holds the iterators of the pipe's
    parents, already adapted to the protocol; :meth:`notifiers`, :meth:`close` and
    :meth:`state_dict` walk them. Used from one thread at a time unless a subclass says otherwise.
    """

    upstream: tuple[PipeIterator[Any], ...] = ()

    def __init__(self, *upstream: Iterable[Any]) -> None:
        self.upstream = tuple(as_nonblocking(source) for source in upstream)

    def __iter__(self) -> PipeIterator[T_co]:
        return self

    def nonblocking_next(self) -> T_co:
        """The next item now; raises NotAvailable if none is ready, StopIteration at the end."""
        raise NotImplementedError(f"{type(self).__name__} must implement nonblocking_next()")

    def __next__(self) -> T_co:
        try:
            return self.nonblocking_next()
        except NotAvailable:
            pass
        # Wait outside the except block: an error raised while waiting (a sample's, a worker's)
        # would otherwise come with "During handling of NotAvailable, another exception occurred".
        return wait_for_next(self)

    def notifiers(self) -> list[Notifier]:
        """The asynchronous sources whose progress can make this iterator ready."""
        found: list[Notifier] = []
        for source in self.upstream:
            found.extend(source.notifiers())
        return found

    def close(self) -> None:
        """Release what this run holds (threads, processes) now; safe to call twice."""
        for source in self.upstream:
            source.close()

    # -- checkpoints (the resume issue builds on these) -------------------------------------

    def state_dict(self) -> dict[str, Any]:
        """This run's position: its own state and its upstream iterators' states, and (for a
        pipe whose stream depends on them) the settings it ran with."""
        state = {"own": self._own_state(), "upstream": [s.state_dict() for s in self.upstream]}
        settings = self._settings()
        if settings:
            state["settings"] = settings
        return state

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Continue from ``state``; call on a fresh iterator before its first item.

        The whole state, this run's and its upstream's, is checked before anything is set.

        Raises:
            IncompatibleStateError: a field is missing, of another type, out of range or not
                one this run could have written; the message names it by its path in the state
                (``upstream.0.own``) and the value received. The run is left as it was.
        """
        load = StateLoad()
        try:
            self.check_state(state, "", load)
        except BaseException:
            load.discard()
            raise
        load.apply()

    def check_state(self, state: Any, path: str, load: StateLoad) -> None:
        """Check ``state`` (found at ``path`` in a larger one) for this run and its upstream,
        setting nothing; add to ``load`` the steps that set it. Subclasses whose state is not
        ``{"own": ..., "upstream": [...]}`` override this; others override
        :meth:`_check_own_state`."""
        if type(self).load_state_dict is not PipeIterator.load_state_dict:
            load.then(lambda: self.load_state_dict(state))  # a user's run that loads its own way
            return
        fields = StateFields(state, path)
        count = len(self.upstream)
        states = fields.sequence("upstream", f"a list of {count} upstream state(s)", length=count)
        for index, (source, source_state) in enumerate(zip(self.upstream, states)):  # type: ignore[arg-type]
            source.check_state(source_state, join(fields.name("upstream"), index), load)
        self._check_settings(fields)
        own = self._check_own_state(fields)
        fields.finish()
        load.then(lambda: self._load_own_state(own))

    def _check_settings(self, fields: StateFields) -> None:
        """Refuse a state taken with other settings (a shuffle buffer of another size, a list
        of another length): its position would be replayed into another stream, some items
        handed out twice and others never."""
        settings = self._settings()
        if not settings:
            return  # a stray "settings" field is refused by ``finish``
        saved = fields.fields("settings")
        assert saved is not None
        differences = {}
        for name, here in settings.items():
            unchecked = here if name in self._settings_unchecked_when_missing else MISSING
            was = saved.raw(name, f"the {name} this {self._pipe_name()} ran with", default=unchecked)
            if was != here or type(was) is not type(here):
                differences[name] = (was, here)
        saved.finish()
        if differences:
            place = f" at {fields.path}" if fields.path else ""
            raise state_mismatch(f"this {self._pipe_name()}{place}", differences)

    # Settings added since states were first written: a state without one still loads.
    _settings_unchecked_when_missing: frozenset[str] = frozenset()

    def _settings(self) -> dict[str, Any]:
        """The settings this run's stream depends on, recorded in its state and compared when
        one is loaded (plain values: ints, bools, strings, None). Stateless pipes record none."""
        return {}

    def _pipe_name(self) -> str:
        return type(self).__name__.lstrip("_").removesuffix("Iterator")

    def _check_own_state(self, fields: StateFields) -> Any:
        """Read and check ``fields["own"]``; return what :meth:`_load_own_state` takes."""
        if type(self)._load_own_state is not PipeIterator._load_own_state:
            return fields.raw("own", "this run's own state")  # a subclass that checks nothing
        return fields.choice("own", [None])  # stateless: a map or a filter keeps nothing

    def _own_state(self) -> Any:
        return None  # stateless: a map or a filter is where its upstream is

    def _load_own_state(self, state: Any) -> None:
        pass


class StateLoad:
    """The steps that set a checked state, gathered while it is checked: nothing is set until
    :meth:`apply`. Iterators made only to check a state (a concat's current input, say) are
    closed by :meth:`discard` when the state is refused."""

    def __init__(self) -> None:
        self._steps: list[Callable[[], None]] = []
        self._made: list[PipeIterator[Any]] = []

    def then(self, step: Callable[[], None]) -> None:
        self._steps.append(step)

    def made(self, iterator: PipeIterator[Any]) -> None:
        self._made.append(iterator)

    def apply(self) -> None:
        for step in self._steps:
            step()

    def discard(self) -> None:
        for iterator in self._made:
            try:
                iterator.close()
            except Exception:  # noqa: BLE001 - refusing the state is the error to report
                pass


def skipped_ahead(items: Iterator[Any], count: int, field: str, has: str) -> Iterator[Any]:
    """``items`` with ``count`` of them read, for a state (at ``field``) that says so many were
    handed out; running out first refuses it, ``has`` saying what ran out ("has {} items").

    Raises:
        IncompatibleStateError: ``items`` ended before ``count``.
    """
    for done in range(count):
        try:
            next(items)
        except StopIteration:
            raise bad_state_field(field, count, f"an int from 0 to {done}", has.format(done)) from None
    return items


def no_checkpoint(iterator: Any, state: Any, path: str) -> IncompatibleStateError:
    """The error for a state given to a run that writes none (it is resumed by skipping)."""
    where = path or "the state"
    return IncompatibleStateError(
        f"cannot load this state: {where} is given to {type(iterator).__name__}, which keeps no "
        f"checkpoint of its position (it is resumed by skipping items), but got {where}={shortened(state)}")


class SkipToResume:
    """Mixin for iterators whose position is not (yet) written down as a checkpoint: asking for
    their ``state_dict()`` says so, and a DataLoader resumes them by skipping instead (exact, if
    slower) rather than from a state that would lose what they hold."""

    def state_dict(self) -> dict[str, Any]:
        raise NotImplementedError(
            f"{type(self).__name__} keeps no checkpoint of its position: it can only be resumed "
            "by skipping items"
        )

    def check_state(self, state: Any, path: str, load: StateLoad) -> None:
        raise no_checkpoint(self, state, path)


def wait_for_next(iterator: PipeIterator[T_co], should_stop: Callable[[], bool] | None = None) -> T_co:
    """Block until ``iterator`` yields, ends or fails, sleeping on its sources' notifiers.

    Raises:
        WaitCancelled: ``should_stop()`` turned True while waiting (checked every slice).
    """
    return wait_until_ready(iterator.nonblocking_next, iterator.notifiers(), should_stop)


def wait_until_ready(
    attempt: Callable[[], R], notifiers: list[Notifier], should_stop: Callable[[], bool] | None = None
) -> R:
    """Call ``attempt`` until it stops raising NotAvailable; between calls, sleep until one of
    ``notifiers`` fires (re-checking every slice), or back off from a short poll when there are
    none.

    Raises:
        WaitCancelled: ``should_stop()`` turned True while waiting (checked every slice); without
            one, in a thread worker, once that worker should stop (its loader's iterator is gone:
            a thread cannot be killed, and a source that never gets ready would keep it polling).
    """
    if should_stop is None:
        should_stop = worker_stopping()
    ready = threading.Event()
    for notifier in notifiers:
        notifier.subscribe(ready)
    poll_s = POLL_FLOOR_S
    try:
        while True:
            ready.clear()  # before the check: a notification after it then wakes the wait
            try:
                return attempt()
            except NotAvailable:
                pass
            if notifiers:
                ready.wait(WAIT_SLICE_S)
            else:
                ready.wait(poll_s)
                poll_s = min(poll_s * 2, POLL_CEILING_S)
            if should_stop is not None and should_stop():
                raise WaitCancelled
    finally:
        for notifier in notifiers:
            notifier.unsubscribe(ready)


_ENDED: Iterator[Any] = iter(())  # what an ended source reads from: StopIteration, always


class BlockingAdapter(PipeIterator[T_co]):
    """A synchronous iterator seen through the protocol: it is always 'ready' (it blocks)."""

    def __init__(self, iterator: Iterator[T_co]) -> None:
        self._iterator = iterator

    def nonblocking_next(self) -> T_co:
        try:
            return next(self._iterator)
        except StopIteration:
            # Ended for good, as a generator is (torch's pipes are generators): an iterator that
            # yields again after its end is not read past it.
            self._iterator = _ENDED
            raise

    __next__ = nonblocking_next

    def close(self) -> None:
        close = getattr(self._iterator, "close", None)  # generators: run their finally blocks
        if close is not None:
            close()

    def state_dict(self) -> dict[str, Any]:
        raise NotImplementedError(
            f"{type(self._iterator).__name__} is a plain iterator with no state_dict(): it can "
            "only be resumed by skipping items"
        )

    def check_state(self, state: Any, path: str, load: StateLoad) -> None:
        raise no_checkpoint(self._iterator, state, path)


def as_nonblocking(source: Iterable[T_co] | Iterator[T_co]) -> PipeIterator[T_co]:
    """Turn a pipe, an iterable dataset, an iterable or an iterator into a protocol iterator.

    Example:
        >>> it = as_nonblocking(range(3))
        >>> it.nonblocking_next(), next(it)
        (0, 1)
    """
    if isinstance(source, PipeIterator):
        return source
    # iter() even on an iterator: a pipe that is its own iterator (a NonBlockingIterDataPipe)
    # starts its run there; any other iterator answers itself. The run a NonBlockingIterDataPipe
    # gives is read through the pipe itself (its checkpoints and errors name the user's class).
    source = iter(source)
    source = getattr(source, RUN_OF, source)
    if isinstance(source, PipeIterator):
        return source
    if _reads_itself_without_blocking(source):
        return _ForeignNonblocking(source)
    return BlockingAdapter(source)


STARTS_A_RUN = "_starts_a_run"  # marks IterDataPipe.nonblocking_next (see below)
RUN_OF = "pipe_whose_run_this_is"  # the pipe behind the iterator a NonBlockingIterDataPipe's iter() gives


def _reads_itself_without_blocking(iterator: Any) -> bool:
    """Whether ``iterator``'s ``nonblocking_next()`` reads the iterator itself.

    An IterDataPipe that is its own iterator (``__iter__`` returns self, ``__next__`` reads)
    inherits the pipe's ``nonblocking_next()``, which starts a run over the pipe, that is,
    calls this function again: it is read through ``next()`` instead.
    """
    method = getattr(iterator, "nonblocking_next", None)
    return callable(method) and not getattr(method, STARTS_A_RUN, False)


class _ForeignNonblocking(PipeIterator[T_co]):
    """A user's iterator that speaks the protocol itself but is not a PipeIterator (a
    ``NonBlockingIterDataPipe``, which is its own iterator, among them). Whatever else it
    offers (``notifiers``, ``close``, ``state_dict``/``load_state_dict``) is used; a checkpoint
    it cannot give is said so, and the loader resumes it by skipping."""

    def __init__(self, iterator: Any) -> None:
        self._iterator = iterator
        self._next = iterator.nonblocking_next

    def nonblocking_next(self) -> T_co:
        try:
            return self._next()
        except StopIteration:
            # Ended for good: a pipe that asks again (a batch handed out short at the end) is
            # told so here, without a call the user's iterator may refuse (the RFC's own queue
            # end raises on any call after its StopIteration: stop 53's pipes skeptic).
            self._next = _ENDED.__next__
            raise

    def notifiers(self) -> list[Notifier]:
        notifiers = getattr(self._iterator, "notifiers", None)
        return list(notifiers()) if callable(notifiers) else []

    def close(self) -> None:
        close = getattr(self._iterator, "close", None)
        if close is not None:
            close()

    def state_dict(self) -> dict[str, Any]:
        state_dict = getattr(self._iterator, "state_dict", None)
        if not callable(state_dict):
            raise NotImplementedError(
                f"{type(self._iterator).__name__} has no state_dict(): it can only be resumed by "
                "skipping items"
            )
        return {"own": state_dict(), "upstream": []}

    def check_state(self, state: Any, path: str, load: StateLoad) -> None:
        """Only the pipe's own ``load_state_dict()`` can read its state: it is checked for the
        frame around it here, and the pipe's refusal becomes an IncompatibleStateError."""
        fields = StateFields(state, path)
        fields.sequence("upstream", "an empty list", length=0)
        own = fields.raw("own", f"the state {type(self._iterator).__name__}.state_dict() gave")
        fields.finish()
        if not callable(getattr(self._iterator, "load_state_dict", None)):
            raise no_checkpoint(self._iterator, state, path)
        load.then(lambda: self._load_users_state(own, fields.name("own")))

    def _load_users_state(self, own: Any, path: str) -> None:
        try:
            self._iterator.load_state_dict(own)
        except IncompatibleStateError:
            raise
        except Exception as error:
            raise IncompatibleStateError(
                f"cannot load this state: {type(self._iterator).__name__}.load_state_dict() refused "
                f"{path}: {type(error).__name__}: {error}") from error
