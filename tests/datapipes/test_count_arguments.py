"""Count arguments (sizes, limits, numbers of branches, shard numbers) must be integers.

torch's pipes take a float where they compare a count (``batch(2.5)`` makes one batch of the
whole source; ``header(2.5)`` yields three items) and a negative shard number (every item is
dropped): each a wrong epoch with no error. pipeload refuses them where the pipe is built, naming
the argument and the value. Integers of other types (numpy, 0-d tensors) and torch's own error
for a count below its minimum are kept.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import Any

import numpy as np
import pytest
import torch
import torch.utils.data.datapipes.iter as theirs

import pipeload.datapipes.iter as ours
import pipeload.datapipes.map as ours_map
from pipeload.datapipes import MapDataPipe


def numbers() -> Any:
    return ours.IterableWrapper(range(10))


def by_parity(x: int) -> int:
    return x % 2


# Each takes the count under test and builds (and for lazy checks, runs) a pipe with it.
COUNTS: dict[str, Callable[[Any], Any]] = {
    "batch_size": lambda n: numbers().batch(n),
    "padded_batch batch_size": lambda n: numbers().padded_batch(n),
    "bucketbatch batch_num": lambda n: numbers().bucketbatch(2, batch_num=n),
    "bucketbatch bucket_num": lambda n: numbers().bucketbatch(2, bucket_num=n),
    "shuffle buffer_size": lambda n: numbers().shuffle(buffer_size=n),
    "fork num_instances": lambda n: numbers().fork(n),
    "fork buffer_size": lambda n: numbers().fork(2, buffer_size=n),
    "demux buffer_size": lambda n: numbers().demux(2, by_parity, buffer_size=n),
    "groupby buffer_size": lambda n: numbers().groupby(by_parity, buffer_size=n),
    "groupby group_size": lambda n: numbers().groupby(by_parity, group_size=n),
    "unbatch unbatch_level": lambda n: numbers().batch(2).batch(2).unbatch(n),
    "header limit": lambda n: numbers().header(n),
    "cycle count": lambda n: numbers().cycle(n),
    "enumerate starting_index": lambda n: numbers().enumerate(n),
    "sharding num_of_instances": lambda n: numbers().sharding_filter().apply_sharding(n, 0),
    "sharding instance_id": lambda n: numbers().sharding_filter().apply_sharding(4, n),
    "map-style batch_size": lambda n: ours_map.SequenceWrapper(range(10)).batch(n),
}


@pytest.mark.parametrize("argument", COUNTS)
def test_a_float_count_is_refused_by_name(argument: str) -> None:
    name = argument.split()[-1]
    with pytest.raises(TypeError, match=rf"^{name} should be an int, but got {name}=2\.0 \(float\)$"):
        COUNTS[argument](2.0)


def _what_it_makes(built: Any) -> list:
    """All that a built pipe yields: a map-style one's items by index, several pipes' (fork's and
    demux's instances) side by side; the pipes that shuffle under one fixed seed."""
    with torch.random.fork_rng():
        torch.manual_seed(0)  # what an unseeded shuffle draws its seed from
        if isinstance(built, (list, tuple)):
            return list(zip(*built))  # in step: no instance runs ahead of its buffer
        if isinstance(built, MapDataPipe):
            return [built[index] for index in range(len(built))]
        return list(built)


# A fresh one for each test: a pipe that changed the one it was given must not change the next test.
OTHER_TWOS: dict[str, Callable[[], Any]] = {"numpy": lambda: np.int64(2), "tensor": lambda: torch.tensor(2)}


def _other_integer_cases() -> Iterator[Any]:
    for kind in OTHER_TWOS:
        for argument in COUNTS:
            yield pytest.param(argument, kind, id=f"{kind}-{argument}")


@pytest.mark.parametrize(("argument", "kind"), list(_other_integer_cases()))
def test_integers_of_other_types_are_accepted(argument: str, kind: str) -> None:
    # Accepted, and taken as the same count: the pipe makes what it makes with a plain 2, and
    # leaves the caller's object as it was (a tensor counted in place was every index it gave).
    two = OTHER_TWOS[kind]()
    assert _what_it_makes(COUNTS[argument](two)) == _what_it_makes(COUNTS[argument](2))
    assert two == 2


def test_torchs_batch_takes_a_float_and_makes_one_batch_of_everything() -> None:
    # what a float count does to torch's pipe: the reason it is refused here
    assert list(theirs.IterableWrapper(range(10)).batch(2.5)) == [list(range(10))]


def test_a_negative_shard_number_is_refused_instead_of_yielding_nothing() -> None:
    torchs = theirs.IterableWrapper(range(10)).sharding_filter()
    torchs.apply_sharding(4, -1)
    assert list(torchs) == []
    with pytest.raises(ValueError, match=r"instance_id\(-1\) should be at least 0"):
        numbers().sharding_filter().apply_sharding(4, -1)


def test_a_negative_header_limit_is_refused_by_name() -> None:
    with pytest.raises(ValueError, match=r"limit should be None \(no limit\) or at least 0, but got limit=-1"):
        numbers().header(-1)
    assert list(numbers().header(0)) == []


def test_counts_below_their_minimum_keep_torchs_errors() -> None:
    with pytest.raises(AssertionError, match=r"^Batch size is required to be larger than 0! \(got batch_size=0\)"):
        numbers().batch(0)
    with pytest.raises(AssertionError, match=r"^buffer_size should be larger than 0 \(got buffer_size=0\)"):
        numbers().shuffle(buffer_size=0)
    with pytest.raises(ValueError, match="^Expected `num_instances` larger than 0, but 0 is found"):
        numbers().fork(0)
