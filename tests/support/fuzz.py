"""Seeded random cases for the fuzz tests (tests/kernels/test_fuzz.py) and the harness that runs
them through fusedfp8's functions on torch tensors of a device ('cpu': the host path, 'cuda':
the kernels) against fusedfp8.numerics.reference called directly.

Cases: shapes (0, 1, primes, 2^k +- 1), element offsets into a bigger buffer (a contiguous
slice whose start is not 16-byte aligned), input dtypes, formats, ops, scales, and values with
the edge values sprinkled in (+-0, input-dtype denormals, +-inf, NaN, +-fmt max, values around
fmt max / scale, and exact rounding ties between neighbouring FP8 values).
"""
from __future__ import annotations

from dataclasses import dataclass

import ml_dtypes
import numpy as np

import fusedfp8
from fusedfp8.formats import get_format
from fusedfp8.numerics import reference as ref
from fusedfp8.recipe import DelayedScaling
from fusedfp8.state import STATE_FIELDS, ScalingState

from .frameworks import np_dtype

SEED = 20261202
DTYPES = ("float32", "float16", "bfloat16")
FMTS = ("e4m3", "e5m2")
OPS = ("identity", "gelu_tanh", "gelu_none", "dgelu_tanh", "dgelu_none")
DIMS = (0, 1, 2, 3, 5, 7, 8, 13, 15, 16, 17, 31, 32, 33, 63, 64, 65, 97, 127, 128, 129, 255, 256, 257, 509)


def fp8_ties(fmt: str) -> np.ndarray:
    """Exact midpoints between neighbouring finite FP8 values (positive), as float32."""
    f = get_format(fmt)
    vals = np.arange(256, dtype=np.uint8).view(f.numpy_dtype).astype(np.float32)
    vals = np.unique(vals[np.isfinite(vals) & (vals >= 0)])
    return ((vals[:-1].astype(np.float64) + vals[1:]) / 2).astype(np.float32)


def edge_values(fmt: str, dtype: str, scale: np.float32) -> np.ndarray:
    """Edge values of the input dtype and of the format seen through ``scale``."""
    f = get_format(fmt)
    fi = ml_dtypes.finfo(np_dtype(dtype))
    m = np.float32(f.max) / scale
    around = [m, np.nextafter(m, np.float32(np.inf)), np.nextafter(m, np.float32(0)), m * np.float32(1.0625),
              m * np.float32(0.97), m * np.float32(2)]
    denorm = [float(fi.smallest_subnormal), float(fi.smallest_subnormal) * 3, float(fi.smallest_normal) / 2]
    vals = [0.0, -0.0, np.inf, -np.inf, np.nan, float(fi.max), 1.0, -1.0] + around + denorm
    vals += [-v for v in around + denorm]
    return np.array(vals, np.float32)


@dataclass
class Case:
    """One fuzz case. ``base`` (and ``base_b`` for dgelu) hold the input at element ``offset``."""

    op: str
    dtype: str
    fmt: str
    shape: tuple
    offset: int
    scale: np.float32
    transpose: bool
    dbias: bool
    base: np.ndarray
    base_b: np.ndarray | None

    @property
    def n(self) -> int:
        return int(np.prod(self.shape, dtype=np.int64))

    @property
    def x(self) -> np.ndarray:
        return self.base[self.offset:self.offset + self.n].reshape(self.shape)

    @property
    def b(self) -> np.ndarray | None:
        return None if self.base_b is None else self.base_b[self.offset:self.offset + self.n].reshape(self.shape)

    def __str__(self) -> str:
        return (f"{self.op} {self.dtype}->{self.fmt} shape={self.shape} offset={self.offset} scale={self.scale!r} "
                f"transpose={self.transpose} dbias={self.dbias}")


def _values(rng, n: int, fmt: str, dtype: str, scale: np.float32) -> np.ndarray:
    kind = rng.integers(0, 4)
    if kind == 0:  # many binades
        v = rng.standard_normal(n) * np.exp2(rng.integers(-30, 20, n))
    elif kind == 1:  # around the format's range after scaling
        v = rng.standard_normal(n) * (get_format(fmt).max / float(scale)) * rng.uniform(0.1, 1.5)
    elif kind == 2:  # exact rounding ties, through a power-of-two scale (x * scale is the tie)
        ties = fp8_ties(fmt)
        v = rng.choice(ties, n) * rng.choice([-1.0, 1.0], n) / np.float64(scale)
    else:  # small integers and halves: exact in every dtype
        v = rng.integers(-40, 40, n) / 2.0
    v = v.astype(np.float32)
    if n:
        e = edge_values(fmt, dtype, scale)
        k = int(rng.integers(0, min(n, 2 * len(e)) + 1))
        v[rng.choice(n, k, replace=False)] = rng.choice(e, k)
    with np.errstate(over="ignore"):
        return v.astype(np_dtype(dtype))


def make_case(rng, op: str, max_elems: int) -> Case:
    dtype = str(rng.choice(DTYPES))
    fmt = str(rng.choice(FMTS))
    nd = int(rng.choice([1, 2, 2, 2, 3]))
    while True:
        shape = tuple(int(rng.choice(DIMS)) for _ in range(nd))
        if int(np.prod(shape, dtype=np.int64)) <= max_elems:
            break
    offset = int(rng.choice([0, 0, 1, 2, 3, 5, 7, 8, 9, 15, 17]))
    scale = np.float32(2.0 ** int(rng.integers(-16, 17))) if rng.random() < 0.8 else np.float32(rng.uniform(1e-3, 1e3))
    n = int(np.prod(shape, dtype=np.int64))
    base = _values(rng, n + offset + 3, fmt, dtype, scale)
    base_b = _values(rng, n + offset + 3, fmt, dtype, np.float32(1)) if op.startswith("dgelu") else None
    transpose = bool(rng.random() < 0.5) and nd >= 1
    dbias = op.startswith("dgelu") and bool(rng.random() < 0.5)
    return Case(op, dtype, fmt, shape, offset, scale, transpose, dbias, base, base_b)


def cases(seed: int, op: str, count: int, max_elems: int) -> list[Case]:
    rng = np.random.default_rng([seed, OPS.index(op)])
    return [make_case(rng, op, max_elems) for _ in range(count)]


def reference(c: Case) -> fusedfp8.Quantized:
    if c.op == "identity":
        return ref.quantize(c.x, c.scale, c.fmt, c.transpose)
    kind, approx = c.op.split("_")
    if kind == "gelu":
        return ref.gelu_quantize(c.x, c.scale, c.fmt, approx, c.transpose)
    return ref.dgelu_quantize(c.x, c.b, c.scale, c.fmt, approx, c.transpose, c.dbias)


def run_ops(c: Case, x, b, scale):
    """The same case through fusedfp8's functions, on arrays of any framework."""
    if c.op == "identity":
        return fusedfp8.quantize(x, scale, c.fmt, transpose=c.transpose)
    kind, approx = c.op.split("_")
    if kind == "gelu":
        return fusedfp8.gelu_quantize(x, scale, c.fmt, approximate=approx, transpose=c.transpose)
    return fusedfp8.dgelu_quantize(x, b, scale, c.fmt, approximate=approx, transpose=c.transpose, dbias=c.dbias)


def dbias_close(c: Case, got, want) -> tuple[bool, str]:
    """dbias against the reference's ``want.dbias`` within float32 summation-order error: per
    column, |got - want| <= (rows + 2) * 2**-23 * sum |dx| (plus a denormal floor). Columns holding
    inf / NaN must agree in NaN-ness; columns whose |dx| sum nears float32 overflow are skipped
    (where the sum overflows depends on the order)."""
    want = np.asarray(want.dbias, np.float64)
    got = np.asarray(got, np.float64)
    if got.shape != want.shape:
        return False, f"shape {got.shape} != {want.shape}"
    with np.errstate(all="ignore"):
        dx = ref.activation("dgelu", c.x, c.b, c.op.split("_")[1])
        dx2 = dx.reshape(int(np.prod(dx.shape[:-1])), dx.shape[-1])
        abscol = np.abs(dx2.astype(np.float64)).sum(axis=0)
        nonfinite = ~np.isfinite(dx2).all(axis=0)
    rows = dx2.shape[0]
    ok_nan = np.array_equal(np.isnan(got[nonfinite]), np.isnan(want[nonfinite]))
    cmp = ~nonfinite & (abscol < 1e37)
    tol = (rows + 2) * 2.0 ** -23 * abscol[cmp] + 1e-38
    diff = np.abs(got[cmp] - want[cmp])
    ok = ok_nan and bool(np.all(diff <= tol))
    return ok, "" if ok else f"max excess {np.max(diff - tol, initial=0)}; nan agree {ok_nan}"


# ---- the harness: cases through torch tensors on a device ---------------------------------------
def to_dev(a: np.ndarray, device: str):
    import torch

    if a.dtype == ml_dtypes.bfloat16:
        return torch.from_numpy(a.view(np.int16).copy()).view(torch.bfloat16).to(device)
    return torch.from_numpy(np.ascontiguousarray(a).copy()).to(device)


def host_bytes(t) -> bytes:
    import torch

    t = t.detach().contiguous().cpu()
    return t.view(torch.uint8).numpy().tobytes() if t.numel() else b""


def check_case(c: Case, device: str) -> str:
    """'' when the case matches the reference, else what differs."""
    import torch

    base = to_dev(c.base, device)
    x = base[c.offset:c.offset + c.n].view(c.shape)
    b = to_dev(c.base_b, device)[c.offset:c.offset + c.n].view(c.shape) if c.base_b is not None else None
    got = run_ops(c, x, b, torch.tensor([c.scale], dtype=torch.float32, device=device))
    want = reference(c)
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
        ok, why = dbias_close(c, got.dbias.cpu().numpy(), want)
        if not ok:
            errs.append(f"dbias: {why}")
    return ", ".join(errs)


def run_sweep(device: str, op: str, count: int, max_elems: int) -> None:
    failures = []
    for k, c in enumerate(cases(SEED, op, count, max_elems)):
        err = check_case(c, device)
        if err:
            failures.append(f"#{k} {c}: {err}")
    assert not failures, f"{len(failures)}/{count} cases differ:\n" + "\n".join(failures[:15])


def fuzz_dequantize(device: str, count: int) -> None:
    """Every FP8 code, odd offsets, three output dtypes, scale_inv over many binades (and
    denormal / huge ones)."""
    import torch

    rng = np.random.default_rng([SEED, 99])
    failures = []
    for k in range(count):
        fmt = str(rng.choice(FMTS))
        out = str(rng.choice(DTYPES))
        shape = tuple(int(rng.choice(DIMS)) for _ in range(int(rng.integers(1, 3))))
        n = int(np.prod(shape))
        off = int(rng.choice([0, 1, 3, 5, 15, 16, 17]))
        codes = rng.integers(0, 256, n + off + 2).astype(np.uint8)
        si = np.float32(rng.choice([2.0 ** int(rng.integers(-40, 40)), rng.uniform(1e-3, 1e3), 1e-45, 3e38]))
        fdt = getattr(torch, get_format(fmt).dtype_name)
        q = torch.from_numpy(codes).to(device)[off:off + n].view(fdt).view(shape)
        got = fusedfp8.dequantize(q, torch.tensor([si], dtype=torch.float32, device=device), out)
        want = ref.dequantize(codes[off:off + n].view(get_format(fmt).numpy_dtype).reshape(shape), si, np_dtype(out))
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


def fuzz_update_scales(device: str, count: int) -> None:
    """``count`` states, two update steps each: history lengths 1..3000 (odd ones, and more than
    one roll chunk of the kernel), 1..300 tensors, both algos, margins, formats, staged amaxes
    0 / -0 / NaN / inf / denormal / huge; every array byte for byte against the rule on NumPy."""
    import torch

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
        dev = ScalingState.create(grad, recipe, like=torch.zeros(1, device=device))
        for step in range(2):
            h = _random_history(rng, L, n)
            if step:
                h[1:] = host.amax_history[1:]
            host.amax_history[...] = h
            dev.amax_history.copy_(torch.from_numpy(h))
            fusedfp8.update_scales(host, recipe)
            fusedfp8.update_scales(dev, recipe)
            bad = [f for f in STATE_FIELDS if host_bytes(getattr(dev, f)) != getattr(host, f).tobytes()]
            if bad:
                failures.append(f"#{k} step {step} L={L} n={n} {recipe}: {bad}")
    assert not failures, f"{len(failures)} differ:\n" + "\n".join(failures[:15])


def fuzz_state_path(device: str, count: int) -> None:
    """Slots of a fresh state (on the GPU: the first-step pre-pass kernels, current scaling) and a
    second quantization into the same slot (max-accumulation), against the host path on a NumPy
    twin: data, scale_inv, and the state's scale / scale_inv / amax row."""
    import torch

    failures = []
    for k, c in enumerate(cases(SEED + 1, "identity", count, 1 << 14)):
        first = "current" if k % 4 else "unit"
        recipe = DelayedScaling(amax_history_len=4, margin=float(k % 3), first_step=first)
        host = ScalingState.create((False, True), recipe)
        dev = ScalingState.create((False, True), recipe, like=torch.zeros(1, device=device))
        i = 1 if c.fmt == "e5m2" else 0  # (the recipe picks the format: E5M2 for the gradient column)
        x = to_dev(c.base, device)[c.offset:c.offset + c.n].view(c.shape)
        errs = []
        for rep in range(2):
            r_host = fusedfp8.quantize(c.x, host.slot(i, recipe), transpose=c.transpose)
            r_dev = fusedfp8.quantize(x, dev.slot(i, recipe), transpose=c.transpose)
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
