"""What the source tests share: tar shards written on the spot, and a real HTTP server on
127.0.0.1 that can cut a response half-way or stall it (module level, so it all pickles)."""

from __future__ import annotations

import bz2
import collections
import gzip
import io
import json
import lzma
import socket
import tarfile
import threading
from functools import partial
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any, NamedTuple

import numpy as np

from pipeload.datapipes import IterDataPipe, NotAvailable, PipeIterator

STALL_SLICE_S = 0.05
TRICKLE_BYTES = 4096  # what a trickling response sends before it hangs


def sample_files(shard: int, index: int) -> list[tuple[str, bytes]]:
    """The members of one sample: a tiny JPEG, its class, some JSON."""
    from PIL import Image

    key = f"s{shard:02d}_{index:03d}"
    image = Image.fromarray(np.full((6, 5, 3), (shard * 40 + index) % 256, np.uint8))
    encoded = io.BytesIO()
    image.save(encoded, "JPEG")
    return [
        (f"{key}.jpg", encoded.getvalue()),
        (f"{key}.cls", str(index).encode()),
        (f"{key}.json", json.dumps({"shard": shard, "index": index}).encode()),
    ]


def tar_bytes(members: list[tuple[str, bytes]]) -> bytes:
    """An uncompressed tar archive holding ``members`` in order."""
    buffer = io.BytesIO()
    with tarfile.open(fileobj=buffer, mode="w") as tar:
        for name, data in members:
            info = tarfile.TarInfo(name)
            info.size = len(data)
            tar.addfile(info, io.BytesIO(data))
    return buffer.getvalue()


def compress(data: bytes, compression: str) -> bytes:
    if compression == "":
        return data
    if compression == "gz":
        return gzip.compress(data)
    if compression == "bz2":
        return bz2.compress(data)
    if compression == "xz":
        return lzma.compress(data)
    if compression == "zst":
        import zstandard

        return zstandard.ZstdCompressor().compress(data)
    raise ValueError(compression)


def write_shards(directory: Path, shards: int, samples: int, compression: str = "") -> list[Path]:
    """``shards`` archives of ``samples`` samples each; returns their paths, in order."""
    suffix = ".tar" + (f".{compression}" if compression else "")
    paths = []
    for shard in range(shards):
        members = [m for index in range(samples) for m in sample_files(shard, index)]
        path = directory / f"shard-{shard:04d}{suffix}"
        path.write_bytes(compress(tar_bytes(members), compression))
        paths.append(path)
    return paths


def all_keys(shards: int, samples: int) -> list[str]:
    return sorted(f"s{shard:02d}_{index:03d}" for shard in range(shards) for index in range(samples))


def sample_key(sample: dict[str, Any]) -> str:
    return sample["__key__"]


class _ShardHandler(BaseHTTPRequestHandler):
    """Serves files from the server's root; HTTP/1.0, one request per connection. ``requests``
    counts the GETs (reads), not the HEADs (a pipeline asking whether its shards exist)."""

    def __init__(self, *args: Any, shards: ShardServer, **kwargs: Any) -> None:
        self.shards = shards
        super().__init__(*args, **kwargs)

    def do_HEAD(self) -> None:  # noqa: N802  (whether a shard is there: no body, not counted as a read)
        path = self.shards.root / self._name()
        if not path.is_file():
            self.send_error(404)
            return
        self.send_response(200)
        self.send_header("Content-Length", str(path.stat().st_size))
        self.end_headers()

    def _name(self) -> str:
        """The file asked for; a query string (a signed URL's) does not choose the file."""
        return self.path.lstrip("/").split("?", 1)[0]

    def do_GET(self) -> None:  # noqa: N802  (http.server's name)
        name = self._name()
        path = self.shards.root / name
        self.shards.note_request(name)
        self.shards.encodings_asked.append(self.headers.get("Accept-Encoding"))
        if not path.is_file():
            self.send_error(404, f"no such shard: {name}")
            return
        data = path.read_bytes()
        fault = self.shards.take_fault(name)
        if fault == "trickle":
            self._trickle(data)
            return
        self.send_response(200)
        self.send_header("Content-Length", str(len(data)))
        self.send_header("Content-Type", "application/x-tar")
        self.end_headers()
        if fault is None:
            self.wfile.write(data)
            return
        self.wfile.write(data[: len(data) // 2])
        self.wfile.flush()
        if fault == "stall":
            self.shards.stalled.set()
            while not self.shards.released.wait(STALL_SLICE_S):
                pass
        self.connection.shutdown(socket.SHUT_RDWR)  # cut the response half-way

    def _trickle(self, data: bytes) -> None:
        """A few bytes from where the request's range begins, then a stall until the server
        closes: a proxy that stops forwarding after each reconnect."""
        start = int(self.headers.get("Range", "bytes=0-")[len("bytes="):].split("-")[0])
        self.send_response(206 if start else 200)
        if start:
            self.send_header("Content-Range", f"bytes {start}-{len(data) - 1}/{len(data)}")
        self.send_header("ETag", '"v1"')
        self.send_header("Content-Length", str(len(data) - start))
        self.end_headers()
        self.wfile.write(data[start:start + TRICKLE_BYTES])
        self.wfile.flush()
        while not self.shards.released.wait(STALL_SLICE_S):
            pass
        self.connection.shutdown(socket.SHUT_RDWR)

    def log_message(self, format: str, *args: Any) -> None:  # noqa: A002
        pass  # quiet: the tests read the request counts instead


class _ServerThread:
    """A ThreadingHTTPServer on 127.0.0.1 run by a thread; closing stops both."""

    def _serve(self, handler: Any, name: str) -> None:
        self._httpd = ThreadingHTTPServer(("127.0.0.1", 0), handler)
        self._httpd.daemon_threads = True
        self._thread = threading.Thread(target=self._httpd.serve_forever, kwargs={"poll_interval": 0.05},
                                        name=name, daemon=True)
        self._thread.start()

    def url(self, name: str) -> str:
        host, port = self._httpd.server_address[:2]
        return f"http://{host}:{port}/{name}"

    def close(self) -> None:
        self._httpd.shutdown()
        self._httpd.server_close()
        self._thread.join()

    def __enter__(self) -> Any:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


class ShardServer(_ServerThread):
    """A real HTTP server in a thread on 127.0.0.1, serving ``root``.

    ``drop(name, times)`` makes the next ``times`` responses for ``name`` stop half-way (the
    connection is cut after half the bytes a full Content-Length promised); ``stall(name)`` makes
    every response for ``name`` stop half-way and hang until the server closes.
    """

    def __init__(self, root: Path) -> None:
        self.root = root
        self._lock = threading.Lock()
        self.requests: collections.Counter[str] = collections.Counter()
        self.encodings_asked: list[str | None] = []  # each GET's Accept-Encoding
        self._drops: dict[str, int] = {}
        self._stalls: set[str] = set()
        self._trickles: set[str] = set()
        self.stalled = threading.Event()  # set once a stalled response is hanging
        self.released = threading.Event()
        self._serve(partial(_ShardHandler, shards=self), "test-shard-server")

    def drop(self, name: str, times: int) -> None:
        with self._lock:
            self._drops[name] = times

    def stall(self, name: str) -> None:
        with self._lock:
            self._stalls.add(name)

    def trickle(self, name: str) -> None:
        """Every response for ``name`` (ranges answered) sends ``TRICKLE_BYTES`` and hangs."""
        with self._lock:
            self._trickles.add(name)

    def note_request(self, name: str) -> None:
        with self._lock:
            self.requests[name] += 1

    def take_fault(self, name: str) -> str | None:
        with self._lock:
            if name in self._stalls:
                return "stall"
            if name in self._trickles:
                return "trickle"
            if self._drops.get(name, 0) > 0:
                self._drops[name] -= 1
                return "drop"
        return None

    def close(self) -> None:
        self.released.set()
        super().close()


def refused_url(name: str) -> str:
    """A URL on 127.0.0.1 where nothing listens: connecting is refused at once."""
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    return f"http://127.0.0.1:{port}/{name}"


def free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


class Gate:
    """A source the test feeds by hand: NotAvailable until items are released, then the end."""

    def __init__(self) -> None:
        self.released: list[Any] = []
        self.ended = False

    def release(self, item: Any) -> None:
        self.released.append(item)


class GatedPipe(IterDataPipe):
    """An iterable pipe over a :class:`Gate` (one thread: the test's)."""

    def __init__(self, gate: Gate) -> None:
        self.gate = gate

    def __iter__(self) -> PipeIterator[Any]:
        return _GatedIterator(self.gate)


class _GatedIterator(PipeIterator[Any]):
    def __init__(self, gate: Gate) -> None:
        super().__init__()
        self._gate = gate

    def nonblocking_next(self) -> Any:
        if self._gate.released:
            return self._gate.released.pop(0)
        if self._gate.ended:
            raise StopIteration
        raise NotAvailable


class ServerBehaviour(NamedTuple):
    """What a :class:`ChangingServer` tells and honours.

    Attributes:
        etag, last_modified: send these validators.
        ranges: answer ``Range`` with 206 (else always the whole object, 200).
        conditions: honour ``If-Match``, ``If-Unmodified-Since`` and ``If-Range`` (a naive
            server ignores them and serves the range of whatever it holds now).
        validators_after_a_cut: send the validators in the responses after the first cut too
            (False: another backend behind the balancer, which sends none).
    """

    etag: bool = True
    last_modified: bool = True
    ranges: bool = True
    conditions: bool = True
    validators_after_a_cut: bool = True


class _Version(NamedTuple):
    data: bytes
    etag: str
    last_modified: str


class _ChangingHandler(BaseHTTPRequestHandler):
    def __init__(self, *args: Any, server_state: ChangingServer, **kwargs: Any) -> None:
        self.state = server_state
        super().__init__(*args, **kwargs)

    def do_GET(self) -> None:  # noqa: N802  (http.server's name)
        state, behaviour = self.state, self.state.behaviour
        version, cut = state.serve(self.path.lstrip("/"), self.headers.get("Range"))
        if version is None:
            self.send_error(404)
            return
        if behaviour.conditions and self._precondition_fails(version):
            self.send_error(412)
            return
        start = self._range_start(version)
        if start is not None and start >= len(version.data):
            self.send_error(416)
            return
        body = version.data if start is None else version.data[start:]
        self.send_response(200 if start is None else 206)
        if start is not None:
            self.send_header("Content-Range", f"bytes {start}-{len(version.data) - 1}/{len(version.data)}")
        self.send_header("Content-Length", str(len(body)))
        validators = behaviour.validators_after_a_cut or not state.cut_was_made
        if behaviour.etag and validators:
            self.send_header("ETag", version.etag)
        if behaviour.last_modified and validators:
            self.send_header("Last-Modified", version.last_modified)
        self.end_headers()
        if not cut:
            self.wfile.write(body)
            return
        self.wfile.write(body[: len(body) // 2])
        self.wfile.flush()
        state.cut_made()  # the object is replaced before the client reconnects
        self.connection.shutdown(socket.SHUT_RDWR)

    def _precondition_fails(self, version: _Version) -> bool:
        match = self.headers.get("If-Match")
        since = self.headers.get("If-Unmodified-Since")
        return (match is not None and match != version.etag) or (
            since is not None and since != version.last_modified)

    def _range_start(self, version: _Version) -> int | None:
        """The byte a 206 starts at, or None for the whole object (200)."""
        asked = self.headers.get("Range")
        if asked is None or not self.state.behaviour.ranges:
            return None
        condition = self.headers.get("If-Range")
        if self.state.behaviour.conditions and condition is not None and condition not in (
                version.etag, version.last_modified):
            return None  # If-Range: the object changed, so the whole new one
        return int(asked.removeprefix("bytes=").split("-")[0])

    def log_message(self, format: str, *args: Any) -> None:  # noqa: A002
        pass


class ChangingServer(_ServerThread):
    """A real HTTP server on 127.0.0.1 holding one object per name, which can be replaced by a
    new version at the moment a response is cut half-way (the client's reconnect then finds the
    new version). ``ranges_asked`` records each request's Range header."""

    def __init__(self, behaviour: ServerBehaviour = ServerBehaviour()) -> None:
        self.behaviour = behaviour
        self._lock = threading.Lock()
        self._objects: dict[str, _Version] = {}
        self._replacements: dict[str, _Version] = {}
        self._pending_cut: str | None = None
        self.cut_was_made = False
        self.ranges_asked: list[str | None] = []
        self._serve(partial(_ChangingHandler, server_state=self), "test-changing-server")

    def put(self, name: str, data: bytes, generation: int = 1) -> None:
        self._objects[name] = _version(data, generation)

    def replace_after_cut(self, name: str, data: bytes, generation: int = 2) -> None:
        """The next response for ``name`` is cut half-way, and ``data`` replaces it then (as
        generation 1, the same version again if ``data`` is the same: a plain cut)."""
        with self._lock:
            self._replacements[name] = _version(data, generation)

    def serve(self, name: str, asked_range: str | None) -> tuple[_Version | None, bool]:
        """(what ``name`` holds now, whether to cut this response)."""
        with self._lock:
            self.ranges_asked.append(asked_range)
            cut = name in self._replacements and self._pending_cut is None
            if cut:
                self._pending_cut = name
            return self._objects.get(name), cut

    def cut_made(self) -> None:
        with self._lock:
            name, self._pending_cut = self._pending_cut, None
            self.cut_was_made = True
            if name is not None:
                self._objects[name] = self._replacements.pop(name)

def _version(data: bytes, generation: int) -> _Version:
    import hashlib

    dates = {1: "Mon, 01 Jan 2024 00:00:00 GMT", 2: "Tue, 02 Jan 2024 00:00:00 GMT"}
    return _Version(data, f'"{hashlib.sha1(data).hexdigest()[:16]}"', dates[generation])
