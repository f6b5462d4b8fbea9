"""GPU fuzzing (issue 8): seeded random sweeps (tests/_fuzz_cases.py) over shapes (0, 1, primes,
2^k +- 1), element offsets into a bigger buffer (contiguous slices whose start is not 16-byte
aligned), input dtypes, formats, ops (identity / gelu tanh+erf / dgelu tanh+erf, transpose, dbias),
scales and values with the edge values in them, compared byte for byte with fusedfp8.reference:
the FP8 data, its transpose, the amax and the scale_inv (dbias within float32 summation order).
At least 2,000 cases for each of identity, gelu, dgelu, dequantize and update_scales, plus the
state path (slots on their first step: the pre-pass kernels) against the host path.

Skipped with the probe's reason where there is no usable GPU. Runtime on an H200: the NumPy
reference dominates (about 40 s), plus the first compile of the 37 kernel modules when CuPy's
cache is cold (shared with tests/test_kernels_gpu.py in the same session).
"""
from __future__ import annotations

import ml_dtypes
import numpy as np
import pytest

import _fuzz_cases as F
from _markers import requires_gpu
from fusedfp8 import ops
from fusedfp8 import reference as ref
from fusedfp8.formats import get_format
from fusedfp8.recipe import DelayedScaling
from fusedfp8.state import STATE_FIELDS, ScalingState

pytestmark = [pytest.mark.gpu, requires_gpu]

SEED = 20261202
COUNTS = {"identity": 2000, "gelu_tanh": 1000, "gelu_none": 1000, "dgelu_tanh": 1000, "dgelu_none": 1000}
MAX_ELEMS = {"identity": 1 << 16}  # the reference's exact-FMA activations are slow on big arrays
ACT_MAX_ELEMS = 4096
DEV = "cuda"  # (tests/test_fuzz.py runs this harness with "cpu" on small subsets)


def torch_mod():
    import torch

    return torch


def to_dev(a: np.ndarray):
    torch = torch_mod()
    if a.dtype == ml_dtypes.bfloat16:
        return torch.from_numpy(a.view(np.int16).copy()).view(torch.bfloat16).to(DEV)
    return torch.from_numpy(np.ascontiguousarray(a).copy()).to(DEV)


def host_bytes(t) -> bytes:
    torch = torch_mod()
    t = t.detach().contiguous().cpu()
    return t.view(torch.uint8).numpy().tobytes() if t.numel() else b""


def check_case(c: F.Case) -> str:
    """'' when the case matches the reference, else what differs."""
    torch = torch_mod()
    base = to_dev(c.base)
    x = base[c.offset:c.offset + c.n].view(c.shape)
    b = to_dev(c.base_b)[c.offset:c.offset + c.n].view(c.shape) if c.base_b is not None else None
    got = F.run_ops(c, x, b, torch.tensor([c.scale], dtype=torch.float32, device=DEV))
    want = F.reference(c)
    errs = []
    if host_bytes(got.data) != np.ascontiguousarray(want.data).tobytes():
        errs.append("data")
    if c.transpose and host_bytes(got.data_t) != np.ascontiguousarray(want.data_t).tobytes():
        errs.append("data_t")
    if host_bytes(got.amax) != np.float32(want.amax).tobytes():
        errs.append(f"amax {got.amax.item()!r} != {want.amax!r}")
    if host_bytes(got.scale_inv) != (np.float32(1) / c.scale).tobytes():
        errs.append("scale_inv")
    if c.dbias:
        ok, why = F.dbias_close(c, got.dbias.cpu().numpy())
        if not ok:
            errs.append(f"dbias: {why}")
    return ", ".join(errs)


def run_sweep(op: str, count: int, max_elems: int) -> None:
    failures = []
    for k, c in enumerate(F.cases(SEED, op, count, max_elems)):
        err = check_case(c)
        if err:
            failures.append(f"#{k} {c}: {err}")
    assert not failures, f"{len(failures)}/{count} cases differ:\n" + "\n".join(failures[:15])


@pytest.mark.parametrize("op", list(COUNTS))
def test_fuzz_quantize_family(op):
    """identity: 2,000 cases; gelu and dgelu: 2,000 each over their two approximations."""
    run_sweep(op, COUNTS[op], MAX_ELEMS.get(op, ACT_MAX_ELEMS))


def test_fuzz_case_counts():
    counts = {"identity": COUNTS["identity"], "gelu": COUNTS["gelu_tanh"] + COUNTS["gelu_none"],
              "dgelu": COUNTS["dgelu_tanh"] + COUNTS["dgelu_none"]}
    assert min(counts.values()) >= 2000, counts


def test_fuzz_dequantize():
    """2,000 cases: every FP8 code, odd offsets, three output dtypes, scale_inv over many binades
    (and denormal / huge ones)."""
    fuzz_dequantize(2000)


def fuzz_dequantize(count: int) -> None:
    torch = torch_mod()
    rng = np.random.default_rng([SEED, 99])
    failures = []
    for k in range(count):
        fmt = str(rng.choice(F.FMTS))
        out = str(rng.choice(F.DTYPES))
        shape = tuple(int(rng.choice(F.DIMS)) for _ in range(int(rng.integers(1, 3))))
        n = int(np.prod(shape))
        off = int(rng.choice([0, 1, 3, 5, 15, 16, 17]))
        codes = rng.integers(0, 256, n + off + 2).astype(np.uint8)
        si = np.float32(rng.choice([2.0 ** int(rng.integers(-40, 40)), rng.uniform(1e-3, 1e3), 1e-45, 3e38]))
        fdt = getattr(torch, get_format(fmt).dtype_name)
        q = torch.from_numpy(codes).to(DEV)[off:off + n].view(fdt).view(shape)
        got = ops.dequantize(q, torch.tensor([si], dtype=torch.float32, device=DEV), out)
        want = ref.dequantize(codes[off:off + n].view(get_format(fmt).numpy_dtype).reshape(shape), si, F.np_dtype(out))
        if host_bytes(got) != np.ascontiguousarray(want).tobytes():
            failures.append(f"#{k} {fmt}->{out} shape={shape} offset={off} scale_inv={si!r}")
    assert not failures, f"{len(failures)} differ:\n" + "\n".join(failures[:15])


def _random_history(rng, L: int, n: int) -> np.ndarray:
    h = np.abs(rng.standard_normal((L, n)) * np.exp2(rng.integers(-40, 40, (L, n)))).astype(np.float32)
    h[rng.random((L, n)) < 0.2] = 0.0
    kinds = rng.integers(0, 9, n)
    row0 = h[0]
    row0[kinds == 0] = 0.0
    row0[kinds == 1] = np.nan
    row0[kinds == 2] = np.inf
    row0[kinds == 3] = 1e-45  # smallest denormal: scale FLT_MAX
    row0[kinds == 4] = 3.4e38
    row0[kinds == 5] = -0.0
    return h


def test_fuzz_update_scales():
    """2,000 updates: history lengths 1..3000 (odd ones, and more than one roll chunk of the
    kernel, included), 1..300 tensors, both algos, margins, formats, staged amaxes 0 / -0 / NaN /
    inf / denormal / huge; 1,000 states, two steps each, every array byte for byte against the
    rule on NumPy."""
    fuzz_update_scales(1000)


def fuzz_update_scales(count: int) -> None:
    torch = torch_mod()
    rng = np.random.default_rng([SEED, 7])
    failures = []
    for k in range(count):
        L = int(rng.choice([1, 2, 3, 16, 31, 33, 127, 257, 1024, 1025, 1026, 3000]))
        n = int(rng.choice([1, 2, 3, 7, 31, 64, 127, 129, 300]))
        recipe = DelayedScaling(margin=float(rng.choice([0, 1, 2.5])), amax_history_len=L,
                                amax_compute_algo=str(rng.choice(["max", "most_recent"])),
                                fp8_format=str(rng.choice(["hybrid", "e4m3"])))
        grad = tuple(bool(g) for g in rng.integers(0, 2, n))
        host = ScalingState.create(grad, recipe)
        dev = ScalingState.create(grad, recipe, like=torch.zeros(1, device=DEV))
        for step in range(2):  # 2 x 1,000 = 2,000 update cases
            h = _random_history(rng, L, n)
            if step:
                h[1:] = host.amax_history[1:]
            host.amax_history[...] = h
            dev.amax_history.copy_(torch.from_numpy(h))
            ops.update_scales(host, recipe)
            ops.update_scales(dev, recipe)
            bad = [f for f in STATE_FIELDS if host_bytes(getattr(dev, f)) != getattr(host, f).tobytes()]
            if bad:
                failures.append(f"#{k} step {step} L={L} n={n} {recipe}: {bad}")
    assert not failures, f"{len(failures)} differ:\n" + "\n".join(failures[:15])


def test_fuzz_state_path_first_step():
    """500 cases through slots of a fresh state (the first-step pre-pass kernels, current scaling)
    and a second quantization into the same slot (max-accumulation), against the host path on a
    NumPy twin: data, scale_inv, and the state's scale / scale_inv / amax row."""
    fuzz_state_path(500)


def fuzz_state_path(count: int) -> None:
    torch = torch_mod()
    failures = []
    for k, c in enumerate(F.cases(SEED + 1, "identity", count, 1 << 14)):
        first = "current" if k % 4 else "unit"
        recipe = DelayedScaling(amax_history_len=4, margin=float(k % 3), first_step=first)
        host = ScalingState.create((False, True), recipe)
        dev = ScalingState.create((False, True), recipe, like=torch.zeros(1, device=DEV))
        i = 1 if c.fmt == "e5m2" else 0  # (the recipe picks the format: E5M2 for the gradient column)
        x = to_dev(c.base)[c.offset:c.offset + c.n].view(c.shape)
        errs = []
        for rep in range(2):
            r_host = ops.quantize(c.x, host.slot(i, recipe), transpose=c.transpose)
            r_dev = ops.quantize(x, dev.slot(i, recipe), transpose=c.transpose)
            if host_bytes(r_dev.data) != np.ascontiguousarray(r_host.data).tobytes():
                errs.append(f"data (call {rep})")
            if c.transpose and host_bytes(r_dev.data_t) != np.ascontiguousarray(r_host.data_t).tobytes():
                errs.append(f"data_t (call {rep})")
            if host_bytes(r_dev.scale_inv) != np.asarray(r_host.scale_inv).tobytes():
                errs.append(f"scale_inv (call {rep})")
            for f in ("amax_history", "scale", "scale_inv"):
                if host_bytes(getattr(dev, f)) != getattr(host, f).tobytes():
                    errs.append(f"state.{f} (call {rep})")
        if errs:
            failures.append(f"#{k} {c} first_step={first}: {errs}")
    assert not failures, f"{len(failures)} differ:\n" + "\n".join(failures[:15])
