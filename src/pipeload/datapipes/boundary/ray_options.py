"""The actor options of a Ray boundary, checked when the pipe is built.

Ray checks an actor's options only when the actor class is given them, which a boundary does
when its first run starts its actors: possibly in a DataLoader worker, an epoch after the pipe
was built. So the options are checked here, each error naming the option and the value. The
common ones are checked without importing Ray (seconds to import; a pipe may be built where it
is never run); any other option is shown to Ray's own check, when Ray is installed (without it,
the first run says which extra to install).
"""

from __future__ import annotations

import math
from typing import Any

_AMOUNTS = ("num_cpus", "num_gpus", "memory")  # what each actor asks of a node
_RETRY_COUNTS = ("max_restarts", "max_task_retries")  # -1: no limit
# Options that cannot work for a boundary's actors, and why.
_REFUSED = {
    "name": "the boundary starts num_actors actors per run and keeps them between runs, and a "
            "name belongs to one actor",
    "get_if_exists": "each run takes its own actors (a name would be needed, and is refused)",
}
_DETACHED = ("the boundary's actors must go with the process that started them: detached ones "
             "outlived a crashed training process, holding their CPUs until `ray stop`")
_STRATEGY_NAMES = ("DEFAULT", "SPREAD")  # or one of Ray's strategy objects


def check_actor_options(options: dict[str, Any]) -> None:
    """Refuse, naming it and its value, an actor option of a Ray boundary that cannot work.

    Raises:
        TypeError: an option of the wrong type.
        ValueError: an option out of range, unknown to Ray, or one a boundary cannot use.
    """
    for key, value in options.items():
        if key in _REFUSED:
            raise ValueError(f"queue_boundary('ray') cannot use the actor option {key}={value!r}: {_REFUSED[key]}")
        if key in _AMOUNTS:
            _check_amount(key, value)
        elif key in _RETRY_COUNTS:
            _check_retry_count(key, value)
        elif key == "max_concurrency" and value not in (None, 1):
            raise ValueError(f"queue_boundary('ray') max_concurrency should be 1 (an actor makes its shard's "
                             f"items in order, one request at a time), but got max_concurrency={value!r}")
        elif key == "resources":
            _check_resources(value)
        elif key == "lifetime" and value == "detached":
            raise ValueError(f"queue_boundary('ray') cannot use the actor option {key}={value!r}: {_DETACHED}")
        elif key == "scheduling_strategy" and isinstance(value, str) and value not in _STRATEGY_NAMES:
            # Ray checks a strategy's name only when an actor is made: the first run, an epoch on.
            raise ValueError(f"queue_boundary('ray') scheduling_strategy should be one of {_STRATEGY_NAMES}, "
                             f"None or one of Ray's strategy objects, but got scheduling_strategy={value!r}")
        elif key == "placement_group" and not _is_placement_group(value):
            # Ray asserts its type only when an actor is made, with an empty AssertionError.
            raise TypeError("queue_boundary('ray') placement_group should be a ray.util.placement_group."
                            f"PlacementGroup, 'default' or None, but got placement_group={value!r}")
        elif key == "runtime_env" and value is not None and not isinstance(value, dict):
            raise TypeError(f"queue_boundary('ray') runtime_env should be a dict or None, but got runtime_env={value!r}")
    others = {key: value for key, value in options.items()
              if key not in (*_AMOUNTS, *_RETRY_COUNTS, "max_concurrency", "resources", "runtime_env")}
    if others:
        _check_with_ray(others)


def _is_placement_group(value: Any) -> bool:
    """Ray's placement group object (by its class name: Ray is imported only when a run starts),
    or what Ray takes in its place."""
    return value is None or value == "default" or type(value).__name__ == "PlacementGroup"


def _is_number(value: Any) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool)


def _check_amount(key: str, value: Any) -> None:
    if value is None:
        return
    if not _is_number(value):
        raise TypeError(f"queue_boundary('ray') {key} should be a number >= 0 or None, but got {key}={value!r}")
    if not 0 <= value < math.inf:
        raise ValueError(f"queue_boundary('ray') {key} should be a number >= 0 or None, but got {key}={value!r}")


def _check_retry_count(key: str, value: Any) -> None:
    # None passes Ray's .options() but fails inside Ray when the actor is made, with a TypeError
    # that names no option: refused here.
    expected = f"{key} should be an int >= 0, or -1 for no limit, but got {key}={value!r}"
    if isinstance(value, bool) or not isinstance(value, int):
        raise TypeError(f"queue_boundary('ray') {expected}")
    if value < -1:
        raise ValueError(f"queue_boundary('ray') {expected}")


def _check_resources(value: Any) -> None:
    expected = "resources should be a dict of resource names to amounts >= 0 (CPU and GPU by num_cpus and num_gpus)"
    if value is None:
        return
    if not isinstance(value, dict):
        raise TypeError(f"queue_boundary('ray') {expected}, but got resources={value!r}")
    for name, amount in value.items():
        if not isinstance(name, str) or name in ("CPU", "GPU"):
            raise ValueError(f"queue_boundary('ray') {expected}, but got resources={value!r} (key {name!r})")
        if not _is_number(amount) or not 0 <= amount < math.inf:
            raise ValueError(f"queue_boundary('ray') {expected}, but got resources={value!r} ({name!r}: {amount!r})")


def _check_with_ray(options: dict[str, Any]) -> None:
    """Ray's own check of the options above do not know (``.options()`` on an actor class
    starts nothing and needs no cluster)."""
    try:
        import ray
    except ImportError:
        return  # the first run says which extra to install
    from pipeload.datapipes.boundary.ray_actors import actor_class

    made = actor_class(ray)
    # One by one first, so that the error names the option Ray refuses; then together (some
    # options only work with others).
    for key, value in options.items():
        _ask_ray(made, {key: value})
    _ask_ray(made, options)


def _ask_ray(made: Any, options: dict[str, Any]) -> None:
    try:
        made.options(**options)
    except (TypeError, ValueError) as error:
        given = ", ".join(f"{key}={value!r}" for key, value in options.items())
        raise type(error)(f"queue_boundary('ray') cannot use the actor option{'s' * (len(options) > 1)} "
                          f"{given}: {error}") from None
