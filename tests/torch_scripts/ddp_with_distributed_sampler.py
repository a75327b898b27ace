"""DDP on CPU: two gloo ranks, each reading its share through DistributedSampler, imported from
torch's submodule as DDP scripts do. Prints what each rank read per epoch, and the trained weight."""

import sys
import tempfile

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from torch.nn.parallel import DistributedDataParallel
from torch.utils.data import DataLoader, TensorDataset
from torch.utils.data.distributed import DistributedSampler

WORLD = 2


def train(rank: int, store: str) -> None:
    dist.init_process_group("gloo", init_method=f"file://{store}", rank=rank, world_size=WORLD)
    torch.manual_seed(0)
    inputs = torch.arange(40, dtype=torch.float32).unsqueeze(1) / 40
    dataset = TensorDataset(inputs, torch.arange(40))
    sampler = DistributedSampler(dataset, shuffle=True, seed=7)
    loader = DataLoader(dataset, batch_size=4, sampler=sampler, num_workers=1)
    model = DistributedDataParallel(torch.nn.Linear(1, 1))
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    read = []
    for epoch in range(2):
        sampler.set_epoch(epoch)
        for x, labels in loader:
            loss = (model(x).squeeze(1) - labels.float() / 40).pow(2).mean()
            optimizer.zero_grad()
            loss.backward()
            optimizer.step()
            read.append(labels.tolist())
    everyone = [None] * WORLD
    dist.all_gather_object(everyone, read)
    if rank == 0:
        for other, batches in enumerate(everyone):
            print(f"rank {other}: {batches}")
        print(f"weight {model.module.weight.item():.6f} bias {model.module.bias.item():.6f}")
        sys.stdout.flush()
    dist.destroy_process_group()


if __name__ == "__main__":
    with tempfile.NamedTemporaryFile(prefix="store-") as store:
        mp.start_processes(train, args=(store.name,), nprocs=WORLD, start_method="fork")
