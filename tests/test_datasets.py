"""Datasets against torch.utils.data as the oracle: same samples, same splits, same error types."""

from __future__ import annotations

import functools
import pickle
import warnings
from collections.abc import Callable, Iterator
from typing import Any

import pytest
import torch
import torch.utils.data as tud

import pipeload
import pipeload.datasets as ours
from oracle import generator, raises_like_torch


same_error = functools.partial(raises_like_torch, tud, ours)


def assert_same_sample(a: Any, b: Any) -> None:
    if isinstance(a, torch.Tensor):
        assert isinstance(b, torch.Tensor) and a.equal(b)
    elif isinstance(a, (tuple, list)):
        assert type(a) is type(b) and len(a) == len(b)
        for x, y in zip(a, b, strict=True):
            assert_same_sample(x, y)
    elif isinstance(a, dict):
        assert type(a) is type(b) and list(a) == list(b)
        for key in a:
            assert_same_sample(a[key], b[key])
    else:
        assert a == b


class Squares(ours.Dataset[int]):
    """A small map-style dataset of ours."""

    def __init__(self, size: int) -> None:
        self.size = size

    def __getitem__(self, index: int) -> int:
        if not 0 <= index < self.size:
            raise IndexError(index)
        return index * index

    def __len__(self) -> int:
        return self.size


class TorchCubes(tud.Dataset):
    """A user's torch map-style dataset."""

    def __init__(self, size: int) -> None:
        self.size = size

    def __getitem__(self, index: int) -> int:
        return index**3

    def __len__(self) -> int:
        return self.size


class Batched(ours.Dataset[int]):
    """Offers __getitems__, and counts how often it is used."""

    def __init__(self, size: int, short_by: int = 0) -> None:
        self.size, self.short_by, self.batched_calls = size, short_by, 0

    def __getitem__(self, index: int) -> int:
        return index + 1000

    def __getitems__(self, indices: list[int]) -> list[int]:
        self.batched_calls += 1
        return [i + 1000 for i in indices][: len(indices) - self.short_by]

    def __len__(self) -> int:
        return self.size


class Counter(ours.IterableDataset[int]):
    def __init__(self, start: int, stop: int) -> None:
        self.start, self.stop = start, stop

    def __iter__(self) -> Iterator[int]:
        return iter(range(self.start, self.stop))

    def __len__(self) -> int:
        return self.stop - self.start


class TorchCounter(tud.IterableDataset):
    def __init__(self, start: int, stop: int) -> None:
        self.start, self.stop = start, stop

    def __iter__(self) -> Iterator[int]:
        return iter(range(self.start, self.stop))

    def __len__(self) -> int:
        return self.stop - self.start


# ---------------------------------------------------------------- bases and generics


def test_base_dataset_getitem_not_implemented() -> None:
    same_error(lambda m: m.Dataset()[0])


def test_iterable_dataset_without_iter_cannot_be_made() -> None:
    same_error(lambda m: type("NoIter", (m.IterableDataset,), {})())


def test_generic_subclasses() -> None:
    class Records(ours.Dataset[dict]):
        def __getitem__(self, index: int) -> dict:
            return {"index": index}

        def __len__(self) -> int:
            return 2

    class Stream(ours.IterableDataset[str]):
        def __iter__(self) -> Iterator[str]:
            return iter("ab")

    assert Records()[1] == {"index": 1}
    assert list(Stream()) == ["a", "b"]
    assert ours.Dataset[int] is not None and ours.Subset[int] is not None


def test_add_makes_concat_and_chain() -> None:
    joined = Squares(2) + Squares(3)
    assert isinstance(joined, ours.ConcatDataset)
    assert [joined[i] for i in range(len(joined))] == [0, 1, 0, 1, 4]
    chained = Counter(0, 2) + Counter(5, 7)
    assert isinstance(chained, ours.ChainDataset)
    assert list(chained) == [0, 1, 5, 6]


# ---------------------------------------------------------------- TensorDataset


@pytest.mark.parametrize("shapes", [[(5,)], [(5, 3), (5,)], [(0, 2), (0,)], [(4, 2, 2)] * 3])
def test_tensor_dataset_matches_torch(shapes: list[tuple[int, ...]]) -> None:
    tensors = [torch.randn(shape, generator=generator(i)) for i, shape in enumerate(shapes)]
    theirs, mine = tud.TensorDataset(*tensors), ours.TensorDataset(*tensors)
    assert len(mine) == len(theirs)
    for index in [*range(len(theirs)), slice(0, 2), [0, 0]] if len(theirs) else []:
        assert_same_sample(mine[index], theirs[index])


def test_tensor_dataset_size_mismatch() -> None:
    err = same_error(lambda m: m.TensorDataset(torch.zeros(3), torch.zeros(4)))
    assert "[3, 4]" in str(err.value)


def test_tensor_dataset_of_no_tensors() -> None:
    same_error(lambda m: len(m.TensorDataset()))


# ---------------------------------------------------------------- ConcatDataset

PART_SIZES = [[3], [0, 4], [2, 0, 5], [1, 1, 1, 1], [0, 0, 3, 0]]


@pytest.mark.parametrize("sizes", PART_SIZES)
@pytest.mark.parametrize("part", ["ours", "torch", "range"])
def test_concat_matches_torch(sizes: list[int], part: str) -> None:
    make = {"ours": Squares, "torch": TorchCubes, "range": lambda n: range(10 * n, 11 * n)}[part]
    theirs = tud.ConcatDataset([make(n) for n in sizes])
    mine = ours.ConcatDataset([make(n) for n in sizes])
    assert len(mine) == len(theirs)
    assert mine.cumulative_sizes == theirs.cumulative_sizes
    for index in range(-len(theirs), len(theirs)):
        assert mine[index] == theirs[index]


def test_concat_accepts_any_iterable_and_mixes_kinds() -> None:
    mine = ours.ConcatDataset(iter([Squares(2), TorchCubes(2), [7]]))
    assert [mine[i] for i in range(5)] == [0, 1, 0, 1, 7]
    assert ours.ConcatDataset.cumsum([[1], [], [2, 3]]) == [1, 1, 3]


def test_concat_rejects_empty() -> None:
    same_error(lambda m: m.ConcatDataset([]))


@pytest.mark.parametrize("stream", [Counter(0, 2), TorchCounter(0, 2)], ids=["ours", "torch"])
def test_concat_rejects_iterable_parts(stream: object) -> None:
    same_error(lambda m: m.ConcatDataset([Squares(2), TorchCounter(0, 2)]))  # the oracle's type
    with pytest.raises(AssertionError, match=r"datasets\[1\] is"):
        ours.ConcatDataset([Squares(2), stream])


@pytest.mark.parametrize("index", [-6, -100])
def test_concat_rejects_too_negative_index(index: int) -> None:
    err = same_error(lambda m: m.ConcatDataset([range(2), range(3)])[index])
    assert f"idx={index}" in str(err.value)


@pytest.mark.parametrize("index", [5, 6, 100])
def test_concat_rejects_index_past_the_end(index: int) -> None:
    err = same_error(lambda m: m.ConcatDataset([range(2), range(3)])[index])
    assert f"idx={index}" in str(err.value)


def test_concat_old_attribute_name_warns() -> None:
    mine = ours.ConcatDataset([range(2), range(3)])
    with pytest.warns(FutureWarning):
        assert mine.cummulative_sizes == [2, 5]


# ---------------------------------------------------------------- ChainDataset


@pytest.mark.parametrize("kind", ["ours", "torch", "mixed"])
def test_chain_matches_torch(kind: str) -> None:
    parts: dict[str, list[Any]] = {
        "ours": [Counter(0, 3), Counter(3, 3), Counter(10, 12)],
        "torch": [TorchCounter(0, 3), TorchCounter(5, 6)],
        "mixed": [Counter(0, 2), TorchCounter(2, 4)],
    }
    theirs = tud.ChainDataset(parts[kind] if kind == "torch" else [
        TorchCounter(p.start, p.stop) for p in parts[kind]])
    mine = ours.ChainDataset(parts[kind])
    assert list(mine) == list(theirs)
    assert len(mine) == len(theirs)


def test_chain_rejects_map_style_parts_lazily() -> None:
    same_error(lambda m: list(m.ChainDataset([[1, 2]])))
    same_error(lambda m: len(m.ChainDataset([[1, 2]])))
    mine = ours.ChainDataset([Counter(0, 2), Squares(3)])
    stream = iter(mine)
    assert [next(stream), next(stream)] == [0, 1]
    with pytest.raises(AssertionError, match="Squares"):
        next(stream)


# ---------------------------------------------------------------- Subset


@pytest.mark.parametrize("indices", [[], [0], [4, 1, 4], list(range(9, -1, -1))])
@pytest.mark.parametrize("base", ["ours", "torch"])
def test_subset_matches_torch(indices: list[int], base: str) -> None:
    dataset = Squares(10) if base == "ours" else TorchCubes(10)
    theirs, mine = tud.Subset(dataset, indices), ours.Subset(dataset, indices)
    assert len(mine) == len(theirs)
    assert [mine[i] for i in range(len(mine))] == [theirs[i] for i in range(len(theirs))]
    positions = list(range(len(indices)))[::-1]
    assert mine.__getitems__(positions) == theirs.__getitems__(positions)


def test_subset_uses_the_base_getitems() -> None:
    base = Batched(10)
    mine = ours.Subset(base, [3, 5, 7])
    assert mine.__getitems__([2, 0]) == [1007, 1003]
    assert base.batched_calls == 1


def test_subset_passes_list_index_through() -> None:
    data = torch.arange(10) * 2
    theirs, mine = tud.Subset(data, [9, 1, 4]), ours.Subset(data, [9, 1, 4])
    assert mine[[0, 2]].equal(theirs[[0, 2]])


def test_a_subset_subclass_overriding_getitem_alone_is_refused_as_torch_refuses_it() -> None:
    class Doubled(ours.Subset[int]):
        def __getitem__(self, idx: int) -> int:
            return 2 * super().__getitem__(idx)

    class TorchDoubled(tud.Subset[int]):
        def __getitem__(self, idx: int) -> int:
            return 2 * super().__getitem__(idx)

    with pytest.raises(NotImplementedError) as theirs:
        TorchDoubled(Batched(5), [1, 2])
    with pytest.raises(NotImplementedError) as mine:
        Doubled(Batched(5), [1, 2])
    first_sentence = str(theirs.value).split(". ")[0].replace("TorchDoubled", "Doubled")
    assert str(mine.value).startswith(first_sentence + ".")
    assert "def __getitems__(self, indices)" in str(mine.value)


def test_a_subset_subclass_overriding_both_methods_is_fetched_through_them() -> None:
    class Doubled(ours.Subset[int]):
        def __getitem__(self, idx: int) -> int:
            return 2 * super().__getitem__(idx)

        def __getitems__(self, indices: list[int]) -> list[int]:
            return [self[index] for index in indices]

    doubled = Doubled(Batched(5), [1, 2])
    assert doubled.__getitems__([0, 1]) == [2002, 2004]
    assert [b.tolist() for b in pipeload.DataLoader(doubled, batch_size=2)] == [[2002, 2004]]


# ---------------------------------------------------------------- StackDataset


def stack_parts(module: Any) -> list[Any]:
    return [Squares(4), TorchCubes(4), module.TensorDataset(torch.arange(4.0)), Batched(4)]


@pytest.mark.parametrize("keyword", [False, True])
@pytest.mark.parametrize("count", [1, 2, 4])
def test_stack_matches_torch(keyword: bool, count: int) -> None:
    def build(module: Any) -> Any:
        parts = stack_parts(module)[:count]
        if keyword:
            return module.StackDataset(**{f"k{i}": p for i, p in enumerate(parts)})
        return module.StackDataset(*parts)

    theirs, mine = build(tud), build(ours)
    assert len(mine) == len(theirs)
    for index in range(4):
        assert_same_sample(mine[index], theirs[index])
    for indices in ([], [3], [2, 0, 2]):
        assert_same_sample(mine.__getitems__(indices), theirs.__getitems__(indices))


def test_stack_uses_nested_getitems() -> None:
    base = Batched(4)
    assert ours.StackDataset(a=base, b=Squares(4)).__getitems__([1, 2]) == [
        {"a": 1001, "b": 1}, {"a": 1002, "b": 4}]
    assert base.batched_calls == 1


@pytest.mark.parametrize(
    "build",
    [
        lambda m: m.StackDataset(),
        lambda m: m.StackDataset(Squares(2), b=Squares(2)),
        lambda m: m.StackDataset(Squares(2), Squares(3)),
        lambda m: m.StackDataset(a=Squares(2), b=Squares(3)),
        lambda m: m.StackDataset(Batched(3, short_by=1)).__getitems__([0, 1]),
        lambda m: m.StackDataset(a=Batched(3, short_by=1)).__getitems__([0, 1]),
    ],
    ids=["none", "both", "args_mismatch", "kwargs_mismatch", "short_tuple", "short_dict"],
)
def test_stack_rejects(build: Callable[[Any], object]) -> None:
    same_error(build)


def test_stack_mismatch_names_the_lengths() -> None:
    with pytest.raises(ValueError, match="a: 2, b: 3"):
        ours.StackDataset(a=Squares(2), b=Squares(3))


# ---------------------------------------------------------------- random_split

SPLITS = [[10], [3, 7], [0, 10], [5, 0, 5], [1] * 10, [0.5, 0.5], [0.3, 0.3, 0.4],
          [0.1] * 10, [1.0], [0.25, 0.75], [0.33, 0.33, 0.34], [1 / 3] * 3]


@pytest.mark.parametrize("lengths", SPLITS)
@pytest.mark.parametrize("size", [10, 11, 17])
@pytest.mark.parametrize("seed", [0, 42])
def test_random_split_matches_torch(lengths: list[float], size: int, seed: int) -> None:
    if all(isinstance(x, int) for x in lengths) and sum(lengths) != size:
        lengths = [*lengths[:-1], lengths[-1] + size - sum(lengths)]
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        theirs = tud.random_split(range(size), lengths, generator=generator(seed))
        mine = ours.random_split(range(size), lengths, generator=generator(seed))
    assert [list(s.indices) for s in mine] == [list(s.indices) for s in theirs]
    assert all(isinstance(s, ours.Subset) for s in mine)


def test_random_split_default_generator_is_torch_global() -> None:
    torch.manual_seed(5)
    theirs = tud.random_split(range(20), [0.5, 0.5])
    after = torch.get_rng_state()
    torch.manual_seed(5)
    mine = ours.random_split(range(20), [0.5, 0.5])
    assert [s.indices for s in mine] == [s.indices for s in theirs]
    assert torch.get_rng_state().equal(after)


def test_random_split_warns_about_empty_splits() -> None:
    with pytest.warns(UserWarning, match="index 2"):
        ours.random_split(range(2), [0.5, 0.5, 0.0], generator=generator(0))


@pytest.mark.parametrize(
    ("lengths", "names"),
    [([3, 3], "lengths=[3, 3]"), ([4, 4], "lengths=[4, 4]"), ([1.2, -0.2], "index 0"),
     ([0.5, 0.6], "lengths=[0.5, 0.6]")],
)
def test_random_split_rejects_bad_lengths(lengths: list[float], names: str) -> None:
    err = same_error(lambda m: m.random_split(range(7), lengths, generator=generator(0)))
    assert names in str(err.value)


def test_random_split_rejects_negative_lengths() -> None:
    # torch makes overlapping garbage subsets from [-1, 6]; we refuse with the same error type.
    with pytest.raises(ValueError, match=r"lengths\[0\]=-1"):
        ours.random_split(range(5), [-1, 6], generator=generator(0))


# ---------------------------------------------------------------- interplay with torch


def test_our_datasets_in_torch_dataloader() -> None:
    data = torch.arange(30.0).reshape(15, 2)

    def build(module: Any) -> Any:
        tensors = module.TensorDataset(data, torch.arange(15))
        joined = module.ConcatDataset([tensors, module.Subset(tensors, [0, 3, 5])])
        return module.StackDataset(joined, module.Subset(module.TensorDataset(data), [i % 15 for i in range(18)]))

    loaders = [tud.DataLoader(build(m), batch_size=4, shuffle=True, generator=generator(1))
               for m in (tud, ours)]
    theirs, mine = (list(loader) for loader in loaders)
    assert_same_sample(mine, theirs)


def test_our_split_in_torch_dataloader_with_workers() -> None:
    data = ours.TensorDataset(torch.arange(12))
    train, _ = ours.random_split(data, [0.75, 0.25], generator=generator(3))
    loader = tud.DataLoader(train, batch_size=4, num_workers=1)
    expected_train, _ = tud.random_split(tud.TensorDataset(torch.arange(12)), [0.75, 0.25],
                                         generator=generator(3))
    assert_same_sample(list(loader), list(tud.DataLoader(expected_train, batch_size=4)))


@pytest.mark.parametrize(
    "make",
    [
        lambda: ours.TensorDataset(torch.arange(3)),
        lambda: ours.ConcatDataset([range(2), Squares(2)]),
        lambda: ours.Subset(Squares(5), [4, 2]),
        lambda: ours.StackDataset(a=range(3), b=Squares(3)),
        lambda: ours.ChainDataset([Counter(0, 2), Counter(4, 5)]),
    ],
)
def test_datasets_pickle(make: Callable[[], Any]) -> None:
    original = make()
    copy = pickle.loads(pickle.dumps(original))
    if isinstance(original, ours.IterableDataset):
        assert list(copy) == list(original)
    else:
        assert_same_sample([copy[i] for i in range(len(copy))],
                           [original[i] for i in range(len(original))])
