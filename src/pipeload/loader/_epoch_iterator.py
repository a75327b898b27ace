"""One epoch over a DataLoader: the iterator ``iter(loader)`` returns.

It owns the epoch's engine (or borrows the loader's, with ``persistent_workers=True``), hands
batches out, notes each in the epoch's progress (what checkpoints read), and stops the engine
when the epoch ends, is dropped, or is interrupted.
"""

from __future__ import annotations

import math
import threading
import warnings
import weakref
from typing import Any

from pipeload._user_frame import first_frame_outside_pipeload
from pipeload import resume
from pipeload.engine import replica
from pipeload.engine.equal_batches import EqualBatches
from pipeload._interrupts import ctrl_c_kept
from pipeload.engine.lifecycle import REAPED_WITHIN_S, wait_for_reaped
from pipeload.engine.pin_stage import InlinePinning, ThreadedPinning
from pipeload.engine.plan import DatasetKind
from pipeload.samplers import exact_length
from pipeload.stats.clock import now, profiling, span
from pipeload.stats.recorder import EpochCount


class _BoundarySlabsGoIfLeftAfterAnError:
    """Run as an epoch's iterator goes: if the epoch was left after an error for one of its
    batches (a loop that did not catch it), the slabs the process boundaries of the loader's graph
    keep between runs are released, as a failed epoch releases the loader's own: the error may
    keep the graph alive for as long as it is kept (a step after a boundary raised: the
    boundary's run ended as any run does, and kept its slabs for the next). An epoch that went on
    to its end after caught errors keeps them for the next run, as any epoch does."""

    def __init__(self, dataset: Any) -> None:
        self.dataset = dataset
        self.raised = False  # an error was raised since the epoch began, and it has not ended since

    def __call__(self) -> None:
        if self.raised:
            replica.release_boundary_slabs(self.dataset)


class _EpochIterator:
    """One epoch over a loader. Owns its engine unless the loader keeps workers persistent.

    Closing it (at the end, or when it is dropped) stops an owned engine at once. An error
    raised for one batch leaves the epoch running, as in torch: catch it, call ``next`` again,
    and the other batches keep coming. The engine itself closes on what ends an epoch (a dead
    worker, a broken channel); Ctrl-C (anything that is not an ``Exception``) closes it here.
    """

    def __init__(self, loader: Any, engine: Any, owns_engine: bool,
                 progress: resume.EpochProgress, count: EpochCount | None = None) -> None:
        self._engine = engine
        self._owns_engine = owns_engine
        # A borrowed (persistent) engine lives as long as its loader: hold the loader, or
        # `for b in DataLoader(..., persistent_workers=True)` would close it under our feet.
        self._loader = None if owns_engine else loader
        self._finalizer = weakref.finalize(self, engine.close) if owns_engine else None
        self._epoch_clock: weakref.finalize | None = None
        self._left_after_an_error = _BoundarySlabsGoIfLeftAfterAnError(loader.dataset)
        weakref.finalize(self, ctrl_c_kept(self._left_after_an_error)).atexit = False
        self._start_next_epoch(loader, progress, count)

    def _start_next_epoch(self, loader: Any, progress: resume.EpochProgress,
                          count: EpochCount | None = None) -> None:
        """Take up the loader's new epoch: at first, and in each later epoch of a persistent
        session (the one iterator torch hands out again). An epoch still running is left."""
        self._stop_epoch_clock()
        self._progress = progress
        self._index_sampler = loader._index_sampler
        self._len_reported = loader._len_reported
        self._is_iterable = loader._dataset_kind is DatasetKind.ITERABLE
        self._num_workers = loader.num_workers
        self._dataset = loader.dataset
        self._failures = loader._failure_board
        self._slab_keeper = loader._slab_keeper  # the loader's slabs, released by a failed epoch
        self._left_after_an_error.raised = False
        self._ended = False
        # Batches handed out, and when the stats time the next (never, with stats off).
        self._count = count if count is not None else EpochCount()
        self._stats = loader._stats.consumer if loader._stats is not None else None
        # From this many batches on, each call is timed in case it ends the epoch: the wait for
        # the end (a stream running dry, workers stopping) is the loop's, timed or not.
        self._ending_from = _batches_expected(loader) if self._stats is not None else math.inf
        # The stats' wall clock of this epoch stops at its end, or when the iterator goes (a
        # `for` loop left by `break` drops it at once): see stats/recorder.py, _Consumer.
        self._epoch_clock = (weakref.finalize(self, ctrl_c_kept(self._stats.epoch_ended), self._count)
                             if self._stats is not None else None)

    def __iter__(self) -> _EpochIterator:
        return self

    def __next__(self) -> Any:
        count = self._count
        asked = ending = 0.0
        if count.handed >= count.next_timed:  # one batch in several is timed: stats/recorder.py
            asked = self._stats.asking()  # times the wait for data (holds no engine)
        elif count.handed >= self._ending_from:
            ending = now()
        try:
            if profiling():  # a span as torch's loader records for its __next__
                with span("pipeload.DataLoader.__next__"):
                    batch = self._engine.next_batch()
            else:
                batch = self._engine.next_batch()
        except StopIteration:
            self._progress.ended = True
            self._left_after_an_error.raised = False  # the epoch ran to its end: its runs too
            # The loop also waits for the end itself and for the workers to stop (not
            # persistent ones): timed always, from the ask when it was timed or expected to end
            # the epoch, else from here (once an epoch: no batch pays).
            closing = (ending or now()) if self._stats is not None else 0.0
            self._finish()
            if self._stats is not None:
                self._stats.ended(asked or closing)
                self._epoch_clock()  # after the workers have stopped: the loop waited for that
            failed = self._failed_epoch()
            if failed is not None:
                # As after any failure (slab_keeper.py): the error may keep the loader, and with
                # it the slabs, alive for as long as it is kept.
                self._slab_keeper.release()
                replica.release_boundary_slabs(self._dataset)
                raise failed from None
            raise
        except Exception as error:
            self._progress.failed(error)
            self._left_after_an_error.raised = True
            if self._stats is not None:
                self._stats.ended(asked)
            # The error's traceback keeps this frame: without `self` in it, an uncaught error
            # (one that unwinds the caller's `for` loop) still lets the iterator go, and its
            # workers with it, however long the error itself is kept.
            del self, error
            raise
        except BaseException:
            self._engine.close()  # Ctrl-C ends the epoch: no half-alive workers
            if self._loader is not None:  # the loader's persistent session, cut short
                self._loader._interrupted_session = self._loader._session
            self._stop_epoch_clock()
            del self
            raise
        if asked:
            self._stats.handed(asked)
        batch = self._progress.handed_out(batch)
        count.handed += 1
        if self._is_iterable and self._len_reported is not None and count.handed > self._len_reported:
            _warn_length_exceeded(self._dataset, self._len_reported, count.handed, self._num_workers)
        return batch

    def __len__(self) -> int:
        return len(self._index_sampler)

    def _failed_epoch(self) -> Exception | None:
        """The error an epoch that ended normally is to raise after all, judged by the failure
        board: a budget crossed, or every file failed (datapipes/sources/on_error.py)."""
        if self._failures is None:
            return None
        from pipeload.datapipes.sources.on_error import epoch_end_error  # has a board: imported

        return epoch_end_error(self._failures, self._count.handed)

    @property
    def _num_yielded(self) -> int:
        """Batches handed out this epoch (torch's attribute; checkpointing helpers read it)."""
        return self._count.handed

    @property
    def _workers(self) -> list[Any]:
        """The engine's worker handles (torch's attribute). After an epoch without persistent
        workers, once they are reaped: torch's are joined at ``StopIteration``, and code written
        for it reads them there (``exitcode`` 0, not alive); ours are reaped beside the loop
        (``reap_in_background``), so looking at them waits for that, a few milliseconds."""
        if self._ended and self._owns_engine:
            wait_for_reaped(REAPED_WITHIN_S)
        return self._engine.workers

    @property
    def _pin_memory(self) -> bool:
        """Whether batches are pinned (torch's attribute: False without an accelerator)."""
        return isinstance(self._pin_stage, (InlinePinning, ThreadedPinning))

    @property
    def _pin_memory_thread(self) -> threading.Thread:
        """The thread that pins batches, as in torch: only with workers and an accelerator."""
        stage = self._pin_stage
        thread = stage.thread if isinstance(stage, ThreadedPinning) else None
        if thread is None:
            raise AttributeError(f"'{type(self).__name__}' object has no attribute '_pin_memory_thread'")
        return thread

    @property
    def _pin_stage(self) -> Any:
        engine = self._engine
        return engine.inner if isinstance(engine, EqualBatches) else engine

    def close(self) -> None:
        """Stop the workers now (persistent workers belong to the loader and stay); the epoch
        is over."""
        if self._finalizer is not None:
            self._finalizer()
        self._stop_epoch_clock()

    def _stop_epoch_clock(self) -> None:
        if self._epoch_clock is not None:
            self._epoch_clock()

    def _finish(self) -> None:
        self._ended = True
        if self._owns_engine and self._finalizer is not None:
            self._finalizer()  # not close(): the stats' clock stops once the loop is told

    def _adopt_engine(self) -> None:
        """The loader let go of its persistent workers mid-epoch: this epoch stops them when it
        ends (or is dropped), as torch's workers stop with the iterator that held them."""
        self._owns_engine = True
        self._loader = None
        self._finalizer = weakref.finalize(self, self._engine.close)
        if self._ended:
            self.close()

    def __getstate__(self) -> Any:
        raise NotImplementedError(f"{type(self).__name__} cannot be pickled")



def _batches_expected(loader: Any) -> float:
    """The batches an epoch of ``loader`` hands out, where its length says (inf: unknown). An
    iterable dataset's only if the user asked the loader's length (a progress bar does): asking
    it here could list a whole store in the main process."""
    if loader._dataset_kind is DatasetKind.ITERABLE:
        samples = loader._len_reported  # len(dataset), when len(loader) asked it
        if samples is None:
            return math.inf
        if loader.batch_size is None:
            return samples
        return samples // loader.batch_size if loader.drop_last else math.ceil(samples / loader.batch_size)
    # Only a sampler known to tell its length exactly: torch never asks a user's sampler for it
    # while iterating, and one may raise there (a stream of unknown length).
    batches = exact_length(loader._index_sampler)
    return math.inf if batches is None else batches


def _warn_length_exceeded(dataset: Any, reported: int, yielded: int, num_workers: int) -> None:
    # torch's sentence, its missing space before "(when" included.
    message = (
        f"Length of IterableDataset {dataset} was reported to be {reported}(when accessing "
        f"len(dataloader)), but {yielded} samples have been fetched. "
    )
    if num_workers > 0:
        message += (
            "For multiprocessing data-loading, this could be caused by not properly configuring "
            "the IterableDataset replica at each worker. Please see "
            "https://pytorch.org/docs/stable/data.html#torch.utils.data.IterableDataset for "
            "examples. (pipeload: with several workers, each worker's replica must yield only "
            "its share: see get_worker_info().)"
        )
    warnings.warn(message, stacklevel=first_frame_outside_pipeload())
