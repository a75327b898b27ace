"""A classic process worker writes each sample into its rows of the batch's slab as it fetches it.

The batch is what ``default_collate`` makes of the samples, in a slab; a placed sample's own
memory is let go at once (the worker's heap holds one sample, not a batch); samples whose tensors
differ fail with torch's words; a custom ``collate_fn`` gets the dataset's own objects.
"""

from __future__ import annotations

import weakref

import pytest
import torch
import torch.utils.data
from conftest import backing_of

from pipeload import DataLoader, TensorDataset, get_worker_info
from pipeload.collate import default_collate_fn_map

pytestmark = [pytest.mark.usefixtures("leak_guard"), pytest.mark.timeout(90)]

BIG = 1 << 16  # floats per sample: a batch of them travels in a slab
BATCH = 8


class CountsLiveSamples(torch.utils.data.Dataset):
    """Sample ``i``: a tensor filled with ``i``, and how many of the tensors this copy of the
    dataset returned earlier for the same batch are still alive somewhere in the worker."""

    def __init__(self, count: int) -> None:
        self.count = count
        self._returned: list[weakref.ref] = []

    def __len__(self) -> int:
        return self.count

    def __getitem__(self, index: int) -> tuple[torch.Tensor, int]:
        if index % BATCH == 0:
            self._returned = []
        alive = sum(ref() is not None for ref in self._returned)
        sample = torch.full((BIG,), float(index))
        self._returned.append(weakref.ref(sample))
        return sample, alive


def test_each_sample_is_let_go_once_it_is_in_its_rows():
    loader = DataLoader(CountsLiveSamples(BATCH * 16), batch_size=BATCH, num_workers=2,
                        persistent_workers=True)
    placed_batches = 0
    for epoch in range(2):
        for number, (values, alive) in enumerate(loader):
            first = number * BATCH
            assert values[:, 0].tolist() == [float(first + k) for k in range(BATCH)]
            assert values[:, -1].tolist() == values[:, 0].tolist()
            # Without rows, sample k would find the k samples before it alive (in the list
            # handed to collate_fn at the end); in its rows, none.
            placed_batches += alive.tolist() == [0] * BATCH
    # The first batch of each worker travels before a slab is granted, and a slab the loop
    # still holds keeps samples waiting: most batches, not all, are placed from the start.
    assert placed_batches >= 8


class Structured(torch.utils.data.Dataset):
    def __len__(self) -> int:
        return BATCH * 6

    def __getitem__(self, index: int) -> tuple:
        return (torch.full((BIG,), float(index)), index,
                {"mask": torch.full((2, BIG // 2), -index, dtype=torch.int32), "name": f"s{index}",
                 "small": torch.tensor([index, index + 1])},
                [torch.arange(BIG, dtype=torch.float64)[index::7].clone()[:1000], 0.5])


def _same(ours, theirs) -> None:
    assert type(ours) is type(theirs)
    if isinstance(ours, torch.Tensor):
        assert ours.dtype == theirs.dtype and torch.equal(ours, theirs)
    elif isinstance(ours, (list, tuple)):
        assert len(ours) == len(theirs)
        for mine, other in zip(ours, theirs):
            _same(mine, other)
    elif isinstance(ours, dict):
        assert list(ours) == list(theirs)
        for key in ours:
            _same(ours[key], theirs[key])
    else:
        assert ours == theirs


def test_tuples_dicts_and_lists_of_tensors_collate_as_in_the_main_process():
    expected = list(DataLoader(Structured(), batch_size=BATCH, num_workers=0))
    loader = DataLoader(Structured(), batch_size=BATCH, num_workers=2)
    batches = list(loader)
    assert len(batches) == len(expected)
    for ours, theirs in zip(batches, expected):
        _same(ours, theirs)
    # After each worker's first batch (sent before any slab is granted), the large stacks are
    # views of the slab the batch came in.
    assert any(backing_of(batch[0]).startswith("/memfd:") for batch in batches[2:])
    assert any(backing_of(batch[2]["mask"]).startswith("/memfd:") for batch in batches[2:])


class ShapeChangesAt(torch.utils.data.Dataset):
    def __init__(self, odd_one: int) -> None:
        self.odd_one = odd_one

    def __len__(self) -> int:
        return BATCH * 4

    def __getitem__(self, index: int) -> torch.Tensor:
        return torch.zeros(BIG + (index == self.odd_one))


@pytest.mark.parametrize("odd_one", [BATCH * 2 + 5, BATCH * 3])
def test_samples_whose_tensors_differ_fail_with_torchs_words(odd_one):
    loader = DataLoader(ShapeChangesAt(odd_one), batch_size=BATCH, num_workers=2)
    with pytest.raises(RuntimeError, match="stack expects each tensor to be equal size"):
        list(loader)


class KeepsWhatItMade(torch.utils.data.Dataset):
    def __init__(self) -> None:
        self.made: dict[int, torch.Tensor] = {}

    def __len__(self) -> int:
        return BATCH * 4

    def __getitem__(self, index: int) -> torch.Tensor:
        self.made[index] = torch.full((BIG,), float(index))
        return self.made[index]


def samples_are_the_datasets_own(samples: list[torch.Tensor]) -> torch.Tensor:
    made = get_worker_info().dataset.made
    return torch.tensor([any(sample is kept for kept in made.values()) for sample in samples])


def test_a_custom_collate_fn_gets_the_datasets_own_tensors():
    loader = DataLoader(KeepsWhatItMade(), batch_size=BATCH, num_workers=2,
                        collate_fn=samples_are_the_datasets_own)
    assert all(batch.all() for batch in loader)


def test_views_of_a_tensor_dataset_arrive_as_in_the_main_process():
    data = torch.arange(BATCH * 6 * BIG, dtype=torch.float32).reshape(BATCH * 6, 2, BIG // 2)
    dataset = TensorDataset(data[:, :, ::2], torch.arange(BATCH * 6))  # non-contiguous rows
    batches = list(DataLoader(dataset, batch_size=BATCH, num_workers=2))
    for number, (values, labels) in enumerate(batches):
        rows = slice(number * BATCH, (number + 1) * BATCH)
        assert torch.equal(values, data[rows, :, ::2]) and values.is_contiguous()
        assert labels.tolist() == list(range(rows.start, rows.stop))


class StreamsBig(torch.utils.data.IterableDataset):
    """Each worker yields its share of 0..60 (sharded by torch's worker info), ``(tensor, i)``."""

    def __iter__(self):
        info = torch.utils.data.get_worker_info()
        first, step = (info.id, info.num_workers) if info is not None else (0, 1)
        for index in range(first, 60, step):
            yield torch.full((BIG,), float(index)), index


def test_an_iterable_datasets_batches_short_last_ones_included_arrive_as_torchs():
    theirs = list(torch.utils.data.DataLoader(StreamsBig(), batch_size=BATCH, num_workers=2))
    ours = list(DataLoader(StreamsBig(), batch_size=BATCH, num_workers=2))
    assert [len(labels) for _, labels in ours] == [len(labels) for _, labels in theirs]
    for (values, labels), (their_values, their_labels) in zip(ours, theirs):
        assert torch.equal(values, their_values) and torch.equal(labels, their_labels)
    assert any(backing_of(values).startswith("/memfd:") for values, _ in ours[2:])


class DtypeChangesAt(torch.utils.data.Dataset):
    """Float32 samples, but one int32 sample of the same size (as many bytes, other values)."""

    def __len__(self) -> int:
        return BATCH * 4

    def __getitem__(self, index: int) -> torch.Tensor:
        if index == BATCH * 2 + 3:
            return torch.full((BIG,), 7, dtype=torch.int32)
        return torch.full((BIG,), index + 0.5)


def test_a_sample_of_another_dtype_is_stacked_as_the_main_process_would():
    def outcome(num_workers: int):
        try:
            return [batch for batch in DataLoader(DtypeChangesAt(), batch_size=BATCH,
                                                  num_workers=num_workers)]
        except RuntimeError as error:  # as torch.stack decides
            return type(error)

    theirs, ours = outcome(0), outcome(2)
    if isinstance(theirs, type):
        assert ours is theirs
    else:
        assert len(ours) == len(theirs)
        for mine, other in zip(ours, theirs):
            assert mine.dtype == other.dtype and torch.equal(mine, other)


class NestedFrom(torch.utils.data.Dataset):
    """Plain samples, then large nested tensors (a strided layout, but no one shape) from the
    third batch on, once slabs are granted."""

    def __len__(self) -> int:
        return BATCH * 4

    def __getitem__(self, index: int) -> torch.Tensor:
        if index < BATCH * 2:
            return torch.full((BIG,), float(index))
        return torch.nested.nested_tensor([torch.full((BIG // 2,), float(index)),
                                           torch.full((BIG // 2 + 1,), -float(index))])


def _last_lines_of_errors(num_workers: int) -> list[str]:
    iterator = iter(DataLoader(NestedFrom(), batch_size=BATCH, num_workers=num_workers))
    lines = []
    for _ in range(4):
        try:
            next(iterator)
            lines.append("a batch")
        except RuntimeError as error:
            lines.append(str(error).strip().splitlines()[-1].removeprefix("RuntimeError: "))
    return lines


@pytest.mark.filterwarnings("ignore:The PyTorch API of nested tensors")
def test_nested_tensors_fail_in_default_collate_with_torchs_words():
    assert _last_lines_of_errors(2) == _last_lines_of_errors(0)


class RefillsOneBuffer(torch.utils.data.Dataset):
    """Every sample is the same tensor, filled with its index when it is asked for."""

    def __init__(self) -> None:
        self.buffer = torch.zeros(BIG)

    def __len__(self) -> int:
        return BATCH * 6

    def __getitem__(self, index: int) -> torch.Tensor:
        return self.buffer.fill_(float(index))


class RefillsARing(torch.utils.data.Dataset):
    """Sample ``i`` is a fresh view of slot ``i % 3`` of one tensor, filled with ``i`` first: the
    view is let go once placed, the tensor it views is not."""

    def __init__(self) -> None:
        self.ring = torch.zeros(3, BIG)

    def __len__(self) -> int:
        return BATCH * 6

    def __getitem__(self, index: int) -> torch.Tensor:
        self.ring[index % 3] = float(index)
        return self.ring[index % 3]


class RefillsAndViewsAsInts(RefillsOneBuffer):
    """The buffer seen as int32: a view that names no base, but shares the buffer's memory."""

    def __getitem__(self, index: int) -> torch.Tensor:
        return super().__getitem__(index).view(torch.int32)


class StreamRefillsOneBuffer(torch.utils.data.IterableDataset):
    def __iter__(self):
        info = torch.utils.data.get_worker_info()
        first, step = (info.id, info.num_workers) if info is not None else (0, 1)
        buffer = torch.zeros(BIG)
        for index in range(first, BATCH * 6, step):
            yield buffer.fill_(float(index))


@pytest.mark.parametrize("dataset", [RefillsOneBuffer, RefillsARing, RefillsAndViewsAsInts,
                                     StreamRefillsOneBuffer])
def test_samples_changed_in_place_after_they_were_fetched_batch_as_torch_stacks_them(dataset):
    # torch stacks what the samples hold once the batch is complete (here: repeats of the last
    # fills), not what they held when each was fetched.
    theirs = list(torch.utils.data.DataLoader(dataset(), batch_size=BATCH, num_workers=2))
    ours = list(DataLoader(dataset(), batch_size=BATCH, num_workers=2))
    assert [batch[:, 0].tolist() for batch in ours] == [batch[:, 0].tolist() for batch in theirs]
    for mine, other in zip(ours, theirs):
        assert mine.dtype == other.dtype and torch.equal(mine, other)
    assert any(backing_of(batch).startswith("/memfd:") for batch in ours[2:])


class KeepsWhatItMadeLonger(KeepsWhatItMade):
    def __len__(self) -> int:
        return BATCH * 6


def stacks_and_tells_whose_tensors(batch, *, collate_fn_map=None):
    """A tensor handler for default_collate_fn_map: the stack (large, so that slabs are granted)
    and, per sample, whether it was the dataset's own tensor."""
    made = get_worker_info().dataset.made.values()
    return torch.stack(batch), torch.tensor([any(part is kept for kept in made) for part in batch])


def test_a_tensor_handler_put_in_default_collate_fn_map_gets_the_datasets_own_tensors(monkeypatch):
    monkeypatch.setitem(default_collate_fn_map, torch.Tensor, stacks_and_tells_whose_tensors)
    batches = list(DataLoader(KeepsWhatItMadeLonger(), batch_size=BATCH, num_workers=2))
    assert len(batches) == 6
    for number, (stacked, owned) in enumerate(batches):
        assert stacked[:, 0].tolist() == [float(number * BATCH + k) for k in range(BATCH)]
        assert owned.all()


class NumberAt(torch.utils.data.Dataset):
    """Tensors, but a number for one sample in the middle of a batch placed in its rows."""

    def __len__(self) -> int:
        return BATCH * 6

    def __getitem__(self, index: int) -> torch.Tensor | int:
        return 3 if index == BATCH * 4 + 2 else torch.full((BIG,), float(index))


def test_a_number_among_placed_tensors_fails_with_torchs_words():
    def outcomes(num_workers: int) -> list[str]:
        iterator = iter(DataLoader(NumberAt(), batch_size=BATCH, num_workers=num_workers))
        lines = []
        for _ in range(6):
            try:
                next(iterator)
                lines.append("a batch")
            except TypeError as error:  # torch.stack's, as in the main process
                lines.append(str(error).strip().splitlines()[-1].removeprefix("TypeError: "))
        return lines

    assert outcomes(2) == outcomes(0)
