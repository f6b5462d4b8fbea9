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
