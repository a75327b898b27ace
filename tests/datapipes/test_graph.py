"""Whole-graph functions: walking, finding, replacing, copying, sharding and seeding, on our pipes,
torch's pipes and graphs that mix them."""

from __future__ import annotations

from typing import Any

import pytest
import torch
import torch.utils.data.datapipes.iter as theirs_iter
import torch.utils.data.graph as theirs_graph
import torch.utils.data.graph_settings as theirs_settings
from pipes_for_tests import add_one, double, normalise

import pipeload.datapipes.iter as ours_iter
from pipeload.datapipes import IterDataPipe, graph
from pipeload.datapipes.iter import Batcher, IterableWrapper, Mapper, ShardingFilter, Shuffler


def shape(g: dict[int, Any]) -> list[Any]:
    return [(type(pipe).__name__.replace("IterDataPipe", ""), shape(parents)) for pipe, parents in g.values()]


def diamond(module: Any) -> Any:
    a, b = module.IterableWrapper(range(12)).shuffle().fork(2)
    return a.map(double).zip(b.shuffle()).shuffle().batch(3)


def test_traverse_dps_has_torchs_shape() -> None:
    theirs = shape(theirs_graph.traverse_dps(diamond(theirs_iter)))
    ours = shape(graph.traverse_dps(diamond(ours_iter)))
    rename = {"_ChildDataPipe": "_Branch", "_Forker": "_ForkSource"}

    def named(tree: list[Any]) -> list[Any]:
        return [(rename.get(name, name), named(parents)) for name, parents in tree]

    assert named(theirs) == ours
    with pytest.raises(RuntimeError, match="Expected `IterDataPipe` or `MapDataPipe`"):
        graph.traverse_dps([1, 2])


def test_list_and_find() -> None:
    pipe = diamond(ours_iter)
    nodes = graph.list_dps(pipe)
    assert [type(n).__name__ for n in nodes] == [
        "Batcher", "Shuffler", "Zipper", "Mapper", "_Branch", "_ForkSource", "Shuffler",
        "IterableWrapper", "Shuffler", "_Branch",
    ]
    assert len(graph.find_dps(pipe, Shuffler)) == 3
    assert graph.find_dps(pipe, (Batcher, Mapper)) == [nodes[0], nodes[3]]
    zipper = nodes[2]
    assert graph.list_dps(pipe, exclude_dps=zipper) == nodes[:2]


def test_the_graph_functions_take_a_traversed_graph_as_torchdatas_do() -> None:
    # torchdata's list_dps, find_dps, replace_dp and remove_dp take traverse_dps() graphs: ours
    # read one as a pipe, and found nothing in it (stop 53's pipes skeptic).
    dp = IterableWrapper(range(6)).shuffle().map(add_one).batch(2)
    traversed = graph.traverse_dps(dp)
    assert graph.list_dps(traversed) == graph.list_dps(dp)
    (shuffle,) = graph.find_dps(traversed, Shuffler)
    without = graph.remove_dp(traversed, shuffle)
    assert isinstance(without, dict) and graph.find_dps(without, Shuffler) == []
    ((last, _),) = without.values()
    assert list(last) == [[1, 2], [3, 4], [5, 6]]
    with pytest.raises(TypeError, match="list_dps: expected a DataPipe or a traverse_dps"):
        graph.list_dps([dp])


def test_replace_and_remove_change_the_graph_in_place_as_torchdatas_do() -> None:
    # torchdata's replace_dp reassigns the reading pipe's attribute: code written for it keeps
    # iterating the pipe it built. Ours built a new graph and left that one as it was (stop 54's
    # pipes skeptic: the edit silently did not take).
    pipe = IterableWrapper(range(9)).shuffle().set_seed(1).map(add_one).batch(3)
    (shuffle,) = graph.find_dps(pipe, Shuffler)
    assert graph.replace_dp(pipe, shuffle, shuffle.datapipe) is pipe
    assert list(pipe) == [[1, 2, 3], [4, 5, 6], [7, 8, 9]] and graph.find_dps(pipe, Shuffler) == []
    with pytest.raises(ValueError, match="is not in the graph"):
        graph.replace_dp(pipe, shuffle, shuffle.datapipe)
    (mapper,) = graph.find_dps(pipe, Mapper)
    assert graph.remove_dp(pipe, mapper) is pipe
    assert list(pipe) == [[0, 1, 2], [3, 4, 5], [6, 7, 8]]
    with pytest.raises(ValueError, match="exactly one parent"):
        graph.remove_dp(pipe, graph.find_dps(pipe, IterableWrapper)[0])


def test_replace_can_put_a_pipe_after_the_one_it_replaces_and_replace_the_last_pipe() -> None:
    source = IterableWrapper(range(4))
    pipe = source.map(add_one)
    assert graph.replace_dp(pipe, source, source.map(add_one)) is pipe  # a pipe put after the source
    assert list(pipe) == [2, 3, 4, 5]
    other = IterableWrapper(range(2))
    assert graph.replace_dp(pipe, pipe, other) is other
    traversed = graph.replace_dp(graph.traverse_dps(other), other, IterableWrapper("ab"))
    ((last, _),) = traversed.values()
    assert list(last) == ["a", "b"]


def test_replace_keeps_a_shared_node_shared() -> None:
    a, b = IterableWrapper(range(4)).fork(2)
    pipe = a.zip(b.map(add_one))
    (source,) = graph.find_dps(pipe, IterableWrapper)
    assert graph.replace_dp(pipe, source, IterableWrapper(range(10, 14))) is pipe
    assert list(pipe) == [(10, 11), (11, 12), (12, 13), (13, 14)]


def test_a_replacement_in_a_copy_leaves_the_original_graph_as_it_was() -> None:
    # What the loader does to place process boundaries: the user's graph is never changed.
    a, b = IterableWrapper(range(4)).fork(2)
    pipe = a.zip(b.map(add_one))
    (source,) = graph.find_dps(pipe, IterableWrapper)
    swapped = graph.replaced_in_a_copy(pipe, source, IterableWrapper(range(10, 14)))
    assert list(swapped) == [(10, 11), (11, 12), (12, 13), (13, 14)]
    assert list(pipe) == [(0, 1), (1, 2), (2, 3), (3, 4)]


def test_copy_graph_copies_every_node_but_not_the_data() -> None:
    data = list(range(6))
    pipe = IterableWrapper(data, deepcopy=False).sharding_filter().map(add_one)
    copied = graph.copy_graph(pipe)
    originals, copies = graph.list_dps(pipe), graph.list_dps(copied)
    assert len(copies) == 3 and not {id(n) for n in originals} & {id(n) for n in copies}
    assert copies[-1].iterable is data
    graph.apply_sharding(copied, 2, 1)
    assert list(copied) == [2, 4, 6] and list(pipe) == [1, 2, 3, 4, 5, 6]


def test_sharding_twice_on_one_path_is_torchs_error() -> None:
    for module, settings in ((theirs_iter, theirs_settings), (ours_iter, graph)):
        pipe = module.IterableWrapper(range(4)).sharding_filter().sharding_filter()
        with pytest.raises(RuntimeError, match="Sharding twice on a single pipeline"):
            settings.apply_sharding(pipe, 2, 0)


def test_sharding_each_branch_is_fine() -> None:
    left = IterableWrapper(range(6)).sharding_filter()
    right = IterableWrapper(range(10, 16)).sharding_filter()
    assert list(graph.apply_sharding(left.zip(right), 3, 1)) == [(1, 11), (4, 14)]


@pytest.mark.parametrize("seed", [0, 5])
def test_apply_random_seed_draws_as_torch(seed: int) -> None:
    outputs = []
    for module, settings in ((theirs_iter, theirs_settings), (ours_iter, graph)):
        pipe = diamond(module)
        settings.apply_random_seed(pipe, torch.Generator().manual_seed(seed))
        outputs.append(normalise(list(pipe)))
    assert outputs[0] == outputs[1]


def test_our_graph_functions_handle_torchs_pipes_and_mixed_graphs() -> None:
    theirs = theirs_iter.IterableWrapper(range(10)).shuffle().sharding_filter()
    expected = theirs_settings.apply_sharding(
        theirs_settings.apply_random_seed(theirs, torch.Generator().manual_seed(3)), 2, 1)
    expected_items = list(expected)

    again = theirs_iter.IterableWrapper(range(10)).shuffle().sharding_filter()
    graph.apply_sharding(graph.apply_random_seed(again, torch.Generator().manual_seed(3)), 2, 1)
    assert list(again) == expected_items

    ours_over_theirs = Mapper(theirs_iter.IterableWrapper(range(6)).sharding_filter(), add_one)
    assert list(graph.apply_sharding(ours_over_theirs, 3, 0)) == [1, 4]
    theirs_over_ours = theirs_iter.Mapper(IterableWrapper(range(6)).sharding_filter(), add_one)
    assert list(graph.apply_sharding(theirs_over_ours, 3, 2)) == [3, 6]
    assert graph.has_sharding(theirs_over_ours) and not graph.has_sharding(IterableWrapper([]))


def test_copy_graph_of_torchs_pipes_shares_no_sharding_state() -> None:
    pipe = theirs_iter.IterableWrapper(range(6)).sharding_filter()
    copied = graph.copy_graph(pipe)
    graph.apply_sharding(copied, 2, 0)
    assert list(copied) == [0, 2, 4] and list(pipe) == list(range(6))


def test_apply_shuffle_settings() -> None:
    pipe = IterableWrapper(range(8)).shuffle().set_seed(0).map(add_one)
    assert graph.apply_shuffle_settings(pipe, shuffle=False) is pipe
    assert list(pipe) == list(range(1, 9))
    assert graph.apply_shuffle_settings(pipe, None) is pipe
    plain = IterableWrapper(range(8))
    with pytest.warns(UserWarning, match="does not contain a `Shuffler`. Adding one at the end"):
        shuffled = graph.apply_shuffle_settings(plain, shuffle=True)
    assert isinstance(shuffled, Shuffler) and sorted(shuffled) == list(range(8))
    assert graph.find_dps(shuffled, ShardingFilter) == []


def named_shape(g: dict[int, Any]) -> list[Any]:
    return [(type(pipe).__name__.replace("MapDataPipe", "").replace("IterDataPipe", ""), named_shape(parents))
            for pipe, parents in g.values()]


@pytest.mark.parametrize("build", [
    lambda it, mp: it.IterableWrapper(mp.SequenceWrapper(range(5)).shuffle()),
    lambda it, mp: it.IterableWrapper(mp.SequenceWrapper(range(5)).map(add_one)).map(double),
    lambda it, mp: it.IterableWrapper([it.IterableWrapper(range(2)).map(double), it.IterableWrapper(range(3))]).batch(2),
])
def test_traverse_dps_sees_through_wrappers_as_torchs_does(build: Any) -> None:
    import torch.utils.data.datapipes.map as theirs_map

    import pipeload.datapipes.map as ours_map

    theirs = named_shape(theirs_graph.traverse_dps(build(theirs_iter, theirs_map)))
    ours = named_shape(graph.traverse_dps(build(ours_iter, ours_map)))
    rename = {"ShufflerIter": "Shuffler", "Map": "Mapper", "Batcher": "Batcher"}

    def renamed(tree: list[Any]) -> list[Any]:
        return [(rename.get(name, name), renamed(parents)) for name, parents in tree]

    assert renamed(theirs) == ours


def test_get_all_graph_pipes_lists_each_pipe_once_before_its_parents_as_torchs() -> None:
    theirs = theirs_settings.get_all_graph_pipes(theirs_graph.traverse_dps(diamond(theirs_iter)))
    ours = graph.get_all_graph_pipes(graph.traverse_dps(diamond(ours_iter)))
    rename = {"_ChildDataPipe": "_Branch", "_Forker": "_ForkSource"}
    theirs_names = [type(p).__name__.replace("IterDataPipe", "") for p in theirs]
    assert [rename.get(name, name) for name in theirs_names] == [type(p).__name__ for p in ours]
    pipe = diamond(ours_iter)
    assert graph.get_all_graph_pipes(graph.traverse_dps(pipe)) == graph.list_dps(pipe)


class SelfReferring(IterDataPipe):
    """torch's test case: a pipe whose inner graph calls back into it, and that cannot be hashed."""

    def add_v(self, x: int) -> int:
        return x + self.v

    def __init__(self, source: Any) -> None:
        self._dp = source.map(self.add_v)
        self.v = 1

    def __iter__(self) -> Any:
        yield from self._dp

    def __hash__(self) -> int:
        raise NotImplementedError


def test_a_pipe_that_refers_to_itself_and_cannot_be_hashed_is_walked_once() -> None:
    source = IterableWrapper(list(range(4)))
    pipe = SelfReferring(source)
    assert graph.traverse_dps(pipe) == {id(pipe): (pipe, {id(pipe._dp): (pipe._dp, {id(source): (source, {})})})}
    assert len(graph.get_all_graph_pipes(graph.traverse_dps(pipe))) == 3
    assert list(pipe) == [1, 2, 3, 4]


def test_the_public_names_are_listed() -> None:
    namespace: dict[str, Any] = {}
    exec("from pipeload.datapipes.graph import *", namespace)  # noqa: S102  (what a user writes)
    public = {name for name in vars(graph) if not name.startswith("_") and callable(getattr(graph, name))
              and getattr(getattr(graph, name), "__module__", "") == graph.__name__}
    assert public <= set(graph.__all__) and set(graph.__all__) <= set(namespace)
    assert {"traverse_dps", "get_all_graph_pipes", "DataPipeGraph"} <= set(graph.__all__)
    pipe = IterableWrapper([1]).map(add_one)
    with pytest.warns(FutureWarning, match="use `traverse_dps`"):
        assert graph.traverse(pipe) == graph.traverse_dps(pipe)
