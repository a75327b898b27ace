"""The module under a short name, `from torch.utils import data`, as many tutorials write it: a
weighted sampler over a random_split, then each rank's share read through
data.distributed.DistributedSampler given num_replicas and rank, with no process group (as a job
that plans its shards ahead does). Prints every batch."""

import torch
from torch.utils import data


class Squares(data.Dataset):
    def __len__(self):
        return 23

    def __getitem__(self, index):
        return index, index * index + torch.randint(0, 5, ()).item()  # drawn in the worker


if __name__ == "__main__":
    torch.manual_seed(0)
    train, val = data.random_split(Squares(), [0.8, 0.2])
    weights = [3.0 if train.indices[i] % 4 == 0 else 1.0 for i in range(len(train))]
    loader = data.DataLoader(train, batch_size=4, num_workers=2,
                             sampler=data.WeightedRandomSampler(weights, num_samples=12))
    for epoch in range(2):
        print("weighted", epoch, [[field.tolist() for field in batch] for batch in loader])
    for rank in range(3):
        shard = data.distributed.DistributedSampler(val, num_replicas=3, rank=rank, shuffle=True, seed=4)
        loader = data.DataLoader(val, batch_size=2, sampler=shard, num_workers=1)
        for epoch in range(2):
            shard.set_epoch(epoch)
            print("rank", rank, epoch, len(loader), [index.tolist() for index, _ in loader])
