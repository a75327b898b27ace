"""A DataPipe graph as the dataset, imported from torch's datapipes and graph modules: shuffled,
sharded across workers by the loader, batched in the graph; the graph inspected with
traverse_dps and sharded by hand with apply_sharding."""

import torch
import torch.utils.data.graph
from torch.utils.data import DataLoader
from torch.utils.data.datapipes.iter import IterableWrapper
from torch.utils.data.graph_settings import apply_sharding


def square(x):
    return x * x


def build():
    return IterableWrapper(range(40)).shuffle().sharding_filter().map(square).batch(4)


def count_nodes(graph):
    return sum(1 + count_nodes(parents) for _, parents in graph.values())


if __name__ == "__main__":
    pipe = build()
    print("nodes", count_nodes(torch.utils.data.graph.traverse_dps(pipe)))
    by_hand = apply_sharding(IterableWrapper(range(10)).sharding_filter(), 3, 1)
    print("shard 1 of 3", list(by_hand))
    torch.manual_seed(0)
    loader = DataLoader(pipe, batch_size=None, num_workers=2)
    for epoch in range(2):
        print(epoch, [batch for batch in loader])
