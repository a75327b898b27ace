"""Holding Ctrl-C back, and asking whether this is the main thread, from a thread that Python's
``threading`` did not start: a finalizer runs on whatever thread drops the last reference (a
library's own threads among them, Ray's reply threads say), and ``threading.current_thread()``
there registers a "Dummy" thread for as long as the process lives."""

from __future__ import annotations

import _thread
import threading

from pipeload._interrupts import ctrl_c_held, on_the_main_thread

ENDS_WITHIN_S = 10.0


def test_holding_ctrl_c_on_a_thread_threading_did_not_start_registers_no_thread() -> None:
    before = {thread.ident for thread in threading.enumerate()}
    answers: list[bool] = []
    done = threading.Event()

    def foreign() -> None:  # as a finalizer run there would
        try:
            with ctrl_c_held():
                answers.append(on_the_main_thread())
        finally:
            done.set()

    _thread.start_new_thread(foreign, ())
    assert done.wait(ENDS_WITHIN_S)
    assert answers == [False] and on_the_main_thread()
    dummies = [t for t in threading.enumerate() if t.ident not in before and isinstance(t, threading._DummyThread)]
    assert dummies == []
