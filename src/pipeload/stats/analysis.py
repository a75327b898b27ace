"""Reading a :class:`~pipeload.stats.report.LoaderStats`: the bottleneck, and what to try.

The rules, in order (docs/design/stats.md explains them):

1. The training loop waited less than ``KEEPS_UP`` of the time: loading keeps up. If the
   workers are mostly idle, fewer of them would do (less memory).
2. Pinning takes longer than the busiest loading stage: name it (try ``pin_memory=False``).
3. No workers: the main process fetches and collates itself; workers would take that off it.
4. Workers busy at least ``SATURATED`` of the time: they are the bottleneck, and the stage
   where they spend most (dataset, collate_fn, handing over) is named. A loop that waited a
   fraction ``w`` of the time needs about ``n / (1 - w)`` workers: up to the usable CPUs when
   the workers compute, beyond them when they mostly wait (their time on a CPU, or ready and
   queued for one, is under ``WAITING`` of their busy time: I/O, remote reads, sleeps).
5. Otherwise the workers idle while the loop waits: the main process's per-batch work
   (receiving, unpickling, reordering, pinning) is what limits.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any

from pipeload.stats.report import LoaderStats, RayStageStats, WorkerStats

KEEPS_UP = 0.10
SATURATED = 0.60
WAITING = 0.5
MAX_SUGGESTED_WORKERS = 64
GIL_SHARE = 0.5  # thread workers running 0.5 to 1.5 CPUs between them take turns on the GIL
HEADROOM = 0.8  # aim to keep workers busy this much, not fully, when suggesting fewer
KIB = 1024
MIB = 1024 * 1024

STAGE_WORDS = {
    "fetch": "`__getitem__` (the dataset)",
    "collate": "`collate_fn`",
    "transfer": "handing batches over to the main process",
}


@dataclass(frozen=True)
class Diagnosis:
    """The bottleneck in a few words, a sentence of advice, and the settings to try."""

    bottleneck: str
    advice: str
    suggestions: dict[str, Any] = field(default_factory=dict)


def diagnose(stats: LoaderStats) -> Diagnosis:
    """Apply the module's rules to ``stats``."""
    if stats.batches == 0:
        return Diagnosis("unknown", "no batches have been loaded yet")
    setup = stats.setup
    wait = stats.wait_fraction
    workers = [w for w in stats.workers if w.kind != "main"]
    if wait < KEEPS_UP:
        return _keeps_up(stats, workers)
    stage = _busiest_stage(stats)
    if stats.pin_s > stats.stages[stage].seconds:
        return Diagnosis("pinning", "pinning is the bottleneck (pin_memory=True): it takes longer than "
                         f"{STAGE_WORDS[stage]}; try pin_memory=False, unless copies to the "
                         "accelerator need pinned memory", {"pin_memory": False})
    if not workers:
        target = _workers_for(stats, 1)
        return Diagnosis(
            STAGE_WORDS[stage],
            f"the main process loads every batch itself, and {STAGE_WORDS[stage]} takes most of "
            f"it; try num_workers={target}", {"num_workers": target})
    busy = _busiest_kind(workers)
    if busy >= SATURATED or (stage == "collate" and _batch_workers_held_back(stats)):
        return _saturated(stats, stage, _current_workers(stats))
    return Diagnosis(
        "the main process",
        f"workers are idle {1 - busy:.0%} of the time while the loop waits: the main process's "
        "work per batch (receiving, unpickling, reordering, pinning) limits; try a larger "
        "batch_size, or worker_type='thread' for light samples",
        {"batch_size": 2 * setup.batch_size} if setup.batch_size else {})


def _keeps_up(stats: LoaderStats, workers: list[WorkerStats]) -> Diagnosis:
    words = f"the training loop waited only {stats.wait_fraction:.0%} of the time: loading keeps up"
    if workers:
        words += f" (workers idle {1 - _mean_busy(workers):.0%} of the time)"
    count = stats.setup.num_workers
    if count > 1 and workers:
        needed = max(1, math.ceil(count * _mean_busy(workers) / HEADROOM))
        if needed < count:
            return Diagnosis("the training loop", f"{words}; num_workers={needed} would too, with "
                             "less memory", {"num_workers": needed})
    return Diagnosis("the training loop", words)


def _current_workers(stats: LoaderStats) -> int:
    """The workers running now: the last auto decision's, else the loader's setting."""
    return stats.decisions[-1].num_workers if stats.decisions else stats.setup.num_workers


def _mostly_waiting(workers: list[WorkerStats]) -> bool:
    busy = sum(w.busy_s for w in workers)
    running = sum(w.cpu_s + w.queued_s for w in workers)  # crowded out is not waiting on I/O
    return busy > 0 and running < WAITING * busy


def _saturated(stats: LoaderStats, stage: str, count: int) -> Diagnosis:
    words = f"{STAGE_WORDS[stage]} is the bottleneck"
    if stats.setup.mode == "economic" and stage == "collate":  # the batch workers' stage
        return _more_batch_workers(stats, words, [w for w in stats.workers if w.kind == "batch"])
    workers = [w for w in stats.workers if w.kind in ("", "item")]
    if _taking_turns_on_the_gil(stats, workers):
        return Diagnosis(STAGE_WORDS[stage], f"{words}, and the thread workers ran one CPU's worth "
                         "between them: Python code holds the GIL, one thread at a time; try "
                         "worker_type='process'", {"worker_type": "process"})
    if _mostly_waiting(workers):
        target = min(MAX_SUGGESTED_WORKERS, 4 * count, max(count + 1, _wanted(stats, count)))
        return Diagnosis(STAGE_WORDS[stage], f"{words}, and the workers mostly wait in it (I/O, "
                         f"sleep, locks) rather than compute: more workers than CPUs help; try "
                         f"num_workers={target} (or 'auto')", {"num_workers": target})
    target = _workers_for(stats, count)
    if target <= count:
        return _cpus_in_use(stats, stage, words)
    return Diagnosis(STAGE_WORDS[stage], f"{words}; try num_workers={target}", {"num_workers": target})


def _taking_turns_on_the_gil(stats: LoaderStats, workers: list[WorkerStats]) -> bool:
    """Thread workers that together ran about one CPU (half of it at least, little more), where
    their number and the CPUs allowed more: they compute in Python, which the GIL serialises."""
    if stats.setup.worker_type != "thread" or len(workers) < 2 or stats.setup.cpus < 2:
        return False
    alive = max(w.alive_s for w in workers)
    running = sum(w.cpu_s + w.queued_s for w in workers)
    return alive > 0 and GIL_SHARE * alive <= running <= (2 - GIL_SHARE) * alive


def _cpus_in_use(stats: LoaderStats, stage: str, words: str) -> Diagnosis:
    return Diagnosis(STAGE_WORDS[stage], f"{words}, and the {stats.setup.cpus} usable CPUs are all "
                     f"in use: make {STAGE_WORDS[stage]} cheaper, or give the job more CPUs")


def _more_batch_workers(stats: LoaderStats, words: str, batch_workers: list[WorkerStats]) -> Diagnosis:
    """Economic mode's ``collate_fn`` limits: more batch workers, bounded as classic workers are
    (a loop that waited all the time would otherwise ask for thousands)."""
    count = len(batch_workers)
    capacity = stats.queue.capacity
    if _batch_workers_held_back(stats):
        return Diagnosis(STAGE_WORDS["collate"], f"{words}, and only prefetch_factor={capacity} "
                         f"batches are collated at once: try prefetch_factor={count} (as many "
                         "batches in memory)", {"prefetch_factor": count})
    if _mostly_waiting(batch_workers):
        more = min(MAX_SUGGESTED_WORKERS, 4 * count, max(count + 1, _wanted(stats, count)))
    else:
        more = _workers_for(stats, count)
    if more <= count:
        return _cpus_in_use(stats, "collate", words)
    settings = {"num_batch_workers": more}
    if more > capacity:  # economic mode collates at most prefetch_factor batches at once
        settings["prefetch_factor"] = more
    return Diagnosis(STAGE_WORDS["collate"], f"{words}; try " + ", ".join(
        f"{name}={value}" for name, value in settings.items()), settings)


def _batch_workers_held_back(stats: LoaderStats) -> bool:
    """Economic mode has more batch workers than batches it may collate at once
    (``prefetch_factor``): the extra ones can only idle."""
    batch_workers = sum(1 for w in stats.workers if w.kind == "batch")
    return stats.setup.mode == "economic" and 0 < stats.queue.capacity < batch_workers


def _wanted(stats: LoaderStats, count: int) -> int:
    """Workers that would keep up with the loop: ``count / (1 - wait)``."""
    return math.ceil(max(count, 1) / max(1e-9, 1 - stats.wait_fraction))


def _workers_for(stats: LoaderStats, count: int) -> int:
    """As :func:`_wanted`, within the usable CPUs."""
    return max(1, min(stats.setup.cpus, _wanted(stats, count)))


def _busiest_stage(stats: LoaderStats) -> str:
    stages = stats.stages
    return max(STAGE_WORDS, key=lambda name: stages[name].seconds)


def _busiest_kind(workers: list[WorkerStats]) -> float:
    """The mean busy fraction of the busiest kind of worker (economic mode has two kinds)."""
    kinds = {w.kind for w in workers}
    return max(_mean_busy([w for w in workers if w.kind == kind]) for kind in kinds)


def _mean_busy(workers: list[WorkerStats]) -> float:
    return sum(w.busy_fraction for w in workers) / len(workers) if workers else 0.0


def summarise(stats: LoaderStats) -> str:
    """The lines of ``LoaderStats.summary()``."""
    setup = stats.setup
    workers = f"{setup.num_workers}"
    if stats.decisions:
        workers = f"auto (now {_current_workers(stats)}, prefetch_factor {stats.decisions[-1].prefetch_factor})"
    lines = [
        f"pipeload stats: {stats.batches:,} batches in {stats.epochs} epoch(s), "
        f"{stats.batches_per_s:,.1f} batches/s, {stats.samples_per_s:,.0f} samples/s; "
        f"first batch after {stats.first_batch_s * 1e3:,.1f} ms",
        f"setup: mode={setup.mode}, num_workers={workers}, worker_type={setup.worker_type}, "
        f"prefetch_factor={setup.prefetch_factor}, batch_size={setup.batch_size}, "
        f"pin_memory={setup.pin_memory}{_unpinned(stats)}, {setup.cpus} usable CPUs",
        f"the training loop waited {stats.wait_fraction:.0%} of the time after each epoch's first "
        f"batch ({stats.wait_s:.2f} s of {stats.wait_s + stats.compute_s:.2f} s), and "
        f"{stats.first_wait_s:.2f} s for the first batches and {stats.end_wait_s:.2f} s at the ends",
        _stage_line(stats),
    ]
    if stats.ray is not None:
        lines.append(_ray_line(stats.ray))
    has_workers = any(w.kind != "main" for w in stats.workers)
    if has_workers:
        lines.append(_worker_line(stats))
    moved = f"moved {_size(stats.bytes_moved)} of tensors to the main process; " if has_workers else ""
    lines.append(f"{moved}skipped samples: {stats.skipped_samples}")
    for decision in stats.decisions:
        lines.append(f"auto at batch {decision.at_batch}: num_workers={decision.num_workers}, "
                     f"prefetch_factor={decision.prefetch_factor} ({decision.reason})")
    diagnosis = diagnose(stats)
    if diagnosis.advice.startswith(diagnosis.bottleneck + " is"):
        lines.append(f"bottleneck: {diagnosis.advice}")
    else:
        lines.append(f"bottleneck: {diagnosis.bottleneck}: {diagnosis.advice}")
    return "\n".join(lines)


def _unpinned(stats: LoaderStats) -> str:
    """Words for pin_memory=True that pinned nothing (no accelerator: batches stay in ordinary
    memory, and a warning said so once)."""
    return " (nothing pinned: no accelerator)" if stats.setup.pin_memory and stats.batches and not stats.pinned else ""


def _size(count: int) -> str:
    """Bytes in the largest unit that still shows them (1 KiB read "0.0 MiB")."""
    if count < KIB:
        return f"{count:,} bytes"
    return f"{count / KIB:,.1f} KiB" if count < MIB else f"{count / MIB:,.1f} MiB"


def _stage_line(stats: LoaderStats) -> str:
    stages = stats.stages
    parts = []
    for name in ("fetch", "collate", "transfer", "pin"):
        stage = stages[name]
        if stage.count:
            unit = {"fetch": "sample", "transfer": "hand-over"}.get(name, "batch")
            parts.append(f"{name} {stage.seconds:.2f} s ({stage.mean_s * 1e6:,.0f} us/{unit})")
    return "time per stage, summed over workers: " + (", ".join(parts) or "nothing yet")


def _ray_line(ray: RayStageStats) -> str:
    per_item = ray.actor_s / ray.items * 1e3 if ray.items else 0.0
    restarts = f", {ray.restarts} actor restart(s)" if ray.restarts else ""
    return (f"Ray stage: {ray.items:,} items from its actors, {ray.actor_s:.2f} s in them "
            f"({per_item:,.2f} ms/item), {ray.transfer_s:.2f} s in transfer, waited for "
            f"{ray.wait_s:.2f} s{restarts}")


def _worker_line(stats: LoaderStats) -> str:
    workers = [w for w in stats.workers if w.kind != "main"]
    each = ", ".join(f"{w.name} {w.busy_fraction:.0%}" for w in workers[:8])
    more = f", and {len(workers) - 8} more" if len(workers) > 8 else ""
    queue = stats.queue
    cpu = sum(w.cpu_fraction for w in workers) / len(workers)
    return (f"{_busy_words(workers)} of the time, on a CPU {cpu:.0%} "
            f"({each}{more}); when a batch "
            f"was handed out, {queue.mean_ready:.1f} more were ready on average and "
            f"{queue.mean_in_flight:.1f} in flight (room for {queue.capacity})")


def _busy_words(workers: list[WorkerStats]) -> str:
    """How busy the workers were: per kind in economic mode (item workers and batch workers do
    different work, and one mean over both described neither)."""
    kinds = [kind for kind in ("item", "batch") if any(w.kind == kind for w in workers)]
    if not kinds:
        return f"workers busy {_mean_busy(workers):.0%}"
    return ", ".join(f"{kind} workers busy {_mean_busy([w for w in workers if w.kind == kind]):.0%}"
                     for kind in kinds)
