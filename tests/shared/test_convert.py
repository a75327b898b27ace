"""share_containers converts a dataset's large containers in place; the loader warns, once per
dataset, when process workers would receive millions of Python objects."""

from __future__ import annotations

import warnings
from collections import defaultdict

import numpy as np
import pytest
import torch
from shared_datasets import HoldsTable

from pipeload import (
    ConcatDataset,
    CopyOnReadWarning,
    DataLoader,
    SharedMapping,
    SharedSequence,
    Subset,
    share_containers,
)

pytestmark = [pytest.mark.usefixtures("leak_guard"), pytest.mark.timeout(120)]

# More than the warning's threshold (1,000,000 Python objects): 500,001 tuples of two.
BIG_TABLE_LENGTH = 500_001


class ImageFolderLike:
    """Shaped like torchvision's ImageFolder: ``samples`` and ``imgs`` are the same list."""

    def __init__(self, count: int) -> None:
        self.classes = ["cat", "dog"]  # small: stays a list
        self.samples = [(f"/data/{self.classes[i % 2]}/{i}.jpg", i % 2) for i in range(count)]
        self.imgs = self.samples
        self.targets = [label for _, label in self.samples]
        self.boxes = {f"/data/{i}.jpg": [(0, 0, 4, 4)] for i in range(count)}
        self.root = "/data"

    def __len__(self) -> int:
        return len(self.samples)

    def __getitem__(self, index: int) -> tuple[str, int, list]:
        path, label = self.samples[index]
        return path, label, self.boxes.get(path, [])


def test_large_attributes_become_shared_and_the_dataset_reads_the_same() -> None:
    dataset = ImageFolderLike(20_000)
    expected = [dataset[i] for i in range(len(dataset))]
    converted = share_containers(dataset)
    assert converted == ["dataset.samples", "dataset.imgs", "dataset.targets", "dataset.boxes"]
    assert isinstance(dataset.samples, SharedSequence) and isinstance(dataset.boxes, SharedMapping)
    assert dataset.imgs is dataset.samples  # one list held twice stays one container
    assert dataset.classes == ["cat", "dog"] and type(dataset.classes) is list
    assert [dataset[i] for i in range(len(dataset))] == expected


def test_nested_datasets_are_converted_and_min_items_is_honoured() -> None:
    inner = ImageFolderLike(300)
    other = HoldsTable(list(range(500)))
    dataset = ConcatDataset([Subset(inner, list(range(100))), other])
    converted = share_containers(dataset, min_items=200)
    assert converted == [
        "dataset.datasets[0].dataset.samples",
        "dataset.datasets[0].dataset.imgs",
        "dataset.datasets[0].dataset.targets",
        "dataset.datasets[0].dataset.boxes",
        "dataset.datasets[1].table",
    ]
    assert type(dataset.datasets[0].indices) is list  # 100 items: under min_items
    assert dataset[50] == inner[50] and dataset[101] == 1


def test_what_cannot_be_converted_is_left_with_a_warning() -> None:
    dataset = HoldsTable({frozenset({i}): i for i in range(10)})
    dataset.lambdas = [lambda: 0] * 10
    with pytest.warns(UserWarning) as caught:
        assert share_containers(dataset, min_items=5) == []
    messages = sorted(str(w.message) for w in caught)
    assert messages[0].startswith("share_containers left dataset.lambdas as it is: SharedSequence: item 0")
    assert messages[1].startswith("share_containers left dataset.table as it is: SharedMapping keys must be")
    assert all(w.filename == __file__ for w in caught)


class Slotted:
    __slots__ = ("table", "__private")

    def __init__(self, table: object = None) -> None:
        self.table = list(range(20_000)) if table is None else table
        self.__private = list(range(20_000))

    def __len__(self) -> int:
        return 4

    def __getitem__(self, index: int) -> int:
        return index


class Index:
    """A helper a dataset holds, not a dataset itself (no __getitem__, no __iter__)."""

    def __init__(self, paths: object) -> None:
        self.paths = paths


def test_datasets_without_attributes_are_left_alone() -> None:
    dataset = range(8)
    assert share_containers(dataset) == []
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        loader = DataLoader(dataset, batch_size=2, num_workers=1, multiprocessing_context="fork")
        assert len(list(loader)) == len(loader)


def test_bad_arguments() -> None:
    with pytest.raises(TypeError, match=r"use pipeload.SharedSequence\(dataset\) as the dataset instead"):
        share_containers([1, 2, 3])
    with pytest.raises(TypeError, match=r"min_items=-1"):
        share_containers(HoldsTable([]), min_items=-1)


def _big_table() -> list[tuple[int, int]]:
    return [(i, i) for i in range(BIG_TABLE_LENGTH)]


def test_process_workers_warn_once_naming_the_attribute_and_the_fix() -> None:
    dataset = HoldsTable(_big_table())
    with pytest.warns(CopyOnReadWarning) as caught:
        assert len(list(DataLoader(dataset, batch_size=2, num_workers=1, multiprocessing_context="fork"))) == 2
    (warning,) = caught
    text = str(warning.message)
    assert "dataset.table is a list of 500,001 items (about 1,500,003 Python objects)" in text
    assert "pipeload.share_containers(dataset)" in text and "pytorch#13246" in text
    assert warning.filename == __file__  # points at the user's loop, not into pipeload
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # a second loader over the same dataset stays quiet
        list(DataLoader(dataset, batch_size=2, num_workers=1, multiprocessing_context="fork"))


def test_each_dataset_is_warned_about_even_equal_ones_and_one_at_a_freed_address() -> None:
    # Known by == (a dataclass dataset equal to another was not named) or, unhashable, by an id()
    # never forgotten (a new dataset at a freed one's address was not named either).
    import dataclasses
    import gc

    from pipeload.shared import warn_if_copy_on_read

    @dataclasses.dataclass(eq=True)
    class Table(torch.utils.data.Dataset):
        rows: list

        def __len__(self) -> int:
            return len(self.rows)

    rows, addresses = _big_table(), set()
    for _ in range(4):
        dataset = Table(rows)
        addresses.add(id(dataset))
        with pytest.warns(CopyOnReadWarning, match="dataset.rows is a list of 500,001 items"):
            warn_if_copy_on_read(dataset, "process")
        with warnings.catch_warnings():
            warnings.simplefilter("error")
            warn_if_copy_on_read(dataset, "process")  # the same dataset: once
        del dataset
        gc.collect()
    first, second = Table(rows), Table(rows)  # equal, both alive
    for dataset in (first, second):
        with pytest.warns(CopyOnReadWarning):
            warn_if_copy_on_read(dataset, "process")


def test_a_plain_list_as_the_dataset_is_told_to_wrap_it() -> None:
    dataset = list(range(1_000_001))
    loader = DataLoader(dataset, batch_size=2, num_workers=1, sampler=[0, 1], multiprocessing_context="fork")
    with pytest.warns(CopyOnReadWarning, match=r"dataset is a list of 1,000,001 items.*pass pipeload.SharedSequence\(dataset\)"):
        list(loader)


@pytest.mark.parametrize(
    "how", ["thread", "inline", "converted"],
)
def test_no_warning_without_process_workers_or_after_converting(how: str) -> None:
    dataset = HoldsTable(_big_table())
    kwargs = {"thread": {"num_workers": 1, "worker_type": "thread"}, "inline": {"num_workers": 0},
              "converted": {"num_workers": 1, "multiprocessing_context": "fork"}}[how]
    if how == "converted":
        assert share_containers(dataset) == ["dataset.table"]
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert len(list(DataLoader(dataset, batch_size=2, **kwargs))) == 2


class HoldsLoadedJson:
    """Keeps its index the way ``json.load`` returns it: a small dict of large lists."""

    def __init__(self, count: int) -> None:
        self.data = {"paths": [f"/data/{i}.jpg" for i in range(count)],
                     "labels": [(i % 3, i) for i in range(count)], "root": "/data"}

    def __len__(self) -> int:
        return len(self.data["paths"])

    def __getitem__(self, index: int) -> tuple[str, tuple[int, int]]:
        return self.data["paths"][index], self.data["labels"][index]


def test_large_containers_inside_a_small_dict_attribute_are_converted_where_they_sit() -> None:
    dataset = HoldsLoadedJson(20_000)
    holder, expected = dataset.data, [dataset[i] for i in range(len(dataset))]
    dataset.same_data = holder  # held twice: still converted once, and never as a whole
    assert share_containers(dataset, min_items=2) == ["dataset.data['paths']", "dataset.data['labels']"]
    assert dataset.data is holder and type(holder) is dict  # the user's dict, its values replaced
    assert isinstance(holder["paths"], SharedSequence) and isinstance(holder["labels"], SharedSequence)
    assert [dataset[i] for i in range(len(dataset))] == expected


def test_large_containers_in_a_tuple_attribute_are_left_with_a_warning_saying_why() -> None:
    dataset = HoldsTable((list(range(20_000)), "small"))
    with pytest.warns(UserWarning, match=r"left dataset.table\[0\] as it is: .*tuple.*pipeload.SharedSequence"):
        assert share_containers(dataset) == []
    assert type(dataset.table[0]) is list


def test_a_list_of_datasets_stays_a_list_whose_datasets_are_converted() -> None:
    first, second = HoldsTable(list(range(300))), HoldsTable(list(range(300, 600)))
    dataset = ConcatDataset([first, second])
    converted = share_containers(dataset, min_items=0)
    assert "dataset.datasets" not in converted  # pickling the datasets would copy them on every read
    assert dataset.datasets[0] is first and isinstance(first.table, SharedSequence)
    assert isinstance(second.table, SharedSequence) and dataset.datasets[1].table[1] == 301


def test_process_workers_warn_about_a_large_list_inside_a_dict_until_it_is_converted() -> None:
    warned, converted = (HoldsTable({"rows": _big_table(), "name": "big"}) for _ in range(2))
    with pytest.warns(CopyOnReadWarning, match=r"dataset.table\['rows'\] is a list of 500,001 items"):
        list(DataLoader(warned, batch_size=2, num_workers=1, multiprocessing_context="fork"))
    assert share_containers(converted) == ["dataset.table['rows']"]
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        list(DataLoader(converted, batch_size=2, num_workers=1, multiprocessing_context="fork"))


def test_slots_attributes_are_converted_as_dict_ones_are() -> None:
    dataset = Slotted()
    assert share_containers(dataset) == ["dataset.table", "dataset._Slotted__private"]
    assert isinstance(dataset.table, SharedSequence) and dataset.table[-1] == 19_999


# Each holds more than a million Python objects where share_containers does not look, or in a
# container it does not convert; the fix named must be one that would work.
RISKY = {
    "numpy object array": (lambda: HoldsTable(np.arange(1_000_001).astype(object)),
                           r"dataset.table is a numpy array of object of 1,000,001 items.*"
                           r"build dataset.table as pipeload.SharedSequence\(dataset.table.tolist\(\)\)"),
    "set": (lambda: HoldsTable(set(range(1_000_001))),
            r"dataset.table is a set of 1,000,001 items.*pipeload.SharedMapping\(dict.fromkeys\(dataset.table\)\)"),
    "defaultdict": (lambda: HoldsTable(defaultdict(int, dict.fromkeys(range(500_001), 0))),
                    r"dataset.table is a defaultdict of 500,001 items.*pipeload.SharedMapping\(dict\(dataset.table\)\)"),
    "slots dataset": (lambda: Slotted(list(range(1_000_001))),
                      r"dataset.table is a list of 1,000,001 items.*pipeload.share_containers\(dataset\)"),
    "list in a helper": (lambda: HoldsTable(Index(list(range(1_000_001)))),
                         r"dataset.table.paths is a list of 1,000,001 items.*"
                         r"build dataset.table.paths as pipeload.SharedSequence\(dataset.table.paths\)"),
}


@pytest.mark.parametrize("name", list(RISKY))
def test_process_workers_warn_about_containers_share_containers_does_not_convert(name: str) -> None:
    make, message = RISKY[name]
    with pytest.warns(CopyOnReadWarning, match=message):
        list(DataLoader(make(), batch_size=2, num_workers=1, multiprocessing_context="fork"))


def test_no_warning_for_arrays_tensors_small_containers_and_shared_ones() -> None:
    dataset = HoldsTable(np.arange(2_000_000))
    dataset.tensor = torch.zeros(2_000_000)
    dataset.helper = Index({"few": [1, 2, 3], "numbers": np.zeros((1000, 1000))})
    dataset.small = set(range(1000))
    dataset.shared = SharedSequence(list(range(1_000_001)))
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        list(DataLoader(dataset, batch_size=2, num_workers=1, multiprocessing_context="fork"))
    dataset.shared.close()
