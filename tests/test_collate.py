"""Differential tests: pipeload's collate against torch.utils.data's, over many sample shapes.

torch is the oracle here (tests only). Every comparison checks values, dtypes, shapes, container
types and key order exactly; error cases check that the exception type matches torch's.
"""

from __future__ import annotations

import functools
import random
from collections import OrderedDict, UserList, defaultdict, namedtuple
from collections.abc import Iterator, Mapping, Sequence
from enum import IntEnum
from types import MappingProxyType
from typing import Any, NamedTuple

import numpy as np
import pytest
import torch
import torch.utils.data
from torch.utils.data import default_collate as torch_default_collate
from torch.utils.data import default_convert as torch_default_convert
from torch.utils.data._utils.collate import collate as torch_collate
from torch.utils.data._utils.collate import default_collate_fn_map as torch_default_map

import pipeload
from pipeload.collate import (
    collate,
    collate_tensor_fn,
    default_collate,
    default_collate_fn_map,
    default_convert,
)
from pipeload.engine import worker_info
from pipeload.transport import collate_output
from pipeload.transport.slab_writer import SlabWriter
from oracle import FrozenMap, KeywordOnlyMap

# --- sample structures ----------------------------------------------------------------------

Pair = namedtuple("Pair", ["left", "right"])


class Labelled(NamedTuple):
    image: Any
    label: Any
    name: Any


class FrozenSeq(Sequence):
    """An immutable sequence that can be built from a list."""

    def __init__(self, items: Sequence[Any]) -> None:
        self._items = list(items)

    def __getitem__(self, index: Any) -> Any:
        return self._items[index]

    def __len__(self) -> int:
        return len(self._items)


TENSOR_DTYPES = [
    torch.float32, torch.float64, torch.float16, torch.bfloat16, torch.int8, torch.uint8,
    torch.int16, torch.int32, torch.int64, torch.bool, torch.complex64,
]
NUMPY_DTYPES = [np.float32, np.float64, np.float16, np.int8, np.uint8, np.int16, np.int32,
                np.int64, np.uint16, np.bool_, np.complex128]
NUMPY_SCALARS = [np.float32, np.float64, np.int8, np.int32, np.int64, np.uint8, np.bool_]
LEAF_KINDS = ["tensor", "ndarray", "npscalar", "float", "int", "bool", "str", "bytes"]
CONTAINER_KINDS = ["dict", "ordered", "defaultdict", "frozenmap", "pair", "labelled", "list",
                   "tuple", "userlist", "frozenseq"]


def random_schema(rng: random.Random, depth: int = 0) -> tuple:
    """A random nested structure description; leaves carry their dtype and shape."""
    if depth >= 3 or rng.random() < 0.35:
        kind = rng.choice(LEAF_KINDS)
        if kind == "tensor":
            shape = tuple(rng.randint(0, 3) for _ in range(rng.randint(0, 3)))
            return (kind, rng.choice(TENSOR_DTYPES), shape)
        if kind == "ndarray":
            shape = tuple(rng.randint(1, 3) for _ in range(rng.randint(0, 2)))
            return (kind, rng.choice(NUMPY_DTYPES), shape)
        if kind == "npscalar":
            return (kind, rng.choice(NUMPY_SCALARS))
        return (kind,)
    kind = rng.choice(CONTAINER_KINDS)
    width = {"pair": 2, "labelled": 3}.get(kind, rng.randint(1, 3))
    return (kind, [random_schema(rng, depth + 1) for _ in range(width)])


def make_sample(schema: tuple, rng: random.Random) -> Any:
    """One sample following ``schema`` with fresh random values."""
    kind = schema[0]
    if kind in LEAF_KINDS:
        return _make_leaf(schema, rng)
    children = [make_sample(child, rng) for child in schema[1]]
    keyed = {f"k{i}": child for i, child in enumerate(children)}
    if kind == "dict":
        return keyed
    if kind == "ordered":
        return OrderedDict(reversed(list(keyed.items())))
    if kind == "defaultdict":
        return defaultdict(list, keyed)
    if kind == "frozenmap":
        return FrozenMap(keyed)
    if kind == "pair":
        return Pair(*children)
    if kind == "labelled":
        return Labelled(*children)
    sequence_type = {"list": list, "tuple": tuple, "userlist": UserList, "frozenseq": FrozenSeq}
    return sequence_type[kind](children)


def _make_leaf(schema: tuple, rng: random.Random) -> Any:
    kind = schema[0]
    seed = rng.randrange(2**31)
    if kind == "tensor":
        values = torch.randint(0, 100, schema[2], generator=torch.Generator().manual_seed(seed))
        return values.to(schema[1])
    if kind == "ndarray":
        return np.random.default_rng(seed).integers(0, 100, size=schema[2]).astype(schema[1])
    if kind == "npscalar":
        return schema[1](seed % 100)
    if kind == "float":
        return rng.random() * 100
    if kind == "int":
        return rng.randint(-(2**40), 2**40)
    if kind == "bool":
        return rng.random() < 0.5
    if kind == "str":
        return "s" * rng.randint(0, 5)
    return bytes(rng.randint(0, 5))


def assert_same(ours: Any, theirs: Any, where: str = "batch") -> None:
    """Assert equal values, dtypes, shapes, container types and key order, recursively."""
    assert type(ours) is type(theirs), f"{where}: {type(ours)} vs {type(theirs)}"
    if isinstance(theirs, torch.Tensor):
        assert ours.dtype == theirs.dtype, f"{where}: {ours.dtype} vs {theirs.dtype}"
        assert ours.shape == theirs.shape, f"{where}: {ours.shape} vs {theirs.shape}"
        assert torch.equal(ours, theirs), f"{where}: values differ"
    elif isinstance(theirs, np.ndarray):
        assert ours.dtype == theirs.dtype, where
        np.testing.assert_array_equal(ours, theirs)
    elif isinstance(theirs, Mapping):
        assert list(ours) == list(theirs), f"{where}: keys {list(ours)} vs {list(theirs)}"
        if isinstance(theirs, defaultdict):
            assert ours.default_factory is theirs.default_factory, where
        for key in theirs:
            assert_same(ours[key], theirs[key], f"{where}[{key!r}]")
    elif isinstance(theirs, Sequence) and not isinstance(theirs, (str, bytes)):
        assert len(ours) == len(theirs), f"{where}: lengths {len(ours)} vs {len(theirs)}"
        for index, (mine, other) in enumerate(zip(ours, theirs)):
            assert_same(mine, other, f"{where}[{index}]")
    else:
        assert ours == theirs, f"{where}: {ours!r} vs {theirs!r}"


def both_collate(batch: list[Any]) -> tuple[Any, Any]:
    return default_collate(batch), torch_default_collate(batch)


def assert_same_error(call_ours: Any, call_torch: Any) -> tuple[BaseException, BaseException]:
    """Run both; both must raise, with the same exception type. Returns the two errors."""
    with pytest.raises(Exception) as torch_info:
        call_torch()
    with pytest.raises(Exception) as our_info:
        call_ours()
    assert type(our_info.value) is type(torch_info.value), (our_info.value, torch_info.value)
    return our_info.value, torch_info.value


# --- default_collate: hand-picked batches ---------------------------------------------------


class Colour(IntEnum):
    RED = 1
    BLUE = 2


HAND_PICKED: dict[str, Any] = {
    **{f"tensor-{d}": lambda d=d: [torch.arange(6).reshape(2, 3).to(d) + i for i in range(4)]
       for d in TENSOR_DTYPES},
    "tensor-0d": lambda: [torch.tensor(1.5), torch.tensor(2.5)],
    "tensor-empty": lambda: [torch.empty(0, 3), torch.empty(0, 3)],
    "tensor-noncontiguous": lambda: [torch.arange(12).reshape(3, 4).t() for _ in range(3)],
    "tensor-int-float-mix": lambda: [torch.tensor([1, 2]), torch.tensor([1.5, 2.5])],
    **{f"ndarray-{d.__name__}": lambda d=d: [np.arange(6).astype(d).reshape(3, 2) for _ in range(3)]
       for d in NUMPY_DTYPES},
    "ndarray-0d": lambda: [np.array(3.0), np.array(4.0)],
    **{f"npscalar-{t.__name__}": lambda t=t: [t(1), t(0), t(3)] for t in NUMPY_SCALARS},
    "npscalar-mixed": lambda: [np.float32(1), np.float64(2)],
    "float": lambda: [1.5, 2.25, -3.0],
    "int": lambda: [0, 1, 2**40],
    "bool": lambda: [True, False],
    "int-then-float": lambda: [1, 2.5],
    "float-then-int": lambda: [1.5, 2],
    "intenum": lambda: [Colour.RED, Colour.BLUE],
    "str": lambda: ["a", "bb", ""],
    "np-str": lambda: [np.str_("a"), np.str_("b")],
    "bytes": lambda: [b"x", b"yz"],
    "dict": lambda: [{"x": torch.ones(2) * i, "y": i, "z": "n"} for i in range(3)],
    "ordereddict": lambda: [OrderedDict([("b", i), ("a", float(i))]) for i in range(3)],
    "defaultdict": lambda: [defaultdict(list, {"v": np.int64(i)}) for i in range(3)],
    "frozenmap": lambda: [FrozenMap({"v": i}) for i in range(2)],
    "keyword-only-map": lambda: [KeywordOnlyMap(items={"v": i}) for i in range(2)],
    "mappingproxy": lambda: [MappingProxyType({"v": i}) for i in range(2)],
    "namedtuple": lambda: [Pair(torch.zeros(2), i) for i in range(3)],
    "typed-namedtuple": lambda: [Labelled(np.zeros(2), i, f"n{i}") for i in range(3)],
    "list": lambda: [[i, float(i), str(i)] for i in range(3)],
    "tuple": lambda: [(torch.ones(1), i) for i in range(3)],
    "tuple-of-str": lambda: [("a", "b"), ("c", "d")],
    "userlist": lambda: [UserList([i, i + 1]) for i in range(3)],
    "frozenseq": lambda: [FrozenSeq([i, 2.0]) for i in range(3)],
    "range": lambda: [range(3), range(1, 4)],
    "nested": lambda: [
        {"img": torch.rand(3, 2, generator=torch.Generator().manual_seed(i)),
         "meta": OrderedDict(id=i, tags=("a", "b"), pair=Pair(np.float32(i), [i, b"q"]))}
        for i in range(4)
    ],
    "batch-of-one": lambda: [{"x": [torch.ones(2)]}],
}


@pytest.mark.parametrize("name", sorted(HAND_PICKED))
def test_default_collate_matches_torch(name: str) -> None:
    ours, theirs = both_collate(HAND_PICKED[name]())
    assert_same(ours, theirs)


def test_memmap_is_collated_like_ndarray(tmp_path: Any) -> None:
    arrays = []
    for i in range(3):
        mm = np.memmap(tmp_path / f"a{i}.bin", dtype=np.float32, mode="w+", shape=(4,))
        mm[:] = i
        arrays.append(mm)
    assert_same(*both_collate(arrays))


@pytest.mark.parametrize("seed", range(300))
def test_random_nested_structures_match_torch(seed: int) -> None:
    rng = random.Random(seed)
    schema = random_schema(rng)
    batch = [make_sample(schema, rng) for _ in range(rng.randint(1, 4))]
    assert_same(*both_collate(batch))


# --- collate with custom maps ---------------------------------------------------------------


class Point:
    def __init__(self, x: int) -> None:
        self.x = x


class SpecialPoint(Point):
    pass


def sum_points(batch: Sequence[Point], *, collate_fn_map: Any = None) -> int:
    return sum(p.x for p in batch)


def list_points(batch: Sequence[Point], *, collate_fn_map: Any = None) -> list[int]:
    return [p.x for p in batch]


CUSTOM_MAPS: dict[str, tuple[Any, Any]] = {
    "custom-type": ({Point: sum_points}, lambda: [{"p": Point(1)}, {"p": Point(2)}]),
    "subclass-by-isinstance": ({Point: sum_points}, lambda: [SpecialPoint(1), SpecialPoint(5)]),
    "exact-beats-earlier-isinstance": (
        {Point: sum_points, SpecialPoint: list_points}, lambda: [SpecialPoint(1), SpecialPoint(5)]
    ),
    "first-isinstance-wins": (
        {(int, float): sum_points, Point: list_points}, lambda: [SpecialPoint(1), SpecialPoint(2)]
    ),
    "tuple-key": (
        {(Point, str): list_points}, lambda: [(Point(1), Point(2)), (Point(3), Point(4))]
    ),
    "default-plus-custom": (
        {**torch_default_map, Point: sum_points},
        lambda: [(torch.ones(2), Point(3)), (torch.zeros(2), Point(4))],
    ),
    "map-overrides-mapping": (
        {dict: lambda b, collate_fn_map: len(b)}, lambda: [{"a": 1}, {"a": 2}]
    ),
    "structure-only": (None, lambda: [{"a": [Point]}, {"a": [Point]}]),
}


@pytest.mark.parametrize("name", sorted(CUSTOM_MAPS))
def test_collate_with_custom_map_matches_torch(name: str) -> None:
    fn_map, make = CUSTOM_MAPS[name]
    if name == "structure-only":  # nothing to collate at the leaves: both must refuse the class
        assert_same_error(lambda: collate(make(), collate_fn_map=None),
                          lambda: torch_collate(make(), collate_fn_map=None))
        return
    ours = collate(make(), collate_fn_map=fn_map)
    theirs = torch_collate(make(), collate_fn_map=fn_map)
    assert_same(ours, theirs)


def test_default_collate_uses_the_module_map(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setitem(default_collate_fn_map, Point, sum_points)
    assert default_collate([{"p": Point(2)}, {"p": Point(3)}]) == {"p": 5}


def test_handlers_receive_the_map_and_tuples_like_torch() -> None:
    seen: list[tuple[type, Any]] = []

    def record(batch: Any, *, collate_fn_map: Any = None) -> str:
        seen.append((type(batch), collate_fn_map))
        return "ok"

    fn_map = {Point: record}
    collate([(Point(1),), (Point(2),)], collate_fn_map=fn_map)
    collate([{"p": Point(1)}], collate_fn_map=fn_map)
    torch_seen = list(seen)
    seen.clear()
    torch_collate([(Point(1),), (Point(2),)], collate_fn_map=fn_map)
    torch_collate([{"p": Point(1)}], collate_fn_map=fn_map)
    assert torch_seen == seen == [(tuple, fn_map), (list, fn_map)]


def test_a_failing_field_is_collated_only_once() -> None:
    calls = []

    def refuse(batch: Any, *, collate_fn_map: Any = None) -> None:
        calls.append(1)
        raise TypeError("no")

    with pytest.raises(TypeError, match="no"):
        collate([{"a": {"b": Point(1)}}], collate_fn_map={Point: refuse})
    assert len(calls) == 1


# --- errors: same types as torch ------------------------------------------------------------

ERROR_CASES: dict[str, Any] = {
    "empty-batch": lambda: [],
    "none": lambda: [None, None],
    "object": lambda: [object(), object()],
    "set": lambda: [{1}, {2}],
    "ndarray-str": lambda: [np.array(["a"]), np.array(["b"])],
    "ndarray-bytes": lambda: [np.array([b"a"]), np.array([b"b"])],
    "ndarray-object": lambda: [np.array([1, None]), np.array([2, None])],
    "np-datetime": lambda: [np.datetime64("2020-01-01"), np.datetime64("2021-01-01")],
    "ragged-list": lambda: [[1, 2], [1, 2, 3]],
    "ragged-tensor": lambda: [torch.zeros(3, 4), torch.zeros(3, 5)],
    "ragged-ndim": lambda: [torch.zeros(3), torch.zeros(3, 1)],
    "ragged-ndarray": lambda: [np.zeros(2), np.zeros(3)],
    "missing-key": lambda: [{"a": 1}, {"b": 2}],
    "tensor-then-int": lambda: [torch.zeros(2), 1],
    "int-then-str": lambda: [1, "a"],
    "nested-tensor": lambda: [torch.nested.nested_tensor([torch.zeros(2), torch.zeros(3)])] * 2,
    "sparse-tensor": lambda: [torch.zeros(2, 2).to_sparse()] * 2,
    "unsupported-in-dict": lambda: [{"a": [None]}, {"a": [None]}],
    # A batch that is one bytes object (batch_size=None, collate_fn=default_collate): its items
    # are ints, and numpy read it as the text of a number (a ValueError; torch: TypeError).
    "bytes-as-the-batch": lambda: b"b0",
    "numpy-bytes-as-the-batch": lambda: np.bytes_(b"n0"),
}


@pytest.mark.filterwarnings("ignore:The PyTorch API of nested tensors")
@pytest.mark.parametrize("name", sorted(ERROR_CASES))
def test_errors_match_torch_type(name: str) -> None:
    make = ERROR_CASES[name]
    ours, theirs = assert_same_error(
        lambda: default_collate(make()), lambda: torch_default_collate(make())
    )
    if isinstance(theirs, TypeError) and str(theirs).startswith("default_collate:"):
        assert str(ours).startswith(str(theirs))  # torch's unsupported-type wording comes first
    if str(theirs).startswith("each element in list of batch"):
        assert str(ours).startswith(str(theirs))


# --- a type default_collate cannot batch: the message names the field and what to return -----

TORCH_UNSUPPORTED = "default_collate: batch must contain tensors, numpy arrays, numbers, dicts or lists; found "


def unsupported_message(batch: list[Any], **kwargs: Any) -> str:
    with pytest.raises(TypeError) as info:
        if kwargs:
            collate(batch, **kwargs)
        else:
            default_collate(batch)
    return str(info.value)


def test_pil_images_name_their_field_and_how_to_make_tensors() -> None:
    # A dataset returning PIL images (no ToTensor) is the first hour's commonest collate error;
    # torch's sentence names the type alone, and ours said no more.
    image = pytest.importorskip("PIL.Image")
    message = unsupported_message([{"image": image.new("RGB", (2, 2)), "label": i} for i in range(2)])
    assert message.startswith(TORCH_UNSUPPORTED + "<class 'PIL.Image.Image'> (pipeload: "), message
    assert "field ['image']" in message and "of type PIL.Image.Image" in message, message
    assert "__getitem__" in message and "collate_fn" in message and "PILToTensor()" in message, message


def test_none_and_text_arrays_name_their_field_and_what_to_return() -> None:
    message = unsupported_message([(torch.zeros(1), None), (torch.zeros(1), None)])
    assert message.startswith(TORCH_UNSUPPORTED + "<class 'NoneType'> (pipeload: "), message
    assert "field [1] are None" in message and "__getitem__" in message, message
    message = unsupported_message([{"name": np.array(["a"])}, {"name": np.array(["b"])}])
    assert message.startswith(TORCH_UNSUPPORTED + "<U1 (pipeload: "), message
    assert "field ['name']" in message and ".tolist()" in message, message


def test_a_map_of_the_callers_own_is_told_to_take_the_type() -> None:
    # Without default_collate's map, what is missing is a handler, not a change to the dataset.
    message = unsupported_message([Point(1), Point(2)], collate_fn_map={torch.Tensor: collate_tensor_fn})
    assert message.startswith(TORCH_UNSUPPORTED), message
    assert "give collate_fn_map a handler" in message and "__getitem__" not in message, message


# --- ragged tensors: the message names the field and the shapes ------------------------------


def ragged_message(batch: list[Any]) -> str:
    with pytest.raises(RuntimeError) as info:
        default_collate(batch)
    assert type(info.value) is RuntimeError
    assert isinstance(info.value.__cause__, RuntimeError)  # torch's own error is chained
    return str(info.value)


def test_ragged_dict_field_names_key_shapes_and_sample() -> None:
    batch = [{"image": torch.zeros(3, 4), "label": i} for i in range(4)]
    batch[2]["image"] = torch.zeros(3, 5)
    message = ragged_message(batch)
    assert "['image']" in message
    assert "torch.Size([3, 4]) vs torch.Size([3, 5]) at sample 2" in message


def test_ragged_sequence_position_and_nested_paths() -> None:
    batch = [(torch.zeros(2), torch.zeros(1)), (torch.zeros(2), torch.zeros(7))]
    message = ragged_message(batch)
    assert "field [1]" in message and "torch.Size([1]) vs torch.Size([7]) at sample 1" in message
    nested = [{"a": [{"b": torch.zeros(size)}]} for size in (2, 2, 9)]
    assert "field ['a'][0]['b']" in ragged_message(nested)


def test_ragged_namedtuple_field_and_numpy_and_top_level() -> None:
    assert "field .image" in ragged_message(
        [Labelled(np.zeros((2, 2)), 0, "a"), Labelled(np.zeros((2, 3)), 1, "b")]
    )
    message = ragged_message([torch.zeros(1), torch.zeros(1), torch.zeros(2)])
    assert "the top level of the batch" in message and "at sample 2" in message


def test_field_path_is_clean_after_an_error() -> None:
    ragged_message([{"x": [torch.zeros(1), torch.zeros(size)]} for size in (2, 3)])
    assert "the top level of the batch" in ragged_message([torch.zeros(1), torch.zeros(2)])


def test_ragged_list_lengths_keep_torch_wording_and_add_the_field() -> None:
    torch_wording = "each element in list of batch should be of equal size"
    with pytest.raises(RuntimeError, match=torch_wording) as info:
        default_collate([{"ids": [1, 2]}, {"ids": [1, 2, 3]}])
    assert "['ids']" in str(info.value) and "sample 1 has 3" in str(info.value)


# --- inside a worker process: output where the batch will travel ---------------------------


@pytest.fixture
def as_worker(request: pytest.FixtureRequest) -> Iterator[None]:
    """Collate as a process worker's sender sets it up (a thread worker sets up nothing)."""
    method = getattr(request, "param", "multiprocessing")
    info = worker_info.WorkerInfo(id=0, num_workers=1, seed=0, dataset=None, worker_method=method)
    worker_info.set_worker_info(info)
    if method == "multiprocessing":
        collate_output.set_writer(SlabWriter())  # no slab granted: fresh shared memory
    try:
        yield
    finally:
        collate_output.set_writer(None)
        worker_info.set_worker_info(None)


def test_worker_process_stacks_large_tensors_into_shared_memory(as_worker: None) -> None:
    batch = [{"img": torch.full((3, 64, 64), float(i)), "label": i} for i in range(4)]
    ours = default_collate(batch)
    # 192 KiB of images go to shared memory at once; the small labels travel inside the message.
    assert ours["img"].is_shared() and not ours["label"].is_shared()
    assert_same(ours, torch_default_collate(batch))
    assert not collate_tensor_fn([torch.ones(2, dtype=torch.int16)] * 3).is_shared()


class SmallSamples(torch.utils.data.Dataset):
    """Samples whose batches of 4 travel inside the message: channels-last images, or vectors
    that require grad."""

    def __init__(self, kind: str) -> None:
        self.kind = kind

    def __len__(self) -> int:
        return 8

    def __getitem__(self, index: int) -> torch.Tensor:
        if self.kind == "channels_last":
            image = torch.arange(2 * 3 * 8 * 8, dtype=torch.float32).reshape(2, 3, 8, 8) + index
            return image.contiguous(memory_format=torch.channels_last)
        return torch.ones(4, requires_grad=True)


def _loader_outcome(make_loader: Any, kind: str) -> list[Any] | str:
    """Every batch, or the last line of the error the loader raised."""
    try:
        return list(make_loader(SmallSamples(kind), batch_size=4, num_workers=2))
    except RuntimeError as error:
        # torch's re-raised error and the frame that raised it hold each other, and that frame
        # holds the iterator: without its traceback the error lets go of the iterator at once,
        # which stops its workers now, not when the collector gets round to it.
        error.__traceback__ = None
        return str(error).strip().splitlines()[-1].removeprefix("RuntimeError: ")


@pytest.mark.usefixtures("leak_guard")
@pytest.mark.timeout(60)
def test_worker_processes_stack_small_batches_contiguous_as_torchs_do() -> None:
    # A torch worker stacks every batch into a fresh contiguous tensor, small ones too.
    theirs = _loader_outcome(torch.utils.data.DataLoader, "channels_last")
    ours = _loader_outcome(pipeload.DataLoader, "channels_last")
    assert [batch.stride() for batch in ours] == [batch.stride() for batch in theirs]
    assert all(torch.equal(mine, other) for mine, other in zip(ours, theirs))


@pytest.mark.usefixtures("leak_guard")
@pytest.mark.timeout(60)
def test_worker_processes_refuse_small_samples_that_require_grad_with_torchs_words() -> None:
    theirs = _loader_outcome(torch.utils.data.DataLoader, "requires_grad")
    ours = _loader_outcome(pipeload.DataLoader, "requires_grad")
    assert isinstance(theirs, str) and isinstance(ours, str)
    assert ours.startswith(theirs)


@pytest.mark.usefixtures("leak_guard")
@pytest.mark.timeout(60)
@pytest.mark.parametrize("kind", ["channels_last", "requires_grad"])
def test_our_collate_in_torchs_own_worker_processes_stacks_as_torchs_collate(kind: str) -> None:
    # torch's DataLoader given pipeload's collate (accelerate rebuilds a loader this way): its
    # workers must get torch's contiguous batches, and torch's refusal of samples that require
    # grad (before: channels-last strides, and a batch torch's queue cannot send, which hung).
    def torch_loader(collate_fn: Any) -> Any:
        return functools.partial(torch.utils.data.DataLoader, collate_fn=collate_fn, timeout=20)

    theirs = _loader_outcome(torch_loader(torch_default_collate), kind)
    ours = _loader_outcome(torch_loader(default_collate), kind)
    if kind == "requires_grad":
        assert isinstance(theirs, str) and ours == theirs
        return
    assert [batch.stride() for batch in ours] == [batch.stride() for batch in theirs]
    assert all(torch.equal(mine, other) for mine, other in zip(ours, theirs))


class ConjugateViews(torch.utils.data.Dataset):
    """Each sample a conjugate view (``conj()`` sets a flag, the memory holds the original)."""

    def __len__(self) -> int:
        return 4

    def __getitem__(self, index: int) -> torch.Tensor:
        return torch.tensor([index + 2j, 1 - index * 1j]).conj()


@pytest.mark.usefixtures("leak_guard")
@pytest.mark.timeout(60)
@pytest.mark.parametrize("batch_size", [2, None])
def test_conjugate_views_keep_their_values_through_process_workers(batch_size: int | None) -> None:
    # torch's worker drops the conjugation here (or fails to stack): the README says ours does
    # not, and this holds it to that. The values are what the main process would compute.
    dataset = ConjugateViews()
    expected = list(pipeload.DataLoader(dataset, batch_size=batch_size))
    ours = list(pipeload.DataLoader(dataset, batch_size=batch_size, num_workers=2))
    assert [batch.tolist() for batch in ours] == [batch.tolist() for batch in expected]
    assert torch.flatten(expected[0])[0].item() == -2j  # sample 0 conjugated: 0+2j -> 0-2j


def test_worker_process_small_structures_match_torch(as_worker: None) -> None:
    batch = HAND_PICKED["nested"]()
    assert_same(default_collate(batch), torch_default_collate(batch))


@pytest.mark.parametrize("seed", range(50))
def test_random_structures_in_worker_match_torch(as_worker: None, seed: int) -> None:
    rng = random.Random(seed)
    schema = random_schema(rng)
    batch = [make_sample(schema, rng) for _ in range(rng.randint(1, 4))]
    assert_same(*both_collate(batch))


@pytest.mark.parametrize("as_worker", ["thread"], indirect=True)
def test_thread_worker_does_not_use_shared_memory(as_worker: None) -> None:
    assert not default_collate([torch.ones(2), torch.ones(2)]).is_shared()


def test_main_process_does_not_use_shared_memory() -> None:
    assert not default_collate([torch.ones(2), torch.ones(2)]).is_shared()


def test_the_main_process_collating_as_a_worker_stacks_into_memory_of_its_own() -> None:
    # Economic mode's main process collating a batch itself: stacked once, straight into memory
    # that, as a worker's batch decoded from its message, torch cannot resize or move under a
    # numpy view (where a second copy into such memory was made before).
    from pipeload.collate import collating_as_a_worker

    with collating_as_a_worker():
        batch = default_collate([torch.full((3,), 1.0), torch.full((3,), 2.0, dtype=torch.float64)])
    assert batch.dtype == torch.float32 and batch.tolist() == [[1.0] * 3, [2.0] * 3]
    assert not batch.untyped_storage().resizable()
    view = batch.numpy()
    with pytest.raises(RuntimeError):
        batch.resize_(10, 3)
    batch.share_memory_()  # moves the bytes: the old ones stay alive under the numpy view
    assert view.tolist() == [[1.0] * 3, [2.0] * 3] and batch.is_shared()
    assert default_collate([torch.ones(2)]).untyped_storage().resizable()  # outside: torch's own


def test_code_posing_as_a_worker_gets_shared_memory_as_from_torchs_collate() -> None:
    # What torch's own test does through its private module, with pipeload's: set
    # _utils.worker._worker_info, and default_collate stacks as in a worker process.
    import pipeload._utils

    tensor, array = torch.zeros(1), np.zeros(1)
    old = pipeload._utils.worker._worker_info
    assert old is None
    try:
        pipeload._utils.worker._worker_info = "x"
        assert pipeload.get_worker_info() == "x"
        assert pipeload._utils.collate.default_collate([tensor]).is_shared()
        assert pipeload._utils.collate.default_collate([array]).is_shared()
    finally:
        pipeload._utils.worker._worker_info = old
    assert pipeload.get_worker_info() is None
    assert not default_collate([tensor]).is_shared()


@pytest.mark.parametrize("as_worker", ["thread"], indirect=True)
def test_a_worker_of_ours_is_what_the_private_module_says(as_worker: None) -> None:
    import pipeload._utils

    assert pipeload._utils.worker._worker_info is pipeload.get_worker_info() is not None


@pytest.mark.parametrize("odd_shape", [(3, 3), (3, 5), (2,)])
def test_ragged_in_worker_still_names_field_and_shapes(as_worker: None, odd_shape: tuple) -> None:
    message = ragged_message([{"image": torch.zeros(3, 4)}, {"image": torch.zeros(odd_shape)}])
    assert f"torch.Size([3, 4]) vs {torch.Size(odd_shape)} at sample 1" in message


# --- default_convert ------------------------------------------------------------------------

CONVERT_CASES: dict[str, Any] = {
    "ndarray": lambda: np.arange(4, dtype=np.int16),
    "ndarray-0d": lambda: np.array(2.5),
    "npscalars": lambda: [t(3) for t in NUMPY_SCALARS],
    "ndarray-str-unchanged": lambda: np.array(["a", "b"]),
    "ndarray-object-unchanged": lambda: np.array([1, None]),
    "np-str-unchanged": lambda: np.str_("x"),
    "tensor": lambda: torch.ones(3),
    "python-numbers": lambda: [1, 2.5, True, None, "s", b"b"],
    "dict": lambda: {"a": np.ones(2), "b": "s"},
    "ordereddict": lambda: OrderedDict(b=np.int32(1), a=[np.float32(2)]),
    "defaultdict": lambda: defaultdict(int, {"v": np.zeros(1)}),
    "frozenmap": lambda: FrozenMap({"v": np.zeros(1)}),
    "keyword-only-map": lambda: KeywordOnlyMap(items={"v": np.zeros(1)}),
    "namedtuple": lambda: Pair(np.zeros(1), 3),
    "tuple-becomes-list": lambda: (np.zeros(1), (np.ones(1),)),
    "userlist": lambda: UserList([np.zeros(1)]),
    "frozenseq": lambda: FrozenSeq([np.zeros(1)]),
    "range": lambda: range(3),
    "str": lambda: "abc",
}


@pytest.mark.parametrize("name", sorted(CONVERT_CASES))
def test_default_convert_matches_torch(name: str) -> None:
    make = CONVERT_CASES[name]
    assert_same(default_convert(make()), torch_default_convert(make()))


@pytest.mark.parametrize("seed", range(100))
def test_default_convert_random_structures_match_torch(seed: int) -> None:
    rng = random.Random(seed)
    sample = make_sample(random_schema(rng), rng)
    assert_same(default_convert(sample), torch_default_convert(sample))


def test_default_convert_returns_untouched_objects_themselves() -> None:
    tensor, text_array = torch.ones(2), np.array(["a"])
    assert default_convert(tensor) is tensor and default_convert(text_array) is text_array


def test_default_convert_keeps_numpy_bytes_scalars() -> None:
    # torch raises TypeError here (it tries to make a tensor of bytes); we keep the value, as
    # it already does for numpy str_ scalars.
    value = np.bytes_(b"ab")
    assert default_convert(value) is value


def test_default_convert_errors_match_torch() -> None:
    assert_same_error(lambda: default_convert(np.datetime64("2020-01-01")),
                      lambda: torch_default_convert(np.datetime64("2020-01-01")))


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_cuda_tensors_stack_on_the_device() -> None:
    batch = [{"x": torch.full((2, 3), float(i), device="cuda"), "y": i} for i in range(3)]
    ours, theirs = both_collate(batch)
    assert ours["x"].device.type == "cuda"
    assert_same(ours, theirs)


class Registered:
    def __init__(self, x: int) -> None:
        self.x = x


def test_a_type_a_library_registered_with_torchs_default_collate_is_collated_by_ours_too() -> None:
    # torch's default_collate_fn_map is a dict of its own: libraries register their types there.
    torch_default_map[Registered] = list_points
    try:
        batch = [{"r": Registered(1), "t": torch.ones(2)}, {"r": Registered(2), "t": torch.zeros(2)}]
        ours = pipeload.default_collate(batch)
        assert ours["r"] == torch_default_collate(batch)["r"] == [1, 2]
        with pytest.raises(TypeError, match="found <class"):  # a map of the user's own is theirs alone
            collate(batch, collate_fn_map={torch.Tensor: torch_default_map[torch.Tensor]})
    finally:
        del torch_default_map[Registered]
