"""SharedSequence behaves as a read-only list of the items it was built from, for every kind of
item, and lets go of its memory when closed or dropped."""

from __future__ import annotations

import copy
import os
import pickle
from fractions import Fraction

import pytest
from shared_datasets import memfd_names

from pipeload import SharedSequence

pytestmark = pytest.mark.usefixtures("leak_guard")

# One list per storage path: packed ints and floats, UTF-8 text (lone surrogates, as os.fsdecode
# makes them, included), raw bytes, (path, label) records, and pickled mixed values.
CASES = {
    "str": ["a", "", "héllo wörld", "\U0001f600", "x" * 5000],
    "str_surrogates": ["a", "undecodable-\udcff", "\udc80"],
    "bytes": [b"", b"\x00\xff", b"abc" * 100],
    "int": [0, -1, 2**63 - 1, -(2**63), 7],
    "big_int": [2**64, -(2**70), 3],
    "float": [0.0, -1.5, float("inf"), 1e-300],
    "record": [("a.jpg", 1), ("b.jpg", 2), ("c\udcff.jpg", -3)],
    "wide_record": [(1, "x", b"y", 2.5, None), (2, "z", b"", -1.0, [1])],
    "mixed": [None, 1, "x", 2.5, {"box": [1, 2]}, [3, 4], Fraction(1, 3), True],
    "bools": [True, False, True],
    "nested": [[1, 2], [], [3]],
    "uneven_tuples": [(1,), (1, 2), ()],
    "empty": [],
}


@pytest.mark.parametrize("values", CASES.values(), ids=CASES.keys())
def test_reads_back_every_item_with_its_type(values: list) -> None:
    shared = SharedSequence(values)
    assert len(shared) == len(values)
    assert list(shared) == values
    assert [shared[i] for i in range(len(values))] == values
    assert [type(item) for item in shared] == [type(item) for item in values]
    assert shared == values and values == shared and shared == tuple(values)
    assert list(reversed(shared)) == values[::-1]


def test_lone_surrogates_after_the_first_chunk_of_strings() -> None:
    from pipeload.shared._columns import CHUNK_ITEMS

    values = [f"name-{i}" for i in range(CHUNK_ITEMS + 10)] + ["os.fsdecode(b'\\xff') gives \udcff"]
    shared = SharedSequence(values)
    assert shared[-1] == values[-1] and shared[0] == values[0] and list(shared) == values


def test_negative_indices_and_bounds_as_a_list() -> None:
    shared = SharedSequence(["a", "b", "c"])
    assert (shared[-1], shared[-3]) == ("c", "a")
    with pytest.raises(IndexError, match="index 3 out of range"):
        shared[3]
    with pytest.raises(IndexError, match="index -4 out of range"):
        shared[-4]
    with pytest.raises(TypeError, match="integers or slices, not str"):
        shared["0"]


def test_index_types_a_list_accepts() -> None:
    import numpy as np
    import torch

    shared = SharedSequence([10, 20, 30])
    assert shared[np.int64(1)] == 20
    assert shared[torch.tensor(2)] == 30
    assert shared[True] == 20


@pytest.mark.parametrize("cut", [slice(1, 4), slice(None, None, -1), slice(-3, None), slice(0, 6, 2), slice(5, 1)])
def test_slices_are_views_equal_to_the_list_slices(cut: slice) -> None:
    values = [f"item{i}" for i in range(6)]
    shared = SharedSequence(values)
    view = shared[cut]
    assert isinstance(view, SharedSequence)
    assert list(view) == values[cut] and len(view) == len(values[cut])
    assert view.nbytes == shared.nbytes  # the same segment, not a copy
    if len(view) > 1:
        assert view[1:] == values[cut][1:]  # a view of a view


def test_slicing_again_and_again_allocates_nothing_per_slice() -> None:
    shared = SharedSequence([f"item{i}" for i in range(100)])
    for start in range(3):
        assert shared[start : start + 10][0] == f"item{start}"
    typed_views = len(shared._segment._arrays)
    for start in range(90):
        assert shared[start : start + 10][-1] == f"item{start + 9}"
    assert len(shared._segment._arrays) == typed_views


def test_sequence_methods() -> None:
    shared = SharedSequence(["a", "b", "a", "c"])
    assert "c" in shared and "z" not in shared
    assert shared.index("c") == 3 and shared.count("a") == 2
    assert shared != ["a", "b"] and shared != ["a", "b", "a", "d"]
    assert shared != "abac" and shared != {"a"}
    with pytest.raises(TypeError):
        hash(shared)


def test_index_of_a_missing_value_says_so_as_a_list_does() -> None:
    values = ["a", "b", "a"]
    shared = SharedSequence(values)
    with pytest.raises(ValueError, match=r"^'z' is not in SharedSequence$"):
        shared.index("z")
    with pytest.raises(ValueError, match=r"^'b' is not in SharedSequence$"):
        shared.index("b", 2)  # present, but before start
    for args in [("a",), ("a", 1), ("a", -1), ("b", -3, -1), ("a", -100, 100)]:
        assert shared.index(*args) == values.index(*args), args


def test_repr_shows_the_first_items_and_the_length() -> None:
    assert repr(SharedSequence(["a", "b"])) == "SharedSequence(['a', 'b'])"
    long = repr(SharedSequence(range(100)))
    assert long.startswith("SharedSequence([0, 1, 2, 3, 4, ...]") and long.endswith("len=100)")


def test_built_from_any_iterable_and_from_another_shared_sequence() -> None:
    shared = SharedSequence(str(i) for i in range(5))
    assert shared == ["0", "1", "2", "3", "4"]
    again = SharedSequence(shared[1:])
    assert again == ["1", "2", "3", "4"] and again.nbytes == shared.nbytes


def test_is_read_only() -> None:
    shared = SharedSequence([[1, 2]])
    with pytest.raises(TypeError):
        shared[0] = 5  # type: ignore[index]
    shared[0].append(3)  # a fresh object each read: the stored one is untouched
    assert shared[0] == [1, 2]


def test_unpicklable_item_is_named_by_its_index() -> None:
    with pytest.raises(TypeError, match=r"SharedSequence: item 2 \(<function .*<lambda>.*this function cannot be "):
        SharedSequence([1, "x", lambda: 0])


def test_copies_are_the_same_object_and_pickles_carry_the_items() -> None:
    shared = SharedSequence(["a", ("b", 2)])
    assert copy.copy(shared) is shared and copy.deepcopy(shared) is shared
    view = shared[1:]
    # Outside a process start there is no child to hand a descriptor to: the bytes travel.
    restored = pickle.loads(pickle.dumps(view))
    assert restored == [("b", 2)] and restored._segment is not view._segment
    restored.close()


def test_close_releases_the_mapping_and_reading_then_fails_clearly() -> None:
    shared = SharedSequence(["a", "b"])
    view = shared[1:]
    names = memfd_names(os.getpid())
    assert names, "the segment should be mapped in this process"
    with shared:
        assert shared[0] == "a"
    assert shared.closed and view.closed
    shared.close()  # idempotent
    assert memfd_names(os.getpid()) == set()
    with pytest.raises(ValueError, match="closed SharedSequence"):
        shared[0]
    with pytest.raises(ValueError, match="closed SharedSequence"):
        list(view)
    assert repr(shared) == "<closed SharedSequence of 2 items>"


@pytest.mark.parametrize("values", [["a", "b"], [1, 2], [("a", 1), ("b", 2)], [[1], [2]]],
                         ids=["str", "int", "record", "pickle"])
def test_an_iterator_made_before_closing_then_fails_clearly(values: list) -> None:
    shared = SharedSequence(values)
    forward, backward = iter(shared), reversed(shared)
    assert next(forward) == values[0] and next(backward) == values[-1]
    shared.close()
    for iterator in (forward, backward):
        with pytest.raises(ValueError, match="closed SharedSequence"):
            next(iterator)


@pytest.mark.usefixtures("no_gc")
def test_dropping_the_last_reference_frees_it_without_the_garbage_collector() -> None:
    shared = SharedSequence(["a", "b"])
    view = shared[:1]
    del shared
    assert memfd_names(os.getpid()), "a view keeps the segment"
    assert view == ["a"]
    del view
    assert memfd_names(os.getpid()) == set()


def test_nothing_is_created_in_dev_shm() -> None:
    before = set(os.listdir("/dev/shm"))
    shared = SharedSequence([str(i) for i in range(10_000)])
    assert set(os.listdir("/dev/shm")) == before
    shared.close()


def test_equals_the_list_it_was_built_from_when_that_holds_nan() -> None:
    nan = float("nan")
    values = [1.5, nan, 2.5, nan]
    shared = SharedSequence(values)
    # A list matches its own NaN by identity; ours are read back as new floats, so NaN matches NaN.
    assert shared == values and shared[1:] == values[1:]
    assert nan in shared and shared.index(nan) == 1 and shared.count(nan) == 2
    with SharedSequence([(nan, "a"), (0.5, "b")]) as records:
        assert records == [(nan, "a"), (0.5, "b")]
    assert shared != [1.5, nan, 2.5, 0.0] and 0.0 not in shared
    shared.close()


def test_equals_the_list_it_was_built_from_when_that_holds_arrays_tensors_or_other_nans() -> None:
    # A list finds its own arrays and NaNs by identity; ours are read back as new objects: ==
    # raised for arrays and tensors (element-wise), and complex, float32 and nested NaNs differed.
    import numpy as np
    import torch

    nan = float("nan")
    values = [np.arange(3.0), np.array([nan, 1.0]), torch.tensor([nan, 2.0]), complex(nan, 0),
              np.float32(nan), {"v": nan, "w": [nan]}, np.array(["a", "b"])]
    shared = SharedSequence(values)
    assert shared == values and all(value in shared for value in values)
    assert shared.index(values[2]) == 2 and shared.count(values[0]) == 1
    assert np.arange(3) not in shared  # another dtype: an identical object could not be it
    assert torch.tensor([nan, 3.0]) not in shared and shared != values[:-1] + [np.array(["a", "c"])]
    shared.close()
    pairs = [(np.arange(3.0), "a"), (torch.ones(2), "b")]  # inside tuples too
    with SharedSequence(pairs) as shared_pairs:
        assert shared_pairs == pairs and pairs[1] in shared_pairs
    numbers = SharedSequence([1, 2, 3])  # a one-element tensor or array beside numbers, as a list
    assert torch.tensor(2) in numbers and np.array(3) in numbers and numbers.index(torch.tensor(3)) == 2
    assert numbers.count(np.array(1)) == [1, 2, 3].count(np.array(1)) == 1
    numbers.close()


@pytest.mark.parametrize("as_built", [list, tuple], ids=["list", "tuple"])
def test_concatenation_repetition_and_order_give_what_the_list_or_tuple_would(as_built: type) -> None:
    # Dataset code that did `self.samples + extra` on the list it had must keep working once
    # share_containers put a SharedSequence there (it reads; the result is a new container).
    values = as_built(["a", "b", "c"])
    shared = SharedSequence(values)
    assert shared + ["d"] == list(values) + ["d"] and type(shared + ["d"]) is list
    assert ["z"] + shared == ["z", "a", "b", "c"] and type(["z"] + shared) is list
    assert ("z",) + shared == ("z", "a", "b", "c") and type(("z",) + shared) is tuple
    assert shared + SharedSequence(["d"]) == ["a", "b", "c", "d"]
    assert shared * 2 == list(values) * 2 and 2 * shared == list(values) * 2 and shared * 0 == []
    assert shared < ["a", "c"] and shared <= ["a", "b", "c"] and shared > ["a"] and shared >= ("a", "b")
    assert sorted([SharedSequence([2]), SharedSequence([1, 5])]) == [[1, 5], [2]]
    with pytest.raises(TypeError):
        shared + "d"  # noqa: B018  (as list + str)
    with pytest.raises(TypeError):
        shared < 3  # noqa: B018
