"""Beginning an interrupted epoch again, and going on from where it was.

The loader begins the epoch as it began the first time, under the generator states the record
kept (torch's global generator is borrowed for that moment and given back, so the training
loop's own stream is untouched): the same base seed and DataPipe seeds are drawn, the sampler
draws the same order. Then:

- map-style datasets skip the keys of the batches already handed out, without loading them, and
  the engine numbers the remaining batches on from there (per-batch and economic seeds follow);
- iterable datasets: each replica starts from its latest snapshot (its ``state_dict()``, taken
  every few batches) and makes again, and drops, the batches it had made since; a replica without
  a state starts over and drops all it had made (with a warning). The round-robin goes on with
  the worker whose turn it was.
"""

from __future__ import annotations

import contextlib
import dataclasses
import itertools
import warnings
from collections.abc import Callable, Iterator
from typing import Any

import torch.utils.data as torch_data

from pipeload._optional import optional_attribute
from pipeload._rng_state import borrowed_global_rng
from pipeload._state_fields import is_int
from pipeload._user_frame import first_frame_outside_pipeload
from pipeload.engine.fetch import StreamPosition
from pipeload.engine.plan import EpochStart
from pipeload.errors import IncompatibleStateError
from pipeload.resume.epoch import EpochProgress
from pipeload.resume.state import ResumePoint
from pipeload.samplers import BatchSampler, DistributedSampler, exact_length
from pipeload.samplers._own_generators import epochs_moved_on, move_epochs_on
from pipeload.samplers._state import StatefulSampler

_END = object()


def epoch_start_draws(point: ResumePoint | None) -> contextlib.AbstractContextManager[None]:
    """The context in which an epoch's first draws are made: the recorded global generator
    when an interrupted epoch is begun again, else the global generator as it is."""
    if point is None or point.record is None:
        return contextlib.nullcontext()
    return borrowed_global_rng(point.record.global_rng)


def unless_sampler_moved_on(loader: Any, point: ResumePoint | None) -> ResumePoint | None:
    """``point``, or None when the loader's sampler was moved to another epoch since the state
    was loaded (``set_epoch``): the batches the state counts belong to the loaded epoch's order,
    and skipping as many of another epoch's would lose them. That epoch then begins whole."""
    if point is None or point.record is None:
        return point
    why = _moved_on_because(loader, point)
    if why is None or _handed_out_whole(loader, point):
        return point  # an epoch handed out whole is run empty all the same: loaded_epoch_is_over
    warnings.warn(
        f"{why}, taken {point.consumed} batches into that epoch: this iteration begins the new "
        "epoch from its start, and what was left of the loaded epoch is not resumed (call "
        "set_epoch with the loaded epoch before iterating to resume it)",
        stacklevel=first_frame_outside_pipeload(),
    )
    return _session_goes_on(loader, point)


def _session_goes_on(loader: Any, point: ResumePoint) -> ResumePoint | None:
    """Where a loaded epoch is left for a new one: persistent workers go on with the loaded
    session's next epoch, as the run's would have (a new session drew another base seed, and
    every augmentation differed: a user's sampler with ``set_epoch``, whose epoch's end cannot be
    told from a count, stop 54's review). None: the new epoch begins as any other."""
    record = point.record
    if record is None or not (loader.persistent_workers and loader.num_workers > 0):
        return None
    return ResumePoint(None, session=(record.base_seed, record.session_epoch + 1))


def loaded_epoch_is_over(loader: Any, point: ResumePoint | None) -> bool:
    """Whether ``point`` resumes a map-style epoch that had handed out all its batches (a state
    saved after its last batch, before its end was seen), so that the next epoch should begin.
    The loaded epoch is run to its end first, empty, even when ``set_epoch`` has moved the
    sampler on since (the usual loop: ``sampler.set_epoch(epoch)``, then ``iter(loader)``): its
    draws from the loader's generator and its persistent workers' session are the ones the next
    epoch follows; begun without them, that epoch drew the loaded one's base seed again, or a
    new session's, and its augmentations differed from the uninterrupted run's. A
    ``DistributedSampler`` still at the loaded epoch is moved on to the next by
    :func:`move_loaded_epochs_on` (Lightning sets the next epoch only once that epoch's iterator
    is made: with the loaded epoch's empty rest, it lost a whole epoch)."""
    if point is None or point.record is None or loader._dataset_kind.label != "map":
        return False
    return _handed_out_whole(loader, point)


def move_loaded_epochs_on(loader: Any, point: ResumePoint | None) -> None:
    """After a loaded epoch found over: a sampler whose epoch decides its order, still at the
    loaded epoch (set by the state), goes to the next, as the loop that saved it would have set
    it, so that the next epoch draws its own order, not the loaded one's again."""
    sampler, saved = _loaded_sampler_state(loader, point)
    if not isinstance(saved, dict):
        return
    if isinstance(sampler, DistributedSampler):  # ours: its own state holds its epoch
        epoch = saved.get("epoch")
        if is_int(epoch) and sampler.epoch == epoch:
            sampler.set_epoch(epoch + 1)
        return
    epochs = saved.get("epochs")
    if isinstance(epochs, dict):
        move_epochs_on(sampler, epochs)


def _loaded_sampler_state(loader: Any, point: ResumePoint | None) -> tuple[Any, Any]:
    """The sampler that draws the keys (the index sampler, or the one inside pipeload's
    BatchSampler) and its state as the loaded epoch began."""
    if point is None or point.record is None or not isinstance(point.record.sampler, dict):
        return None, None
    sampler, saved = loader._index_sampler, point.record.sampler
    inner = optional_attribute(sampler, "sampler")
    if isinstance(sampler, StatefulSampler) and inner is not None:
        sampler, saved = inner, saved.get("sampler")
    return sampler, saved


def _loaded_epochs(loader: Any, point: ResumePoint | None) -> tuple[Any, dict[str, int]]:
    """The sampler without a state of its own whose epochs the loaded state set, and those
    epochs by place (none: an empty dict)."""
    sampler, saved = _loaded_sampler_state(loader, point)
    epochs = saved.get("epochs") if isinstance(saved, dict) else None
    return (sampler, epochs) if isinstance(epochs, dict) else (None, {})


def _handed_out_whole(loader: Any, point: ResumePoint) -> bool:
    """Whether the loaded map-style epoch had handed out every batch, in order."""
    if point.handed_out_above or point.repeat_from is not None or point.padded:
        return False  # batches handed out out of order, or made again: not a plain count
    total = _epoch_length(loader._index_sampler)
    return total is not None and point.consumed == total


def _epoch_length(sampler: Any) -> int | None:
    """The batches (or keys) of an epoch, where the sampler's length is exactly what it yields:
    torch's and our samplers, and subclasses of torch's ``DistributedSampler`` (Lightning's
    ``DistributedSamplerWrapper``), whose iteration holds ``num_samples`` keys, its length."""
    total = exact_length(sampler)
    if total is not None:
        return total
    batched = type(sampler) in (BatchSampler, torch_data.BatchSampler)
    keys = optional_attribute(sampler, "sampler") if batched else sampler
    return len(sampler) if isinstance(keys, torch_data.DistributedSampler) else None


def _moved_on_because(loader: Any, point: ResumePoint) -> str | None:
    """Why the loaded epoch's order is no longer the sampler's: pipeload's samplers say; for one
    without a state, its epoch moved from the one the state set."""
    ask = getattr(loader._index_sampler, "_replay_abandoned_because", None)
    why = ask() if callable(ask) else None
    if why is not None:
        return why
    sampler, epochs = _loaded_epochs(loader, point)
    return epochs_moved_on(sampler, epochs) if epochs else None


def position_tasks(loader: Any, tasks: Iterator[Any], point: ResumePoint | None) -> tuple[Iterator[Any], EpochStart]:
    """Where an epoch begins: a resumed map-style epoch skips the keys already handed out, an
    iterable one goes on with the worker whose turn it was. With ``equal_batches``, a sampler
    whose length is exact says how many batches the epoch has, so the ranks agree once."""
    if loader._dataset_kind.label == "iterable":
        return tasks, stream_start(point, loader.num_workers)
    keys_of = len if loader._auto_collation else (lambda _task: 1)
    tasks, start = skip_handed_out(tasks, point, keys_of, _sampler_name(loader))
    if loader.equal_batches is not None:
        start = dataclasses.replace(start, epoch_batches=exact_length(loader._index_sampler))
    return tasks, start


def skip_handed_out(tasks: Iterator[Any], point: ResumePoint | None, keys_of: Callable[[Any], int],
                    sampler_name: str = "the sampler") -> tuple[Iterator[Any], EpochStart]:
    """Map-style: drop the tasks of the batches handed out before the checkpoint.

    The first remaining task is taken here too if the interrupted epoch had taken it: samplers
    draw from the global generator when their first key is asked for, which must then happen
    while it is borrowed (and otherwise after, from the user's generator, as it would have).

    Raises:
        IncompatibleStateError: the sampler, begun again, gave fewer tasks than were handed out.
    """
    if point is None or point.record is None:
        return tasks, EpochStart()
    skip, _, _, remake = point.engine_view()
    skipped_keys = 0
    for skipped in range(skip):
        task = next(tasks, _END)
        if task is _END:
            raise _ran_out(skip, skipped, sampler_name)
        skipped_keys += keys_of(task)
    handed_out = point.handed_out_above
    steps_done = point.consumed + len(handed_out) + point.padded
    if not point.sampler_started:
        return tasks, EpochStart(remake=remake, handed_out=handed_out, steps_done=steps_done)
    first = next(tasks, _END)
    rest = tasks if first is _END else itertools.chain([first], tasks)
    return rest, EpochStart(first_batch=skip, first_position=skipped_keys, remake=remake,
                            handed_out=handed_out, steps_done=steps_done)


def resumed_streams(point: ResumePoint | None) -> dict[int, StreamPosition] | None:
    """Iterable datasets: where each replica resumes (None: from the start of the epoch)."""
    if point is None or point.record is None:
        return None
    return point.engine_view()[1]


def progress_from(point: ResumePoint | None, iterable: bool = False) -> EpochProgress:
    """A new epoch's progress: from zero, or where a resumed epoch stood (so a checkpoint
    taken after resuming says where the whole epoch stands). ``iterable``: its batches come
    from iterable replicas."""
    if point is None or point.record is None:
        return EpochProgress(iterable=iterable)
    return EpochProgress(point.consumed, dict(point.streams or {}), point.last_worker, point.padded,
                         point.repeat_from, set(point.handed_out_above),
                         sampler_started=point.sampler_started, iterable=iterable)


def stream_start(point: ResumePoint | None, num_workers: int) -> EpochStart:
    """Iterable datasets: whose turn comes first."""
    if point is None or point.record is None:
        return EpochStart()
    _, _, last_worker, remake = point.engine_view()
    first = 0 if last_worker is None else last_worker + 1
    return EpochStart(first_worker=first % max(num_workers, 1), remake=remake)


def _sampler_name(loader: Any) -> str:
    """The index sampler's class, and the sampler's inside a batch sampler (the user's, often)."""
    name = type(loader._index_sampler).__name__
    inner = getattr(loader._index_sampler, "sampler", None)
    if loader.batch_sampler is None or inner is None:
        return name
    return f"{name} over {type(inner).__name__}"


def _ran_out(handed_out: int, given: int, sampler_name: str) -> IncompatibleStateError:
    # Skipping on would resume past the end: the rest of the epoch would be lost, silently.
    return IncompatibleStateError(
        f"cannot resume this epoch: the state says {handed_out} batches of it were handed out, but "
        f"{sampler_name} gave {given} when the epoch was begun again from the state. A sampler's "
        "load_state_dict() must make its next iteration the one its state_dict() was taken "
        "before (pipeload skips what was handed out itself); a state that is how far an "
        "iteration got (as torchdata's samplers keep) cannot be resumed this way")
