"""LayerNorm fused with FP8 quantization: the NumPy twin of ``cuda_src/layernorm_quantize.cu``
and the row layout that fixes its summation order.

Per row of x viewed as (rows, cols), in float32 with one rounding per operation:

    mean = row_sum(x) / cols                           (div.rn)
    d    = x - mean
    var  = row_sum(d * d) / cols                       (the variance from the centred values)
    rstd = 1 / sqrt(var + eps)                         (sqrt.rn, then div.rn: both correctly rounded)
    y    = ((d * rstd) * weight) + bias                (two multiplies and an add, never fused)

then ``y`` is quantized as :func:`fusedfp8.numerics.reference.finish` does (``amax = max |y|``).
A missing weight is 1 and a missing bias is -0 (x + -0 == x for every x, -0 included): the exact
identities, so leaving one out gives the same bits as not applying it.

``row_sum`` is the kernel's reduction, in the kernel's order (so the result is bitwise the
kernel's, and deterministic): the row is cut into chunks of ``CHUNK`` = 8 columns (the last one
zero-padded), and ``T = threads_per_row(cols)`` threads share a row, thread ``t`` taking chunks
``t, t + T, t + 2T, ...`` (coalesced loads). Each thread keeps 8 sums, one per position in a chunk,
and adds its chunks into them in order, starting from +0 (so no sum is ever -0, and a padded +0
changes nothing); then halving trees: over the 8 positions (``a[j] += a[j + h]`` for h = 4, 2, 1),
over the 32 lanes of each warp (h = 16 .. 1: the warp's xor-butterfly), and over the T / 32 warps
of the row (h = T / 64 .. 1). Padded columns enter the sum of squares as exact zeros.

``mean`` and ``rstd`` are handed out (float32, one per row) for the backward; a NaN among them is
the canonical 0x7FC00000 (the sign and payload of a NaN out of arithmetic differ between NumPy,
XLA and the GPU; the FP8 bytes and the amax carry only its NaN-ness).
"""
from __future__ import annotations

import math

import numpy as np

from ..formats import Format
from ..types import Quantized
from . import reference as ref

f32 = np.float32
CHUNK = 8  # columns per chunk: one 16-byte load of a 2-byte input (two of float32)
CACHED_CHUNKS = 4  # chunks per thread the kernel keeps in registers (beyond: read again per pass)
MAX_THREADS_PER_ROW = 512  # also the kernel's block size
CANONICAL_NAN = np.uint32(0x7FC00000)


def threads_per_row(cols: int) -> int:
    """Threads sharing one row: the smallest power of two >= 32 whose threads hold the row in
    ``CACHED_CHUNKS`` chunks each, at most ``MAX_THREADS_PER_ROW`` (1024 columns: 32, one warp;
    4096: 128; 16384: 512; wider rows are read again from memory past 4 chunks a thread)."""
    chunks = -(-int(cols) // CHUNK)
    t = 32
    while t < MAX_THREADS_PER_ROW and t * CACHED_CHUNKS < chunks:
        t *= 2
    return t


def layout(cols: int) -> tuple[int, int]:
    """(threads per row T, chunk steps per thread K): a row is padded to K * T * CHUNK columns."""
    t = threads_per_row(cols)
    chunks = -(-int(cols) // CHUNK)
    return t, max(1, -(-chunks // t))


def _halve(v: np.ndarray, n: int) -> np.ndarray:
    """Halving tree over the last axis (length n, a power of two): v[i] += v[i + h], h = n/2 .. 1."""
    h = n // 2
    while h >= 1:
        v = v[..., :h] + v[..., h:2 * h]
        h //= 2
    return v[..., 0]


def row_sum(v: np.ndarray) -> np.ndarray:
    """(rows,) float32 sums of the (rows, cols) float32 array ``v`` in the kernel's order."""
    rows, cols = v.shape
    t, k = layout(cols)
    pad = np.zeros((rows, k * t * CHUNK), f32)
    pad[:, :cols] = v
    pad = pad.reshape(rows, k, t, CHUNK)
    acc = np.zeros((rows, t, CHUNK), f32)
    with np.errstate(all="ignore"):
        for step in range(k):
            acc = acc + pad[:, step]
        lanes = _halve(acc, CHUNK).reshape(rows, t // 32, 32)
        warps = _halve(lanes, 32)
        return _halve(warps, t // 32).astype(f32)


def canonical_nan(v: np.ndarray) -> np.ndarray:
    """``v`` with every NaN as 0x7FC00000."""
    v = np.array(v, f32)
    v.view(np.uint32)[np.isnan(v)] = CANONICAL_NAN
    return v


def _param(p, cols: int, argname: str):
    if p is None:
        return None
    p = ref.to_float32(p)
    if p.shape != (cols,):
        raise ValueError(f"{argname} must have shape ({cols},) (the last dimension of x); got {p.shape}")
    return p


def layernorm_f32(x, weight, bias, eps) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """(y, mean, rstd): y float32 of x's shape, mean and rstd (rows,) float32 (NaN canonical).
    ``weight`` / ``bias``: (cols,) float arrays or None."""
    xf = ref.to_float32(x)
    if xf.ndim == 0:
        raise ValueError("x: layernorm needs an input of at least 1 dimension; got a scalar")
    cols = xf.shape[-1]
    rows = math.prod(xf.shape[:-1])
    v = xf.reshape(rows, cols)
    w, b = _param(weight, cols, "weight"), _param(bias, cols, "bias")
    with np.errstate(all="ignore"):
        n = f32(cols)
        mean = (row_sum(v) / n).astype(f32)
        d = (v - mean[:, None]).astype(f32)
        var = (row_sum((d * d).astype(f32)) / n).astype(f32)
        rstd = (f32(1.0) / np.sqrt((var + f32(eps)).astype(f32))).astype(f32)
        y = (d * rstd[:, None]).astype(f32)
        if w is not None:
            y = (y * w).astype(f32)
        if b is not None:
            y = (y + b).astype(f32)
    return y.reshape(xf.shape), canonical_nan(mean), canonical_nan(rstd)


def layernorm_quantize(x, weight, bias, eps, scale, fmt: str | Format = "e4m3", transpose: bool = False,
                       pad_to: int = 1) -> tuple[Quantized, np.ndarray, np.ndarray]:
    """(Quantized of y, mean, rstd): y = LayerNorm(x) as :func:`layernorm_f32`, quantized with
    ``scale`` as :func:`fusedfp8.numerics.reference.quantize` does; ``amax = max |y|``.
    ``pad_to`` > 1: ``data`` is y's (rows, cols) view in the corner of zeros of its shape rounded up
    to multiples of ``pad_to`` (``data_t`` likewise, transposed; :func:`reference.pad2d`), the pad
    outside the amax; mean and rstd stay (rows,)."""
    if isinstance(pad_to, bool) or not isinstance(pad_to, (int, np.integer)) or pad_to < 1:
        raise ValueError(f"pad_to must be a positive int; got {pad_to!r}")
    y, mean, rstd = layernorm_f32(x, weight, bias, eps)
    res = ref.finish(y, ref.amax(y), scale, fmt, transpose)
    if pad_to > 1:
        cols = y.shape[-1]
        rows = math.prod(y.shape[:-1])
        prows, pcols = -(-rows // pad_to) * pad_to, -(-cols // pad_to) * pad_to
        res = res._replace(data=ref.pad2d(res.data.reshape(rows, cols), prows, pcols),
                           data_t=ref.pad2d(res.data_t, pcols, prows) if res.data_t is not None else None)
    return res, mean, rstd
