"""Ctrl-C (SIGINT) held back while a step must finish, and Ctrl-C raised inside a garbage
collector's finalizer sent again where the user's code sees it.

Below the engine and the transport, both of which hold Ctrl-C: the engine while it stops
workers, the transport while a buffer's descriptor has no owner yet (made, not yet kept).
"""

from __future__ import annotations

import contextlib
import signal
import sys
import threading
import time
import weakref
from collections.abc import Callable, Iterator
from typing import Any


@contextlib.contextmanager
def ctrl_c_held() -> Iterator[None]:
    """Hold Ctrl-C (SIGINT) back while the block runs, then deliver it: stopping is finished
    before the KeyboardInterrupt is raised (or the handler in place runs).

    Stopping is where a second Ctrl-C lands when a user presses it twice: the first one's
    stopping waits (up to a second or two) for a worker stuck in user code. Raised there, it
    would leave the rest undone for good (workers running, their pipes and slabs held for as
    long as the process lives), because the finalizer that stops them has already fired and
    does not fire twice. Stopping is bounded (``JOIN_GRACE_S + TERMINATE_GRACE_S + KILL_GRACE_S``),
    so the interrupt comes that much later at most. Only the main thread takes signals and may
    set handlers; elsewhere, where SIGINT is ignored or not handled in Python, and inside an
    outer hold, the block runs as it is.
    """
    previous = signal.getsignal(signal.SIGINT) if on_the_main_thread() else None
    if not callable(previous) or getattr(previous, "holds_ctrl_c", False):
        yield
        return
    held: list[tuple[int, Any]] = []

    def hold(signum: int, frame: Any) -> None:
        held.append((signum, frame))

    hold.holds_ctrl_c = True  # type: ignore[attr-defined]
    signal.signal(signal.SIGINT, hold)
    try:
        yield
    finally:
        signal.signal(signal.SIGINT, previous)
        if held and _inside_a_finalizer(sys._getframe()):
            # Raised in a finalizer (an iterator dropped after ``break``), it would be printed as
            # "Exception ignored" and lost: sent again once the finalizer has returned, it is
            # raised in the user's code.
            _send_ctrl_c_again(threading.get_ident())
        elif held:
            previous(*held[0])  # the default handler raises KeyboardInterrupt here


def on_the_main_thread() -> bool:
    """Whether this is the main thread. Asked by ident, not with ``threading.current_thread()``:
    code that runs in finalizers may run on a thread Python's ``threading`` did not start (a
    library's C++ thread dropping the last reference to one of our objects), which
    ``current_thread()`` would register for good as a "Dummy" thread."""
    return threading.get_ident() == threading.main_thread().ident


def ctrl_c_kept(callback: Callable[..., Any]) -> Callable[..., Any]:
    """``callback``, for a ``weakref.finalize``: a Ctrl-C raised inside it while the garbage
    collection runs it (printed as "Exception ignored" and lost: the training loop went on) is
    sent again to the main thread once no finalizer runs there, and lands in the user's code."""

    def call(*args: Any, **kwargs: Any) -> Any:
        try:
            return callback(*args, **kwargs)
        except KeyboardInterrupt:
            if not _inside_a_finalizer(sys._getframe()):
                raise
            _send_ctrl_c_again(threading.main_thread().ident)
            return None

    return call


def ctrl_c_kept_in_weakref_callback(callback: Callable[[Any], None]) -> Callable[[Any], None]:
    """``callback``, for a ``weakref.ref``'s callback (only ever run as its object dies, where
    what it raises is printed as "Exception ignored" and lost): a Ctrl-C raised inside it is
    sent again to the main thread once no such callback or finalizer runs there. ``callback``
    must be safe to run twice: it runs again after a Ctrl-C, which may have come before it did
    its work (a weak reference to each batch storage lets go of its slab lease this way, many
    times a second: a Ctrl-C pressed during a training loop lands there now and then)."""

    def _called_by_the_collector(held: Any) -> None:
        try:
            callback(held)
        except KeyboardInterrupt:
            callback(held)
            _send_ctrl_c_again(threading.main_thread().ident)

    return _called_by_the_collector


def _inside_a_finalizer(frame: Any) -> bool:
    """Whether a ``weakref.finalize`` runs in ``frame`` or below it on its stack, called by the
    garbage collection of its object (its weakref passed as ``_``), where what it raises is
    printed and dropped (called by our code, ``finalizer()``, it raises to its caller); or a
    weak reference's callback made by :func:`ctrl_c_kept_in_weakref_callback`."""
    while frame is not None:
        if frame.f_code is _FINALIZER_CODE and frame.f_locals.get("_") is not None:
            return True
        if frame.f_code is _WEAKREF_CALLBACK_CODE:
            return True
        frame = frame.f_back
    return False


def _send_ctrl_c_again(thread: int | None) -> None:
    """Raise SIGINT again in ``thread`` once no finalizer runs there (on a thread of its own, as
    the one that caught it is inside one)."""
    threading.Thread(target=_ctrl_c_after_finalizers, args=(thread,), name="pipeload-ctrl-c",
                     daemon=True).start()


def _ctrl_c_after_finalizers(main_thread: int) -> None:
    """Send SIGINT to the main thread as soon as no finalizer runs on it (a real signal, so that
    a blocking call it has gone on to is interrupted as a terminal's Ctrl-C would)."""
    deadline = time.monotonic() + CTRL_C_REDELIVERY_WAIT_S
    while _inside_a_finalizer(sys._current_frames().get(main_thread)) and time.monotonic() < deadline:
        time.sleep(CTRL_C_REDELIVERY_POLL_S)  # a finalizer's remaining steps take microseconds
    signal.pthread_kill(main_thread, signal.SIGINT)


_FINALIZER_CODE = weakref.finalize.__call__.__code__
_WEAKREF_CALLBACK_CODE = ctrl_c_kept_in_weakref_callback(print).__code__
CTRL_C_REDELIVERY_POLL_S = 0.001
CTRL_C_REDELIVERY_WAIT_S = 5.0  # then sent anyway: a finalizer that another one's stop holds up
