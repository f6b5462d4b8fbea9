"""Reliability of torch FP8 training (issue 8), one body for the CPU (reference path) and the GPU
(CUDA kernels, torch._scaled_mm): fault injection and checkpoint/restore.

Fault injection (tests/support/reliability.py): one step whose input or output gradient holds inf
or NaN in one element. That tensor's overflow counter goes up by one, its scale, scale_inv and
history are kept (no roll, nothing non-finite enters the history), the next clean step updates
every tensor exactly as the reference rule says, and the loss keeps falling; a whole run with a
fault every 10th step ends within 2% of the clean run's loss.

Checkpoints: a run saved at step 50 and restored in a fresh process (tests/run/checkpoint_resume.py)
continues bitwise identically (losses, every FP8 state array, final parameters) to the
uninterrupted run.
"""
from __future__ import annotations

import numpy as np
import pytest
import torch

from support import checkpoint as C
from support.torch_helpers import one_torch_thread  # noqa: F401  (autouse: one intra-op thread)
from support import reliability as rel

pytestmark = pytest.mark.fp8_gemm  # (on the GPU: torch._scaled_mm)




@pytest.mark.parametrize("fault", rel.FAULTS)
def test_one_faulty_step(device, fault):
    rel.check_fault_step(device, fault)


def test_overflow_every_10th_step_ends_within_2_percent_of_clean(device):
    rel.check_periodic_overflows(device)


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


def test_checkpoint_restored_in_a_fresh_process_continues_bitwise(tmp_path):
    """The uninterrupted run (here; it saves at step 50 with torch.save) against the restored one
    (a fresh process: torch.load, 50 more steps)."""
    ckpt = tmp_path / "step50.pt"
    whole = rel.checkpoint_run("cpu", 0, 100, save_at=(50, str(ckpt)))
    C.run_fresh("checkpoint_resume.py", "cpu", 50, 100, tmp_path / "resumed.npz", "--load", ckpt)
    resumed = dict(np.load(tmp_path / "resumed.npz"))
    C.assert_resumed_run_equals_the_whole(whole, resumed, saved_at=50, last=99)
