"""One leg of the flax checkpoint test (tests/jax/test_flax_reliability.py), run in a fresh process
(the 'flax_checkpoint' background job runs both legs):

    python tests/run/flax_checkpoint.py FIRST LAST RECORD.npz [--save-at N CKPT] [--load CKPT]

Trains the model of tests/support/flax_reliability.py for steps FIRST..LAST-1 (a fault every 10th step,
so overflow counters are part of the state), optionally saving the whole TrainState (params, FP8
state, optimizer state, step) with ``flax.serialization.to_bytes`` before step N, or restoring
one with ``from_bytes`` into a freshly initialised TrainState before starting. Records per step
the loss and every module's FP8 state, and the final parameters, as raw arrays in an .npz file.
"""
from __future__ import annotations

import argparse
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # tests/: support

import jax  # noqa: E402
import numpy as np  # noqa: E402
from flax import serialization  # noqa: E402

from support import flax_reliability as fr  # noqa: E402


def run(first: int, last: int, save_at: tuple[int, str] | None = None, load: str | None = None) -> dict:
    task = fr.Task()
    st = fr.make_state()
    if load:
        with open(load, "rb") as f:
            st = serialization.from_bytes(st, f.read())
    out = {}
    for s in range(first, last):
        if save_at and s == int(save_at[0]):
            with open(save_at[1], "wb") as f:
                f.write(serialization.to_bytes(st))
        st, loss, _ = fr.train_step(st, *task.batch(s, fr.fault_at(s)))
        out[f"loss/{s}"] = np.asarray(loss)
        for k, m in enumerate(fr.states(st)):
            for name, a in m.items():
                out[f"state/{s}/{k}/{name}"] = a
    for path, a in jax.tree_util.tree_leaves_with_path(st.params["params"]):
        out[f"param/{jax.tree_util.keystr(path)}"] = np.asarray(a)
    out["step"] = np.asarray(st.step)
    return out


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("first", type=int)
    p.add_argument("last", type=int)
    p.add_argument("record")
    p.add_argument("--save-at", nargs=2)
    p.add_argument("--load")
    a = p.parse_args()
    np.savez(a.record, **run(a.first, a.last, a.save_at, a.load))


if __name__ == "__main__":
    main()
