"""Workers started anew each epoch: when their start and stop take a large share of the time.

A loader without ``persistent_workers`` starts its workers at each ``iter()`` and stops them at
each epoch's end. The loop waits through both: the start before the epoch's first batch
(``first_wait_s``), the stop in the call that ends the epoch (``end_wait_s``). A persistent
pool pays the start once, and a later epoch's first batch then takes about one batch's work.
So what persistence would save per epoch is the first batch's wait beyond one batch's work in
the workers, plus the end's wait. Where that is ``RESTART_SHARE`` of the time or more, the
verdict says so, with the figures, and suggests ``persistent_workers=True``.

A loop can wait for its epochs' first batches with workers that live on too: an epoch of a few
batches (a handful of shards, each worker building its first batch from scratch) starts with
its pipeline empty every time. Where those waits, after the first epoch's, take
``RESTART_SHARE`` of the time after it, the verdict says so with the figures
(:func:`first_batches`): the steady verdict leaves first batches out, and "keeps up" alone
read as the whole run.

Judged on its own evidence, before the steady verdict's: at least ``MIN_EPOCHS`` epochs (a
persistent pool pays the first start too), ``MIN_STEADY_BATCHES`` batches after their first,
and ``MIN_ELAPSED_S`` in all. The steady verdict's seconds leave the start-ups out, and a loader
whose epochs are mostly start-up may never gather them: its slow starts were never judged, and
a run that did gather them was told to keep its settings while persistent workers doubled its
throughput.
"""

from __future__ import annotations

from dataclasses import dataclass

from pipeload.stats.report import LoaderStats

# The share of the loop's time that starting and stopping workers must take to be named: a
# loop that spends a quarter of its time on them gains at least 1.33x from persistent workers
# (the same margin as analysis.LIMITS, for the same reason: noise must not flip the verdict).
RESTART_SHARE = 0.25
MIN_EPOCHS = 2
MIN_STEADY_BATCHES = 50
MIN_ELAPSED_S = 2.0


@dataclass(frozen=True)
class Restarts:
    """Per epoch, on average: seconds spent starting and stopping workers beyond what a
    persistent pool's later epoch spends (``restart_s``), of the epoch's ``epoch_s``; and one
    batch's work in the workers, what a persistent pool's first batch still takes
    (``batch_work_s``)."""

    restart_s: float
    epoch_s: float
    batch_work_s: float

    @property
    def share(self) -> float:
        return self.restart_s / self.epoch_s if self.epoch_s > 0 else 0.0


def restarts(stats: LoaderStats, factor: float = 1.0) -> Restarts | None:
    """What starting workers anew each epoch costs, when it is worth naming (None otherwise:
    persistent or no workers, less than ``factor`` times the evidence it needs, or a small
    share)."""
    if stats.setup.persistent_workers or not _has_workers(stats) or not _enough_evidence(stats, factor):
        return None
    workers = [w for w in stats.workers if w.kind != "main"]
    batch_work_s = sum(w.busy_s for w in workers) / stats.batches
    epochs = stats.epochs
    start_s = max(0.0, stats.first_wait_s / epochs - batch_work_s)
    found = Restarts(start_s + stats.end_wait_s / epochs, stats.elapsed_s / epochs, batch_work_s)
    return found if found.share >= RESTART_SHARE else None


def _has_workers(stats: LoaderStats) -> bool:
    running = stats.decisions[-1].num_workers if stats.decisions else stats.setup.num_workers
    return running > 0 and any(w.kind != "main" for w in stats.workers)


def _enough_evidence(stats: LoaderStats, factor: float) -> bool:
    steady_batches = stats.batches - stats.epochs
    return (stats.epochs >= factor * MIN_EPOCHS and steady_batches >= factor * MIN_STEADY_BATCHES
            and stats.elapsed_s >= factor * MIN_ELAPSED_S)


def restart_words(found: Restarts, advice: str = "try persistent_workers=True, which starts them once") -> str:
    """The verdict's sentence, with its figures, ending with ``advice``."""
    return (f"the workers start anew each epoch (persistent_workers=False): {found.restart_s:.2f} s "
            f"of each epoch's {found.epoch_s:.2f} s ({found.share:.0%}) went on starting them before "
            f"the first batch, beyond a batch's own {found.batch_work_s * 1e3:,.1f} ms of work, and "
            f"stopping them at the end; {advice}")


@dataclass(frozen=True)
class FirstBatches:
    """After the first epoch: the loop's waits for its ``epochs`` epochs' first batches
    (``wait_s`` in all), of the ``elapsed_s`` those epochs took, over ``batches`` batches."""

    wait_s: float
    elapsed_s: float
    epochs: int
    batches: int

    @property
    def share(self) -> float:
        return self.wait_s / self.elapsed_s if self.elapsed_s > 0 else 0.0


def first_batches(stats: LoaderStats) -> FirstBatches | None:
    """The later epochs' waits for their first batches, when they take a large share of the
    time (None otherwise, without workers, or on less evidence than :func:`restarts` needs, over
    ``MIN_EPOCHS`` later epochs). Without workers every batch is loaded while the loop waits,
    its first no more than the others: the steady verdict says it."""
    if not _has_workers(stats) or not _enough_evidence(stats, 1.0):
        return None
    later = stats.epochs - 1
    found = FirstBatches(max(0.0, stats.first_wait_s - stats.opening_wait_s),
                         max(0.0, stats.elapsed_s - stats.opening_wait_s), later,
                         # the first epoch's batches: at least its first; the epochs alike
                         round(stats.batches * later / stats.epochs) if stats.epochs else 0)
    if later < MIN_EPOCHS or found.elapsed_s < MIN_ELAPSED_S or found.share < RESTART_SHARE:
        return None
    return found


def first_batch_words(found: FirstBatches) -> str:
    """The verdict's sentence, with its figures."""
    return (f"each epoch's first batch kept the training loop waiting: {found.wait_s:.2f} s of "
            f"{found.elapsed_s:.2f} s ({found.share:.0%}) after the first epoch, "
            f"{found.wait_s / found.epochs * 1e3:,.0f} ms an epoch; with "
            f"{_count(found.batches / found.epochs)} batches an epoch, every epoch starts with nothing "
            "in flight and waits for its workers' first batches (the steady figures leave these "
            "waits out); longer epochs would spread them over more batches")


def _count(value: float) -> str:
    """``value`` as a count: whole where it is, else to one decimal."""
    return f"{value:,.0f}" if abs(value - round(value)) < 0.05 else f"{value:,.1f}"
