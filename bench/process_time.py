"""Each process's exact run time, classic against economic mode, on ``pipeload bench``'s JPEGs.

    python -m bench.process_time [--rounds 3] [--epochs 3] [--workers 2,4,8,14]

psutil's ``cpu_times()`` and ``os.times()`` count in 10 ms ticks: an idle worker can be charged
tens of milliseconds an epoch. This reads each worker's run time from ``/proc/PID/schedstat``
(nanoseconds, every thread) and the main process's from its own CPU clock, on a loader made with
``persistent_workers=True`` so that its workers can be read while they live:

  * ``first``: each process over the loader's first epoch, start-up included (exit not);
  * ``later``: each over the epochs after it, per sample; the main process too.

Then, for economic mode, the main process's CPU a sample at each ``--workers`` count (persistent,
after a first epoch): what every batch waits for, and how it grows as pieces shrink.
Linux only (schedstat).
"""

from __future__ import annotations

import argparse
import os
import time
import warnings
from typing import Any

import psutil

import pipeload
from pipeload.cli.images import TarImages, dataset_dir, ensure_images

BATCH_SIZE = 64
MODES = ("classic", "economic")


def run_time_ms(pid: int) -> float:
    """The process's run time so far, all its threads, in ms (0 once it is gone)."""
    total = 0
    try:
        for task in os.listdir(f"/proc/{pid}/task"):
            with open(f"/proc/{pid}/task/{task}/schedstat") as stat:
                total += int(stat.read().split()[0])
    except OSError:
        return 0.0
    return total / 1e6


def make_loader(images: TarImages, mode: str, workers: int) -> Any:
    with warnings.catch_warnings():  # economic mode's batch workers exceed the CPUs: said, known
        warnings.simplefilter("ignore")
        return pipeload.DataLoader(images, batch_size=BATCH_SIZE, shuffle=True, num_workers=workers,
                                   mode=mode, persistent_workers=True)


def one_loader(images: TarImages, mode: str, workers: int, epochs: int) -> dict[str, Any]:
    """Run times of one persistent loader: its workers' over the first epoch, then every
    process's per sample over the later ones."""
    loader = make_loader(images, mode, workers)
    for _ in loader:
        pass
    pids = [child.pid for child in psutil.Process().children()]
    first = [run_time_ms(pid) for pid in pids]
    main_before, samples = time.process_time(), 0
    before = [run_time_ms(pid) for pid in pids]
    for _ in range(epochs - 1):
        for inputs, _labels in loader:
            samples += len(inputs)
    main_us = (time.process_time() - main_before) / samples * 1e6
    later = [(run_time_ms(pid) - start) / samples * 1e3 for pid, start in zip(pids, before)]
    del loader
    return {"first_ms": first, "later_us": later, "main_us": main_us}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--epochs", type=int, default=3, help="epochs per loader (the first apart)")
    parser.add_argument("--size", type=int, default=2048, help="images in the dataset")
    parser.add_argument("--workers", default="2,4,8,14", help="item worker counts for the main-process scan")
    args = parser.parse_args(argv)
    if args.epochs < 2:
        parser.error("--epochs must be at least 2 (the first is read apart)")
    counts = [int(count) for count in args.workers.split(",")]
    ensure_images(args.size)
    images = TarImages(dataset_dir(args.size))
    print(f"{len(images)} JPEGs, batch {BATCH_SIZE}, 2 workers, persistent; run times from "
          "/proc/PID/schedstat (workers: item workers, then batch workers) and the main process's CPU clock")
    for round_number in range(args.rounds):
        for mode in MODES:
            found = one_loader(images, mode, 2, args.epochs)
            first = " + ".join(f"{ms:,.0f}" for ms in found["first_ms"])
            later = " + ".join(f"{us:,.1f}" for us in found["later_us"])
            print(f"round {round_number + 1} {mode:<9} first epoch, workers ms: {first}; later epochs, "
                  f"us a sample: workers {later}, main {found['main_us']:.1f}")
    print("economic mode, main process's CPU a sample (later epochs), by item workers:")
    for count in counts:
        main_us = one_loader(images, "economic", count, args.epochs)["main_us"]
        classic_us = one_loader(images, "classic", count, args.epochs)["main_us"]
        print(f"  {count:>2} workers: economic {main_us:5.1f} us, classic {classic_us:5.1f} us")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
