"""How a classic pool starts its process workers: all of them, as torch's, before the sampler's
first draw (and before a dataset's own ``__len__`` is asked), so that each inherits the main
process as ``iter()`` found it."""

from __future__ import annotations

import os
import random

import pytest
import torch.utils.data

import pipeload

pytestmark = [pytest.mark.usefixtures("leak_guard"), pytest.mark.timeout(60)]


class _Recorded:
    """``worker_init_fn`` that leaves one file per worker id in ``folder``."""

    def __init__(self, folder: str) -> None:
        self.folder = folder

    def __call__(self, worker_id: int) -> None:
        with open(os.path.join(self.folder, str(worker_id)), "w"):
            pass


def test_every_worker_starts_with_the_epoch_even_one_that_gets_no_task(tmp_path):
    loader = pipeload.DataLoader(list(range(1)), batch_size=1, num_workers=3,
                                 worker_init_fn=_Recorded(str(tmp_path)), multiprocessing_context="fork")
    iterator = iter(loader)
    assert len({worker.pid for worker in iterator._workers}) == 3
    assert [batch.tolist() for batch in iterator] == [[0]]
    assert all(worker.exitcode == 0 for worker in iterator._workers)  # (waits for the reaping)
    assert sorted(os.listdir(tmp_path)) == ["0", "1", "2"]  # as torch's: all three ran it


class _PickledCount:
    """A dataset whose ``n``-th pickling in this process fails (0: none does)."""

    pickled = 0
    fail_at = 0

    def __len__(self) -> int:
        return 4

    def __getitem__(self, index: int) -> int:
        return index

    def __reduce__(self):
        cls = type(self)
        cls.pickled += 1
        if cls.pickled == cls.fail_at:
            raise RuntimeError("this dataset cannot be pickled this time")
        return (cls, ())


def test_a_worker_that_cannot_start_after_worker_0_fails_iter_and_leaves_no_process():
    _PickledCount.pickled, _PickledCount.fail_at = 0, 0
    one = pipeload.DataLoader(_PickledCount(), batch_size=2, num_workers=1, multiprocessing_context="spawn")
    assert [batch.tolist() for batch in one] == [[0, 1], [2, 3]]
    per_worker_start = _PickledCount.pickled  # the pickling check, and worker 0's start
    _PickledCount.pickled, _PickledCount.fail_at = 0, per_worker_start + 1  # worker 1's start
    two = pipeload.DataLoader(_PickledCount(), batch_size=1, num_workers=2, multiprocessing_context="spawn")
    with pytest.raises(RuntimeError, match="cannot be pickled this time"):
        iter(two)  # worker 0 had started: it is stopped (leak_guard)
    assert [batch.tolist() for batch in two] == [[0], [1], [2], [3]]  # the next epoch starts afresh


class _DrawnOrder(torch.utils.data.Sampler):
    """A sampler that shuffles with its dataset's own generator, in the main process."""

    def __init__(self, dataset: _OwnGenerator) -> None:
        self.dataset = dataset

    def __iter__(self):
        order = list(range(len(self.dataset)))
        self.dataset.rng.shuffle(order)
        return iter(order)

    def __len__(self) -> int:
        return len(self.dataset)


class _OwnGenerator(torch.utils.data.Dataset):
    """Each item draws from the dataset's own generator, which no worker seeding touches: a
    worker draws on from the state it inherited."""

    def __init__(self) -> None:
        self.rng = random.Random(5)

    def __len__(self) -> int:
        return 8

    def __getitem__(self, index: int) -> tuple[int, int]:
        return index, self.rng.randrange(1 << 30)


def _batches(module, num_workers: int) -> list[list[list[int]]]:
    dataset = _OwnGenerator()
    loader = module.DataLoader(dataset, batch_size=2, sampler=_DrawnOrder(dataset), num_workers=num_workers,
                               multiprocessing_context="fork")
    return [[column.tolist() for column in batch] for batch in loader]


@pytest.mark.parametrize("num_workers", [2, 3])
def test_every_worker_inherits_the_main_process_from_before_the_samplers_first_draw_as_torchs(num_workers):
    # A worker forked after the sampler's first draw would inherit the generator as the draw left
    # it: other values in that worker's items than torch's.
    assert _batches(pipeload, num_workers) == _batches(torch.utils.data, num_workers)


class _Listed(torch.utils.data.Dataset):
    def __init__(self, items: list[int]) -> None:
        self.items = items

    def __len__(self) -> int:
        return len(self.items)

    def __getitem__(self, index: int) -> int:
        return self.items[index]


class _DrawsInWorkers(torch.utils.data.Dataset):
    """Each item draws from torch's and Python's global generators, as augmentations do."""

    def __len__(self) -> int:
        return 12

    def __getitem__(self, index: int) -> tuple[int, float, float]:
        return index, float(torch.rand(())), random.random()


def _drawn(module, num_workers: int, **options) -> list[list[list[float]]]:
    torch.manual_seed(11)
    loader = module.DataLoader(_DrawsInWorkers(), batch_size=2, num_workers=num_workers,
                               multiprocessing_context="fork", **options)
    return [[column.tolist() for column in batch] for batch in loader]


@pytest.mark.parametrize("num_workers", [2, 3])
@pytest.mark.parametrize("sampling", ["sequential", "shuffle", "distributed"])
def test_workers_forked_after_the_first_draw_of_our_samplers_draw_what_torchs_draw(sampling, num_workers):
    # pipeload's own samplers drawing from the global generator let worker 0 build while the
    # others fork; every worker reseeds that generator before any user code, as torch's.
    def options(module):
        if sampling == "distributed":
            return {"sampler": module.DistributedSampler(_DrawsInWorkers(), num_replicas=2, rank=1)}
        return {"shuffle": sampling == "shuffle"}

    assert _drawn(pipeload, num_workers, **options(pipeload)) == \
        _drawn(torch.utils.data, num_workers, **options(torch.utils.data))


@pytest.mark.parametrize("sampling", ["sequential", "shuffle", "a user's sampler", "own generator",
                                      "a dataset's own __len__"])
def test_worker_0_alone_forks_before_the_first_draw_of_our_samplers_and_the_rest_as_tasks_go(sampling):
    from pipeload.loader import _engine_choice

    dataset = list(range(8))
    options = {"shuffle": sampling != "sequential"}
    if sampling == "a user's sampler":
        options = {"sampler": list(range(8))}
    elif sampling == "own generator":
        options["generator"] = torch.Generator().manual_seed(3)
    elif sampling == "a dataset's own __len__":
        dataset = _Listed(dataset)
    loader = pipeload.DataLoader(dataset, batch_size=2, num_workers=3, multiprocessing_context="fork",
                                 **options)
    engine = _engine_choice.build_engine(loader)
    try:
        before_the_first_draw = len(engine._workers.handles)
        engine.start_epoch(iter(loader._index_sampler))
        assert len(engine._workers.handles) == 3
        keys = sorted(key for _ in range(4) for key in engine.next_batch().tolist())
    finally:
        engine.close()
    assert before_the_first_draw == (1 if sampling in ("sequential", "shuffle") else 3)
    assert keys == list(range(8))


class _CountsItsLength(torch.utils.data.Dataset):
    """Each item says how many times the main process had asked the dataset's length when its
    worker started (a ``__len__`` that does more than count: opening the file it counts in)."""

    def __init__(self) -> None:
        self.asked = 0

    def __len__(self) -> int:
        self.asked += 1
        return 8

    def __getitem__(self, index: int) -> int:
        return self.asked


@pytest.mark.parametrize("mode", ["classic", "economic"])
@pytest.mark.parametrize("persistent", [False, True], ids=["per-epoch", "persistent"])
@pytest.mark.parametrize("sampling", ["sequential", "shuffle", "distributed"])
def test_a_datasets_own_len_is_asked_only_after_every_worker_started_as_torchs(sampling, persistent, mode):
    # torch starts its workers before the sampler's first draw asks the length: no worker
    # inherits what a __len__ did (an HDF5 or LMDB handle it opened), and all see the same.
    def first_epoch(module, **options):
        dataset = _CountsItsLength()
        if sampling == "distributed":
            options["sampler"] = module.DistributedSampler(dataset, num_replicas=1, rank=0, shuffle=False)
        else:
            options["shuffle"] = sampling == "shuffle"
        loader = module.DataLoader(dataset, batch_size=2, num_workers=2, multiprocessing_context="fork",
                                   persistent_workers=persistent, **options)
        asked_before_iter = dataset.asked
        seen = {value for batch in loader for value in batch.tolist()}
        return seen, asked_before_iter

    theirs, asked = first_epoch(torch.utils.data)
    assert theirs == {asked}
    ours, asked = first_epoch(pipeload, **({"mode": mode} if mode == "economic" else {}))
    assert ours == {asked}


class _OpensWhatItCounts(torch.utils.data.Dataset):
    """A ``__len__`` that opens the file it counts in and keeps it open: the dataset can no longer
    be pickled (a spawned worker must be sent it before that)."""

    def __init__(self, path: str) -> None:
        self.path = path
        self.handle = None

    def __len__(self) -> int:
        if self.handle is None:
            self.handle = open(self.path, "rb")  # noqa: SIM115 (kept open, as such datasets do)
        return 4

    def __getitem__(self, index: int) -> int:
        return index


def test_a_spawned_worker_is_sent_the_dataset_before_its_len_opened_a_file(tmp_path):
    path = tmp_path / "counts"
    path.write_bytes(b"4")
    dataset = _OpensWhatItCounts(str(path))
    loader = pipeload.DataLoader(dataset, batch_size=2, num_workers=1, multiprocessing_context="spawn")
    try:
        assert [batch.tolist() for batch in loader] == [[0, 1], [2, 3]]  # as torch's
    finally:
        if dataset.handle is not None:
            dataset.handle.close()


class _ShufflingBatches(torch.utils.data.Sampler):
    """A batch sampler whose ``__iter__`` is a plain function that shuffles as it is asked."""

    def __init__(self) -> None:
        self.asked = 0

    def __iter__(self):
        self.asked += 1
        batches = [[0, 1], [2, 3], [4, 5], [6, 7]]
        random.shuffle(batches)
        return iter(batches)

    def __len__(self) -> int:
        return 4


@pytest.mark.parametrize("num_workers, persistent", [(0, False), (2, False), (2, True)],
                         ids=["no workers", "per-epoch", "persistent"])
def test_a_users_batch_sampler_is_asked_for_iterations_as_torchs_and_gives_its_order(num_workers, persistent):
    # torch asks it once before its workers start and once after, and draws from the second.
    def epochs(module):
        random.seed(0)
        sampler = _ShufflingBatches()
        loader = module.DataLoader(list(range(8)), batch_sampler=sampler, num_workers=num_workers,
                                   persistent_workers=persistent, multiprocessing_context="fork" if num_workers else None)
        return [[batch.tolist() for batch in loader] for _ in range(2)], sampler.asked

    assert epochs(pipeload) == epochs(torch.utils.data)
