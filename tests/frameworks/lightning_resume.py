"""Run by tests/frameworks/test_lightning_resume.py in a process of its own (Lightning's fit
patches torch's DataLoader class while it runs, and leaves ``__delattr__`` on it: the other tests
must not see that): three fits on one CPU, written to ``<out>/seen.json``.

1. ``whole``: 3 epochs, each epoch's batches noted;
2. ``stopped``: the same, stopped after batch 2 of epoch 1 with a checkpoint;
3. ``resumed``: ``fit(ckpt_path=...)`` from that checkpoint.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Any

import lightning.pytorch as pl
import torch
import torch.utils.data as tud

import pipeload


class Interrupted(Exception):
    """The run stops here, its checkpoint written."""


class Recorder(pl.LightningModule):
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
            raise Interrupted

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.SGD(self.parameters(), lr=0.0)


def fit(model: Recorder, checkpoint: Path | None = None) -> None:
    sampler = tud.DistributedSampler(list(range(40)), num_replicas=2, rank=0, shuffle=True, seed=3)
    loader = pipeload.DataLoader(list(range(40)), sampler=sampler, batch_size=2, num_workers=2)
    trainer = pl.Trainer(accelerator="cpu", devices=1, max_epochs=3, logger=False,
                         enable_checkpointing=False, enable_progress_bar=False,
                         enable_model_summary=False, use_distributed_sampler=False)
    trainer.fit(model, train_dataloaders=loader, ckpt_path=checkpoint)


def main(out_dir: Path) -> None:
    whole = Recorder()
    fit(whole)
    checkpoint = out_dir / "mid.ckpt"
    stopped = Recorder(stop_at=(1, 2), checkpoint=checkpoint)
    try:
        fit(stopped)
    except Interrupted:
        pass
    resumed = Recorder()
    fit(resumed, checkpoint)
    seen = {name: model.seen for name, model in (("whole", whole), ("stopped", stopped), ("resumed", resumed))}
    (out_dir / "seen.json").write_text(json.dumps(seen))


if __name__ == "__main__":
    main(Path(sys.argv[1]))
