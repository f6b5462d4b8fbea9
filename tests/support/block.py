"""Block scaling's test inputs and the byte-for-byte comparison of two block quantizations (any
framework's arrays against fusedfp8.numerics.block's result)."""
from __future__ import annotations

import numpy as np

import fusedfp8
from fusedfp8.numerics import block as B
from support.frameworks import np_dtype, to_np

SHAPES = {"aligned-256x384": (256, 384), "ragged-300x260": (300, 260), "ragged-1x1": (1, 1),
          "ragged-129x127": (129, 127), "ragged-7x1000": (7, 1000), "ragged-1000x7": (1000, 7),
          "ragged-3x5x130": (3, 5, 130)}


RECIPE = fusedfp8.BlockScaling()  # 1x128 activations, 128x128 weights, E4M3, power-of-two scales
HYBRID_EXACT = fusedfp8.BlockScaling(weight_block=(1, 128), fp8_format="hybrid", power_of_two_scales=False)
# the calls of the entry points (fusedfp8.block_quantize, its jax and torch faces), by id:
# (shape, dtype, recipe, weight, grad, transpose, pad_to); ragged shapes (a last block shorter than 128
# along either axis), a 3-D input, one element, an empty one; every recipe field and tensor role
CALLS = {
    "300x260-bf16-act-t": ((300, 260), "bfloat16", RECIPE, False, False, True, 1),
    "300x260-f32-weight-t": ((300, 260), "float32", RECIPE, True, False, True, 1),
    "129x127-f16-weight-t-pad16": ((129, 127), "float16", RECIPE, True, False, True, 16),
    "3x5x130-bf16-grad-hybrid-t-pad16": ((3, 5, 130), "bfloat16", HYBRID_EXACT, False, True, True, 16),
    "1x1-f32-weight-1x128-hybrid": ((1, 1), "float32", HYBRID_EXACT, True, False, True, 1),
    "1000x7-f32-grad-e4m3": ((1000, 7), "float32", RECIPE, False, True, False, 1),
    "0x130-bf16-t-pad16": ((0, 130), "bfloat16", RECIPE, False, False, True, 16),
}


def expected(x: np.ndarray, recipe, weight: bool, grad: bool, transpose: bool, pad_to: int):
    """The NumPy definition with the block and format the recipe gives the tensor."""
    return B.block_quantize(x, recipe.format_for(grad), recipe.block_for(weight), recipe.power_of_two_scales,
                            transpose, pad_to)


def inputs(shape, dtype: str, seed: int, special=None) -> np.ndarray:
    """Rows (and blocks of rows) at their own magnitudes, so that a scale from the wrong block shows."""
    g = np.random.default_rng(seed)
    rows = int(np.prod(shape[:-1])) if len(shape) > 1 else 1
    x = g.standard_normal((rows, shape[-1])) * np.exp2(g.integers(-12, 12, (rows, 1))) * np.exp2(
        g.integers(-3, 3, (rows, shape[-1])))
    if dtype == "float16":
        x = np.clip(x * 2.0 ** -4, -6e4, 6e4)
    x = x.astype(np.float32)
    if special is not None:
        special(x)
    return x.reshape(shape).astype(np_dtype(dtype))


def specials(x: np.ndarray) -> None:
    """Blocks of zeros, NaN, inf, denormals and tiny maxima in a (384, 512) input (as 2-D)."""
    x[0:128, 0:128] = -0.0  # a block of zeros of either shape
    x[130, 5] = np.nan  # a NaN and an inf in other blocks
    x[260, 140] = -np.inf
    x[131:141, 256:384] = 1e-40  # rows of 128 float32 denormals (bf16 keeps them, float16 flushes them to 0)
    x[256:384, 384:512] = 1e-40  # ... and a whole tile, with a tiny max: fmt_max / 3e-38 is inf in float32
    x[140, 300] = x[300, 450] = 3e-38


def _bits(a, itemsize: int) -> np.ndarray:
    a = np.ascontiguousarray(to_np(a))
    return a.view({1: np.uint8, 4: np.uint32}[itemsize])


def assert_same(got, want, transpose: bool) -> None:
    """``got`` (a BlockQuantized of any framework's arrays; data as float8 or uint8 codes, amax a
    scalar or one element) holds ``want``'s bytes (a fusedfp8.numerics.block result): data and
    scales bit for bit, with their shapes, the amax as bits (NaN: any NaN)."""
    fields = ("data", "scale_inv") + (("data_t", "scale_inv_t") if transpose else ())
    for field in fields:
        size = 1 if field.startswith("data") else 4
        g, w = _bits(getattr(got, field), size), _bits(getattr(want, field), size)
        assert g.shape == w.shape, (field, g.shape, w.shape)
        bad = np.argwhere(g != w)
        assert bad.size == 0, f"{field}: {len(bad)} differ, first at {tuple(bad[0])}: got {g[tuple(bad[0])]:#x}, " \
                              f"want {w[tuple(bad[0])]:#x}"
    if not transpose:
        assert got.data_t is None and got.scale_inv_t is None
    amax = np.asarray(to_np(got.amax), np.float32).reshape(-1)
    assert amax.size == 1, amax.shape
    want_amax = np.float32(want.amax)
    assert (np.isnan(amax[0]) and np.isnan(want_amax)) or amax.view(np.uint32)[0] == want_amax.view(np.uint32), \
        (amax[0], want_amax)
