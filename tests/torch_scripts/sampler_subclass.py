"""A sampler of one's own, subclassing torch's from its submodule: batches of similar lengths
(a bucketing batch sampler), over a Subset from random_split, with a worker_init_fn that reads
the worker's info from torch's private module."""

import torch
from torch.utils.data import DataLoader
from torch.utils.data._utils.worker import get_worker_info
from torch.utils.data.dataset import Dataset, random_split
from torch.utils.data.sampler import BatchSampler, RandomSampler, Sampler


class Lengths(Dataset):
    def __len__(self):
        return 30

    def __getitem__(self, index):
        return torch.full((index % 7 + 1,), index).sum()


class BucketBatches(Sampler):
    """Shuffles, then sorts each window of 8 indices by length before cutting batches of 4."""

    def __init__(self, lengths, generator):
        self.lengths = lengths
        self.generator = generator

    def __iter__(self):
        order = list(RandomSampler(range(len(self.lengths)), generator=self.generator))
        for start in range(0, len(order), 8):
            window = sorted(order[start:start + 8], key=lambda i: self.lengths[i])
            yield from BatchSampler(window, batch_size=4, drop_last=False)

    def __len__(self):
        return sum(-(-len(range(s, min(s + 8, len(self.lengths)))) // 4)
                   for s in range(0, len(self.lengths), 8))


def note_worker(worker_id):
    info = get_worker_info()
    assert info is not None and info.id == worker_id and info.num_workers == 2


if __name__ == "__main__":
    train, _ = random_split(Lengths(), [0.8, 0.2], generator=torch.Generator().manual_seed(1))
    lengths = [train.indices[i] % 7 + 1 for i in range(len(train))]
    sampler = BucketBatches(lengths, torch.Generator().manual_seed(2))
    loader = DataLoader(train, batch_sampler=sampler, num_workers=2, worker_init_fn=note_worker)
    for epoch in range(2):
        print(epoch, [batch.tolist() for batch in loader])
    print("batches per epoch", len(loader))
