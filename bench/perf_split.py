"""Where a new set of workers' CPU goes, by process and by what the kernel was doing (``perf``).

    PYTHONPATH=src:. python -m bench.perf_split [--epochs 8] [--num-workers 2] [--frequency 1999]

Runs ``bench.epoch_costs``' float32 3x224x224 items (4,096 an epoch, batch 64, each batch read
once per 4 KiB page) through one pipeload loader with ``persistent_workers=True`` and one
without, each in a process of its own under ``perf record -g``, and splits the samples of each
run: the main process or a worker, then user space, page faults (by the kernel's handler:
a new anonymous page, copy-on-write, a shared page, a file's pages), ``madvise`` (the slabs'
page tables populated), ``clone`` (``fork``: the page-table copy) and other system calls. It
prints CPU milliseconds per epoch after the first for both runs and their difference: what a
loader without persistent workers pays each epoch for its new workers. Both runs include the
same start (imports, the first epoch), which the difference removes.

Needs ``perf`` (``linux-tools``) and a ``kernel.perf_event_paranoid`` that lets a user profile
their own processes (2 or less). Sampling counts are estimates: read differences of a few
milliseconds as noise.
"""

from __future__ import annotations

import argparse
import collections
import os
import shutil
import subprocess
import sys
import tempfile
from collections.abc import Iterator

from bench.run import _positive_int

SCENARIOS = ("persistent", "per-epoch")
ITEMS = 4096
BATCH_SIZE = 64
PAGE_ELEMENTS = 1024  # float32 values per 4 KiB page
# Kernel entry points a sample's stack may pass through, most specific first.
FAULT_HANDLERS = ("do_anonymous_page", "do_wp_page", "do_shared_fault", "do_read_fault",
                  "do_cow_fault", "filemap_map_pages", "shmem_fault")
FAULT_NAMES = {"do_anonymous_page": "new anonymous page", "do_wp_page": "copy-on-write",
               "do_shared_fault": "shared page (a slab)", "shmem_fault": "shared page (a slab)",
               "do_read_fault": "a file's pages", "filemap_map_pages": "a file's pages",
               "do_cow_fault": "copy-on-write"}


def run_loader(scenario: str, epochs: int, num_workers: int) -> None:
    """The measured job (in its own process, under perf): ``epochs`` epochs of one loader."""
    import pipeload
    from bench.epoch_costs import FloatItems

    loader = pipeload.DataLoader(FloatItems(ITEMS, (3, 224, 224)), batch_size=BATCH_SIZE,
                                 num_workers=num_workers,
                                 persistent_workers=scenario == "persistent")
    for _ in range(epochs):
        for batch in loader:
            float(batch.view(-1)[::PAGE_ELEMENTS].sum())  # one value per page, as a copy would


def samples(script: str) -> Iterator[tuple[int, list[str]]]:
    """(pid, stack of function names, innermost first) of each sample in ``perf script`` text."""
    pid, stack = None, []
    for line in script.splitlines():
        if not line.strip():
            if pid is not None:
                yield pid, stack
            pid, stack = None, []
        elif pid is None:
            pid = int(line.split()[0])
        else:
            parts = line.split(None, 1)
            stack.append(parts[1].split("+")[0].strip() if len(parts) > 1 else "?")
    if pid is not None:
        yield pid, stack


def kind_of_work(stack: list[str]) -> str:
    """What the sampled thread was doing, from its stack."""
    names = set(stack)
    if "asm_exc_page_fault" in names:
        handler = next((h for h in FAULT_HANDLERS if h in names), None)
        return "page fault: " + (FAULT_NAMES[handler] if handler else "other")
    for call in ("madvise", "clone", "clone3", "munmap", "mmap", "exit_group"):
        if f"__x64_sys_{call}" in names or f"__do_sys_{call}" in names:
            return {"clone3": "clone (fork)", "clone": "clone (fork)"}.get(call, call)
    if "do_syscall_64" in names or "entry_SYSCALL_64" in names:
        return "other system calls"
    return "user space, and kernel work not in a call"


def split(script: str) -> dict[tuple[str, str], int]:
    """Samples by (main process or workers, kind of work). The main process is the lowest pid:
    the workers are its children."""
    taken = list(samples(script))
    if not taken:
        return {}
    main = min(pid for pid, _ in taken)
    counts: dict[tuple[str, str], int] = collections.Counter()
    for pid, stack in taken:
        counts[("main" if pid == main else "workers", kind_of_work(stack))] += 1
    return counts


def profile(scenario: str, args: argparse.Namespace, directory: str) -> dict[tuple[str, str], int]:
    data = os.path.join(directory, f"{scenario}.data")
    job = [sys.executable, "-m", "bench.perf_split", "--job", scenario, "--epochs", str(args.epochs),
           "--num-workers", str(args.num_workers)]
    subprocess.run(["perf", "record", "-q", "-g", "-F", str(args.frequency), "-o", data, "--", *job],
                   check=True, env={**os.environ, "PYTHONPATH": os.pathsep.join(sys.path)})
    script = subprocess.run(["perf", "script", "-i", data, "-F", "pid,ip,sym"], check=True,
                            capture_output=True, text=True).stdout
    return split(script)


def report(runs: dict[str, dict[tuple[str, str], int]], args: argparse.Namespace) -> str:
    per_epoch_ms = 1000.0 / args.frequency / max(1, args.epochs - 1)
    keys = sorted(set().union(*runs.values()), key=lambda k: (k[0] != "main", k[1]))
    lines = [f"CPU ms an epoch after the first, {args.epochs} epochs, {args.num_workers} workers "
             f"(perf at {args.frequency} Hz)",
             f"{'process':<9}{'doing':<42}{'persistent':>11}{'per-epoch':>11}{'difference':>12}"]
    for who in ("main", "workers"):
        for key in (k for k in keys if k[0] == who):
            before, after = (runs[s].get(key, 0) * per_epoch_ms for s in SCENARIOS)
            lines.append(f"{who:<9}{key[1]:<42}{before:>11.1f}{after:>11.1f}{after - before:>+12.1f}")
        before, after = (sum(v for k, v in runs[s].items() if k[0] == who) * per_epoch_ms for s in SCENARIOS)
        lines.append(f"{who:<9}{'all told':<42}{before:>11.1f}{after:>11.1f}{after - before:>+12.1f}")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--epochs", type=_positive_int, default=8, help="default: %(default)s")
    parser.add_argument("--num-workers", type=_positive_int, default=2, help="default: %(default)s")
    parser.add_argument("--frequency", type=_positive_int, default=1999,
                        help="samples a second, per CPU (default: %(default)s)")
    parser.add_argument("--job", choices=SCENARIOS, help=argparse.SUPPRESS)  # the measured process
    args = parser.parse_args(argv)
    if args.job:
        run_loader(args.job, args.epochs, args.num_workers)
        return 0
    if shutil.which("perf") is None:
        print("perf is not installed (linux-tools): nothing to measure", file=sys.stderr)
        return 1
    if args.epochs < 2:
        parser.error("--epochs must be 2 or more: the first epoch is start-up, left out")
    with tempfile.TemporaryDirectory(prefix="pipeload-perf-") as directory:
        runs = {scenario: profile(scenario, args, directory) for scenario in SCENARIOS}
    print(report(runs, args))
    return 0


if __name__ == "__main__":
    sys.exit(main())
