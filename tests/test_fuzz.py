"""Fuzzing on the CPU (issue 8), a seeded subset in CI; the full sweep is tests/test_fuzz_gpu.py.

1. The GPU sweep's harness run on CPU tensors (fusedfp8.ops' host path: slots, offsets, torch
   wrapping, the transposed 2-D view of any shape, zero-size shapes) against fusedfp8.reference
   called directly, for every op, dequantize, update_scales and the first-step state path.
2. Invariants that do not trust the reference: the FP8 round trip stays within half an FP8
   step (relative, or absolute in the subnormal range) of the scaled input, saturates beyond the
   format's max, and keeps NaN; the amax propagates NaN over inf over finite values and is
   max |x| otherwise; numpy and torch callers get the same bytes.
"""
from __future__ import annotations

import ml_dtypes
import numpy as np
import pytest
import torch

import _fuzz_cases as F
import test_fuzz_gpu as G
from fusedfp8 import ops
from fusedfp8.formats import get_format


@pytest.fixture(autouse=True)
def on_cpu(monkeypatch):
    monkeypatch.setattr(G, "DEV", "cpu")
    n = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(n)


@pytest.mark.parametrize("op", F.OPS)
def test_harness_on_the_host_path(op):
    G.run_sweep(op, 60, 2048)


def test_harness_dequantize_update_and_state_path():
    G.fuzz_dequantize(150)
    G.fuzz_update_scales(60)
    G.fuzz_state_path(60)


def _to_torch(a: np.ndarray) -> torch.Tensor:
    if a.dtype == ml_dtypes.bfloat16:
        return torch.from_numpy(a.view(np.int16).copy()).view(torch.bfloat16)
    return torch.from_numpy(a.copy())


@pytest.mark.parametrize("seed", range(4))
def test_round_trip_amax_and_framework_invariants(seed):
    for c in F.cases(1000 + seed, "identity", 120, 4096):
        f = get_format(c.fmt)
        x = np.ascontiguousarray(c.x)
        s = np.array([c.scale], np.float32)
        r = ops.quantize(x, s, c.fmt, transpose=c.transpose)
        rt = ops.quantize(_to_torch(x), torch.from_numpy(s.copy()), c.fmt, transpose=c.transpose)
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
        ops.quantize(x, s, c.fmt, amax=amax)
        xa = np.float32(np.max(np.abs(x.astype(np.float32)), initial=0)) if x.size else np.float32(0)
        if np.isnan(before) or np.isnan(x.astype(np.float32)).any():
            assert np.isnan(amax[0]), (k, str(c))
        else:
            assert amax[0] == max(before, xa), (k, str(c))
