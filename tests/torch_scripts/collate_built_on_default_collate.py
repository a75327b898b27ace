"""A custom collate_fn built on torch's collate helpers, imported from the private submodule as
many projects do: pads variable-length token lists, registers a type in the collate map, and
leaves the rest to default_collate."""

import dataclasses

import torch
import torch.utils.data
from torch.utils.data import Dataset
from torch.utils.data._utils.collate import collate, default_collate_fn_map
from torch.utils.data.dataloader import default_collate


@dataclasses.dataclass
class Box:
    corners: list


def collate_boxes(batch, *, collate_fn_map=None):
    return torch.tensor([box.corners for box in batch], dtype=torch.float32)


class Sentences(Dataset):
    def __len__(self):
        return 13

    def __getitem__(self, index):
        tokens = list(range(index % 5 + 1))
        return {"tokens": tokens, "label": index % 3, "box": Box([index, index, index + 1, index + 2])}


def pad_and_collate(samples):
    longest = max(len(s["tokens"]) for s in samples)
    padded = torch.tensor([s["tokens"] + [0] * (longest - len(s["tokens"])) for s in samples])
    rest = collate([{"label": s["label"], "box": s["box"]} for s in samples],
                   collate_fn_map={Box: collate_boxes, **default_collate_fn_map})
    return {"tokens": padded, **rest, "lengths": default_collate([len(s["tokens"]) for s in samples])}


if __name__ == "__main__":
    torch.manual_seed(0)
    loader = torch.utils.data.DataLoader(Sentences(), batch_size=4, shuffle=True, num_workers=2,
                                         collate_fn=pad_and_collate)
    for batch in loader:
        print({key: value.tolist() for key, value in batch.items()})
