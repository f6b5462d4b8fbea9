"""Reliability of flax FP8 training (issue 8) on the jax.numpy path: fault injection (a fault every
10th step alternates input inf and NaN; tests/support/flax_reliability.py) and checkpoint/restore
in fresh processes (tests/run/flax_checkpoint.py). The flax modules defer the scale update to the
next forward, so a fault shows one step later than in torch (see the support module)."""
from pathlib import Path

import numpy as np
import pytest

from support import checkpoint as C
from support import flax_reliability as fr
from support.background import JOBS


@pytest.mark.parametrize("fault", fr.FAULTS)
def test_flax_one_faulty_step(fault):
    fr.check_fault_step(fault)


def test_flax_overflow_every_10th_step_ends_within_2_percent_of_clean():
    fr.check_periodic_overflows()


@pytest.mark.slow
@pytest.mark.background("flax_checkpoint")
def test_flax_checkpoint_restored_in_a_fresh_process_continues_bitwise(background):
    """The uninterrupted run (it saves the TrainState at step 50 with flax.serialization) against
    the restored one (from_bytes, 50 more steps), each in a fresh process (the 'flax_checkpoint'
    background job, tests/support/background.py).

    Both run with ``--xla_gpu_deterministic_ops=true``: XLA:GPU picks its GEMM algorithms by timing
    them at compile time, so two processes can compile the same step with different algorithms (a
    different summation order). On the H200 without the flag the restored run differed from its
    first step on (loss/50); the flag turns the autotuning off. Harmless on the CPU."""
    for _, env in JOBS["flax_checkpoint"](Path("unused")):
        assert "--xla_gpu_deterministic_ops=true" in env["XLA_FLAGS"].split()
    out = background.result("flax_checkpoint").check().out
    whole, resumed = (dict(np.load(out / name)) for name in ("whole.npz", "resumed.npz"))
    C.assert_resumed_run_equals_the_whole(whole, resumed, saved_at=50, last=99)
