"""Block scaling's test inputs and the byte-for-byte comparison of two block quantizations (any
framework's arrays against fusedfp8.numerics.block's result)."""
from __future__ import annotations

import numpy as np

from support.frameworks import np_dtype, to_np

SHAPES = {"aligned-256x384": (256, 384), "ragged-300x260": (300, 260), "ragged-1x1": (1, 1),
          "ragged-129x127": (129, 127), "ragged-7x1000": (7, 1000), "ragged-1000x7": (1000, 7),
          "ragged-3x5x130": (3, 5, 130)}


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
