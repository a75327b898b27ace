"""A pipe checks the state it is given before it sets anything.

Loaded straight into a pipe's iterator (no loader, so no digest: a state kept by hand, or one of
version 1), a damaged state is refused with ``IncompatibleStateError`` naming the field by its
path in the state and the value received, and the iterator is left as it was: it then yields what
a fresh one yields. The checks are the ones the loader's state goes through (``StateFields``).
"""

from __future__ import annotations

import copy
import io
import tarfile
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest

from pipeload import IncompatibleStateError
from pipeload.datapipes import NonBlockingIterDataPipe
from pipeload.datapipes.iter import IterableWrapper
from pipeload.datapipes.map import SequenceWrapper


def taken(pipe: Any, count: int) -> tuple[Iterator[Any], dict[str, Any]]:
    iterator = iter(pipe)
    for _ in range(count):
        next(iterator)
    return iterator, copy.deepcopy(iterator.state_dict())


def refused_unchanged(make: Callable[[], Any], state: Any, match: str) -> None:
    """``state`` is refused with a message matching ``match``; the iterator is then a fresh one."""
    target = iter(make())
    with pytest.raises(IncompatibleStateError, match=match):
        target.load_state_dict(state)
    assert list(target) == list(make())


def shuffled() -> Any:
    return IterableWrapper(range(30)).shuffle(buffer_size=5).set_seed(7)


# -- the frame every pipe's state has ---------------------------------------------------------

def test_a_missing_upstream_or_own_is_named() -> None:
    _, state = taken(IterableWrapper(range(9)).map(str), 2)
    for field in ("upstream", "own"):
        damaged = {key: value for key, value in state.items() if key != field}
        refused_unchanged(lambda: IterableWrapper(range(9)).map(str), damaged, f"it has no {field} ")


def test_an_upstream_list_of_the_wrong_length_is_named() -> None:
    _, state = taken(IterableWrapper(range(9)).map(str), 2)
    state["upstream"].append(state["upstream"][0])
    refused_unchanged(lambda: IterableWrapper(range(9)).map(str), state,
                      r"upstream should be a list of 1 upstream state\(s\)")


def test_a_stray_field_is_refused() -> None:
    _, state = taken(IterableWrapper(range(9)), 2)
    state["position"] = 2
    refused_unchanged(lambda: IterableWrapper(range(9)), state, r"position should be absent")


def test_a_stateless_pipe_takes_only_none_as_its_own() -> None:
    _, state = taken(IterableWrapper(range(9)).map(str), 2)
    state["own"] = 3
    refused_unchanged(lambda: IterableWrapper(range(9)).map(str), state, r"^cannot load this state: own should be")


# -- IterableWrapper --------------------------------------------------------------------------

@pytest.mark.parametrize("position, expected", [
    (-1, r"own should be an int from 0 to 9, but got own=-1"),
    ("5", r"own should be an int from 0 to 9, but got own='5'"),
    (5.0, r"own should be an int from 0 to 9, but got own=5\.0"),
    (True, r"own should be an int from 0 to 9, but got own=True"),
    (10, r"own should be an int from 0 to 9, but got own=10"),
])
def test_an_in_memory_position_is_an_int_within_the_data(position: Any, expected: str) -> None:
    refused_unchanged(lambda: IterableWrapper(range(9)), {"own": position, "upstream": [], "settings": {"length": 9}},
                      expected)


def test_a_position_past_data_without_a_length_is_refused_unset() -> None:
    make = lambda: IterableWrapper(iter_of(4))  # noqa: E731
    refused_unchanged(make, {"own": 6, "upstream": []}, r"own should be an int from 0 to 4, but got own=6 \(the data has 4 items\)")


class iter_of:  # noqa: N801 - reads as a call
    """An iterable of ``range(n)`` without a length."""

    def __init__(self, n: int) -> None:
        self.n = n

    def __iter__(self) -> Iterator[int]:
        return iter(range(self.n))


def test_a_refused_own_leaves_the_upstream_unmoved() -> None:
    """The shuffle's upstream state is good, its own is not: the wrapper under it has not moved."""
    _, state = taken(shuffled(), 12)
    state["own"]["source_done"] = "no"
    refused_unchanged(shuffled, state, r"own\.source_done should be True or False")


# -- shuffle ----------------------------------------------------------------------------------

def test_a_shuffle_buffer_is_a_list_no_longer_than_the_buffer() -> None:
    _, state = taken(shuffled(), 3)
    state["own"]["buffer"] = {str(i): i for i in range(5)}
    refused_unchanged(shuffled, state, r"own\.buffer should be a list of at most 5 items")
    state["own"]["buffer"] = list(range(6))
    refused_unchanged(shuffled, state, r"own\.buffer should be a list of at most 5 items")


def test_a_flipped_source_done_with_a_full_buffer_is_refused() -> None:
    _, state = taken(shuffled(), 3)
    assert state["own"]["source_done"] is False and len(state["own"]["buffer"]) == 5
    state["own"]["source_done"] = True
    refused_unchanged(shuffled, state, r"own\.source_done should be False while the buffer is full")


@pytest.mark.parametrize("damage", ["short", "text", "float", "version"])
def test_a_shuffle_generator_state_is_tried_before_it_is_set(damage: str) -> None:
    _, state = taken(shuffled(), 3)
    version, words, gauss = state["own"]["rng"]
    rng = {"short": [version, list(words)[:100], gauss], "text": "abc",
           "float": [version, [float(w) for w in words], gauss], "version": [9, list(words), gauss]}[damage]
    state["own"]["rng"] = rng
    refused_unchanged(shuffled, state, r"own\.rng should be a random\.Random state")


def test_a_map_shuffle_keeps_only_its_own_indices() -> None:
    make = lambda: SequenceWrapper(range(8)).shuffle().set_seed(1)  # noqa: E731
    _, state = taken(make(), 3)
    refused_unchanged(make, {**state, "own": [0, 0, 1, 2, 3]}, r"own should be None or a list of the keys left")
    refused_unchanged(make, {**state, "own": [99]}, r"own should be None or a list of the keys left")


# -- the others ------------------------------------------------------------------------------

def test_a_batch_being_filled_is_shorter_than_a_batch() -> None:
    make = lambda: IterableWrapper(range(9)).batch(3)  # noqa: E731
    _, state = taken(make(), 1)
    refused_unchanged(make, {**state, "own": [1, 2, 3]}, r"own should be a list of fewer than 3 items")


def test_a_header_counts_within_its_limit() -> None:
    make = lambda: IterableWrapper(range(9)).header(4)  # noqa: E731
    _, state = taken(make(), 1)
    refused_unchanged(make, {**state, "own": 5}, r"own should be an int from 0 to 4, but got own=5")


def test_a_concat_names_its_inputs_left() -> None:
    make = lambda: IterableWrapper(range(3)).concat(IterableWrapper(range(4)))  # noqa: E731
    _, state = taken(make(), 4)
    refused_unchanged(make, {**state, "own": 2}, r"own should be an int from 0 to 1, but got own=2")


def test_a_cycle_counts_rounds_within_its_count() -> None:
    make = lambda: IterableWrapper(range(3)).cycle(2)  # noqa: E731
    _, state = taken(make(), 4)
    refused_unchanged(make, {**state, "own": [3, 1]}, r"own\.0 should be an int from 0 to 2, but got own\.0=3")


def test_a_flatmap_count_past_its_items_elements_is_refused() -> None:
    make = lambda: IterableWrapper(["ab", "cde"]).flatmap(list)  # noqa: E731
    _, state = taken(make(), 3)
    assert state["own"] == {"item": "cde", "taken": 1}
    refused_unchanged(make, {**state, "own": {"item": "cde", "taken": 4}},
                      r"own\.taken should be an int from 0 to 3, but got own\.taken=4 \(that item expands to 3 elements\)")


def test_a_pipe_without_a_checkpoint_refuses_any_state() -> None:
    make = lambda: IterableWrapper(range(3)).zip(IterableWrapper(range(3)))  # noqa: E731
    refused_unchanged(make, {"own": None, "upstream": []}, r"keeps no checkpoint of its position")



def _forked_branch() -> Any:
    return IterableWrapper(range(3)).fork(2)[0]


def _parity(number: int) -> int:
    return number % 2


def _demuxed_branch() -> Any:
    return IterableWrapper(range(3)).demux(2, _parity)[0]


@pytest.mark.parametrize("make", [_forked_branch, _demuxed_branch], ids=["fork", "demux"])
def test_a_fork_or_demux_branch_refuses_any_state(make: Callable[[], Any]) -> None:
    # A branch keeps no checkpoint (the loader resumes it by skipping): the stateless shape
    # {"own": None, "upstream": []} was accepted and the branch read on from its start.
    branch = make()
    target = iter(branch)
    with pytest.raises(IncompatibleStateError, match=r"keeps no checkpoint of its position"):
        target.load_state_dict({"own": None, "upstream": []})
    target.close()


class Countdown(NonBlockingIterDataPipe):
    """A user's pipe with a checkpoint of its own whose load fails on a bad state."""

    def __init__(self, start: int) -> None:
        self.start = start
        self.left = start

    def reset(self) -> None:
        self.left = self.start

    def nonblocking_next(self) -> int:
        if self.left == 0:
            raise StopIteration
        self.left -= 1
        return self.left

    def state_dict(self) -> dict[str, Any]:
        return {"left": self.left}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.left = state["left"]


def test_a_users_pipe_refusing_its_state_becomes_an_incompatible_state_error() -> None:
    iterator = iter(IterableWrapper([0]).concat(Countdown(3)).map(str))
    next(iterator)
    next(iterator)
    state = iterator.state_dict()
    assert state["upstream"][0]["upstream"][0]["own"] == {"left": 2}
    state["upstream"][0]["upstream"][0]["own"] = {"count": 2}
    with pytest.raises(IncompatibleStateError, match=r"Countdown\.load_state_dict\(\) refused "
                       r"upstream\.0\.upstream\.0\.own: KeyError") as caught:
        iter(IterableWrapper([0]).concat(Countdown(3)).map(str)).load_state_dict(state)
    assert isinstance(caught.value.__cause__, KeyError)


# -- tar ---------------------------------------------------------------------------------------

def tar_shard(tmp_path: Path) -> str:
    path = tmp_path / "shard.tar"
    with tarfile.open(path, "w") as archive:
        for item in range(4):
            data = f"member {item}".encode()
            info = tarfile.TarInfo(f"{item:02d}.txt")
            info.size = len(data)
            archive.addfile(info, io.BytesIO(data))
    return str(path)


def member_text(member: Any) -> str:
    return f"{member[0]}: {member[1].decode()}"


@pytest.mark.parametrize("own, expected", [
    ([1000, 1], r"{f} should be a multiple of 512 \(a tar block\), but got {f}=1000"),
    ([-512, 1], r"{f} should be an int >= 0, but got {f}=-512"),
    (["1024", 1], r"{f} should be an int >= 0, but got {f}='1024'"),
    ([1024, 3], r"{g} should be an int from 0 to 2, but got {g}=3"),
    ([1024], r"{o} should be None or \[bytes into the archive, members read, the archive's URL, its version or None\]"),
    ([1024, 1, None], r"{o} should be None or \[bytes into the archive, members read, the archive's URL, its version or None\]"),
    ([1024, 1, "a.tar", {"size": -1}], r"{v}\.size should be an int >= 0, but got {v}\.size=-1"),
])
def test_a_tar_offset_is_checked_when_it_is_loaded(tmp_path: Path, own: Any, expected: str) -> None:
    shard = tar_shard(tmp_path)
    make = lambda: IterableWrapper([shard]).open_files("b").load_from_tar().map(member_text)  # noqa: E731
    _, state = taken(make(), 1)
    assert state["upstream"][0]["own"][:2] == [1024, 1]  # then the archive's URL and version
    state["upstream"][0]["own"] = own
    o = r"upstream\.0\.own"
    refused_unchanged(make, state, expected.format(f=o + r"\.0", g=o + r"\.1", o=o, v=o + r"\.3"))


# -- the settings a stream depends on ----------------------------------------------------------

def test_a_shuffle_state_is_refused_by_a_shuffle_with_another_buffer_size() -> None:
    # The same generator draws other slots from another buffer: items would come twice or never.
    _, state = taken(shuffled(), 3)
    refused_unchanged(lambda: IterableWrapper(range(30)).shuffle(buffer_size=6).set_seed(7), state,
                      r"buffer_size differs \(state: 5, here: 6\)")


def test_a_batch_state_is_refused_by_a_batch_of_another_size_or_drop_last() -> None:
    _, state = taken(IterableWrapper(range(9)).batch(3), 1)
    refused_unchanged(lambda: IterableWrapper(range(9)).batch(4), state, r"batch_size differs \(state: 3, here: 4\)")
    refused_unchanged(lambda: IterableWrapper(range(9)).batch(3, drop_last=True), state,
                      r"drop_last differs \(state: False, here: True\)")


def test_a_state_of_a_list_that_has_grown_since_is_refused() -> None:
    # A shard appended to a shuffled shard list: the same position replays another permutation.
    _, state = taken(IterableWrapper(list(range(6))).shuffle().set_seed(3), 2)
    refused_unchanged(lambda: IterableWrapper(list(range(7))).shuffle().set_seed(3), state,
                      r"into this IterableWrapper at upstream\.0: length differs \(state: 6, here: 7\)")


def test_settings_are_checked_for_type_and_refused_when_missing() -> None:
    _, state = taken(IterableWrapper(range(9)).header(4), 1)
    assert state["settings"] == {"limit": 4}
    refused_unchanged(lambda: IterableWrapper(range(9)).header(4), {**state, "settings": {"limit": 4.0}},
                      r"limit differs \(state: 4\.0, here: 4\)")
    refused_unchanged(lambda: IterableWrapper(range(9)).header(4), {k: v for k, v in state.items() if k != "settings"},
                      r"it has no settings")
    refused_unchanged(lambda: IterableWrapper(range(9)).header(4), {**state, "settings": {"limit": 4, "x": 1}},
                      r"settings\.x should be absent")
