"""Two source trees of pipeload against each other on ``pipeload bench``'s JPEGs, alternating.

    python -m bench.trees --tree before=/path/to/old/src --tree after=src [--rounds 6]
                          [--repeats 3] [--loader economic] [--size 2048] [--workers 2]

On a shared machine the same command moves by 10-15% from one minute to the next, more than the
changes one wants to see. So each tree's figure here is a ratio taken inside one process, where
the drift weighs on both sides alike: ``--loader``'s samples/s (and tree CPU per sample) against
classic mode's, both measured by ``bench.item_costs`` in the same run (a warm-up, then ``--repeats``
interleaved passes of torch's loader, classic and economic; the medians). One pass a run is not
enough: single passes of one loader spread by 30% here. The trees take turns, round after round,
each run a fresh interpreter with ``PYTHONPATH=<tree>:.`` (this checkout's benchmarks, the tree's
pipeload). It prints every round and, per tree, the median ratio and its spread; the change is
the median of the paired differences, round by round.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]


def _tree(text: str) -> tuple[str, Path]:
    name, sep, path = text.partition("=")
    if not sep or not name or not path:
        raise argparse.ArgumentTypeError(f"--tree must be NAME=PATH (a pipeload src directory), got {text!r}")
    src = Path(path).resolve()
    if not (src / "pipeload" / "__init__.py").is_file():
        raise argparse.ArgumentTypeError(f"--tree {name}: {src} holds no pipeload package")
    return name, src


def one_run(src: Path, size: int, workers: int, repeats: int) -> dict[str, dict[str, float]]:
    """``bench.item_costs`` once (``repeats`` passes of each loader) with ``src``'s pipeload."""
    env = {**os.environ, "PYTHONPATH": f"{src}{os.pathsep}{REPO}"}
    command = [sys.executable, "-m", "bench.item_costs", "--repeats", str(repeats), "--json",
               "--size", str(size), "--workers", str(workers)]
    done = subprocess.run(command, cwd=REPO, env=env, capture_output=True, text=True, check=False)
    if done.returncode != 0:
        raise RuntimeError(f"bench.item_costs failed with {src}:\n{done.stderr[-2000:]}")
    return json.loads(done.stdout.strip().splitlines()[-1])


def ratios(result: dict[str, dict[str, float]], loader: str) -> tuple[float, float]:
    """(samples/s, tree CPU per sample) of ``loader`` against classic mode's, in one run."""
    mine, classic = result[loader], result["classic"]
    return (mine["samples_per_s"] / classic["samples_per_s"], mine["tree_cpu_us"] / classic["tree_cpu_us"])


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--tree", type=_tree, action="append", required=True,
                        help="NAME=PATH of a pipeload src directory; give two (or more)")
    parser.add_argument("--rounds", type=int, default=6, help="default: %(default)s")
    parser.add_argument("--repeats", type=int, default=3,
                        help="passes of each loader in one run (default: %(default)s)")
    parser.add_argument("--loader", default="economic", choices=("economic", "torch"),
                        help="the loader compared with classic mode (default: %(default)s)")
    parser.add_argument("--size", type=int, default=2048, help="images (default: %(default)s)")
    parser.add_argument("--workers", type=int, default=2, help="default: %(default)s")
    args = parser.parse_args(argv)
    if len(args.tree) < 2 or len({name for name, _ in args.tree}) != len(args.tree):
        parser.error("give at least two --tree NAME=PATH, each NAME once")
    if args.rounds < 1 or args.repeats < 1:
        parser.error(f"--rounds and --repeats must be at least 1, got {args.rounds} and {args.repeats}")
    seen: dict[str, list[tuple[float, float]]] = {name: [] for name, _ in args.tree}
    for round_number in range(args.rounds):
        shift = round_number % len(args.tree)
        for name, src in args.tree[shift:] + args.tree[:shift]:
            speed, cpu = ratios(one_run(src, args.size, args.workers, args.repeats), args.loader)
            seen[name].append((speed, cpu))
            print(f"round {round_number + 1}: {name:<10} {args.loader}/classic {speed:.3f}x samples/s, "
                  f"{cpu:.3f}x tree CPU a sample  (load {os.getloadavg()[0]:.1f})", flush=True)
    print(f"\n{args.loader} against classic mode, {args.rounds} rounds of {args.repeats} passes, "
          f"{args.size} JPEGs, {args.workers} workers")
    for name, values in seen.items():
        speeds = [speed for speed, _ in values]
        print(f"  {name:<10} samples/s {statistics.median(speeds):.3f}x ({min(speeds):.3f}..{max(speeds):.3f}), "
              f"tree CPU a sample {statistics.median(cpu for _, cpu in values):.3f}x")
    first = args.tree[0][0]
    for name, values in list(seen.items())[1:]:
        changes = [after[0] - before[0] for before, after in zip(seen[first], values)]
        print(f"  {name} - {first}, round by round: median {statistics.median(changes):+.3f} "
              f"({min(changes):+.3f}..{max(changes):+.3f})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
