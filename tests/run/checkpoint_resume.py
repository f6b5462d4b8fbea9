"""One leg of the torch checkpoint test (tests/pytorch/test_torch_reliability.py), run in a fresh
process:

    python tests/run/checkpoint_resume.py DEVICE FIRST LAST RECORD.npz [--save-at N CKPT] [--load CKPT]

Trains the model of tests/support/reliability.py on its task for steps FIRST..LAST-1 (Adam with a
cosine schedule over 100 steps, a fault every 10th step so overflow counters are part of the
state), optionally saving {model, optimizer, scheduler} with torch.save after step N-1 or
loading such a checkpoint before starting. Records per step the loss and every module's FP8
state (scale, scale_inv, amax_history, overflows, updates), and the final parameters, as raw
bytes in an .npz file.
"""
from __future__ import annotations

import argparse
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # tests/: support

import numpy as np  # noqa: E402
import torch  # noqa: E402

from support import reliability as rel  # noqa: E402


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("device")
    p.add_argument("first", type=int)
    p.add_argument("last", type=int)
    p.add_argument("record")
    p.add_argument("--save-at", nargs=2)
    p.add_argument("--load")
    a = p.parse_args()
    torch.set_num_threads(1)
    np.savez(a.record, **rel.checkpoint_run(a.device, a.first, a.last, a.save_at, a.load))


if __name__ == "__main__":
    main()
