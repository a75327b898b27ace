"""Shared buffers made by the transport: a Ctrl-C that lands as one is made leaves no
descriptor behind."""

from __future__ import annotations

import os
import signal

import pytest

from pipeload.transport import shared_memory
from pipeload.transport.shared_memory import BUFFER_PREFIX, Backing, create_buffer
from pipeload.transport.slab_memory import SlabMemory


def our_buffers() -> list[str]:
    """The descriptors of this process open on one of our buffers."""
    found = []
    for fd in os.listdir("/proc/self/fd"):
        try:
            target = os.readlink(f"/proc/self/fd/{fd}")
        except OSError:
            continue
        if BUFFER_PREFIX in target:
            found.append(target)
    return found


@pytest.fixture
def ctrl_c_as_a_memfd_is_made(monkeypatch: pytest.MonkeyPatch) -> None:
    """Ctrl-C delivered the moment memfd_create returns, before anything holds its descriptor
    (where a user's Ctrl-C landed in stop 53's lifecycle probe, one descriptor leaked each time)."""
    if shared_memory.current_backing() is not Backing.MEMFD:
        pytest.skip("buffers are not memfds here")
    made = os.memfd_create

    def interrupted(*args: object) -> int:
        fd = made(*args)
        signal.raise_signal(signal.SIGINT)  # its handler runs once this call has returned
        return fd

    monkeypatch.setattr(os, "memfd_create", interrupted)


@pytest.mark.usefixtures("ctrl_c_as_a_memfd_is_made")
def test_a_ctrl_c_as_a_buffer_is_made_closes_it() -> None:
    before = our_buffers()
    with pytest.raises(KeyboardInterrupt):
        create_buffer(1 << 20, allocate=False)
    assert our_buffers() == before


@pytest.mark.usefixtures("ctrl_c_as_a_memfd_is_made")
def test_a_ctrl_c_as_a_slab_is_made_closes_its_buffer() -> None:
    before = our_buffers()
    with pytest.raises(KeyboardInterrupt):
        SlabMemory(1 << 20, None)
    assert our_buffers() == before
