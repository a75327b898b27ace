"""What happens when the function a pipe was given fails while the pipe runs.

The user's exception reaches the loop as itself, with a note naming the pipe and the argument
that held the function (the traceback between the loop and the function is pipeload's). A
``StopIteration`` escaping the function (a ``next()`` on an exhausted iterator, say) fails the
run as a ``RuntimeError``, as PEP 479 makes it inside torch's generator pipes, instead of ending
the run there and silently dropping the rest of the epoch.
"""

from __future__ import annotations

import traceback
from collections.abc import Callable
from typing import Any

import pytest
import torch.utils.data.datapipes.iter as theirs

import pipeload
import pipeload.datapipes.iter as ours
import pipeload.datapipes.map as ours_map

# The builders wrap the functions under test in lambdas (which warn that they do not pickle).
pytestmark = [pytest.mark.usefixtures("leak_guard"), pytest.mark.timeout(60),
              pytest.mark.filterwarnings("ignore:(Lambda|Local) function is not supported by pickle")]

FAILING_ITEM = 3


class BadSample(Exception):
    """The user's own exception type."""


def stops_early(x: Any) -> Any:
    """A function with a bug: on one item a StopIteration escapes it."""
    if x == FAILING_ITEM:
        next(iter(()))
    return x


def fails(x: Any) -> Any:
    if x == FAILING_ITEM:
        raise BadSample(f"cannot read sample {x}")
    return x


def keep(fn: Callable[[Any], Any], x: Any) -> bool:
    return fn(x) % 2 == 0


def branch(fn: Callable[[Any], Any], x: Any) -> int:
    return fn(x) % 2


def sort_batches(fn: Callable[[Any], Any], bucket: list[Any]) -> list[Any]:
    return sorted(bucket, key=fn)


# Each builder takes the function and returns (the pipe, the argument that holds the function).
def _map(fn: Any) -> Any:
    return ours.IterableWrapper(range(8)).map(fn), "fn"


def _filter(fn: Any) -> Any:
    return ours.IterableWrapper(range(8)).filter(lambda x: keep(fn, x)), "filter_fn"


def _flatmap(fn: Any) -> Any:
    return ours.IterableWrapper(range(8)).flatmap(lambda x: [fn(x)]), "fn"


def _collate(fn: Any) -> Any:
    return ours.IterableWrapper(range(8)).collate(collate_fn=fn), "collate_fn"


def _groupby(fn: Any) -> Any:
    return ours.IterableWrapper(range(8)).groupby(fn), "group_key_fn"


def _demux(fn: Any) -> Any:
    evens, _ = ours.IterableWrapper(range(8)).demux(2, lambda x: branch(fn, x))
    return evens, "classifier_fn"


def _bucketbatch(fn: Any) -> Any:
    pipe = ours.IterableWrapper(range(8)).bucketbatch(2, batch_num=1, sort_key=lambda b: sort_batches(fn, b))
    return pipe, "sort_key"


def _map_style_map(fn: Any) -> Any:
    return ours_map.SequenceWrapper(range(8)).map(fn).to_iter_datapipe(), "fn"


BUILDERS = {"map": _map, "filter": _filter, "flatmap": _flatmap, "collate": _collate,
            "groupby": _groupby, "demux": _demux, "bucketbatch": _bucketbatch,
            "map-style map": _map_style_map}


@pytest.mark.parametrize("operation", BUILDERS)
def test_a_stopiteration_escaping_the_function_fails_the_run_instead_of_ending_it(operation: str) -> None:
    pipe, argument = BUILDERS[operation](stops_early)
    with pytest.raises(RuntimeError, match=f"`{argument}` raised StopIteration") as caught:
        list(pipe)
    assert isinstance(caught.value.__cause__, StopIteration)


def test_torchs_pipes_fail_on_that_stopiteration_too() -> None:
    with pytest.raises(RuntimeError, match="StopIteration"):
        list(theirs.IterableWrapper(range(8)).map(stops_early))


@pytest.mark.parametrize("operation", BUILDERS)
def test_the_users_exception_arrives_as_itself_naming_the_pipe(operation: str) -> None:
    pipe, argument = BUILDERS[operation](fails)
    with pytest.raises(BadSample, match="cannot read sample 3") as caught:
        list(pipe)
    (note,) = caught.value.__notes__
    assert note.startswith(f"pipeload: raised by `{argument}` of ")


def test_the_note_names_the_pipe_and_what_it_reads() -> None:
    with pytest.raises(BadSample) as caught:
        list(ours.IterableWrapper(range(8)).map(fails).map(str))
    assert caught.value.__notes__ == ["pipeload: raised by `fn` of Mapper(fails) <- IterableWrapper(range(0, 8))"]


@pytest.mark.parametrize("worker_type", ["process", "thread"])
def test_through_the_loaders_workers_the_type_and_the_pipe_reach_the_loop(worker_type: str) -> None:
    pipe = ours.IterableWrapper(range(8)).sharding_filter().map(fails)
    loader = pipeload.DataLoader(pipe, batch_size=2, num_workers=2, worker_type=worker_type)
    with pytest.raises(BadSample) as caught:
        list(loader)
    assert "pipeload: raised by `fn` of Mapper(fails) <- ShardingFilter" in str(caught.value) + "".join(
        getattr(caught.value, "__notes__", []))


@pytest.mark.parametrize("where", ["thread", "process", "loader"])
def test_past_a_boundary_or_a_worker_the_note_naming_the_pipe_comes_along_once(where: str) -> None:
    # A process boundary, and the loader's process workers, rebuilt the error with their own
    # note alone: the pipe and argument that raised were left in the traceback's text.
    pipe = ours.IterableWrapper(range(8)).sharding_filter().map(fails)
    if where == "loader":
        run: Any = pipeload.DataLoader(pipe, batch_size=2, num_workers=1)
        last = "pipeload: raised in DataLoader worker 0 while fetching a batch"
    else:
        run = pipe.queue_boundary(where, 2)
        last = f"pipeload: raised {'upstream of a thread' if where == 'thread' else 'in the upstream process of a'}"
    with pytest.raises(BadSample) as caught:
        list(run)
    notes = caught.value.__notes__
    printed = "".join(traceback.format_exception(caught.value))
    del caught  # its traceback holds the run open (a loop's error, once handled, is dropped)
    assert printed.count("raised by `fn` of Mapper(fails)") == 1, printed  # not again in the text
    assert notes[0] == "pipeload: raised by `fn` of Mapper(fails) <- ShardingFilter <- ..."
    assert len(notes) == 2 and notes[1].startswith(last), notes


def test_through_the_loaders_workers_a_stopiteration_fails_the_epoch_instead_of_shortening_it() -> None:
    loader = pipeload.DataLoader(ours.IterableWrapper(range(8)).sharding_filter().map(stops_early),
                                 batch_size=2, num_workers=2)
    with pytest.raises(RuntimeError, match="`fn` raised StopIteration"):
        list(loader)
