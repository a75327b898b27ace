"""Reading a :class:`~pipeload.stats.report.LoaderStats`: what limits loading, and what to try.

A verdict is given only on enough evidence, and only where something stands out by a margin,
so that identical runs get the same verdict and following it does not slow the loader:

Before them: workers started anew each epoch whose start and stop take a large share of the
time are named, and ``persistent_workers=True`` suggested (``stats.startup``, on its own
evidence); else epochs whose first batches alone take a large share (few batches an epoch) are
named, with their figures; the steady verdict's suggestions, if any, follow, and under
``num_workers="auto"`` where the tuner stands (still tuning, or the settings it settled on).

0. Too few steady batches (``MIN_STEADY_BATCHES``) or seconds (``MIN_STEADY_S``): no verdict
   yet; it says how many more batches it needs. Likewise while ``num_workers="auto"`` is still
   trying settings (its latest decision not ``settled``): the figures mix them.
1. The training loop waited less than ``LIMITS`` of the time: the training loop limits, and
   loading keeps up (under ``KEEPS_UP``: if the workers idle most of the time, busy under
   ``FEWER_IF_BUSY``, fewer would do, with less memory) or nearly (the workers' occupancy is
   said, so a loop fed by saturated workers knows where the rest lies). The share is of the
   steady time; the epochs' first batches and ends, where they take ``KEEPS_UP`` of the run or
   more and no rule above named them, are said beside it.
2. Pinning takes ``STANDS_OUT`` times the busiest loading stage: name it (try ``pin_memory=False``).
3. No workers: the main process loads every batch itself; workers would take that off it.
4. The busiest kind of worker is occupied at least ``SATURATED`` of the time (in its stages, or
   else on a CPU or queued for one: per-task work outside the stages counts too, see
   :func:`occupancy`): the workers limit, and
   the stage where they spend most is named if it takes ``STANDS_OUT`` times the next (else the
   shares of the stages are given: naming one of two near-equal stages flipped between runs). A loop
   that waited a fraction ``w`` of the time needs about ``n / (1 - w)`` workers: up to the
   usable CPUs when the workers compute (on a CPU, or ready and queued for one, at least
   ``COMPUTING`` of their busy time), beyond them when they mostly wait (under ``WAITING``: I/O,
   remote reads, sleeps; only when fetching stands out, as waits in handing over are
   back-pressure; thread workers only while they run under ``GIL_FREE`` of a CPU between them,
   as a thread waiting for the GIL looks the same); otherwise nothing is suggested. Numbers are rounded up to a coarse
   ladder (``LADDER``), so noise between runs does not move them by one; a number no larger
   than the workers running (``MAX_SUGGESTED_WORKERS``, the tuner's cap too) is never suggested.
5. Process workers occupied at most ``IDLE`` while the loop waits: the main process's own work per
   batch limits (thread workers hand batches over for next to nothing: there, as between
   ``IDLE`` and ``SATURATED``, no single bottleneck stands out).

Whatever the verdict, workers of an iterable dataset that built no batch at all are named: the
dataset has fewer shards than workers, and as many workers as shards do the same work.
Suggestions never touch what is trained (``batch_size``, ``drop_last``, the sampler); "auto" is
offered only where the loader re-tunes (map-style datasets in classic mode).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any

from pipeload.stats.report import LoaderStats, WorkerStats
from pipeload.stats.startup import FirstBatches, Restarts, first_batch_words, first_batches, restart_words, restarts

MIN_STEADY_BATCHES = 50
MIN_STEADY_S = 2.0
KEEPS_UP = 0.05
# Below this share of waiting, loading nearly keeps up and no bottleneck is named. Identical
# runs of the README's stats example (20 ms steps) on an idle 2-core box waited 6% to 15%: at
# 0.15 they named "the workers" once in five and "no single bottleneck" four times; a loop
# waiting under a quarter of its time gains at most 1.33x from loading however it is tuned.
LIMITS = 0.25
SATURATED = 0.80
IDLE = 0.40
WAITING = 0.50
COMPUTING = 0.75
GIL_FREE = 0.5  # thread workers running less than this CPU between them do not queue on the GIL
STANDS_OUT = 1.5
FEWER_IF_BUSY = 0.35
HEADROOM = 0.8  # aim to keep workers busy this much, not fully, when suggesting fewer
MAX_SUGGESTED_WORKERS = 64
LADDER = (1, 2, 3, 4, 6, 8, 12, 16, 24, 32, 48, 64)
STAGES = ("fetch", "collate", "transfer")  # the loading stages, in the workers (or inline)
# Thread workers that ran one CPU between them, give or take GIL_BAND, take turns on the GIL
# (judged only with 3 CPUs or more: on 2, the main thread's share alone keeps them near one).
GIL_BAND = 0.3
GIL_MIN_CPUS = 3
CROWDED = 0.25  # queued for a CPU this share of their life: crowded out, not the GIL
# What a worker process adds to each batch it hands over, in CPU time (its task, its answer, the
# hand-over in the main process), and what it adds for each MiB of the batch (writing it into
# shared memory, the main process's side of a slab). On a machine whose CPUs the workers fill,
# the main process's share is taken from them: 2 workers load faster than none only for batches
# that take longer than this to load. Cheap items, 2 persistent workers against num_workers=0 on
# the 2-core box (stop 53, `python -m bench.hand_over`), read as 2 CPUs over (load + hand-over):
# 320 us a batch of 0.09 MiB and 0.38 MiB, 337 us at 1.5 MiB, 739 us at 6 MiB. (Stop 37: tiny
# items inline at 59,601 batches/s, 3,696 with 2 workers.) 100 us, the figure before, told a
# stream of 8 us samples (255 us a batch) and 1.5 MiB batches of 160 us to "try num_workers=2":
# 2.2x and 1.7x slower when followed (a newcomer's and a skeptic's probes at stop 53).
WORKER_BATCH_COST_S = 300e-6
HAND_OVER_S_PER_MIB = 75e-6
# The most of a worker's busy time taken for queueing when its work is judged: 2 workers and the
# main process on 2 CPUs queue a third of it; a machine full of another program's work would
# otherwise read any batch as costing nothing to load.
MOST_QUEUED = 0.5
# Workers are suggested for batches that take this many hand-overs to load: 2 workers then load
# about 1.2 times as fast as none on 2 CPUs; at one they only break even.
WORKERS_PAY_OFF = 1.5
# What "occupied" and "idle" mean in a verdict (see occupancy()): more than the stats line's
# "busy", which counts the stages alone; said where they appear, as the two figures differ.
OCCUPIED_WORDS = ("in their stages, or else running or queued for a CPU",
                  "neither in their stages nor running or queued for a CPU")


@dataclass(frozen=True)
class Diagnosis:
    """What limits, in a few words (``bottleneck``), the verdict as a sentence (``advice``),
    and the DataLoader settings to try (``suggestions``: empty means keep them)."""

    bottleneck: str
    advice: str
    suggestions: dict[str, Any] = field(default_factory=dict)


def diagnose(stats: LoaderStats) -> Diagnosis:
    """Apply the module's rules to ``stats``."""
    if stats.batches == 0:
        return Diagnosis("unknown", "no batches have been loaded yet")
    found = restarts(stats)
    firsts = first_batches(stats) if found is None else None
    tuning = still_tuning(stats)
    # Under "auto", where the epochs' starts are named, the tuner's state goes with them: the
    # verdict named the start-up alone while the decisions listed above it were still trying
    # settings (or had settled), and read as if they had nothing to do with it.
    pending = Diagnosis("still tuning", tuning) if tuning is not None else None
    shortfall = evidence_shortfall(stats)
    if shortfall is not None:
        return _opening(stats, found, firsts, pending) or Diagnosis("not enough data", shortfall)
    if pending is not None:
        return _opening(stats, found, firsts, pending) or pending
    workers = [w for w in stats.workers if w.kind != "main"]
    if stats.setup.dataset != "map" and any(w.tasks for w in workers):
        workers = [w for w in workers if w.tasks or w.kind != ""]  # shardless: said apart
    said_apart = found is not None or firsts is not None
    steady_verdict = _with_idle_shards(stats, _verdict(stats, workers, said_apart))
    return _opening(stats, found, firsts, steady_verdict) or steady_verdict


def still_tuning(stats: LoaderStats) -> str | None:
    """Why ``num_workers="auto"`` is not judged yet (None: it settled, or there is none): its
    figures mix the settings it is trying, and advice on them would race it."""
    if not stats.decisions or stats.decisions[-1].settled:
        return None
    latest = stats.decisions[-1]
    return (f"num_workers='auto' is still tuning (trying num_workers={latest.num_workers}, "
            f"prefetch_factor={latest.prefetch_factor} since batch {latest.at_batch:,}): its figures "
            "mix the settings it tries; judged once it settles")


def _opening(stats: LoaderStats, found: Restarts | None, firsts: FirstBatches | None,
             steady_verdict: Diagnosis | None) -> Diagnosis | None:
    """The epochs' starts, where they take a large share of the time (None: they do not)."""
    if found is not None:
        return _restarting(stats, found, steady_verdict)
    if firsts is not None:
        return _first_batches(stats, firsts, steady_verdict)
    return None


def _first_batches(stats: LoaderStats, found: FirstBatches, steady_verdict: Diagnosis | None) -> Diagnosis:
    """Every epoch's first batch takes a large share with the workers alive: said first, with no
    setting to change (the workers are persistent, or starting them is not what costs); the
    steady verdict follows (under "auto", with where the tuner stands)."""
    advice = first_batch_words(found)
    if steady_verdict is None:
        return Diagnosis("epoch start", advice)
    tuned = stats.decisions and steady_verdict.bottleneck != "still tuning"
    settled = f"{_settled_words(stats)}: " if tuned else ""
    return Diagnosis("epoch start", f"{advice}. Between the first batches, {settled}{steady_verdict.advice}",
                     steady_verdict.suggestions)


def _restarting(stats: LoaderStats, found: Restarts, steady_verdict: Diagnosis | None) -> Diagnosis:
    """Starting workers each epoch takes a large share: said first, with ``persistent_workers``;
    the steady verdict follows where it suggests something (its "keep these settings" would
    contradict the suggestion). Under "auto", where the tuner stands always follows: still
    tuning (the steady verdict waits for it), or the settings it settled on. Where a batch
    takes less work than a worker adds to each it hands over, no worker at all is faster still:
    a trivially cheap dataset, 2 workers started each epoch, was told to persist where
    num_workers=0 loaded it faster than either. (Not with a ``worker_init_fn``: what it sets
    up, a loader without workers would not.)"""
    work_s = _work_per_batch(stats)
    if (0 < work_s < hand_over_s(stats) and stats.setup.mode == "classic" and not stats.decisions
            and not stats.setup.has_worker_init_fn):
        words = (f"a batch takes {work_s * 1e6:,.0f} us of work (fetch and collate), less than a worker adds "
                 "to each batch it hands over: try num_workers=0, which loads them in the main "
                 "process and starts no worker")
        return Diagnosis("worker start-up", restart_words(found, words), {"num_workers": 0})
    suggestions: dict[str, Any] = {"persistent_workers": True}
    advice = restart_words(found)
    if steady_verdict is not None and steady_verdict.bottleneck == "still tuning":
        advice += f". Between the starts, {steady_verdict.advice}"
    elif stats.decisions:
        advice += f". Between the starts, {_settled_words(stats)}"
        if steady_verdict is not None and steady_verdict.suggestions:
            suggestions.update(steady_verdict.suggestions)
            advice += f": {steady_verdict.advice}"
    elif steady_verdict is not None and steady_verdict.suggestions:
        suggestions.update(steady_verdict.suggestions)
        advice += f". Between the starts, {steady_verdict.advice}"
    return Diagnosis("worker start-up", advice, suggestions)


def _settled_words(stats: LoaderStats) -> str:
    """Where ``num_workers="auto"`` stopped (its latest decision is settled)."""
    settled = stats.decisions[-1]
    return (f"num_workers='auto' settled on num_workers={settled.num_workers}, "
            f"prefetch_factor={settled.prefetch_factor} at batch {settled.at_batch:,}")


def steady(stats: LoaderStats) -> tuple[int, float]:
    """Batches after each epoch's first, and the seconds the loop spent on them."""
    return max(0, stats.batches - stats.epochs), stats.wait_s + stats.compute_s


def evidence_shortfall(stats: LoaderStats, factor: float = 1.0) -> str | None:
    """Why there is too little to judge yet (None: enough): fewer than ``factor`` times
    ``MIN_STEADY_BATCHES`` steady batches, or ``MIN_STEADY_S`` seconds of them."""
    batches, seconds = steady(stats)
    need_batches, need_s = math.ceil(factor * MIN_STEADY_BATCHES), factor * MIN_STEADY_S
    if batches >= need_batches and seconds >= need_s:
        return None
    if batches == 0 and stats.epochs > 1:  # more epochs like these would add nothing to judge
        return (f"too little to judge: none of the {stats.epochs} epochs handed out more than one "
                "batch, and an epoch's first batch is start-up, never judged; a verdict needs epochs "
                f"of two or more batches, {need_batches} of them after the epochs' first and {need_s:.0f} s")
    rate = batches / seconds if batches and seconds > 0 else 0.0
    more = max(need_batches - batches, math.ceil((need_s - seconds) * rate) if rate else 0)
    # Where the seconds are short, the batches follow from this run's rate: said with the
    # seconds (epochs of a few batches, each a burst of batches already waiting, read "about
    # 5,420 more batches" at a rate no longer run would keep).
    time_short = f", or {need_s - seconds:.1f} s more of them" if need_s - seconds >= 0.1 else ""
    return (f"too little to judge yet: {batches:,} batches after each epoch's first, in {seconds:.1f} s; "
            f"a verdict needs {need_batches} batches and {need_s:.0f} s of them: about {more:,} more "
            f"{'batch' if more == 1 else 'batches'}{time_short}")


def _verdict(stats: LoaderStats, workers: list[WorkerStats], starts_said: bool = False) -> Diagnosis:
    """The steady verdict (rules 1 to 5); ``starts_said``: the epochs' starts are named apart."""
    wait = stats.wait_fraction
    if wait < LIMITS:
        return _keeps_up(stats, workers, starts_said)
    stage, stands_out = _busiest_stage(stats)
    if stats.pin_s > STANDS_OUT * stats.stages[stage].seconds:
        return Diagnosis("pinning", "pinning limits (pin_memory=True): it takes longer than "
                         f"{stage_words(stats, stage)}; try pin_memory=False, unless copies to the "
                         "accelerator need pinned memory", {"pin_memory": False})
    if not workers:
        words = (f"the main process loads every batch itself while the loop waits {wait:.0%} of "
                 f"the time ({_split(stats)})")
        if stats.setup.cpus < 2:  # a worker would share the one CPU with the loop
            return Diagnosis("the main process", f"{words}; with one usable CPU, workers would only "
                             "take turns with it")
        batches, _ = steady(stats)
        per_batch = stats.wait_s / batches if batches else 0.0
        hand_over = hand_over_s(stats)
        if per_batch < hand_over:
            return Diagnosis("the main process", f"{words}; a batch takes {per_batch * 1e6:.0f} us to "
                             f"load, less than a worker process adds to each batch it hands over"
                             f"{_hand_over_words(stats, hand_over)}: keep num_workers=0")
        if per_batch < WORKERS_PAY_OFF * hand_over:
            return Diagnosis("the main process", f"{words}; a batch takes {per_batch * 1e6:.0f} us to "
                             f"load, too little beside what a worker process adds to each batch it "
                             f"hands over{_hand_over_words(stats, hand_over)} for workers to pay off: "
                             "keep num_workers=0")
        target = _workers_for(stats, 1)
        return Diagnosis("the main process", f"{words}; try num_workers={target}", {"num_workers": target})
    light = _lighter_than_handing_over(stats)
    if light is not None:
        return light
    busy = _busiest_kind(workers)  # occupied, in fact: see occupancy()
    if busy >= SATURATED or (stage == "collate" and _batch_workers_held_back(stats)):
        return _saturated(stats, stage, stands_out)
    if busy <= IDLE and stats.setup.worker_type == "process":
        return Diagnosis("the main process", f"the workers idle {1 - busy:.0%} of the time while the "
                         f"loop waits {wait:.0%}: the main process's own work per batch limits "
                         "(receiving, unpickling, reordering, pinning, or other work in this process)")
    if busy <= IDLE:  # thread workers: the main thread's work per batch is next to nothing
        return Diagnosis("no single bottleneck", f"the thread workers idle {1 - busy:.0%} of the time "
                         f"while the loop waits {wait:.0%}: they and the loop's thread take turns on "
                         "the GIL and the CPUs, and no one part stands out; keep these settings")
    return Diagnosis("no single bottleneck", f"the loop waits {wait:.0%} of the time and the workers "
                     f"are occupied {busy:.0%} of theirs ({OCCUPIED_WORDS[0]}): neither they nor the main process stands "
                     "out; keep these settings")


def _lighter_than_handing_over(stats: LoaderStats) -> Diagnosis | None:
    """Classic workers whose batches are lighter than a hand-over (``hand_over_s``) and take one
    process less time to load than the loop now waits for each (``WORKERS_PAY_OFF`` times
    less): handing them over costs more than the workers gain, and the main process would load
    them faster itself. Tiny items, 2 process workers on
    the 2-core box: 19,000 to 24,000 samples/s, num_workers=0 184,000 to 192,000; a stream of 8
    us samples, 1,740 batches/s with 2 workers against 3,920 with none (stop 53), where the
    workers' stages alone did not stand out ("keep these settings"). The work is the workers'
    fetch and collate less the share of it they spent queued for a CPU (on 2 CPUs they queue
    behind each other and the main process: the stream's 240 us batches read 553 us), at most
    ``MOST_QUEUED`` of it. None where that is not so, or ``"auto"`` chooses the count."""
    if stats.setup.mode != "classic" or stats.decisions or not stats.batches:
        return None
    work_s = _cpu_work_per_batch(stats)
    batches, _ = steady(stats)
    wait_s = stats.wait_s / batches if batches else 0.0
    # Only batches lighter than a hand-over: heavier ones, whose workers queue because another
    # program loads the machine, are the workers' to build (the rule read 38 ms batches queued
    # behind another program as lighter than handing over, stop 53's second review). The same
    # line the num_workers=0 rule draws, so that the two never send a loader back and forth.
    if work_s <= 0 or work_s >= hand_over_s(stats) or WORKERS_PAY_OFF * work_s >= wait_s:
        return None
    return Diagnosis("handing over", f"the loop waits {stats.wait_fraction:.0%} of the time, "
                     f"{wait_s * 1e6:,.0f} us a batch, for batches that take {work_s * 1e6:,.0f} us "
                     "of work each (fetch and collate, on a CPU): handing them over costs more than "
                     "the workers gain: try num_workers=0, which loads them in the main process",
                     {"num_workers": 0})


def _cpu_work_per_batch(stats: LoaderStats) -> float:
    """``_work_per_batch`` less the share of the workers' busy time they were queued for a CPU:
    what one process with a CPU of its own would spend."""
    workers = working([w for w in stats.workers if w.kind in ("", "main")])
    busy = sum(w.busy_s for w in workers)
    queued = min(MOST_QUEUED, sum(w.queued_s for w in workers) / busy) if busy > 0 else 0.0
    return _work_per_batch(stats) * (1.0 - queued)


def hand_over_s(stats: LoaderStats) -> float:
    """What a worker process adds to each batch it hands over, for batches of the size seen
    (thread workers hand the batch itself over: its size adds nothing)."""
    threads = stats.setup.worker_type == "thread" and stats.setup.num_workers > 0
    per_mib = 0.0 if threads else HAND_OVER_S_PER_MIB
    return WORKER_BATCH_COST_S + _bytes_per_batch(stats) / (1 << 20) * per_mib


def _hand_over_words(stats: LoaderStats, hand_over: float) -> str:
    """``hand_over`` in words, where the batches' size adds to it."""
    size = _bytes_per_batch(stats)
    if size < (1 << 20) // 10:
        return ""
    return f" (about {hand_over * 1e6:,.0f} us for a batch of {size / (1 << 20):,.1f} MiB)"


def _bytes_per_batch(stats: LoaderStats) -> float:
    """Tensor bytes a batch held, in whichever process built it (0: not known)."""
    built = [w for w in stats.workers if w.kind in ("", "main")]
    tasks = sum(w.tasks for w in built)
    return sum(w.bytes_out for w in built) / tasks if tasks else 0.0


def _work_per_batch(stats: LoaderStats) -> float:
    """Seconds of fetch and collate a batch took, in whichever process built it."""
    stages = stats.stages
    built = stages["collate"].count or stats.batches
    return (stages["fetch"].seconds + stages["collate"].seconds) / built if built else 0.0


def _keeps_up(stats: LoaderStats, workers: list[WorkerStats], starts_said: bool = False) -> Diagnosis:
    """The loop waited under ``LIMITS``: the training loop takes most of the time, loading keeps
    up (under ``KEEPS_UP``) or nearly. One verdict for both: the README's stats example waits 5%
    to 15% from run to run, and a name that changed at 5% changed between identical runs. The
    share is the steady one, after each epoch's first batch; the waits it leaves out are said
    too unless ``starts_said`` (see :func:`_first_and_end_words`)."""
    wait = stats.wait_fraction
    starts = "" if starts_said else _first_and_end_words(stats)
    if wait >= KEEPS_UP:
        return Diagnosis("the training loop", _nearly_keeping_up(stats, workers, starts))
    words = f"loading keeps up: the training loop waited only {wait:.0%} of the time after each epoch's first batch"
    if not workers:
        return Diagnosis("the training loop", words + starts)
    busy = sum(occupancy(w) for w in workers) / len(workers)
    words += f" (workers idle {1 - busy:.0%} of the time: {OCCUPIED_WORDS[1]}){starts}"
    count = _current_workers(stats)
    if count > 1 and busy <= FEWER_IF_BUSY:
        needed = _ladder(math.ceil(count * busy / HEADROOM))
        if needed < count and not tried_by_auto(stats, needed):
            return Diagnosis("the training loop", f"{words}; num_workers={needed} would keep up too, "
                             "with less memory", {"num_workers": needed})
    return Diagnosis("the training loop", words)


def _nearly_keeping_up(stats: LoaderStats, workers: list[WorkerStats], starts: str = "") -> str:
    words = (f"loading nearly keeps up: the training loop waited {stats.wait_fraction:.0%} of the time "
             "after each epoch's first batch")
    if workers:
        busy = _busiest_kind(workers)
        words += f" and the workers were occupied {busy:.0%} of theirs ({OCCUPIED_WORDS[0]})"
        if busy >= SATURATED and _running_share(workers) >= COMPUTING:
            words += (f" (the {stats.setup.cpus} usable CPUs all in use: a cheaper dataset or more "
                      "CPUs would close the rest)")
    return f"{words}{starts}; nothing else stands out, keep these settings"


def _first_and_end_words(stats: LoaderStats) -> str:
    """The loop's waits for its epochs' first batches and at their ends, where they take
    ``KEEPS_UP`` of the run or more (less would itself read as keeping up): the steady share
    leaves them out, and below the share that names them (``startup.RESTART_SHARE``) the
    verdict said "waited only 3% of the time" of a loop that waited 13% of its run for them (2
    workers started anew each epoch), below the summary's line that gave their seconds."""
    waited = stats.first_wait_s + stats.end_wait_s
    share = waited / stats.elapsed_s if stats.elapsed_s > 0 else 0.0
    if share < KEEPS_UP:
        return ""
    which = ("the first batch and at the end" if stats.epochs <= 1 else
             "the epochs' first batches and at their ends")
    return f"; it waited {waited:.2f} s more for {which}, {share:.0%} of the {stats.elapsed_s:.2f} s run"


def _saturated(stats: LoaderStats, stage: str, stands_out: bool) -> Diagnosis:
    """The workers limit: name their stage if it stands out, else give the split; then what
    more (or other) workers would do."""
    if stats.setup.mode == "economic" and stage == "collate" and stands_out:  # batch workers' stage
        return _more_batch_workers(stats, [w for w in stats.workers if w.kind == "batch"])
    what = stage_words(stats, stage) if stands_out else "that work"
    words = (f"the workers limit loading, in {stage_words(stats, stage)}" if stands_out else
             f"the workers limit loading ({_split(stats)})")
    workers = [w for w in stats.workers if w.kind in ("", "item")]
    count = _current_workers(stats)
    if _taking_turns_on_the_gil(stats, workers):
        return Diagnosis("the workers", f"{words}, and the thread workers ran one CPU's worth between "
                         "them: Python code holds the GIL, one thread at a time; try "
                         "worker_type='process'", {"worker_type": "process"})
    share = _running_share(workers)
    # Waiting counts as I/O only inside the dataset: waits in handing over are back-pressure.
    if share < WAITING and stage == "fetch" and stands_out and not _threads_may_queue_on_the_gil(stats, workers):
        target = _ladder(min(MAX_SUGGESTED_WORKERS, 4 * count, max(count + 1, _wanted(stats, count))))
        waits = (f"{words}, and they mostly wait there (on a CPU or queued for one {share:.0%} of "
                 "their busy time: I/O, sleeps, locks)")
        if target <= count:  # at the most suggested (and "auto"'s cap): never the count it runs
            return Diagnosis("the workers", f"{waits}, with {count} workers already, the most "
                             f"suggested: make {what} wait less (fewer, larger reads), or overlap "
                             "its waits inside the dataset")
        if tried_by_auto(stats, target):
            return Diagnosis("the workers", f"{waits}; num_workers='auto' tried {target} workers and "
                             f"kept {count}: make {what} wait less (fewer, larger reads)")
        auto = " (or 'auto')" if retunable(stats) and not stats.decisions else ""  # not if it is
        return Diagnosis("the workers", f"{waits}: more workers than CPUs help; try "
                         f"num_workers={target}{auto}{_expected_warning(stats, target)}",
                         {"num_workers": target})
    target = _workers_for(stats, count)
    if share < COMPUTING:
        return Diagnosis("the workers", f"{words}; they partly compute, partly wait (on a CPU or "
                         f"queued for one {share:.0%} of their busy time): no setting stands out")
    if target <= count:
        return Diagnosis("the workers", f"{words}, and the {stats.setup.cpus} usable CPUs are all in "
                         f"use: make {what} cheaper, or give the job more CPUs")
    return Diagnosis("the workers", f"{words}; try num_workers={target}", {"num_workers": target})


def _expected_warning(stats: LoaderStats, target: int) -> str:
    """Words for a suggested count above the usable CPUs, which torch's warning (kept, for the
    same arguments) calls excessive: expected here, as the workers mostly wait. Thread workers
    start no process and get no such warning (``arguments.warn_if_too_many_workers``)."""
    if target <= stats.setup.cpus or stats.setup.worker_type == "thread":
        return ""
    return (f" (the DataLoader then warns that {target} workers exceed the suggested "
            f"{stats.setup.cpus}: expected, for workers that mostly wait)")


def _split(stats: LoaderStats) -> str:
    """Where the loading time went, in shares of the three stages (the largest first)."""
    stages = stats.stages
    total = sum(stages[name].seconds for name in STAGES) or 1.0
    ranked = sorted(STAGES, key=lambda name: stages[name].seconds, reverse=True)
    return ", ".join(f"{stage_words(stats, name)} {stages[name].seconds / total:.0%}" for name in ranked
                     if stages[name].seconds / total >= 0.05)


def _with_idle_shards(stats: LoaderStats, verdict: Diagnosis) -> Diagnosis:
    """Add to ``verdict`` that workers of an iterable dataset built nothing: fewer shards than
    workers. As many workers as built batches do the same work (more would only idle too)."""
    workers = [w for w in stats.workers if w.kind == ""]
    idle = [w for w in workers if w.tasks == 0]
    if stats.setup.dataset == "map" or not idle or len(idle) == len(workers) or stats.decisions:
        return verdict
    working = len(workers) - len(idle)
    note = (f"{len(idle)} of the {len(workers)} workers built no batch ({_names(idle)}): the "
            "dataset splits into fewer shards than workers (each worker reads whole shards), "
            f"so num_workers={working} does the same work with less memory")
    suggestions = dict(verdict.suggestions)
    suggestions["num_workers"] = min(working, suggestions.get("num_workers", working))
    return Diagnosis(verdict.bottleneck, f"{verdict.advice}. {note[0].upper()}{note[1:]}", suggestions)


def _names(workers: list[WorkerStats]) -> str:
    ids = [str(w.worker_id) for w in workers]
    return f"worker {ids[0]}" if len(ids) == 1 else f"workers {', '.join(ids[:-1])} and {ids[-1]}"


def retunable(stats: LoaderStats) -> bool:
    """Whether ``num_workers="auto"`` re-tunes this loader: map-style datasets in classic mode."""
    return stats.setup.mode == "classic" and stats.setup.dataset == "map"


def stage_words(stats: LoaderStats, stage: str) -> str:
    """A stage, named as the user knows it (DataPipes and iterable datasets have no
    ``__getitem__``)."""
    if stage == "fetch":
        return {"pipe": "the DataPipe graph", "iterable": "the dataset's `__iter__`"}.get(
            stats.setup.dataset, "the dataset's `__getitem__`")
    if stage == "collate":
        return "`collate_fn`"
    return ("handing items and batches between processes" if stats.setup.mode == "economic"
            else "handing batches over to the main process")


def tried_by_auto(stats: LoaderStats, count: int) -> bool:
    """Whether ``num_workers="auto"`` has run ``count`` workers (the count it runs, its cap, a
    step it went back from): suggesting it would contradict what the tuner measured."""
    return any(decision.num_workers == count for decision in stats.decisions)


def _current_workers(stats: LoaderStats) -> int:
    """The workers running now: the last auto decision's, else the loader's setting."""
    return stats.decisions[-1].num_workers if stats.decisions else stats.setup.num_workers


def _running_share(workers: list[WorkerStats]) -> float:
    """Of the workers' busy time, the share they were on a CPU or queued for one (crowded out
    by other jobs is not waiting on I/O). Workers that finished no task have no busy time:
    their CPU seconds, start-up's, are left out."""
    workers = working(workers)
    busy = sum(w.busy_s for w in workers)
    return min(1.0, sum(w.cpu_s + w.queued_s for w in workers) / busy) if busy > 0 else 1.0


def _taking_turns_on_the_gil(stats: LoaderStats, workers: list[WorkerStats]) -> bool:
    """Thread workers that together ran about one CPU, not crowded out, where their number and
    the CPUs allowed more: they compute in Python, which the GIL serialises."""
    if stats.setup.worker_type != "thread" or len(workers) < 2 or stats.setup.cpus < GIL_MIN_CPUS:
        return False
    alive = max(w.alive_s for w in workers)
    busy = working(workers)
    on_cpu, queued = sum(w.cpu_s for w in busy), sum(w.queued_s for w in busy)
    return alive > 0 and abs(on_cpu / alive - 1) <= GIL_BAND and queued < CROWDED * alive


def _more_batch_workers(stats: LoaderStats, batch_workers: list[WorkerStats]) -> Diagnosis:
    """Economic mode's ``collate_fn`` limits: more batch workers, bounded as classic workers are
    (a loop that waited all the time would otherwise ask for thousands)."""
    count, capacity = len(batch_workers), stats.queue.capacity
    what = stage_words(stats, "collate")
    words = f"the batch workers limit loading, in {what}"
    if _batch_workers_held_back(stats):
        return Diagnosis("the batch workers", f"{words}, and only prefetch_factor={capacity} batches are collated "
                         f"at once: try prefetch_factor={count} (as many batches in memory)",
                         {"prefetch_factor": count})
    share = _running_share(batch_workers)
    if share < WAITING:
        more = _ladder(min(MAX_SUGGESTED_WORKERS, 4 * count, max(count + 1, _wanted(stats, count))))
    elif share >= COMPUTING:
        more = _workers_for(stats, count)
    else:
        return Diagnosis("the batch workers", f"{words}; they partly compute, partly wait: no setting "
                         "stands out")
    if more <= count and share < WAITING:  # they wait, with the most workers suggested already
        return Diagnosis("the batch workers", f"{words}, and they mostly wait there, with {count} "
                         f"batch workers already, the most suggested: make {what} wait less")
    if more <= count:
        return Diagnosis("the batch workers", f"{words}, and the {stats.setup.cpus} usable CPUs are "
                         f"all in use: make {what} cheaper, or give the job more CPUs")
    settings = {"num_batch_workers": more}
    if more > capacity:  # economic mode collates at most prefetch_factor batches at once
        settings["prefetch_factor"] = more
    return Diagnosis("the batch workers", f"{words}; try " + ", ".join(f"{name}={value}" for name, value in settings.items()),
                     settings)


def _batch_workers_held_back(stats: LoaderStats) -> bool:
    """Economic mode has more batch workers than batches it may collate at once
    (``prefetch_factor``): the extra ones can only idle."""
    batch_workers = sum(1 for w in stats.workers if w.kind == "batch")
    return stats.setup.mode == "economic" and 0 < stats.queue.capacity < batch_workers


def _wanted(stats: LoaderStats, count: int) -> int:
    """Workers that would keep up with the loop: ``count / (1 - wait)``."""
    return math.ceil(max(count, 1) / max(1e-9, 1 - stats.wait_fraction))


def _workers_for(stats: LoaderStats, count: int) -> int:
    """As :func:`_wanted`, rounded up the ladder, within the usable CPUs."""
    return max(1, min(stats.setup.cpus, _ladder(_wanted(stats, count))))


def _ladder(count: int) -> int:
    """``count`` rounded up to the next step of ``LADDER`` (beyond it: itself)."""
    return next((step for step in LADDER if step >= count), count)


def _busiest_stage(stats: LoaderStats) -> tuple[str, bool]:
    """The loading stage that took longest, and whether it took ``STANDS_OUT`` times the next."""
    stages = stats.stages
    ranked = sorted(STAGES, key=lambda name: stages[name].seconds, reverse=True)
    first, second = stages[ranked[0]].seconds, stages[ranked[1]].seconds
    return ranked[0], first >= STANDS_OUT * second


def _busiest_kind(workers: list[WorkerStats]) -> float:
    """The mean occupancy of the most occupied kind of worker (economic mode has two kinds)."""
    kinds = {w.kind for w in workers}
    return max(sum(occupancy(w) for w in mine) / len(mine)
               for mine in ([w for w in workers if w.kind == kind] for kind in kinds))


def occupancy(worker: WorkerStats) -> float:
    """The share of its life a worker was not idle: in its stages (busy), or else running or
    queued to run. A worker waiting for its next task is neither; one busy with per-task work
    outside the timed stages (receiving the task, writing the batch's slab) is running: the
    stages alone read 26% to 40% "busy" for workers on a CPU or queued 60% to 70% of their life.
    A worker that finished no task was occupied by none: its time running or queued went on
    starting up (sharding its copy, starting its iterator) and answering epochs' starts, and
    read as the pool at work (8 process workers on 2 CPUs over 4 shards: the 4 with no shard
    ran or queued from a third to all of their short lives)."""
    if worker.alive_s <= 0 or not worker.tasks:
        return 0.0
    return min(1.0, max(worker.busy_s, worker.cpu_s + worker.queued_s) / worker.alive_s)


def _threads_may_queue_on_the_gil(stats: LoaderStats, workers: list[WorkerStats]) -> bool:
    """Thread workers running half a CPU or more between them: what reads as waiting may be
    waiting for the GIL, which more threads would only lengthen."""
    if stats.setup.worker_type != "thread" or not workers:
        return False
    alive = max(w.alive_s for w in workers)
    return alive > 0 and sum(w.cpu_s for w in working(workers)) >= GIL_FREE * alive


def working(workers: list[WorkerStats]) -> list[WorkerStats]:
    """The workers that finished a task (built a batch or a piece, or failed one): those whose
    seconds on a CPU are work, not only their start-up."""
    return [w for w in workers if w.tasks]


def mean_busy(workers: list[WorkerStats]) -> float:
    """The workers' mean busy fraction (0 without workers)."""
    return sum(w.busy_fraction for w in workers) / len(workers) if workers else 0.0
