"""Operations torch never had (flatmap, padded_batch, bucketbatch, in_batch_shuffle, cycle, header,
enumerate, in_memory_cache) and the checkpoint hooks of stateful runs."""

from __future__ import annotations

import collections
import random
from typing import Any

import pytest
import torch
from pipes_for_tests import Counting, add_one, double

from pipeload.datapipes import DataChunk, graph
from pipeload.datapipes.iter import IterableWrapper


def test_flatmap() -> None:
    assert list(IterableWrapper(["ab", "", "c"]).flatmap(list)) == ["a", "b", "c"]
    assert list(IterableWrapper([[1, 2], [3]]).flatmap()) == [1, 2, 3]
    rows = [(1, [7, 8]), (2, [9])]
    assert list(IterableWrapper(rows).flatmap(lambda xs: [x * 10 for x in xs], input_col=1)) == [70, 80, 90]
    with pytest.raises(ValueError, match="takes 2 positional parameters, but 1 are required"):
        IterableWrapper(rows).flatmap(lambda a, b: [a], input_col=1)


Point = collections.namedtuple("Point", "tokens label")


def test_padded_batch_pads_tensors_lists_and_fields_to_the_longest() -> None:
    items = [torch.ones(2, 3), torch.ones(4, 1)]
    (batch,) = IterableWrapper(items).padded_batch(2, padding_value=-1)
    assert [tuple(t.shape) for t in batch] == [(4, 3), (4, 3)]
    assert batch[0][2:].eq(-1).all() and batch[1][:, 1:].eq(-1).all() and batch[1][:, 0].eq(1).all()
    (collated,) = IterableWrapper(items).padded_batch(2).collate()
    assert collated.shape == (2, 4, 3)

    rows = [Point([1, 2, 3], 0), Point([4], 1), Point([5, 6], 1)]
    batches = list(IterableWrapper(rows).padded_batch(2))
    assert batches == [[Point([1, 2, 3], 0), Point([4, 0, 0], 1)], [Point([5, 6], 1)]]
    dicts = [{"ids": [1], "text": "a"}, {"ids": [2, 3], "text": "bc"}]
    assert list(IterableWrapper(dicts).padded_batch(2)) == [
        [{"ids": [1, 0], "text": "a"}, {"ids": [2, 3], "text": "bc"}]
    ]
    assert list(IterableWrapper(range(5)).padded_batch(2, drop_last=True)) == [[0, 1], [2, 3]]
    with pytest.raises(ValueError, match=r"same number of dimensions.*\[\(2,\), \(2, 2\)\]"):
        list(IterableWrapper([torch.ones(2), torch.ones(2, 2)]).padded_batch(2))


def by_length(bucket: list[list[int]]) -> list[list[int]]:
    return sorted(bucket, key=len)


def sentences(count: int) -> list[list[int]]:
    generator = torch.Generator().manual_seed(0)
    return [[0] * int(torch.randint(1, 40, (1,), generator=generator)) for _ in range(count)]


@pytest.mark.parametrize("in_batch", [True, False])
def test_bucketbatch_groups_similar_lengths_and_keeps_every_item(in_batch: bool) -> None:
    data = sentences(200)
    pipe = IterableWrapper(data).bucketbatch(
        8, batch_num=5, bucket_num=2, sort_key=by_length, use_in_batch_shuffle=in_batch
    ).set_seed(1)
    batches = list(pipe)
    assert sorted(map(len, sum(batches, []))) == sorted(map(len, data))
    assert len(batches) == len(pipe) == 25
    spread = sum(max(map(len, b)) - min(map(len, b)) for b in batches) / len(batches)
    plain = list(IterableWrapper(data).batch(8))
    plain_spread = sum(max(map(len, b)) - min(map(len, b)) for b in plain) / len(plain)
    assert spread < plain_spread / 2
    assert list(pipe.set_seed(1)) == batches  # the same seed, the same batches
    assert list(pipe.set_seed(2)) != batches


def test_bucketbatch_options() -> None:
    unshuffled = IterableWrapper(range(10)).bucketbatch(3, batch_num=2, sort_key=sorted).set_shuffle(False)
    assert list(unshuffled) == [[0, 1, 2], [3, 4, 5], [6, 7, 8], [9]]
    dropped = IterableWrapper(range(10)).bucketbatch(3, drop_last=True, batch_num=2)
    assert sorted(len(b) for b in dropped) == [3, 3, 3]
    with pytest.raises(AssertionError, match="Number of buckets is required to be larger than 0"):
        IterableWrapper([]).bucketbatch(3, bucket_num=0)


@pytest.mark.parametrize("in_batch", [True, False])
def test_one_bucket_with_a_sort_key_holds_consecutive_items_as_torchdatas_does(in_batch: bool) -> None:
    # torchdata shuffles items only with several buckets or no sort_key: items were mixed
    # across buckets here when use_in_batch_shuffle was False.
    pipe = IterableWrapper(range(40)).bucketbatch(2, batch_num=5, sort_key=sorted, use_in_batch_shuffle=in_batch)
    in_order = [[i, i + 1] for i in range(0, 40, 2)]
    orders = []
    for seed in range(5):
        batches = list(pipe.set_seed(seed))
        assert sorted(batches) == in_order, batches
        # each run of 5 batches (a bucket, here a pool) is 10 consecutive items
        assert [sorted(sum(batches[start:start + 5], [])) for start in range(0, 20, 5)] == [
            list(range(start, start + 10)) for start in range(0, 40, 10)]
        orders.append(batches)
    if in_batch:  # torchdata's batch shuffle runs over bucket_num batches: one leaves them in order
        assert orders == [in_order] * 5
    else:  # the pool's batches are shuffled
        assert any(order != in_order for order in orders)


def test_in_batch_shuffle_draws_torchdatas_stream() -> None:
    batches = [list(range(i, i + 4)) for i in range(0, 20, 4)] + [[20, 21]]
    pipe = IterableWrapper(batches).in_batch_shuffle()
    rng = random.Random(7)  # torchdata: one random.Random per run, seeded, sample() per batch
    expected = [rng.sample(batch, len(batch)) for batch in batches]
    shuffled = list(pipe.set_seed(7))
    assert shuffled == expected and all(type(batch) is DataChunk for batch in shuffled)
    assert list(pipe) != expected  # the seed served one run; the next draws its own
    assert len(pipe) == len(batches)
    assert list(pipe.set_shuffle(False)) == batches


def test_in_batch_shuffle_is_seeded_by_the_graph_and_the_global_generator() -> None:
    def run(seed: int) -> list[Any]:
        pipe = IterableWrapper(range(30)).batch(5).in_batch_shuffle()
        return list(graph.apply_random_seed(pipe, torch.Generator().manual_seed(seed)))

    assert run(1) == run(1) != run(2)
    assert all(sorted(batch) == list(range(i, i + 5)) for i, batch in zip(range(0, 30, 5), run(3)))
    pipe = IterableWrapper(range(30)).batch(5).in_batch_shuffle()
    epochs = []
    for _ in range(2):
        torch.manual_seed(0)
        epochs.append(list(pipe))
    assert epochs[0] == epochs[1]


def test_cycle() -> None:
    assert list(IterableWrapper(range(2)).cycle(3)) == [0, 1, 0, 1, 0, 1]
    assert list(IterableWrapper(range(2)).cycle(0)) == []
    forever = iter(IterableWrapper("ab").cycle())
    assert [next(forever) for _ in range(5)] == list("ababa")
    assert list(IterableWrapper([]).cycle()) == []  # nothing to repeat: ends instead of spinning
    assert len(IterableWrapper(range(4)).cycle(2)) == 8
    with pytest.raises(TypeError, match="cycles forever"):
        len(IterableWrapper(range(4)).cycle())
    with pytest.raises(ValueError, match="Expected non-negative count, got -1"):
        IterableWrapper([]).cycle(-1)


def test_header_reads_no_further_than_its_limit() -> None:
    counter = [0]
    pipe = Counting(100, counter).header(3)
    assert list(pipe) == [0, 1, 2] and counter == [3]
    assert list(IterableWrapper(range(2)).header(5)) == [0, 1]
    assert list(IterableWrapper(range(4)).header(None)) == [0, 1, 2, 3]
    assert len(IterableWrapper(range(2)).header(5)) == 2
    assert len(IterableWrapper(iter(range(9))).header(5)) == 5


def test_enumerate() -> None:
    assert list(IterableWrapper("ab").enumerate()) == [(0, "a"), (1, "b")]
    assert list(IterableWrapper("ab").enumerate(starting_index=10)) == [(10, "a"), (11, "b")]
    assert len(IterableWrapper("abc").enumerate()) == 3


def test_in_memory_cache_replays_without_reading_the_source_again() -> None:
    counter = [0]
    pipe = Counting(5, counter).map(double).in_memory_cache()
    assert list(pipe) == [0, 2, 4, 6, 8] and counter == [5]
    assert list(pipe) == [0, 2, 4, 6, 8] and counter == [5]
    partial = Counting(5, [0]).in_memory_cache()
    assert list(partial.header(2)) == [0, 1]
    assert list(partial) == list(range(5))  # an unfinished pass caches nothing


def test_in_memory_cache_keeps_the_tail_that_fits() -> None:
    counter = [0]
    items = [torch.zeros(1024 * 256, dtype=torch.uint8) + i for i in range(8)]  # 256 KiB each
    pipe = Counting(8, counter).map(lambda i: items[i]).in_memory_cache(size=1)
    first = [int(t[0]) for t in pipe]
    assert counter == [8]
    assert [int(t[0]) for t in pipe] == first == list(range(8))
    assert counter == [8 + 4]  # 4 items fit in 1 MB; the first 4 were read again


def not_multiple_of_three(x: int) -> bool:
    return x % 3 > 0


@pytest.mark.parametrize("build", [
    lambda: IterableWrapper(range(20)).map(add_one),
    lambda: IterableWrapper(range(20)).filter(not_multiple_of_three),
    lambda: IterableWrapper(range(20)).header(15).enumerate(3),
    lambda: IterableWrapper(range(20)).sharding_filter().apply_sharding(3, 1),
    lambda: IterableWrapper(range(20)).batch(3),
    lambda: IterableWrapper(range(6)).cycle(3),
    lambda: IterableWrapper(range(3)).concat(IterableWrapper(range(3, 6)), IterableWrapper([6])),
    lambda: IterableWrapper(range(20)).shuffle(buffer_size=5).set_seed(4),
    lambda: IterableWrapper(range(20)).batch(3).in_batch_shuffle().set_seed(4),
])
@pytest.mark.parametrize("taken", [0, 1, 4])
def test_stateful_runs_resume_from_a_state_dict(build: Any, taken: int) -> None:
    expected = list(build())[taken:]
    pipe = build()
    it = iter(pipe)
    for _ in range(taken):
        next(it)
    state = it.state_dict()
    if hasattr(pipe, "set_seed"):
        pipe.set_seed(999)  # the state, not the seed, decides what follows
    fresh = iter(pipe)
    fresh.load_state_dict(state)
    assert list(fresh) == expected


def test_a_plain_iterator_says_it_cannot_be_checkpointed() -> None:
    it = iter(Counting(3, [0]).map(add_one))
    next(it)
    with pytest.raises(NotImplementedError, match="can only be resumed by skipping"):
        it.state_dict()
