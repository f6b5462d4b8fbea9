"""cuda_src/block_quantize.cu byte for byte against its NumPy definition (fusedfp8/numerics/block.py):
q, q_t and both scale arrays in cuBLASLt's layout (pad entries included), and the tensor's amax, for
every input dtype x format x block shape x power-of-two flag, aligned, ragged and padded shapes,
misaligned pointers (the element-load and byte-store paths), grids from one block to one per tile,
and blocks of zeros, NaN, inf, denormals and tiny maxima; the fused ops (gelu, dgelu with its second
input, misaligned too) byte for byte, and dbias the same bits on every grid. GPU only: the kernels are launched here
directly (one RawModule of the family's source, the library's compile options), as the grids and
slots that the launch plan does not vary; tests/api/test_block_quantize.py and
tests/jax/test_jax_block.py run them through the plan (fusedfp8.block_quantize, the JAX kernel paths)."""
from __future__ import annotations

import numpy as np
import pytest

from fusedfp8.launch import kernels as K
from fusedfp8.numerics import block as B
from fusedfp8.numerics.reference import activation, as_2d
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


OP_IDS = {"gelu_tanh": 1, "gelu_erf": 2, "dgelu_tanh": 3, "dgelu_erf": 4}
_op_modules: dict = {}


def op_kernel(dtype: str, fmt: str, op: str, dbias: bool):
    """block_quantize<T, FMT, false, OP, HAS_DBIAS> (1x128; the identity with dbias as "identity"),
    one module per input dtype, compiled on first use."""
    import cupy

    ok, reason = K.probe()
    if not ok:
        pytest.skip(reason)

    def name(f, o, db):
        return f"block_quantize<{CPP[dtype]}, {FMT[f]}, false, {o}, {str(db).lower()}>"

    if dtype not in _op_modules:
        names = [name(f, o, o >= 3) for f in FMT for o in OP_IDS.values()] + [name(f, 0, True) for f in FMT]
        _op_modules[dtype] = cupy.RawModule(code=K.family_source("block_quantize"), options=K.compile_options(),
                                            name_expressions=names)
    o = OP_IDS.get(op, 0)
    return _op_modules[dtype].get_function(name(fmt, o, o >= 3 or dbias))


def launch(kernels, x: np.ndarray, fmt: str, block, pow2: bool, transpose: bool, pad_to: int = 1, grid=None,
           misalign: bool = False, slot: float = 0.0, op: str = "identity", b=None, dbias: bool = False):
    """One launch; every output as numpy (q and q_t as uint8, the scales, the amax slot, dbias).
    ``op``: a kernel op name ('gelu_tanh', ..., with ``b`` for the dgelu ones)."""
    import cupy

    def dev(a):  # a 2-D input as raw bits on the device, ``off`` elements past an aligned allocation
        a2 = as_2d(a)
        r = a2.view(np.uint16) if a2.dtype.itemsize == 2 else a2.view(np.uint32)
        buf = cupy.zeros(r.size + off, r.dtype)
        buf[off:] = cupy.asarray(r.reshape(-1))
        return buf[off:]

    x2 = as_2d(x)
    rows, cols = x2.shape
    prows, pcols = -(-rows // pad_to) * pad_to, -(-cols // pad_to) * pad_to
    square = block[0] != 1
    off = 1 if misalign else 0  # one element (or byte) past an aligned allocation
    xbuf = dev(x)
    bbuf = dev(b) if b is not None else NULL
    qbuf = cupy.full(prows * pcols + off, SENTINEL, cupy.uint8)
    tbuf = cupy.full(prows * pcols + off, SENTINEL, cupy.uint8)
    s_shape, t_shape = B.scale_shape(prows, pcols, block), B.scale_shape(pcols, prows, block)
    s = cupy.full(s_shape, np.nan, cupy.float32)
    st = cupy.full(t_shape, np.nan, cupy.float32)
    amax = cupy.full(1, slot, cupy.float32)
    ntiles = -(-prows // 128) * -(-pcols // 128)
    db = cupy.full(cols, np.nan, cupy.float32)
    partial = cupy.full((-(-prows // 128), cols), np.nan, cupy.float32)
    counters = cupy.zeros(-(-pcols // 128), cupy.int32)
    fn = kernels[(x.dtype.name, fmt, square)] if op == "identity" and not dbias else op_kernel(x.dtype.name, fmt, op,
                                                                                                 dbias)
    fn((grid or min(ntiles, 264),), (256,),
       (xbuf, bbuf, qbuf[off:], s, tbuf[off:] if transpose else NULL, st if transpose else NULL, amax,
        db if dbias else NULL, partial if dbias else NULL, counters if dbias else NULL, NULL, NULL, NULL, NULL,
        np.int64(rows), np.int64(cols), np.int64(prows), np.int64(pcols), np.int32(pow2)))
    got = {"data": cupy.asnumpy(qbuf[off:]).reshape(prows, pcols), "scale_inv": cupy.asnumpy(s),
           "amax": cupy.asnumpy(amax)[0]}
    if dbias:
        got["dbias"] = cupy.asnumpy(db)
        assert not cupy.asnumpy(counters).any()  # (left zeroed for the next call)
    if transpose:
        got["data_t"] = cupy.asnumpy(tbuf[off:]).reshape(pcols, prows)
        got["scale_inv_t"] = cupy.asnumpy(st)
    return got


def check(got: dict, x: np.ndarray, fmt: str, block, pow2: bool, transpose: bool, pad_to: int = 1, slot=0.0,
          op: str = "identity", b=None, approximate: str = "tanh"):
    want = B.block_quantize(x, fmt, block, pow2, transpose, pad_to, op, b, approximate)
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


OPS = [("gelu_tanh", "gelu", "tanh"), ("gelu_erf", "gelu", "none"), ("dgelu_tanh", "dgelu", "tanh"),
       ("dgelu_erf", "dgelu", "none")]


@pytest.mark.parametrize("dtype", list(CPP))
@pytest.mark.parametrize("fmt", list(FMT))
@pytest.mark.parametrize("op, ref_op, approximate", OPS, ids=[o[0] for o in OPS])
@pytest.mark.parametrize("shape", [(300, 260), (129, 127), (3, 5, 130)], ids=["300x260", "129x127", "3x5x130"])
def test_the_fused_ops_are_the_reference(kernels, dtype, fmt, op, ref_op, approximate, shape):
    """y = op(x) cast, its scales, q_t's; the amax of y; with and without q_t, padded, misaligned
    (x and b one element off: the element loads)."""
    x, dy = inputs(shape, dtype, sum(shape)), inputs(shape, dtype, 3)
    a, b = (dy, x) if ref_op == "dgelu" else (x, None)
    for transpose, pad_to, misalign in ((False, 1, False), (True, 1, False), (True, 16, True)):
        got = launch(kernels, a, fmt, (1, 128), fmt == "e4m3", transpose, pad_to, misalign=misalign, op=op, b=b,
                     dbias=ref_op == "dgelu")
        check(got, a, fmt, (1, 128), fmt == "e4m3", transpose, pad_to, op=ref_op, b=b, approximate=approximate)
        if ref_op == "dgelu":
            y = as_2d(activation(ref_op, a, b, approximate)).astype(np.float64)
            assert (np.abs(got["dbias"] - y.sum(axis=0)) <= 2.0 ** -18 * np.abs(y).sum(axis=0) + 1e-37).all()


@pytest.mark.parametrize("op", ["identity", "dgelu_tanh"])
@pytest.mark.parametrize("transpose", [False, True], ids=["q", "q+q_t"])
def test_dbias_is_the_same_bits_on_every_grid_and_close_to_the_float64_sums(kernels, op, transpose):
    x, dy = inputs((3000, 4100), "bfloat16", 13), inputs((3000, 4100), "bfloat16", 14)
    b = x if op != "identity" else None
    y = np.asarray(activation(op.split("_")[0], dy, b, "tanh"), np.float64).reshape(3000, 4100)
    ntiles = -(-3000 // 128) * -(-4100 // 128)
    first = None
    for grid in (None, ntiles, 7, 1):
        got = launch(kernels, dy, "e5m2", (1, 128), False, transpose, 16, grid=grid, op=op, b=b, dbias=True)
        check(got, dy, "e5m2", (1, 128), False, transpose, 16, op=op.split("_")[0], b=b)
        bits = got["dbias"].view(np.uint32)
        assert first is None or np.array_equal(bits, first), grid
        first = bits
    err = np.abs(got["dbias"] - y.sum(axis=0))
    assert (err <= 2.0 ** -18 * np.abs(y).sum(axis=0) + 1e-37).all(), err.max()
