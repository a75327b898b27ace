"""A piece's item seeds computed at once are exactly the one-at-a-time seeds, and seed the
generators exactly as ``reseed`` does (economic mode's seeding promise rests on it)."""

from __future__ import annotations

import random

import numpy as np
import pytest
import torch

from pipeload.engine.item_seeds import ItemSeeds
from pipeload.engine.worker_info import item_seed, make_thread_rng, numpy_seed_of, reseed


@pytest.mark.parametrize(("base_seed", "epoch", "first"), [
    (0, 0, 0), (1, 0, 63), ((1 << 64) - 1, 3, 10**9), (0x9E3779B97F4A7C15, 1 << 40, (1 << 63) - 40),
])
def test_a_run_s_seeds_are_the_one_at_a_time_ones(base_seed, epoch, first):
    seeds = ItemSeeds(base_seed, epoch, first, 33)
    for offset in range(33):
        expected = item_seed(base_seed, epoch, first + offset)
        assert seeds.seed(offset) == expected
        assert seeds._numpy_seeds[offset] == numpy_seed_of(expected)


def test_many_random_runs_agree_with_the_one_at_a_time_functions():
    draw = random.Random(1234)
    for _ in range(200):
        base, epoch, first = draw.getrandbits(64), draw.randrange(50), draw.getrandbits(40)
        count = draw.randrange(1, 20)
        seeds = ItemSeeds(base, epoch, first, count)
        offset = draw.randrange(count)
        expected = item_seed(base, epoch, first + offset)
        assert seeds.seed(offset) == expected
        assert seeds._numpy_seeds[offset] == numpy_seed_of(expected)


def _draws(rng=None) -> tuple:
    if rng is None:
        return random.random(), float(torch.rand(())), float(np.random.rand())
    return rng.random_generator.random(), float(torch.rand((), generator=rng.torch_generator)), \
        float(rng.numpy_generator.rand())


def test_applying_a_seed_draws_as_reseed_does_for_process_and_thread_generators():
    seeds = ItemSeeds(77, 2, 500, 4)
    seeds.apply(3, None)
    ours = _draws()
    reseed(item_seed(77, 2, 503), None)
    assert ours == _draws()
    rng = make_thread_rng(77, 0)
    seeds.apply(1, rng)
    ours = _draws(rng)
    reseed(item_seed(77, 2, 501), rng)
    assert ours == _draws(rng)


def test_numpy_is_told_items_apart_by_the_bits_torch_keeps():
    """numpy gets the seed's low 32 bits, the bits torch's CPU generator keeps: two seeds torch
    tells apart numpy tells apart too, and two torch draws alike from, numpy draws alike from."""
    def draws(seed):
        reseed(seed, None)
        return float(torch.rand(())), float(np.random.rand())

    seed = item_seed(5, 0, 12)
    torch_a, numpy_a = draws(seed)
    torch_b, numpy_b = draws(seed ^ 1)
    assert torch_a != torch_b and numpy_a != numpy_b
    assert draws(seed ^ (1 << 40)) == (torch_a, numpy_a)
