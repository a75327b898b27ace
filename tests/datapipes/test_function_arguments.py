"""The functions pipes are given (map's fn, filter's filter_fn, groupby's group_key_fn, demux's
classifier_fn, collate's collate_fn, map-style map's fn, and flatmap's as torchdata checks it),
checked when the pipe is built as torch checks them: something that is not callable fails at
once, and a lambda or a local function warns that it will not pickle (a spawned worker could not
receive it)."""

from __future__ import annotations

import functools
import warnings
from collections.abc import Callable
from typing import Any

import pytest
import torch.utils.data.datapipes.iter as theirs_iter
import torch.utils.data.datapipes.map as theirs_map
from pipes_for_tests import add, add_one, first_letter, is_even, parity

import pipeload.datapipes.iter as ours_iter
import pipeload.datapipes.map as ours_map

# torch's Grouper, refused half-built, complains from __del__ when it is collected.
pytestmark = pytest.mark.filterwarnings("ignore::pytest.PytestUnraisableExceptionWarning")

MODULES = [(theirs_iter, theirs_map), (ours_iter, ours_map)]

# Each builder takes (iter module, map module, function) and builds one pipe around the function.
BUILDERS: dict[str, Callable[[Any, Any, Any], Any]] = {
    "map": lambda it, mp, fn: it.IterableWrapper(range(4)).map(fn),
    "filter": lambda it, mp, fn: it.IterableWrapper(range(4)).filter(fn),
    "groupby": lambda it, mp, fn: it.IterableWrapper(["a1", "b1"]).groupby(fn),
    "demux": lambda it, mp, fn: it.IterableWrapper(range(4)).demux(2, fn),
    "collate": lambda it, mp, fn: it.IterableWrapper(range(4)).batch(2).collate(collate_fn=fn),
    "map-style map": lambda it, mp, fn: mp.SequenceWrapper(range(4)).map(fn),
}
NAMED = {"map": add_one, "filter": is_even, "groupby": first_letter, "demux": parity,
         "collate": sum, "map-style map": add_one}


@pytest.mark.parametrize("operation", BUILDERS)
@pytest.mark.parametrize("not_callable", [5, None, "name"])
def test_a_function_that_is_not_callable_fails_when_the_pipe_is_built(operation: str, not_callable: Any) -> None:
    if operation == "collate" and not_callable is None:
        pytest.skip("collate_fn=None is the default: conversion is used")
    errors = []
    for modules in MODULES:
        with pytest.raises(Exception) as caught:
            BUILDERS[operation](*modules, not_callable)
        errors.append(caught.value)
    theirs, ours = errors
    assert type(ours) is type(theirs) is TypeError
    assert str(ours).startswith(str(theirs))
    assert repr(not_callable) in str(ours)  # ours names what it received


MODULE_LAMBDA = lambda *args: 0  # noqa: E731  (a module-level lambda is the case under test)


def _local_function(x: Any) -> Any:
    def local(y: Any) -> Any:
        return y

    return local


@pytest.mark.parametrize("operation", BUILDERS)
@pytest.mark.parametrize("kind, make", [
    ("Lambda", lambda: MODULE_LAMBDA),
    ("Local", lambda: lambda *args: 0),  # a lambda made inside a function is a local function
    ("Local", lambda: _local_function(0)),
    ("Local", lambda: functools.partial(_local_function(0))),
])
def test_a_lambda_or_local_function_warns_as_torch_does(operation: str, kind: str, make: Any) -> None:
    for modules in MODULES:
        with pytest.warns(UserWarning, match=f"^{kind} function is not supported by pickle, please use "
                                              "regular python function or functools.partial instead."):
            BUILDERS[operation](*modules, make())


@pytest.mark.parametrize("operation", BUILDERS)
def test_a_named_function_or_partial_is_quiet(operation: str) -> None:
    for fn in (NAMED[operation], functools.partial(add, 0) if operation == "map" else NAMED[operation]):
        with warnings.catch_warnings():
            warnings.simplefilter("error")
            BUILDERS[operation](ours_iter, ours_map, fn)


def test_the_warning_points_at_the_users_line() -> None:
    with pytest.warns(UserWarning) as caught:
        ours_iter.IterableWrapper(range(3)).map(lambda x: x)
    assert caught[0].filename == __file__


def test_a_pipe_with_a_lambda_fails_to_pickle_as_torchs_does_and_a_named_one_round_trips() -> None:
    import pickle

    errors = []
    for iter_module, _ in MODULES:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            pipe = iter_module.IterableWrapper(range(3)).map(MODULE_LAMBDA)
        with pytest.raises(Exception) as caught:
            pickle.dumps(pipe)
        errors.append(type(caught.value))
        named = iter_module.IterableWrapper(range(3)).map(add_one).filter(is_even)
        assert list(pickle.loads(pickle.dumps(named))) == [2]
    assert errors[1] is errors[0] is pickle.PicklingError


def test_flatmap_checks_its_function_as_torchdata_does() -> None:
    with pytest.raises(TypeError, match=r"^A callable function is expected, but <class 'int'> is provided\. \(got fn=5\)"):
        ours_iter.IterableWrapper([[1]]).flatmap(5)
    with pytest.warns(UserWarning, match="^Lambda function is not supported by pickle"):
        ours_iter.IterableWrapper([[1]]).flatmap(MODULE_LAMBDA)
    assert list(ours_iter.IterableWrapper([[1, 2], [3]]).flatmap()) == [1, 2, 3]  # None: flatten
