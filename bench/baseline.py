"""The reference side of ``pipeload bench``: torch's own DataLoader, with the same arguments.

It lives here, outside the package, so that pipeload itself never calls torch's loader; the
``pipeload bench`` demo picks it up when it runs from a source checkout (``make demo`` does).
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

import torch
import torch.utils.data

from pipeload.cli import SEED, BenchConfig


def make_torch_loader(dataset: Any, config: BenchConfig) -> Iterable[Any]:
    """A ``torch.utils.data.DataLoader`` built as ``pipeload.cli.make_pipeload_loader`` builds ours."""
    return torch.utils.data.DataLoader(
        dataset,
        batch_size=config.batch_size,
        shuffle=True,
        num_workers=config.num_workers,
        generator=torch.Generator().manual_seed(SEED),
    )
