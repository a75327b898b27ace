"""Where a tiny batch's fixed cost goes: CPU time per stage, per batch, in a real 2-worker run.

    python -m bench.batch_costs [--side main|worker|both] [--items 200000]

Loads the ``tiny`` workload (64 Python ints a batch) with 2 process workers and times the stages
of the main process (receive, decode, hand-out, task send) or of the workers (task read, fetch and
collate, encode, send) with ``time.thread_time_ns``: CPU time of the thread, so time spent waiting
for a CPU on a shared machine is left out. Stages are timed by wrapping the engine's own methods
(fork start method: the workers inherit the wrappers), so the figures carry the wrappers' own cost,
about a microsecond each; nested stages are indented and included in their parent.
"""

from __future__ import annotations

import argparse
import collections
import glob
import json
import os
import sys
import tempfile
import time
from collections.abc import Callable, Sequence
from typing import Any

from bench.workloads import PythonInts

BATCH_SIZE = 64
_totals: collections.Counter = collections.Counter()
_calls: collections.Counter = collections.Counter()
_ORDER: list[str] = []  # how the stages print: each parent above what it includes


def _wrap(owner: Any, name: str, label: str) -> None:
    original: Callable[..., Any] = getattr(owner, name)

    def timed(*args: Any, **kwargs: Any) -> Any:
        started = time.thread_time_ns()
        try:
            return original(*args, **kwargs)
        finally:
            _totals[label] += time.thread_time_ns() - started
            _calls[label] += 1

    setattr(owner, name, timed)


def _wrap_main() -> None:
    from pipeload.engine import pool, workers
    from pipeload.transport import channel, endpoints

    _wrap(pool.PoolEngine, "next_batch", "next_batch (all)")
    _wrap(workers.WorkerGroup, "receive", "  receive (poll, read, decode, stats)")
    _wrap(channel._Poller, "poll", "    poll")
    _wrap(endpoints, "decode", "    decode")
    _wrap(pool.PoolEngine, "_hand_over", "  hand over (stats, budget, top up)")
    _wrap(pool.PoolEngine, "_take_task", "    next task (sampler, grant)")
    _wrap(workers.WorkerGroup, "send", "    task send (pickle, write)")
    _ORDER[:] = ["next_batch (all)", "  receive (poll, read, decode, stats)", "    poll",
                 "    decode", "  hand over (stats, budget, top up)",
                 "    next task (sampler, grant)", "    task send (pickle, write)"]


def _wrap_workers(out_dir: str) -> None:
    from pipeload.engine import fetch, worker_main
    from pipeload.transport import channel, endpoints

    _wrap(worker_main.WorkerLoop, "_next_command", "next command (read, unpickle)")
    _wrap(channel.PipeEnd, "_read", "  read (poll, read)")
    _wrap(worker_main.WorkerLoop, "_serve", "serve (all)")
    _wrap(fetch.MapFetcher, "fetch", "  fetch and collate")
    _wrap(endpoints.Sender, "send", "  send (encode, sendmsg)")
    _wrap(endpoints, "encode", "    encode")
    _wrap(endpoints, "send_message", "    sendmsg")
    _ORDER[:] = ["next command (read, unpickle)", "  read (poll, read)", "serve (all)",
                 "  fetch and collate", "  send (encode, sendmsg)", "    encode", "    sendmsg"]
    exit_now = worker_main.exit_now

    def leave() -> None:
        with open(os.path.join(out_dir, f"{os.getpid()}.json"), "w") as out:
            json.dump([_totals, _calls], out)
        exit_now()

    worker_main.exit_now = leave


def run(side: str, items: int) -> None:
    """Time one side over one epoch and print its stages per batch."""
    import pipeload

    _totals.clear()
    _calls.clear()
    with tempfile.TemporaryDirectory(prefix="pipeload-costs-") as out_dir:
        (_wrap_main if side == "main" else lambda: _wrap_workers(out_dir))()
        loader = pipeload.DataLoader(PythonInts(items), batch_size=BATCH_SIZE, num_workers=2,
                                     multiprocessing_context="fork")
        started = time.perf_counter()
        for _ in loader:
            pass
        rate = items / (time.perf_counter() - started)
        del loader
        deadline = time.monotonic() + 5.0
        while side == "worker" and len(glob.glob(os.path.join(out_dir, "*.json"))) < 2:
            if time.monotonic() > deadline:
                break
            time.sleep(0.05)
        for path in glob.glob(os.path.join(out_dir, "*.json")):
            totals, calls = json.load(open(path))
            _totals.update(totals)
            _calls.update(calls)
    batches = items / BATCH_SIZE
    print(f"{side}: {rate:,.0f} samples/s; CPU per batch by stage (workers: summed over both)")
    for label in _ORDER:
        per_batch = _totals[label] / batches / 1000
        print(f"  {label:<40} {per_batch:7.1f} us   calls/batch {_calls[label] / batches:.2f}")


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench.batch_costs", description=__doc__.split("\n")[0])
    parser.add_argument("--side", choices=("main", "worker", "both"), default="both")
    parser.add_argument("--items", type=int, default=200_000)
    args = parser.parse_args(argv)
    for side in ("main", "worker") if args.side == "both" else (args.side,):
        if os.fork() == 0:  # each side in a fresh process: the wrappers stay out of the other
            try:
                run(side, args.items)
            finally:
                sys.stdout.flush()
                os._exit(0)
        os.wait()
    return 0


if __name__ == "__main__":
    sys.exit(main())
