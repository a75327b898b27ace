"""Run by tests/frameworks/test_lightning.py: Trainer(strategy="ddp", devices=2) on CPU.

Lightning relaunches this script for rank 1, so everything happens at module level under
``__main__``. Each rank writes what it saw to ``<out>/rank<r>.json``.

Two ways in are exercised at once: training loaders handed to ``fit`` (Lightning rebuilds them
from their attributes and ``__init__`` signature), and a validation loader made in the
``val_dataloader`` hook (Lightning records its ``__init__`` arguments while the hook runs).
"""

from __future__ import annotations

import json
import os
import sys
from collections import defaultdict
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))

import lightning.pytorch as pl  # noqa: E402
import torch  # noqa: E402

import pipeload  # noqa: E402
from workload import TaggedLoader, Witness, describe  # noqa: E402

SEED = 7
EPOCHS = 2


class Model(pl.LightningModule):
    def __init__(self) -> None:
        super().__init__()
        self.layer = torch.nn.Linear(1, 1)
        self.seen: dict = defaultdict(lambda: defaultdict(list))
        self.loaders: dict = {}

    def training_step(self, batch: dict, batch_idx: int) -> torch.Tensor:
        for name, part in batch.items():
            self.seen[name][str(self.current_epoch)].append(describe(part))
        return self.layer(batch["plain"]["index"].float().unsqueeze(1)).sum()

    def validation_step(self, batch: dict, batch_idx: int) -> None:
        self.seen["val"][str(self.current_epoch)].append(describe(batch))

    def val_dataloader(self) -> TaggedLoader:
        return TaggedLoader(Witness(10), tag="made-in-hook", batch_size=3, num_workers=1)

    def on_train_epoch_start(self) -> None:
        loaders = dict(self.trainer.train_dataloader)
        loaders["val"] = self.trainer.val_dataloaders
        for name, loader in loaders.items():
            inner = loader.batch_sampler.sampler if loader.batch_sampler is not None else loader.sampler
            self.loaders[name] = {
                "type": type(loader).__qualname__,
                "module": type(loader).__module__,
                "is_torch_loader": isinstance(loader, torch.utils.data.DataLoader),
                "tag": getattr(loader, "tag", None),
                "sampler": type(inner).__qualname__,
                "sampler_shuffles": bool(getattr(inner, "shuffle", False)),
                "sampler_seed": getattr(inner, "seed", None),
                "num_workers": loader.num_workers,
                "worker_type": loader.worker_type,
            }

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.SGD(self.parameters(), lr=0.01)


def main(out_dir: str) -> None:
    pl.seed_everything(SEED, verbose=False)
    train = {
        "plain": pipeload.DataLoader(Witness(), batch_size=4, shuffle=True, num_workers=2),
        "custom": TaggedLoader(Witness(), tag="extra-argument", batch_size=4, shuffle=True,
                               num_workers=1, persistent_workers=True),
    }
    model = Model()
    trainer = pl.Trainer(
        strategy="ddp", accelerator="cpu", devices=2, max_epochs=EPOCHS, logger=False,
        enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
        num_sanity_val_steps=0,
    )
    trainer.fit(model, train_dataloaders=train)
    record = {
        "rank": trainer.global_rank,
        "main_pid": os.getpid(),
        "seed": SEED,
        "loaders": model.loaders,
        "seen": model.seen,
    }
    Path(out_dir, f"rank{trainer.global_rank}.json").write_text(json.dumps(record))


if __name__ == "__main__":
    main(sys.argv[1])
