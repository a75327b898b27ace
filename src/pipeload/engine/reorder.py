"""Bookkeeping for one epoch of pooled loading: who builds which batch, and what may be yielded.

Pure state, no I/O, so its rules can be read (and tested) on their own.
"""

from __future__ import annotations

from pipeload.transport.messages import Report, WorkerReport


class BatchLedger:
    """Assigns batches to workers and hands arrivals back in sampler order.

    Touched only by the thread that drives the epoch.
    Invariants, between calls:
      - ``next_to_yield <= next_to_send``;
      - every batch number in ``[next_to_yield, next_to_send)`` is in exactly one of
        ``building`` (sent, awaited), ``arrived`` (received, not yet yielded) or ``skipped``
        (sent to a worker whose iterable ran dry: it will never come);
      - ``len(building) == sum(in_flight(w) for each worker w)``: a worker's batches in flight
        are those sent to it less those it answered and those skipped when it ran dry
        (``sent_per_worker``, ``answered_per_worker``: counted up, never down, so that the
        answers per worker are there to read: the stats count a worker's tasks from them);
      - ``outstanding`` (sent, not yet yielded or skipped) is what the prefetch budget bounds, so
        batches that arrive early count against it and memory stays bounded behind a slow worker;
      - only workers below ``taking`` are chosen for new batches (the rest, a pool shrinking in
        place, only finish what they hold).
    """

    def __init__(self, num_workers: int, in_order: bool, least_loaded: bool = False,
                 first_batch: int = 0, first_worker: int = 0, prefetch_factor: int | None = None) -> None:
        self.in_order = in_order
        # Round-robin in order mode is torch's rule (iterable workers interleave by it); economic
        # mode's batch workers have no such stream to keep, so they always take the least loaded.
        # Out of order with ``prefetch_factor``, torch's rule too: the next worker in the rotation
        # with room, its share of ``prefetch_factor * num_workers`` among the active ones (a slow
        # worker's queue fills up to it, as torch's does; torch's own test holds that order).
        self.room_rule = prefetch_factor if not in_order and not least_loaded else None
        self.least_loaded = least_loaded or (not in_order and self.room_rule is None)
        # A resumed epoch numbers its batches on from those handed out before the checkpoint,
        # and the round-robin goes on with the worker whose turn it was.
        self.next_to_send = first_batch
        self.next_to_yield = first_batch
        self.building: dict[int, int] = {}  # batch number -> worker id
        self.arrived: dict[int, WorkerReport] = {}
        self.skipped: set[int] = set()
        self.active = [True] * num_workers
        self.sent_per_worker = [0] * num_workers
        self.answered_per_worker = [0] * num_workers
        # Where the engine counts samples (``count_samples``): each batch's samples until it is
        # answered, and the samples each worker has answered, counted up as its tasks are.
        self.samples_of: dict[int, int] | None = None
        self.answered_samples_per_worker = [0] * num_workers
        self._skipped_per_worker = [0] * num_workers
        self.taking = num_workers
        self._rotation = first_worker % num_workers if num_workers else 0

    def resize(self, num_workers: int) -> None:
        """From now on only workers ``0 .. num_workers - 1`` take new batches; new ones start
        active and idle. Workers beyond keep their place until :meth:`forget_from`."""
        grow = num_workers - len(self.active)
        if grow > 0:
            self.active += [True] * grow
        for counts in (self.sent_per_worker, self.answered_per_worker, self._skipped_per_worker,
                       self.answered_samples_per_worker):
            counts += [0] * (num_workers - len(counts))
        self.taking = num_workers
        if self._rotation >= num_workers:  # it shrank: the turn goes back to the first
            self._rotation = 0

    def forget_from(self, first: int) -> None:
        """Drop workers ``first`` and up, which hold nothing (a shrunk pool stopped them). Their
        counts stay: a worker started later in the same slot counts on from them."""
        del self.active[first:]

    def idle_from(self, first: int) -> bool:
        """Whether workers ``first`` and up hold nothing in flight."""
        return not any(self.in_flight(worker_id) for worker_id in range(first, len(self.sent_per_worker)))

    def in_flight(self, worker_id: int) -> int:
        """Batches sent to ``worker_id`` and neither answered nor skipped."""
        return (self.sent_per_worker[worker_id] - self.answered_per_worker[worker_id]
                - self._skipped_per_worker[worker_id])

    @property
    def outstanding(self) -> int:
        return len(self.building) + len(self.arrived)

    def any_active(self) -> bool:
        return any(self.active)

    def choose_worker(self) -> int | None:
        """Next active worker: round-robin in order mode (as torch); out of order, the next in
        the rotation with room (as torch) or, without a ceiling (economic mode's batch workers),
        the least loaded (ties go to the next in the rotation)."""
        count = self.taking
        if not self.least_loaded and self.room_rule is None and self.active[self._rotation]:
            chosen = self._rotation  # the usual case, without building the candidate list
        else:
            candidates = [(self._rotation + step) % count for step in range(count)]
            candidates = [w for w in candidates if self.active[w]]
            if not candidates:
                return None
            chosen = candidates[0]
            if self.room_rule is not None:
                room = self.room_rule * count // len(candidates)
                chosen = next((w for w in candidates if self.in_flight(w) < room),
                              min(candidates, key=self.in_flight))
            elif self.least_loaded:
                chosen = min(candidates, key=self.in_flight)
        self._rotation = (chosen + 1) % count
        return chosen

    def count_samples(self) -> None:
        """Count the samples each worker answers from now on (``record_sent``'s ``samples``)."""
        self.samples_of = {}

    def record_sent(self, worker_id: int, samples: int = 0) -> int:
        """Note that the next batch, of ``samples`` samples (where counted), went to
        ``worker_id``; returns its batch number."""
        number = self.next_to_send
        self.building[number] = worker_id
        if self.samples_of is not None:
            self.samples_of[number] = samples
        self.sent_per_worker[worker_id] += 1
        self.next_to_send += 1
        return number

    def record_report(self, report: WorkerReport) -> None:
        number = report.batch_number
        worker_id = self.building.pop(number, None)
        if worker_id is None:
            return  # a task of a worker already marked dry
        self.answered_per_worker[worker_id] += 1
        if self.samples_of is not None:
            self.answered_samples_per_worker[worker_id] += self.samples_of.pop(number, 0)
        if report.report is Report.EXHAUSTED:
            self._skip(number)
            self._retire(worker_id)
        else:
            self.arrived[number] = report

    def _retire(self, worker_id: int) -> None:
        """A dry worker builds nothing more: what it still owes is skipped, not awaited."""
        self.active[worker_id] = False
        owed = [n for n, w in self.building.items() if w == worker_id]
        for number in owed:
            del self.building[number]
            self._skip(number)
        self._skipped_per_worker[worker_id] += len(owed)

    def _skip(self, number: int) -> None:
        if self.in_order:  # out of order, nothing waits for a number, so nothing need skip it
            self.skipped.add(number)

    def pop_ready(self) -> WorkerReport | None:
        """The report to yield next, if it is here."""
        if not self.in_order:
            if not self.arrived:
                return None
            number = min(self.arrived)
            return self.arrived.pop(number)
        self._skip_past_dry_batches()
        report = self.arrived.pop(self.next_to_yield, None)
        if report is not None:
            self.next_to_yield += 1
        return report

    def _skip_past_dry_batches(self) -> None:
        while self.next_to_yield in self.skipped:
            self.skipped.discard(self.next_to_yield)
            self.next_to_yield += 1

    def nothing_left(self) -> bool:
        """True when every batch sent has been yielded or skipped."""
        return not self.building and not self.arrived
