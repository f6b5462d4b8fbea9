"""How close the reference's float32 exp / erfc / gelu / gelu' are to the exact functions (float64,
scipy), on millions of inputs: tight bounds, a little above what the present code reaches, so that
a change to a polynomial, a constant or the op sequence that costs accuracy fails here. (The kernels
are the reference bit for bit: tests/kernels/test_activation_bits.py.)

Measured when these were written (issue 18), with the code they replaced in brackets: exp on
[-87, 0] 2.15 ulp [2.72]; erfc(-x / sqrt 2) as the erf gelu computes it, on [-6, 6] 19.4 ulp [27
on [-4.2, 0]], on [-13, 0] 66 ulp [255] (there the float32 x^2 alone moves exp(-x^2 / 2) by up to
x^2 2**-24 relative); gelu tanh max |error| 5.2e-7 [5.2e-7], 8.1 ulp where |gelu| >= 1e-3 [15.2];
gelu erf 3.8e-7 [3.8e-7], 9.4 ulp [21.9]; gelu' tanh 2.6e-7 [2.1e-7]; gelu' erf 2.1e-7 [2.3e-7]
(gelu' crosses 0 near x = -0.75: an ulp bound means nothing there)."""
import math

import numpy as np
import pytest
from scipy.special import erfc

from fusedfp8.numerics import reference as ref

f32 = np.float32
S = math.sqrt(2 / math.pi)
RNG = np.random.default_rng(2026)
ERFC_ULP_6, ERFC_ULP_13 = 21, 70


def ulps(y, exact) -> np.ndarray:
    """|y - exact| in units of the float32 spacing at exact (the denormal spacing at least)."""
    spacing = np.maximum(np.spacing(np.abs(exact).astype(f32)).astype(np.float64), 2.0 ** -149)
    return np.abs(np.asarray(y, np.float64) - exact) / spacing


def test_exp():
    a = np.concatenate([-RNG.uniform(0, 87, 2_000_000), -RNG.uniform(0, 1, 1_000_000)]).astype(f32)
    assert ulps(ref.exp_f32(a), np.exp(a.astype(np.float64))).max() <= 2.3
    h = RNG.uniform(0, 174, 1_000_000).astype(f32)  # e**(-h/2), gelu' (erf)'s pdf
    assert ulps(ref.exp_f32(h, half=True), np.exp(-0.5 * h.astype(np.float64))).max() <= 2.3
    assert ref.exp_f32(f32(0.0)) == 1 and ref.exp_f32(f32(-87.5)) == 0 and ref.exp_f32(f32(175.0), half=True) == 0


def test_exp2_of_a_product():
    """2**(q x) with the product unrounded: the polynomial's 1.94 ulp and the rounding of f = q x - k
    (2.04 ulp measured)."""
    x = RNG.uniform(-125, 125, 2_000_000).astype(f32)
    q = RNG.uniform(0.5, 1, x.size).astype(f32)  # |q x| <= 125
    exact = np.exp2(q.astype(np.float64) * x)
    assert ulps(ref.exp2_product(q, x), exact).max() <= 2.1
    assert ref.exp2_product(f32(1.0), f32(0.0)) == 1


def erfc_of_x(x):
    """erfc(-x / sqrt 2) (= 2 Phi(x)) as the erf gelu computes it."""
    ax = np.minimum(np.abs(x), f32(40.0))
    return ref.erfc_neg(x, ref.erfc_of_abs(ax, ref.exp_f32(x * x, half=True)))


def test_erfc():
    x = RNG.uniform(-6, 6, 2_000_000).astype(f32)
    assert ulps(erfc_of_x(x), erfc(-x.astype(np.float64) / math.sqrt(2))).max() <= ERFC_ULP_6
    x = -RNG.uniform(0, 13, 2_000_000).astype(f32)  # the tail, down to 1e-37
    assert ulps(erfc_of_x(x), erfc(-x.astype(np.float64) / math.sqrt(2))).max() <= ERFC_ULP_13
    assert erfc_of_x(f32(0.0)) == 1 and erfc_of_x(-f32(0.0)) == 1


def gelu64(x, approximate):
    if approximate == "tanh":
        return 0.5 * x * (1 + np.tanh(S * (x + 0.044715 * x ** 3)))
    return 0.5 * x * erfc(-x / math.sqrt(2))


def dgelu64(x, approximate):
    if approximate == "tanh":
        th = np.tanh(S * (x + 0.044715 * x ** 3))
        return 0.5 * (1 + th) + 0.5 * x * (1 - th ** 2) * S * (1 + 3 * 0.044715 * x ** 2)
    return 0.5 * erfc(-x / math.sqrt(2)) + x * np.exp(-x * x / 2) / math.sqrt(2 * math.pi)


X = np.concatenate([RNG.uniform(-10, 10, 2_000_000), RNG.standard_normal(2_000_000) * 2,
                    np.linspace(-12, 12, 1_000_001)]).astype(f32)


@pytest.mark.parametrize("approximate, max_abs, max_ulp", [("tanh", 5.5e-7, 9), ("none", 4e-7, 10.5)])
def test_gelu(approximate, max_abs, max_ulp):
    exact = gelu64(X.astype(np.float64), approximate)
    g = ref.gelu_f32(X, approximate)
    assert np.abs(g - exact).max() <= max_abs
    assert ulps(g, exact)[np.abs(exact) >= 1e-3].max() <= max_ulp


@pytest.mark.parametrize("approximate, max_abs", [("tanh", 3e-7), ("none", 2.3e-7)])
def test_dgelu(approximate, max_abs):
    exact = dgelu64(X.astype(np.float64), approximate)
    assert np.abs(ref.dgelu_f32(X, approximate) - exact).max() <= max_abs
