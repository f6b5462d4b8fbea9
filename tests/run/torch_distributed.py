"""The torch.distributed ranks of tests/pytorch/test_distributed.py, spawned from a process of their
own (the 'torch_distributed' background job):

    python tests/run/torch_distributed.py OUT_DIR

One start (``torch.multiprocessing``, forked) per world size (2 and 4), each running every scenario
of tests/support/torch_distributed.py in the same processes (importing torch dominates the cost);
the 2-rank processes also try FSDP2 and run scripts/train_ddp.py's main() with torchrun's
environment. Then the two CurrentScaling ranks of tests/pytorch/test_torch_current_distributed.py
(tests/support/torch_current_distributed.py), forked too: spawned from the test process, each
imported torch and fusedfp8 again. The ranks' .npz files go to OUT_DIR/world2, OUT_DIR/world4 and
OUT_DIR/current.
"""
from __future__ import annotations

import os
import sys
from pathlib import Path

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # tests/: support

from support import torch_current_distributed as C  # noqa: E402
from support import torch_distributed as D  # noqa: E402


def main(out_dir: str) -> None:
    for world in D.WORLDS:
        out = Path(out_dir) / f"world{world}"
        out.mkdir(parents=True, exist_ok=True)
        D.spawn_world(world, out)
    current = Path(out_dir) / "current"
    current.mkdir(parents=True, exist_ok=True)
    C.spawn(current, start_method="fork")


if __name__ == "__main__":
    main(sys.argv[1])
