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
