"""``pipeload`` on the command line (also ``python -m pipeload``).

    pipeload bench [--size N] [--workers N] [--repeats N] [--batch-size B] [--loaders a,b,...] [--chart PATH]
    pipeload profile MODULE:FACTORY [--batches N] [--max-seconds S] [--batch-size B]
                     [--num-workers N] [--mode M] [--worker-type T] [--step-ms T]

``bench`` (bench.py) compares torch's DataLoader with pipeload's modes on a JPEG dataset it
makes on first run; ``profile`` (profile.py) loads your own data until it can judge and prints the
stats summary with suggested settings. A mistake in the arguments, a factory that cannot be
imported or raises, a missing optional package: one line on stderr and a non-zero exit.
"""

from __future__ import annotations

import argparse
import os
import signal
import sys
import warnings
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any, NoReturn

from pipeload.cli.bench import LOADERS, BenchOptions
from pipeload.cli.profile import CommandError, ProfileOptions

OPTIONAL_PACKAGES = {"PIL": "Pillow", "psutil": "psutil", "tqdm": "tqdm", "matplotlib": "matplotlib"}


class _Parser(argparse.ArgumentParser):
    """argparse, but a usage mistake is one line (the usage text is a --help away)."""

    command_names: tuple[str, ...] = ()

    def error(self, message: str) -> NoReturn:
        if self.command_names and message.endswith("required: COMMAND"):
            # A bare ``pipeload``: the one line names the commands, as a wrong one's does.
            message += f" (choose from {', '.join(map(repr, self.command_names))}; pipeload --help says more)"
        self.exit(2, f"{self.prog}: error: {message}\n")


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point of the ``pipeload`` command; returns the exit status.

    Example:
        >>> main(["bench", "--size", "256", "--repeats", "1"])  # doctest: +SKIP
    """
    args = build_parser().parse_args(argv)
    try:
        with warnings.catch_warnings():
            warnings.showwarning = _one_line_warning(args.command, _callers(sys._getframe(1)))
            return args.handler(args)
    except CommandError as error:
        print(f"pipeload {args.command}: {_usage_prefix(error.status)}{error}", file=sys.stderr)
        return error.status
    except LookupError as error:  # a loader that cannot run here (no checkout, no workers)
        print(f"pipeload {args.command}: {_usage_prefix(2)}{error.args[0]}", file=sys.stderr)
        return 2
    except ModuleNotFoundError as error:
        package = OPTIONAL_PACKAGES.get((error.name or "").split(".")[0])
        if package is None:
            raise
        print(f"pipeload {args.command}: needs {package}: pip install 'pipeload[bench]'", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        print(f"pipeload {args.command}: interrupted", file=sys.stderr)
        return 130
    except BrokenPipeError:  # the reader left early (`| head`): not worth a traceback
        _silence_stdout()
        return 128 + signal.SIGPIPE


def _usage_prefix(status: int) -> str:
    """argparse's word before a usage mistake (exit status 2), so that every mistake in what was
    asked reads alike, whichever check caught it; failures while running (status 1) have none."""
    return "error: " if status == 2 else ""


def _callers(frame: Any) -> set[tuple[str, int]]:
    """(file, line) of ``frame`` and every frame above it: where the command was called from."""
    places = set()
    while frame is not None:
        places.add((frame.f_code.co_filename, frame.f_lineno))
        frame = frame.f_back
    return places


def _one_line_warning(command: str, callers: set[tuple[str, int]]) -> Callable[..., None]:
    """Warnings as one line on stderr each. pipeload's warnings point at the first line outside
    pipeload; about what the command itself set up (the DataLoader it builds from the options),
    that is where the command was called from (``callers``), no line of the user's: said without
    a place. One raised in the user's code keeps its file and line."""

    def show(message: Warning | str, category: type[Warning], filename: str, lineno: int,
             file: Any = None, line: str | None = None) -> None:
        where = "" if (filename, lineno) in callers else f" ({filename}:{lineno})"
        print(f"pipeload {command}: {category.__name__}: {message}{where}", file=sys.stderr)

    return show


def _silence_stdout() -> None:
    # Python flushes stdout once more at exit, which would fail on the closed pipe again and print
    # "Exception ignored"; pointing the descriptor at /dev/null lets that flush succeed.
    devnull = os.open(os.devnull, os.O_WRONLY)
    os.dup2(devnull, sys.stdout.fileno())
    os.close(devnull)


def build_parser() -> argparse.ArgumentParser:
    parser = _Parser(prog="pipeload", description="pipeload: torch.utils.data's interface, its own engine.")
    parser.add_argument("--version", action="version", version=_version())
    commands = parser.add_subparsers(dest="command", required=True, metavar="COMMAND",
                                     parser_class=_Parser)
    _add_bench(commands)
    _add_profile(commands)
    parser.command_names = tuple(commands.choices)
    return parser


def _version() -> str:
    import torch

    import pipeload

    return f"pipeload {pipeload.__version__} (torch {torch.__version__})"


def _add_bench(commands: argparse._SubParsersAction) -> None:
    defaults = BenchOptions()
    bench = commands.add_parser("bench", help="torch's DataLoader and pipeload's modes, side by side",
                                description="Load synthetic JPEGs in tar shards (made on first run, "
                                "under $PIPELOAD_CACHE or ~/.cache/pipeload) with each loader, "
                                "interleaving repeats; print a table and write a PNG chart.")
    bench.add_argument("--size", type=_at_least(1), default=defaults.size,
                       help="images in the dataset (default: %(default)s)")
    bench.add_argument("--workers", type=_at_least(0), default=defaults.workers,
                       help="num_workers of every loader (default: %(default)s)")
    bench.add_argument("--repeats", type=_at_least(1), default=defaults.repeats,
                       help="runs per loader, interleaved (default: %(default)s)")
    bench.add_argument("--batch-size", type=_at_least(1), default=defaults.batch_size,
                       help="images per batch (default: %(default)s)")
    bench.add_argument("--loaders", type=_loader_names, default=defaults.loaders,
                       help=f"comma-separated, from {', '.join(LOADERS)} (default: all)")
    bench.add_argument("--chart", type=Path, default=None,
                       help="where to write the PNG chart (default: a timestamped file under the "
                       "cache directory's bench/)")
    bench.set_defaults(handler=_bench)


def _add_profile(commands: argparse._SubParsersAction) -> None:
    defaults = ProfileOptions(target="")
    profile = commands.add_parser("profile", help="load your data until it can judge; say what limits it",
                                  description="Import MODULE, call FACTORY() for a dataset or a "
                                  "DataLoader, load batches (epoch after epoch) until the stats can "
                                  "judge, print the stats summary and "
                                  "suggested settings.")
    profile.add_argument("target", metavar="MODULE:FACTORY",
                         help="e.g. mypackage.data:make_dataset; the current directory is importable")
    profile.add_argument("--batches", type=_at_least(1), default=defaults.batches,
                         help="batches to load (default: until there is enough to judge)")
    profile.add_argument("--max-seconds", type=_seconds, default=defaults.max_seconds,
                         help="stop loading after this long, judged or not (default: %(default)s)")
    # Given or not is told apart (default None): a DataLoader the factory returns keeps its own
    # settings, and a flag given for nothing is said so.
    profile.add_argument("--batch-size", type=_at_least(1), default=None,
                         help=f"for a dataset (default: {defaults.batch_size})")
    profile.add_argument("--num-workers", type=_workers, default=None,
                         help=f"for a dataset: a number or 'auto' (default: {defaults.num_workers})")
    profile.add_argument("--mode", choices=("classic", "economic"), default=None,
                         help=f"for a dataset (default: {defaults.mode})")
    profile.add_argument("--worker-type", choices=("process", "thread"), default=None,
                         help=f"for a dataset (default: {defaults.worker_type})")
    profile.add_argument("--step-ms", type=_milliseconds, default=defaults.step_ms,
                         help="pretend training time per batch, in ms (default: %(default)s)")
    profile.set_defaults(handler=_profile)


def _bench(args: argparse.Namespace) -> int:
    from pipeload.cli import bench

    return bench.run(BenchOptions(args.size, args.workers, args.repeats, args.batch_size,
                                  tuple(args.loaders), args.chart))


def _profile(args: argparse.Namespace) -> int:
    from pipeload.cli import profile

    for_a_dataset = {"batch_size": args.batch_size, "num_workers": args.num_workers, "mode": args.mode,
                     "worker_type": args.worker_type}
    given = {name: value for name, value in for_a_dataset.items() if value is not None}
    return profile.run(ProfileOptions(args.target, args.batches, step_ms=args.step_ms,
                                      max_seconds=args.max_seconds, given=tuple(given), **given))


def _loader_names(text: str) -> tuple[str, ...]:
    # An empty or repeated name is a typo, not a request: refused rather than quietly dropped
    # (an empty one) or run twice into two identical rows (a repeated one).
    names = tuple(name.strip() for name in text.split(","))
    choices = ", ".join(LOADERS)
    if not all(names):
        raise argparse.ArgumentTypeError(f"empty loader name in {text!r}; give names separated by "
                                         f"single commas, from {choices}")
    unknown = [name for name in names if name not in LOADERS]
    if unknown:
        raise argparse.ArgumentTypeError(f"unknown loader {unknown[0]!r}; choose from {choices}")
    repeated = [name for index, name in enumerate(names) if name in names[:index]]
    if repeated:
        raise argparse.ArgumentTypeError(f"loader {repeated[0]!r} named twice in {text!r}")
    return names


def _workers(text: str) -> int | str:
    if text == "auto":
        return "auto"
    try:
        return _at_least(0)(text)
    except argparse.ArgumentTypeError:
        raise argparse.ArgumentTypeError(f"expected an integer >= 0 or 'auto', got {text!r}") from None


def _milliseconds(text: str) -> float:
    return _number_of("milliseconds", text, allow_zero=True)


def _seconds(text: str) -> float:
    return _number_of("seconds", text, allow_zero=False)


def _number_of(unit: str, text: str, allow_zero: bool) -> float:
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a number of {unit}, got {text!r}") from None
    # The comparisons also refuse nan, which compares false both ways.
    if not (0 <= value if allow_zero else 0 < value) or not value < float("inf"):
        raise argparse.ArgumentTypeError(f"expected a number of {unit} {'>=' if allow_zero else '>'} 0, got {text!r}")
    return value


def _at_least(minimum: int):  # noqa: ANN202  (an argparse type)
    def parse(text: str) -> int:
        try:
            value = int(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"expected an integer, got {text!r}") from None
        if value < minimum:
            raise argparse.ArgumentTypeError(f"expected an integer >= {minimum}, got {text!r}")
        return value
    parse.__name__ = f"integer >= {minimum}"
    return parse
