"""NumPy / ml_dtypes twins of every kernel: the oracle for the CUDA kernels and the CPU backend.

Everything is computed in float32 with one rounding per operation, in the same order as the
kernels in ``cuda_src/`` (which are compiled without FMA contraction and without flush-to-zero),
so results agree byte for byte. The activation functions use the library's own exp2 / sigmoid /
erfc, built from + - * / only, because ``np.tanh`` and CUDA's ``tanhf`` do not round alike.
"""
from __future__ import annotations

import math
import numpy as np

from ..formats import Format, get_format
from ..types import Quantized, check_approximate

from . import scaling
from .constants import (ERFC_MAX_ARG, ERFC_POLY, ERFC_T_SCALE, EXP2_POLY, EXP_HALF_MAX_ARG, EXP_MIN_ARG, EXP_SHIFTER,
                        GELU_K2, GELU_KC1, GELU_M0, GELU_M3, GELU_X_MAX, INV_SQRT_2PI, LOG2E, LOG2E_LO)
from .xp import NumpyNamespace

f32 = np.float32
_NP = NumpyNamespace()


def fma_f32(a, b, c) -> np.ndarray:
    """Correctly rounded float32 a*b + c (the kernels' fma.rn.f32), emulated exactly.

    a*b is exact in float64; rounding the float64 sum s to float32 is right unless s sits exactly
    halfway between two float32 neighbours while the float64 sum was inexact (the double-rounding
    case): then the sum's exact error e (TwoSum) decides the side. A float32 midpoint has at most
    25 significant bits, so only the elements of s whose 28 low significand bits are zero can be
    such a case: those few go through :func:`_double_rounding_fix`, the rest is ``float32(s)``.
    """
    a64 = np.asarray(a, np.float32).astype(np.float64)
    b64 = np.asarray(b, np.float32).astype(np.float64)
    c64 = np.asarray(c, np.float32).astype(np.float64)
    with np.errstate(all="ignore"):
        p = a64 * b64
        s = np.asarray(p + c64)
        r = s.astype(np.float32)
        maybe = np.flatnonzero((s.view(np.uint64) & np.uint64(0x0FFFFFFF)) == 0)
        if maybe.size:
            flat = r.reshape(-1)  # (a view: writes reach r)
            flat[maybe] = _double_rounding_fix(np.broadcast_to(p, s.shape).flat[maybe],
                                               np.broadcast_to(c64, s.shape).flat[maybe], s.flat[maybe], flat[maybe])
    return r


def _double_rounding_fix(p, c, s, r) -> np.ndarray:
    """float32 p + c correctly rounded, from the float64 sum ``s = p + c`` and ``r = float32(s)``
    (p, c float64 with p + c exact in ~106 bits): the TwoSum error e of s; where s is a float32
    midpoint and e != 0, round-to-nearest-even chose r, and the exact value lies on e's side."""
    bb = s - p
    e = (p - (s - bb)) + (c - bb)
    r64 = r.astype(np.float64)
    toward = np.where(s > r64, np.float32(np.inf), np.float32(-np.inf)).astype(np.float32)
    other = np.nextafter(r, toward)
    mid = (r64 + other.astype(np.float64)) * 0.5
    tie = np.isfinite(s) & np.isfinite(e) & (r64 != s) & (s == mid) & (e != 0)
    go_other = tie & ((e > 0) == (other.astype(np.float64) > r64))
    return np.where(go_other, other, r).astype(np.float32)


def to_float32(x) -> np.ndarray:
    """Input (float32, float16 or ml_dtypes.bfloat16) to float32: exact."""
    x = np.asarray(x)
    if x.dtype.name not in ("float32", "float16", "bfloat16"):
        raise TypeError(f"x must be float32, float16 or bfloat16; got {x.dtype}")
    return x.astype(np.float32)


# ---- quantization ----------------------------------------------------------------------------
def cast_to_fp8(v: np.ndarray, fmt: str | Format) -> np.ndarray:
    """``cvt.rn.satfinite``: RNE, finite overflow and +-inf saturate to +-max, NaN -> canonical
    NaN, subnormals kept. ``v`` is float32; returns an ml_dtypes float8 array."""
    fmt = get_format(fmt)
    v = np.asarray(v, np.float32)
    with np.errstate(invalid="ignore", over="ignore"):
        q = np.asarray(np.clip(v, -fmt.max, fmt.max)).astype(fmt.numpy_dtype).reshape(v.shape)
    bits = q.view(np.uint8).reshape(-1)
    bits[np.isnan(v).reshape(-1)] = fmt.nan_bits
    return q


def amax(x) -> np.float32:
    """max |x| in float32, NaN-propagating (canonical NaN), 0 for an empty array."""
    v = to_float32(x)
    if v.size == 0:
        return f32(0.0)
    m = np.max(np.abs(v))
    return f32(np.nan) if np.isnan(m) else f32(m)


def _scale_value(scale) -> np.float32:
    s = np.asarray(scale)
    if s.size != 1:
        raise ValueError(f"scale must hold exactly one element; got shape {s.shape}")
    return f32(s.reshape(()))


def as_2d(v: np.ndarray, argname: str = "x", need: str = "transpose") -> np.ndarray:
    """``v`` viewed as (prod(shape[:-1]), shape[-1]); ValueError naming ``argname`` and what ``need``s
    the 2-D view for a scalar."""
    if v.ndim == 0:
        raise ValueError(f"{argname}: {need} needs an input of at least 1 dimension; got a scalar")
    return v.reshape(math.prod(v.shape[:-1]), v.shape[-1])  # (-1 is ambiguous when the size is 0)


def finish(v: np.ndarray, amax_v, scale, fmt, transpose: bool, dbias=None) -> Quantized:
    with np.errstate(over="ignore", invalid="ignore"):
        q = cast_to_fp8(v * _scale_value(scale), fmt)
    q_t = np.ascontiguousarray(as_2d(q).T) if transpose else None
    return Quantized(q, amax_v, q_t, dbias)


def pad2d(q: np.ndarray, rows: int, cols: int) -> np.ndarray:
    """The 2-D ``q`` in the top-left corner of a (rows, cols) array of zeros of its dtype (the
    padded FP8 operands of the kernels' ``pad_to``)."""
    out = np.zeros((rows, cols), q.dtype)
    out[:q.shape[0], :q.shape[1]] = q
    return out


def quantize(x, scale, fmt: str | Format = "e4m3", transpose: bool = False, dbias: bool = False) -> Quantized:
    """``q = fp8(float32(x) * scale)``, ``amax = max |x|``; optionally also ``q.T`` (2-D view)
    and the column sums of ``x`` (a gradient's bias gradient, as :func:`dgelu_quantize`'s)."""
    v = to_float32(x)
    return finish(v, amax(v), scale, fmt, transpose, column_sums(v, "x") if dbias else None)


def dequantize(q, scale_inv, dtype=np.float32) -> np.ndarray:
    """``dtype(float32(q) * scale_inv)``; NaN as the dtype's canonical NaN (as the kernel)."""
    with np.errstate(all="ignore"):
        v = np.asarray(q).astype(np.float32) * _scale_value(scale_inv)
    return float32_to(v, dtype)


def float32_to(v: np.ndarray, dtype) -> np.ndarray:
    """The float32 ``v`` in ``dtype`` (round to nearest even); a NaN as the dtype's canonical NaN
    (what the dequantize kernels write)."""
    out = np.asarray(v).astype(dtype).reshape(np.shape(v))
    out.reshape(-1)[np.isnan(v).reshape(-1)] = np.array(np.nan, np.float32).astype(dtype)
    return out


# ---- the library's own float32 exp / sigmoid / erfc (same op sequence as cuda_src) -----------
def _where(c, a, b):
    return np.where(c, a, b).astype(np.float32, copy=False)


def _pow2_poly(f, t) -> np.ndarray:
    """p(f) ~ 2**f for |f| <= 1/2 (the degree-5 polynomial, Horner with FMA), times 2**k by adding
    the low bits of the shifter sum t (k << 23) to its bits: exact while the result is normal."""
    p = EXP2_POLY[0]
    for c in EXP2_POLY[1:]:
        p = fma_f32(p, f, c)
    bits = np.asarray(p, np.float32).view(np.uint32) + (np.asarray(t, np.float32).view(np.uint32) << np.uint32(23))
    return bits.view(np.float32)


def exp2_product(q, x) -> np.ndarray:
    """2**(q x) for q x in [-125, 125] (the product unrounded), branch-free as the kernels:
    t = fma(q, x, 1.5 * 2**23) rounds q x to an integer k (in t's low bits), f = fma(q, x, -k) in
    [-1/2, 1/2], then :func:`_pow2_poly`. Outside that range the bits mean nothing."""
    with np.errstate(all="ignore"):
        t = fma_f32(q, x, EXP_SHIFTER)
        return _pow2_poly(fma_f32(q, x, -np.asarray(t - EXP_SHIFTER, np.float32)), t)


def exp_f32(a: np.ndarray, half: bool = False) -> np.ndarray:
    """e**(s a), s = 1 or -1/2 (``half``; folded exactly into the constants), for s a <= 0 (a few ulp
    above 0 also fine), as 2**(s a log2 e), branch-free: k = round(s a log2 e) from one FMA with the
    shifter, f = s a log2 e - k from two FMAs with log2 e split in two floats (error below 2**-25),
    then :func:`_pow2_poly`; 0 where s a < -87."""
    a = np.asarray(a, np.float32)
    s = f32(-0.5 if half else 1.0)
    with np.errstate(all="ignore"):
        t = fma_f32(a, s * LOG2E, EXP_SHIFTER)
        k = np.asarray(t - EXP_SHIFTER, np.float32)
        y = _pow2_poly(fma_f32(a, s * LOG2E_LO, fma_f32(a, s * LOG2E, -k)), t)
    return _where(a > EXP_HALF_MAX_ARG if half else a < EXP_MIN_ARG, f32(0.0), y)


def rcp_f32(d: np.ndarray) -> np.ndarray:
    """1 / d correctly rounded, for d in [1, 2**126) (the kernels: the hardware reciprocal seed and
    one Newton step, which is rcp.rn.f32's own fast path, correctly rounded on that range)."""
    with np.errstate(all="ignore"):
        return np.asarray(f32(1.0) / np.asarray(d, np.float32), np.float32)


def erfc_of_abs(ax: np.ndarray, e: np.ndarray) -> np.ndarray:
    """erfc(ax / sqrt 2) = t R(t) exp(-x^2 / 2) for ax = |x| <= 40, t = 1 / (1 + ax / (2 sqrt 2)), R the
    degree-8 fit of erfcx / t; ``e`` = exp(-x^2 / 2) from the caller (the erf gelu' shares it)."""
    with np.errstate(all="ignore"):
        t = rcp_f32(fma_f32(ax, ERFC_T_SCALE, f32(1.0)))
        p = ERFC_POLY[0]
        for c in ERFC_POLY[1:]:
            p = fma_f32(p, t, c)
        return np.asarray((t * p) * e, np.float32)


def erfc_neg(x: np.ndarray, e: np.ndarray) -> np.ndarray:
    """erfc(-x / sqrt 2) from e = erfc(|x| / sqrt 2): 2 - e for x >= 0 (sign bit clear), else e."""
    with np.errstate(all="ignore"):
        return _where(np.signbit(x), e, f32(2.0) - e)


def _clamp(x, lim):
    lim = f32(lim)
    return _where(x > lim, lim, _where(x < -lim, -lim, x))


def _sigmoid_parts(xc: np.ndarray, x: np.ndarray):
    """xc^2, E = 2**(q xc) and r = 1 / (1 + E) = 0.5 (1 + tanh u), q = K2 + KC1 xc^2, so that
    q xc = -2 u log2 e for u = sqrt(2/pi) (xc + 0.044715 xc^3). xc is x clamped (by the caller) to at
    most X_MAX = 9.875, where E < 2**-121 and r is 1 (and above -X_MAX where x is not); r is 0 for
    x < -X_MAX (where it is below 2**-121)."""
    with np.errstate(all="ignore"):
        x2 = xc * xc
        e = exp2_product(fma_f32(x2, GELU_KC1, GELU_K2), xc)
        r = _where(x < -GELU_X_MAX, f32(0.0), rcp_f32(f32(1.0) + e))
    return x2, e, r


def _nan_where_nan(x, y):
    """``y`` with the canonical NaN where ``x`` is NaN: the sign and payload of a NaN that went
    through the arithmetic differ between NumPy, XLA and the GPU, and only its NaN-ness reaches an
    output (quantization writes the format's NaN byte, the amax the canonical NaN)."""
    return _where(np.isnan(x), f32(np.nan), y)


def gelu_f32(x: np.ndarray, approximate: str) -> np.ndarray:
    """gelu in float32: 'tanh' (0.5x(1+tanh(sqrt(2/pi)(x+0.044715x^3)))) or 'none' (erf)."""
    x = np.asarray(x, np.float32)
    with np.errstate(all="ignore"):
        if approximate == "tanh":
            _, _, r = _sigmoid_parts(np.fmin(x, GELU_X_MAX), x)  # (fmin: a NaN x gives X_MAX there)
            return _nan_where_nan(x, x * r)
        ax = _where(np.abs(x) > ERFC_MAX_ARG, ERFC_MAX_ARG, np.abs(x))  # (NaN kept)
        e = erfc_of_abs(ax, exp_f32(x * x, half=True))
        return _nan_where_nan(x, (f32(0.5) * x) * erfc_neg(x, e))


def dgelu_f32(x: np.ndarray, approximate: str) -> np.ndarray:
    """d gelu / dx in float32 (x clamped where the function is flat, NaN kept)."""
    x = np.asarray(x, np.float32)
    with np.errstate(all="ignore"):
        if approximate == "tanh":
            # d/dx = r + x (2 E r^2) du/dx = r (1 + (x M) (E r)) with M = 2 du/dx, since
            # 0.5 (1 - tanh^2 u) = 2 E r^2
            xc = _clamp(x, GELU_X_MAX)  # (the float32 result is 1 above, and 0 below by the select)
            x2, e, r = _sigmoid_parts(xc, x)
            g = fma_f32(xc * fma_f32(x2, GELU_M3, GELU_M0), e * r, f32(1.0)) * r
        else:
            xc = _clamp(x, 40.0)
            e = exp_f32(xc * xc, half=True)  # shared by the pdf and erfc
            g = fma_f32(xc, e * INV_SQRT_2PI, f32(0.5) * erfc_neg(xc, erfc_of_abs(np.abs(xc), e)))
    return _nan_where_nan(x, g)


def column_sums(v: np.ndarray, argname: str = "dy") -> np.ndarray:
    """(N,) float32 column sums of v viewed as (M, N), accumulated in float64 (the dbias oracle)."""
    return as_2d(v, argname).astype(np.float64).sum(axis=0).astype(np.float32)


def activation(op: str, x, b=None, approximate: str = "tanh") -> np.ndarray:
    """The float32 value a kernel quantizes: ``x`` ('identity'), ``gelu(x)`` ('gelu') or
    ``x * gelu'(b)`` ('dgelu': x is the incoming gradient dy, b the forward input)."""
    xf = to_float32(x)
    if op == "identity":
        return xf
    with np.errstate(all="ignore"):
        if op == "gelu":
            return gelu_f32(xf, check_approximate(approximate))
        return (xf * dgelu_f32(to_float32(b), check_approximate(approximate))).astype(np.float32)


def gelu_quantize(x, scale, fmt: str | Format = "e4m3", approximate: str = "tanh",
                  transpose: bool = False) -> Quantized:
    """``y = gelu(x)`` in float32, quantized; ``amax = max |y|``."""
    y = gelu_f32(to_float32(x), check_approximate(approximate))
    return finish(y, amax(y), scale, fmt, transpose)


def dgelu_quantize(dy, x, scale, fmt: str | Format = "e5m2", approximate: str = "tanh",
                   transpose: bool = False, dbias: bool = False) -> Quantized:
    """``dx = dy * gelu'(x)`` in float32, quantized; ``amax = max |dx|``; ``dbias`` = column
    sums of the unquantized dx over the (M, N) view (float32)."""
    dyf, xf = to_float32(dy), to_float32(x)
    if dyf.shape != xf.shape:
        raise ValueError(f"dy and x must have the same shape; got {dyf.shape} and {xf.shape}")
    with np.errstate(all="ignore"):
        dx = (dyf * dgelu_f32(xf, check_approximate(approximate))).astype(np.float32)
        db = column_sums(dx) if dbias else None
    return finish(dx, amax(dx), scale, fmt, transpose, db)


# ---- scaling ---------------------------------------------------------------------------------
def current_scale(amax_v, fmt: str | Format, margin_factor: float, fallback) -> np.float32:
    """First-step scale from the tensor's own amax, with the update rule's formula; the
    ``fallback`` scale where amax is 0 (either sign) or non-finite."""
    a = np.asarray(amax_v, np.float32)
    return f32(scaling.current_scale(_NP, a, f32(get_format(fmt).max), f32(margin_factor), f32(fallback)))
