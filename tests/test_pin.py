"""pin_memory walks batches like torch's: same structure and types out, custom pinning honoured.

This machine may have no accelerator, where ``Tensor.pin_memory()`` raises; the structural tests
then swap in a stand-in that tags the tensors it "pins", and compare against torch's walk under
the same stand-in. Real pinning is checked only where CUDA is present.
"""

from __future__ import annotations

from collections import OrderedDict, UserList, defaultdict, namedtuple
from collections.abc import Mapping, Sequence
from typing import Any

import pytest
import torch
from torch.utils.data._utils.pin_memory import pin_memory as torch_pin_memory

from pipeload.pin import pin_memory, pinning_available
from oracle import FrozenMap, KeywordOnlyMap

Pair = namedtuple("Pair", ["left", "right"])
needs_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")


class Shape(tuple):
    """A tuple subclass that is not a namedtuple."""


class CustomBatch:
    """A user batch type that knows how to pin itself."""

    def __init__(self, data: torch.Tensor) -> None:
        self.data = data
        self.pin_calls = 0

    def pin_memory(self) -> CustomBatch:
        self.pin_calls += 1
        self.data = self.data.pin_memory()
        return self


class PinnableDict(dict):
    """A mapping with its own pin_memory: the method wins over walking the mapping."""

    def pin_memory(self) -> str:
        return "pinned by method"


@pytest.fixture
def fake_pinning(monkeypatch: pytest.MonkeyPatch) -> list[torch.Tensor]:
    """Replace Tensor.pin_memory with a clone that remembers every tensor it returned."""
    pinned: list[torch.Tensor] = []

    def fake_pin(self: torch.Tensor, *args: Any, **kwargs: Any) -> torch.Tensor:
        copy = self.clone()
        pinned.append(copy)
        return copy

    monkeypatch.setattr(torch.Tensor, "pin_memory", fake_pin)
    return pinned


def t(value: float) -> torch.Tensor:
    return torch.full((2,), value)


STRUCTURES: dict[str, Any] = {
    "tensor": lambda: t(1),
    "dict": lambda: {"a": t(1), "b": "s", "c": 3},
    "ordereddict": lambda: OrderedDict(b=t(1), a=[t(2)]),
    "defaultdict": lambda: defaultdict(list, {"v": t(1)}),
    "frozenmap": lambda: FrozenMap({"v": t(1)}),
    "keyword-only-map": lambda: KeywordOnlyMap(items={"v": t(1)}),
    "namedtuple": lambda: Pair(t(1), "x"),
    "tuple-stays-tuple": lambda: (t(1), (t(2), b"b")),
    "tuple-subclass": lambda: Shape([t(1), 2]),
    "list": lambda: [t(1), None, 2.5],
    "userlist": lambda: UserList([t(1)]),
    "range": lambda: range(3),
    "strings": lambda: ["a", b"b"],
    "leaves": lambda: [None, 1, 2.5, True, object],
    "nested": lambda: {"x": [Pair(t(1), {"y": (t(2),)})], "meta": OrderedDict(id="7")},
}


def assert_same_structure(ours: Any, theirs: Any, where: str = "batch") -> None:
    assert type(ours) is type(theirs), f"{where}: {type(ours)} vs {type(theirs)}"
    if isinstance(theirs, torch.Tensor):
        assert torch.equal(ours, theirs), where
    elif isinstance(theirs, Mapping):
        assert list(ours) == list(theirs), where
        if isinstance(theirs, defaultdict):
            assert ours.default_factory is theirs.default_factory
        for key in theirs:
            assert_same_structure(ours[key], theirs[key], f"{where}[{key!r}]")
    elif isinstance(theirs, Sequence) and not isinstance(theirs, (str, bytes)):
        assert len(ours) == len(theirs), where
        for index, (mine, other) in enumerate(zip(ours, theirs)):
            assert_same_structure(mine, other, f"{where}[{index}]")
    else:
        assert ours == theirs, where


def tensors_in(data: Any) -> list[torch.Tensor]:
    if isinstance(data, torch.Tensor):
        return [data]
    if isinstance(data, Mapping):
        return [x for value in data.values() for x in tensors_in(value)]
    if isinstance(data, Sequence) and not isinstance(data, (str, bytes)):
        return [x for item in data for x in tensors_in(item)]
    return []


@pytest.mark.parametrize("name", sorted(STRUCTURES))
def test_structure_matches_torch(name: str, fake_pinning: list[torch.Tensor]) -> None:
    ours = pin_memory(STRUCTURES[name]())
    our_pinned = list(fake_pinning)
    theirs = torch_pin_memory(STRUCTURES[name]())
    assert_same_structure(ours, theirs)
    # Every tensor in the result is one the pinning call produced, and no other was made.
    assert sorted(map(id, tensors_in(ours))) == sorted(map(id, our_pinned))


def test_leaves_pass_through_as_the_same_objects() -> None:
    marker = object()
    for leaf in ("text", b"bytes", 3, 2.5, None, marker):
        assert pin_memory(leaf) is leaf


def test_custom_pin_memory_method_is_called(fake_pinning: list[torch.Tensor]) -> None:
    batch = CustomBatch(t(1))
    result = pin_memory({"batch": batch, "other": [batch]})
    assert result["batch"] is batch and result["other"][0] is batch
    assert batch.pin_calls == 2


def test_method_on_a_mapping_wins_over_walking_it() -> None:
    assert pin_memory(PinnableDict(a=1)) == "pinned by method"
    assert torch_pin_memory(PinnableDict(a=1)) == "pinned by method"


def test_device_argument_is_accepted(fake_pinning: list[torch.Tensor]) -> None:
    assert_same_structure(pin_memory({"a": t(1)}, device="cuda"), {"a": t(1)})


def test_pinning_available_matches_torch() -> None:
    accelerator = getattr(torch, "accelerator", torch.cuda)
    expected = accelerator.is_available()
    assert pinning_available() is expected


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the accelerator-less failure")
def test_without_an_accelerator_tensor_pinning_raises_like_torch() -> None:
    with pytest.raises(RuntimeError):
        torch_pin_memory(t(1))
    with pytest.raises(RuntimeError):
        pin_memory({"a": t(1)})


@pytest.mark.skipif(pinning_available(), reason="checks the accelerator-less warning")
@pytest.mark.parametrize("module", ["torch", "pipeload"])
def test_without_an_accelerator_the_pin_memory_warning_comes_before_a_timeout_refusal(module: str) -> None:
    # torch's iterator warns before its single-process iterator refuses the timeout; ours
    # refused first and never warned (stop 54's parity fuzz).
    import warnings

    import torch.utils.data as tud

    import pipeload

    loader = (tud if module == "torch" else pipeload).DataLoader(range(4), pin_memory=True, timeout=5)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        with pytest.raises(AssertionError, match="requires timeout == 0"):
            iter(loader)
    assert any("'pin_memory' argument is set as true but no accelerator is found" in str(w.message) for w in caught)


@needs_cuda
def test_real_pinning_pins_every_tensor() -> None:
    batch = {"x": [Pair(t(1), {"y": (t(2),)})], "name": "n", "n": 3}
    result = pin_memory(batch)
    tensors = tensors_in(result)
    assert len(tensors) == 2 and all(x.is_pinned() for x in tensors)
    assert_same_structure(result, batch)
    assert pinning_available()


@needs_cuda
def test_real_pinning_of_a_custom_batch() -> None:
    batch = pin_memory(CustomBatch(t(3)))
    assert batch.pin_calls == 1 and batch.data.is_pinned()


@needs_cuda
def test_already_pinned_tensors_pass_through_without_a_copy() -> None:
    pinned = t(4).pin_memory()
    result = pin_memory({"x": pinned, "custom": CustomBatch(t(2))})
    assert result["x"] is pinned
    assert result["custom"].pin_calls == 1  # custom types are still asked to pin themselves
