"""Float32 constants of the numerics, written as the same hex literals as ``cuda_src/common.cuh``
(``tests`` compare the two files literal by literal)."""
from __future__ import annotations

import numpy as np

f32 = np.float32


def _hex(h: str) -> np.float32:
    return f32(float.fromhex(h))


FLT_MAX = f32(np.finfo(np.float32).max)

LOG2E = _hex("0x1.715476p+0")
LN2_HI = _hex("0x1.62e4p-1")
LN2_LO = _hex("0x1.7f7d1cp-20")
# exp(r) on [-ln2/2, ln2/2]: Taylor to degree 6 (error 1.2e-7 relative), highest first
EXP_POLY = tuple(_hex(h) for h in ("0x1.6c16c2p-10", "0x1.111112p-7", "0x1.555556p-5", "0x1.555556p-3",
                                    "0x1p-1", "0x1p+0", "0x1p+0"))
SQRT_2_OVER_PI = _hex("0x1.988454p-1")
GELU_C1 = _hex("0x1.6e4e26p-5")
GELU_C3 = _hex("0x1.12ba9ep-3")  # 3 * 0.044715
INV_SQRT2 = _hex("0x1.6a09e6p-1")
INV_SQRT_2PI = _hex("0x1.988454p-2")
ERFC_POLY = tuple(_hex(h) for h in ("0x1.5df28ap-3", "-0x1.a4f124p-1", "0x1.7d0f6p+0", "-0x1.229cbap+0",
                                     "0x1.1d8f98p-2", "-0x1.7d8498p-3", "0x1.8c6d92p-4", "0x1.7f11f6p-2",
                                     "0x1.00018ep+0"))
ERFC_C0 = _hex("0x1.43f89cp+0")
EXP_MIN_ARG = f32(-87.0)  # below: exp flushes to 0 (< 1.7e-38), so 2**k stays a normal float
EXP_SHIFTER = _hex("0x1.8p+23")  # fma(a, LOG2E, 1.5 * 2**23) rounds a log2 e to an integer k in its low bits
TWO_M64 = _hex("0x1p-64")  # exp builds p * 2**(k + 64) from the bits, then scales back once
GELU_K = _hex("-0x1.988454p+0")  # -2 sqrt(2/pi): exp(-2|u|) = exp(K |w|), w = x + 0.044715 x^3
RCP_C0 = _hex("0x1.69696ap+0")  # 24/17: the linear seed of 1 / d on [1, 2] is 24/17 - 8/17 d (within 1/17)
RCP_C1 = _hex("0x1.e1e1e2p-2")  # 8/17
RCP_MAGIC = np.uint32(0x7EF311C7)  # the seed of 1 / d on [1, 16): the float with bits MAGIC - bits(d)
ERFC_MAX_ARG = f32(20.0)  # erfc(|z| >= 20) is 0 in float32 (from about 10 on): |z| is capped there
