"""Reaching a Ray cluster from the process that reads a Ray queue boundary.

Ray is optional: nothing here imports it until a Ray boundary is iterated, so ``import pipeload``
costs nothing more without it, and a missing package is one line naming the extra to install.

Which cluster: one this process is already connected to; else the boundary's ``address``, or
``RAY_ADDRESS``; else, in a main process only, a new local cluster (``ray.init()``'s default).
A DataLoader process worker never starts a cluster of its own (each worker would start one):
it connects to the address the boundary was sent with, which is the cluster its parent was
connected to when the pipe was pickled for a spawn or forkserver worker.

Ray is not fork-safe: a process forked from one connected to Ray inherits a connection whose
threads did not survive the fork, and any call through it hangs; so does a new connection from
a process forked after its parent's ``ray.shutdown()`` (the library's threads stay behind).
Such a process gets a clear error instead, saying how to start its workers. "Connected" is seen
at the fork (``ray.is_initialized()``) or remembered from this module's own connections: Ray
keeps no trace of one that ended.
"""

from __future__ import annotations

import multiprocessing
import os
import socket
import sys
from typing import Any

INSTALL_HINT = "pip install 'pipeload[ray]'"
PROBE_TIMEOUT_S = 5.0  # an address nobody answers fails within this, not after Ray's retries
_forked_from_driver = False
_connected_here = False  # this process has been connected to Ray (through this module)


def import_ray() -> Any:
    """The ``ray`` module.

    Raises:
        ImportError: Ray is not installed (one line naming the extra to install).
    """
    try:
        import ray
    except ImportError:
        raise ImportError(f"queue_boundary('ray') needs the ray package: {INSTALL_HINT}") from None
    return ray


def _note_fork() -> None:
    """In a forked child: remember whether the parent was connected to Ray (then Ray cannot
    work here)."""
    global _forked_from_driver
    ray = sys.modules.get("ray")
    connected = _connected_here or bool(ray is not None and ray.is_initialized())
    _forked_from_driver = _forked_from_driver or connected


os.register_at_fork(after_in_child=_note_fork)


def connected_address() -> str | None:
    """The address of the cluster this process is connected to (not one inherited through a
    fork), or None; what a pipe pickled here tells the process that unpickles it."""
    ray = sys.modules.get("ray")
    if ray is None or _forked_from_driver or not ray.is_initialized():
        return None
    try:
        return ray.get_runtime_context().gcs_address
    except Exception:  # a client connection (ray://) has no GCS address to hand on
        return None


def connect(address: str | None, init_options: dict[str, Any]) -> Any:
    """Make sure this process is connected to a Ray cluster; return the ``ray`` module.

    Args:
        address: the cluster to join (None: ``RAY_ADDRESS``, else a new local cluster in a main
            process).
        init_options: more keyword arguments for ``ray.init`` when this call connects.

    Raises:
        ImportError: Ray is not installed.
        RuntimeError: this process was forked from one connected to Ray, or it is a
            DataLoader worker with no address to connect to.
        ConnectionError: nothing answers at the address (one line naming it).
    """
    global _connected_here
    ray = import_ray()
    if _forked_from_driver:
        raise RuntimeError(
            "queue_boundary('ray') cannot use Ray in a process forked from one that is or was "
            "connected to Ray (Ray does not survive fork, even after ray.shutdown()). Start the "
            "DataLoader's workers with multiprocessing_context='spawn' or 'forkserver', or connect "
            "only in the workers: set RAY_ADDRESS (or the boundary's address=) instead of "
            "connecting in the main process"
        )
    if ray.is_initialized():
        _connected_here = True
        return ray
    address = address or os.environ.get("RAY_ADDRESS") or None
    if address is None and multiprocessing.parent_process() is not None:
        raise RuntimeError(
            "queue_boundary('ray') found no Ray cluster to join from this worker process: start "
            "one (`ray start --head`) and set RAY_ADDRESS, or pass address= to the boundary"
        )
    if address is not None:
        _probe(address)
    try:
        ray.init(address=address, **init_options)
    except ConnectionError as error:
        raise ConnectionError(f"could not join the Ray cluster at {address!r}: {error}") from None
    _connected_here = True
    return ray


def _probe(address: str) -> None:
    """Fail fast, naming ``address``, when nothing listens there (Ray itself retries for a
    minute or more). Addresses that are not ``host:port`` (``auto``, ``ray://...``) are Ray's."""
    host, _, port = address.rpartition(":")
    if not host or not port.isdigit() or "://" in address:
        return
    try:
        socket.create_connection((host, int(port)), timeout=PROBE_TIMEOUT_S).close()
    except OSError as error:
        raise ConnectionError(
            f"could not reach the Ray cluster at {address!r} ({error.strerror or error}); is it "
            "running (`ray start --head`), and is the address right?"
        ) from None
