"""LayerNorm and LayerNorm + quantize in ``jax.numpy``: :mod:`fusedfp8.numerics.layernorm`'s op
order and summation tree, byte for byte, on the guarded arithmetic of
:mod:`fusedfp8.numerics.jnp` (its docstring says why), with an exact integer square root.
"""
from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

from ..formats import Format
from . import layernorm as _ln
from .jnp import (_INF_BITS, _MAG, _c, _hide, _mul, _traced_once, _unpack, amax, bits, cast_to_fp8, computed_once,
                  div_rn, f32, from_bits, mul, shares_one_zero)

_SQRT_STEPS = 26  # result bits of the integer square root: 24 significant, a guard bit, one for odd exponents


def _sqrt_step(i, rqm):
    """One bit of the digit-by-digit square root of ``m * 2**26`` (two radicand bits a step, the top
    ones from m, zeros below); remainder < 2**27, so int32 is enough. Module level: jax caches the
    loop by the function's identity."""
    r, q, m = rqm
    pair = jnp.where(i <= 12, lax.shift_right_logical(m, jnp.maximum(24 - 2 * i, 0)) & 3, 0)
    r = (r << 2) | pair
    t = (q << 2) | 1
    take = r >= t
    return jnp.where(take, r - t, r), (q << 1) | take.astype(jnp.int32), m


@_traced_once()
def sqrt_rn(v) -> jax.Array:
    """IEEE float32 square root, round to nearest even: the kernels' ``sqrt.rn.f32`` bit for bit,
    denormal arguments included (XLA:CPU reads them as 0, and XLA:GPU may lower ``sqrt``
    approximately), by an integer digit-by-digit root of the significand. sqrt(+-0) = +-0,
    sqrt(+inf) = +inf, a negative argument or NaN gives NaN."""
    v = jnp.asarray(v, f32)
    ib = bits(v)
    mag = ib & _MAG
    m, e = _unpack(mag)  # |v| = m * 2**(e - 150), m in [2**23, 2**24)
    ex = e - 150
    odd = ex & 1
    m = m << odd  # an even exponent: m in [2**23, 2**25)
    ex = ex - odd
    r = jnp.zeros_like(m)
    q = jnp.zeros_like(m)
    r, q, _ = lax.fori_loop(0, _SQRT_STEPS, _sqrt_step, (r, q, m))
    # sqrt(|v|) = sqrt(m * 2**26) * 2**((ex - 26) / 2), q = floor(sqrt(m * 2**26)) in [2**24.5, 2**25.5)
    drop = 1 + (q >= (1 << 25)).astype(jnp.int32)  # bits below the 24 kept
    kept = lax.shift_right_logical(q, drop)
    rest = q & ((1 << drop) - 1)
    half = 1 << (drop - 1)
    up = (rest > half) | ((rest == half) & ((r != 0) | ((kept & 1) == 1)))
    biased = (ex - 26) // 2 + drop + 150
    out = lax.shift_left(biased - 1, jnp.int32(23)) + kept + up.astype(jnp.int32)
    out = jnp.where(mag == 0, ib, jnp.where(mag == _INF_BITS, _INF_BITS, out))
    nan = (mag > _INF_BITS) | ((ib < 0) & (mag != 0))
    return from_bits(jnp.where(nan, np.int32(0x7FC00000), out))


def _halve(v, n: int):
    h = n // 2
    while h >= 1:
        v = v[..., :h] + v[..., h:2 * h]
        h //= 2
    return v[..., 0]


@shares_one_zero
def row_sum(v) -> jax.Array:
    """(rows,) sums of the (rows, cols) float32 array ``v`` in the kernel's order
    (:func:`fusedfp8.numerics.layernorm.row_sum`). The adds need no hiding: XLA reassociates
    float adds only with constants."""
    rows, cols = v.shape
    t, k = _ln.layout(cols)
    pad = jnp.pad(v, ((0, 0), (0, k * t * _ln.CHUNK - cols))).reshape(rows, k, t, _ln.CHUNK)
    acc = _hide(jnp.zeros((rows, t, _ln.CHUNK), f32))  # +0, never folded away (0 + -0 is +0)
    for step in range(k):
        acc = acc + pad[:, step]
    lanes = _halve(acc, _ln.CHUNK).reshape(rows, t // 32, 32)
    return _halve(_halve(lanes, 32), t // 32)


def _canonical_nan(v):
    return jnp.where(jnp.isnan(v), from_bits(np.int32(0x7FC00000)), v)


@shares_one_zero
def layernorm_f32(x, weight, bias, eps):
    """(y, mean, rstd) as :func:`fusedfp8.numerics.layernorm.layernorm_f32`: y float32 of x's shape,
    mean and rstd (rows,) float32 with the canonical NaN. Known gap on XLA:CPU: denormal
    intermediates (differences below 2**-126, squares of differences below 2**-63) are flushed."""
    x = jnp.asarray(x).astype(f32)
    cols = x.shape[-1]
    rows = int(np.prod(x.shape[:-1], dtype=np.int64))
    v = x.reshape(rows, cols)
    n = _c(cols)
    # each statistic computed once: XLA copies a division into every fusion that reads it
    mean = computed_once(div_rn(row_sum(v), n))
    d = v - mean[:, None]
    var = div_rn(row_sum(_mul(d, d)), n)
    rstd = computed_once(div_rn(_c(1.0), sqrt_rn(var + _c(np.float32(eps)))))
    y = _mul(d, rstd[:, None])
    if weight is not None:
        y = _mul(y, jnp.asarray(weight).astype(f32))
    if bias is not None:
        y = y + jnp.asarray(bias).astype(f32)
    return y.reshape(x.shape), _canonical_nan(mean), _canonical_nan(rstd)


@shares_one_zero
def layernorm_quantize(x, weight, bias, eps, scale, fmt: str | Format, transpose: bool = False):
    """(q, q_t, amax, mean, rstd): LayerNorm of x quantized with ``scale`` (uint8 codes of x's
    shape; the (cols, rows) transpose or None), ``amax = max |y|``, the per-row statistics."""
    y, mean, rstd = layernorm_f32(x, weight, bias, eps)
    q = cast_to_fp8(mul(y, jnp.reshape(jnp.asarray(scale, f32), ())), fmt)
    q_t = q.reshape(mean.shape[0], q.shape[-1]).T if transpose else None
    return q, q_t, amax(y), mean, rstd
