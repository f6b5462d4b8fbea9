"""The torch.distributed ranks of tests/pytorch/test_distributed.py, spawned from a process of their
own (the 'torch_distributed' background job):

    python tests/run/torch_distributed.py OUT_DIR

One spawn (``torch.multiprocessing``) per world size (2 and 4), each running every scenario of
tests/support/torch_distributed.py in the same processes (importing torch dominates the cost);
the 2-rank processes also try FSDP2 and run scripts/train_ddp.py's main() with torchrun's
environment. The ranks' .npz files go to OUT_DIR/world2 and OUT_DIR/world4.
"""
from __future__ import annotations

import os
import sys
from pathlib import Path

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # tests/: support

from support import torch_distributed as D  # noqa: E402


def main(out_dir: str) -> None:
    for world in D.WORLDS:
        out = Path(out_dir) / f"world{world}"
        out.mkdir(parents=True, exist_ok=True)
        D.spawn_world(world, out)


if __name__ == "__main__":
    main(sys.argv[1])
