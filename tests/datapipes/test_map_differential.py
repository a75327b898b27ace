"""Every map-style operation torch.utils.data.datapipes.map has, against torch's."""

from __future__ import annotations

import inspect
from collections.abc import Callable
from typing import Any

import pytest
import torch
import torch.utils.data.datapipes.map as theirs_map
from pipes_for_tests import add_one, normalise

import pipeload.datapipes.map as ours_map


def read_all(pipe: Any) -> list[Any]:
    if isinstance(pipe, (ours_map.Shuffler, theirs_map.Shuffler)):
        return list(pipe)
    return [pipe[i] for i in range(len(pipe))]


def same(build: Callable[[Any], Any], seed: int | None = None) -> list[Any]:
    outputs = []
    for module in (theirs_map, ours_map):
        if seed is not None:
            torch.manual_seed(seed)
        outputs.append(normalise(read_all(build(module))))
    assert outputs[1] == outputs[0]
    return outputs[1]


def same_error(action: Callable[[Any], Any]) -> BaseException:
    with pytest.raises(Exception) as their_error:
        action(theirs_map)
    with pytest.raises(type(their_error.value)) as our_error:
        action(ours_map)
    return our_error.value


@pytest.mark.parametrize("name", theirs_map.__all__)
def test_every_torch_class_exists_with_the_same_arguments(name: str) -> None:
    theirs, ours = getattr(theirs_map, name), getattr(ours_map, name)
    wanted = list(inspect.signature(theirs.__init__).parameters)
    assert list(inspect.signature(ours.__init__).parameters) == wanted


def source(module: Any, data: Any = range(10)) -> Any:
    return module.SequenceWrapper(data)


def test_map_and_default_identity() -> None:
    assert same(lambda m: source(m).map(add_one)) == list(range(1, 11))
    same(lambda m: source(m).map())


@pytest.mark.parametrize("batch_size", [1, 3, 4, 10, 12])
@pytest.mark.parametrize("drop_last", [False, True])
def test_batch(batch_size: int, drop_last: bool) -> None:
    same(lambda m: source(m).batch(batch_size, drop_last=drop_last))
    same_error(lambda m: source(m).batch(batch_size, drop_last=drop_last)[12])


@pytest.mark.parametrize("seed", [0, 3, 99])
def test_shuffle_with_a_seed_gives_torchs_order(seed: int) -> None:
    same(lambda m: source(m, range(25)).shuffle().set_seed(seed))
    same(lambda m: source(m, range(25)).shuffle(indices=[3, 1, 4, 1, 5]).set_seed(seed))


def test_shuffle_without_a_seed_and_disabled() -> None:
    def two_runs(module: Any) -> Any:
        pipe = source(module).shuffle()
        return [list(pipe), list(pipe), torch.rand(1).item()]

    outputs = []
    for module in (theirs_map, ours_map):
        torch.manual_seed(4)
        outputs.append(two_runs(module))
    assert outputs[0] == outputs[1]
    same(lambda m: source(m).shuffle().set_shuffle(False))
    assert len(ours_map.SequenceWrapper(range(7)).shuffle()) == 7


def test_concat_and_zip() -> None:
    same(lambda m: source(m, range(3)).concat(source(m, "abcd"), source(m, [9])))
    same(lambda m: source(m, range(3)).zip(source(m, "abcd")))
    same_error(lambda m: source(m, range(3)).concat(source(m))[13])
    same_error(lambda m: m.Concater())
    same_error(lambda m: m.Concater(source(m), [1]))
    same_error(lambda m: m.Zipper())


def test_zip_index_error_names_the_pipe() -> None:
    error = same_error(lambda m: source(m, range(3)).zip(source(m, "ab"))[2])
    assert str(error).startswith("Index 2 is out of range for one of the input MapDataPipes")


def test_sequence_wrapper_of_a_mapping_and_deepcopy() -> None:
    data = {"a": [1], "b": [2]}
    for module in (theirs_map, ours_map):
        copied, shared = module.SequenceWrapper(data), module.SequenceWrapper(data, deepcopy=False)
        data["a"].append(0)
        assert (copied["a"], shared["a"]) == ([1], [1, 0])
        data["a"].pop()


def test_to_iter_datapipe() -> None:
    pipe = ours_map.SequenceWrapper("abcde")
    assert list(pipe.to_iter_datapipe()) == list("abcde")
    assert list(pipe.to_iter_datapipe(indices=[4, 0])) == ["e", "a"]
    assert len(pipe.to_iter_datapipe([1, 2])) == 2
    assert list(pipe.to_iter_datapipe().batch(2)) == [["a", "b"], ["c", "d"], ["e"]]
