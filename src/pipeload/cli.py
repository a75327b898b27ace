"""``pipeload`` on the command line.

    pipeload bench [--num-workers N] [--batch-size B] [--samples S] [--epochs E]

``bench`` loads one synthetic image dataset with pipeload and with torch's own DataLoader in the
same process, and prints samples/s for each and the ratio pipeload/torch. torch's side comes from
``bench/baseline.py`` in a source checkout (the package itself never calls torch's loader);
without it, only pipeload's row is printed. It uses only
pipeload's public API, exactly as a user would. The fuller comparison (several workloads, memory
and shared-memory peaks) is ``python -m bench.run`` in a source checkout.

Subcommands are argparse sub-parsers, each with its own ``_<name>_command`` handler, so
``pipeload profile`` can join ``bench`` without touching it.
"""

from __future__ import annotations

import argparse
import contextlib
import importlib.util
import sys
import time
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Protocol

import torch

import pipeload
from pipeload._bench_data import SyntheticImages

# One seed for the shuffling generator and the global RNG, so every run loads the same batches.
SEED = 0
# torch's side of the demo: outside the package, so pipeload itself never calls torch's loader.
BASELINE_PATH = Path(__file__).resolve().parents[2] / "bench" / "baseline.py"
WORKER_TYPES = ("process", "thread")


@dataclass(frozen=True)
class BenchConfig:
    """What ``pipeload bench`` loads, and how.

    ``worker_type`` goes to pipeload only; torch's loader always uses processes.
    """

    num_workers: int = 2
    batch_size: int = 64
    samples: int = 8192
    epochs: int = 2
    worker_type: str = "process"


@dataclass(frozen=True)
class EpochTiming:
    """One loader's pass over the dataset: how many samples arrived, and how long it took."""

    loader_name: str
    epoch: int
    samples: int
    seconds: float


@dataclass(frozen=True)
class LoaderSummary:
    """All epochs of one loader added up."""

    loader_name: str
    samples: int
    seconds: float

    @property
    def samples_per_s(self) -> float:
        return self.samples / self.seconds if self.seconds > 0 else float("inf")


# Builds a fresh loader over the dataset; the benchmark iterates what it returns once per epoch.
LoaderFactory = Callable[[Any, BenchConfig], Iterable[Any]]


def make_pipeload_loader(dataset: Any, config: BenchConfig) -> Iterable[Any]:
    """A ``pipeload.DataLoader`` over ``dataset`` as ``config`` asks."""
    return pipeload.DataLoader(
        dataset,
        batch_size=config.batch_size,
        shuffle=True,
        num_workers=config.num_workers,
        generator=torch.Generator().manual_seed(SEED),
        worker_type=config.worker_type,
    )


def available_loaders() -> dict[str, LoaderFactory]:
    """pipeload, and torch's loader beside it when the checkout's ``bench/baseline.py`` is there.

    Found by path from this file, not by module name, so whatever ``bench`` happens to be
    importable from the current directory cannot stand in for it.
    """
    loaders: dict[str, LoaderFactory] = {"pipeload": make_pipeload_loader}
    baseline_path = BASELINE_PATH
    if not baseline_path.is_file():
        print(f"torch's side of the comparison needs a source checkout ({baseline_path} is "
              "missing): pipeload only", file=sys.stderr)
        return loaders
    spec = importlib.util.spec_from_file_location("_pipeload_bench_baseline", baseline_path)
    baseline = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(baseline)
    loaders["torch"] = baseline.make_torch_loader
    return loaders


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point of the ``pipeload`` command and of ``python -m pipeload``.

    Args:
        argv: the arguments after the program name; ``sys.argv[1:]`` when None.

    Returns:
        The process exit status.

    Example:
        >>> main(["bench", "--samples", "256"])  # doctest: +SKIP
    """
    args = build_parser().parse_args(argv)
    return args.handler(args)


def build_parser() -> argparse.ArgumentParser:
    """The argument parser, one sub-parser per subcommand."""
    parser = argparse.ArgumentParser(
        prog="pipeload", description="pipeload: a drop-in replacement for torch's data loading."
    )
    commands = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    _add_bench_parser(commands)
    return parser


def _add_bench_parser(commands: argparse._SubParsersAction) -> None:
    defaults = BenchConfig()
    bench = commands.add_parser(
        "bench",
        help="compare pipeload with torch's DataLoader on a synthetic image dataset",
        description=(
            "Load synthetic 3x64x64 images (normalised, randomly flipped) with pipeload and with "
            "torch's DataLoader in one process, alternating which goes first each epoch, and "
            "print samples/s for each and the ratio pipeload/torch."
        ),
    )
    bench.add_argument("--num-workers", type=_non_negative_int, default=defaults.num_workers,
                       help="worker count for both loaders (default: %(default)s)")
    bench.add_argument("--batch-size", type=_positive_int, default=defaults.batch_size,
                       help="samples per batch (default: %(default)s)")
    bench.add_argument("--samples", type=_positive_int, default=defaults.samples,
                       help="dataset length (default: %(default)s)")
    bench.add_argument("--epochs", type=_positive_int, default=defaults.epochs,
                       help="passes over the dataset per loader (default: %(default)s)")
    bench.add_argument("--worker-type", choices=WORKER_TYPES, default=defaults.worker_type,
                       help="pipeload's workers: processes or threads (default: %(default)s)")
    bench.set_defaults(handler=_bench_command)


def _bench_command(args: argparse.Namespace) -> int:
    config = BenchConfig(
        num_workers=args.num_workers,
        batch_size=args.batch_size,
        samples=args.samples,
        epochs=args.epochs,
        worker_type=args.worker_type,
    )
    print(describe(config), flush=True)
    loaders = available_loaders()
    timings = run_bench(config, loaders)
    print(format_table(summarise(timings, list(loaders))))
    return 0


def describe(config: BenchConfig) -> str:
    """One line saying what the benchmark is about to load."""
    return (
        f"SyntheticImages: {config.samples} samples of 3x64x64, batch {config.batch_size}, "
        f"{config.num_workers} workers ({config.worker_type} for pipeload), "
        f"{config.epochs} epoch(s) per loader, order alternating"
    )


def run_bench(
    config: BenchConfig, loaders: Mapping[str, LoaderFactory], *, progress: bool = True
) -> list[EpochTiming]:
    """Time every loader in ``loaders`` over the synthetic dataset for ``config.epochs`` epochs.

    The order alternates every epoch (A B, B A, A B, ...) so that warm-up costs and drifting
    machine load fall on both loaders alike.

    Args:
        config: dataset size, batch size, workers, epochs.
        loaders: name -> factory; each factory is called once, and its loader reused each epoch.
        progress: draw a tqdm bar per epoch (when tqdm is installed and stderr is a terminal).

    Returns:
        One timing per loader per epoch, in the order they ran.
    """
    torch.manual_seed(SEED)
    dataset = SyntheticImages(config.samples)
    built = {name: factory(dataset, config) for name, factory in loaders.items()}
    timings = []
    for epoch in range(config.epochs):
        order = list(built) if epoch % 2 == 0 else list(reversed(built))
        for name in order:
            label = f"{name:<8} epoch {epoch + 1}/{config.epochs}"
            with _progress_bar(label, _length_or_none(built[name]), progress) as bar:
                timings.append(_time_one_epoch(name, epoch, built[name], bar))
    return timings


class _ProgressBar(Protocol):
    def update(self, n: int = 1) -> Any: ...


def _time_one_epoch(name: str, epoch: int, loader: Iterable[Any], bar: _ProgressBar) -> EpochTiming:
    samples = 0
    started = time.perf_counter()
    for images, _labels in loader:
        samples += len(images)
        bar.update()
    return EpochTiming(name, epoch, samples, time.perf_counter() - started)


@contextlib.contextmanager
def _progress_bar(label: str, total: int | None, enabled: bool) -> Iterator[_ProgressBar]:
    try:
        from tqdm import tqdm  # an optional dependency: the `bench` extra
    except ImportError:
        tqdm = None
    if tqdm is None or not enabled:
        yield _NoProgressBar()
        return
    # disable=None: draw only when stderr is a terminal, so logs and pipes stay clean.
    with tqdm(total=total, desc=label, unit="batch", disable=None, file=sys.stderr) as bar:
        yield bar


class _NoProgressBar:
    def update(self, n: int = 1) -> None:
        pass


def _length_or_none(loader: Iterable[Any]) -> int | None:
    try:
        return len(loader)  # type: ignore[arg-type]
    except TypeError:
        return None


def summarise(timings: Iterable[EpochTiming], loader_names: Sequence[str]) -> list[LoaderSummary]:
    """Add up each loader's epochs, keeping ``loader_names``' order."""
    timings = list(timings)
    return [
        LoaderSummary(
            name,
            sum(t.samples for t in timings if t.loader_name == name),
            sum(t.seconds for t in timings if t.loader_name == name),
        )
        for name in loader_names
    ]


def format_table(summaries: Sequence[LoaderSummary]) -> str:
    """A plain-text table of samples/s per loader, then the ratio of the first to the second."""
    lines = [f"{'loader':<16}{'samples':>10}{'seconds':>10}{'samples/s':>12}"]
    for row in summaries:
        lines.append(
            f"{row.loader_name:<16}{row.samples:>10}{row.seconds:>10.2f}{row.samples_per_s:>12,.0f}"
        )
    if len(summaries) == 2:
        mine, theirs = summaries
        ratio = mine.samples_per_s / theirs.samples_per_s
        label = f"{mine.loader_name}/{theirs.loader_name}"
        lines.append(f"{label:<16}{'':>10}{'':>10}{ratio:>11.2f}x")
    return "\n".join(lines)


def _positive_int(text: str) -> int:
    value = _int(text)
    if value < 1:
        raise argparse.ArgumentTypeError(f"expected an integer >= 1, got {text!r}")
    return value


def _non_negative_int(text: str) -> int:
    value = _int(text)
    if value < 0:
        raise argparse.ArgumentTypeError(f"expected an integer >= 0, got {text!r}")
    return value


def _int(text: str) -> int:
    try:
        return int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected an integer, got {text!r}") from None
