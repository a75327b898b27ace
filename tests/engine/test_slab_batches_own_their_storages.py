"""Every tensor of a batch that travels in a slab has a storage of its own, as torch's have.

torch's workers collate each output into a shared storage of exactly its size. Ours write all of
a batch into one slab; before this, each tensor arrived as a view of a storage spanning the whole
slab: ``torch.save`` of one tensor wrote the slab (the other outputs' bytes too), two outputs of
one batch shared a storage, and ``resize_`` could grow a tensor over its neighbours. Each output
now arrives over its own piece of the slab: the same no-copy transport, torch's storages.
"""

from __future__ import annotations

import io

import pytest
import torch
from faults import ECONOMIC, FORK, engine_params, loader_kwargs

from pipeload import DataLoader

pytestmark = [pytest.mark.usefixtures("leak_guard"), pytest.mark.timeout(90),
              pytest.mark.filterwarnings("ignore:'pin_memory' argument is set as true:UserWarning"),
              pytest.mark.filterwarnings("ignore:This DataLoader will create:UserWarning")]

ITEMS = 48
BATCH = 4


class ImageAndVector(torch.utils.data.Dataset):
    """Item i: a 3x64x64 image, a label and a 64 Ki-float vector, all derived from i."""

    def __len__(self) -> int:
        return ITEMS

    def __getitem__(self, index: int) -> tuple[torch.Tensor, int, torch.Tensor]:
        return torch.full((3, 64, 64), float(index)), index, torch.full((1 << 16,), -float(index))


def saved_bytes(tensor: torch.Tensor) -> int:
    buffer = io.BytesIO()
    torch.save(tensor, buffer)
    return len(buffer.getvalue())


def expected(number: int) -> list[float]:
    return [float(number * BATCH + k) for k in range(BATCH)]


@pytest.mark.parametrize("pin_memory", [False, True], ids=["unpinned", "pinned"])
@pytest.mark.parametrize("engine", engine_params(FORK, ECONOMIC))
def test_each_output_of_a_slab_batch_has_a_storage_of_exactly_its_size(engine, pin_memory: bool) -> None:
    # Pinned (with CUDA: slabs page-locked in place), each piece still answers is_pinned() and
    # copies to the device; without CUDA pin_memory=True loads through plain slabs.
    loader = DataLoader(ImageAndVector(), batch_size=BATCH, num_workers=2, pin_memory=pin_memory,
                        **loader_kwargs(engine))
    pinned = pin_memory and torch.cuda.is_available()
    in_slabs = 0
    for number, (images, labels, vectors) in enumerate(loader):
        if pinned:
            assert images.is_pinned() and vectors.is_pinned()
            assert torch.equal(vectors.cuda(non_blocking=True).cpu(), vectors)
        assert images[:, 0, 0, 0].tolist() == expected(number)
        assert vectors[:, -1].tolist() == [-v for v in expected(number)]
        assert labels.tolist() == list(range(number * BATCH, number * BATCH + BATCH))
        in_slabs += not vectors.is_shared()  # a slab piece (a one-shot buffer answers True)
        storages = set()
        for tensor in (images, labels, vectors):
            assert tensor.storage_offset() == 0
            assert tensor.untyped_storage().nbytes() == tensor.nbytes
            storages.add(tensor.untyped_storage().data_ptr())
        assert len(storages) == 3
        # torch.save writes the tensor's bytes, not the slab's (a small header besides).
        assert saved_bytes(vectors) < vectors.nbytes + 4096
        if engine.economic and number == 0:
            continue  # collated by the main process from its samples, in memory of its own
        with pytest.raises(RuntimeError, match="not resizable"):
            images.resize_(images.numel() + 1)  # torch refuses it the same way
    assert in_slabs >= 6  # after the first few batches, which go out before a slab is sized


class StackAndItsFirstRow:
    """A collate_fn returning a stacked batch and a view of it: they share one storage in
    torch, and must still share one here."""

    def __call__(self, samples: list[tuple[torch.Tensor, int, torch.Tensor]]) -> tuple[torch.Tensor, torch.Tensor]:
        stacked = torch.stack([vector for _, _, vector in samples])
        return stacked, stacked[0]


def test_views_of_one_output_still_share_its_storage() -> None:
    loader = DataLoader(ImageAndVector(), batch_size=BATCH, num_workers=2,
                        collate_fn=StackAndItsFirstRow(), **loader_kwargs(FORK))
    for number, (stacked, first) in enumerate(loader):
        assert first[-1].item() == -expected(number)[0]
        assert first.untyped_storage().data_ptr() == stacked.untyped_storage().data_ptr()
        assert stacked.untyped_storage().nbytes() == stacked.nbytes
        stacked[0, 0] = 7.0
        assert first[0].item() == 7.0


@pytest.mark.parametrize("move", ["share_memory_", "queue"])
@pytest.mark.parametrize("engine", engine_params(FORK, ECONOMIC))
def test_addresses_taken_from_a_batch_before_it_moves_to_shared_memory_keep_its_values(engine, move: str) -> None:
    # share_memory_() (which a torch.multiprocessing queue calls on what it sends) moves a
    # storage torch does not count as shared into new memory in place: the slab's storage let go
    # of its lease, and a numpy array, memoryview or DLPack tensor taken before read the batch
    # written into the slab next (a review: batch 2's numpy array read batch 9's values).
    import numpy as np
    import torch.multiprocessing as torch_mp
    from torch.utils import dlpack

    from pipeload.transport.lease_holders import leases_kept

    queue = torch_mp.get_context("fork").Queue() if move == "queue" else None
    loader = DataLoader(ImageAndVector(), batch_size=BATCH, num_workers=2, **loader_kwargs(engine))
    kept: tuple = ()
    for number, (images, _, vectors) in enumerate(loader):
        if number == 2:
            array, rows = images.numpy(), memoryview(vectors[1].numpy())
            capsule_tensor = dlpack.from_dlpack(dlpack.to_dlpack(images[3]))
            if queue is None:
                images.share_memory_()
                vectors.share_memory_()
            else:
                queue.put((images, vectors))  # its feeder thread moves them to shared memory
                got_images, _ = queue.get(timeout=30)
                assert got_images[:, 0, 0, 0].tolist() == expected(2)
                del got_images
            assert images.is_shared() and vectors.is_shared()  # neither holds the slab now
            kept = (array, rows, capsule_tensor)
        del images, vectors
    array, rows, capsule_tensor = kept
    assert array[:, 0, 0, 0].tolist() == expected(2)
    assert np.asarray(rows)[0] == -expected(2)[1]
    assert capsule_tensor[0, 0, 0].item() == expected(2)[3]
    if queue is not None:
        queue.close()
        queue.join_thread()
        from multiprocessing import resource_sharer
        resource_sharer.stop()  # the thread that served the batch's descriptor to the reader
    del kept, array, rows, capsule_tensor, loader, _  # (the last batch's middle part, inline)
    assert leases_kept() == 0  # each went with its tensors
