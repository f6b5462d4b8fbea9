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
INV_SQRT_2PI = _hex("0x1.988454p-2")
# erfc(|x| / sqrt 2) = t R(t) exp(-x^2 / 2), t = 1 / (1 + |x| T_SCALE): R of degree 8, a relative minimax fit
# of erfcx(a) / t (a = |x| / sqrt 2 = 2 (1 - t) / t) on t in [0.16, 1] (4.3e-8), its float32 coefficients
# tuned so that the Horner evaluation gives R(1) = 1 exactly, highest first
ERFC_POLY = tuple(_hex(h) for h in ("-0x1.e4e962p-5", "0x1.240704p-2", "-0x1.f42f34p-2", "0x1.1e38aep-2",
                                     "-0x1.c4968ap-6", "0x1.9ff82cp-3", "0x1.f1a830p-3", "0x1.212adcp-2",
                                     "0x1.20db0ap-2"))
ERFC_T_SCALE = _hex("0x1.6a09e6p-2")  # 1 / (2 sqrt 2)
ERFC_MAX_ARG = f32(40.0)  # |x| is capped there (exp(-x^2 / 2) is 0 in float32 from 18.7 on)
