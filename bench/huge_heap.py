"""What gathering the main process's memory into huge pages does for a loader without persistent
workers: the same script run with ``PIPELOAD_HUGE_HEAP=on`` and ``off``, in turns.

    PYTHONPATH=src:. python -m bench.huge_heap [--runs 3] [--epochs 10] [--num-workers 2]
                                               [--items 4096] [--held-mib 0]
    PYTHONPATH=src:. python -m bench.huge_heap --collapse [--runs 3]

Each run is a fresh process holding one loader (``bench.epoch_costs``'s float32 3x224x224 items,
batch 64, ``persistent_workers=False``), as a training script has: every epoch ends and the next
starts at once, so a gathering round runs while the next workers start (their fork waits for it
``FORK_WAITS_S`` at most, then the round goes on at the next stop: ``engine/huge_heap.py``). The loop reads
one value per 4 KiB page of each batch. ``--held-mib`` holds that much more in the main process
(a dataset kept in memory), which every fork copies the page table of.

Printed per run: each epoch's milliseconds, epochs 2+'s median, the fork + exit + reap of the
process after the last epoch, and what the rounds gathered. Then, over all runs, on / off of the
epochs 2+ medians (below 1: faster with it) and of the epoch 2 times (where a round's copy costs).

``--collapse`` measures the mechanism alone, in fresh processes with torch imported and no loader:
the process's private memory, a bare fork + exit + reap before, the time to gather every window
worth it (the module's own choice and gathering, in one go), and the fork + exit after.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time


def one_run(epochs: int, num_workers: int, items: int, held_mib: int) -> dict[str, object]:
    import torch

    import pipeload
    from bench.epoch_costs import FloatItems
    from bench.worker_churn import fork_exit_wait_ms
    from pipeload.engine import huge_heap

    held = torch.ones(held_mib << 18) if held_mib else None  # touched: resident
    loader = pipeload.DataLoader(FloatItems(items, (3, 224, 224)), batch_size=64, num_workers=num_workers)
    times = []
    for _ in range(epochs):
        started = time.perf_counter()
        for batch in loader:
            float(batch.reshape(-1)[::1024].sum())
        times.append((time.perf_counter() - started) * 1e3)
    huge_heap.GATHERER.wait()
    rounds = huge_heap.GATHERER.rounds
    del held
    return {"epochs_ms": times, "fork_ms": statistics.median(fork_exit_wait_ms(10)),
            "gathered_mib": sum(r.gathered_bytes for r in rounds) >> 20,
            "round_ms": sum(r.seconds for r in rounds) * 1e3, "rounds": len(rounds)}


def collapse_once() -> dict[str, float]:
    import torch  # noqa: F401  (what a training script's main process holds)

    from bench.worker_churn import fork_exit_wait_ms
    from pipeload.engine import huge_heap

    before = statistics.median(fork_exit_wait_ms(20))
    private = huge_heap.anonymous_bytes()
    found = huge_heap.windows_to_gather(set(), 1 << 30)
    if found is None:
        raise SystemExit("the page map cannot be read here")
    with open("/proc/self/pagemap", "rb", buffering=0) as pagemap:
        done = huge_heap.gather(found.chosen, pagemap.fileno())
    after = statistics.median(fork_exit_wait_ms(20))
    return {"private_mib": private / (1 << 20), "fork_before_ms": before, "gathered_mib":
            done.gathered_bytes / (1 << 20), "gather_ms": done.seconds * 1e3, "fork_after_ms": after}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--runs", type=int, default=3, help="runs of each setting, in turns")
    parser.add_argument("--epochs", type=int, default=10)
    parser.add_argument("--num-workers", type=int, default=2)
    parser.add_argument("--items", type=int, default=4096)
    parser.add_argument("--held-mib", type=int, default=0, help="more memory held by the main process")
    parser.add_argument("--collapse", action="store_true", help="the mechanism alone, no loader")
    parser.add_argument("--one-run", choices=("on", "off", "collapse"), help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.one_run == "collapse":
        print(json.dumps(collapse_once()))
        return
    if args.collapse:
        for _ in range(args.runs):
            command = [sys.executable, "-m", "bench.huge_heap", "--one-run", "collapse"]
            out = subprocess.run(command, check=True, capture_output=True, text=True).stdout
            run = json.loads(out.strip().splitlines()[-1])
            print(f"private memory {run['private_mib']:.0f} MiB; fork+exit {run['fork_before_ms']:.1f} ms; "
                  f"gathered {run['gathered_mib']:.0f} MiB in {run['gather_ms']:.0f} ms; "
                  f"fork+exit after {run['fork_after_ms']:.1f} ms")
        return
    if args.epochs < 3:
        parser.error("--epochs must be at least 3: epoch 1 has no round, epoch 2 pays for it")
    if args.one_run:
        print(json.dumps(one_run(args.epochs, args.num_workers, args.items, args.held_mib)))
        return
    print(f"{os.cpu_count()} CPUs, load average {os.getloadavg()[0]:.1f}; {args.num_workers} workers, "
          f"{args.items} items an epoch, {args.held_mib} MiB more held")
    results: dict[str, list[dict[str, object]]] = {"on": [], "off": []}
    for _ in range(args.runs):
        for setting in ("on", "off"):
            command = [sys.executable, "-m", "bench.huge_heap", "--one-run", setting, "--epochs",
                       str(args.epochs), "--num-workers", str(args.num_workers), "--items",
                       str(args.items), "--held-mib", str(args.held_mib)]
            env = dict(os.environ, PIPELOAD_HUGE_HEAP=setting)
            out = subprocess.run(command, env=env, check=True, capture_output=True, text=True).stdout
            run = json.loads(out.strip().splitlines()[-1])
            results[setting].append(run)
            epochs = [round(ms) for ms in run["epochs_ms"]]  # type: ignore[union-attr]
            print(f"{setting:>3}: epochs {epochs} ms; 2+ median {statistics.median(epochs[1:])}; "
                  f"fork+exit {run['fork_ms']:.1f} ms; {run['rounds']} rounds gathered "
                  f"{run['gathered_mib']} MiB in {run['round_ms']:.0f} ms")
    medians = {s: statistics.median(statistics.median(r["epochs_ms"][1:]) for r in runs)  # type: ignore[index]
               for s, runs in results.items()}
    seconds = {s: statistics.median(r["epochs_ms"][1] for r in runs)  # type: ignore[index]
               for s, runs in results.items()}
    print(f"epochs 2+ (median of run medians): on {medians['on']:.0f} ms, off {medians['off']:.0f} ms, "
          f"on/off {medians['on'] / medians['off']:.2f}x")
    print(f"epoch 2 alone: on {seconds['on']:.0f} ms, off {seconds['off']:.0f} ms, "
          f"on/off {seconds['on'] / seconds['off']:.2f}x")


if __name__ == "__main__":
    main()
