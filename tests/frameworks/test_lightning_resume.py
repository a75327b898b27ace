"""A mid-epoch checkpoint of Lightning's resumes the batches the run had left, in their order.

Lightning loads the loader's state, makes the epoch's iterator, and only then calls the
sampler's ``set_epoch``: torch's ``DistributedSampler`` was still at epoch 0 when the resumed
epoch drew its order, so (with torch's loader too) the batches skipped were epoch 0's and the
rest handed out belonged to another order, silently. The state keeps the sampler's epoch.
"""

from __future__ import annotations

import gc
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.utils.data as tud

import pipeload

pl = pytest.importorskip("lightning.pytorch")


class _Interrupted(Exception):
    """The run stops here, its checkpoint written."""


class _Recorder(pl.LightningModule):
    """Notes each epoch's batches; saves a checkpoint and stops after batch ``stop_at``."""

    def __init__(self, stop_at: tuple[int, int] | None = None, checkpoint: Path | None = None) -> None:
        super().__init__()
        self.layer = torch.nn.Linear(1, 1)
        self.seen: dict[int, list[list[int]]] = {}
        self.stop_at, self.checkpoint = stop_at, checkpoint

    def training_step(self, batch: torch.Tensor, batch_idx: int) -> torch.Tensor:
        self.seen.setdefault(self.current_epoch, []).append(batch.tolist())
        return self.layer(batch.float().unsqueeze(1)).sum()

    def on_train_batch_end(self, outputs: Any, batch: Any, batch_idx: int) -> None:
        if self.stop_at == (self.current_epoch, batch_idx):
            self.trainer.save_checkpoint(self.checkpoint)
            raise _Interrupted

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.SGD(self.parameters(), lr=0.0)


def _fit(model: _Recorder, checkpoint: Path | None = None) -> None:
    sampler = tud.DistributedSampler(list(range(40)), num_replicas=2, rank=0, shuffle=True, seed=3)
    loader = pipeload.DataLoader(list(range(40)), sampler=sampler, batch_size=2, num_workers=2)
    trainer = pl.Trainer(accelerator="cpu", devices=1, max_epochs=3, logger=False,
                         enable_checkpointing=False, enable_progress_bar=False,
                         enable_model_summary=False, use_distributed_sampler=False)
    trainer.fit(model, train_dataloaders=loader, ckpt_path=checkpoint)


@pytest.mark.timeout(120)
def test_a_mid_epoch_checkpoint_resumes_the_rest_of_that_epochs_order(tmp_path: Path, leak_guard: Any) -> None:
    whole = _Recorder()
    _fit(whole)
    checkpoint = tmp_path / "mid.ckpt"
    stopped = _Recorder(stop_at=(1, 2), checkpoint=checkpoint)
    with pytest.raises(_Interrupted):
        _fit(stopped)
    assert stopped.seen[1] == whole.seen[1][:3]
    resumed = _Recorder()
    _fit(resumed, checkpoint)
    assert resumed.seen == {1: whole.seen[1][3:], 2: whole.seen[2]}
    # Lightning's trainer and its loops refer to each other: the loaders (and their slabs) go
    # when the collector frees that cycle, not when _fit returns.
    del whole, stopped, resumed
    gc.collect()
