"""Decode and augment JPEGs in Ray actors, feeding a training loop (one process, or torchrun).

    python examples/ray_preprocess.py                        # a local Ray cluster, 2 actors
    RAY_ADDRESS=head-node:6379 python examples/ray_preprocess.py --actors 8 --actor-cpus 1

    # every rank joins the same cluster and runs its own actors on its own share of the files
    ray start --head --port=6379
    RAY_ADDRESS=127.0.0.1:6379 torchrun --standalone --nproc_per_node=2 examples/ray_preprocess.py

The graph: the image files are shuffled (the same order on every rank: the loader seeds it),
split across ranks and actors (``sharding_filter``), and everything above the boundary (reading,
decoding, random crop and flip) runs in ``--actors`` Ray actors per rank. The images come back
through Ray's object store without copies, in the same order as if one process had made them,
and the training loop batches them here. ``print(loader.stats())`` at the end has a line for the
Ray stage: the time its actors spent, the time in transfer, and how long the loop waited.

The JPEGs are written once into ``--images-dir`` (small synthetic pictures, labelled by their
colour). On a real cluster the actors must be able to read the files (a shared file system, or
object storage through ``open_files``) and import pipeload and this script's functions: install
them on every node, or pass ``--runtime-env`` as JSON (e.g. ``{"working_dir": "."}``).
"""

from __future__ import annotations

import argparse
import io
import json
import os
from pathlib import Path

import numpy as np
import torch
import torch.distributed as dist

import pipeload
from pipeload.datapipes.iter import IterableWrapper

SIZE = 32  # the training crop
COLOURS = ((220, 40, 40), (40, 200, 60), (50, 80, 230))  # the three classes


def write_images(directory: Path, count: int) -> list[str]:
    """Small JPEGs of a noisy colour, named ``<index>-<label>.jpg``."""
    from PIL import Image

    directory.mkdir(parents=True, exist_ok=True)
    rng = np.random.default_rng(0)
    for index in range(count):
        label = index % len(COLOURS)
        pixels = np.clip(rng.normal(COLOURS[label], 30, size=(48, 48, 3)), 0, 255).astype(np.uint8)
        buffer = io.BytesIO()
        Image.fromarray(pixels).save(buffer, format="JPEG", quality=90)
        (directory / f"{index:05d}-{label}.jpg").write_bytes(buffer.getvalue())
    return sorted(str(path) for path in directory.glob("*.jpg"))


def decode_and_augment(path: str) -> tuple[torch.Tensor, int]:
    """Runs in a Ray actor: read, decode, random crop and flip; a CHW float tensor and its label."""
    from PIL import Image

    with Image.open(path) as image:
        pixels = torch.from_numpy(np.array(image.convert("RGB"), dtype=np.uint8))
    top, left = (int(v) for v in torch.randint(0, pixels.shape[0] - SIZE + 1, (2,)))
    crop = pixels[top:top + SIZE, left:left + SIZE].permute(2, 0, 1).float().div_(255)
    if torch.rand(()) < 0.5:
        crop = crop.flip(2)
    label = int(Path(path).stem.split("-")[1])
    return crop.contiguous(), label


def make_loader(paths: list[str], args: argparse.Namespace) -> pipeload.DataLoader:
    actor_options = {"num_cpus": args.actor_cpus} if args.actor_cpus else {}
    if args.runtime_env:
        actor_options["runtime_env"] = json.loads(args.runtime_env)
    pipe = (IterableWrapper(paths).shuffle().sharding_filter()
            .map(decode_and_augment)
            .queue_boundary("ray", args.buffer_size, num_actors=args.actors, **actor_options))
    return pipeload.DataLoader(pipe, batch_size=args.batch_size, shuffle=True)


def connect(args: argparse.Namespace, ranks: int) -> None:
    import ray

    address = args.address or os.environ.get("RAY_ADDRESS")
    if address is None and ranks > 1:
        raise SystemExit("with several ranks, start one cluster (`ray start --head`) and set RAY_ADDRESS: "
                         "each rank would otherwise start a cluster of its own")
    if address is not None:
        ray.init(address=address)
    else:
        ray.init(num_cpus=args.local_cpus, include_dashboard=False)


def train(args: argparse.Namespace) -> None:
    ranks = int(os.environ.get("WORLD_SIZE", "1"))
    if ranks > 1:
        dist.init_process_group("gloo")
    rank = dist.get_rank() if ranks > 1 else 0
    directory = Path(args.images_dir)
    if rank == 0 and len(list(directory.glob("*.jpg"))) < args.images:
        write_images(directory, args.images)
    if ranks > 1:
        dist.barrier()  # the other ranks wait for the files
    paths = sorted(str(path) for path in directory.glob("*.jpg"))[:args.images]
    torch.manual_seed(args.seed)  # the same on every rank: their shuffles agree, their shares split one order
    connect(args, ranks)
    model = torch.nn.Sequential(torch.nn.Conv2d(3, 8, 3, stride=2), torch.nn.ReLU(),
                                torch.nn.AdaptiveAvgPool2d(1), torch.nn.Flatten(), torch.nn.Linear(8, len(COLOURS)))
    if ranks > 1:
        model = torch.nn.parallel.DistributedDataParallel(model)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.5)
    loader = make_loader(paths, args)
    for epoch in range(args.epochs):
        seen = correct = 0
        for images, labels in loader:
            logits = model(images)
            loss = torch.nn.functional.cross_entropy(logits, labels)
            optimizer.zero_grad()
            loss.backward()
            optimizer.step()
            seen += len(labels)
            correct += int((logits.argmax(1) == labels).sum())
        print(f"rank {rank} epoch {epoch}: {seen} images, accuracy {correct / max(seen, 1):.2f}", flush=True)
    if rank == 0:
        print(loader.stats())
    loader.dataset.release_actors()
    if ranks > 1:
        dist.destroy_process_group()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--images-dir", default="ray-images")
    parser.add_argument("--images", type=int, default=600)
    parser.add_argument("--epochs", type=int, default=2)
    parser.add_argument("--batch-size", type=int, default=32)
    parser.add_argument("--actors", type=int, default=2, help="Ray actors per rank")
    parser.add_argument("--actor-cpus", type=float, default=None, help="CPUs each actor reserves")
    parser.add_argument("--buffer-size", type=int, default=64, help="images asked for ahead, per rank")
    parser.add_argument("--runtime-env", default=None, help="the actors' Ray runtime_env, as JSON")
    parser.add_argument("--address", default=None, help="the Ray cluster (default: RAY_ADDRESS, else a local one)")
    parser.add_argument("--local-cpus", type=int, default=2, help="CPUs of the local cluster, without an address")
    parser.add_argument("--seed", type=int, default=0)
    train(parser.parse_args())


if __name__ == "__main__":
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    main()
