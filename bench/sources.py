"""JPEGs in tar shards over HTTP through pipes, against the same JPEGs as local files under
torch.utils.data, in one run.

    python -m bench.sources [--images 3000] [--per-shard 100] [--num-workers 2] [--repeats 3] [--read-ahead 64]

pipeload: ``webdataset_pipeline(<shard URLs>)`` with a ``jpg`` handler that decodes with Pillow
and resizes to 64x64 (the ``jpeg`` workload's work), samples batched by
``pipeload.DataLoader(pipe, batch_size=64, num_workers=k)``. The shards are served by Python's
``http.server`` in its own process on 127.0.0.1, so every byte crosses a real socket.
torch: ``bench.workloads.JpegFiles`` (a map-style folder dataset over the same images as local
files, the same decode and resize) through ``torch.utils.data.DataLoader(batch_size=64,
num_workers=k)``.

Each repeat runs both loaders, alternating which goes first; the table gives median samples/s
and the ratio.
"""

from __future__ import annotations

import argparse
import io
import socket
import statistics
import subprocess
import sys
import tarfile
import tempfile
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import numpy as np
import torch.utils.data

import pipeload
from bench.measure import measure, warm_up
from bench.workloads import JPEG_OUTPUT_SIDE, JpegFiles, write_jpegs
from pipeload.datapipes import webdataset_pipeline

BATCH_SIZE = 64
WARMUP_BATCHES = 3
SERVER_START_S = 20.0


class DecodeResize:
    """The ``jpg`` handler: Pillow decode, RGB, bilinear resize to a square, uint8 CHW tensor."""

    def __init__(self, side: int = JPEG_OUTPUT_SIDE) -> None:
        self.side = side

    def __call__(self, data: bytes) -> torch.Tensor:
        from PIL import Image

        with Image.open(io.BytesIO(data)) as image:
            resized = image.convert("RGB").resize((self.side, self.side), Image.BILINEAR)
        return torch.from_numpy(np.array(resized, dtype=np.uint8)).permute(2, 0, 1).contiguous()


def image_and_label(sample: dict[str, Any]) -> tuple[torch.Tensor, int]:
    return sample["jpg"], sample["cls"]


def write_shards(paths: list[str], directory: Path, per_shard: int) -> list[str]:
    """Pack the JPEGs into uncompressed tar shards, ``per_shard`` images each; returns names."""
    directory.mkdir(parents=True, exist_ok=True)
    names = []
    for first in range(0, len(paths), per_shard):
        name = f"train-{first // per_shard:05d}.tar"
        with tarfile.open(directory / name, "w") as tar:
            for index in range(first, min(first + per_shard, len(paths))):
                tar.add(paths[index], arcname=f"{index:06d}.jpg")
                label = str(index % 10).encode()
                info = tarfile.TarInfo(f"{index:06d}.cls")
                info.size = len(label)
                tar.addfile(info, io.BytesIO(label))
        names.append(name)
    return names


class HttpServerProcess:
    """``python -m http.server`` on 127.0.0.1 in its own process, serving ``directory``."""

    def __init__(self, directory: Path) -> None:
        with socket.socket() as probe:
            probe.bind(("127.0.0.1", 0))
            self.port = probe.getsockname()[1]
        self._process = subprocess.Popen(
            [sys.executable, "-m", "http.server", str(self.port), "--bind", "127.0.0.1", "--directory", str(directory)],
            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        self._wait_ready()

    def _wait_ready(self) -> None:
        deadline = time.monotonic() + SERVER_START_S
        while time.monotonic() < deadline:
            try:
                socket.create_connection(("127.0.0.1", self.port), timeout=0.5).close()
                return
            except OSError:
                time.sleep(0.05)  # polling a port that is not open yet
        self.close()
        raise RuntimeError(f"http.server did not start on port {self.port}")

    def url(self, name: str) -> str:
        return f"http://127.0.0.1:{self.port}/{name}"

    def close(self) -> None:
        if self._process.poll() is None:
            self._process.terminate()
            self._process.wait(timeout=5)


def pipeload_loader(urls: list[str], num_workers: int, read_ahead: int) -> Callable[[], Any]:
    pipe = webdataset_pipeline(urls, shuffle_shards=False, shuffle_buffer=0, handlers={"jpg": DecodeResize()},
                               read_ahead=read_ahead)
    pipe = pipe.map(image_and_label)
    return lambda: pipeload.DataLoader(pipe, batch_size=BATCH_SIZE, num_workers=num_workers)


def torch_loader(paths: list[str], num_workers: int) -> Callable[[], Any]:
    dataset = JpegFiles(paths)
    return lambda: torch.utils.data.DataLoader(dataset, batch_size=BATCH_SIZE, num_workers=num_workers)


def batch_size_of(batch: Any) -> int:
    return len(batch[1])


def run(args: argparse.Namespace, root: Path) -> dict[str, float]:
    paths = write_jpegs(root / "jpegs", args.images)
    names = write_shards(paths, root / "shards", args.per_shard)
    server = HttpServerProcess(root / "shards")
    try:
        factories = {
            "pipeload (tar over HTTP)": pipeload_loader([server.url(n) for n in names], args.num_workers,
                                                        args.read_ahead),
            "torch (local files)": torch_loader(paths, args.num_workers),
        }
        for factory in factories.values():
            warm_up(factory, WARMUP_BATCHES)
        rates: dict[str, list[float]] = {name: [] for name in factories}
        for repeat in range(args.repeats):
            order = list(factories) if repeat % 2 == 0 else list(reversed(factories))
            for name in order:
                result = measure(factories[name], batch_size_of, workload="jpeg_shards", loader=name)
                if result.samples != args.images:
                    raise RuntimeError(f"{name} loaded {result.samples} samples, expected {args.images}")
                rates[name].append(result.samples_per_s)
    finally:
        server.close()
    return {name: statistics.median(values) for name, values in rates.items()}


def main(argv: Sequence[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    with tempfile.TemporaryDirectory(prefix="pipeload-bench-sources-") as scratch:
        medians = run(args, Path(scratch))
    ours, theirs = medians.values()
    print(f"{args.images} JPEGs (160x120 -> {JPEG_OUTPUT_SIDE}x{JPEG_OUTPUT_SIDE}), {args.per_shard} per shard, "
          f"batch {BATCH_SIZE}, {args.num_workers} process workers, read_ahead={args.read_ahead}, "
          f"median of {args.repeats}")
    for name, rate in medians.items():
        print(f"  {name:26s} {rate:10.0f} samples/s")
    print(f"  ratio pipeload/torch       {ours / theirs:10.2f}x")
    return 0


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--images", type=int, default=3000)
    parser.add_argument("--per-shard", type=int, default=100)
    parser.add_argument("--num-workers", type=int, default=2)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--read-ahead", type=int, default=64, help="webdataset_pipeline's read_ahead")
    return parser


if __name__ == "__main__":
    sys.exit(main())
