"""Float32 constants of the numerics, written as the same hex literals as ``cuda_src/common.cuh``
(``tests`` compare the two files literal by literal). Each is the float32 rounding of the exact
value named beside it (computed in float64; ``tests/numerics/test_constants.py`` recomputes them)."""
from __future__ import annotations

import numpy as np

f32 = np.float32


def _hex(h: str) -> np.float32:
    return f32(float.fromhex(h))


FLT_MAX = f32(np.finfo(np.float32).max)

LOG2E = _hex("0x1.715476p+0")  # 1 / ln 2
LOG2E_LO = _hex("0x1.4ae0c0p-26")  # 1 / ln 2 - LOG2E: a log2 e = a LOG2E + a LOG2E_LO to about 2**-49 |a|
# 2**f on [-1/2, 1/2]: relative minimax of degree 5 with the constant term 1 (so 2**0 = 1 exactly), its
# float32 coefficients tuned for the Horner evaluation with FMA (max error 1.94 ulp), highest first
EXP2_POLY = tuple(_hex(h) for h in ("0x1.5bba0cp-10", "0x1.3cea88p-7", "0x1.c6b74ap-5", "0x1.ebf9c6p-3",
                                     "0x1.62e42ap-1", "0x1p+0"))
EXP_SHIFTER = _hex("0x1.8p+23")  # fma(a, b, 1.5 * 2**23) rounds a b to an integer k in its low bits
EXP_MIN_ARG = f32(-87.0)  # exp(a): 0 below (e**-87 = 2**-125.5 is still a normal float)
EXP_HALF_MAX_ARG = f32(174.0)  # exp(-a / 2): 0 above
# gelu (tanh): 0.5 (1 + tanh u) = 1 / (1 + 2**b), b = -2 u log2 e = x (K2 + KC1 x^2) for u = sqrt(2/pi)
# (x + 0.044715 x^3); d gelu / dx uses M = 2 du/dx = M0 + M3 x^2. x is clamped to +-X_MAX, where
# |b| < 122 (2**b and 1 + 2**b are normal floats, and so is the reciprocal)
GELU_X_MAX = _hex("0x1.3cp+3")  # 9.875
GELU_K2 = _hex("-0x1.26aec2p+1")  # -2 sqrt(2/pi) / ln 2
GELU_KC1 = _hex("-0x1.a5a7d0p-4")  # -2 sqrt(2/pi) 0.044715 / ln 2
GELU_M0 = _hex("0x1.988454p+0")  # 2 sqrt(2/pi)
GELU_M3 = _hex("0x1.b6676cp-3")  # 2 sqrt(2/pi) 3 0.044715
INV_SQRT2 = _hex("0x1.6a09e6p-1")
INV_SQRT_2PI = _hex("0x1.988454p-2")
# erfc(a) = t exp(-a^2 + Q(t)), t = 1 / (1 + a/2), Q(t) = t P(t) - 1.26551223 (Numerical Recipes'
# Chebyshev fit, P of degree 8): the coefficients of P, then the constant, highest first
ERFC_POLY = tuple(_hex(h) for h in ("0x1.5df28ap-3", "-0x1.a4f124p-1", "0x1.7d0f6p+0", "-0x1.229cbap+0",
                                     "0x1.1d8f98p-2", "-0x1.7d8498p-3", "0x1.8c6d92p-4", "0x1.7f11f6p-2",
                                     "0x1.00018ep+0", "-0x1.43f89cp+0"))
ERFC_MAX_ARG = f32(20.0)  # erfc(|z| >= 20) is 0 in float32 (from about 10 on): |z| is capped there
