"""A training script that checkpoints its loader after every batch, for the kill-and-resume test.

    python resume_training.py OUT                      # train 3 epochs, write OUT/result.json
    python resume_training.py OUT --stop-after N       # ... then hang after batch N's checkpoint
    python resume_training.py OUT --resume             # continue from OUT/checkpoint.json

Each checkpoint holds what a real one would: the loader's state_dict(), the process's generator
states, the epoch, and (standing in for the model) every batch seen so far. It is written to a
temporary file and renamed over the old one, so a SIGKILL leaves the last complete one.
"""

from __future__ import annotations

import argparse
import base64
import json
import os
import random
import threading
from pathlib import Path
from typing import Any

import numpy as np
import torch

import pipeload

EPOCHS = 3


class Augmented(pipeload.Dataset):
    def __len__(self) -> int:
        return 30

    def __getitem__(self, i: int) -> tuple[int, float, float, float]:
        return i, torch.rand(1).item(), random.random(), float(np.random.rand())


def make_loader() -> pipeload.DataLoader:
    return pipeload.DataLoader(Augmented(), batch_size=4, shuffle=True, num_workers=2,
                               persistent_workers=True, worker_seeding="per_batch")


def generator_states() -> dict[str, Any]:
    numpy_state = np.random.get_state()
    return {
        "torch": base64.b64encode(torch.get_rng_state().numpy().tobytes()).decode(),
        "random": random.getstate(),
        "numpy": [numpy_state[0], numpy_state[1].tolist(), *numpy_state[2:]],
    }


def restore_generators(saved: dict[str, Any]) -> None:
    torch.set_rng_state(torch.frombuffer(bytearray(base64.b64decode(saved["torch"])), dtype=torch.uint8))
    version, words, gauss = saved["random"]
    random.setstate((version, tuple(words), gauss))
    name, keys, *rest = saved["numpy"]
    np.random.set_state((name, np.array(keys, dtype=np.uint32), *rest))


def save(path: Path, checkpoint: dict[str, Any]) -> None:
    partial = path.with_suffix(".partial")
    partial.write_text(json.dumps(checkpoint))
    os.replace(partial, path)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("out")
    parser.add_argument("--stop-after", type=int, default=None)
    parser.add_argument("--resume", action="store_true")
    args = parser.parse_args()
    out = Path(args.out)
    loader = make_loader()
    if args.resume:
        checkpoint = json.loads((out / "checkpoint.json").read_text())
        restore_generators(checkpoint["generators"])
        loader.load_state_dict(checkpoint["loader"])
        first_epoch, seen = checkpoint["epoch"], checkpoint["seen"]
    else:
        torch.manual_seed(0)
        random.seed(0)
        np.random.seed(0)
        first_epoch, seen = 0, []
    for epoch in range(first_epoch, EPOCHS):
        for batch in loader:
            seen.append([column.tolist() for column in batch])
            save(out / "checkpoint.json", {"loader": loader.state_dict(), "generators": generator_states(),
                                           "epoch": epoch, "seen": seen})
            if len(seen) == args.stop_after:
                (out / "stopped").write_text(str(os.getpid()))
                while True:  # wait here, workers and all, for the SIGKILL
                    threading.Event().wait(1.0)
    (out / "result.json").write_text(json.dumps(seen))


if __name__ == "__main__":
    main()
