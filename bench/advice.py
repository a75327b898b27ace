"""Is the stats' advice stable, and does following it keep the loader as fast? (issue 28)

    PYTHONPATH=src:. python -m bench.advice [--runs 5] [--rounds 3] [--batches 120] [--workload NAME ...]

Part 1, verdicts: each workload is profiled ``--runs`` times from scratch, as ``pipeload
profile`` does (every wait timed, epoch after epoch until the stats hold twice what a verdict
needs); the verdict is what limits and the settings suggested. A workload passes when every run
gives the same verdict.

Part 2, following the advice: for each workload whose verdict suggests settings, the loader as it
was and the loader with the suggestion take turns for ``--rounds`` rounds, each timed over
``--batches`` batches after its first (samples/s), with a second run of the loader as it was in
every round as an A/A control. The advice passes unless the median of the rounds' own ratios
(advised / as it was, paired within each round) is below 1 by more than the widest A/A ratio's
distance from 1 (the noise).

Workloads: the README's ("See what your loader is doing": the demo's JPEGs, batch 64, 2 process
workers, a 20 ms training step; and its ten lines: random tensors, 2 workers), the demo's loaders
(``pipeload bench``: classic, economic, threads, pipes; no training step), and two where advice
names a setting (an I/O-like dataset waiting 2 ms per item; a pipe of 4 shards read by 8 workers).
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
import warnings
from collections import Counter
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import torch

import pipeload
from pipeload.cli.images import TarImages, ensure_images, shard_pipe
from pipeload.cli.profile import ProfileOptions, load
from pipeload.datapipes.iter import IterableWrapper
from pipeload.stats.analysis import diagnose
from pipeload.stats.recorder import usable_cpus

IMAGES = 2048
SEED = 0


class Waits(pipeload.Dataset):
    """Each item waits ``wait_s`` (a remote read) and costs next to no CPU."""

    def __init__(self, count: int, wait_s: float) -> None:
        self.count, self.wait_s = count, wait_s

    def __len__(self) -> int:
        return self.count

    def __getitem__(self, index: int) -> torch.Tensor:
        time.sleep(self.wait_s)
        return torch.full((16,), float(index))


def _shard_items(shard: int) -> list[int]:
    return list(range(shard * 1000, shard * 1000 + 500))


def _decode_like(value: int) -> torch.Tensor:
    until = time.perf_counter() + 0.0005  # half a millisecond of work per sample
    while time.perf_counter() < until:
        pass
    return torch.full((8,), float(value))


@dataclass(frozen=True)
class Workload:
    """A loader to judge: ``make(**settings)`` builds it; ``step_ms`` of training per batch."""

    name: str
    make: Callable[..., pipeload.DataLoader]
    step_ms: float = 0.0


def _jpeg_loader(images: TarImages, **settings: Any) -> pipeload.DataLoader:
    options = {"batch_size": 64, "shuffle": True, "num_workers": 2, **settings}
    return pipeload.DataLoader(images, generator=torch.Generator().manual_seed(SEED), **options)


def _pipes_loader(images: TarImages, **settings: Any) -> pipeload.DataLoader:
    options = {"batch_size": 64, "num_workers": 2, **settings}
    return pipeload.DataLoader(shard_pipe(images), generator=torch.Generator().manual_seed(SEED), **options)


def _ten_lines(**settings: Any) -> pipeload.DataLoader:
    generator = torch.Generator().manual_seed(SEED)
    dataset = pipeload.TensorDataset(torch.randn(1000, 3, 32, 32, generator=generator),
                                     torch.randint(0, 10, (1000,), generator=generator))
    train, _ = pipeload.random_split(dataset, [0.9, 0.1], generator=torch.Generator().manual_seed(0))
    options = {"batch_size": 64, "shuffle": True, "num_workers": 2, "persistent_workers": True, **settings}
    return pipeload.DataLoader(train, **options)


def _shards(**settings: Any) -> pipeload.DataLoader:
    pipe = IterableWrapper(list(range(4))).sharding_filter().flatmap(_shard_items).map(_decode_like)
    return pipeload.DataLoader(pipe, **{"batch_size": 50, "num_workers": 8, **settings})


def workloads() -> list[Workload]:
    images = TarImages(ensure_images(IMAGES))
    return [
        Workload("readme-stats", lambda **s: _jpeg_loader(images, **s), step_ms=20),
        Workload("readme-ten-lines", _ten_lines),
        Workload("demo-classic", lambda **s: _jpeg_loader(images, **s)),
        Workload("demo-economic", lambda **s: _jpeg_loader(images, **{"mode": "economic", **s})),
        Workload("demo-threads", lambda **s: _jpeg_loader(images, **{"worker_type": "thread", **s})),
        Workload("demo-pipes", lambda **s: _pipes_loader(images, **s)),
        Workload("io-waits", lambda **s: pipeload.DataLoader(Waits(4096, 0.002), **{"batch_size": 32, "num_workers": 2, **s})),
        Workload("shards-8-over-4", _shards),
    ]


@dataclass(frozen=True)
class Verdict:
    """One profile's verdict, and the readings it rests on."""

    bottleneck: str
    settings: tuple[tuple[str, Any], ...]
    words: str
    readings: str


def verdict_of(workload: Workload) -> Verdict:
    """Profile a fresh loader as ``pipeload profile`` does."""
    loader = workload.make()
    loader._stats.time_every_batch()
    load(loader, ProfileOptions(target=workload.name, step_ms=workload.step_ms))
    stats = loader.stats()
    diagnosis = diagnose(stats)
    workers = [w for w in stats.workers if w.kind != "main" and w.tasks]
    busy = sum(w.busy_s for w in workers)
    readings = (f"{stats.batches} batches, waited {stats.wait_fraction:.0%}, busy "
                f"{statistics.mean(w.busy_fraction for w in workers) if workers else 0:.0%}, on or queued "
                f"for a CPU {sum(w.cpu_s + w.queued_s for w in workers) / busy if busy else 0:.0%}")
    return Verdict(diagnosis.bottleneck, tuple(sorted(diagnosis.suggestions.items())), diagnosis.advice,
                   readings)


def samples_per_s(loader: pipeload.DataLoader, batches: int, step_ms: float) -> float:
    """Samples/s over ``batches`` batches after the first, epoch after epoch."""
    seen = samples = 0
    started = 0.0
    while seen <= batches:
        for batch in loader:
            if seen == 0:
                started = time.perf_counter()
            else:
                samples += len(batch[0]) if isinstance(batch, (list, tuple)) else len(batch)
            seen += 1
            if step_ms:
                _busy(step_ms / 1000)
            if seen > batches:
                break
    return samples / (time.perf_counter() - started)


def _busy(seconds: float) -> None:
    until = time.perf_counter() + seconds
    while time.perf_counter() < until:
        pass


@dataclass(frozen=True)
class Following:
    """One workload's advice followed: medians of the loader as it was, advised, and A/A."""

    workload: str
    settings: dict[str, Any]
    before: float
    after: float
    ratio: float
    noise: float
    per_round: tuple[float, ...]

    @property
    def slower_than_noise(self) -> bool:
        return self.ratio < 1 - self.noise


def follow(workload: Workload, settings: dict[str, Any], rounds: int, batches: int) -> Following:
    """The loader as it was (twice: A/A) and with ``settings``, taking turns for ``rounds``."""
    runs: dict[str, list[float]] = {"before": [], "again": [], "after": []}
    order = ["before", "after", "again"]
    for round_ in range(rounds):
        for name in order[round_ % 3:] + order[:round_ % 3]:
            loader = workload.make(**(settings if name == "after" else {}))
            runs[name].append(samples_per_s(loader, batches, workload.step_ms))
            del loader
    before, after = statistics.median(runs["before"]), statistics.median(runs["after"])
    aa = [again / first for first, again in zip(runs["before"], runs["again"])]
    noise = max(abs(r - 1) for r in aa)
    per_round = tuple(a / b for a, b in zip(runs["after"], runs["before"]))
    # Paired within each round: machine load drifts between rounds far more than within one.
    return Following(workload.name, settings, before, after, statistics.median(per_round), noise, per_round)


def _load_average() -> str:
    try:
        with open("/proc/loadavg") as file:
            return " ".join(file.read().split()[:3])
    except OSError:
        return "unknown"


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--runs", type=int, default=5, help="profiles per workload (default 5)")
    parser.add_argument("--rounds", type=int, default=3, help="rounds when following advice (default 3)")
    parser.add_argument("--batches", type=int, default=120, help="batches timed per run (default 120)")
    parser.add_argument("--workload", action="append", help="only these (repeatable)")
    args = parser.parse_args(argv)
    warnings.simplefilter("ignore")  # "more workers than CPUs" is part of two workloads
    chosen = [w for w in workloads() if not args.workload or w.name in args.workload]
    print(f"{usable_cpus()} usable CPUs, torch {torch.__version__}; load average {_load_average()}", flush=True)
    print("\n| workload | same verdict | verdict (runs) | suggested |\n|---|---|---|---|")
    advised = []
    for workload in chosen:
        verdicts = [verdict_of(workload) for _ in range(args.runs)]
        counts = Counter((v.bottleneck, v.settings) for v in verdicts)
        (bottleneck, settings), most = counts.most_common(1)[0]
        shown = "; ".join(f"{b}{' ' + str(dict(t)) if t else ''} x{n}" for (b, t), n in counts.items())
        print(f"| {workload.name} | {most} of {args.runs} | {shown} | {dict(settings) or 'keep these'} |", flush=True)
        print(f"|   | | {verdicts[0].words} | |", flush=True)
        print(f"|   | | runs: {'; '.join(v.readings for v in verdicts)} | |", flush=True)
        if settings:
            advised.append((workload, dict(settings)))
    if advised:
        print("\n| workload | advice | before samples/s | after | after/before, median of rounds (each) | A/A noise | slower beyond noise |"
              "\n|---|---|---:|---:|---|---:|---|")
    for workload, settings in advised:
        result = follow(workload, settings, args.rounds, args.batches)
        rounds = ", ".join(f"{r:.2f}" for r in result.per_round)
        print(f"| {result.workload} | {settings} | {result.before:,.0f} | {result.after:,.0f} | "
              f"{result.ratio:.2f}x ({rounds}) | +-{result.noise:.0%} | "
              f"{'YES' if result.slower_than_noise else 'no'} |", flush=True)
    print(f"\nload average at the end {_load_average()}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
