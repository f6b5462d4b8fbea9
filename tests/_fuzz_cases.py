"""Seeded random cases for the fuzz tests (tests/test_fuzz.py on the CPU, tests/test_fuzz_gpu.py on
the GPU): shapes (0, 1, primes, 2^k +- 1), element offsets into a bigger buffer (a contiguous slice
whose start is not 16-byte aligned), input dtypes, formats, ops, scales, and values with the edge
values sprinkled in (+-0, input-dtype denormals, +-inf, NaN, +-fmt max, values around fmt max /
scale, and exact rounding ties between neighbouring FP8 values)."""
from __future__ import annotations

from dataclasses import dataclass

import ml_dtypes
import numpy as np

from fusedfp8 import reference as ref
from fusedfp8.formats import get_format

DTYPES = ("float32", "float16", "bfloat16")
FMTS = ("e4m3", "e5m2")
OPS = ("identity", "gelu_tanh", "gelu_none", "dgelu_tanh", "dgelu_none")
DIMS = (0, 1, 2, 3, 5, 7, 8, 13, 15, 16, 17, 31, 32, 33, 63, 64, 65, 97, 127, 128, 129, 255, 256, 257, 509)


def np_dtype(name: str) -> np.dtype:
    return np.dtype(ml_dtypes.bfloat16) if name == "bfloat16" else np.dtype(name)


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


def reference(c: Case) -> ref.Quantized:
    if c.op == "identity":
        return ref.quantize(c.x, c.scale, c.fmt, c.transpose)
    kind, approx = c.op.split("_")
    if kind == "gelu":
        return ref.gelu_quantize(c.x, c.scale, c.fmt, approx, c.transpose)
    return ref.dgelu_quantize(c.x, c.b, c.scale, c.fmt, approx, c.transpose, c.dbias)


def run_ops(c: Case, x, b, scale):
    """The same case through fusedfp8.ops, on arrays of any framework."""
    from fusedfp8 import ops

    if c.op == "identity":
        return ops.quantize(x, scale, c.fmt, transpose=c.transpose)
    kind, approx = c.op.split("_")
    if kind == "gelu":
        return ops.gelu_quantize(x, scale, c.fmt, approximate=approx, transpose=c.transpose)
    return ops.dgelu_quantize(x, b, scale, c.fmt, approximate=approx, transpose=c.transpose, dbias=c.dbias)


def dbias_close(c: Case, got) -> tuple[bool, str]:
    """dbias against the reference within float32 summation-order error: per column,
    |got - want| <= (rows + 2) * 2**-23 * sum |dx| (plus a denormal floor). Columns holding inf /
    NaN must agree in NaN-ness; columns whose |dx| sum nears float32 overflow are skipped (where
    the sum overflows depends on the order)."""
    want = reference(c).dbias.astype(np.float64)
    got = np.asarray(got, np.float64)
    if got.shape != want.shape:
        return False, f"shape {got.shape} != {want.shape}"
    with np.errstate(all="ignore"):
        xf, bf = ref._float32(c.x), ref._float32(c.b)
        dx = (xf * ref.dgelu_f32(bf, c.op.split("_")[1])).astype(np.float32)
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
