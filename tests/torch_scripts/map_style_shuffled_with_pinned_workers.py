"""A typical image-classification loop: a map-style Dataset with a random augmentation drawn in
the workers, shuffled, two worker processes, pin_memory (with no accelerator both loaders warn and
hand out ordinary memory). Prints every batch's labels, a checksum of its images, and the weights."""

import torch
from torch.utils.data import DataLoader, Dataset


class Noisy(Dataset):
    def __init__(self, n):
        self.images = torch.arange(n * 12, dtype=torch.float32).reshape(n, 3, 2, 2)
        self.labels = torch.arange(n) % 10

    def __len__(self):
        return len(self.labels)

    def __getitem__(self, i):
        return self.images[i] + torch.rand(3, 2, 2), self.labels[i]  # drawn in the worker


if __name__ == "__main__":
    torch.manual_seed(0)
    loader = DataLoader(Noisy(100), batch_size=16, shuffle=True, num_workers=2, pin_memory=True,
                        drop_last=False)
    model = torch.nn.Linear(12, 10)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.01)
    for epoch in range(2):
        for images, labels in loader:
            loss = torch.nn.functional.cross_entropy(model(images.flatten(1)), labels)
            optimizer.zero_grad()
            loss.backward()
            optimizer.step()
            print(epoch, labels.tolist(), f"{images.sum().item():.4f}", images.is_pinned())
    print(f"weight sum {model.weight.sum().item():.6f}")
