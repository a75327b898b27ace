"""Checkpoint and resume: ``DataLoader.state_dict()`` / ``load_state_dict()``.

- ``epoch.py``: what the loader notes when an epoch begins and as it hands batches out;
- ``state.py``: the JSON checkpoint built from those notes, and reading one back (with the
  checks that refuse a state from another configuration);
- ``checked.py``: a state read field by field, every field checked (and its digest) before
  anything is set from it; ``trial.py``: a digest-less (version 1) state's replica states tried
  through the pipes' own ``load_state_dict()`` on a copy of the graph;
- ``replay.py``: beginning an interrupted epoch again and going on from where it was;
- ``handed_out.py``: dropping, right after the engine, the batches an out-of-order epoch had
  handed out past its watermark (made again on resume).

The engines know nothing of checkpoints: they are given an :class:`~pipeload.engine.plan.EpochStart`
(where numbering begins), a session's base seed and first epoch, and for iterable datasets each
replica's position. See docs/design/resume.md.
"""

from pipeload.resume.epoch import (
    STREAM_SNAPSHOT_EVERY, EpochProgress, EpochRecord, begin_epoch, record_sampler_state,
    recorded_at_first_draw,
)
from pipeload.resume.handed_out import DropHandedOut
from pipeload.resume.replay import (
    epoch_start_draws,
    loaded_epoch_is_over,
    move_loaded_epochs_on,
    position_tasks,
    progress_from,
    resumed_streams,
    skip_handed_out,
    stream_start,
    unless_sampler_moved_on,
)
from pipeload.resume.state import (
    ResumePoint, build_state, check_can_checkpoint, generators_as_loaded, read_state,
    set_generators_as_loaded,
)

__all__ = [
    "STREAM_SNAPSHOT_EVERY",
    "DropHandedOut",
    "EpochProgress",
    "EpochRecord",
    "ResumePoint",
    "begin_epoch",
    "build_state",
    "check_can_checkpoint",
    "epoch_start_draws",
    "generators_as_loaded",
    "loaded_epoch_is_over",
    "move_loaded_epochs_on",
    "position_tasks",
    "progress_from",
    "read_state",
    "record_sampler_state",
    "recorded_at_first_draw",
    "resumed_streams",
    "set_generators_as_loaded",
    "skip_handed_out",
    "stream_start",
    "unless_sampler_moved_on",
]
