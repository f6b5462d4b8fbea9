"""Reliability on the CPU (issue 8): fault injection in training and checkpoint/restore, with the
torch modules on their reference path, and the flax modules on the jax.numpy path (at the end;
a fault every 10th step alternates input inf and NaN). The GPU twins are in
tests/test_reliability_gpu.py.

Fault injection (tests/_reliability.py): one step whose input or output gradient holds inf or
NaN in one element. That tensor's overflow counter goes up by one, its scale, scale_inv and
history are kept (no roll, nothing non-finite enters the history), the next clean step updates
every tensor exactly as the reference rule says, and the loss keeps falling; a whole run with a
fault every 10th step ends within 2% of the clean run's loss.

Checkpoints: a run saved at step 50 and restored in a fresh process continues bitwise
identically (losses, every FP8 state array, final parameters) to the uninterrupted run. The
restore runs in a fresh process (tests/_checkpoint_run.py), which also keeps torch.load away from
the NVRTC-compiling pytest process (torch 2.13 CPU fails to load there; see
tests/test_pytorch.py).
"""
from __future__ import annotations

import os
import subprocess
import sys

import numpy as np
import pytest
import torch

import _reliability as rel

HERE = os.path.dirname(os.path.abspath(__file__))


@pytest.fixture(autouse=True)
def one_thread():
    """Small tensors: intra-op threads only contend (20x slower on a loaded 2-core machine)."""
    n = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(n)


@pytest.mark.parametrize("fault", rel.FAULTS)
def test_one_faulty_step(fault):
    rel.check_fault_step("cpu", fault)


def test_overflow_every_10th_step_ends_within_2_percent_of_clean():
    rel.check_periodic_overflows("cpu")


def test_fault_check_would_see_a_poisoned_history(monkeypatch):
    """Control: with an update rule that lets the non-finite amax into the history (the bug the
    rule exists to prevent), the fault-step check fails."""
    from fusedfp8 import state as state_mod

    real = state_mod.update_rule

    def poisoning(xp, amax_history, scale, overflows, updates, fmt_max, margin_factor, algo):
        out = list(real(xp, amax_history, scale, overflows, updates, fmt_max, margin_factor, algo))
        out[0] = xp.concatenate([out[0][:-1], amax_history[:1]], axis=0)  # the staged amax, rolled in as is
        return tuple(out)

    monkeypatch.setattr(state_mod, "update_rule", poisoning)
    with pytest.raises(AssertionError):
        rel.check_fault_step("cpu", "input-inf", after=2)


# ---- checkpoints -----------------------------------------------------------------------------
def restore_in_fresh_process(device, ckpt, record, first=50, last=100) -> dict:
    cmd = [sys.executable, os.path.join(HERE, "_checkpoint_run.py"), device, str(first), str(last), str(record),
           "--load", str(ckpt)]
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    return dict(np.load(record))


def assert_resumed_run_equals_the_whole(whole: dict, resumed: dict, saved_at: int = 50, last: int = 99) -> None:
    """The run restored from the step-``saved_at`` checkpoint recorded bitwise what the
    uninterrupted run recorded from that step on (losses, states, final weights), and the run is
    not trivial: scales moved after the save, and overflows were counted after it."""
    keys = [k for k in whole if not k.startswith(("loss/", "state/")) or int(k.split("/")[1]) >= saved_at]
    assert sorted(keys) == sorted(resumed), set(keys) ^ set(resumed)
    differ = [k for k in keys if whole[k].tobytes() != resumed[k].tobytes()]
    assert not differ, differ[:10]
    scales = [whole[f"state/{s}/0/scale"] for s in (saved_at, last)]
    assert scales[0].tobytes() != scales[1].tobytes()
    over = [sum(float(whole[f"state/{s}/{k}/overflows"].sum()) for k in range(4)) for s in (saved_at, last)]
    assert over[1] > over[0] > 0


def test_checkpoint_restored_in_a_fresh_process_continues_bitwise(tmp_path):
    """The uninterrupted run (here; it saves at step 50 with torch.save) against the restored one
    (a fresh process: torch.load, 50 more steps)."""
    import _checkpoint_run

    ckpt = tmp_path / "step50.pt"
    whole = _checkpoint_run.run("cpu", 0, 100, save_at=(50, str(ckpt)))
    resumed = restore_in_fresh_process("cpu", ckpt, tmp_path / "resumed.npz")
    assert_resumed_run_equals_the_whole(whole, resumed)


# ---- flax (fusedfp8.jax) ---------------------------------------------------------------------
# The same on the flax modules (jax.numpy path): tests/_flax_reliability.py, tests/_flax_checkpoint_run.py.
@pytest.mark.parametrize("fault", ["input-inf", "input-nan"])
def test_flax_one_faulty_step(fault):
    import _flax_reliability as frel

    frel.check_fault_step(fault)


def test_flax_overflow_every_10th_step_ends_within_2_percent_of_clean():
    import _flax_reliability as frel

    frel.check_periodic_overflows()


def test_flax_checkpoint_restored_in_a_fresh_process_continues_bitwise(tmp_path):
    """The uninterrupted run (it saves the TrainState at step 50 with flax.serialization) against
    the restored one (from_bytes, 50 more steps), each in a fresh process.

    Both run with ``--xla_gpu_deterministic_ops=true``: XLA:GPU picks its GEMM algorithms by
    timing them at compile time, so two processes can compile the same step with different
    algorithms (a different summation order). On the H200 without the flag the restored run
    differed from its first step on (loss/50); the flag turns the autotuning off. Harmless on the
    CPU."""
    flags = (os.environ.get("XLA_FLAGS", "") + " --xla_gpu_deterministic_ops=true").strip()
    env = dict(os.environ, XLA_FLAGS=flags)
    ckpt, records = tmp_path / "step50.msgpack", (tmp_path / "whole.npz", tmp_path / "resumed.npz")
    script = os.path.join(HERE, "_flax_checkpoint_run.py")
    for cmd in ([sys.executable, script, "0", "100", str(records[0]), "--save-at", "50", str(ckpt)],
                [sys.executable, script, "50", "100", str(records[1]), "--load", str(ckpt)]):
        done = subprocess.run(cmd, capture_output=True, text=True, timeout=300, env=env)
        assert done.returncode == 0, done.stderr[-3000:]
    whole, resumed = (dict(np.load(r)) for r in records)
    assert_resumed_run_equals_the_whole(whole, resumed)
