"""Fuzzing (issue 8): seeded random sweeps (tests/support/fuzz.py) over shapes (0, 1, primes,
2^k +- 1), element offsets into a bigger buffer (contiguous slices whose start is not 16-byte
aligned), input dtypes, formats, ops (identity / gelu tanh+erf / dgelu tanh+erf, transpose, dbias),
scales and values with the edge values in them, compared byte for byte with
fusedfp8.numerics.reference: the FP8 data, its transpose, the amax and the scale_inv (dbias within
float32 summation order); dequantize, update_scales and the state path (slots on their first
step) likewise.

One body per sweep for both devices: on 'cuda' the full sweep (at least 2,000 cases for each of
identity, gelu, dgelu, dequantize and update_scales, plus 500 state-path cases; the NumPy
reference dominates, about 40 s on an H200 host), on 'cpu' a seeded subset through the host path
(slots, offsets, torch wrapping, the transposed 2-D view of any shape, zero-size shapes).

On the CPU also invariants that do not trust the reference: the FP8 round trip stays within half
an FP8 step (relative, or absolute in the subnormal range) of the scaled input, saturates beyond
the format's max, and keeps NaN; the amax propagates NaN over inf over finite values and is
max |x| otherwise; numpy and torch callers get the same bytes.
"""
from __future__ import annotations

import numpy as np
import pytest
import torch

import fusedfp8
from fusedfp8.formats import get_format
from support import fuzz as F
from support.torch_helpers import one_torch_thread  # noqa: F401  (autouse: one intra-op thread)
from support.frameworks import to_torch

# (count, max elements) per sweep and device
SWEEPS = {
    "cuda": {"identity": (2000, 1 << 16), "gelu_tanh": (1000, 4096), "gelu_none": (1000, 4096),
             "dgelu_tanh": (1000, 4096), "dgelu_none": (1000, 4096),
             "dequantize": 2000, "update_scales": 1000, "state_path": 500},
    "cpu": {**{op: (60, 2048) for op in F.OPS}, "dequantize": 150, "update_scales": 60, "state_path": 60},
}




@pytest.mark.parametrize("op", F.OPS)
def test_fuzz_quantize_family(device, op):
    count, max_elems = SWEEPS[device][op]
    F.run_sweep(device, op, count, max_elems)


def test_fuzz_case_counts():
    """On the GPU: identity 2,000 cases; gelu and dgelu 2,000 each over their two approximations;
    dequantize 2,000; update_scales 2,000 (1,000 states, two steps each)."""
    c = SWEEPS["cuda"]
    counts = {"identity": c["identity"][0], "gelu": c["gelu_tanh"][0] + c["gelu_none"][0],
              "dgelu": c["dgelu_tanh"][0] + c["dgelu_none"][0], "dequantize": c["dequantize"],
              "update_scales": 2 * c["update_scales"]}
    assert min(counts.values()) >= 2000, counts
    assert c["state_path"] >= 500


def test_fuzz_dequantize(device):
    F.fuzz_dequantize(device, SWEEPS[device]["dequantize"])


def test_fuzz_update_scales(device):
    F.fuzz_update_scales(device, SWEEPS[device]["update_scales"])


def test_fuzz_state_path_first_step(device):
    F.fuzz_state_path(device, SWEEPS[device]["state_path"])


# ---- invariants that do not trust the reference (host path) ----------------------------------------
@pytest.mark.parametrize("seed", range(4))
def test_round_trip_amax_and_framework_invariants(seed):
    for c in F.cases(1000 + seed, "identity", 120, 4096):
        f = get_format(c.fmt)
        x = np.ascontiguousarray(c.x)
        s = np.array([c.scale], np.float32)
        r = fusedfp8.quantize(x, s, c.fmt, transpose=c.transpose)
        rt = fusedfp8.quantize(to_torch(x), torch.from_numpy(s.copy()), c.fmt, transpose=c.transpose)
        assert rt.data.view(torch.uint8).numpy().tobytes() == r.data.tobytes(), str(c)
        if c.transpose:
            assert rt.data_t.view(torch.uint8).numpy().tobytes() == r.data_t.tobytes(), str(c)
        xf = x.astype(np.float32).astype(np.float64)
        # amax: NaN if any NaN, else inf if any inf, else max |x| (exactly)
        a = np.float32(r.amax[0]) if np.ndim(r.amax) else np.float32(r.amax)
        if np.isnan(xf).any():
            assert np.isnan(a), str(c)
        elif xf.size:
            assert a == np.float32(np.max(np.abs(xf))), str(c)
        else:
            assert a == 0, str(c)
        # round trip: within half an FP8 step of x * scale, saturated beyond max, NaN kept
        q = r.data.astype(np.float32).astype(np.float64)
        v = xf * np.float64(c.scale)
        with np.errstate(invalid="ignore", over="ignore"):
            v32 = (x.astype(np.float32) * c.scale).astype(np.float64)  # the kernel's one fp32 multiply
            nan = np.isnan(v32)
            assert np.isnan(q[nan]).all() and not np.isnan(q[~nan]).any(), str(c)
            big = ~nan & (np.abs(v32) >= f.max)
            assert (q[big] == np.sign(v32[big]) * f.max).all(), str(c)
            rest = ~nan & ~big
            sub = 2.0 ** (2 - 2 ** (f.exponent_bits - 1) - f.mantissa_bits)  # smallest subnormal step
            bound = np.maximum(np.abs(v32[rest]) * 2.0 ** -(f.mantissa_bits + 1), sub / 2)
            assert (np.abs(q[rest] - v32[rest]) <= bound).all(), str(c)
            assert np.all(np.abs(v32[rest] - v[rest]) <= np.abs(v[rest]) * 2.0 ** -24 + 1e-45), str(c)
            assert (np.sign(q[rest]) * np.sign(v32[rest]) >= 0).all(), str(c)  # never the wrong sign


def test_amax_accumulation_keeps_a_nan():
    amax = np.zeros(1, np.float32)
    s = np.ones(1, np.float32)
    for k, c in enumerate(F.cases(77, "identity", 40, 256)):
        x = np.ascontiguousarray(c.x)
        before = amax[0]
        fusedfp8.quantize(x, s, c.fmt, amax=amax)
        xa = np.float32(np.max(np.abs(x.astype(np.float32)), initial=0)) if x.size else np.float32(0)
        if np.isnan(before) or np.isnan(x.astype(np.float32)).any():
            assert np.isnan(amax[0]), (k, str(c))
        else:
            assert amax[0] == max(before, xa), (k, str(c))
