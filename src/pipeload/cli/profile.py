"""``pipeload profile MODULE:FACTORY``: load batches of your data and say what limits it.

``FACTORY`` is a callable in an importable module (the current directory is on the path) that
returns a dataset (map-style or iterable) or a DataLoader. A dataset gets a pipeload DataLoader
with the command's options; a pipeload DataLoader is used as it is; torch's DataLoader is rebuilt
as pipeload's with its dataset, sampler or batch sampler, batch size, drop_last, collate_fn,
workers and every other setting it was made with (the flags for a dataset are then left aside,
and said so). By default it loads (epoch after epoch) until the stats have twice what a verdict needs
(``stats.analysis.MIN_STEADY_BATCHES`` batches and ``MIN_STEADY_S`` seconds), at most
``--max-seconds``; ``--batches`` sets the count instead. ``--step-ms`` of pretend training runs
between batches. Then the loader's stats summary is printed, with the settings worth trying.
"""

from __future__ import annotations

import importlib
import os
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch.utils.data as torch_data

import pipeload
from pipeload.stats.analysis import evidence_shortfall, steady, still_tuning
from pipeload.stats.startup import restarts


class CommandError(Exception):
    """A problem with what the user asked for: printed as one line, exit status ``status``."""

    def __init__(self, message: str, status: int = 2) -> None:
        super().__init__(message)
        self.status = status


# What a torch DataLoader keeps as attributes of the same name as its arguments, besides the
# dataset, batching and sampling ones: carried over to the pipeload loader it is rebuilt as.
_TORCH_SETTINGS = ("pin_memory", "timeout", "worker_init_fn", "multiprocessing_context", "generator",
                   "prefetch_factor", "persistent_workers", "pin_memory_device", "in_order")

# Load until the stats hold this many times what a verdict needs (analysis.evidence_shortfall).
EVIDENCE_MARGIN = 2.0
CHECK_EVERY = 8  # batches between looks at the evidence (a snapshot walks every worker's totals)
ONE_BATCH_EPOCHS = 3  # epochs of one batch each after which loading more cannot help a verdict


@dataclass(frozen=True)
class ProfileOptions:
    """What ``pipeload profile`` runs; ``batches=None``: until there is enough to judge."""

    target: str
    batches: int | None = None
    batch_size: int = 32
    num_workers: int | str = 2
    mode: str = "classic"
    worker_type: str = "process"
    step_ms: float = 0.0
    max_seconds: float = 60.0
    given: tuple[str, ...] = ()  # which of batch_size, num_workers, mode, worker_type the user gave


def run(options: ProfileOptions) -> int:
    """The whole command; returns the exit status."""
    made = call_factory(options.target)
    loader = as_loader(made, options)
    loader._stats.time_every_batch()  # measuring, not training: every wait timed
    started = time.perf_counter()
    batches = load(loader, options)
    stats = loader.stats()
    print(f"profiled {batches} batches ({stats.epochs} epoch(s)) from {options.target} in "
          f"{time.perf_counter() - started:.1f} s")
    print(stats.summary())
    suggestions = stats.suggested_settings()
    if suggestions:
        settings = ", ".join(f"{key}={value!r}" for key, value in suggestions.items())
        print(f"suggested settings: DataLoader(..., {settings})")
    elif evidence_shortfall(stats) is not None:
        print(f"suggested settings: none yet (too little to judge; {_more_evidence(stats, options)})")
    elif still_tuning(stats) is not None:
        print(f"suggested settings: none yet (num_workers='auto' is still tuning; {_more_evidence(stats, options)})")
    else:
        print("suggested settings: keep these")
    return 0


def _more_evidence(stats: Any, options: ProfileOptions) -> str:
    """What would give the stats enough to judge, by what stopped the loading."""
    if options.batches is not None:
        return "give --batches more, or leave it out"
    if _one_batch_epochs(stats):
        return "its epochs hold one batch each, and an epoch's first is never judged"
    return f"it stopped at --max-seconds {options.max_seconds:g}: give more"


def _one_batch_epochs(stats: Any) -> bool:
    """Several epochs and no batch past an epoch's first: more such epochs add nothing to judge."""
    return stats.epochs >= ONE_BATCH_EPOCHS and steady(stats)[0] == 0


def call_factory(target: str) -> Any:
    """Import ``MODULE:FACTORY`` and call it; every failure becomes a one-line CommandError."""
    module_name, _, attribute = target.partition(":")
    if not module_name or not attribute:
        raise CommandError(f"expected MODULE:FACTORY (for example mypackage.data:make_dataset), got {target!r}")
    if module_name.endswith(".py") or os.sep in module_name:
        raise CommandError(f"expected MODULE:FACTORY with a module's name, not a file's, got {target!r}: "
                           f"{_as_module_target(module_name, attribute)}")
    if os.getcwd() not in sys.path:
        sys.path.insert(0, os.getcwd())  # as `python -m` would: the user's own modules
    try:
        module = importlib.import_module(module_name)
    except Exception as error:
        raise CommandError(f"cannot import module {module_name!r}: {type(error).__name__}: {error}") from None
    factory = getattr(module, attribute, None)
    if not callable(factory):
        what = "has no attribute" if factory is None else "has a non-callable"
        raise CommandError(f"module {module_name!r} {what} {attribute!r}")
    try:
        return factory()
    except (Exception, SystemExit) as error:  # sys.exit() in a factory: said, not a silent exit
        raise CommandError(f"{target} raised {type(error).__name__}: {error}", status=1) from None


def _as_module_target(path: str, attribute: str) -> str:
    """What to type instead of ``path:attribute``: the module's dotted name, from the directory
    it is importable from (the current one when the file is below it)."""
    file = Path(path).with_suffix("") if path.endswith(".py") else Path(path)
    absolute = file.resolve()
    try:
        relative = absolute.relative_to(Path.cwd())
    except ValueError:  # outside the current directory: run from the file's own
        return f"run `pipeload profile {absolute.name}:{attribute}` from {absolute.parent}"
    return f"try `pipeload profile {'.'.join(relative.parts)}:{attribute}`"


def as_loader(made: Any, options: ProfileOptions) -> pipeload.DataLoader:
    """The pipeload DataLoader to profile, from what the factory returned."""
    if isinstance(made, torch_data.DataLoader) and options.given:
        _say_flags_left_aside(made, options)
    if isinstance(made, pipeload.DataLoader):
        try:
            made.stats()
        except RuntimeError:  # built with stats=False: the summary is all this command prints
            raise CommandError(f"{options.target} returned a DataLoader built with stats=False: "
                               "nothing to profile; return one with stats on (the default)",
                               status=1) from None
        return made
    if isinstance(made, type):  # a class has __getitem__ and __len__ too: the instance was meant
        raise CommandError(f"{options.target} returned the class {made.__name__}, expected a dataset "
                           "or a DataLoader (an instance: call the class)", status=1)
    if isinstance(made, torch_data.DataLoader):
        return _rebuilt(made)
    if not isinstance(made, (torch_data.Dataset, torch_data.IterableDataset)) and not (
            hasattr(made, "__getitem__") and hasattr(made, "__len__")):
        raise CommandError(f"{options.target} returned {type(made).__name__}, expected a dataset "
                           "or a DataLoader", status=1)
    try:
        return pipeload.DataLoader(made, batch_size=options.batch_size, num_workers=options.num_workers,
                                   mode=options.mode, worker_type=options.worker_type)
    except Exception as error:  # the dataset's own code may run here too
        raise CommandError(f"cannot load {options.target}'s dataset: {type(error).__name__}: {error}",
                           status=1) from None


def _say_flags_left_aside(loader: torch_data.DataLoader, options: ProfileOptions) -> None:
    """The dataset's flags given for a DataLoader, which keeps its own settings: said, on stderr."""
    flags = ", ".join("--" + name.replace("_", "-") for name in options.given)
    # A torch DataLoader has no mode or worker_type: it loads as classic mode with processes.
    defaults = {"mode": "classic", "worker_type": "process"}
    own = ", ".join(f"{name}={getattr(loader, name, defaults.get(name))!r}" for name in options.given)
    print(f"pipeload profile: {flags} set a dataset's loader; {options.target} returned a DataLoader, "
          f"profiled with its own settings ({own})", file=sys.stderr)


def _rebuilt(loader: torch_data.DataLoader) -> pipeload.DataLoader:
    """torch's loader as pipeload's: every setting it was made with (its samples batched and
    ordered the same way, its workers started, seeded and kept the same way)."""
    kept = {name: getattr(loader, name) for name in _TORCH_SETTINGS if hasattr(loader, name)}
    kept["collate_fn"] = loader.collate_fn
    kept["num_workers"] = loader.num_workers
    if not isinstance(loader.multiprocessing_context, (str, type(None))):
        kept["multiprocessing_context"] = loader.multiprocessing_context.get_start_method()
    if isinstance(loader.dataset, torch_data.IterableDataset):  # no sampler allowed
        return pipeload.DataLoader(loader.dataset, batch_size=loader.batch_size,
                                   drop_last=loader.drop_last, **kept)
    if loader.batch_size is None and loader.batch_sampler is not None:  # the user's batch_sampler
        return pipeload.DataLoader(loader.dataset, batch_sampler=loader.batch_sampler, **kept)
    return pipeload.DataLoader(loader.dataset, batch_size=loader.batch_size, sampler=loader.sampler,
                               drop_last=loader.drop_last, **kept)


def load(loader: pipeload.DataLoader, options: ProfileOptions) -> int:
    """Load batches, epoch after epoch, until ``options`` says to stop (``batches``, or enough
    to judge; ``max_seconds`` at most), with ``step_ms`` of pretend training after each;
    returns how many.

    Raises:
        CommandError: loading failed, or the loader gave no batch.
    """
    step_s = options.step_ms / 1000
    deadline = time.perf_counter() + options.max_seconds
    batches = 0
    while True:
        in_epoch = _one_epoch(loader, options, step_s, batches, deadline)
        batches += in_epoch
        if in_epoch == 0 or _enough(loader, options, batches) or time.perf_counter() >= deadline:
            break
        if options.batches is None and _one_batch_epochs(loader.stats()):
            break  # loading on until the deadline would judge nothing more
    if batches == 0:
        raise CommandError(f"{options.target} gave no batches", status=1)
    return batches


def _one_epoch(loader: pipeload.DataLoader, options: ProfileOptions, step_s: float, before: int,
               deadline: float) -> int:
    iterator = None
    batches = 0
    try:
        iterator = iter(loader)  # starting an epoch runs the dataset's code too (len, __iter__)
        for _ in iterator:
            batches += 1
            if step_s:
                _pretend_to_train(step_s)
            done = before + batches
            if (done % CHECK_EVERY == 0 or options.batches is not None) and (
                    _enough(loader, options, done) or time.perf_counter() >= deadline):
                break
    except Exception as error:
        raise CommandError(f"loading failed after {before + batches} batches: {type(error).__name__}: "
                           f"{_in_one_line(error)}", status=1) from None
    finally:
        close = getattr(iterator, "close", None)
        if close is not None:
            close()
    return batches


def _in_one_line(error: Exception) -> str:
    """The error's first line and, where a worker's traceback follows it (torch's "Caught ...
    in DataLoader worker process N" and the original traceback), the original error's last line:
    the first alone names the worker, not what went wrong."""
    lines = [line.strip() for line in str(error).splitlines() if line.strip()]
    if not lines:
        return ""
    if "Original Traceback (most recent call last):" in lines[1:-1]:
        return f"{lines[0]} The original error: {lines[-1]}"
    return lines[0]


def _enough(loader: pipeload.DataLoader, options: ProfileOptions, batches: int) -> bool:
    if options.batches is not None:
        return batches >= options.batches
    stats = loader.stats()
    if still_tuning(stats) is not None:  # "auto": its figures are judged once it settles
        return False
    # Epochs that are mostly workers starting may never gather the steady seconds a verdict
    # needs: their start-ups, judged on their own evidence, are the verdict then.
    return evidence_shortfall(stats, EVIDENCE_MARGIN) is None or restarts(stats, EVIDENCE_MARGIN) is not None


def _pretend_to_train(seconds: float) -> None:
    # Busy, not asleep: a training step keeps a CPU (or the GPU's launching thread) occupied.
    until = time.perf_counter() + seconds
    while time.perf_counter() < until:
        pass
