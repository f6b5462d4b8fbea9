"""One leg of the checkpoint test (tests/test_reliability.py), run in a fresh process:

    python tests/_checkpoint_run.py DEVICE FIRST LAST RECORD.npz [--save-at N CKPT] [--load CKPT]

Trains the model of tests/_reliability.py on its task for steps FIRST..LAST-1 (Adam with a
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

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import numpy as np  # noqa: E402
import torch  # noqa: E402

import _reliability as rel  # noqa: E402
import fusedfp8.pytorch as fp8  # noqa: E402
from fusedfp8.state import STATE_FIELDS  # noqa: E402

TOTAL = 100


def run(device: str, first: int, last: int, save_at: tuple[int, str] | None = None, load: str | None = None) -> dict:
    """Steps first..last-1; the record as a dict of numpy arrays (see the module docstring)."""
    task = rel.Task(device)
    model = rel.make_model(device)
    opt = torch.optim.Adam(model.parameters(), lr=1e-2)
    sched = torch.optim.lr_scheduler.CosineAnnealingLR(opt, TOTAL)
    if load:
        ckpt = torch.load(load, map_location=device)
        model.load_state_dict(ckpt["model"])
        opt.load_state_dict(ckpt["opt"])
        sched.load_state_dict(ckpt["sched"])
    out = {}
    for s in range(first, last):
        if save_at and s == int(save_at[0]):
            torch.save({"model": model.state_dict(), "opt": opt.state_dict(), "sched": sched.state_dict()},
                       save_at[1])
        fault = rel.FAULTS[(s // 10) % len(rel.FAULTS)] if s % 10 == 9 else None
        loss, _ = rel.step(model, opt, *task.batch(s), fault=fault)
        sched.step()
        out[f"loss/{s}"] = np.float32(loss)
        for k, m in enumerate(fp8.fp8_modules(model)):
            for f in STATE_FIELDS:
                out[f"state/{s}/{k}/{f}"] = getattr(m, f).detach().cpu().numpy().copy()
    for name, prm in model.named_parameters():
        out[f"param/{name}"] = prm.detach().cpu().numpy().copy()
    return out


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
    np.savez(a.record, **run(a.device, a.first, a.last, a.save_at, a.load))


if __name__ == "__main__":
    main()
