"""Each phase of a fresh loader's pass, classic against economic mode, on ``pipeload bench``'s JPEGs.

    python -m bench.pass_phases [--rounds 20] [--size 2048] [--workers 2]

``pipeload bench`` gives a pass's samples/s; this splits the pass a fresh loader makes (as the
bench makes one per pass, without persistent workers) into ``iter()``, the first batch, the
rest, and the last batch to ``StopIteration`` (the workers' exit), with the main thread's CPU
for the whole pass. The two modes run in turns, the order swapped every round, and the ratio of
their whole passes is taken inside each round: the median of those paired ratios moves less with
the machine's load than a ratio of two medians. The loop reads one value per 4 KiB of each
batch's images, as a training loop's copy would touch them.
"""

from __future__ import annotations

import argparse
import statistics
import time
import warnings
from typing import Any

import pipeload
from pipeload.cli.images import TarImages, dataset_dir, ensure_images

BATCH_SIZE = 64
MODES = ("classic", "economic")
PHASES = ("iter", "first", "rest", "tail", "pass", "cpu")


def one_pass(images: TarImages, mode: str, workers: int) -> dict[str, float]:
    """A fresh loader's pass, in seconds per phase (``cpu``: the main thread's CPU)."""
    with warnings.catch_warnings():  # economic mode's batch workers may exceed the CPUs: known
        warnings.simplefilter("ignore")
        loader = pipeload.DataLoader(images, batch_size=BATCH_SIZE, shuffle=True, num_workers=workers,
                                     mode=mode)
    cpu = time.thread_time()
    started = time.perf_counter()
    iterator = iter(loader)
    made = time.perf_counter()
    batch = next(iterator)
    first = last = time.perf_counter()
    for batch in iterator:
        batch[0].view(-1)[::1024].sum()
        last = time.perf_counter()
    ended = time.perf_counter()
    return {"iter": made - started, "first": first - made, "rest": last - first, "tail": ended - last,
            "pass": ended - started, "cpu": time.thread_time() - cpu}


def run(images: TarImages, rounds: int, workers: int) -> dict[str, list[dict[str, float]]]:
    passes: dict[str, list[dict[str, float]]] = {mode: [] for mode in MODES}
    for number in range(rounds):
        for mode in MODES if number % 2 == 0 else MODES[::-1]:
            passes[mode].append(one_pass(images, mode, workers))
    return passes


def report(passes: dict[str, list[dict[str, Any]]]) -> str:
    lines = [f"{'mode':9} " + " ".join(f"{phase:>9}" for phase in PHASES) + "   (medians, ms)"]
    for mode, rows in passes.items():
        medians = [statistics.median(row[phase] for row in rows) * 1e3 for phase in PHASES]
        lines.append(f"{mode:9} " + " ".join(f"{value:9.1f}" for value in medians))
    ratios = sorted(c["pass"] / e["pass"] for c, e in zip(passes["classic"], passes["economic"]))
    quarter = len(ratios) // 4
    lines.append(f"economic/classic samples/s, paired by round: median {statistics.median(ratios):.3f}x, "
                 f"quartiles {ratios[quarter]:.3f}x..{ratios[-1 - quarter]:.3f}x over {len(ratios)} rounds")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--rounds", type=int, default=20)
    parser.add_argument("--size", type=int, default=2048, help="images in the dataset")
    parser.add_argument("--workers", type=int, default=2)
    args = parser.parse_args(argv)
    if args.rounds < 1 or args.workers < 1:
        parser.error("--rounds and --workers must be 1 or more")
    ensure_images(args.size)
    images = TarImages(dataset_dir(args.size))
    print(f"{args.size} JPEGs, batch {BATCH_SIZE}, {args.workers} workers, a fresh loader a pass, "
          f"{args.rounds} rounds of both modes in turns")
    print(report(run(images, args.rounds, args.workers)))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
