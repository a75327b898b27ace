"""What ``loader.stats()`` returns: frozen, plain numbers, and a summary in words."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

# Kinds of worker, by what their totals mean: who fetches samples, who hands batches over.
FETCHING_KINDS = ("", "item", "main")
BATCH_KINDS = ("", "batch", "main")
HANDING_OVER_KINDS = ("", "batch")


@dataclass(frozen=True)
class WorkerStats:
    """One worker's totals (summed over the pools it lived in, with non-persistent workers).

    Attributes:
        kind: "" (a classic worker), "item" or "batch" (economic mode), "main" (no workers).
        worker_id: its id among workers of its kind.
        tasks: batches it built (economic item workers: pieces of batches), failed ones included.
        samples: samples it fetched (a batch worker: samples it collated).
        fetch_s: seconds in the dataset.
        collate_s: seconds in ``collate_fn``.
        transfer_s: seconds handing results over (pickling and writing them to the channel).
        bytes_out: bytes of tensor data it handed over (the main process, loading without
            workers: of the batches it made, which workers would hand over).
        alive_s: seconds from its start to its latest report.
        cpu_s: seconds it ran on a CPU meanwhile.
        queued_s: seconds it was ready to run but waited for a CPU (a crowded machine).
    """

    kind: str
    worker_id: int
    tasks: int
    samples: int
    fetch_s: float
    collate_s: float
    transfer_s: float
    bytes_out: int
    alive_s: float
    cpu_s: float = 0.0
    queued_s: float = 0.0

    @property
    def name(self) -> str:
        return f"{self.kind} worker {self.worker_id}".lstrip() if self.kind != "main" else "main process"

    @property
    def busy_s(self) -> float:
        return self.fetch_s + self.collate_s + self.transfer_s

    @property
    def busy_fraction(self) -> float:
        """How much of its life it spent working (the rest: waiting for tasks, starting up)."""
        return min(1.0, self.busy_s / self.alive_s) if self.alive_s > 0 else 0.0

    @property
    def cpu_fraction(self) -> float:
        """How much of its life it used a CPU; well below ``busy_fraction``: it mostly waited."""
        return min(1.0, self.cpu_s / self.alive_s) if self.alive_s > 0 else 0.0

    def plus(self, other: WorkerStats) -> WorkerStats:
        return WorkerStats(self.kind, self.worker_id, self.tasks + other.tasks,
                           self.samples + other.samples, self.fetch_s + other.fetch_s,
                           self.collate_s + other.collate_s, self.transfer_s + other.transfer_s,
                           self.bytes_out + other.bytes_out, self.alive_s + other.alive_s,
                           self.cpu_s + other.cpu_s, self.queued_s + other.queued_s)


@dataclass(frozen=True)
class QueueStats:
    """What the training loop found each time a batch was handed out.

    Attributes:
        mean_ready, max_ready: batches already built and waiting their turn (beyond the one
            handed out); near 0 means the loop usually waited.
        mean_in_flight, max_in_flight: batches sent to workers and not yet handed out (the
            ready ones included; the one handed out not).
        capacity: the most batches the engine may have in flight, the one handed out included
            (``prefetch_factor * num_workers`` in classic mode, ``prefetch_factor`` in economic
            mode; the in-flight budget keeps fewer where fewer keep the loop fed).
    """

    mean_ready: float
    max_ready: int
    mean_in_flight: float
    max_in_flight: int
    capacity: int


@dataclass(frozen=True)
class StageStats:
    """One stage: how often it ran and how long it took in all (summed over workers)."""

    count: int
    seconds: float

    @property
    def mean_s(self) -> float:
        return self.seconds / self.count if self.count else 0.0


@dataclass(frozen=True)
class RayStageStats:
    """The Ray queue boundaries of a graph: what their actors made and what waited for them
    (summed over boundaries, runs and workers).

    Attributes:
        items: items the actors sent.
        actor_s: seconds the actors spent making them (running the upstream pipe).
        transfer_s: seconds from an actor having a chunk ready to the chunk being read (Ray's
            serialisation, the object store, the network; wall clocks of two machines).
        wait_s: seconds the downstream asked for an item that was not there yet.
        restarts: actors restarted after they died.
    """

    items: int = 0
    actor_s: float = 0.0
    transfer_s: float = 0.0
    wait_s: float = 0.0
    restarts: int = 0

    def plus(self, other: RayStageStats) -> RayStageStats:
        return RayStageStats(self.items + other.items, self.actor_s + other.actor_s,
                             self.transfer_s + other.transfer_s, self.wait_s + other.wait_s,
                             self.restarts + other.restarts)

    def minus(self, other: RayStageStats) -> RayStageStats:
        return RayStageStats(self.items - other.items, self.actor_s - other.actor_s,
                             self.transfer_s - other.transfer_s, self.wait_s - other.wait_s,
                             self.restarts - other.restarts)

    def as_tuple(self) -> tuple[float, ...]:
        """As a worker's totals carry it (a plain tuple pickles cheaply)."""
        return (self.items, self.actor_s, self.transfer_s, self.wait_s, self.restarts)

    @classmethod
    def from_tuple(cls, values: tuple[float, ...]) -> RayStageStats:
        return cls(*values) if values else cls()


@dataclass(frozen=True)
class TuningDecision:
    """One decision of ``num_workers="auto"`` / ``prefetch_factor="auto"``.

    Attributes:
        at_batch: batches handed out when it was taken.
        num_workers, prefetch_factor: the settings from then on.
        samples_per_s: the throughput measured just before.
        reason: why, in words.
        settled: the tuner stopped here: nothing changes after it (before, the figures mix
            settings still being tried, and are not judged).
    """

    at_batch: int
    num_workers: int
    prefetch_factor: int
    samples_per_s: float
    reason: str
    settled: bool = False


@dataclass(frozen=True)
class LoaderStats:
    """A loader's stats since it was made, across epochs. ``str()`` gives :meth:`summary`.

    Attributes:
        setup: the loader's mode, worker type, workers, prefetch, batch size, usable CPUs.
        batches: batches handed to the training loop.
        epochs: epochs started.
        wait_s: seconds the training loop spent waiting in ``next()``, each epoch's first batch
            excepted (that is start-up: ``first_wait_s``).
        compute_s: seconds it spent between two ``next()`` calls (its own work).
        first_wait_s: seconds it waited for the first batch of each epoch, summed.
        end_wait_s: seconds it waited in the calls that handed out no batch: each epoch's end
            (with workers that are not persistent, their stopping) and errors.
        first_batch_s: time from ``iter(loader)`` to the first batch, in the latest epoch.
        opening_wait_s: the first epoch's share of ``first_wait_s`` (a persistent pool's one
            start included).
        pin_s, pinned: time spent pinning batches, and how many were pinned.
        workers: per-worker totals.
        queue: ready and in-flight batches seen at each hand-out.
        skipped_samples: samples the dataset's ``on_error="skip"`` (or callable) pipes left out
            (a sample that failed, or one its archive cut short), in every worker's copy, exact.
        skipped_files: files and archives those pipes left out, wholly or from where they broke.
        decisions: what ``num_workers="auto"`` decided, in order.
        ray: what the dataset's Ray queue boundaries measured, in every worker's copy (None
            when it has none); also ``stages["ray"]``.
        separate_processes: where the loader ran the DataPipes that asked for a process of their
            own (``is_separate_process()``), one line each: "Decode: its own process (a process
            boundary after it)".
    """

    setup: Any
    batches: int
    epochs: int
    wait_s: float
    compute_s: float
    first_batch_s: float
    pin_s: float
    pinned: int
    workers: tuple[WorkerStats, ...]
    queue: QueueStats
    skipped_samples: int = 0
    skipped_files: int = 0
    decisions: tuple[TuningDecision, ...] = ()
    first_wait_s: float = 0.0
    end_wait_s: float = 0.0
    separate_processes: tuple[str, ...] = ()
    ray: RayStageStats | None = None
    assembled_batches: int = 0
    """Economic mode: batches the main process put together itself (direct batches)."""
    assembled_samples: int = 0
    """... and the samples they held."""
    opening_wait_s: float = 0.0

    @property
    def elapsed_s(self) -> float:
        """Seconds the training loop spent in epochs: waiting (start-up and ends included) plus
        its own work."""
        return self.first_wait_s + self.wait_s + self.end_wait_s + self.compute_s

    @property
    def wait_fraction(self) -> float:
        """The share of the steady time (after each epoch's first batch) the loop waited."""
        steady = self.wait_s + self.compute_s
        return self.wait_s / steady if steady > 0 else 0.0

    @property
    def batches_per_s(self) -> float:
        return self.batches / self.elapsed_s if self.elapsed_s > 0 else 0.0

    @property
    def samples_per_batch(self) -> float:
        # Batch workers count the samples they collated: exact with their batches, where item
        # workers' last reports of an epoch may never be read (nothing waits for them). Economic
        # mode's main process counts those it assembled itself (with flat samples, every one).
        built = sum(w.tasks for w in self.workers if w.kind in BATCH_KINDS) + self.assembled_batches
        batched = sum(w.samples for w in self.workers if w.kind in BATCH_KINDS) + self.assembled_samples
        return batched / built if built else 0.0

    @property
    def samples_per_s(self) -> float:
        return self.batches_per_s * self.samples_per_batch

    @property
    def bytes_moved(self) -> int:
        """Bytes of tensor data handed from workers to the main process; failed batches moved
        none. In economic mode, those of the batches handed to the loop, at the bytes a sample
        of what the item workers handed over: they write each item into the shared memory the
        main process hands out, in a batch it assembles itself or one a batch worker collated
        from views of those items (whose bytes it would count again). Their own sum counts the
        items of every batch they fetched for: those of failed batches (an item worker cannot
        know that another piece of its batch failed: a run where every other batch failed read
        1.5 times what the loop received), and those of batches built ahead of an epoch left
        early; it misses the pieces whose reports an epoch ended before reading (an item worker
        reports a piece after handing it to its batch worker, which may hand the epoch's last
        batch over first, and nothing waits for the rest).
        Items that hold no tensor (NumPy arrays, images) count nothing there: the tensors reach
        the main process from the batch workers that collated them, so the larger of the two
        sums is taken (with tensor items, the batch workers' sum covers only what they collated
        of the items'; with others, the items' is 0 and 4 MiB of batches read "moved 0 bytes")."""
        if any(w.kind == "item" for w in self.workers):
            items = [w for w in self.workers if w.kind == "item"]
            fetched = sum(w.samples for w in items)
            handed_out = self.samples_per_batch * self.batches
            per_item = sum(w.bytes_out for w in items) / fetched if fetched else 0.0
            collated = sum(w.bytes_out for w in self.workers if w.kind == "batch")
            return max(round(per_item * handed_out), collated)
        return sum(w.bytes_out for w in self.workers if w.kind in HANDING_OVER_KINDS)

    @property
    def stages(self) -> dict[str, StageStats]:
        """fetch, collate, transfer, pin and wait (the training loop's), each summed; and ray
        (items the actors made, seconds they spent) when the dataset has a Ray boundary."""
        def total(attribute: str, kinds: tuple[str, ...]) -> float:
            return sum(getattr(w, attribute) for w in self.workers if w.kind in kinds)

        built = int(sum(w.tasks for w in self.workers if w.kind in BATCH_KINDS))
        handed = int(sum(w.tasks for w in self.workers if w.kind in HANDING_OVER_KINDS + ("item",)))
        stages = {
            "fetch": StageStats(int(total("samples", FETCHING_KINDS)), total("fetch_s", FETCHING_KINDS)),
            "collate": StageStats(built, total("collate_s", BATCH_KINDS)),
            "transfer": StageStats(handed, total("transfer_s", HANDING_OVER_KINDS + ("item",))),
            "pin": StageStats(self.pinned, self.pin_s),
            "wait": StageStats(self.batches, self.first_wait_s + self.wait_s + self.end_wait_s),
        }
        if self.ray is not None:
            stages["ray"] = StageStats(int(self.ray.items), self.ray.actor_s)
        return stages

    def summary(self) -> str:
        """A few lines in words: throughput, where the time goes, the bottleneck, what to try."""
        from pipeload.stats.summary import summarise  # the words live apart, beside their rules

        return summarise(self)

    def suggested_settings(self) -> dict[str, Any]:
        """DataLoader arguments worth trying, e.g. ``{"num_workers": 6}`` (empty: keep them)."""
        from pipeload.stats.analysis import diagnose

        return dict(diagnose(self).suggestions)

    def __str__(self) -> str:
        return self.summary()
