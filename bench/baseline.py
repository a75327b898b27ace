"""The reference side of ``pipeload bench``: torch's own DataLoader, with the same arguments.

It lives here, outside the package, so that pipeload itself never calls torch's loader; the
``pipeload bench`` command picks it up by path when it runs from a source checkout (``make demo``
does).
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

import torch
import torch.utils.data


def make_torch_loader(dataset: Any, batch_size: int, num_workers: int, seed: int) -> Iterable[Any]:
    """A ``torch.utils.data.DataLoader`` built as ``pipeload bench`` builds pipeload's."""
    return torch.utils.data.DataLoader(
        dataset,
        batch_size=batch_size,
        shuffle=True,
        num_workers=num_workers,
        generator=torch.Generator().manual_seed(seed),
    )
