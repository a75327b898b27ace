"""A batch's slab lease is let go of in a weak reference's callback, run as the batch dies: many
times a second in a training loop, so a Ctrl-C pressed during the loop lands there now and then.
Raised there, it would be printed as "Exception ignored" and lost (the loop went on as if nobody
had pressed it): it must reach the loop, and the lease must still be let go of."""

from __future__ import annotations

import signal
import sys
import threading
import time

import pytest
import torch

from pipeload.transport import lease_holders

REACHES_THE_LOOP_S = 5.0


def _ctrl_c_as_called(name: str):
    """A trace function that sends this process a real SIGINT as the function ``name`` is
    entered (a Ctrl-C landing at its first instruction), then stops tracing."""

    def trace(frame, event, arg):
        if event == "call" and frame.f_code.co_name == name:
            sys.settrace(None)
            signal.raise_signal(signal.SIGINT)
        return None

    return trace


def test_a_ctrl_c_as_a_lease_is_let_go_reaches_the_loop_and_the_lease_goes(ctrl_c_raises) -> None:
    storage = torch.UntypedStorage(64)
    kept_before = lease_holders.leases_kept()
    lease_holders.keep_lease_with(storage, memoryview(bytearray(8)))
    assert lease_holders.leases_kept() == kept_before + 1
    sys.settrace(_ctrl_c_as_called("_let_go"))
    try:
        with pytest.raises(KeyboardInterrupt):
            del storage  # the callback runs here, and returns
            stop = threading.Event()
            deadline = time.monotonic() + REACHES_THE_LOOP_S
            while time.monotonic() < deadline:  # the loop's next steps: where the Ctrl-C belongs
                stop.wait(0.01)
    finally:
        sys.settrace(None)
    assert lease_holders.leases_kept() == kept_before
