"""exp, erfc, gelu and dgelu in ``jax.numpy``: the reference's op sequence
(:mod:`fusedfp8.numerics.reference`), byte for byte, on the guarded arithmetic of
:mod:`fusedfp8.numerics.jnp` (products hidden from FMA contraction, exact fused multiply-adds
and divisions; its docstring says why).
"""
from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

from . import constants as C
from .jnp import _c, _hide, _mul, _traced_once, bits, div_rn, f32, fma_f32, from_bits

def _pow2_poly(f, t) -> jax.Array:
    """As :func:`fusedfp8.numerics.reference._pow2_poly`: the polynomial of 2**f, times 2**k from the bits."""
    p = _c(C.EXP2_POLY[0])
    for coef in C.EXP2_POLY[1:]:
        p = fma_f32(p, f, _c(coef), denormals=False)
    return from_bits(bits(p) + lax.shift_left(bits(t), jnp.int32(23)))


def exp2_product(q, x) -> jax.Array:
    """2**(q x), as :func:`fusedfp8.numerics.reference.exp2_product`."""
    t = fma_f32(q, x, _c(C.EXP_SHIFTER), denormals=False)
    return _pow2_poly(fma_f32(q, x, -_hide(t - _c(C.EXP_SHIFTER))), t)


@_traced_once("half")
def exp_f32(a, half: bool = False) -> jax.Array:
    """e**(s a), s = 1 or -1/2, as :func:`fusedfp8.numerics.reference.exp_f32` (branch-free, shifter
    rounding, log2 e in two parts, the scaling by 2**k from the bits)."""
    a = jnp.asarray(a, f32)
    s = np.float32(-0.5 if half else 1.0)
    t = fma_f32(a, _c(s * C.LOG2E), _c(C.EXP_SHIFTER), denormals=False)
    k = _hide(t - _c(C.EXP_SHIFTER))
    y = _pow2_poly(fma_f32(a, _c(s * C.LOG2E_LO), fma_f32(a, _c(s * C.LOG2E), -k)), t)
    return jnp.where(a > _c(C.EXP_HALF_MAX_ARG) if half else a < _c(C.EXP_MIN_ARG), _c(0.0), y)


def rcp_f32(d) -> jax.Array:
    """1 / d correctly rounded, as :func:`fusedfp8.numerics.reference.rcp_f32`."""
    d = jnp.asarray(d, f32)
    return div_rn(_c(1.0), d)


def erfc_of_abs(ax, e) -> jax.Array:
    """erfc(ax / sqrt 2), as :func:`fusedfp8.numerics.reference.erfc_of_abs`."""
    t = rcp_f32(fma_f32(ax, _c(C.ERFC_T_SCALE), _c(1.0), denormals=False))
    p = _c(C.ERFC_POLY[0])
    for coef in C.ERFC_POLY[1:]:
        p = fma_f32(p, t, _c(coef), denormals=False)
    return _mul(_mul(t, p), e)


def erfc_neg(x, e) -> jax.Array:
    return jnp.where(jnp.signbit(x), e, _c(2.0) - e)


def _clamp(x, lim):
    lim = _c(lim)
    return jnp.where(x > lim, lim, jnp.where(x < -lim, -lim, x))


def _sigmoid_parts(xc, x):
    x2 = _mul(xc, xc)
    e = exp2_product(fma_f32(x2, _c(C.GELU_KC1), _c(C.GELU_K2), denormals=False), xc)
    r = jnp.where(x < -_c(C.GELU_X_MAX), _c(0.0), rcp_f32(_c(1.0) + e))
    return x2, e, r


def _nan_where_nan(x, y):
    return jnp.where(jnp.isnan(x), _c(np.nan), y)  # (see reference._nan_where_nan)


@_traced_once("approximate")
def gelu_f32(x, approximate: str) -> jax.Array:
    """gelu in float32 ('tanh' or 'none'), as :func:`fusedfp8.numerics.reference.gelu_f32`."""
    x = jnp.asarray(x, f32)
    if approximate == "tanh":
        _, _, r = _sigmoid_parts(jnp.fmin(x, _c(C.GELU_X_MAX)), x)
        return _nan_where_nan(x, _mul(x, r))
    ax = jnp.where(jnp.abs(x) > _c(C.ERFC_MAX_ARG), _c(C.ERFC_MAX_ARG), jnp.abs(x))
    e = erfc_of_abs(ax, exp_f32(_mul(x, x), half=True))
    return _nan_where_nan(x, _mul(_mul(_c(0.5), x), erfc_neg(x, e)))


@_traced_once("approximate")
def dgelu_f32(x, approximate: str) -> jax.Array:
    """d gelu / dx in float32, as :func:`fusedfp8.numerics.reference.dgelu_f32`."""
    x = jnp.asarray(x, f32)
    if approximate == "tanh":
        xc = _clamp(x, C.GELU_X_MAX)
        x2, e, r = _sigmoid_parts(xc, x)
        m = fma_f32(x2, _c(C.GELU_M3), _c(C.GELU_M0), denormals=False)
        return _nan_where_nan(x, _mul(fma_f32(_mul(xc, m), _mul(e, r), _c(1.0), denormals=False), r))
    xc = _clamp(x, 40.0)
    e = exp_f32(_mul(xc, xc), half=True)
    half_cdf = _mul(_c(0.5), erfc_neg(xc, erfc_of_abs(jnp.abs(xc), e)))
    return _nan_where_nan(x, fma_f32(xc, _mul(e, _c(C.INV_SQRT_2PI)), half_cdf))
