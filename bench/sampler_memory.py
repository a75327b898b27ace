"""The memory an epoch's order costs the loader's processes: a shuffled map-style loader over many
keys, pipeload (classic and economic) beside torch, the summed PSS of main process and workers.

    PYTHONPATH=src:. python -m bench.sampler_memory [--keys 4000000] [--loaders torch,classic,economic]

Each loader runs in a fresh interpreter (``persistent_workers=True``, 2 workers, batch 8192, a
dataset whose item is its index, a collate that returns one small tensor): near the end of its
epoch the PSS of each process of the tree is read with psutil. An order held as a list of
Python ints (~38 bytes a key) whose pages a worker forked after the first draw keeps as its own
shows here; torch forks every worker before drawing.
"""

from __future__ import annotations

import argparse
import subprocess
import sys

CHILD = """
import sys, warnings, psutil, torch, torch.utils.data as tud
warnings.simplefilter("ignore")
import pipeload
keys, which = int(sys.argv[1]), sys.argv[2]
class Keys(tud.Dataset):
    def __len__(self): return keys
    def __getitem__(self, index): return index
def collate(batch): return torch.tensor(len(batch))
options = dict(batch_size=8192, shuffle=True, num_workers=2, collate_fn=collate, persistent_workers=True)
loader = (tud.DataLoader(Keys(), **options) if which == "torch"
          else pipeload.DataLoader(Keys(), mode=which, **options))
me = psutil.Process()
for number, _ in enumerate(loader):
    if number == len(loader) - 3:
        pss = [p.memory_full_info().pss >> 20 for p in [me] + me.children(recursive=True)]
print(sum(pss), pss)
"""


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--keys", type=int, default=4_000_000)
    parser.add_argument("--loaders", default="torch,classic,economic")
    args = parser.parse_args()
    print(f"{args.keys:,} keys, batch 8192, 2 workers, persistent; PSS summed over the process tree")
    for which in args.loaders.split(","):
        done = subprocess.run([sys.executable, "-c", CHILD, str(args.keys), which],
                              capture_output=True, text=True, check=True)
        total, _, each = done.stdout.strip().partition(" ")
        print(f"{which:8} {int(total):6,} MiB   per process (main first): {each} MiB")


if __name__ == "__main__":
    main()
