"""The pipe base classes: the functional registry, descriptions that pickle, lazy setup."""

from __future__ import annotations

import copy
import inspect
import pickle
import pydoc
from collections.abc import Iterator
from typing import Any

import pytest
import torch.utils.data as tud
from pipes_for_tests import ListsWhereUsed, add_one

import pipeload
from pipeload.datapipes import IterDataPipe, MapDataPipe, functional_datapipe, lazy_init
from pipeload.datapipes._iter_ops import IterOperations
from pipeload.datapipes._map_ops import MapOperations
from pipeload.datapipes.iter import IterableWrapper, Mapper
from pipeload.datapipes.map import SequenceWrapper


def test_the_package_exports_torchs_names() -> None:
    for name in ("IterDataPipe", "MapDataPipe", "functional_datapipe", "DataChunk"):
        assert hasattr(tud, name) and hasattr(pipeload, name)
    assert isinstance(IterableWrapper([]), pipeload.IterableDataset)
    assert isinstance(SequenceWrapper([]), pipeload.Dataset)


@functional_datapipe("times")
class Times(IterDataPipe):
    def __init__(self, source: IterDataPipe, factor: int = 2) -> None:
        self.source = source
        self.factor = factor

    def __iter__(self) -> Iterator[int]:
        return (x * self.factor for x in self.source)


@functional_datapipe("plus_key")
class PlusKey(MapDataPipe):
    def __init__(self, source: MapDataPipe) -> None:
        self.source = source

    def __getitem__(self, index: int) -> int:
        return self.source[index] + index

    def __len__(self) -> int:
        return len(self.source)


def test_functional_datapipe_registers_a_chainable_method() -> None:
    pipe = IterableWrapper(range(4)).times(factor=3).map(add_one).times()
    assert list(pipe) == [2, 8, 14, 20]
    assert "times" in dir(pipe) and IterDataPipe.functions["times"].__doc__ == Times.__doc__
    assert list(SequenceWrapper([10, 10]).plus_key()) == [10, 11]
    assert not hasattr(SequenceWrapper([]), "times")


def test_functional_datapipe_refuses_a_taken_name_as_torch_does() -> None:
    for module in (tud, pipeload):
        with pytest.raises(Exception, match="Unable to add DataPipe function name map as it is already taken"):
            @module.functional_datapipe("map")
            class Clash(module.IterDataPipe):
                pass
    with pytest.raises(TypeError, match="can only decorate IterDataPipe"):
        functional_datapipe("nothing")(object)


def test_a_pipe_pickles_as_its_description() -> None:
    pipe = IterableWrapper(range(6)).map(add_one).shuffle().set_seed(3).batch(2)
    restored = pickle.loads(pickle.dumps(pipe))
    assert list(restored) == list(pipe)  # the seed travels with the description: same order
    assert repr(restored) == repr(pipe)
    assert str(restored.datapipe.datapipe) == "Mapper(add_one) <- IterableWrapper(range(0, 6))"


def test_a_pipes_repr_says_what_it_applies_and_where_it_reads_from() -> None:
    # It read just "Mapper": nothing of which function, nor over what.
    pipe = IterableWrapper(list(range(200))).shuffle(buffer_size=50).map(add_one).batch(4)
    assert repr(pipe) == ("Batcher(batch_size=4) <- Mapper(add_one) <- Shuffler(buffer_size=50) "
                          "<- IterableWrapper(list of 200 items)")
    deep = pipe.map(add_one).map(add_one)
    assert repr(deep) == "Mapper(add_one) <- Mapper(add_one) <- Batcher(batch_size=4) <- Mapper(add_one) <- ..."
    assert str(IterableWrapper(range(3)).zip(IterableWrapper(range(3)))) == (
        "Zipper <- (IterableWrapper(range(0, 3)), IterableWrapper(range(0, 3)))")


def test_two_iterators_over_one_pipe_do_not_disturb_each_other() -> None:
    pipe = IterableWrapper(range(5)).map(add_one)
    first, second = iter(pipe), iter(pipe)
    assert [next(first), next(first), next(second), next(first), next(second)] == [1, 2, 1, 3, 2]


class Lookup(IterDataPipe):
    made: list[int] = []

    def __init__(self, source: IterDataPipe, offset: int) -> None:
        self.source = source
        self.offset = offset

    @lazy_init
    def table(self) -> dict[int, int]:
        Lookup.made.append(self.offset)
        return {i: i + self.offset for i in range(100)}

    def __iter__(self) -> Iterator[int]:
        return (self.table[x] for x in self.source)


def test_lazy_init_runs_on_first_use_and_is_never_pickled_or_copied() -> None:
    Lookup.made.clear()
    pipe = Lookup(IterableWrapper(range(3)), offset=10)
    assert Lookup.made == []  # nothing at construction
    assert list(pipe) == [10, 11, 12] and list(pipe) == [10, 11, 12]
    assert Lookup.made == [10]  # once, then cached
    assert Lookup.table.is_ready(pipe)
    restored = pickle.loads(pickle.dumps(pipe))
    assert not Lookup.table.is_ready(restored) and not Lookup.table.is_ready(copy.copy(pipe))
    assert list(restored) == [10, 11, 12] and Lookup.made == [10, 10]


class Listing(MapDataPipe):
    def __init__(self, count: int) -> None:
        self.count = count
        self.lazy_inits = 0

    def lazy_init(self) -> None:
        self.items = [10 * i for i in range(self.count)]
        self.lazy_inits += 1

    def __getitem__(self, index: int) -> int:
        return self.items[index]

    def __len__(self) -> int:
        return len(self.items)


class ListsTens(ListsWhereUsed):
    def __iter__(self) -> Iterator[tuple[int, int]]:
        return ((10 * number, pid) for number, pid in super().__iter__())


def test_the_rfcs_lazy_init_method_is_called_once_before_the_first_iter_or_len() -> None:
    pipe = ListsWhereUsed(3)
    assert pipe.numbers is None  # nothing at construction
    assert len(pipe) == 3 and [n for n, _ in pipe] == [0, 1, 2] and [n for n, _ in pipe] == [0, 1, 2]
    assert pipe.lazy_inits == 1
    assert [n for n, _ in ListsWhereUsed(2).map(add_one_to_first)] == [1, 2]  # through a chain
    assert [n for n, _ in ListsTens(3)] == [0, 10, 20]  # a subclass overriding __iter__
    listing = Listing(4)
    assert listing[2] == 20 and len(listing) == 4 and listing.lazy_inits == 1


class _ListsWhenAsked(pipeload.datapipes.NonBlockingIterDataPipe):
    """A non-blocking source read only through ``nonblocking_next()``, as the RFC's loop reads."""

    def __init__(self) -> None:
        self.names: list[str] | None = None
        self.position = 0

    def lazy_init(self) -> None:
        self.names = ["a", "b"]

    def reset(self) -> None:
        self.position = 0

    def nonblocking_next(self) -> str:
        if self.position == len(self.names):
            raise StopIteration
        self.position += 1
        return self.names[self.position - 1]


def test_the_rfcs_lazy_init_runs_before_a_first_nonblocking_next() -> None:
    source = _ListsWhenAsked()
    assert [source.nonblocking_next(), source.nonblocking_next()] == ["a", "b"]


def test_the_rfcs_lazy_init_runs_again_in_each_copy() -> None:
    pipe = ListsWhereUsed(3)
    list(pipe)
    restored, copied = pickle.loads(pickle.dumps(pipe)), copy.copy(pipe)
    list(restored), list(copied)
    assert (restored.lazy_inits, copied.lazy_inits) == (2, 2)


def add_one_to_first(pair: tuple[int, int]) -> tuple[int, int]:
    return pair[0] + 1, pair[1]


def _pipe_with_reset(base: type) -> Any:
    """A pipe written for torch: its per-run state is set in reset(), which torch's
    IterDataPipe calls each time the pipe is iterated."""

    class Remaining(base):  # type: ignore[misc, valid-type]
        def __init__(self, count: int) -> None:
            self.count, self.resets = count, 0

        def reset(self) -> None:
            self.left = self.count
            self.resets += 1

        def __iter__(self) -> Iterator[int]:
            while self.left:
                self.left -= 1
                yield self.left

    return Remaining


@pytest.mark.parametrize("base", [tud.IterDataPipe, IterDataPipe], ids=["torch", "pipeload"])
def test_a_subclass_reset_is_called_each_time_the_pipe_is_iterated_as_torchs(base: type) -> None:
    pipe = _pipe_with_reset(base)(3)
    assert list(pipe) == [2, 1, 0] and list(pipe) == [2, 1, 0] and pipe.resets == 2
    assert list(_pipe_with_reset(base)(2).map(add_one)) == [2, 1]


def test_a_reset_subclass_in_the_loader_and_read_without_blocking() -> None:
    pipe = _pipe_with_reset(IterDataPipe)(4)
    assert sorted(pipeload.DataLoader(pipe, batch_size=None)) == [0, 1, 2, 3]
    assert [pipe.nonblocking_next(), pipe.nonblocking_next()] == [3, 2]


def test_parents_are_explicit() -> None:
    a, b = IterableWrapper(range(3)), IterableWrapper(range(4))
    zipped = a.zip(b)
    assert zipped.parents() == (a, b)
    assert Mapper(zipped, add_one).parents() == (zipped,)
    assert a.parents() == ()
    assert Times(a).parents() == (a,)  # found among a user's pipe's attributes


def _functional_forms(operations: type) -> list[str]:
    return [name for name, value in vars(operations).items() if inspect.isfunction(value) and not name.startswith("_")]


@pytest.mark.parametrize("operations, pipe", [
    (IterOperations, lambda: IterableWrapper(range(3))),
    (MapOperations, lambda: SequenceWrapper(range(3))),
], ids=["iter", "map"])
def test_help_on_a_functional_form_is_its_class_documentation(operations: type, pipe: Any) -> None:
    for name in _functional_forms(operations):
        text = pydoc.render_doc(getattr(pipe(), name), forceload=True)
        for wanted in (f"(functional name: ``{name}``)", "Args:", "Example:"):
            assert wanted in text, f"help(pipe.{name}) lacks {wanted!r}"
