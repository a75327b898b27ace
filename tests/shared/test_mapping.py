"""SharedMapping behaves as a read-only dict of what it was built from: lookups with Python's
equality (1 == 1.0 == True), dict order, and the same answers in a process with another hash seed."""

from __future__ import annotations

import copy
import os
import pickle
import re
import subprocess
import sys
from collections import OrderedDict

import pytest
from shared_datasets import memfd_names

from pipeload import SharedMapping

pytestmark = pytest.mark.usefixtures("leak_guard")

SOURCE = {
    "cat.jpg": 3,
    "d\u00e9j\u00e0-vu.jpg": [1, 2],
    "undecodable-\udcff": None,
    b"raw": "bytes key",
    7: "int key",
    -(2**70): "big int key",
    2.5: "float key",
    None: "none key",
    (1, "a", (b"x", 2.5)): "tuple key",
    "": {"nested": {"dict": 1}},
}


def test_lookups_membership_and_get_match_the_dict() -> None:
    shared = SharedMapping(SOURCE)
    assert len(shared) == len(SOURCE)
    for key, value in SOURCE.items():
        assert shared[key] == value and key in shared and shared.get(key) == value
    assert "dog.jpg" not in shared and shared.get("dog.jpg", -1) == -1
    with pytest.raises(KeyError, match="dog.jpg"):
        shared["dog.jpg"]


def test_equal_keys_of_other_types_find_the_entry_as_in_a_dict() -> None:
    shared = SharedMapping({1: "one", 2.0: "two", (1, 2): "pair", 0: "zero"})
    assert shared[1.0] == shared[True] == "one"
    assert shared[2] == "two" and shared[(1.0, 2)] == "pair" and shared[False] == "zero"
    assert shared[-0.0] == "zero"
    import numpy as np

    assert shared[np.int64(1)] == "one" and shared[np.float64(2.0)] == "two"
    assert "1" not in shared and b"1" not in shared


def test_lookups_with_other_number_types_answer_as_the_dict_does() -> None:
    import numpy as np
    import torch
    from fractions import Fraction

    plain = {0.5: "half", 0.1: "tenth", 3: "three"}
    shared = SharedMapping(plain)
    probes = [np.float32(0.5), np.float16(0.1), Fraction(1, 2), Fraction(1, 3), Fraction(3), np.float32(3.0),
              Fraction(10**400, 3), np.float32("nan"), torch.tensor(1.5), torch.tensor([1.5, 2.5])[0]]
    for key in probes:
        assert (key in shared, shared.get(key)) == (key in plain, plain.get(key)), key
    assert shared[np.float32(0.5)] == shared[Fraction(1, 2)] == "half"


def test_numpy_bools_complex_numbers_memoryviews_and_tensors_answer_as_the_dict_does() -> None:
    import numpy as np
    import torch

    plain = {1: "one", 2.5: "two and a half", b"x": "bytes", False: "false"}
    shared = SharedMapping(plain)
    probes = [np.True_, np.False_, 1 + 0j, 1 + 1j, np.complex128(2.5), memoryview(b"x"),
              memoryview(bytearray(b"x")), torch.tensor(1), torch.tensor(0), torch.tensor(2.5)]
    for key in probes:
        try:
            expected = (key in plain, plain.get(key))
        except ValueError as refused:  # a writable memoryview cannot be hashed: refused alike
            with pytest.raises(ValueError, match=re.escape(str(refused))):
                shared.get(key)
            continue
        assert (key in shared, shared.get(key)) == expected, key
    # a tensor hashes by identity: a dict cannot hold one as a key that another tensor finds
    with pytest.raises(TypeError, match=r"keys must be str.*got key tensor\(1\)"):
        SharedMapping({torch.tensor(1): "one"})


def test_keys_that_are_not_stored_types() -> None:
    shared = SharedMapping({"a": 1})
    assert frozenset() not in shared and shared.get(object()) is None
    with pytest.raises(TypeError, match="unhashable"):
        shared[["a"]]
    with pytest.raises(TypeError, match=r"keys must be str, bytes, int.*got key frozenset\(\{1\}\).*key number 1"):
        SharedMapping({"a": 1, frozenset({1}): 2})


def test_a_value_that_cannot_be_stored_is_named_by_its_key_and_type() -> None:
    import threading

    lock = threading.Lock()
    with pytest.raises(TypeError, match=r"^SharedMapping: the value of key 'b' \(<unlocked _thread.lock.*\) "
                                        r"cannot be stored in shared memory because this lock cannot be pickled"):
        SharedMapping({"a": 1, "b": lock})
    with pytest.raises(TypeError, match=r"^SharedMapping \(tuple field 1\): the value of key 'b' .*this lock"):
        SharedMapping({"a": ("x", 1), "b": ("y", lock)})


def test_iteration_views_and_order_follow_the_dict() -> None:
    shared = SharedMapping(SOURCE)
    assert list(shared) == list(SOURCE)
    assert list(shared.keys()) == list(SOURCE.keys())
    assert list(shared.values()) == list(SOURCE.values())
    assert list(shared.items()) == list(SOURCE.items())
    assert ("cat.jpg", 3) in shared.items() and 3 in shared.values() and "cat.jpg" in shared.keys()
    assert dict(shared) == SOURCE


def test_equality_with_any_mapping() -> None:
    shared = SharedMapping(SOURCE)
    assert shared == SOURCE and SOURCE == shared and shared == SharedMapping(SOURCE)
    assert shared != {**SOURCE, "cat.jpg": 4} and shared != {"cat.jpg": 3} and shared != [1]
    with pytest.raises(TypeError):
        hash(shared)


def test_built_from_pairs_mappings_and_empty() -> None:
    assert SharedMapping([("a", 1), ("b", 2)]) == {"a": 1, "b": 2}
    assert SharedMapping(OrderedDict(x=1)) == {"x": 1}
    empty = SharedMapping()
    assert len(empty) == 0 and list(empty) == [] and "a" not in empty


def test_many_entries_with_colliding_buckets() -> None:
    source = {f"/data/train/n{i % 997:08d}/img_{i}.JPEG": i for i in range(50_000)}
    source.update({i: -i for i in range(50_000)})
    shared = SharedMapping(source)
    assert all(shared[key] == value for key, value in source.items())
    assert all(f"/data/train/n{i % 997:08d}/img_{i}.jpeg" not in shared for i in range(1_000))


def test_repr_is_short() -> None:
    assert repr(SharedMapping({"a": 1})) == "SharedMapping({'a': 1})"
    long = repr(SharedMapping({i: i for i in range(100)}))
    assert long.startswith("SharedMapping({0: 0, 1: 1, 2: 2, 3: 3, ...}") and long.endswith("len=100)")


def test_copies_pickles_and_closing() -> None:
    shared = SharedMapping({"a": ("x", 1)})
    assert copy.deepcopy(shared) is shared
    restored = pickle.loads(pickle.dumps(shared))
    assert restored == {"a": ("x", 1)}
    restored.close()
    with shared:
        assert shared["a"] == ("x", 1)
    assert shared.closed and memfd_names(os.getpid()) == set()
    with pytest.raises(ValueError, match="closed SharedMapping"):
        shared["a"]
    with pytest.raises(ValueError, match="closed SharedMapping"):
        list(shared.values())


def test_iterators_made_before_closing_then_fail_clearly() -> None:
    shared = SharedMapping({"a": 1, "b": 2})
    iterators = [iter(shared), iter(shared.values()), iter(shared.items())]
    assert [next(iterator) for iterator in iterators] == ["a", 1, ("a", 1)]
    shared.close()
    for iterator in iterators:
        with pytest.raises(ValueError, match="closed SharedMapping"):
            next(iterator)


_OTHER_SEED = """
import pickle, sys
mapping = pickle.load(sys.stdin.buffer)
keys = ["cat.jpg", "d\\u00e9j\\u00e0-vu.jpg", (1, "a", (b"x", 2.5)), b"raw", 2.5]
print(all(mapping[key] == expected for key, expected in zip(keys, pickle.loads(bytes.fromhex(sys.argv[1])))))
"""


def test_another_interpreter_with_another_hash_seed_finds_every_key() -> None:
    shared = SharedMapping(SOURCE)
    expected = [SOURCE[key] for key in ["cat.jpg", "d\u00e9j\u00e0-vu.jpg", (1, "a", (b"x", 2.5)), b"raw", 2.5]]
    env = {**os.environ, "PYTHONHASHSEED": "12345", "PYTHONPATH": os.pathsep.join(sys.path)}
    done = subprocess.run(
        [sys.executable, "-c", _OTHER_SEED, pickle.dumps(expected).hex()],
        input=pickle.dumps(shared), capture_output=True, env=env, timeout=60, check=True,
    )
    assert done.stdout.strip() == b"True", done.stderr.decode()


def test_equals_the_dict_it_was_built_from_when_that_holds_tensors_or_arrays() -> None:
    import numpy as np
    import torch

    source = {"t": torch.tensor([1.0, float("nan")]), "a": np.zeros((2, 2)), "n": {"x": float("nan")}}
    shared = SharedMapping(source)
    assert shared == source  # == raised: a tensor's == answers element by element
    assert shared != {**source, "a": np.ones((2, 2))}
    shared.close()


def test_every_listed_key_is_found_a_nan_one_too() -> None:
    nan = float("nan")
    source = {nan: 1, "b": 2, (nan, "x"): 3, 2.5: nan}
    shared = SharedMapping(source)
    # A dict finds its NaN key by identity; ours is read back as a new float, so NaN finds NaN.
    assert [shared[key] for key in shared][:3] == [1, 2, 3]
    assert list(dict(shared).values())[:3] == [1, 2, 3]
    assert float("-nan") in shared and shared.get(float("nan")) == 1
    assert shared == source and source == shared
    assert shared != {float("nan"): 1, "b": 2, (nan, "x"): 3, 2.5: 0.0}
    shared.close()


def test_copy_union_and_reversed_give_what_the_dict_would() -> None:
    # Dataset code that did `self.meta.copy()` or `defaults | self.meta` on the dict it had
    # must keep working once share_containers put a SharedMapping there.
    entries = {"a": 1, "b": [1, 2], 3: "c"}
    shared = SharedMapping(entries)
    copied = shared.copy()
    assert copied == entries and type(copied) is dict and list(copied) == list(entries)
    copied["a"] = 9  # a plain dict, to change
    assert shared["a"] == 1
    assert shared | {"a": 0, "d": 4} == entries | {"a": 0, "d": 4}
    assert {"a": 0, "d": 4} | shared == {"a": 0, "d": 4} | entries
    assert type(shared | {}) is dict and list({"d": 4} | shared) == ["d", "a", "b", 3]
    assert list(reversed(shared)) == list(reversed(entries))
    with pytest.raises(TypeError):
        shared | [("a", 1)]  # noqa: B018  (as dict | list)
