"""A streaming dataset as torch's documentation writes one: an IterableDataset that splits its range
across workers with torch.utils.data.get_worker_info() (reached through `import torch.utils.data`),
a random draw per item; without workers and with two. Prints every batch."""

import math

import torch
import torch.utils.data


class Range(torch.utils.data.IterableDataset):
    def __init__(self, start, end):
        super().__init__()
        self.start, self.end = start, end

    def __iter__(self):
        info = torch.utils.data.get_worker_info()
        if info is None:
            lo, hi = self.start, self.end
        else:
            per_worker = int(math.ceil((self.end - self.start) / float(info.num_workers)))
            lo = self.start + info.id * per_worker
            hi = min(lo + per_worker, self.end)
        for i in range(lo, hi):
            yield torch.tensor([i, torch.randint(0, 1000, ()).item()])


if __name__ == "__main__":
    torch.manual_seed(3)
    dataset = Range(3, 40)
    for workers in (0, 2):
        loader = torch.utils.data.DataLoader(dataset, batch_size=5, num_workers=workers)
        print(workers, [batch.tolist() for batch in loader])
