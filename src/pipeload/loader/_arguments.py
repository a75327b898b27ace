"""DataLoader argument checks: torch's rules and exception types, messages that name the argument.

Each check refuses one argument (or one combination) and says what it received and what would be
accepted, so the loader's constructor reads as a list of decisions.
"""

from __future__ import annotations

import math
import multiprocessing
import multiprocessing.context
import operator
import os
import warnings
from typing import Any

from pipeload._user_frame import first_frame_outside_pipeload
from pipeload.errors import ArgumentAssertionError, exact_value
from pipeload.samplers import (
    RandomSampler,
    Sampler,
    SequentialSampler,
    _InfiniteConstantSampler,
)

WORKER_TYPES = ("process", "thread")
MODES = ("classic", "economic")
EQUAL_BATCHES = (None, "drop", "pad")
WORKER_SEEDINGS = ("torch", "per_batch")


AUTO = "auto"


def auto_options(num_workers: Any, prefetch_factor: Any, stats: bool) -> tuple[bool, bool]:
    """Which of num_workers and prefetch_factor are "auto" (the tuner reads the stats, so they
    must be on); ``stats`` is checked first (``check_stats``)."""
    check_stats(stats)
    auto = (num_workers == AUTO, prefetch_factor == AUTO)
    if auto[1] and not auto[0] and num_workers == 0:
        resolve_prefetch_factor(prefetch_factor, 0)  # torch's error: prefetching needs workers
    if any(auto) and not stats:
        name = "num_workers" if auto[0] else "prefetch_factor"
        raise ValueError(f"{name}='auto' tunes itself from the loader's stats, but got stats=False; "
                         "set stats=True or give a number")
    return auto


def check_stats(stats: Any) -> None:
    """Refuse a ``stats`` that is not True or False: a string such as "no" would be taken as
    true, and the loader would count every batch while the user believes it off."""
    if not isinstance(stats, bool):
        raise TypeError(f"stats should be True or False, but got stats={stats!r} ({type(stats).__name__})")


def plain_number(value: Any) -> int | float | None:
    """``value`` as a Python int (anything with ``__index__``: numpy integers, bools, integer
    tensors) or float (anything ``float()`` takes by ``__float__``: numpy floats, one-element
    tensors), else None. torch never checks the types of num_workers, timeout and
    prefetch_factor, only compares and counts with them: whatever does both like a number, it
    takes, so we take it too, and hand the engine a plain number."""
    try:
        return operator.index(value)
    except TypeError:
        pass
    if not hasattr(type(value), "__float__"):  # str and bytes parse in float(); torch refuses them
        return None
    try:
        return float(value)
    except (TypeError, ValueError, RuntimeError):  # a tensor of several elements, say
        return None


def resolve_num_workers(num_workers: Any) -> int:
    """num_workers as an int. A float counts only as 0.0, which torch compares with 0 and loads
    without workers; any other float torch refuses once iterating, when it counts workers with
    ``range()`` (2.0 included)."""
    count = plain_number(num_workers)
    if count is not None and count < 0:  # before the type: torch says this of -0.5 too
        raise ValueError(
            "num_workers option should be non-negative; use num_workers=0 to disable "
            f"multiprocessing. (pipeload: got num_workers={num_workers!r})"
        )
    if isinstance(count, float) and count != 0:
        raise TypeError(f"'float' object cannot be interpreted as an integer (pipeload: num_workers should "
                        f"be an int (or 'auto'), but got num_workers={num_workers!r})")
    if count is None:
        # torch compares it with 0 first: a str (or any other type int cannot be compared with)
        # fails there, in those words.
        words = f"'<' not supported between instances of '{type(num_workers).__name__}' and 'int' "
        raise TypeError(f"{words}(pipeload: num_workers should be an int (or 'auto'), but got "
                        f"num_workers={num_workers!r})")
    return int(count)


def check_worker_options(
    num_workers: int, persistent_workers: bool, worker_type: Any, multiprocessing_context: Any
) -> None:
    if persistent_workers and num_workers == 0:
        raise ValueError(
            "persistent_workers option needs num_workers > 0, but got "
            f"persistent_workers={persistent_workers!r} with num_workers=0"
        )
    if worker_type not in WORKER_TYPES:
        raise ValueError(f"worker_type should be one of {WORKER_TYPES}, but got worker_type={worker_type!r}")
    if worker_type == "thread" and multiprocessing_context is not None:
        raise ValueError(
            "multiprocessing_context only applies to process workers, but got "
            f"multiprocessing_context={multiprocessing_context!r} with worker_type='thread'"
        )


def resolve_mode(
    mode: Any, num_workers: int, num_batch_workers: Any, prefetch_factor: int | None, dataset: Any,
    iterable: bool,
) -> int | None:
    """Check ``mode`` and what it brings; returns the number of batch workers (None in classic)."""
    if mode not in MODES:
        raise ValueError(f"mode should be one of {MODES}, but got mode={mode!r}")
    if mode == "classic":
        if num_batch_workers is not None:
            raise ValueError(
                "num_batch_workers only applies to mode='economic', but got "
                f"num_batch_workers={num_batch_workers!r} with mode='classic'"
            )
        return None
    if iterable:
        raise ValueError(
            "mode='economic' needs a map-style dataset (it fetches items by index), but got the "
            f"IterableDataset {type(dataset).__name__}; use mode='classic' for iterable datasets"
        )
    batch_workers = _resolve_num_batch_workers(num_batch_workers, prefetch_factor)
    # The economic RFC: "Setting it to 0 disables multiprocessing (as today)": the main process
    # loads, as in classic mode, and no worker of either kind starts.
    return 0 if num_workers == 0 else batch_workers


def _resolve_num_batch_workers(num_batch_workers: Any, prefetch_factor: int | None) -> int:
    if num_batch_workers is None:
        return prefetch_factor or 2  # one batch worker per batch in flight
    # Integers as num_workers takes them (numpy ints, integer tensors); a bool or a float is a
    # mistake here, where torch has no argument to agree with.
    count = None if isinstance(num_batch_workers, bool) else plain_number(num_batch_workers)
    if type(count) is not int:
        raise TypeError(
            f"num_batch_workers should be an int, but got num_batch_workers={num_batch_workers!r}"
        )
    if count <= 0:
        raise ValueError(
            "num_batch_workers should be a positive integer (the number of workers that collate "
            f"batches in mode='economic'), but got num_batch_workers={num_batch_workers!r}"
        )
    return count


def check_callables(**functions: Any) -> None:
    """Functions the loader calls (None: its default). torch finds a value that is not callable
    only when it calls it, in a worker, with Python's words alone; said here, when the loader is
    made, with those words first and the argument named."""
    for name, function in functions.items():
        if function is not None and not callable(function):
            raise TypeError(f"{type(function).__name__!r} object is not callable: {name} should be a "
                            f"function, but got {name}={function!r}")


def check_max_shm_bytes(max_shm_bytes: Any) -> None:
    """None (the default: half of what the memory behind shared buffers can take) or bytes > 0."""
    if max_shm_bytes is None:
        return
    if not isinstance(max_shm_bytes, int) or isinstance(max_shm_bytes, bool):
        raise TypeError(
            "max_shm_bytes should be a positive number of bytes (an int) or None, but got "
            f"max_shm_bytes={max_shm_bytes!r}"
        )
    if max_shm_bytes <= 0:
        raise ValueError(
            "max_shm_bytes should be a positive number of bytes or None (no explicit limit), but "
            f"got max_shm_bytes={max_shm_bytes!r}"
        )


def check_equal_batches(equal_batches: Any) -> None:
    if equal_batches not in EQUAL_BATCHES:
        raise ValueError(
            f"equal_batches should be one of {EQUAL_BATCHES} (\"drop\": every rank stops when the "
            "first runs out; \"pad\": ranks that run out repeat their last batch), but got "
            f"equal_batches={equal_batches!r}"
        )


def check_worker_seeding(worker_seeding: Any) -> None:
    if worker_seeding not in WORKER_SEEDINGS:
        raise ValueError(
            f"worker_seeding should be one of {WORKER_SEEDINGS} (\"torch\": each worker seeded "
            "once, as torch does; \"per_batch\": the generators are seeded before every batch, "
            f"so a resumed epoch draws the same random values), but got worker_seeding={worker_seeding!r}"
        )


def resolve_timeout(timeout: Any) -> float:
    """timeout as a plain int or float (an int stays one: torch prints "after 1 seconds")."""
    seconds = plain_number(timeout)
    if seconds is None:
        # torch's own words are those of its check, `if timeout < 0`, failing on the value
        try:
            bool(timeout < 0)
            words, kind = "", TypeError
        except Exception as error:  # noqa: BLE001 - its words and type are torch's
            words, kind = f"{error} ", type(error)
        raise kind(f"{words}(pipeload: timeout should be a number of seconds, but got "
                   f"timeout={timeout!r})".lstrip())
    if seconds < 0 or math.isnan(seconds):
        raise ValueError(f"timeout option should be non-negative, but got timeout={timeout!r}")
    return seconds


def resolve_prefetch_factor(prefetch_factor: Any, num_workers: int) -> int | None:
    if num_workers == 0:
        if prefetch_factor is not None:
            raise ValueError(
                "prefetch_factor option could only be specified in multiprocessing.let num_workers "
                "> 0 to enable multiprocessing, otherwise set prefetch_factor to None. (pipeload: "
                f"got prefetch_factor={prefetch_factor!r} with num_workers=0)"
            )
        return None
    if prefetch_factor is None:
        return 2
    count = plain_number(prefetch_factor)
    if count is not None and count < 0:  # before the type: torch says this of -1.5 too
        # torch raises a ValueError at construction, an AssertionError for one set later
        raise ArgumentAssertionError(
            f"prefetch_factor option should be non-negative (pipeload: got "
            f"prefetch_factor={prefetch_factor!r}; each worker needs at least one batch in flight, "
            f"so it takes a positive integer)"
        )
    if isinstance(count, float):  # torch fails on any float, 2.0 included, in range()
        raise TypeError(f"'float' object cannot be interpreted as an integer (pipeload: prefetch_factor "
                        f"should be an int, but got prefetch_factor={prefetch_factor!r})")
    if count is None:
        raise TypeError(f"prefetch_factor should be an int, but got prefetch_factor={prefetch_factor!r}")
    if count == 0:
        raise ArgumentAssertionError(
            "prefetch_factor must be greater than 0 for MultiProcessingDataLoaderIter (pipeload: "
            f"got prefetch_factor={prefetch_factor!r}; each worker needs at least one batch in flight)"
        )
    return count


def check_iterable_options(shuffle: Any, sampler: Any, batch_sampler: Any) -> None:
    if shuffle not in {False, None}:
        raise ValueError(
            f"DataLoader with IterableDataset: expected unspecified shuffle option, but got shuffle={shuffle}"
            f"{exact_value('shuffle', shuffle)}"
        )
    if sampler is not None:
        raise ValueError(
            f"DataLoader with IterableDataset: expected unspecified sampler option, but got sampler={sampler}"
            f"{exact_value('sampler', sampler)}"
        )
    if batch_sampler is not None:
        raise ValueError(
            "DataLoader with IterableDataset: expected unspecified batch_sampler option, "
            f"but got batch_sampler={batch_sampler}{exact_value('batch_sampler', batch_sampler)}"
        )


def check_batching(
    batch_size: Any, shuffle: Any, sampler: Any, batch_sampler: Any, drop_last: bool
) -> tuple[int | None, bool]:
    if sampler is not None and shuffle:
        raise ValueError(
            f"sampler option is mutually exclusive with shuffle (got shuffle={shuffle!r}): the "
            "sampler decides the order; leave shuffle out, or give a sampler that shuffles "
            "(RandomSampler, or DistributedSampler(..., shuffle=True))"
        )
    if batch_sampler is not None:
        if batch_size != 1 or shuffle or sampler is not None or drop_last:
            raise ValueError(
                "batch_sampler option is mutually exclusive with batch_size, shuffle, sampler, "
                f"and drop_last (got batch_size={batch_size!r}, shuffle={shuffle!r}, "
                f"sampler={sampler!r}, drop_last={drop_last!r}): the batch sampler makes every "
                "batch; leave those four out, or pass batch_size, shuffle and drop_last to the "
                "batch sampler you build"
            )
        return None, False
    if batch_size is None and drop_last:
        raise ValueError(
            "batch_size=None option disables auto-batching and is mutually exclusive with "
            f"drop_last (got drop_last={drop_last!r})"
        )
    return batch_size, drop_last


def default_sampler(dataset: Any, iterable: bool, shuffle: bool, generator: Any) -> Sampler:
    if iterable:
        return _InfiniteConstantSampler()
    if shuffle:
        return RandomSampler(dataset, generator=generator)
    return SequentialSampler(dataset)


def resolve_context(context: Any, num_workers: int) -> Any:
    if context is None:
        return None
    if num_workers == 0:
        raise ValueError(
            "multiprocessing_context can only be used with multi-process loading "
            f"(num_workers > 0), but got num_workers=0 (pipeload: and multiprocessing_context={context!r})"
        )
    if isinstance(context, str):
        methods = multiprocessing.get_all_start_methods()
        if context not in methods:
            raise ValueError(
                f"multiprocessing_context option should specify a valid start method in {methods!r}, "
                f"but got multiprocessing_context={context!r}"
            )
        return multiprocessing.get_context(context)
    if not isinstance(context, multiprocessing.context.BaseContext):
        raise TypeError(
            "multiprocessing_context option should be a valid context object or a string "
            f"specifying the start method, but got multiprocessing_context={context}"
            f"{exact_value('multiprocessing_context', context)}"
        )
    return context


def warn_if_too_many_workers(num_workers: int, batch_workers: int = 0, worker_type: str = "process") -> None:
    """torch's warning when more workers start than there are CPUs to run them; in economic
    mode every process that starts counts: ``num_workers`` item workers and ``batch_workers``.
    Thread workers start no process (they share this one, and one CPU's worth of Python under
    the GIL: more of them than CPUs is how waiting on files or a network is overlapped)."""
    if num_workers == 0 or worker_type == "thread":
        return
    item_workers, num_workers = num_workers, num_workers + batch_workers
    # torch's count: the CPUs this process may run on (affinity, so cgroups/taskset count).
    cpuset_checked = hasattr(os, "sched_getaffinity")
    available = len(os.sched_getaffinity(0)) if cpuset_checked else os.cpu_count()
    if available is not None and num_workers <= available:
        return
    if available is None:
        suggestion = "DataLoader is not able to compute a suggested max number of worker in current system."
    else:
        suggestion = (
            f"Our suggested max number of worker in current system is {available}"
            f"{'' if cpuset_checked else ' (`cpuset` is not taken into account)'}, which is "
            "smaller than what this DataLoader is going to create."
        )
    economic = (f" (pipeload: {item_workers} item workers and up to {batch_workers} batch workers, "
                "mode='economic'; a batch worker starts only when a batch needs one, and none "
                "does for flat samples collated by default_collate)") if batch_workers else ""
    warnings.warn(
        f"This DataLoader will create {num_workers} worker processes in total. {suggestion} "
        "Please be aware that excessive worker creation might get DataLoader running slow or "
        f"even freeze, lower the worker number to avoid potential slowness/freeze if necessary.{economic}",
        stacklevel=first_frame_outside_pipeload(),
    )
