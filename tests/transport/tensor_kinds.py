"""Every kind of tensor a dataset can hand a loader, as a dataset: one kind per item.

It lives in an importable module (not inside a test) so that spawn workers can unpickle the
dataset and the tensor subclass by reference. Each item is made in ``__getitem__`` from a
generator seeded with its index, so every process (and torch's loader) builds the same values.
"""

from __future__ import annotations

import warnings
from collections.abc import Callable
from typing import Any

import torch

LARGE_FLOATS = 20 * 1024  # 80 KiB of float32: over the inline limit, so it travels in shared memory
FLOAT8_TYPES = tuple(d for d in vars(torch).values()
                     if isinstance(d, torch.dtype) and "float8" in str(d))


class TaggedTensor(torch.Tensor):
    """A tensor subclass with an attribute of its own (pickling must keep both)."""


def _tagged(g: torch.Generator) -> torch.Tensor:
    tensor = torch.randn(3, 2, generator=g).as_subclass(TaggedTensor)
    tensor.tag = "kept"
    return tensor


def _nested(layout: torch.layout) -> Callable[[torch.Generator], torch.Tensor]:
    def make(g: torch.Generator) -> torch.Tensor:
        parts = [torch.randn(5, 2, generator=g), torch.randn(3, 2, generator=g)]
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # the strided layout's "prototype" warning
            return torch.nested.nested_tensor(parts, layout=layout)
    return make


def _float8(dtype: torch.dtype) -> Callable[[torch.Generator], torch.Tensor]:
    return lambda g: torch.rand(4, 3, generator=g).to(dtype)


def _complex(g: torch.Generator) -> torch.Tensor:
    return torch.randn(4, 3, dtype=torch.complex64, generator=g)


def _sparse_csr(g: torch.Generator) -> torch.Tensor:
    dense = torch.randn(4, 5, generator=g)
    return (dense * (dense > 0)).to_sparse_csr()


def _sparse_coo(g: torch.Generator) -> torch.Tensor:
    dense = torch.randn(4, 5, generator=g)
    return (dense * (dense > 0)).to_sparse()


KINDS: dict[str, Callable[[torch.Generator], torch.Tensor]] = {
    "strided": lambda g: torch.randn(3, 4, generator=g),
    "large": lambda g: torch.randn(LARGE_FLOATS, generator=g),
    "transposed": lambda g: torch.randn(4, 6, generator=g).t(),
    "large-transposed": lambda g: torch.randn(LARGE_FLOATS // 64, 64, generator=g).t(),
    "offset-and-step": lambda g: torch.randn(12, generator=g)[2:11:3],
    "expanded": lambda g: torch.randn(3, generator=g).expand(4, 3),
    "zero-size": lambda g: torch.empty((0, 3)),
    "zero-size-inner": lambda g: torch.empty((2, 0, 4), dtype=torch.int16),
    "scalar": lambda g: torch.tensor(7.5),
    "nested-strided": _nested(torch.strided),
    "nested-jagged": _nested(torch.jagged),
    "sparse-coo": _sparse_coo,
    "sparse-coo-uncoalesced": lambda g: torch.sparse_coo_tensor(
        torch.tensor([[0, 0, 1], [2, 2, 0]]), torch.randn(3, generator=g), (2, 3)),
    "sparse-csr": _sparse_csr,
    "quantized": lambda g: torch.quantize_per_tensor(torch.randn(6, generator=g), 0.1, 3, torch.quint8),
    "quantized-per-channel": lambda g: torch.quantize_per_channel(
        torch.randn(2, 3, generator=g), torch.tensor([0.1, 0.2]), torch.tensor([0, 1]), 0, torch.qint8),
    "complex": _complex,
    "complex-conj": lambda g: _complex(g).conj(),
    "negated-view": lambda g: _complex(g).conj().imag,  # a view with the negative bit set
    "bool": lambda g: torch.rand(5, generator=g) > 0.5,
    "bfloat16": lambda g: torch.randn(4, generator=g).to(torch.bfloat16),
    **{f"{str(d).removeprefix('torch.')}": _float8(d) for d in FLOAT8_TYPES},
    "requires-grad": lambda g: torch.randn(3, generator=g, requires_grad=True),
    "parameter": lambda g: torch.nn.Parameter(torch.randn(3, generator=g)),
    "subclass": _tagged,
}
FORMS = ("alone", "in-a-list")  # the batch is the tensor / a list of it and a plain tensor


class TensorKinds(torch.utils.data.Dataset):
    """Item ``i``: kind ``i // 2`` of ``KINDS``, alone or in a list with a plain tensor."""

    def __len__(self) -> int:
        return len(KINDS) * len(FORMS)

    def __getitem__(self, index: int) -> Any:
        name = list(KINDS)[index // len(FORMS)]
        tensor = KINDS[name](torch.Generator().manual_seed(index))
        if FORMS[index % len(FORMS)] == "alone":
            return tensor
        return [tensor, torch.tensor([index, index])]

    @staticmethod
    def index_of(name: str, form: str) -> int:
        return list(KINDS).index(name) * len(FORMS) + FORMS.index(form)


def first_item(batch: list[Any]) -> Any:
    """The collate function: a batch of one item is that item, exactly as the dataset made it."""
    return batch[0]
