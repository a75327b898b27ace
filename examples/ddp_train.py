"""Train a tiny model with DDP on CPU (gloo), loading with pipeload, under torchrun.

    torchrun --standalone --nproc_per_node=2 examples/ddp_train.py                # map-style
    torchrun --standalone --nproc_per_node=2 examples/ddp_train.py --data shards  # tar shards

Map-style: a ``DistributedSampler`` gives each rank its share, shuffled anew every epoch
(``set_epoch``). Shards: a DataPipe shuffles the tar files, splits them across ranks and workers
(``sharding_filter``), opens them and streams their members (``open_files``,
``load_from_tar``). Shards of
different sizes leave the ranks with different numbers of batches, which would hang DDP on the
last step; ``equal_batches="pad"`` makes every rank yield as many (ranks that run out repeat
their last batch).

``--record DIR`` writes what each rank saw (``rank{N}.json``: the sample ids of every batch, per
epoch), which is how the test checks that the ranks' shares are disjoint and cover the data.

Checkpoints: ``--checkpoint DIR`` saves, after every step, each rank's model, generator states and
``loader.state_dict()``; ``--stop-after N`` stops every rank after step N (a preemption), and
``--resume`` continues from the checkpoint, mid-epoch, with the same batches an uninterrupted run
would have seen:

    torchrun --standalone --nproc_per_node=2 examples/ddp_train.py --checkpoint ckpt --stop-after 7
    torchrun --standalone --nproc_per_node=2 examples/ddp_train.py --checkpoint ckpt --resume
"""

from __future__ import annotations

import argparse
import io
import json
import os
import tarfile
from pathlib import Path

import numpy as np
import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel

import pipeload
from pipeload.datapipes.iter import IterableWrapper

FEATURES = 8
SHARD_SIZES = (7, 9, 6, 8, 10)  # uneven on purpose: 40 samples in 5 tar files


def features_of(sample_id: int) -> np.ndarray:
    """The sample's features, the same wherever it is read from."""
    return np.random.default_rng(sample_id).standard_normal(FEATURES).astype(np.float32)


class Points(pipeload.Dataset):
    """A map-style dataset: sample ``i`` is (i, its features, its label)."""

    def __init__(self, length: int) -> None:
        self.length = length

    def __len__(self) -> int:
        return self.length

    def __getitem__(self, i: int) -> tuple[int, torch.Tensor, int]:
        return i, torch.from_numpy(features_of(i)), i % 2


def write_shards(directory: Path) -> list[str]:
    """Write the tar shards (one member per sample, named by its id) and return their paths."""
    directory.mkdir(parents=True, exist_ok=True)
    paths, first = [], 0
    for number, size in enumerate(SHARD_SIZES):
        path = directory / f"shard-{number:03d}.tar"
        with tarfile.open(path, "w") as archive:
            for sample_id in range(first, first + size):
                payload = features_of(sample_id).tobytes()
                member = tarfile.TarInfo(f"{sample_id:06d}.f32")
                member.size = len(payload)
                archive.addfile(member, io.BytesIO(payload))
        paths.append(str(path))
        first += size
    return paths


def as_sample(member: tuple[str, bytes]) -> tuple[int, torch.Tensor, int]:
    """A tar member (``"<shard>/<id>.f32"``, its bytes) as (id, features, label)."""
    path, data = member
    sample_id = int(path.rsplit("/", 1)[1].split(".")[0])
    return sample_id, torch.from_numpy(np.frombuffer(data, dtype=np.float32).copy()), sample_id % 2


def shard_pipe(paths: list[str]) -> pipeload.IterableDataset:
    """Shard files shuffled, split across ranks × workers, then streamed: each rank reads its files."""
    return (IterableWrapper(paths).shuffle().sharding_filter()
            .open_files("b").load_from_tar().map(as_sample))


def make_loader(kind: str, directory: Path, args: argparse.Namespace) -> pipeload.DataLoader:
    if kind == "map":
        dataset = Points(sum(SHARD_SIZES))
        sampler = pipeload.DistributedSampler(dataset, shuffle=True, seed=args.seed)
        return pipeload.DataLoader(dataset, batch_size=args.batch_size, sampler=sampler,
                                   num_workers=args.num_workers)
    if dist.get_rank() == 0 and not list(directory.glob("shard-*.tar")):
        write_shards(directory)
    dist.barrier()  # the other ranks wait for the files
    paths = sorted(str(p) for p in directory.glob("shard-*.tar"))
    return pipeload.DataLoader(shard_pipe(paths), batch_size=args.batch_size, shuffle=True,
                               num_workers=args.num_workers, equal_batches="pad")


class Checkpoints:
    """One JSON file per rank, replaced whole after every step (a crash leaves the last one)."""

    def __init__(self, directory: str | None) -> None:
        self.path = Path(directory, f"rank{dist.get_rank()}.json") if directory else None

    def save(self, model: torch.nn.Module, loader: pipeload.DataLoader, epoch: int, seen: dict) -> None:
        if self.path is None:
            return
        self.path.parent.mkdir(parents=True, exist_ok=True)
        state = {"model": {k: v.tolist() for k, v in model.state_dict().items()},
                 "torch_rng": torch.get_rng_state().tolist(), "loader": loader.state_dict(),
                 "epoch": epoch, "seen": seen}
        partial = self.path.with_suffix(".partial")
        partial.write_text(json.dumps(state))
        os.replace(partial, self.path)

    def restore(self, model: torch.nn.Module, loader: pipeload.DataLoader) -> tuple[int, dict]:
        state = json.loads(self.path.read_text())
        model.load_state_dict({k: torch.tensor(v) for k, v in state["model"].items()})
        torch.set_rng_state(torch.tensor(state["torch_rng"], dtype=torch.uint8))
        loader.load_state_dict(state["loader"])  # the next iter(loader) goes on mid-epoch
        return state["epoch"], state["seen"]


def train(args: argparse.Namespace) -> dict:
    torch.manual_seed(args.seed)  # the same on every rank: shard shuffles agree, so do the weights
    loader = make_loader(args.data, Path(args.shards), args)
    model = DistributedDataParallel(torch.nn.Linear(FEATURES, 2))
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)  # no momentum: no optimizer state to keep
    checkpoints = Checkpoints(args.checkpoint)
    first_epoch, seen = checkpoints.restore(model.module, loader) if args.resume else (0, {})
    steps = sum(len(batches) for batches in seen.values())
    for epoch in range(first_epoch, args.epochs):
        if isinstance(loader.sampler, pipeload.DistributedSampler):
            loader.sampler.set_epoch(epoch)
        seen.setdefault(str(epoch), [])
        loss = None
        for ids, x, y in loader:
            loss = torch.nn.functional.cross_entropy(model(x), y)
            optimizer.zero_grad()
            loss.backward()  # DDP's all_reduce: every rank must take the same number of steps
            optimizer.step()
            seen[str(epoch)].append(ids.tolist())
            steps += 1
            checkpoints.save(model.module, loader, epoch, seen)
            if steps == args.stop_after:
                return {"rank": dist.get_rank(), "stopped": steps}
        if dist.get_rank() == 0 and loss is not None:
            print(f"epoch {epoch}: {len(seen[str(epoch)])} steps, loss {loss.item():.3f}", flush=True)
    weights = {k: v.tolist() for k, v in model.module.state_dict().items()}
    return {"rank": dist.get_rank(), "world_size": dist.get_world_size(), "seen": seen, "weights": weights}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--data", choices=("map", "shards"), default="map")
    parser.add_argument("--shards", default="ddp-shards", help="directory of the tar shards")
    parser.add_argument("--epochs", type=int, default=2)
    parser.add_argument("--batch-size", type=int, default=4)
    parser.add_argument("--num-workers", type=int, default=2)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--record", default=None, help="write rank{N}.json here")
    parser.add_argument("--checkpoint", default=None, help="save each rank's checkpoint here")
    parser.add_argument("--stop-after", type=int, default=None, help="stop after this many steps")
    parser.add_argument("--resume", action="store_true", help="continue from --checkpoint")
    args = parser.parse_args()
    dist.init_process_group("gloo")
    try:
        record = train(args)
        if args.record:
            Path(args.record, f"rank{record['rank']}.json").write_text(json.dumps(record))
    finally:
        dist.destroy_process_group()


if __name__ == "__main__":
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    main()
