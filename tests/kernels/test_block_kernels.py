"""cuda_src/block_quantize.cu byte for byte against its NumPy definition (fusedfp8/numerics/block.py):
q, q_t and both scale arrays in cuBLASLt's layout (pad entries included), and the tensor's amax, for
every input dtype x format x block shape x power-of-two flag, aligned, ragged and padded shapes,
misaligned pointers (the element-load and byte-store paths), grids from one block to one per tile,
and blocks of zeros, NaN, inf, denormals and tiny maxima. GPU only: the kernels are launched here
directly (one RawModule of the family's source, the library's compile options), as the grids and
slots that the launch plan does not vary; tests/api/test_block_quantize.py and
tests/jax/test_jax_block.py run them through the plan (fusedfp8.block_quantize, the JAX kernel paths)."""
from __future__ import annotations

import numpy as np
import pytest

from fusedfp8.launch import kernels as K
from fusedfp8.numerics import block as B
from fusedfp8.numerics.reference import as_2d
from support.block import SHAPES, inputs, specials

pytestmark = pytest.mark.gpu

CPP = K.CPP_TYPES
FMT = K.FMT_IDS
SENTINEL = 0xA5  # every output byte starts as this (every scale as NaN): what the kernel skips shows
NULL = np.uint64(0)


@pytest.fixture(scope="module")
def kernels():
    import cupy

    ok, reason = K.probe()
    if not ok:
        pytest.skip(reason)
    names = {(d, f, sq): f"block_quantize<{CPP[d]}, {FMT[f]}, {str(sq).lower()}>" for d in CPP for f in FMT
             for sq in (False, True)}
    mod = cupy.RawModule(code=K.family_source("block_quantize"), options=K.compile_options(),
                         name_expressions=list(names.values()))
    return {k: mod.get_function(n) for k, n in names.items()}


def launch(kernels, x: np.ndarray, fmt: str, block, pow2: bool, transpose: bool, pad_to: int = 1, grid=None,
           misalign: bool = False, slot: float = 0.0):
    """One launch; every output as numpy (q and q_t as uint8, the scales, the amax slot)."""
    import cupy

    x2 = as_2d(x)
    rows, cols = x2.shape
    prows, pcols = -(-rows // pad_to) * pad_to, -(-cols // pad_to) * pad_to
    square = block[0] != 1
    raw = x2.view(np.uint16) if x2.dtype.itemsize == 2 else x2.view(np.uint32)
    off = 1 if misalign else 0  # one element (or byte) past an aligned allocation
    xbuf = cupy.zeros(raw.size + off, raw.dtype)
    xbuf[off:] = cupy.asarray(raw.reshape(-1))
    qbuf = cupy.full(prows * pcols + off, SENTINEL, cupy.uint8)
    tbuf = cupy.full(prows * pcols + off, SENTINEL, cupy.uint8)
    s_shape, t_shape = B.scale_shape(prows, pcols, block), B.scale_shape(pcols, prows, block)
    s = cupy.full(s_shape, np.nan, cupy.float32)
    st = cupy.full(t_shape, np.nan, cupy.float32)
    amax = cupy.full(1, slot, cupy.float32)
    ntiles = -(-prows // 128) * -(-pcols // 128)
    kernels[(x.dtype.name, fmt, square)](
        (grid or min(ntiles, 264),), (256,),
        (xbuf[off:], qbuf[off:], s, tbuf[off:] if transpose else NULL, st if transpose else NULL, amax, np.int64(rows),
         np.int64(cols), np.int64(prows), np.int64(pcols), np.int32(pow2)))
    got = {"data": cupy.asnumpy(qbuf[off:]).reshape(prows, pcols), "scale_inv": cupy.asnumpy(s),
           "amax": cupy.asnumpy(amax)[0]}
    if transpose:
        got["data_t"] = cupy.asnumpy(tbuf[off:]).reshape(pcols, prows)
        got["scale_inv_t"] = cupy.asnumpy(st)
    return got


def check(got: dict, x: np.ndarray, fmt: str, block, pow2: bool, transpose: bool, pad_to: int = 1, slot=0.0):
    want = B.block_quantize(x, fmt, block, pow2, transpose, pad_to)
    for field in ("data", "scale_inv") + (("data_t", "scale_inv_t") if transpose else ()):
        w = getattr(want, field)
        w = w.reshape(got[field].shape).view(np.uint8 if field.startswith("data") else np.uint32)
        g = got[field].view(w.dtype)
        bad = np.argwhere(g != w)
        assert bad.size == 0, f"{field}: {len(bad)} differ, first at {tuple(bad[0])}: got {g[tuple(bad[0])]:#x}, " \
                              f"want {w[tuple(bad[0])]:#x}"
    # the slot max-accumulates as bits (a NaN, canonical, above everything; a held -0 counts as 0)
    held = np.asarray(slot, np.float32).view(np.uint32)
    held = 0 if held == 0x80000000 else int(held)
    mine = 0x7FC00000 if np.isnan(want.amax) else int(np.asarray(want.amax, np.float32).view(np.uint32))
    assert int(np.asarray(got["amax"], np.float32).view(np.uint32)) == max(held, mine), (got["amax"], want.amax, slot)


@pytest.mark.parametrize("dtype", list(CPP))
@pytest.mark.parametrize("fmt", list(FMT))
@pytest.mark.parametrize("block", [(1, 128), (128, 128)], ids=["1x128", "128x128"])
@pytest.mark.parametrize("pow2", [False, True], ids=["exact", "pow2"])
@pytest.mark.parametrize("shape", list(SHAPES.values()), ids=list(SHAPES))
def test_block_quantize_is_the_reference(kernels, dtype, fmt, block, pow2, shape):
    x = inputs(shape, dtype, sum(shape))
    for transpose in (False, True):
        check(launch(kernels, x, fmt, block, pow2, transpose), x, fmt, block, pow2, transpose)


@pytest.mark.parametrize("block", [(1, 128), (128, 128)], ids=["1x128", "128x128"])
@pytest.mark.parametrize("shape", [(2048, 4096), (3000, 4100)], ids=["2048x4096", "3000x4100"])
def test_large_shapes_and_every_grid(kernels, block, shape):
    """More tiles than blocks (grid-stride), one block for every tile, a single block."""
    x = inputs(shape, "bfloat16", 3)
    ntiles = -(-shape[0] // 128) * -(-shape[1] // 128)
    for grid in (None, ntiles, 1):
        check(launch(kernels, x, "e4m3", block, True, True, grid=grid), x, "e4m3", block, True, True)


@pytest.mark.parametrize("dtype", list(CPP))
@pytest.mark.parametrize("block", [(1, 128), (128, 128)], ids=["1x128", "128x128"])
@pytest.mark.parametrize("shape", [(300, 250), (129, 17), (16, 16)], ids=["300x250", "129x17", "16x16"])
def test_padding_and_misaligned_pointers(kernels, dtype, block, shape):
    """pad_to 16 (zeros outside, the scales of the zero-padded input) and pointers one element / byte
    off 16-byte alignment (element loads, byte stores), with and without the transpose."""
    x = inputs(shape, dtype, 5)
    for pad_to in (1, 16):
        for misalign in (False, True):
            for transpose in (False, True):
                got = launch(kernels, x, "e4m3", block, False, transpose, pad_to, misalign=misalign)
                check(got, x, "e4m3", block, False, transpose, pad_to)


@pytest.mark.parametrize("dtype", list(CPP))
@pytest.mark.parametrize("fmt", list(FMT))
@pytest.mark.parametrize("block", [(1, 128), (128, 128)], ids=["1x128", "128x128"])
@pytest.mark.parametrize("pow2", [False, True], ids=["exact", "pow2"])
def test_zero_nan_inf_and_tiny_blocks(kernels, dtype, fmt, block, pow2):
    x = inputs((384, 512), dtype, 7, specials)
    for transpose in (False, True):
        check(launch(kernels, x, fmt, block, pow2, transpose), x, fmt, block, pow2, transpose)
    y = inputs((384, 512), dtype, 7)
    for slot in (0.0, -0.0, 1e30, np.nan):  # the amax slot max-accumulates (a held -0 counts as 0)
        check(launch(kernels, y, fmt, block, pow2, False, slot=slot), y, fmt, block, pow2, False, slot=slot)
