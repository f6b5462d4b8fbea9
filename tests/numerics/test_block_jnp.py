"""Block scaling's jax.numpy twin (fusedfp8/numerics/block_jnp.py) against its NumPy definition
(fusedfp8/numerics/block.py), byte for byte: the codes, both scale arrays in the layout (pad
entries included) and the tensor's amax, on ragged shapes (a last block shorter than 128 along
either axis), padded shapes, every input dtype, both formats and block shapes, with and without
power-of-two scales, and blocks of zeros, NaN, inf, denormals and tiny maxima (which XLA:CPU's
flushing and its non-IEEE division would get wrong without the twin's care). Each case compiles
one XLA program (about a second here), so the cases are a spread, not the full product;
tests/numerics/test_block_reference.py holds the definition itself to its own oracles."""
from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from fusedfp8.numerics import block as B
from fusedfp8.numerics import block_jnp as BJ
from support.block import assert_same, inputs, specials
from support.frameworks import np_dtype

# (shape, dtype, fmt, block, pow2, transpose, pad_to)
CASES = {
    "ragged-300x260-bf16-1x128-t": ((300, 260), "bfloat16", "e4m3", (1, 128), True, True, 1),
    "ragged-300x260-f32-128x128-t": ((300, 260), "float32", "e5m2", (128, 128), False, True, 1),
    "ragged-129x127-f16-1x128-pad16": ((129, 127), "float16", "e5m2", (1, 128), False, True, 16),
    "ragged-129x127-bf16-128x128-pad16": ((129, 127), "bfloat16", "e4m3", (128, 128), True, True, 16),
    "ragged-3x5x130-f32-1x128": ((3, 5, 130), "float32", "e4m3", (1, 128), False, False, 1),
    "ragged-1000x7-bf16-128x128-t": ((1000, 7), "bfloat16", "e5m2", (128, 128), True, True, 1),
    "ragged-1x1-f32-1x128-t": ((1, 1), "float32", "e4m3", (1, 128), True, True, 1),
    "1d-200-f16-128x128": ((200,), "float16", "e4m3", (128, 128), False, False, 1),
    "empty-0x130-bf16-1x128-t-pad16": ((0, 130), "bfloat16", "e4m3", (1, 128), True, True, 16),
}


@pytest.mark.parametrize("case", list(CASES.values()), ids=list(CASES))
def test_the_twin_is_the_numpy_definition(case):
    shape, dtype, fmt, block, pow2, transpose, pad_to = case
    x = inputs(shape, dtype, sum(shape) + 2)
    got = BJ.block_quantize(jnp.asarray(x), fmt, block, pow2, transpose, pad_to)
    want = B.block_quantize(x, fmt, block, pow2, transpose, pad_to)
    assert_same(got, want, transpose)
    assert got.data.dtype == jnp.uint8 and got.amax.shape == ()


@pytest.mark.parametrize("dtype, fmt, pow2", [("float32", "e4m3", False), ("bfloat16", "e5m2", True),
                                              ("float16", "e4m3", True)])
@pytest.mark.parametrize("block", [(1, 128), (128, 128)], ids=["1x128", "128x128"])
def test_zero_nan_inf_denormal_and_tiny_blocks(dtype, fmt, pow2, block):
    """A block of -0, a NaN and an inf (scale 1, the NaN byte, saturation), float32 and bf16
    denormals (an exact amax and product where XLA:CPU flushes), and blocks whose max is so tiny
    that fmt_max / amax is inf (FLT_MAX, or 2**127 with pow2)."""
    x = inputs((384, 512), dtype, 7, specials)
    got = BJ.block_quantize(jnp.asarray(x), fmt, block, pow2, True)
    assert_same(got, B.block_quantize(x, fmt, block, pow2, True), True)
    assert np.isnan(got.amax)


def test_traced_inside_jit_the_same_bytes():
    x = inputs((130, 300), "bfloat16", 11)

    @jax.jit
    def f(v):
        return BJ.block_quantize(v * 1, "e4m3", (1, 128), True, True)

    assert_same(f(jnp.asarray(x)), B.block_quantize(x, "e4m3", (1, 128), True, True), True)


def test_bad_arguments_are_refused_by_name():
    with pytest.raises(ValueError, match=r"^block must be \(1, 128\) or \(128, 128\); got \(1, 64\)$"):
        BJ.block_quantize(jnp.ones((2, 2)), "e4m3", (1, 64))
    with pytest.raises(ValueError, match=r"^x: block scaling needs an input of at least 1 dimension; got a scalar$"):
        BJ.block_quantize(jnp.float32(1.0))
    with pytest.raises(ValueError, match=r"^pad_to must be a positive int"):
        BJ.block_quantize(jnp.ones((2, 2)), pad_to=0)


def _ln_inputs(shape, dtype, seed):
    """LayerNorm inputs whose rows differ in offset and spread, with a NaN row, an inf and a constant row."""
    g = np.random.default_rng(seed)
    x = (g.standard_normal(shape) * np.exp2(g.integers(-6, 6, (shape[0], 1))) + g.standard_normal((shape[0], 1)) * 4)
    x[1, 3], x[2, 7], x[3] = np.nan, -np.inf, 2.5
    return x.astype(np.float32).astype(np_dtype(dtype))


def test_block_layernorm_twin_is_the_numpy_definition():
    """LayerNorm fused with 1x128 block quantization: the twin's codes, scales (q's and q_t's),
    amax, mean and rstd against the definition, bit for bit. One program for two cases: a ragged
    bf16 input with bf16 parameters (one warp a row), power-of-two scales, and a float32 input
    wider than 32 x 4 chunks (two warps a row) without a weight, padded to 16."""
    x1, x2 = _ln_inputs((300, 260), "bfloat16", 1), _ln_inputs((129, 1030), "float32", 2)
    w1 = (np.linspace(0.5, 2, 260)).astype(np_dtype("bfloat16"))
    b1 = (np.linspace(-1, 1, 260)).astype(np_dtype("bfloat16"))
    b2 = np.linspace(-0.25, 0.5, 1030).astype(np.float32)
    cases = ((x1, w1, b1, 1e-5, "e4m3", True, True, 1), (x2, None, b2, 1e-3, "e5m2", False, True, 16))

    @jax.jit
    def both(x1, w1, b1, x2, b2):
        return (BJ.block_layernorm_quantize(x1, w1, b1, 1e-5, "e4m3", True, True, 1),
                BJ.block_layernorm_quantize(x2, None, b2, 1e-3, "e5m2", False, True, 16))

    for got, (x, w, b, eps, fmt, pow2, t, pad) in zip(both(x1, w1, b1, x2, b2), cases):
        want = B.block_layernorm_quantize(x, w, b, eps, fmt, pow2, t, pad)
        assert_same(got[0], want[0], True)
        for g, w_ in zip(got[1:], want[1:]):  # mean, rstd (the canonical NaN in the NaN row)
            np.testing.assert_array_equal(np.asarray(g).view(np.uint32), w_.view(np.uint32))
        assert np.isnan(got[0].amax)
