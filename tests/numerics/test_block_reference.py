"""Block scaling's NumPy definition (fusedfp8/numerics/block.py), the oracle of
cuda_src/block_quantize.cu, against its own oracles: the scales recomputed per block in float64
from the rule as docs/design.md writes it, the bytes decoded within half an FP8 ulp times the
block's scale, and the scale layout read back element by element."""
import math

import ml_dtypes
import numpy as np
import pytest

from fusedfp8.formats import E4M3, E5M2
from fusedfp8.numerics import block as B
from fusedfp8.numerics import reference as ref

f32 = np.float32
FLT_MAX = float(np.finfo(np.float32).max)
BF16 = np.dtype(ml_dtypes.bfloat16)
FMTS = pytest.mark.parametrize("fmt", [E4M3, E5M2], ids=["e4m3", "e5m2"])
POW2 = pytest.mark.parametrize("pow2", [False, True], ids=["exact", "pow2"])
BLOCKS = pytest.mark.parametrize("block", [(1, 128), (128, 128)], ids=["1x128", "128x128"])
SHAPES = {"aligned-256x384": (256, 384), "ragged-300x260": (300, 260), "ragged-129x127": (129, 127),
          "ragged-1x1": (1, 1), "ragged-1d-200": (200,), "ragged-3d-2x70x200": (2, 70, 200), "ragged-0x130": (0, 130)}
SHAPE_PARAMS = pytest.mark.parametrize("shape", list(SHAPES.values()), ids=list(SHAPES))
MIN_EXP = {"e4m3": -6, "e5m2": -14}  # the smallest normal exponent of each format


def rows_of(seed: int, shape, dtype=np.float32) -> np.ndarray:
    """Values over many binades, each row (and each block of rows) at its own magnitude, so that a
    scale read from the wrong block shows."""
    g = np.random.default_rng(seed)
    two_d = (int(np.prod(shape[:-1])), shape[-1]) if len(shape) > 1 else (1, shape[0])
    v = g.standard_normal(two_d) * np.exp2(g.integers(-20, 20, (two_d[0], 1))) * np.exp2(g.integers(-4, 4, two_d))
    return v.reshape(shape).astype(dtype)


def view2d(x) -> np.ndarray:
    x = np.asarray(x)
    return x.reshape(-1, x.shape[-1]) if x.ndim > 1 else x.reshape(1, -1)


def expected_scale(amax: float, fmt, pow2: bool) -> float:
    """The rule in float64: fmt_max / amax rounded once to float32 (a float64 quotient of float32
    operands rounded to float32 is the correctly rounded float32 quotient), FLT_MAX past it, 2**e
    below it with pow2; 1 for amax 0, inf or NaN."""
    if amax == 0 or not math.isfinite(amax):
        return 1.0
    with np.errstate(over="ignore"):
        s = float(f32(fmt.max / amax))
    s = FLT_MAX if math.isinf(s) else s
    return math.ldexp(1.0, math.frexp(s)[1] - 1) if pow2 else s


def expected_scales(x2: np.ndarray, fmt, block, pow2: bool) -> tuple[np.ndarray, np.ndarray]:
    """(the scale_inv array of the (rows, cols) operand x2 in the documented layout, pad entries 1;
    each element's float32 scale), block by block with Python floats."""
    rows, cols = x2.shape
    nk, nr = math.ceil(cols / 128), math.ceil(rows / block[0])
    out = np.ones(B.scale_shape(rows, cols, block), np.float32)
    per_elem = np.zeros(x2.shape, np.float32)
    for i in range(nr):
        for k in range(nk):
            at = slice(i * block[0], (i + 1) * block[0]), slice(k * 128, (k + 1) * 128)
            blk = x2[at].astype(np.float64)
            a = float(np.max(np.abs(blk))) if not np.isnan(blk).any() else math.nan
            scale = f32(expected_scale(a, fmt, pow2))
            per_elem[at] = scale
            out[(k, i) if block[0] == 1 else (i, k)] = f32(1.0) / scale
    return out, per_elem


def expected_layout(x2: np.ndarray, fmt, block, pow2: bool) -> np.ndarray:
    return expected_scales(x2, fmt, block, pow2)[0]


def half_ulp(y: np.ndarray, fmt) -> np.ndarray:
    """Half an FP8 ulp at |y| (the subnormal spacing below the smallest normal)."""
    e = np.maximum(np.floor(np.log2(np.maximum(np.abs(y), 1e-300))), MIN_EXP[fmt.name])
    return np.exp2(e - fmt.mantissa_bits) / 2


def error_bound(x2: np.ndarray, sinv: np.ndarray, fmt) -> np.ndarray:
    """How far the decoded bytes may be from x2 (float64): half an FP8 ulp at the scaled value
    times the block's scale_inv, plus the float32 roundings of x * scale and of 1 / scale."""
    return half_ulp(x2 / sinv, fmt) * sinv + np.abs(x2) * 2.0 ** -22


# ---- the scales and the bytes against float64 ---------------------------------------------------
@FMTS
@POW2
@BLOCKS
@SHAPE_PARAMS
@pytest.mark.parametrize("dtype", [np.dtype(np.float32), BF16, np.dtype(np.float16)], ids=["f32", "bf16", "f16"])
def test_scales_and_bytes_against_float64(fmt, pow2, block, shape, dtype):
    x = rows_of(sum(shape) + len(shape), shape, dtype) if dtype != np.float16 else \
        np.clip(rows_of(sum(shape), shape), -6e4, 6e4).astype(dtype)
    r = B.block_quantize(x, fmt, block, pow2)
    x2 = view2d(x).astype(np.float64)
    assert r.data.shape == x.shape and r.data.dtype == fmt.numpy_dtype
    want, scale = expected_scales(view2d(x), fmt, block, pow2)
    assert r.scale_inv.dtype == np.float32 and r.scale_inv.flags.c_contiguous
    np.testing.assert_array_equal(r.scale_inv, want)
    # the bytes: one float32 multiply by the block's scale, then the cast every quantization shares
    with np.errstate(over="ignore"):
        q = ref.cast_to_fp8(view2d(x).astype(np.float32) * scale, fmt)
    np.testing.assert_array_equal(view2d(r.data).view(np.uint8), q.view(np.uint8))
    assert r.amax == (np.max(np.abs(x2)) if x2.size else 0.0)
    # the bytes decode to x within half an FP8 ulp (at the scaled value) times the block's scale_inv,
    # plus the float32 roundings of x * scale and of 1 / scale
    if x2.size == 0:
        return
    sinv = B.expand_scales(r.scale_inv, *x2.shape, block).astype(np.float64)
    deq = view2d(r.data).astype(np.float64) * sinv
    bound = error_bound(x2, sinv, fmt)
    assert np.all(np.abs(deq - x2) <= bound), np.max(np.abs(deq - x2) - bound)
    # ... and the block's max reaches the top binade: fmt_max itself (pow2: at least fmt_max / 2 once cast)
    for i in range(0, x2.shape[0], block[0]):
        for k in range(0, x2.shape[1], 128):
            blk_x, blk_q = x2[i:i + block[0], k:k + 128], view2d(r.data)[i:i + block[0], k:k + 128]
            top = np.abs(blk_q.astype(np.float64)).flat[np.argmax(np.abs(blk_x))]
            if np.max(np.abs(blk_x)) > 0:
                assert (fmt.max / 2 <= top <= fmt.max) if pow2 else top == fmt.max, (i, k, top)


@FMTS
@BLOCKS
def test_power_of_two_scales_round_the_exact_scale_down(fmt, block):
    x = rows_of(3, (256, 512))
    exact = B.block_quantize(x, fmt, block, power_of_two=False).scale_inv
    p2 = B.block_quantize(x, fmt, block, power_of_two=True).scale_inv
    s, s2 = 1 / exact.astype(np.float64), 1 / p2.astype(np.float64)
    assert np.all(s2 <= s) and np.all(s2 > s / 2)
    mant, _ = np.frexp(p2)
    assert np.all(mant == 0.5)  # every scale_inv a power of two
    assert np.any(s2 < s)  # (the data is not made of powers of two: the rounding did something)


def test_a_tiny_block_max_gives_flt_max_and_its_power_of_two():
    """448 / 1e-40 is inf in float32: the scale is FLT_MAX (2**127 rounded down to a power of two),
    its inverse 1 / FLT_MAX (2**-127, a float32 subnormal, kept); the block's bytes are those of
    x * scale."""
    x = np.zeros((1, 256), np.float32)
    x[0, 3], x[0, 130] = 1e-40, 1e-30  # the max of two blocks: a float32 denormal, a tiny normal
    plain = B.block_quantize(x, "e4m3")
    pow2 = B.block_quantize(x, "e4m3", power_of_two=True)
    assert plain.scale_inv[0, 0] == f32(1) / f32(FLT_MAX) and pow2.scale_inv[0, 0] == f32(2.0 ** -127)
    assert pow2.scale_inv[0, 0] > 0  # (a subnormal, not flushed)
    assert plain.data.view(np.uint8)[0, 3] == ref.cast_to_fp8(np.array([f32(1e-40) * f32(FLT_MAX)]), "e4m3").view(
        np.uint8)[0]
    assert pow2.data.view(np.uint8)[0, 3] == ref.cast_to_fp8(np.array([f32(1e-40) * f32(2.0 ** 127)]), "e4m3").view(
        np.uint8)[0]
    assert plain.scale_inv[1, 0] == f32(1) / (f32(448) / f32(1e-30))  # finite: the formula itself


# ---- zeros, NaN, inf ---------------------------------------------------------------------------
@FMTS
@POW2
@BLOCKS
def test_zero_nan_and_inf_blocks_take_scale_one_and_leave_the_others_alone(fmt, pow2, block):
    """A block of zeros (either sign), one holding a NaN and one holding an inf each take scale 1:
    no scale is ever 0, inf or NaN. The NaN casts to the NaN byte, the inf saturates, the block's
    other elements cast with scale 1; every other block is quantized as without them; the tensor's
    amax carries the NaN."""
    x = rows_of(5, (256, 384))
    x[0:128, 0:128] = -0.0  # block (0, 0) of either block shape: all zeros
    x[128, 200], x[200, 300] = np.nan, -np.inf  # in blocks (1, 1) and (1, 2) of 128x128; rows of 1x128
    clean = x.copy()
    clean[128, 200], clean[200, 300] = 0.0, 0.0
    r, c = B.block_quantize(x, fmt, block, pow2), B.block_quantize(clean, fmt, block, pow2)
    s = B.expand_scales(r.scale_inv, 256, 384, block)
    assert np.all(np.isfinite(r.scale_inv)) and np.all(r.scale_inv > 0)
    assert np.all(s[:128, :128] == 1) and np.all(r.data.view(np.uint8)[:128, :128] == 0x80)
    assert s[128, 200] == 1 and s[200, 300] == 1
    q = r.data.view(np.uint8)
    assert q[128, 200] == fmt.nan_bits
    assert r.data.astype(np.float32)[200, 300] == -fmt.max
    hit = np.zeros((256, 384), bool)  # the elements of the two blocks with a special value
    for (i, k) in ((128, 200), (200, 300)):
        rs = slice(i, i + 1) if block[0] == 1 else slice(i // 128 * 128, i // 128 * 128 + 128)
        hit[rs, k // 128 * 128:k // 128 * 128 + 128] = True
    np.testing.assert_array_equal(q[~hit], c.data.view(np.uint8)[~hit])
    unit = ref.cast_to_fp8(x[hit & ~np.isnan(x) & ~np.isinf(x)], fmt)  # scale 1
    np.testing.assert_array_equal(q[hit & ~np.isnan(x) & ~np.isinf(x)], unit.view(np.uint8))
    assert np.isnan(r.amax)
    x[128, 200] = 1.0
    assert B.block_quantize(x, fmt, block, pow2).amax == np.inf


# ---- the transposed copy ------------------------------------------------------------------------
@FMTS
@POW2
@pytest.mark.parametrize("shape", [(256, 384), (300, 260), (3, 40, 130), (1, 1)],
                         ids=["aligned", "ragged", "3d", "1x1"])
def test_the_1x128_transpose_is_the_block_quantization_of_x_t(fmt, pow2, shape):
    """With 1x128 blocks the transposed copy has its own scales, one per 128 consecutive elements
    of a column of x: it is exactly block_quantize of x.T (2-D view), not q.T."""
    x = rows_of(7, shape)
    r = B.block_quantize(x, fmt, (1, 128), pow2, transpose=True)
    t = B.block_quantize(np.ascontiguousarray(view2d(x).T), fmt, (1, 128), pow2)
    np.testing.assert_array_equal(r.data_t.view(np.uint8), t.data.view(np.uint8))
    np.testing.assert_array_equal(r.scale_inv_t, t.scale_inv)
    rows, cols = view2d(x).shape
    assert r.data_t.shape == (cols, rows) and r.scale_inv_t.shape == (math.ceil(rows / 128), -(-cols // 4) * 4)
    np.testing.assert_array_equal(r.scale_inv_t, expected_layout(view2d(x).T, fmt, (1, 128), pow2))
    if rows >= 128:  # rows at their own magnitudes: the column scales differ from the row scales
        assert not np.array_equal(r.data_t.view(np.uint8), np.ascontiguousarray(view2d(r.data).T).view(np.uint8))


@FMTS
@POW2
@pytest.mark.parametrize("shape", [(256, 384), (300, 260), (130, 5)], ids=["aligned", "ragged", "narrow"])
def test_the_128x128_transpose_is_the_same_bytes_and_scales_transposed(fmt, pow2, shape):
    x = rows_of(9, shape)
    r = B.block_quantize(x, fmt, (128, 128), pow2, transpose=True)
    np.testing.assert_array_equal(r.data_t.view(np.uint8), np.ascontiguousarray(r.data.T).view(np.uint8))
    t = B.block_quantize(np.ascontiguousarray(x.T), fmt, (128, 128), pow2)  # square blocks: their own transpose
    np.testing.assert_array_equal(r.scale_inv_t, t.scale_inv)
    nr, nk = math.ceil(shape[0] / 128), math.ceil(shape[1] / 128)
    np.testing.assert_array_equal(r.scale_inv_t[:nk, :nr], r.scale_inv[:nr, :nk].T)
    assert r.scale_inv_t.shape == (nk, -(-nr // 4) * 4) and np.all(r.scale_inv_t[:, nr:] == 1)


# ---- the layout --------------------------------------------------------------------------------
@pytest.mark.parametrize("rows, cols, block, shape", [
    (256, 384, (1, 128), (3, 256)), (300, 260, (1, 128), (3, 300)), (301, 128, (1, 128), (1, 304)),
    (2, 129, (1, 128), (2, 4)), (0, 5, (1, 128), (1, 0)),
    (256, 384, (128, 128), (2, 4)), (300, 260, (128, 128), (3, 4)), (128, 640, (128, 128), (1, 8)),
    (129, 1, (128, 128), (2, 4)),
], ids=["1x128-aligned", "1x128-ragged", "1x128-rows-pad", "1x128-tiny", "1x128-empty", "128-aligned", "128-ragged",
        "128-five-k-blocks", "128-narrow"])
def test_scale_shape(rows, cols, block, shape):
    assert B.scale_shape(rows, cols, block) == shape


def test_the_layout_element_by_element_and_as_torch_scaled_mm_views_it():
    """scale_inv[k, r] is row r's K block k (1x128), scale_inv[i, k] the tile (i, k) (128x128), pad
    entries 1; torch._scaled_mm's blockwise 1x128 scale of an (M, K) operand is the same memory as
    an (M, ceil(K / 128)) array with strides (1, M) when M is a multiple of 4."""
    x = np.zeros((8, 300), np.float32)
    for r in range(8):
        for k in range(3):
            x[r, 128 * k] = 448.0 * 2.0 ** (r + 10 * k)  # block (r, k): scale 2**-(r + 10k)
    s = B.block_quantize(x, "e4m3", (1, 128), power_of_two=True).scale_inv
    assert s.shape == (3, 8)
    for r in range(8):
        for k in range(3):
            assert s[k, r] == 2.0 ** (r + 10 * k)
    t = np.lib.stride_tricks.as_strided(s, shape=(8, 3), strides=(4, 4 * 8))
    assert t[5, 2] == 2.0 ** 25 and np.array_equal(t, s.T)
    w = np.zeros((300, 600), np.float32)
    for i in range(3):
        for k in range(5):
            w[128 * i, 128 * k] = 448.0 * 2.0 ** (i + 4 * k)
    sw = B.block_quantize(w, "e4m3", (128, 128), power_of_two=True).scale_inv
    assert sw.shape == (3, 8) and np.all(sw[:, 5:] == 1)
    for i in range(3):
        for k in range(5):
            assert sw[i, k] == 2.0 ** (i + 4 * k)
    with pytest.raises(ValueError, match=r"^scale_inv must have shape \(3, 8\) for a \(8, 300\) operand with 1x128 "
                                         r"blocks; got \(8, 3\)"):
        B.expand_scales(s.T, 8, 300, (1, 128))


@pytest.mark.parametrize("pow2", [False, True], ids=["exact", "pow2"])
def test_a_gemm_over_the_layouts_matches_the_high_precision_one(pow2):
    """What cuBLASLt computes from the bytes and the scales as laid out (a 1x128 activation times a
    128x128 weight, and the weight gradient's two 1x128 transposed copies) is the float64 product
    within the operands' quantization errors (error_bound, read through the layouts)."""
    def operand(q, sinv, x, block, fmt):
        d = B.block_dequantize(q, sinv, block).astype(np.float64)
        x = x.astype(np.float64)
        err = error_bound(x, B.expand_scales(sinv, *x.shape, block).astype(np.float64), fmt)
        assert np.all(np.abs(d - x) <= err)
        return d, np.abs(x), err

    a, w, g = rows_of(11, (256, 384)), rows_of(12, (384, 384)), rows_of(13, (256, 384))
    qa = B.block_quantize(a, E4M3, (1, 128), pow2, transpose=True)
    qw = B.block_quantize(w, E4M3, (128, 128), pow2)
    qg = B.block_quantize(g, E5M2, (1, 128), pow2, transpose=True)
    for (qx, sx, x, bx, fx), (qy, sy, y, by, fy) in [
        ((qa.data, qa.scale_inv, a, (1, 128), E4M3), (qw.data, qw.scale_inv, w, (128, 128), E4M3)),  # forward
        ((qg.data_t, qg.scale_inv_t, g.T, (1, 128), E5M2), (qa.data_t, qa.scale_inv_t, a.T, (1, 128), E4M3)),  # wgrad
    ]:
        (dx, ax, ex), (dy, ay, ey) = operand(qx, sx, x, bx, fx), operand(qy, sy, y, by, fy)
        exact = x.astype(np.float64) @ y.astype(np.float64).T
        bound = ax @ ey.T + ex @ ay.T + ex @ ey.T
        assert np.all(np.abs(dx @ dy.T - exact) <= bound * (1 + 1e-9))
        assert np.any(np.abs(dx @ dy.T - exact) > 0)  # (the check sees quantization at all)


def test_dequantize_writes_the_canonical_nan_and_keeps_the_dtype():
    x = rows_of(1, (4, 256))
    x[1, 7] = np.nan
    r = B.block_quantize(x, "e4m3", (1, 128))
    out = B.block_dequantize(r.data, r.scale_inv, (1, 128), BF16)
    assert out.dtype == BF16 and out.shape == (4, 256)
    assert out.view(np.uint16)[1, 7] == 0x7FC0
    assert np.isnan(out.astype(np.float32)).sum() == 1


# ---- padding -----------------------------------------------------------------------------------
@BLOCKS
@pytest.mark.parametrize("transpose", [False, True], ids=["q", "q-and-t"])
def test_padding_is_the_quantization_of_the_zero_padded_input(block, transpose):
    x = rows_of(17, (300, 250))
    r = B.block_quantize(x, "e4m3", block, True, transpose, pad_to=16)
    z = np.zeros((304, 256), np.float32)
    z[:300, :250] = x
    p = B.block_quantize(z, "e4m3", block, True, transpose)
    assert r.data.shape == (304, 256) and r.scale_inv.shape == B.scale_shape(304, 256, block)
    for field in ("data", "scale_inv") + (("data_t", "scale_inv_t") if transpose else ()):
        got, want = getattr(r, field), getattr(p, field)
        assert got.shape == want.shape, field
        np.testing.assert_array_equal(got.view(np.uint8), want.view(np.uint8))
    assert r.amax == p.amax and (r.data_t is None) == (not transpose)
    assert np.all(r.data.view(np.uint8)[300:] == 0) and np.all(r.data.view(np.uint8)[:, 250:] == 0)
    plain = B.block_quantize(x, "e4m3", block, True)
    np.testing.assert_array_equal(r.data.view(np.uint8)[:300, :250], plain.data.view(np.uint8))


def test_the_data_keeps_the_input_shape_unless_padded():
    x = rows_of(2, (2, 3, 200))
    assert B.block_quantize(x).data.shape == (2, 3, 200)
    assert B.block_quantize(x, pad_to=16).data.shape == (16, 208)
    assert B.block_quantize(x, transpose=True).data_t.shape == (200, 6)


# ---- bad arguments -----------------------------------------------------------------------------
@pytest.mark.parametrize("kwargs, exc, match", [
    (dict(block=(64, 64)), ValueError, r"^block must be \(1, 128\) or \(128, 128\); got \(64, 64\)$"),
    (dict(block="1x128"), ValueError, r"^block must be \(1, 128\) or \(128, 128\); got '1x128'$"),
    (dict(block=None), ValueError, r"^block must be \(1, 128\) or \(128, 128\); got None$"),
    (dict(pad_to=0), ValueError, r"^pad_to must be a positive int"),
    (dict(fmt="e3m4"), ValueError, r"^fmt: unsupported FP8 format 'e3m4'"),
], ids=["block-64", "block-str", "block-None", "pad-0", "fmt"])
def test_bad_arguments_are_refused_by_name(kwargs, exc, match):
    with pytest.raises(exc, match=match):
        B.block_quantize(np.ones((4, 4), np.float32), **kwargs)


def test_a_scalar_or_an_integer_input_is_refused():
    with pytest.raises(ValueError, match=r"^x: block scaling needs an input of at least 1 dimension; got a scalar$"):
        B.block_quantize(np.float32(1.0))
    with pytest.raises(TypeError, match=r"^x must be float32, float16 or bfloat16; got int32$"):
        B.block_quantize(np.ones((2, 2), np.int32))


@FMTS
@POW2
def test_block_layernorm_is_the_fused_layernorm_then_the_block_rule(fmt, pow2):
    """LayerNorm fused with 1x128 block quantization: mean and rstd are the per-tensor fused
    LayerNorm's (fusedfp8.numerics.layernorm, bit for bit); each byte of q and q_t decodes to its
    float32 LayerNorm value within half an FP8 ulp times its block's scale (the scales from
    the blocks of y, not of x); padded, the rows x cols corner is the unpadded result and the pad
    is FP8 zeros (zeros of y, not the LayerNorm of a zero row)."""
    from fusedfp8.numerics import layernorm as LN

    g = np.random.default_rng(5)
    x = (g.standard_normal((150, 300)) * np.exp2(g.integers(-8, 8, (150, 1))) + 3).astype(BF16)
    w, b = np.linspace(0.25, 4, 300).astype(f32), np.linspace(-2, 2, 300).astype(f32)
    got, mean, rstd = B.block_layernorm_quantize(x, w, b, 1e-5, fmt, pow2, True)
    _, mean_ln, rstd_ln = LN.layernorm_quantize(x, w, b, 1e-5, f32(1.0), fmt)
    assert np.array_equal(mean.view(np.uint32), mean_ln.view(np.uint32))
    assert np.array_equal(rstd.view(np.uint32), rstd_ln.view(np.uint32))
    y = LN.layernorm_f32(x, w, b, 1e-5)[0].astype(np.float64)  # (held to float64 in test_layernorm_reference.py)
    for q, s_inv, yy in ((got.data, got.scale_inv, y), (got.data_t, got.scale_inv_t, y.T)):
        rows, cols = yy.shape
        si = B.expand_scales(s_inv, rows, cols, (1, 128)).astype(np.float64)
        dec = q.astype(np.float64) * si
        ulp = np.exp2(np.floor(np.log2(np.maximum(np.abs(yy) / si, 2.0 ** MIN_EXP[fmt.name]))) - fmt.mantissa_bits)
        assert np.all(np.abs(dec - yy) <= 0.5 * ulp * si * (1 + 2.0 ** -20))  # (y * scale: one float32 rounding)
    padded, _, _ = B.block_layernorm_quantize(x, w, b, 1e-5, fmt, pow2, True, 16)
    q16 = padded.data.view(np.uint8)
    assert q16.shape == (160, 304) and not q16[150:].any() and not q16[:, 300:].any()
    assert np.array_equal(q16[:150, :300], got.data.view(np.uint8))
    assert np.array_equal(padded.data_t.view(np.uint8)[:300, :150], got.data_t.view(np.uint8))
