"""Where a worker's CPU goes, step by step, on ``pipeload bench``'s JPEG workload.

    python -m bench.worker_steps [--size 4096] [--passes 2] [--workers 2]

``bench.item_costs`` says how much CPU each kind of process takes a sample; this says what it is
spent on inside the workers, measured where it happens: each step of economic mode's item and
batch worker loops (and the dataset's ``__getitem__`` in classic workers) is timed with the
thread's CPU clock, in real worker processes (fork), on fresh loaders as the bench makes them.
Per item for item workers and classic workers (fetch, seeding, handing over, ...; "other" is the
rest of the process's CPU: start-up, the loop, waiting's wake-ups), per batch for batch workers.

The timers are wrappers this module puts around pipeload's own methods before any worker is
forked; they add about a microsecond a call, so the small steps read a little high. Run the same
command with ``PYTHONPATH=/path/to/an/older/src:.`` to read an older tree the same way (a step
that does not exist there is left out).
"""

from __future__ import annotations

import argparse
import collections
import json
import os
import tempfile
import time
from collections.abc import Callable
from typing import Any

from bench.item_costs import WARMUP_BATCHES, _wait_for_workers, make_loader
from pipeload.cli.bench import _dataset
from pipeload.cli.images import TarImages

# (module, class, method) -> step name; each kind of worker writes its own steps
ITEM_STEPS = {("pipeload.engine.economic_workers", "ItemWorkerLoop", "_fetched"): "fetch",
              ("pipeload.engine.item_seeds", "ItemSeeds", "apply"): "seeding",
              ("pipeload.engine.item_seeds", "ItemSeeds", "__init__"): "a piece's seeds",
              ("pipeload.engine.economic_workers", "ItemWorkerLoop", "_hand_over"): "hand over",
              ("pipeload.engine.economic_workers", "ItemWorkerLoop", "_place_for_main"): "place for main",
              ("pipeload.engine.economic_workers", "ItemWorkerLoop", "_report"): "report",
              ("pipeload.engine.economic_workers", "ItemWorkerLoop", "_next_command"): "next command"}
BATCH_STEPS = {("pipeload.transport.item_links", "BatchInbox", "receive"): "receive",
               ("pipeload.engine.economic_workers", "BatchWorkerLoop", "_collate"): "collate",
               ("pipeload.engine.economic_workers", "BatchWorkerLoop", "_send_batch"): "send batch"}
CLASSIC_STEPS = {("pipeload.cli.images", "TarImages", "__getitem__"): "fetch"}
DUMP_EVERY = 32  # counted units (items, batches) between two writes of a process's totals


class _Steps:
    """One process's step totals (thread CPU seconds, calls), written to ``directory``."""

    def __init__(self, directory: str) -> None:
        self.directory = directory
        self.seconds: collections.Counter[str] = collections.Counter()
        self.calls: collections.Counter[str] = collections.Counter()
        self.kind = ""
        self.pid = 0

    def timed(self, kind: str, step: str, method: Callable[..., Any], unit: str) -> Callable[..., Any]:
        def wrapper(*args: Any, **kwargs: Any) -> Any:
            if self.pid != os.getpid():  # a fresh worker (its first timed step names its kind)
                self.seconds.clear(), self.calls.clear()
                self.pid, self.kind = os.getpid(), kind
            if self.kind != kind:  # an item worker's dataset call, say: inside its own "fetch"
                return method(*args, **kwargs)
            started = time.thread_time()
            try:
                return method(*args, **kwargs)
            finally:
                self.seconds[step] += time.thread_time() - started
                self.calls[step] += 1
                if step == unit and self.calls[step] % DUMP_EVERY == 0:
                    self.dump(unit)
        return wrapper

    def dump(self, unit: str) -> None:
        record = {"kind": self.kind, "units": self.calls[unit], "cpu": time.process_time(),
                  "steps": dict(self.seconds)}
        with open(os.path.join(self.directory, f"{os.getpid()}.json"), "w") as out:
            json.dump(record, out)


def install(steps: _Steps) -> None:
    """Wrap every step that exists in this tree (before any worker is forked)."""
    import importlib

    for kind, table, unit in (("item worker", ITEM_STEPS, "fetch"), ("batch worker", BATCH_STEPS, "send batch"),
                              ("classic worker", CLASSIC_STEPS, "fetch")):
        for (module_name, class_name, method_name), step in table.items():
            owner = getattr(importlib.import_module(module_name), class_name, None)
            method = getattr(owner, method_name, None) if owner is not None else None
            if method is not None:
                setattr(owner, method_name, steps.timed(kind, step, method, unit))


def summary(directory: str) -> str:
    by_kind: dict[str, list[dict[str, Any]]] = collections.defaultdict(list)
    for name in os.listdir(directory):
        with open(os.path.join(directory, name)) as record:
            data = json.load(record)
        by_kind[data["kind"]].append(data)
    lines = []
    for kind, records in sorted(by_kind.items()):
        units = sum(r["units"] for r in records)
        steps: collections.Counter[str] = collections.Counter()
        for record in records:
            steps.update(record["steps"])
        cpu = sum(r["cpu"] for r in records)
        per, scale, sign = ("batch", 1e3, "ms") if kind == "batch worker" else ("item", 1e6, "us")
        # No timed step runs inside another: "other" is the process's CPU beyond them all.
        parts = [f"{k} {v / units * scale:.1f}" for k, v in steps.most_common()]
        parts.append(f"other {(cpu - sum(steps.values())) / units * scale:.1f}")
        plural = "batches" if per == "batch" else "items"
        lines.append(f"{kind + 's':<16} per {per} ({units} {plural}, {sign}): CPU {cpu / units * scale:.1f}: "
                     + ", ".join(parts))
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--size", type=int, default=4096, help="images in the dataset")
    parser.add_argument("--passes", type=int, default=2, help="fresh loaders of each mode")
    parser.add_argument("--workers", type=int, default=2)
    args = parser.parse_args(argv)
    images = TarImages(_dataset(args.size))
    with tempfile.TemporaryDirectory(prefix="pipeload-worker-steps-") as directory:
        steps = _Steps(directory)
        install(steps)
        for name in ("classic", "economic"):  # a short pass of each first: imports, caches
            for _, _batch in zip(range(WARMUP_BATCHES), make_loader(name, images, args.workers)):
                pass
            _wait_for_workers()
        for name in os.listdir(directory):
            os.remove(os.path.join(directory, name))
        for _ in range(args.passes):
            for name in ("classic", "economic"):
                for _batch in make_loader(name, images, args.workers):
                    pass
                _wait_for_workers()  # every worker has written its totals (it writes as it goes)
        print(f"{args.size} JPEGs, batch 64, {args.workers} workers, {args.passes} passes of each mode; "
              f"load average {os.getloadavg()[0]:.1f}")
        print(summary(directory))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
