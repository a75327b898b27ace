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
import time
import warnings
from typing import Any

from pipeload._user_frame import first_frame_outside_pipeload

INSTALL_HINT = "pip install 'pipeload[ray]'"
PROBE_TIMEOUT_S = 5.0  # an address where Ray does not answer fails within this, not after Ray's retries
_forked_from_driver = False
_connected_here = False  # this process has been connected to Ray (through this module)
_started_here = False  # ... to a local cluster it started (or found) with ray.init(), no address


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
        ConnectionError: nothing at the address answers as a Ray cluster (one line naming
            ``address`` or ``RAY_ADDRESS``, within ``PROBE_TIMEOUT_S``).
        ValueError: a ``host:port`` address whose port is not a number.
    """
    global _connected_here, _started_here
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
    named = f"address={address!r}" if address else f"RAY_ADDRESS={os.environ.get('RAY_ADDRESS')!r}"
    address = address or os.environ.get("RAY_ADDRESS") or None
    if address is None and multiprocessing.parent_process() is not None:
        raise RuntimeError(
            "queue_boundary('ray') found no Ray cluster to join from this worker process: start "
            "one (`ray start --head`) and set RAY_ADDRESS, or pass address= to the boundary"
        )
    if address is not None:
        _probe(address, named)
    try:
        ray.init(address=address, **init_options)
    except ConnectionError as error:
        # The cause Ray chained (a refused auth token, a version mismatch) is what to act on.
        cause = error.__cause__ or error.__context__
        why = f" ({type(cause).__name__}: {cause})" if cause is not None else ""
        raise ConnectionError(f"could not join the Ray cluster at {named}: {error}{why}") from error
    _connected_here = True
    _started_here = address is None
    return ray


# What an actor's options ask of each node resource, by the names cluster_resources() uses.
_RESOURCE_NAMES = {"num_cpus": "CPU", "num_gpus": "GPU", "memory": "memory"}


def check_actors_fit(ray: Any, num_actors: int, actor_options: dict[str, Any], start_timeout_s: float,
                     copies: int = 1) -> None:
    """Say at once when ``num_actors`` actors with ``actor_options``, for each of ``copies``
    copies of the graph that run at once on this cluster (a rank's DataLoader workers, which
    take turns batch by batch, so all their actors must be placed), ask for more of a resource
    than the whole cluster has (only what the options name: an actor that names none needs a CPU
    to be placed, not one each). Such actors would wait for ``start_timeout_s`` and fail.

    Raises:
        ValueError: the cluster is the local one this process started (or found) with
            ``ray.init()`` and no address: it cannot grow, so the wait would be for nothing.

    Warns:
        UserWarning: any other cluster (an autoscaler may add nodes while the actors wait).
    """
    asked = _asked(actor_options)
    try:
        total = ray.cluster_resources()
    except Exception:  # a client connection, or an old Ray: Ray's own wait says it later
        return
    actors = num_actors * copies
    short = [f"{actors} x {amount:g} {name} = {actors * amount:g}, the cluster has "
             f"{total.get(name, 0):g}" for name, amount in asked.items()
             if actors * amount > total.get(name, 0) + 1e-9]
    if not short:
        return
    each = (f" ({num_actors} for each of the {copies} DataLoader workers, whose actors all run at "
            "once: the workers take turns batch by batch)") if copies > 1 else ""
    what = (f"queue_boundary('ray') asks for {actors} actor{'s' * (actors != 1)}{each} with "
            f"{_named(actor_options)}: "
            f"{'; '.join(short)}")
    if _started_here and not _forked_from_driver:
        raise ValueError(
            f"{what}. This process started (or found) that local cluster with ray.init() and it "
            "cannot grow: give fewer actors (num_actors) or workers, or ask less of each, start it larger "
            "(init_options=), or join a larger cluster (address= or RAY_ADDRESS)"
        )
    warnings.warn(
        f"{what} now. The actors beyond what fits wait for the cluster to grow (an autoscaler), "
        f"for at most start_timeout_s={start_timeout_s:g} s, then the run fails",
        stacklevel=first_frame_outside_pipeload(),
    )


def fit_now(ray: Any, num_actors: int, actor_options: dict[str, Any]) -> bool:
    """Whether ``num_actors`` more actors with ``actor_options`` fit in what the cluster has free
    now (what the options name; True where Ray cannot say)."""
    asked = _asked(actor_options)
    if not asked:
        return True
    try:
        free = ray.available_resources()
    except Exception:
        return True
    return all(num_actors * amount <= free.get(name, 0) + 1e-9 for name, amount in asked.items())


def _asked(actor_options: dict[str, Any]) -> dict[str, float]:
    """What one actor asks of each resource, by the names cluster_resources() uses."""
    asked = {_RESOURCE_NAMES[key]: float(value) for key, value in actor_options.items()
             if key in _RESOURCE_NAMES and value}
    asked.update({name: float(value) for name, value in (actor_options.get("resources") or {}).items()})
    return asked


def _named(actor_options: dict[str, Any]) -> str:
    return ", ".join(f"{key}={value!r}" for key, value in actor_options.items()
                     if key in _RESOURCE_NAMES or key == "resources")


def _probe(address: str, named: str) -> None:
    """Fail fast, naming the argument (``named``), when nothing at ``address`` answers as a Ray
    cluster: ``ray.init`` retries for minutes, whether nothing listens there or something other
    than Ray's GCS does. Addresses that are not ``host:port`` (``auto``, ``ray://...``) are Ray's.

    The GCS is a gRPC server: on a new connection it sends HTTP/2's SETTINGS frame first, so
    the probe reads the first frame header and looks at its type (an HTTP/1 server answers
    text, many other servers nothing at all).
    """
    host, _, port = address.rpartition(":")
    if not host or "://" in address:
        return
    if not port.isdigit():
        raise ValueError(f"queue_boundary('ray') {named} should be 'host:port' with a port number, "
                         "'auto', or a 'ray://' address")
    deadline = time.monotonic() + PROBE_TIMEOUT_S
    try:
        with socket.create_connection((host.strip("[]"), int(port)), timeout=PROBE_TIMEOUT_S) as probe:
            probe.sendall(_HTTP2_PREFACE + _EMPTY_SETTINGS)
            first = _read(probe, _FRAME_HEADER_BYTES, deadline)
    except OSError as error:
        reason = f"no answer within {PROBE_TIMEOUT_S:g} s" if isinstance(error, TimeoutError) else error.strerror or error
        raise ConnectionError(
            f"could not reach the Ray cluster at {named} ({reason}); is it running "
            "(`ray start --head`), and is the address right?"
        ) from None
    if len(first) < _FRAME_HEADER_BYTES or first[3] != _SETTINGS_FRAME:
        raise ConnectionError(
            f"no Ray cluster at {named}: something listens there but does not answer as Ray's "
            f"GCS (it said {first[:24]!r}); is the port the head node's (`ray start --head "
            "--port`, 6379 by default)?"
        )


_HTTP2_PREFACE = b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n"
_SETTINGS_FRAME = 0x4
_EMPTY_SETTINGS = bytes([0, 0, 0, _SETTINGS_FRAME, 0, 0, 0, 0, 0])  # length 0, no flags, stream 0
_FRAME_HEADER_BYTES = 9


def _read(connection: socket.socket, count: int, deadline: float) -> bytes:
    """Up to ``count`` bytes, fewer if the peer closes; TimeoutError past ``deadline``."""
    got = b""
    while len(got) < count:
        connection.settimeout(max(0.01, deadline - time.monotonic()))
        chunk = connection.recv(count - len(got))
        if not chunk:
            break
        got += chunk
    return got
