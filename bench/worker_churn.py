"""What a new set of workers costs an epoch: where a loader without persistent workers loses time.

    PYTHONPATH=src:. python -m bench.worker_churn [--epochs 6] [--num-workers 2] [--step-ms 0]
                                                  [--items 4096] [--with-late-stop]
                                                  [--huge-heap auto|on|off]

First the floor no loader can go under: ``fork`` + ``_exit`` + ``waitpid`` of this very process
(torch imported), best and median of 20. Then one pipeload loader with ``persistent_workers=False``
and one with ``True`` (``bench.epoch_costs``'s float32 3x224x224 items, batch 64, ``--items`` an
epoch, 4096 by default),
epoch by epoch and turn by turn (the order flips each epoch), the loop reading one value per 4 KiB page (plus ``--step-ms`` of busy work per
batch, as a training step), each epoch split into: ``iter()`` (the forks), the first batch after
it, the first and second halves of the batches, and the time from the last batch to
``StopIteration`` (waiting for the workers to exit). Epochs 2+ are what a training script sees.

``--with-late-stop`` adds a third per-epoch loader whose workers are asked to stop only at
``StopIteration``, as before workers with nothing left to do were let go at once
(``PoolConfig.stop_when_done`` turned off for it alone): its "stop" column against the
per-epoch loader's is what letting them go early saves (with ``--step-ms``, where the loop is
the slower side; with the workers the slower side, nothing).

``--huge-heap`` sets ``PIPELOAD_HUGE_HEAP`` (``engine/huge_heap.py``): ``on`` gathers the main
process's memory into huge pages after the first set of workers stops, ``off`` never does, and
``auto`` (the default) does so where a CPU is spare beside the workers. The fork floor is measured
again after the last epoch, so the two lines show what the gathering did to it.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import os
import statistics
import time
from collections.abc import Iterator
from dataclasses import dataclass

import pipeload
from bench.epoch_costs import FloatItems
from pipeload.engine import huge_heap
from pipeload.loader import _engine_choice


@dataclass(frozen=True)
class EpochSplit:
    iter_ms: float
    first_ms: float
    first_half_ms: float
    second_half_ms: float
    stop_ms: float

    @property
    def total_ms(self) -> float:
        return self.iter_ms + self.first_ms + self.first_half_ms + self.second_half_ms + self.stop_ms


def fork_exit_wait_ms(times: int = 20) -> list[float]:
    """How long this process takes to fork a child that exits at once, and to reap it."""
    spent = []
    for _ in range(times):
        started = time.perf_counter()
        pid = os.fork()
        if pid == 0:
            os._exit(0)
        os.waitpid(pid, 0)
        spent.append((time.perf_counter() - started) * 1e3)
    return spent


def busy_for(seconds: float) -> None:
    end = time.perf_counter() + seconds
    while time.perf_counter() < end:
        pass


@contextlib.contextmanager
def workers_stopped_late() -> Iterator[None]:
    """Engines built meanwhile ask their workers to stop only when the epoch ends."""
    usual = _engine_choice._pool_config

    def late(*args: object, **kwargs: object) -> object:
        return dataclasses.replace(usual(*args, **kwargs), stop_when_done=False)

    _engine_choice._pool_config = late
    try:
        yield
    finally:
        _engine_choice._pool_config = usual


def one_epoch(loader: pipeload.DataLoader, step_s: float) -> EpochSplit:
    started = time.perf_counter()
    iterator = iter(loader)
    made = time.perf_counter()
    stamps = []
    for batch in iterator:
        stamps.append(time.perf_counter())
        float(batch.reshape(-1)[::1024].sum())
        busy_for(step_s)
    ended = time.perf_counter()
    del batch, iterator
    half = len(stamps) // 2
    return EpochSplit((made - started) * 1e3, (stamps[0] - made) * 1e3,
                      (stamps[half] - stamps[0]) * 1e3, (stamps[-1] - stamps[half]) * 1e3,
                      (ended - stamps[-1]) * 1e3)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--epochs", type=int, default=6)
    parser.add_argument("--num-workers", type=int, default=2)
    parser.add_argument("--step-ms", type=float, default=0.0, help="busy work per batch")
    parser.add_argument("--items", type=int, default=4096,
                        help="items an epoch: a new set of workers costs the same whatever it is")
    parser.add_argument("--with-late-stop", action="store_true",
                        help="add a per-epoch loader whose workers stop only at StopIteration")
    parser.add_argument("--huge-heap", choices=("auto", "on", "off"), default="auto",
                        help="PIPELOAD_HUGE_HEAP for this run")
    args = parser.parse_args()
    os.environ[huge_heap.HUGE_HEAP_ENV] = args.huge_heap
    if args.epochs < 2:
        parser.error("--epochs must be at least 2: the first epoch is not what later ones cost")
    forks = fork_exit_wait_ms()
    print(f"fork + _exit + waitpid of this process: best {min(forks):.1f} ms, "
          f"median {statistics.median(forks):.1f} ms ({os.cpu_count()} CPUs, load average "
          f"{os.getloadavg()[0]:.1f})")
    if args.items < 64:
        parser.error("--items must be at least one batch (64)")
    dataset = FloatItems(args.items, (3, 224, 224))
    print(f"{'loader':<15}{'epoch':>6}{'iter()':>9}{'first':>9}{'1st half':>10}{'2nd half':>10}"
          f"{'stop':>8}{'total':>9}  (ms)")
    names = ("per-epoch", "persistent") + (("late-stop",) if args.with_late_stop else ())
    loaders = {name: pipeload.DataLoader(dataset, batch_size=64, num_workers=args.num_workers,
                                         persistent_workers=name == "persistent")
               for name in names}
    splits: dict[str, list[EpochSplit]] = {name: [] for name in loaders}
    for number in range(1, args.epochs + 1):
        order = list(loaders) if number % 2 else list(reversed(loaders))  # turn by turn
        for name in order:
            with workers_stopped_late() if name == "late-stop" else contextlib.nullcontext():
                split = one_epoch(loaders[name], args.step_ms / 1e3)
            splits[name].append(split)
            print(f"{name:<15}{number:>6}{split.iter_ms:>9.1f}{split.first_ms:>9.1f}"
                  f"{split.first_half_ms:>10.1f}{split.second_half_ms:>10.1f}{split.stop_ms:>8.1f}"
                  f"{split.total_ms:>9.1f}")
    medians = {name: {field: statistics.median(getattr(s, field) for s in runs[1:])
                      for field in ("iter_ms", "first_ms", "first_half_ms", "second_half_ms",
                                    "stop_ms", "total_ms")}
               for name, runs in splits.items()}
    ours, kept = medians["per-epoch"], medians["persistent"]
    print("epochs 2+, medians, per-epoch minus persistent: " + ", ".join(
        f"{field[:-3].replace('_', ' ')} {ours[field] - kept[field]:+.1f} ms" for field in ours))
    print(f"per-epoch / persistent samples/s: {kept['total_ms'] / ours['total_ms']:.2f}x")
    # Each new worker costs at least what this process's bare fork, exit and reap cost (copying
    # and then tearing down the page tables of torch's import), whatever the loader does.
    floor_ms = args.num_workers * statistics.median(forks)
    print(f"ceiling from the forks alone ({args.num_workers} x {statistics.median(forks):.1f} ms "
          f"an epoch): {kept['total_ms'] / (kept['total_ms'] + floor_ms):.2f}x")
    huge_heap.GATHERER.wait()
    rounds = huge_heap.GATHERER.rounds
    after = fork_exit_wait_ms()
    print(f"fork + _exit + waitpid after the epochs: best {min(after):.1f} ms, median "
          f"{statistics.median(after):.1f} ms (--huge-heap {args.huge_heap}: " + (
              f"its first round gathered {rounds[0].gathered_bytes >> 20} MiB into huge pages in "
              f"{rounds[0].seconds * 1e3:.0f} ms; {len(rounds)} rounds)" if rounds else "nothing gathered)"))
    if "late-stop" in medians:
        late = medians["late-stop"]
        print(f"last batch to StopIteration, epochs 2+, medians: workers let go when done "
              f"{ours['stop_ms']:.1f} ms, asked only at the end {late['stop_ms']:.1f} ms")


if __name__ == "__main__":
    main()
