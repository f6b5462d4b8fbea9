"""LayerNorm and LayerNorm + quantize in ``jax.numpy``: :mod:`fusedfp8.numerics.layernorm`'s op
order and summation tree, byte for byte, on the guarded arithmetic of
:mod:`fusedfp8.numerics.jnp` (its docstring says why), with an exact square root.
"""
from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

from ..formats import Format
from . import layernorm as _ln
from .jnp import (_INF_BITS, _MAG, _c, _f32_rn, _f64, _hide, _mul, _traced_once, amax, bits, cast_to_fp8, computed_once,
                  div_rn, f32, from_bits, mul, shares_one_zero)

@_traced_once()
def sqrt_rn(v) -> jax.Array:
    """IEEE float32 square root, round to nearest even: the kernels' ``sqrt.rn.f32`` bit for bit,
    denormal arguments included (XLA:CPU reads them as 0, and XLA:GPU may lower a float32 ``sqrt``
    approximately): the float64 root rounded to float32 (:func:`fusedfp8.numerics.jnp.fma_f32`'s
    section says why that is exact). sqrt(+-0) = +-0, sqrt(+inf) = +inf, a negative argument or
    NaN gives NaN."""
    v = jnp.asarray(v, f32)
    ib = bits(v)
    mag = ib & _MAG
    with jax.enable_x64(True):
        out = bits(_f32_rn(jnp.sqrt(_f64(v))))
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
