"""Samplers against torch.utils.data as the oracle: same seed, same indices, same error types."""

from __future__ import annotations

import itertools
import functools
import pickle
import tracemalloc
from collections.abc import Callable, Iterator
from typing import Any

import numpy as np
import pytest
import torch
import torch.utils.data as tud

import pipeload
import pipeload.samplers as ours
from pipeload.samplers import _InfiniteConstantSampler
from oracle import generator, raises_like_torch


same_error = functools.partial(raises_like_torch, tud, ours)


# ---------------------------------------------------------------- SequentialSampler


@pytest.mark.parametrize("size", [0, 1, 7, 100])
def test_sequential_matches_torch(size: int) -> None:
    data = list(range(size))
    assert list(ours.SequentialSampler(data)) == list(tud.SequentialSampler(data))
    assert len(ours.SequentialSampler(data)) == size


# ---------------------------------------------------------------- RandomSampler

RANDOM_CASES = [
    (size, replacement, num_samples)
    for size in (1, 5, 32, 33, 100)
    for replacement in (False, True)
    for num_samples in (None, 1, 31, 32, 33, 64, 250)
]


@pytest.mark.parametrize(("size", "replacement", "num_samples"), RANDOM_CASES)
@pytest.mark.parametrize("seed", [0, 7])
def test_random_with_generator_matches_torch(
    size: int, replacement: bool, num_samples: int | None, seed: int
) -> None:
    theirs = tud.RandomSampler(range(size), replacement, num_samples, generator=generator(seed))
    mine = ours.RandomSampler(range(size), replacement, num_samples, generator=generator(seed))
    for _epoch in range(3):  # the shared generator carries state across epochs
        assert list(mine) == list(theirs)
    assert len(mine) == len(theirs)
    assert mine.generator.get_state().equal(theirs.generator.get_state())


@pytest.mark.parametrize(("size", "replacement", "num_samples"), RANDOM_CASES[::3])
def test_random_without_generator_uses_global_rng_like_torch(
    size: int, replacement: bool, num_samples: int | None
) -> None:
    torch.manual_seed(123)
    expected = [list(tud.RandomSampler(range(size), replacement, num_samples)) for _ in range(2)]
    after_theirs = torch.get_rng_state()
    torch.manual_seed(123)
    got = [list(ours.RandomSampler(range(size), replacement, num_samples)) for _ in range(2)]
    assert got == expected
    assert torch.get_rng_state().equal(after_theirs)


@pytest.mark.parametrize("module", [tud, ours], ids=["torch", "pipeload"])
def test_random_seed_is_drawn_at_first_next_not_at_iter(module: Any) -> None:
    sampler = module.RandomSampler(range(50))
    torch.manual_seed(1)
    started = iter(sampler)
    torch.manual_seed(2)  # the seed must come from here, when the first index is asked for
    first_run = list(started)
    torch.manual_seed(2)
    assert list(sampler) == first_run


def test_random_interleaved_iterators_match_torch() -> None:
    def run(module: Any) -> list[int]:
        sampler = module.RandomSampler(range(40), generator=generator(3))
        a, b = iter(sampler), iter(sampler)
        return [next(a), next(b), *itertools.islice(a, 5), *itertools.islice(b, 5)]

    assert run(ours) == run(tud)


def test_random_num_samples_follows_data_length() -> None:
    data = [1, 2, 3]
    sampler = ours.RandomSampler(data)
    data.append(4)
    assert len(sampler) == 4 and sorted(sampler) == [0, 1, 2, 3]


@pytest.mark.parametrize("replacement", [0, 1, None, "yes", 1.0])
def test_random_rejects_non_bool_replacement(replacement: object) -> None:
    err = same_error(lambda m: m.RandomSampler(range(3), replacement=replacement))
    assert f"replacement={replacement!r}" in str(err.value)


@pytest.mark.parametrize("num_samples", [0, -1, 1.5, "3", np.float64(2.0), False])
def test_random_rejects_bad_num_samples(num_samples: object) -> None:
    err = same_error(lambda m: m.RandomSampler(range(3), num_samples=num_samples))
    assert f"num_samples={num_samples!r}" in str(err.value)


def test_random_rejects_empty_data_without_num_samples() -> None:
    err = same_error(lambda m: m.RandomSampler([]))
    assert "num_samples=0" in str(err.value)


@pytest.mark.parametrize("replacement", [False, True])
def test_random_empty_data_with_num_samples_behaves_like_torch(replacement: bool) -> None:
    def run(module: Any) -> list[int]:
        return list(module.RandomSampler([], replacement, num_samples=3, generator=generator(0)))

    same_error(run)


def test_random_accepts_true_as_num_samples_like_torch() -> None:
    # bool is an int in Python; torch accepts num_samples=True (one sample), and so do we.
    assert len(list(tud.RandomSampler(range(5), num_samples=True))) == 1
    assert len(list(ours.RandomSampler(range(5), num_samples=True))) == 1


# ---------------------------------------------------------------- SubsetRandomSampler


@pytest.mark.parametrize("indices", [[], [4], [9, 3, 5, 1], list(range(0, 200, 3))])
@pytest.mark.parametrize("seed", [0, 5])
def test_subset_random_matches_torch(indices: list[int], seed: int) -> None:
    theirs = tud.SubsetRandomSampler(indices, generator=generator(seed))
    mine = ours.SubsetRandomSampler(indices, generator=generator(seed))
    for _epoch in range(2):
        assert list(mine) == list(theirs)
    assert len(mine) == len(indices)
    torch.manual_seed(seed)
    expected = list(tud.SubsetRandomSampler(indices))
    torch.manual_seed(seed)
    assert list(ours.SubsetRandomSampler(indices)) == expected


def test_subset_random_keeps_index_objects() -> None:
    indices = torch.tensor([10, 20, 30])
    theirs = list(tud.SubsetRandomSampler(indices, generator=generator(0)))
    mine = list(ours.SubsetRandomSampler(indices, generator=generator(0)))
    assert [type(i) for i in mine] == [type(i) for i in theirs]
    assert [int(i) for i in mine] == [int(i) for i in theirs]


# ---------------------------------------------------------------- WeightedRandomSampler

WEIGHTS = [
    [1.0],
    [0.1, 0.9, 0.4, 0.7, 3.0, 0.6],
    [0.0, 0.0, 1.0, 2.0],
    torch.rand(50, generator=generator(9)).tolist(),
]


# Without replacement, multinomial refuses more draws than there are positive weights.
WEIGHTED_CASES = [
    (weights, replacement, num_samples)
    for weights in WEIGHTS
    for replacement in (True, False)
    for num_samples in (1, 2, 7, 40)
    if replacement or num_samples <= sum(w > 0 for w in weights)
]


@pytest.mark.parametrize(("weights", "replacement", "num_samples"), WEIGHTED_CASES)
@pytest.mark.parametrize("as_type", ["list", "tensor", "numpy"])
def test_weighted_matches_torch(
    weights: list[float], replacement: bool, num_samples: int, as_type: str
) -> None:
    converted: Any = {"list": weights, "tensor": torch.tensor(weights),
                      "numpy": np.array(weights)}[as_type]
    theirs = tud.WeightedRandomSampler(converted, num_samples, replacement, generator(4))
    mine = ours.WeightedRandomSampler(converted, num_samples, replacement, generator(4))
    for _epoch in range(2):
        assert list(mine) == list(theirs)
    assert len(mine) == num_samples
    assert mine.weights.dtype == torch.double and mine.weights.equal(theirs.weights)


def test_weighted_without_generator_uses_global_rng_like_torch() -> None:
    torch.manual_seed(11)
    expected = list(tud.WeightedRandomSampler(WEIGHTS[1], 20))
    torch.manual_seed(11)
    assert list(ours.WeightedRandomSampler(WEIGHTS[1], 20)) == expected


@pytest.mark.parametrize("num_samples", [0, -2, True, 2.0, "3", None])
def test_weighted_rejects_bad_num_samples(num_samples: object) -> None:
    err = same_error(lambda m: m.WeightedRandomSampler([1.0, 2.0], num_samples))
    assert f"num_samples={num_samples!r}" in str(err.value)


@pytest.mark.parametrize("replacement", [0, 1, None, "no"])
def test_weighted_rejects_non_bool_replacement(replacement: object) -> None:
    err = same_error(lambda m: m.WeightedRandomSampler([1.0, 2.0], 1, replacement))
    assert f"replacement={replacement!r}" in str(err.value)


@pytest.mark.parametrize("weights", [[[1.0, 2.0]], 3.0, torch.ones(2, 2)])
def test_weighted_rejects_wrong_shape(weights: object) -> None:
    err = same_error(lambda m: m.WeightedRandomSampler(weights, 1))
    assert "shape" in str(err.value)


@pytest.mark.parametrize(
    ("weights", "names"),
    [
        ([1.0, -1.0], "negative"),
        ([1.0, float("nan")], "finite"),
        ([float("inf"), 1.0], "finite"),
        ([0.0, 0.0], "sum"),
        ([], "sum"),
    ],
)
def test_weighted_rejects_bad_weights(weights: list[float], names: str) -> None:
    # torch only notices at the first iteration; we refuse at construction. Same type.
    err = same_error(lambda m: list(m.WeightedRandomSampler(weights, 2)))
    assert names in str(err.value)


def test_weighted_rejects_too_many_draws_without_replacement() -> None:
    err = same_error(lambda m: list(m.WeightedRandomSampler([1.0, 2.0], 3, replacement=False)))
    assert "num_samples=3" in str(err.value)


def test_weighted_rejects_non_numeric_weights() -> None:
    same_error(lambda m: m.WeightedRandomSampler("ab", 1))


# ---------------------------------------------------------------- BatchSampler


def key_sources(size: int) -> dict[str, Callable[[Any], Any]]:
    return {
        "range": lambda m: range(size),
        "list": lambda m: list(range(size))[::-1],
        "sequential": lambda m: m.SequentialSampler(range(size)),
        "random": lambda m: m.RandomSampler(range(size), generator=generator(size)),
        "torch_random": lambda m: tud.RandomSampler(range(size), generator=generator(size)),
    }


# A RandomSampler over no data is refused at construction, so no random source of size 0.
BATCH_SOURCES = [(size, source) for size in (0, 1, 6, 10, 31) for source in key_sources(0)
                 if size > 0 or "random" not in source]


@pytest.mark.parametrize(("size", "source"), BATCH_SOURCES)
@pytest.mark.parametrize("batch_size", [1, 3, 5, 10, 40])
@pytest.mark.parametrize("drop_last", [False, True])
def test_batch_matches_torch(size: int, source: str, batch_size: int, drop_last: bool) -> None:
    make = key_sources(size)[source]
    theirs = tud.BatchSampler(make(tud), batch_size, drop_last)
    mine = ours.BatchSampler(make(ours), batch_size, drop_last)
    assert list(mine) == list(theirs)
    assert list(mine) == list(theirs)  # a second epoch too
    assert len(mine) == len(theirs) == len(list(mine))


def test_batch_accepts_a_one_shot_iterator() -> None:
    mine = ours.BatchSampler(iter(range(7)), 3, drop_last=False)
    assert list(mine) == [[0, 1, 2], [3, 4, 5], [6]]
    assert list(mine) == []


@pytest.mark.parametrize("batch_size", [0, -1, True, False, 1.5, 2.0, "2", None, np.float32(3)])
def test_batch_rejects_bad_batch_size(batch_size: object) -> None:
    err = same_error(lambda m: m.BatchSampler(range(4), batch_size, False))
    assert f"batch_size={batch_size!r}" in str(err.value)


@pytest.mark.parametrize("drop_last", [0, 1, None, "yes"])
def test_batch_rejects_non_bool_drop_last(drop_last: object) -> None:
    err = same_error(lambda m: m.BatchSampler(range(4), 2, drop_last))
    assert f"drop_last={drop_last!r}" in str(err.value)


def test_batch_len_of_unsized_sampler_is_a_type_error() -> None:
    same_error(lambda m: len(m.BatchSampler(iter(range(4)), 2, False)))


# ---------------------------------------------------------------- DistributedSampler

DISTRIBUTED_CASES = [
    (size, replicas, rank)
    for size in (0, 1, 2, 5, 10, 13)
    for replicas in (1, 2, 3, 4, 7)
    for rank in range(replicas)
]


@pytest.mark.parametrize(("size", "replicas", "rank"), DISTRIBUTED_CASES)
@pytest.mark.parametrize("shuffle", [True, False])
@pytest.mark.parametrize("drop_last", [False, True])
def test_distributed_matches_torch(
    size: int, replicas: int, rank: int, shuffle: bool, drop_last: bool
) -> None:
    args = (range(size), replicas, rank, shuffle, 17, drop_last)
    theirs, mine = tud.DistributedSampler(*args), ours.DistributedSampler(*args)
    for epoch in (0, 1, 5):
        theirs.set_epoch(epoch)
        mine.set_epoch(epoch)
        assert list(mine) == list(theirs)
    assert len(mine) == len(theirs)
    assert (mine.num_samples, mine.total_size) == (theirs.num_samples, theirs.total_size)


@pytest.mark.parametrize("drop_last", [False, True])
def test_distributed_ranks_cover_the_dataset(drop_last: bool) -> None:
    shares = [list(ours.DistributedSampler(range(11), 4, rank, seed=3, drop_last=drop_last))
              for rank in range(4)]
    assert len({len(share) for share in shares}) == 1
    seen = set(itertools.chain.from_iterable(shares))
    assert seen <= set(range(11))
    assert len(seen) == (8 if drop_last else 11)


def test_distributed_epoch_changes_order() -> None:
    sampler = ours.DistributedSampler(range(50), 1, 0)
    first = list(sampler)
    assert list(sampler) == first
    sampler.set_epoch(1)
    assert list(sampler) != first


@pytest.mark.parametrize(
    "kwargs", [{}, {"num_replicas": 2}, {"rank": 0}], ids=["neither", "no_rank", "no_replicas"]
)
def test_distributed_without_process_group_raises_like_torch(kwargs: dict[str, int]) -> None:
    import torch.distributed as dist

    if dist.is_available() and dist.is_initialized():
        pytest.skip("a process group is initialised in this process")
    same_error(lambda m: m.DistributedSampler(range(4), **kwargs))


@pytest.mark.parametrize(("replicas", "rank"), [(2, 2), (2, -1), (1, 5), (0, 0), (-1, 0)])
def test_distributed_rejects_rank_outside_range(replicas: int, rank: int) -> None:
    err = same_error(lambda m: m.DistributedSampler(range(4), num_replicas=replicas, rank=rank))
    assert f"rank={rank}" in str(err.value) and f"num_replicas={replicas}" in str(err.value)


# ---------------------------------------------------------------- the rest


def test_infinite_constant_sampler_yields_none_forever() -> None:
    assert list(itertools.islice(_InfiniteConstantSampler(), 1000)) == [None] * 1000


def test_base_sampler_iter_not_implemented() -> None:
    same_error(lambda m: iter(m.Sampler()))


class Evens(ours.Sampler[int]):
    def __init__(self, size: int) -> None:
        self.size = size

    def __iter__(self) -> Iterator[int]:
        return iter(range(0, self.size, 2))

    def __len__(self) -> int:
        return (self.size + 1) // 2


def test_generic_sampler_subclass() -> None:
    assert ours.Sampler[int] is not None
    assert list(ours.BatchSampler(Evens(9), 2, drop_last=False)) == [[0, 2], [4, 6], [8]]


@pytest.mark.parametrize(
    "make",
    [
        lambda m: m.SequentialSampler(range(9)),
        lambda m: m.RandomSampler(range(9), generator=generator(2)),
        lambda m: m.RandomSampler(range(9), True, 20, generator=generator(2)),
        lambda m: m.SubsetRandomSampler([1, 5, 7], generator=generator(2)),
        lambda m: m.WeightedRandomSampler([1.0, 2.0, 3.0], 6, generator=generator(2)),
        lambda m: m.BatchSampler(m.RandomSampler(range(9), generator=generator(2)), 4, True),
        lambda m: m.DistributedSampler(range(9), 2, 1, seed=4),
    ],
)
def test_pickled_sampler_gives_the_same_order(make: Callable[[Any], Any]) -> None:
    sampler = make(ours)
    copy = pickle.loads(pickle.dumps(sampler))
    first_epoch = list(copy)
    assert first_epoch == list(make(tud))
    assert first_epoch == list(sampler)


@pytest.mark.parametrize("shuffle_kind", ["sequential", "random"])
@pytest.mark.parametrize("as_batch_sampler", [False, True])
def test_our_samplers_drive_torch_dataloader(shuffle_kind: str, as_batch_sampler: bool) -> None:
    data = torch.arange(23)

    def batches(module: Any) -> list[torch.Tensor]:
        if shuffle_kind == "random":
            sampler = module.RandomSampler(data, generator=generator(8))
        else:
            sampler = module.SequentialSampler(data)
        if as_batch_sampler:
            batch_sampler = module.BatchSampler(sampler, 5, drop_last=False)
            return list(tud.DataLoader(data, batch_sampler=batch_sampler))
        return list(tud.DataLoader(data, batch_size=5, sampler=sampler))

    mine, theirs = batches(ours), batches(tud)
    assert len(mine) == len(theirs)
    assert all(a.equal(b) for a, b in zip(mine, theirs, strict=True))


def test_torch_samplers_inside_our_batch_sampler() -> None:
    inner = tud.WeightedRandomSampler([1.0, 0.0, 2.0], 7, generator=generator(1))
    expected = list(tud.BatchSampler(
        tud.WeightedRandomSampler([1.0, 0.0, 2.0], 7, generator=generator(1)), 3, False))
    assert list(ours.BatchSampler(inner, 3, drop_last=False)) == expected


def test_batch_sizes_are_known_only_where_the_sampler_says_them_exactly() -> None:
    # What the stats derive an untimed batch's samples from (stats/clock.py: untimed_size).
    assert ours.batch_sizes(ours.BatchSampler(ours.SequentialSampler(range(10)), 4, False), True) == (4, 2)
    assert ours.batch_sizes(tud.BatchSampler(tud.RandomSampler(range(10)), 3, True), True) == (3, 2)
    assert ours.batch_sizes(ours.SequentialSampler(range(10)), False) == (1, None)  # one sample a task
    assert ours.batch_sizes([[0, 1], [2]], True) is None  # a batch sampler of its own: anything goes

    class Sub(ours.BatchSampler):
        pass

    assert ours.batch_sizes(Sub(ours.SequentialSampler(range(10)), 4, False), True) is None
    assert ours.batch_sizes(ours.BatchSampler(range(10), 4, False), True) is None  # not an exact sampler


@pytest.mark.parametrize("make", [
    lambda keys: ours.RandomSampler(range(keys)),
    lambda keys: ours.RandomSampler(range(keys), num_samples=keys + 5),
    lambda keys: ours.SubsetRandomSampler(range(keys)),
    lambda keys: ours.DistributedSampler(range(keys), num_replicas=2, rank=1),
    lambda keys: ours.DistributedSampler(range(keys), num_replicas=3, rank=0, shuffle=False),
], ids=["random", "random-more", "subset", "distributed", "distributed-in-order"])
def test_an_iteration_holds_its_order_in_a_tensor_not_as_python_ints(make) -> None:
    # A list of an epoch's keys costs ~38 bytes a key in the main process, and iterating it
    # writes to every int (reference counts): the pages of a list made before a worker's fork
    # became that worker's own as the main process read on (a review: +150 MiB for 4 million
    # keys). The tensor costs 8 bytes a key, outside Python's allocator.
    keys = 200_000
    sampler = make(keys)
    torch.manual_seed(0)
    expected = list(sampler)
    torch.manual_seed(0)
    tracemalloc.start()
    try:
        iterator = iter(sampler)
        first = next(iterator)
        held = tracemalloc.get_traced_memory()[0]
    finally:
        tracemalloc.stop()
    assert held < keys  # under 1 byte a key (a list of the keys: ~36)
    assert [first, *iterator] == expected


@pytest.mark.parametrize("weights", [[-1.0, float("nan"), 3.0], [float("nan"), 1.0], [float("inf"), -1.0, 1.0],
                                     [float("-inf"), 1.0]])
@pytest.mark.parametrize("num_samples, replacement", [(2, True), (1, True), (2, False)])
def test_bad_weights_are_refused_with_the_words_torch_uses_for_that_draw(weights: list[float], num_samples: int,
                                                                        replacement: bool) -> None:
    # torch.multinomial has two sentences: one drawing several with replacement, one otherwise.
    with pytest.raises(RuntimeError) as theirs:
        list(torch.utils.data.WeightedRandomSampler(weights, num_samples, replacement))
    sampler = ours.WeightedRandomSampler(weights, num_samples, replacement)  # built, as torch's is
    with pytest.raises(RuntimeError) as mine:
        list(sampler)
    assert str(mine.value).startswith(str(theirs.value))


def test_weights_are_checked_when_drawn_so_placeholders_may_be_filled_in_first() -> None:
    # torch's sampler takes any weights of the right shape and fails only when drawing: code
    # that builds it with zeros and fills them in before the epoch broke at the constructor.
    sampler = ours.WeightedRandomSampler([0.0, 0.0, 0.0], 4)
    assert len(sampler) == 4
    with pytest.raises(RuntimeError, match=r"^invalid multinomial distribution \(sum of probabilities <= 0\)"):
        list(sampler)
    sampler.weights = torch.tensor([0.0, 1.0, 0.0], dtype=torch.double)
    assert list(sampler) == [1, 1, 1, 1]
    # Two faults: torch's loader names the one it checks first, the shuffle, as ours does now.
    too_many = ours.WeightedRandomSampler([1.0, 1.0], 5, replacement=False)
    with pytest.raises(ValueError, match="sampler option is mutually exclusive with shuffle"):
        pipeload.DataLoader(range(2), sampler=too_many, shuffle=True)


def test_only_our_samplers_drawing_from_the_global_generator_at_most_may_draw_between_worker_forks():
    from pipeload.samplers import draws_unseen_by_workers

    data = list(range(6))
    own = torch.Generator().manual_seed(0)
    unseen = [ours.SequentialSampler(data), ours.RandomSampler(data),
              ours.SubsetRandomSampler([1, 2]), ours.WeightedRandomSampler([1.0, 2.0], 3),
              ours.DistributedSampler(data, num_replicas=2, rank=0),
              ours.BatchSampler(ours.RandomSampler(data), 2, False)]
    seen = [ours.RandomSampler(data, generator=own), ours.SubsetRandomSampler([1], generator=own),
            ours.BatchSampler(ours.RandomSampler(data, generator=own), 2, False),
            torch.utils.data.RandomSampler(data),  # torch's own: anything may change
            type("Mine", (ours.RandomSampler,), {})(data),  # a subclass may draw from anything
            ours.BatchSampler(data, 2, False), iter(data)]
    assert [draws_unseen_by_workers(s) for s in unseen] == [True] * len(unseen)
    assert [draws_unseen_by_workers(s) for s in seen] == [False] * len(seen)
    halfway = ours.RandomSampler(data)
    next(iter(halfway))
    loaded = ours.RandomSampler(data)
    loaded.load_state_dict(halfway.state_dict())
    # A loaded iteration replays its draws under a borrowed global generator state.
    assert not draws_unseen_by_workers(loaded)
    assert not draws_unseen_by_workers(ours.BatchSampler(loaded, 2, False))
