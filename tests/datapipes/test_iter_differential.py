"""Every iterable operation torch.utils.data.datapipes has, against torch's: same class names,
same arguments, same outputs, same lengths, same exception types (torch is the oracle)."""

from __future__ import annotations

import inspect
import warnings
from collections.abc import Callable
from typing import Any

import pytest
import torch
import torch.utils.data.datapipes.iter as theirs_iter
from pipes_for_tests import add, add_one, double, first_letter, is_even, normalise, parity

import pipeload.datapipes.iter as ours_iter
from pipeload.datapipes import IterDataPipe
from pipeload.datapipes.iter import SHARDING_PRIORITIES

# torch warns about lambdas it could not pickle; these pipes are never pickled here.
pytestmark = pytest.mark.filterwarnings("ignore:Local function is not supported by pickle")

TORCH_CLASSES = [name for name in theirs_iter.__all__
                 if name not in {"FileLister", "FileOpener", "RoutedDecoder"}]


def same(build: Callable[[Any], Any], seed: int | None = None) -> list[Any]:
    """Build the pipe with torch's module and ours, iterate both (after the same torch seed)."""
    outputs = []
    for module in (theirs_iter, ours_iter):
        if seed is not None:
            torch.manual_seed(seed)
        outputs.append(normalise(list(build(module))))
    assert outputs[1] == outputs[0]
    return outputs[1]


def same_error(build: Callable[[Any], Any]) -> BaseException:
    with pytest.raises(Exception) as their_error:
        list(build(theirs_iter))
    with pytest.raises(type(their_error.value)) as our_error:
        list(build(ours_iter))
    assert type(our_error.value) is type(their_error.value)
    return our_error.value


def same_length(build: Callable[[Any], Any]) -> None:
    lengths = []
    for module in (theirs_iter, ours_iter):
        try:
            lengths.append(len(build(module)))
        except TypeError:
            lengths.append("TypeError")
    assert lengths[1] == lengths[0]


@pytest.mark.parametrize("name", TORCH_CLASSES)
def test_every_torch_class_exists_with_the_same_arguments(name: str) -> None:
    theirs, ours = getattr(theirs_iter, name), getattr(ours_iter, name)
    wanted = _parameters(theirs)
    got = _parameters(ours)
    assert list(got) == list(wanted)
    for parameter, default in wanted.items():
        if not callable(default) and not isinstance(default, type):  # default_collate is ours
            assert got[parameter] == default, parameter


def _parameters(cls: type) -> dict[str, Any]:
    init = cls.__new__ if "__new__" in vars(cls) else cls.__init__
    params = list(inspect.signature(init).parameters.values())[1:]
    return {p.name: p.default for p in params}


@pytest.mark.parametrize("name", ["batch", "collate", "concat", "demux", "filter", "fork",
                                  "groupby", "map", "mux", "sharding_filter", "shuffle",
                                  "unbatch", "zip"])
def test_functional_names_are_real_methods(name: str) -> None:
    assert inspect.isfunction(getattr(ours_iter.IterableWrapper, name))
    assert name in dir(ours_iter.IterableWrapper([]))


def source(module: Any, data: Any = range(10)) -> Any:
    return module.IterableWrapper(data)


# -- map, filter, collate ------------------------------------------------------------------------


def test_map() -> None:
    assert same(lambda m: source(m).map(add_one)) == list(range(1, 11))
    same_length(lambda m: source(m).map(add_one))


ROWS = [(1, 2, 3), (4, 5, 6)]
DICT_ROWS = [{"a": 1, "b": 2}, {"a": 3, "b": 4}]


@pytest.mark.parametrize("data, fn, input_col, output_col", [
    (ROWS, add_one, 0, None),
    (ROWS, add_one, 1, -1),
    (ROWS, add_one, 2, 0),
    (ROWS, add, [0, 1], None),
    (ROWS, add, (1, 2), -1),
    (ROWS, add, [0, 2], 1),
    ([list(r) for r in ROWS], add, [0, 1], None),
    (DICT_ROWS, add_one, "a", None),
    (DICT_ROWS, add_one, "a", "c"),
    (DICT_ROWS, add, ["a", "b"], "sum"),
    (DICT_ROWS, add, ["a", "b"], None),
])
def test_map_columns(data: Any, fn: Any, input_col: Any, output_col: Any) -> None:
    same(lambda m: source(m, data).map(fn, input_col=input_col, output_col=output_col))


@pytest.mark.parametrize("kwargs", [
    {"fn": add_one, "output_col": 1},
    {"fn": add, "input_col": [0, 1], "output_col": [1, 2]},
    {"fn": add, "input_col": 0},
    {"fn": add_one, "input_col": [0, 1]},
])
def test_map_argument_errors(kwargs: dict[str, Any]) -> None:
    error = same_error(lambda m: source(m, ROWS).map(**kwargs))
    assert isinstance(error, ValueError)


def test_filter() -> None:
    assert same(lambda m: source(m).filter(is_even)) == [0, 2, 4, 6, 8]
    same(lambda m: source(m, ROWS).filter(is_even, input_col=1))
    same(lambda m: source(m, ROWS).filter(lambda a, b: a + b > 4, input_col=[0, 1]))
    same_error(lambda m: source(m).filter(parity))  # not a bool


def test_collate() -> None:
    same(lambda m: source(m).batch(3).collate())
    same(lambda m: source(m, [(i, float(i)) for i in range(6)]).batch(4).collate())
    same(lambda m: source(m).batch(3).collate(collate_fn=sum))
    same(lambda m: source(m).batch(3).collate(conversion=len))


@pytest.mark.parametrize("conversion", [None, 3])
def test_collate_refuses_a_conversion_that_is_no_function_by_name(conversion: Any) -> None:
    # torch fails at the first batch with "'list' object has no attribute 'items'"; ours said
    # TorchArrow was missing (stop 54's pipes skeptic)
    with pytest.raises(TypeError, match=rf"conversion should be the collate function .* but got conversion={conversion}"):
        ours_iter.IterableWrapper(range(3)).batch(2).collate(conversion=conversion)


# -- batch, unbatch, groupby ---------------------------------------------------------------------


@pytest.mark.parametrize("batch_size", [1, 3, 7, 10, 11])
@pytest.mark.parametrize("drop_last", [False, True])
def test_batch(batch_size: int, drop_last: bool) -> None:
    same(lambda m: source(m).batch(batch_size, drop_last=drop_last))
    same_length(lambda m: source(m).batch(batch_size, drop_last=drop_last))
    same_length(lambda m: source(m).filter(is_even).batch(batch_size, drop_last=drop_last))


def test_batch_wrapper_and_errors() -> None:
    batches = same(lambda m: source(m).batch(4, wrapper_class=list))
    assert type(list(ours_iter.IterableWrapper(range(3)).batch(2))[0]).__name__ == "DataChunk"
    assert batches == [[0, 1, 2, 3], [4, 5, 6, 7], [8, 9]]
    same_error(lambda m: source(m).batch(0))


NESTED = [[[0, 1], [2]], [[3, 4], [5]], [[6]]]


@pytest.mark.parametrize("level", [0, 1, 2, -1])
def test_unbatch(level: int) -> None:
    same(lambda m: source(m, NESTED).unbatch(unbatch_level=level))
    same(lambda m: source(m).batch(3).batch(2).unbatch(level))


@pytest.mark.parametrize("level", [3, -2])
def test_unbatch_errors(level: int) -> None:
    same_error(lambda m: source(m, NESTED).unbatch(unbatch_level=level))


WORDS = ["a1", "b1", "a2", "c1", "b2", "a3", "c2", "d1", "a4", "b3", "e1", "a5"]


@pytest.mark.parametrize("kwargs", [
    {},
    {"keep_key": True},
    {"group_size": 2},
    {"group_size": 2, "keep_key": True},
    {"buffer_size": 3},
    {"buffer_size": 4, "group_size": 3, "guaranteed_group_size": 1},
    {"buffer_size": 4, "group_size": 3, "guaranteed_group_size": 2, "drop_remaining": True},
    {"buffer_size": 3, "keep_key": True},
])
def test_groupby(kwargs: dict[str, Any]) -> None:
    same(lambda m: source(m, WORDS).groupby(first_letter, **kwargs))


@pytest.mark.parametrize("kwargs", [
    {"buffer_size": 4, "group_size": 3, "guaranteed_group_size": 2},  # Failed to group items
    {"group_size": 0},
    {"buffer_size": 2, "group_size": 3},
    {"guaranteed_group_size": 2},
])
def test_groupby_errors(kwargs: dict[str, Any]) -> None:
    same_error(lambda m: source(m, WORDS).groupby(first_letter, **kwargs))


# -- shuffle, sampler, sharding ------------------------------------------------------------------


@pytest.mark.parametrize("seed", [0, 1, 12345])
@pytest.mark.parametrize("buffer_size", [1, 3, 100])
def test_shuffle_with_a_seed_gives_torchs_order(seed: int, buffer_size: int) -> None:
    same(lambda m: source(m, range(30)).shuffle(buffer_size=buffer_size).set_seed(seed))


def test_shuffle_without_a_seed_draws_from_the_global_generator_as_torch() -> None:
    def two_epochs(module: Any) -> Any:
        pipe = source(module, range(20)).shuffle()
        return [list(pipe), list(pipe), torch.rand(1).item()]

    same(two_epochs, seed=7)
    same(lambda m: source(m, NESTED).shuffle(unbatch_level=2).set_seed(3))
    same(lambda m: source(m, range(10)).shuffle().set_shuffle(False))
    same(lambda m: source(m, range(10)).shuffle().shuffle(buffer_size=4), seed=11)
    same_length(lambda m: source(m).shuffle())
    same_error(lambda m: source(m).shuffle(buffer_size=0))


def test_sampler_yields_the_samplers_keys() -> None:
    same(lambda m: m.Sampler(source(m)))
    same_length(lambda m: m.Sampler(source(m)))


@pytest.mark.parametrize("shards, shard", [(1, 0), (3, 0), (3, 2), (4, 1), (11, 10)])
def test_sharding_filter(shards: int, shard: int) -> None:
    def build(module: Any) -> Any:
        pipe = source(module).sharding_filter()
        pipe.apply_sharding(shards, shard)
        return pipe

    same(build)
    same_length(build)


def test_sharding_groups_combine_as_torchs() -> None:
    def build(module: Any, group_filter: Any = None) -> Any:
        pipe = source(module, range(30)).sharding_filter(sharding_group_filter=group_filter)
        pipe.apply_sharding(2, 1, sharding_group=SHARDING_PRIORITIES.DISTRIBUTED)
        pipe.apply_sharding(3, 2, sharding_group=SHARDING_PRIORITIES.MULTIPROCESSING)
        return pipe

    same(build)
    same(lambda m: build(m, SHARDING_PRIORITIES.MULTIPROCESSING))
    same_length(build)


@pytest.mark.parametrize("workers, ranks", [(1, 2), (2, 1), (2, 3), (3, 2)])
def test_every_worker_and_rank_shard_of_a_seeded_shuffle_is_torchs_and_each_item_is_read_once(
    workers: int, ranks: int
) -> None:
    from torch.utils.data import graph_settings as theirs_settings

    from pipeload.datapipes import graph as our_settings

    def shard(module: Any, worker: int, rank: int) -> Any:
        settings = theirs_settings if module is theirs_iter else our_settings
        pipe = source(module, range(23)).shuffle(buffer_size=7).sharding_filter().map(double)
        settings.apply_random_seed(pipe, torch.Generator().manual_seed(5))  # as every worker does
        settings.apply_sharding(pipe, workers, worker, SHARDING_PRIORITIES.MULTIPROCESSING)
        settings.apply_sharding(pipe, ranks, rank, SHARDING_PRIORITIES.DISTRIBUTED)
        return pipe

    everything = []
    for rank in range(ranks):
        for worker in range(workers):
            everything += same(lambda m: shard(m, worker, rank))  # noqa: B023  (used at once)
    assert sorted(everything) == [double(i) for i in range(23)]


def test_sharding_errors() -> None:
    def too_far(module: Any) -> Any:
        return source(module).sharding_filter().apply_sharding(2, 2) or []

    def mixed(module: Any) -> Any:
        pipe = source(module).sharding_filter()
        pipe.apply_sharding(2, 0, sharding_group=SHARDING_PRIORITIES.DISTRIBUTED)
        pipe.apply_sharding(2, 0)
        return pipe

    assert "instance_id(2) should be smaller than num_of_instances(2)" in str(same_error(too_far))
    assert str(same_error(mixed)).startswith("ShardingFilter cannot mix DEFAULT and non DEFAULT groups")


# -- several pipes -------------------------------------------------------------------------------


@pytest.mark.parametrize("lengths", [(3,), (3, 5), (5, 3, 4), (0, 2)])
def test_zip_concat_mux(lengths: tuple[int, ...]) -> None:
    def pipes(module: Any) -> list[Any]:
        return [source(module, range(10 * i, 10 * i + n)) for i, n in enumerate(lengths)]

    for operation in ("zip", "concat", "mux"):
        same(lambda m: getattr(pipes(m)[0], operation)(*pipes(m)[1:]))
        same_length(lambda m: getattr(pipes(m)[0], operation)(*pipes(m)[1:]))


def test_several_pipe_errors() -> None:
    same_error(lambda m: m.Concater())
    same_error(lambda m: m.Concater(source(m), [1, 2]))
    same_error(lambda m: m.Zipper(source(m), [1, 2]))


# -- fork and demux ------------------------------------------------------------------------------


@pytest.mark.parametrize("copy", [None, "shallow", "deep"])
def test_fork_branches_see_everything(copy: Any) -> None:
    def zipped(module: Any) -> Any:
        a, b, c = source(module, [[i] for i in range(6)]).fork(3, copy=copy)
        return a.zip(b.map(len), c)

    def one_after_the_other(module: Any) -> Any:
        a, b = source(module).fork(2, copy=copy)
        return list(a) + list(b.map(double))

    same(zipped)
    same(one_after_the_other)
    same_length(lambda m: source(m).fork(2)[1])


def test_fork_of_one_is_the_pipe_itself_and_errors_match() -> None:
    pipe = ours_iter.IterableWrapper(range(3))
    assert pipe.fork(1) is pipe
    same_error(lambda m: source(m).fork(0))
    same_error(lambda m: source(m).fork(2, copy="sideways"))


def test_fork_buffer_overflow_is_torchs_error_with_our_detail() -> None:
    error = same_error(lambda m: source(m).fork(2, buffer_size=3)[0])
    assert isinstance(error, BufferError)
    assert str(error).startswith("ForkerIterDataPipe buffer overflow,buffer size 3 is insufficient.")
    assert "Branch 0" in str(error) and "buffer_size" in str(error)


@pytest.mark.parametrize("items", [5, 1000])
def test_fork_holds_exactly_buffer_size_items_as_torch_does(items: int) -> None:
    # The room was checked before the source was read: a branch read to its end over exactly
    # buffer_size items (range(1000).fork(2), torch's default buffer) asked past the end and
    # raised BufferError for an item that does not exist.
    def one_after_the_other(module: Any) -> Any:
        a, b = source(module, range(items)).fork(2, buffer_size=items)
        return list(a) + list(b)

    assert len(same(one_after_the_other)) == 2 * items
    same_error(lambda m: list(source(m, range(items + 1)).fork(2, buffer_size=items)[0]))


def test_fork_runs_one_pass_for_its_branches() -> None:
    a, b = ours_iter.IterableWrapper(range(5)).shuffle().fork(2)  # no seed: drawn once per run
    pairs = list(a.zip(b))
    assert all(x == y for x, y in pairs) and sorted(x for x, _ in pairs) == list(range(5))


class CountingReads:
    """Counts the source items a graph reads (a module-level callable, so torch's map takes it)."""

    def __init__(self) -> None:
        self.count = 0

    def __call__(self, x: int) -> int:
        self.count += 1
        return x


def _read_in_turn(module: Any, how: str) -> tuple[Any, int, list[str]]:
    """The branches read one after the other, each iterator ended (or dropped) before the next
    is made: what they give, how many source items were read, and the warnings."""
    reads = CountingReads()
    pipe = source(module, range(6)).map(reads)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        if how == "fork list, list":
            a, b = pipe.fork(2)
            out = [list(a), list(b), list(a), list(b)]
        elif how == "demux concat":
            a, b = pipe.demux(2, parity)
            out = [list(a.concat(b)), list(b.concat(a))]
        elif how == "fork a dropped midway":
            a, b = pipe.fork(2)
            first = iter(a)
            out = [[next(first), next(first)]]
            del first
            out += [list(b), list(a)]
        elif how == "fork a twice before b":
            a, b, c = pipe.fork(3)
            out = [list(a), list(b), list(a), list(c), list(b)]
        else:
            raise AssertionError(how)
    return out, reads.count, [str(w.message)[:40] for w in caught if "pickle" not in str(w.message)]


@pytest.mark.parametrize("how", ["fork list, list", "demux concat", "fork a dropped midway",
                                 "fork a twice before b"])
def test_branches_read_in_turn_share_one_pass_of_the_source_as_torchs(how: str) -> None:
    theirs = _read_in_turn(theirs_iter, how)
    ours = _read_in_turn(ours_iter, how)
    assert ours == theirs


class OneShotStream(IterDataPipe):
    """A source whose every pass reads new data (a socket, a message queue)."""

    def __init__(self) -> None:
        self.sent = 0

    def __iter__(self) -> Any:
        for _ in range(3):
            self.sent += 1
            yield self.sent


def test_a_one_shot_source_gives_a_late_fork_branch_the_same_items() -> None:
    a, b = OneShotStream().fork(2)
    first = iter(a)
    seen = list(first)
    del first  # nothing but the fork keeps what b has not read
    assert (seen, list(b)) == ([1, 2, 3], [1, 2, 3])


def test_demux() -> None:
    def branches(module: Any, **kwargs: Any) -> Any:
        evens, odds = source(module).demux(2, parity, **kwargs)
        return list(evens) + list(odds)

    same(branches)
    same(lambda m: source(m).demux(3, lambda x: x % 3)[2])
    same(lambda m: m.Zipper(*source(m).demux(2, parity)))
    same(lambda m: source(m).demux(2, lambda x: None if x == 4 else x % 2, drop_none=True)[0])
    same_length(lambda m: source(m).demux(2, parity)[0])
    with pytest.raises(TypeError, match="demux branch 1 has no length"):
        len(source(ours_iter).demux(2, parity)[1])


def test_demux_errors() -> None:
    same_error(lambda m: source(m).demux(2, lambda x: 5)[0])
    same_error(lambda m: source(m).demux(2, lambda x: None)[0])
    error = same_error(lambda m: source(m).demux(2, parity, buffer_size=2)[1])
    assert str(error).startswith(
        "DemultiplexerIterDataPipe buffer overflow, buffer size 2 is insufficient."
    )
    same_error(lambda m: source(m).demux(0, parity))


# -- sources and whole chains --------------------------------------------------------------------


def test_iterable_wrapper_copies_unless_told() -> None:
    def mutate_twice(module: Any, deepcopy: bool) -> Any:
        data = [[0], [1]]
        pipe = source(module, data) if deepcopy else module.IterableWrapper(data, deepcopy=False)
        for item in pipe:
            item.append("x")
        return list(pipe) + [data]

    same(lambda m: mutate_twice(m, True))
    same(lambda m: mutate_twice(m, False))
    same_length(lambda m: source(m, iter(range(3))))


def test_a_long_chain_matches_torch() -> None:
    def chain(module: Any) -> Any:
        pipe = source(module, range(100)).shuffle(buffer_size=16).set_seed(5)
        pipe = pipe.map(double).filter(is_even).batch(7, drop_last=True).unbatch()
        evens, odds = pipe.map(lambda x: x // 2).demux(2, parity, buffer_size=100)
        return evens.mux(odds).batch(5).collate()

    same(chain)


@pytest.mark.parametrize("chunk", [None, 1, 2, 10])
def test_stream_reader_matches_torch(chunk: int | None) -> None:
    import io

    same(lambda m: m.StreamReader(m.IterableWrapper(
        [("letters", io.StringIO("abcde")), ("empty", io.BytesIO(b"")), ("bytes", io.BytesIO(b"xyz"))],
        deepcopy=False), chunk=chunk))
