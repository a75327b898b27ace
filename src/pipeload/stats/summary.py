"""The lines of ``LoaderStats.summary()``: throughput, the setup, where the time went, and the
verdict (its rules live in ``analysis``)."""

from __future__ import annotations

from pipeload.stats.analysis import diagnose, mean_busy, working
from pipeload.stats.report import LoaderStats, RayStageStats, WorkerStats

KIB = 1024
MIB = 1024 * 1024
SHOWN_WORKERS = 8


def summarise(stats: LoaderStats) -> str:
    """The lines of ``LoaderStats.summary()``."""
    lines = [
        f"pipeload stats: {stats.batches:,} batches in {stats.epochs} epoch(s), "
        f"{stats.batches_per_s:,.1f} batches/s, {stats.samples_per_s:,.0f} samples/s; "
        f"{_first_batch_words(stats)}",
        _setup_line(stats),
        f"the training loop waited {stats.wait_fraction:.0%} of the time after each epoch's first "
        f"batch ({seconds(stats.wait_s)} of {seconds(stats.wait_s + stats.compute_s)}), and "
        f"{seconds(stats.first_wait_s)} for the first batches and {seconds(stats.end_wait_s)} at the ends",
        _stage_line(stats),
    ]
    if stats.ray is not None:
        lines.append(_ray_line(stats.ray))
    has_workers = any(w.kind != "main" for w in stats.workers)
    if has_workers:
        lines += [_worker_line(stats), _queue_line(stats)]
    moved = ""
    if has_workers and stats.setup.worker_type == "thread":  # nothing crosses a process
        moved = f"thread workers handed {_size(stats.bytes_moved)} of tensors to the loop within the main process; "
    elif has_workers:
        moved = f"moved {_size(stats.bytes_moved)} of tensors to the main process; "
    lines.append(f"{moved}skipped samples: {stats.skipped_samples}, skipped files: {stats.skipped_files}")
    for placed in stats.separate_processes:
        lines.append(f"separate process (is_separate_process): {placed}")
    for decision in stats.decisions:
        lines.append(f"auto at batch {decision.at_batch}: num_workers={decision.num_workers}, "
                     f"prefetch_factor={decision.prefetch_factor} ({decision.reason})")
    lines.append(f"verdict: {diagnose(stats).advice}")
    return "\n".join(lines)


def seconds(value: float) -> str:
    """``1.23 s``, or ``4.5 ms`` under a tenth of a second (``0.00 s of 0.00 s`` said nothing)."""
    return f"{value:.2f} s" if value >= 0.1 or value == 0 else f"{value * 1e3:.1f} ms"


def _setup_line(stats: LoaderStats) -> str:
    setup = stats.setup
    if setup.num_workers == 0 and not stats.decisions:
        loading = "num_workers=0 (loading in the main process)"
    else:
        workers = f"{setup.num_workers}"
        prefetch = f"{setup.prefetch_factor}"
        if stats.decisions:  # "auto": the settings running now
            workers = f"auto (now {stats.decisions[-1].num_workers})"
            prefetch = f"{stats.decisions[-1].prefetch_factor}"
        loading = f"num_workers={workers}, worker_type={setup.worker_type}, prefetch_factor={prefetch}"
    dataset = {"pipe": "a DataPipe graph", "iterable": "an iterable dataset"}.get(setup.dataset, "a map-style dataset")
    return (f"setup: {dataset}, mode={setup.mode}, {loading}, batch_size={setup.batch_size}, "
            f"pin_memory={setup.pin_memory}{_unpinned(stats)}, {setup.cpus} usable CPUs")


def _unpinned(stats: LoaderStats) -> str:
    """Words for pin_memory=True that pinned nothing (no accelerator: batches stay in ordinary
    memory, and a warning said so once)."""
    return " (nothing pinned: no accelerator)" if stats.setup.pin_memory and stats.batches and not stats.pinned else ""


def _size(count: int) -> str:
    """Bytes in the largest unit that still shows them (1 KiB read "0.0 MiB")."""
    if count < KIB:
        return f"{count:,} bytes"
    return f"{count / KIB:,.1f} KiB" if count < MIB else f"{count / MIB:,.1f} MiB"


def _first_batch_words(stats: LoaderStats) -> str:
    """When the first batch came, and whose it is: the latest epoch's
    (``LoaderStats.first_batch_s``), which after the first epoch is no longer the loader's start."""
    if not stats.batches:
        return "no batch yet" if not stats.epochs else "no batch"
    whose = "first batch" if stats.epochs <= 1 else "the latest epoch's first batch"
    return f"{whose} after {stats.first_batch_s * 1e3:,.1f} ms"


def _stage_line(stats: LoaderStats) -> str:
    stages = stats.stages
    parts = []
    for name in ("fetch", "collate", "transfer", "pin"):
        stage = stages[name]
        if stage.count:
            unit = {"fetch": "sample", "transfer": "hand-over"}.get(name, "batch")
            parts.append(f"{name} {stage.seconds:.2f} s ({stage.mean_s * 1e6:,.0f} us/{unit}"
                         f"{_assembled_words(stats, stage.count) if name == 'collate' else ''})")
    if not stages["collate"].count and stats.setup.mode == "economic" and stats.batches:
        parts.append(f"collate: none in batch workers (the main process put together all "
                     f"{stats.batches:,} batches from item workers' pieces)")
    return "time per stage, summed over workers: " + (", ".join(parts) or "nothing yet")


def _assembled_words(stats: LoaderStats, collated: int) -> str:
    """Economic mode: the batches the main process put together from item workers' pieces
    (direct batches, engine/direct_batches.py) are no batch worker's; the collate figure is the
    batch workers' alone."""
    assembled = stats.batches - collated
    if stats.setup.mode != "economic" or assembled <= 0:
        return ""
    batches = "batch" if collated == 1 else "batches"
    return (f", over the {collated:,} {batches} the batch workers collated; the main process put "
            f"together the other {assembled:,} from item workers' pieces")


def _ray_line(ray: RayStageStats) -> str:
    per_item = ray.actor_s / ray.items * 1e3 if ray.items else 0.0
    restarts = f", {ray.restarts} actor restart(s)" if ray.restarts else ""
    return (f"Ray stage: {ray.items:,} items from its actors, {ray.actor_s:.2f} s in them "
            f"({per_item:,.2f} ms/item), {ray.transfer_s:.2f} s in transfer, waited for "
            f"{ray.wait_s:.2f} s{restarts}")


def _worker_line(stats: LoaderStats) -> str:
    """How busy the workers were, and what their busy time was made of: on a CPU, ready but
    queued for one (other jobs had the CPUs), or neither (waiting inside the dataset). The
    split is of the workers that finished a task: the others have no busy time, and their
    seconds on a CPU or queued for one, their start-up's, read as part of the work."""
    workers = [w for w in stats.workers if w.kind != "main"]
    each = ", ".join(f"{w.name} {w.busy_fraction:.0%}{_no_batch(w)}" for w in workers[:SHOWN_WORKERS])
    hidden = workers[SHOWN_WORKERS:]
    idle_hidden = [w for w in hidden if _no_batch(w)]
    more = f", and {len(hidden)} more" if hidden else ""
    if idle_hidden:
        words = {_no_batch(w) for w in idle_hidden}
        did = words.pop().strip(" ()") if len(words) == 1 else "did no task"
        more += f" ({len(idle_hidden)} of them {did})"
    busy = sum(w.busy_s for w in workers)
    if busy <= 0:
        return f"{_busy_words(workers)} of the time ({each}{more})"
    worked = working(workers)
    on_cpu = min(1.0, sum(w.cpu_s for w in worked) / busy)
    queued = min(1.0 - on_cpu, sum(w.queued_s for w in worked) / busy)
    return (f"{_busy_words(workers)} of the time ({each}{more}); of that busy time, {on_cpu:.0%} on "
            f"a CPU, {queued:.0%} ready but queued for one (other work had the CPUs), "
            f"{1 - on_cpu - queued:.0%} waiting inside the work (I/O, sleeps, locks)")


_NO_TASK = {"": " (built no batch)", "item": " (fetched no piece)", "batch": " (collated no batch)"}


def _no_batch(worker: WorkerStats) -> str:
    """Words for a worker that has done no task, in its kind's terms: a count, exact before any
    verdict (an iterable dataset with fewer shards than workers leaves the rest with nothing to
    build; a small batch leaves economic item workers with no piece)."""
    return _NO_TASK.get(worker.kind, "") if worker.tasks == 0 else ""


def _queue_line(stats: LoaderStats) -> str:
    """What the pool held at each hand-out (sampled), besides the batch handed out. "Ready" and
    "in flight" side by side read as two heaps ("1.1 more were ready and 3.0 in flight (room for
    4)": 4.1 against room for 4): the ready ones are in flight too, and the room, the most the
    engine may have in flight, counts the batch handed out."""
    queue = stats.queue
    made_of = _room_words(stats)
    made_of = f"{made_of}; " if made_of else ""
    return (f"when a batch was handed out, {queue.mean_in_flight:.1f} others were in flight on average "
            f"(sent to workers, not yet handed out), {queue.mean_ready:.1f} of them ready (built, waiting "
            f"in the main process for their turn); room for {queue.capacity} in flight, the batch handed "
            f"out included ({made_of}the pool keeps fewer when fewer keep the loop fed)")


def _room_words(stats: LoaderStats) -> str | None:
    """What the room is made of: ``prefetch_factor`` batches per worker in classic mode,
    ``prefetch_factor`` in all in economic mode; under "auto", the settings running now. None
    when the settings known here do not make the room: the setup is read at construction, and
    ``num_workers`` or ``prefetch_factor`` may be set afterwards, as torch allows."""
    capacity = stats.queue.capacity
    if stats.setup.mode == "economic":
        prefetch = stats.setup.prefetch_factor
        return f"prefetch_factor={prefetch}, whatever the number of workers" if prefetch == capacity else None
    if stats.decisions:
        now = stats.decisions[-1]
        if (now.prefetch_factor or 0) * now.num_workers != capacity:
            return None
        tuned = any((d.num_workers, d.prefetch_factor) != (now.num_workers, now.prefetch_factor)
                    for d in stats.decisions)
        after = ", after other settings num_workers='auto' tried" if tuned else ""
        return f"prefetch_factor={now.prefetch_factor} x {_workers(now.num_workers)} now{after}"
    if (stats.setup.prefetch_factor or 0) * stats.setup.num_workers != capacity:
        return None
    return f"prefetch_factor={stats.setup.prefetch_factor} x {_workers(stats.setup.num_workers)}"


def _workers(count: int) -> str:
    return f"{count} worker" if count == 1 else f"{count} workers"


def _busy_words(workers: list[WorkerStats]) -> str:
    """How busy the workers were: per kind in economic mode (item workers and batch workers do
    different work, and one mean over both described neither)."""
    kinds = [kind for kind in ("item", "batch") if any(w.kind == kind for w in workers)]
    if not kinds:
        return f"workers busy {mean_busy(workers):.0%}"
    return ", ".join(f"{kind} workers busy {mean_busy([w for w in workers if w.kind == kind]):.0%}"
                     for kind in kinds)

