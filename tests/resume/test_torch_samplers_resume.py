"""torch's own samplers handed to the loader resume exactly.

One given a generator of its own (``RandomSampler(generator=g)``, ``SubsetRandomSampler``,
``WeightedRandomSampler``, a ``BatchSampler`` over one) has no ``state_dict()``, and its order
depends on where that generator stood as its iteration began: the checkpoint keeps the
generator's state, and a resumed epoch, any epoch, gives the batches of the uninterrupted run
(before, a later epoch resumed replayed the first epoch's order). A sampler that keeps nothing and
draws from nothing of its own is iterated again from its start, with a warning; for torch's
samplers the warning names pipeload's of the same name.
"""

from __future__ import annotations

import json
import warnings
from collections.abc import Callable
from typing import Any

import pytest
import torch
import torch.utils.data as torch_data

import pipeload
from pipeload._state_digest import sealed
from pipeload.errors import IncompatibleStateError

DATA = list(range(11))
EPOCHS = 3


def _generator() -> torch.Generator:
    return torch.Generator().manual_seed(5)


def _torch_random() -> dict[str, Any]:
    return {"sampler": torch_data.RandomSampler(DATA, generator=_generator()), "batch_size": 3}


def _torch_random_with_replacement() -> dict[str, Any]:
    return {"sampler": torch_data.RandomSampler(DATA, replacement=True, num_samples=13,
                                                generator=_generator()), "batch_size": 3}


def _torch_subset() -> dict[str, Any]:
    return {"sampler": torch_data.SubsetRandomSampler(DATA[2:], generator=_generator()), "batch_size": 3}


def _torch_weighted() -> dict[str, Any]:
    weights = [float(k + 1) for k in DATA]
    return {"sampler": torch_data.WeightedRandomSampler(weights, 12, generator=_generator()), "batch_size": 3}


def _torch_batches() -> dict[str, Any]:
    inner = torch_data.RandomSampler(DATA, generator=_generator())
    return {"batch_sampler": torch_data.BatchSampler(inner, 3, drop_last=False)}


def _torch_random_unbatched() -> dict[str, Any]:
    return {"sampler": torch_data.RandomSampler(DATA, generator=_generator()), "batch_size": None}


def _ours_random() -> dict[str, Any]:
    return {"sampler": pipeload.RandomSampler(DATA, generator=_generator()), "batch_size": 3}


ARRANGEMENTS = [_torch_random, _torch_random_with_replacement, _torch_subset, _torch_weighted,
                _torch_batches, _torch_random_unbatched]


def _batches(loader: pipeload.DataLoader) -> list[Any]:
    return [_listed(batch) for batch in loader]


def _listed(batch: Any) -> Any:
    return batch.tolist() if isinstance(batch, torch.Tensor) else batch


def _uninterrupted(arguments: Callable[[], dict[str, Any]]) -> list[list[Any]]:
    loader = pipeload.DataLoader(DATA, **arguments())
    return [_batches(loader) for _ in range(EPOCHS)]


def _checkpoint(arguments: Callable[[], dict[str, Any]], epoch: int, taken: int) -> dict[str, Any]:
    """The loader's state after ``taken`` batches of epoch ``epoch`` (0: between epochs), as
    it comes back from a JSON file."""
    loader = pipeload.DataLoader(DATA, **arguments())
    for _ in range(epoch):
        _batches(loader)
    if taken:
        iterator = iter(loader)
        for _ in range(taken):
            next(iterator)
    return json.loads(json.dumps(loader.state_dict()))


def _resumed(arguments: Callable[[], dict[str, Any]], state: dict[str, Any], epochs: int) -> list[list[Any]]:
    loader = pipeload.DataLoader(DATA, **arguments())
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # its generators are kept: nothing to warn about
        loader.load_state_dict(state)
    return [_batches(loader) for _ in range(epochs)]


@pytest.mark.parametrize("arguments", ARRANGEMENTS, ids=lambda a: a.__name__.strip("_"))
def test_a_torch_sampler_with_its_own_generator_resumes_every_epoch_exactly(
        arguments: Callable[[], dict[str, Any]]) -> None:
    expected = _uninterrupted(arguments)
    for epoch in (1, 2):
        for taken in (0, 2):
            state = _checkpoint(arguments, epoch, taken)
            resumed = _resumed(arguments, state, EPOCHS - epoch)
            assert resumed[0] == expected[epoch][taken:], (epoch, taken)
            assert resumed[1:] == expected[epoch + 1:], (epoch, taken)


def test_a_damaged_generator_state_of_a_torch_sampler_is_refused_by_name() -> None:
    state = _checkpoint(_torch_random, 1, 2)
    generators = state["epoch"]["sampler"]["sampler"]["generators"]
    generators["generator"] = generators["generator"][:-8]
    loader = pipeload.DataLoader(DATA, **_torch_random())
    with pytest.raises(IncompatibleStateError, match=r"epoch\.sampler\.sampler\.generators\.generator"):
        loader.load_state_dict(state)


def _weighted(weights: list[float], num_samples: int) -> Callable[[], dict[str, Any]]:
    return lambda: {"sampler": torch_data.WeightedRandomSampler(weights, num_samples, generator=_generator()),
                    "batch_size": 3}


@pytest.mark.parametrize("other", [_weighted([1.0] * 11, 14), _weighted([1.0] * 10 + [5.0], 13)],
                         ids=["num_samples", "weights"])
def test_a_torch_sampler_with_other_weights_or_num_samples_refuses_the_state(
        other: Callable[[], dict[str, Any]]) -> None:
    # Only the generator's state was kept: the same state under other weights or another
    # num_samples drew another order, and the resume took it for the one it left.
    state = _checkpoint(_weighted([1.0] * 11, 13), 1, 2)
    loader = pipeload.DataLoader(DATA, **other())
    with pytest.raises(IncompatibleStateError, match=r"epoch\.sampler\.sampler\.shape should be .* "
                                                     r"\(the sampler's type, num_samples, replacement"):
        loader.load_state_dict(state)
    pipeload.DataLoader(DATA, **_weighted([1.0] * 11, 13)()).load_state_dict(state)  # its own: loads


def test_a_state_without_the_generators_state_loads_with_the_warning_of_before() -> None:
    # Written before generator states were kept (the sampler's state None): it loads, and the
    # sampler is iterated again from its start, as then, with the warning that says what that means.
    state = _checkpoint(_torch_random, 1, 2)
    inner = sealed({**state["epoch"]["sampler"], "sampler": None})
    state = sealed({**state, "epoch": {**state["epoch"], "sampler": inner}})
    loader = pipeload.DataLoader(DATA, **_torch_random())
    with pytest.warns(UserWarning, match="RandomSampler has no state_dict"):
        loader.load_state_dict(state)


@pytest.mark.parametrize("taken_with, loaded_with", [
    (lambda: torch_data.SubsetRandomSampler(range(0, 10)), lambda: torch_data.SubsetRandomSampler(range(1, 11))),
    (lambda: torch_data.WeightedRandomSampler([1.0] * 11, 13), lambda: torch_data.WeightedRandomSampler([2.0] + [1.0] * 10, 13)),
    (lambda: torch_data.RandomSampler(DATA, replacement=True, num_samples=12),
     lambda: torch_data.RandomSampler(DATA, replacement=True, num_samples=15)),
], ids=["subset-indices", "weights", "num_samples"])
def test_a_torch_sampler_drawing_from_the_global_generator_refuses_a_state_of_another_shape(
        taken_with: Callable[[], Any], loaded_with: Callable[[], Any]) -> None:
    # The global generator's state is the loader's: under other indices, weights or num_samples
    # it drew another order, which the resume took for the one it left (ours refused it).
    state = _checkpoint(lambda: {"sampler": taken_with(), "batch_size": 3}, 1, 2)
    with pytest.raises(IncompatibleStateError, match=r"epoch\.sampler\.sampler\.shape should be"):
        pipeload.DataLoader(DATA, sampler=loaded_with(), batch_size=3).load_state_dict(state)
    with pytest.warns(UserWarning, match="has no state_dict"):  # its own shape: loads, as before
        pipeload.DataLoader(DATA, sampler=taken_with(), batch_size=3).load_state_dict(state)


def test_ours_of_the_same_name_resumes_a_later_epoch_exactly_with_torchs_draws() -> None:
    loader = torch_data.DataLoader(DATA, **_torch_random())
    torchs = [[b.tolist() for b in loader] for _ in range(2)]
    state = _checkpoint(_ours_random, 1, 1)
    resumed = _resumed(_ours_random, state, 1)
    assert torchs[1][1:] == resumed[0]


def test_torchs_sampler_drawing_from_the_global_generator_is_warned_with_ours_named() -> None:
    arguments = lambda: {"sampler": torch_data.RandomSampler(DATA), "batch_size": 3}  # noqa: E731
    state = _checkpoint(arguments, 1, 1)
    with pytest.warns(UserWarning, match="RandomSampler has no state_dict") as caught:
        pipeload.DataLoader(DATA, **arguments()).load_state_dict(state)
    assert len(caught) == 1
    assert "pipeload.RandomSampler takes the same arguments as torch's" in str(caught[0].message)


def test_a_users_sampler_is_warned_without_ours_named() -> None:
    class OwnOrder(torch_data.Sampler[int]):
        def __iter__(self) -> Any:
            return iter(reversed(DATA))

        def __len__(self) -> int:
            return len(DATA)

    state = _checkpoint(lambda: {"sampler": OwnOrder(), "batch_size": 3}, 1, 1)
    with pytest.warns(UserWarning, match="OwnOrder has no state_dict") as caught:
        pipeload.DataLoader(DATA, sampler=OwnOrder(), batch_size=3).load_state_dict(state)
    assert "pipeload." not in str(caught[0].message)


@pytest.mark.parametrize("arguments", [_torch_random, _torch_batches], ids=["sampler", "batch_sampler"])
def test_an_epoch_after_one_left_unfinished_resumes_exactly(arguments: Callable[[], dict[str, Any]]) -> None:
    """The loop broke out of an epoch; the next one began where the generator then stood, not
    where the unfinished one began (what the checkpoint kept before)."""
    def run(state: dict[str, Any] | None = None) -> tuple[list[Any], dict[str, Any] | None]:
        loader = pipeload.DataLoader(DATA, **arguments())
        if state is not None:
            loader.load_state_dict(state)
            return _batches(loader), None
        next(iter(loader))  # an epoch left after one batch
        handed, saved = [], None
        for batch in loader:
            handed.append(batch.tolist())
            if len(handed) == 2:
                saved = json.loads(json.dumps(loader.state_dict()))
        return handed, saved

    uninterrupted, state = run()
    resumed, _ = run(state)
    assert resumed == uninterrupted[2:]


class _EagerBatches(pipeload.Sampler):
    """A user's batch sampler whose ``__iter__`` draws the whole order when it is called (a
    plain function, as bucketing batch samplers often are), from a generator of its own."""

    def __init__(self, count: int) -> None:
        self.count = count
        self.generator = torch.Generator().manual_seed(3)

    def __len__(self) -> int:
        return (self.count + 1) // 2

    def __iter__(self):
        order = torch.randperm(self.count, generator=self.generator).tolist()
        return iter([order[i:i + 2] for i in range(0, self.count, 2)])


@pytest.mark.parametrize("num_workers, persistent", [(0, False), (2, False), (2, True)],
                         ids=["no workers", "per-epoch", "persistent"])
def test_a_users_eager_batch_sampler_resumes_mid_epoch_exactly(num_workers: int, persistent: bool) -> None:
    # Its generator is recorded as the epoch began: before the loader first asks it for an
    # iteration (torch asks twice when workers start anew), not after that draw.
    def make() -> pipeload.DataLoader:
        return pipeload.DataLoader(list(range(7)), batch_sampler=_EagerBatches(7), num_workers=num_workers,
                                   persistent_workers=persistent)

    loader = make()
    [batch.tolist() for batch in loader]  # a later epoch is checkpointed
    iterator = iter(loader)
    next(iterator)
    state = json.loads(json.dumps(loader.state_dict()))
    rest = [batch.tolist() for batch in iterator]
    resumed = make()
    resumed.load_state_dict(state)
    assert [batch.tolist() for batch in resumed] == rest


def test_a_loader_drawing_from_the_global_generator_as_its_own_is_warned_on_resume() -> None:
    loader = pipeload.DataLoader(list(range(7)), batch_size=3, shuffle=True, generator=torch.default_generator)
    iterator = iter(loader)
    next(iterator)
    state = loader.state_dict()
    resumed = pipeload.DataLoader(list(range(7)), batch_size=3, shuffle=True, generator=torch.default_generator)
    with pytest.warns(UserWarning, match="generator is torch.default_generator") as warned:
        resumed.load_state_dict(state)
    assert warned[0].filename == __file__
    quiet = pipeload.DataLoader(list(range(7)), batch_size=3, shuffle=True, generator=torch.Generator())
    iterator = iter(quiet)
    next(iterator)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        pipeload.DataLoader(list(range(7)), batch_size=3, shuffle=True,
                            generator=torch.Generator()).load_state_dict(quiet.state_dict())


# -- torch's DistributedSampler: its order is its epoch's ---------------------------------------

def _distributed(rank: int = 0) -> torch_data.DistributedSampler:
    return torch_data.DistributedSampler(list(range(40)), num_replicas=2, rank=rank, shuffle=True, seed=3)


def _distributed_batched(sampler: Any) -> dict[str, Any]:
    return {"sampler": sampler, "batch_size": 2}


def _distributed_unbatched(sampler: Any) -> dict[str, Any]:
    return {"sampler": sampler, "batch_size": None}


def _distributed_in_torchs_batch_sampler(sampler: Any) -> dict[str, Any]:
    return {"batch_sampler": torch_data.BatchSampler(sampler, 2, drop_last=False)}


DISTRIBUTED = [_distributed_batched, _distributed_unbatched, _distributed_in_torchs_batch_sampler]


def _epochs_of(arrange: Callable[[Any], dict[str, Any]], num_workers: int, epochs: int) -> list[list[Any]]:
    """Each epoch's batches of an uninterrupted run that calls set_epoch before each."""
    sampler = _distributed()
    loader = pipeload.DataLoader(list(range(40)), num_workers=num_workers, **arrange(sampler))
    out = []
    for epoch in range(epochs):
        sampler.set_epoch(epoch)
        out.append(_batches(loader))
    return out


def _saved_in_epoch(arrange: Callable[[Any], dict[str, Any]], epoch: int, taken: int | None) -> dict[str, Any]:
    """The state after ``taken`` batches of epoch ``epoch`` (None: all of them)."""
    sampler = _distributed()
    loader = pipeload.DataLoader(list(range(40)), **arrange(sampler))
    for earlier in range(epoch):
        sampler.set_epoch(earlier)
        _batches(loader)
    sampler.set_epoch(epoch)
    iterator = iter(loader)
    for _ in range(len(loader) if taken is None else taken):
        next(iterator)
    return json.loads(json.dumps(loader.state_dict()))


@pytest.mark.parametrize("num_workers", [0, 2])
@pytest.mark.parametrize("arrange", DISTRIBUTED, ids=lambda a: a.__name__.strip("_"))
def test_torchs_distributed_sampler_resumes_its_epoch_when_set_epoch_comes_after_iter(
        arrange: Callable[[Any], dict[str, Any]], num_workers: int) -> None:
    # Lightning loads the loader's state, makes the iterator, and only then calls set_epoch:
    # the sampler was still at epoch 0, so the resumed epoch skipped 3 batches of epoch 0's
    # order and handed out the rest of it, silently (torch's loader does the same).
    expected = _epochs_of(arrange, num_workers, 4)
    state = _saved_in_epoch(arrange, 2, 3)
    sampler = _distributed()
    loader = pipeload.DataLoader(list(range(40)), num_workers=num_workers, **arrange(sampler))
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # its epoch is kept: nothing to warn about
        loader.load_state_dict(state)
    assert sampler.epoch == 2
    iterator = iter(loader)
    sampler.set_epoch(2)
    assert [_listed(b) for b in iterator] == expected[2][3:]
    sampler.set_epoch(3)
    assert _batches(loader) == expected[3]


@pytest.mark.parametrize("arrange", DISTRIBUTED, ids=lambda a: a.__name__.strip("_"))
def test_torchs_distributed_sampler_saved_after_its_epochs_last_batch_resumes_with_the_next_epochs_order(
        arrange: Callable[[Any], dict[str, Any]]) -> None:
    # The loaded epoch is over: the next begins, in its own order (set_epoch(3)), not in the
    # loaded epoch's again.
    expected = _epochs_of(arrange, 2, 4)
    sampler = _distributed()
    loader = pipeload.DataLoader(list(range(40)), num_workers=2, **arrange(sampler))
    loader.load_state_dict(_saved_in_epoch(arrange, 2, None))
    iterator = iter(loader)
    assert sampler.epoch == 3
    sampler.set_epoch(3)  # Lightning's, after the iterator is made
    assert [_listed(b) for b in iterator] == expected[3]


def test_torchs_distributed_sampler_moved_to_another_epoch_after_loading_begins_that_epoch_whole() -> None:
    expected = _epochs_of(_distributed_batched, 0, 4)
    sampler = _distributed()
    loader = pipeload.DataLoader(list(range(40)), **_distributed_batched(sampler))
    loader.load_state_dict(_saved_in_epoch(_distributed_batched, 2, 3))
    sampler.set_epoch(3)
    with pytest.warns(UserWarning, match=r"set_epoch\(3\) was called after loading a state of epoch 2, "
                                         r"taken 3 batches into that epoch"):
        assert _batches(loader) == expected[3]


def test_torchs_distributed_sampler_of_another_rank_resumes_this_ranks_order() -> None:
    # Lightning loads rank 0's loader state on every rank: the sampler's rank is no part of
    # what the state checks, and rank 1 goes on in its own order, in epoch 2.
    full = pipeload.DataLoader(list(range(40)), sampler=_distributed(rank=1), batch_size=2)
    full.sampler.set_epoch(2)
    expected = _batches(full)
    state = _saved_in_epoch(_distributed_batched, 2, 3)
    sampler = _distributed(rank=1)
    loader = pipeload.DataLoader(list(range(40)), sampler=sampler, batch_size=2)
    loader.load_state_dict(state)
    assert _batches(loader) == expected[3:]


@pytest.mark.parametrize("other", [{"seed": 4}, {"shuffle": False}], ids=["seed", "shuffle"])
def test_torchs_distributed_sampler_with_another_seed_or_shuffle_refuses_the_state(other: dict[str, Any]) -> None:
    # The same epoch under another seed is another order: the resumed epoch would have skipped
    # 3 batches of it and handed out the rest, silently.
    state = _saved_in_epoch(_distributed_batched, 2, 3)
    options = {"num_replicas": 2, "rank": 0, "shuffle": True, "seed": 3, **other}
    loader = pipeload.DataLoader(list(range(40)), batch_size=2,
                                 sampler=torch_data.DistributedSampler(list(range(40)), **options))
    with pytest.raises(IncompatibleStateError, match=r"epoch\.sampler\.sampler\.shape .*shuffle, seed"):
        loader.load_state_dict(state)


def test_a_state_written_before_seeds_were_digested_still_resumes_torchs_distributed_sampler() -> None:
    from pipeload.samplers._own_generators import _SHAPING_BEFORE_SEEDS, sampler_shape

    expected = _epochs_of(_distributed_batched, 0, 3)
    state = _saved_in_epoch(_distributed_batched, 2, 3)
    inner = state["epoch"]["sampler"]
    older = sampler_shape(_distributed(), _SHAPING_BEFORE_SEEDS)
    assert inner["sampler"]["shape"] != older
    inner = sealed({**inner, "sampler": {**inner["sampler"], "shape": older}})
    state = sealed({**state, "epoch": {**state["epoch"], "sampler": inner}})
    loader = pipeload.DataLoader(list(range(40)), **_distributed_batched(_distributed()))
    loader.load_state_dict(state)
    assert _batches(loader) == expected[2][3:]


@pytest.mark.parametrize("epochs, message", [
    ({"epoch": "2"}, r"epoch\.sampler\.sampler\.epochs\.epoch should be an int from .*, but got .*'2'"),
    ({"epoch": 2**70}, r"epoch\.sampler\.sampler\.epochs\.epoch should be an int from -9223372036854775808 to "
                       r"9223372036854775807"),
    ({"epoch": 2, "sampler.epoch": 1}, r"epoch\.sampler\.sampler\.epochs should be the epochs of the samplers at \['epoch'\]"),
    ([2], r"epoch\.sampler\.sampler\.epochs should be a dict or None"),
])
def test_a_damaged_epoch_of_torchs_distributed_sampler_is_refused_by_name(epochs: Any, message: str) -> None:
    state = _saved_in_epoch(_distributed_batched, 2, 3)
    inner = state["epoch"]["sampler"]
    assert inner["sampler"]["epochs"] == {"epoch": 2}
    inner = sealed({**inner, "sampler": {**inner["sampler"], "epochs": epochs}})
    state = sealed({**state, "epoch": {**state["epoch"], "sampler": inner}})
    sampler = _distributed()
    loader = pipeload.DataLoader(list(range(40)), sampler=sampler, batch_size=2)
    with pytest.raises(IncompatibleStateError, match=message):
        loader.load_state_dict(state)
    assert sampler.epoch == 0  # refused: nothing set
