"""The NumPy reference (fusedfp8/numerics/reference.py): the oracle of every kernel, so it gets its own oracles.

Quantization is checked byte for byte against two independent twins: ml_dtypes' cast (clip, then
RNE), and a brute-force decoder/rounder written here from the bit layouts alone (all 256 codes
decoded to float64, nearest representable with ties to the even mantissa, saturation at +-max,
NaN -> 0x7F). Activations are checked against float64 formulas and float64 torch.
"""
import math
from fractions import Fraction

import ml_dtypes
import numpy as np
import pytest
import torch

from fusedfp8.numerics import reference as ref
from fusedfp8.formats import E4M3, E5M2

f32 = np.float32
BF16 = np.dtype(ml_dtypes.bfloat16)
IN_DTYPES = [np.dtype(np.float32), np.dtype(np.float16), BF16]
IN_IDS = ["f32", "f16", "bf16"]
FMTS = [E4M3, E5M2]
FMT_IDS = ["e4m3", "e5m2"]


# ---- an independent FP8 oracle ---------------------------------------------------------------
def decode_all(fmt) -> np.ndarray:
    """float64 value of each of the 256 codes, from the bit layout alone (no ml_dtypes)."""
    e, m = fmt.exponent_bits, fmt.mantissa_bits
    bias = 2 ** (e - 1) - 1
    all_ones = (1 << e) - 1
    out = np.empty(256)
    for code in range(256):
        sign = -1.0 if code & 0x80 else 1.0
        ex, man = (code >> m) & all_ones, code & ((1 << m) - 1)
        if fmt.name == "e5m2" and ex == all_ones:  # IEEE-like: inf and NaNs
            out[code] = sign * math.inf if man == 0 else math.nan
        elif fmt.name == "e4m3" and ex == all_ones and man == (1 << m) - 1:  # e4m3fn: only S.1111.111 is NaN
            out[code] = math.nan
        elif ex == 0:
            out[code] = sign * man * 2.0 ** (1 - bias - m)
        else:
            out[code] = sign * (1 + man / 2 ** m) * 2.0 ** (ex - bias)
    return out


def oracle_fp8(v, fmt) -> np.ndarray:
    """uint8 codes of float32 values v: nearest, ties to even mantissa, saturating, NaN -> 0x7F."""
    table = decode_all(fmt)
    pos = np.array([c for c in range(128) if np.isfinite(table[c])])
    assert np.all(np.diff(table[pos]) > 0)  # positive codes are ordered by value
    vals = table[pos]
    v = np.asarray(v, np.float32)
    a = np.abs(v.astype(np.float64)).reshape(-1)
    idx = np.clip(np.searchsorted(vals, a), 1, len(vals) - 1)
    lo, hi = vals[idx - 1], vals[idx]
    d_lo, d_hi = a - lo, hi - a
    hi_even = (pos[idx] & 1) == 0
    pick = np.where((d_hi < d_lo) | ((d_hi == d_lo) & hi_even), pos[idx], pos[idx - 1])
    pick = np.where(a >= vals[-1], pos[-1], pick)  # saturate (finite overflow and inf)
    code = pick.astype(np.uint8) | np.where(np.signbit(v.reshape(-1)), 0x80, 0).astype(np.uint8)
    code[np.isnan(a)] = 0x7F
    return code.reshape(v.shape)


def mldtypes_fp8(v, fmt) -> np.ndarray:
    """The ml_dtypes twin: clip to +-max, cast (RNE), NaN -> 0x7F."""
    v = np.asarray(v, np.float32)
    with np.errstate(invalid="ignore"):
        q = np.clip(v, -fmt.max, fmt.max).astype(fmt.numpy_dtype).view(np.uint8).copy()
    q[np.isnan(v)] = 0x7F
    return q


def test_oracle_decoder_agrees_with_ml_dtypes():
    # Sanity of the oracle itself: the decoder matches ml_dtypes on every code.
    for fmt in FMTS:
        mine = decode_all(fmt)
        theirs = np.arange(256, dtype=np.uint8).view(fmt.numpy_dtype).astype(np.float64)
        np.testing.assert_array_equal(mine, theirs)
        assert np.nanmax(mine[np.isfinite(mine)]) == fmt.max


# ---- boundary cases --------------------------------------------------------------------------
def boundary_values(fmt) -> np.ndarray:
    """float64 values on and around every rounding boundary of fmt (all exactly float32)."""
    table = decode_all(fmt)
    pos = np.array(sorted(v for v in table[:128] if np.isfinite(v)))
    mids = (pos[:-1] + pos[1:]) / 2  # every tie, at every exponent (subnormal and normal)
    top_gap = pos[-1] - pos[-2]
    sub = pos[1]  # smallest subnormal
    extra = [
        0.0, fmt.max, fmt.max + top_gap / 2, fmt.max + top_gap, 2 * fmt.max, 1e30, np.finfo(np.float32).max,
        math.inf, math.nan,
        sub, sub / 2, sub / 4, 1.5 * sub, 2.5 * sub, 3.5 * sub, sub * 0.75,
        np.finfo(np.float32).tiny, 2.0 ** -149,
    ]
    pos_all = np.concatenate([pos, mids, extra])
    return np.concatenate([pos_all, -pos_all])


def neighbours_in(x: np.ndarray) -> np.ndarray:
    """x and its two neighbours by one unit in the last place of x's own dtype (bit +- 1)."""
    ui = {2: np.uint16, 4: np.uint32}[x.dtype.itemsize]
    bits = x.view(ui)
    finite = np.isfinite(x.astype(np.float32))
    up = (bits[finite] + ui(1)).view(x.dtype)
    magnitude = bits & ui((1 << (8 * x.dtype.itemsize - 1)) - 1)
    down = (bits[finite & (magnitude != 0)] - ui(1)).view(x.dtype)  # not across +-0
    return np.concatenate([x, up, down])


def random_binades(rng, dtype, fmt, n=4000) -> np.ndarray:
    """Random values spread over 40 binades, from below the smallest subnormal to above max."""
    top = math.floor(math.log2(fmt.max)) + 3
    e = rng.integers(top - 40, top, n)
    v = rng.uniform(1.0, 2.0, n) * np.exp2(e) * rng.choice([-1.0, 1.0], n)
    with np.errstate(over="ignore"):
        return v.astype(np.float32).astype(dtype)


SCALES = [1.0, 2.0 ** -3, 3.0, 1e3]
SCALE_IDS = ["s1", "s2^-3", "s3", "s1e3"]


@pytest.mark.parametrize("scale", SCALES, ids=SCALE_IDS)
@pytest.mark.parametrize("dtype", IN_DTYPES, ids=IN_IDS)
@pytest.mark.parametrize("fmt", FMTS, ids=FMT_IDS)
def test_quantize_bytes_match_both_oracles(fmt, dtype, scale, rng):
    s32 = f32(scale)
    # Inputs placed so that x * scale lands on every boundary (exactly where the input dtype and
    # the power-of-two scales allow it, next to it otherwise), and one ulp either side.
    with np.errstate(over="ignore"):
        x = (boundary_values(fmt) / float(s32)).astype(np.float32).astype(dtype)
    if dtype == np.float32 and scale in (1.0, 2.0 ** -3):  # the ties really are in the test
        b = boundary_values(fmt)
        b = b[np.abs(b) <= 2 * fmt.max].astype(np.float32)  # FLT_MAX / 2**-3 overflows, fine
        assert np.isin(b, x.astype(np.float32) * s32).all()
    x = neighbours_in(x)
    x = np.concatenate([x, random_binades(rng, dtype, fmt)])
    assert x.dtype == dtype and x.size > 500
    with np.errstate(over="ignore", invalid="ignore"):
        v = x.astype(np.float32) * s32  # the contract: one fp32 multiply
    got = ref.quantize(x, np.array([s32]), fmt)
    assert got.data.dtype == fmt.numpy_dtype and got.data.shape == x.shape
    got_bytes = got.data.view(np.uint8)
    expect = oracle_fp8(v, fmt)
    bad = np.nonzero(got_bytes != expect)[0]
    assert bad.size == 0, [(float(x[i]), float(v[i]), hex(got_bytes[i]), hex(expect[i])) for i in bad[:8]]
    np.testing.assert_array_equal(got_bytes, mldtypes_fp8(v, fmt))
    # amax is of the input, before scaling, NaN-propagating (x holds NaNs here).
    assert np.isnan(got.amax) and got.amax.dtype == np.float32
    finite = x[~np.isnan(x.astype(np.float32))]
    assert ref.amax(finite) == np.max(np.abs(finite.astype(np.float64)))


@pytest.mark.parametrize("fmt", FMTS, ids=FMT_IDS)
def test_quantize_named_edge_cases(fmt):
    """The edge-case table, spelled out (scale 1, float32)."""
    table = decode_all(fmt)
    max_code = int(np.nanargmax(np.where(np.isfinite(table[:128]), table[:128], -1)))
    sub = table[1]
    cases = [  # (input, expected byte)
        (0.0, 0x00), (-0.0, 0x80),
        (fmt.max, max_code), (-fmt.max, 0x80 | max_code),
        (np.nextafter(f32(fmt.max), f32(np.inf)), max_code),
        (-np.nextafter(f32(fmt.max), f32(np.inf)), 0x80 | max_code),
        (math.inf, max_code), (-math.inf, 0x80 | max_code),
        (math.nan, 0x7F), (-math.nan, 0x7F),
        (sub, 0x01), (sub / 2, 0x00), (-sub / 2, 0x80),  # half the smallest subnormal: tie -> even (0)
        (np.nextafter(f32(sub / 2), f32(1)), 0x01), (np.nextafter(f32(sub / 2), f32(0)), 0x00),
        (1.5 * sub, 0x02), (2.5 * sub, 0x02),  # ties between subnormals go to the even code
        (1e-45, 0x00), (-1e-45, 0x80),
    ]
    x = np.array([c[0] for c in cases], np.float32)
    got = ref.quantize(x, f32(1.0), fmt).data.view(np.uint8)
    assert [hex(b) for b in got] == [hex(c[1]) for c in cases]


@pytest.mark.parametrize("fmt", FMTS, ids=FMT_IDS)
def test_cast_every_code_roundtrips(fmt):
    """Every finite fp8 value maps to its own code; NaN codes to 0x7F; e5m2 +-inf saturates."""
    vals = decode_all(fmt).astype(np.float32)
    got = ref.cast_to_fp8(vals, fmt).view(np.uint8)
    codes = np.arange(256, dtype=np.uint8)
    finite = np.isfinite(vals)
    np.testing.assert_array_equal(got[finite], codes[finite])
    assert np.all(got[np.isnan(vals)] == 0x7F)
    if fmt.has_inf:
        assert list(got[[0x7C, 0xFC]]) == [0x7B, 0xFB]


# ---- amax ------------------------------------------------------------------------------------
@pytest.mark.parametrize("dtype", IN_DTYPES, ids=IN_IDS)
@pytest.mark.parametrize("where", [0, 5, 10], ids=["first", "middle", "last"])
def test_amax_nan_propagates(dtype, where):
    x = np.linspace(-3, 3, 11).astype(dtype)
    x[where] = np.nan
    x[(where + 3) % 11] = np.inf  # an inf does not hide the NaN
    a = ref.amax(x)
    assert a.dtype == np.float32 and np.isnan(a)
    assert np.array(a).view(np.uint32) == 0x7FC00000  # canonical NaN, whatever NaN came in


def test_amax_negative_nan_is_canonical():
    x = np.array([1.0, -np.nan], np.float32)
    x.view(np.uint32)[1] = 0xFFC00001  # negative NaN with a payload
    assert np.array(ref.amax(x)).view(np.uint32) == 0x7FC00000


@pytest.mark.parametrize("dtype", IN_DTYPES, ids=IN_IDS)
@pytest.mark.parametrize("inf", [np.inf, -np.inf], ids=["+inf", "-inf"])
def test_amax_inf(dtype, inf):
    x = np.array([1.0, inf, -7.0], dtype)
    a = ref.amax(x)
    assert a == np.inf and a.dtype == np.float32


@pytest.mark.parametrize("dtype", IN_DTYPES, ids=IN_IDS)
@pytest.mark.parametrize("shape", [(0,), (0, 16), (16, 0), (3, 0, 5)], ids=["0", "0x16", "16x0", "3x0x5"])
def test_amax_empty_is_zero(dtype, shape):
    a = ref.amax(np.zeros(shape, dtype))
    assert a == 0 and a.dtype == np.float32


@pytest.mark.parametrize("dtype", IN_DTYPES, ids=IN_IDS)
def test_amax_all_zero(dtype):
    x = np.zeros((5, 7), dtype)
    x[1, 2] = -0.0
    a = ref.amax(x)
    assert np.array(a).view(np.uint32) == 0  # +0


@pytest.mark.parametrize("dtype, bits, value", [
    (np.dtype(np.float16), 0x0001, 2.0 ** -24),  # smallest fp16 subnormal
    (np.dtype(np.float16), 0x83FF, 1023 * 2.0 ** -24),  # largest (negative) fp16 subnormal
    (BF16, 0x0001, 2.0 ** -133),  # smallest bf16 subnormal (a float32 subnormal too)
    (BF16, 0x807F, 127 * 2.0 ** -133),
    (np.dtype(np.float32), 0x00000001, 2.0 ** -149),
], ids=["f16-min", "f16-max-sub-neg", "bf16-min", "bf16-max-sub-neg", "f32-min"])
def test_amax_denormal_inputs_are_not_flushed(dtype, bits, value):
    raw = np.zeros(9, {2: np.uint16, 4: np.uint32}[dtype.itemsize])
    raw[4] = bits
    a = ref.amax(raw.view(dtype))
    assert a != 0 and float(a) == value


@pytest.mark.parametrize("dtype", IN_DTYPES, ids=IN_IDS)
def test_amax_random_is_exact(dtype, rng):
    x = (rng.standard_normal((257, 129)) * 100).astype(dtype)
    assert ref.amax(x) == np.max(np.abs(x.astype(np.float64)))


# ---- transpose -------------------------------------------------------------------------------
@pytest.mark.parametrize("shape, t_shape", [
    ((64, 128), (128, 64)), ((303, 300), (300, 303)), ((1, 1), (1, 1)), ((7,), (7, 1)), ((0, 16), (16, 0)),
    ((3, 5, 7), (7, 15)), ((17, 1), (1, 17)),
], ids=["aligned-64x128", "ragged-303x300", "1x1", "1d-7", "empty-0x16", "3d-3x5x7", "17x1"])
@pytest.mark.parametrize("fmt", FMTS, ids=FMT_IDS)
def test_quantize_transpose(shape, t_shape, fmt, rng):
    x = (rng.standard_normal(shape) * 50).astype(np.float32)
    r = ref.quantize(x, f32(0.5), fmt, transpose=True)
    assert r.data_t.shape == t_shape and r.data_t.flags.c_contiguous and r.data_t.dtype == fmt.numpy_dtype
    n = shape[-1]
    np.testing.assert_array_equal(r.data_t.view(np.uint8), r.data.reshape(-1, n).T.view(np.uint8))
    assert ref.quantize(x, f32(0.5), fmt).data_t is None


def test_quantize_transpose_of_scalar_is_refused():
    with pytest.raises(ValueError, match="x: transpose"):
        ref.quantize(np.array(3.0, np.float32), f32(1.0), transpose=True)


def test_quantize_scalar_input():
    r = ref.quantize(np.array(3.0, np.float32), f32(1.0))
    assert r.data.shape == () and r.data.view(np.uint8) == 0x44  # 3.0 in e4m3


@pytest.mark.parametrize("bad", [np.ones(2, np.float32), np.ones((1, 2), np.float32)], ids=["2", "1x2"])
def test_quantize_scale_must_be_one_element(bad):
    with pytest.raises(ValueError, match="scale must hold exactly one element"):
        ref.quantize(np.ones(4, np.float32), bad)


@pytest.mark.parametrize("dtype", [np.int32, np.float64, np.uint8], ids=["int32", "f64", "uint8"])
def test_reference_rejects_other_input_dtypes(dtype):
    with pytest.raises(TypeError, match="x must be float32, float16 or bfloat16"):
        ref.quantize(np.ones(4, dtype), f32(1.0))


# ---- fma_f32: the reference's emulation of the kernels' fma.rn.f32 ----------------------------
def exact_fma_f32(a, b, c) -> np.float32:
    """Round the exact rational a*b + c to float32 (nearest, ties to even), by brute force."""
    a, b, c = (np.float32(v) for v in (a, b, c))
    if not (np.isfinite(a) and np.isfinite(b) and np.isfinite(c)):
        return np.float32(np.float64(a) * np.float64(b) + np.float64(c))
    exact = Fraction(float(a)) * Fraction(float(b)) + Fraction(float(c))
    if exact == 0:  # the sign of an exact zero follows IEEE addition, which float64 does exactly
        return np.float32(np.float64(a) * np.float64(b) + np.float64(c))
    with np.errstate(over="ignore"):
        guess = np.float32(float(exact))  # within one float32 ulp (double rounding at most)
    cands = {guess, np.nextafter(guess, np.float32(np.inf)), np.nextafter(guess, np.float32(-np.inf))}

    def value(v):  # inf stands for 2**128 when rounding (IEEE overflow rule)
        return Fraction(float(v)) if np.isfinite(v) else Fraction(2 ** 128) * (1 if v > 0 else -1)

    return min(cands, key=lambda v: (abs(value(v) - exact), int(np.array(v).view(np.uint32)) & 1))


def fma_cases(rng):
    n = 3000
    mant = lambda: rng.uniform(1, 2, n) * rng.choice([-1.0, 1.0], n)  # noqa: E731
    a = (mant() * np.exp2(rng.integers(-30, 30, n))).astype(np.float32)
    b = (mant() * np.exp2(rng.integers(-30, 30, n))).astype(np.float32)
    # c near -a*b (cancellation), or many binades away (the sum rounds, in float64 too)
    near = (-(a.astype(np.float64) * b) * (1 + rng.standard_normal(n) * 2.0 ** -20)).astype(np.float32)
    far = (mant() * np.exp2(rng.integers(-60, 60, n))).astype(np.float32)
    c = np.where(rng.random(n) < 0.5, near, far).astype(np.float32)
    # Double-rounding traps: a*b = -+(2**-24 - 2**-70) exactly; with c = 1 + 2**-23 the float64 sum
    # lands exactly on a float32 midpoint while the exact sum does not, so "float64 then cast to
    # float32" rounds the wrong way (to even) where the true fma does not.
    p = (1 + 2.0 ** -23) * 2.0 ** -24
    trap_a = np.array([p, -p, -p], np.float32)
    trap_b = np.array([1 - 2.0 ** -23] * 3, np.float32)
    trap_c = np.array([1 + 2.0 ** -23, -(1 + 2.0 ** -23), 1 + 2.0 ** -23], np.float32)
    special = [  # subnormal results, overflow, exact zero
        (2.0 ** -70, 2.0 ** -70, 0.0), (2.0 ** -75, 2.0 ** -70, 2.0 ** -140), (3e38, 2.0, -3e38), (3e38, 3e38, 0.0),
        (2.0, 3.0, -6.0), (-2.0, 3.0, 6.0), (0.0, -1.0, -0.0), (1e-20, 1e-20, -1e-40),
    ]
    sa, sb, sc = (np.array(col, np.float32) for col in zip(*special))
    return (np.concatenate([a, trap_a, sa]), np.concatenate([b, trap_b, sb]), np.concatenate([c, trap_c, sc]))


def test_fma_f32_is_correctly_rounded(rng):
    a, b, c = fma_cases(rng)
    got = ref.fma_f32(a, b, c)
    assert got.dtype == np.float32
    want = np.array([exact_fma_f32(*abc) for abc in zip(a, b, c)], np.float32)
    bad = np.nonzero(got.view(np.uint32) != want.view(np.uint32))[0]
    assert bad.size == 0, [(a[i], b[i], c[i], got[i], want[i]) for i in bad[:5]]
    # the traps really are traps: the naive float64 route differs from the exact answer there
    with np.errstate(over="ignore"):
        naive = (a.astype(np.float64) * b + c).astype(np.float32)
    traps = slice(-11, -8)
    assert np.count_nonzero(naive[traps] != want[traps]) == 3
    assert list(want[traps]) == [1 + 2.0 ** -23, -(1 + 2.0 ** -23), 1 + 2.0 ** -23]


def fma_f32_every_element(a, b, c) -> np.ndarray:
    """The reference's fma_f32 before it sent only the possible midpoints through the TwoSum check:
    the double-rounding fix applied to every element (the oracle that the faster one must equal
    bit for bit)."""
    a64, b64, c64 = (np.asarray(v, np.float32).astype(np.float64) for v in (a, b, c))
    with np.errstate(all="ignore"):
        p = a64 * b64
        s = np.asarray(p + c64)
        return ref._double_rounding_fix(np.broadcast_to(p, s.shape), np.broadcast_to(c64, s.shape), s,
                                        s.astype(np.float32))


def test_fma_f32_equals_the_every_element_version(rng):
    """fma_f32 checks only the elements whose float64 sum has 25 significant bits or fewer for
    double rounding; it equals the version that checked every element, bit for bit and in shape:
    the exactness cases, small integers and halves (sums that land on float32 midpoints, exact or
    not, many of them), non-finite and signed-zero operands, and broadcasting (scalars, 0-d)."""
    a, b, c = fma_cases(rng)
    n = 20000
    ia = rng.integers(-2 ** 12, 2 ** 12, n) * np.exp2(rng.integers(-14, 14, n))
    ib = rng.integers(-2 ** 12, 2 ** 12, n) * np.exp2(rng.integers(-14, 14, n))
    ic = (1 + rng.integers(0, 2 ** 23, n) * 2.0 ** -23) * np.exp2(rng.integers(-20, 20, n)) * rng.choice([-1, 1], n)
    odd = np.array([np.inf, -np.inf, np.nan, 0.0, -0.0, 2.0 ** -149, -(2.0 ** -149), 3.4e38, 2.0 ** -126])
    oa, ob, oc = (x.reshape(-1) for x in np.meshgrid(odd, odd, odd, indexing="ij"))
    cases = [(a, b, c), (ia, ib, ic), (ia, ib, -ia * ib), (oa, ob, oc),
             (a, np.float32(0.5), np.float32(1.0)), (np.float32(3.0), b, c), (np.float32(3.0), np.float32(5.0), c),
             (np.float32(2.0 ** -24 + 2.0 ** -47), np.float32(1 - 2.0 ** -23), np.float32(1 + 2.0 ** -23)),
             (a.reshape(-1, 1)[:50], b[:40], c[:40]), (np.float32(2.0), np.float32(3.0), np.float32(1.0))]
    hits = 0
    for x, y, z in cases:
        x, y, z = (np.asarray(v, np.float32) for v in (x, y, z))
        got, want = ref.fma_f32(x, y, z), fma_f32_every_element(x, y, z)
        assert got.dtype == want.dtype == np.float32 and got.shape == want.shape
        assert got.tobytes() == want.tobytes()
        with np.errstate(all="ignore"):
            naive = (x.astype(np.float64) * y + z).astype(np.float32)
        hits += np.count_nonzero((got != naive) & ~np.isnan(got))
    assert hits >= 3  # the double-rounding fix did change results (the traps and the integer sums)


# ---- activations -----------------------------------------------------------------------------
SQRT_2_PI = math.sqrt(2 / math.pi)


def gelu64(x, approximate):
    x = np.asarray(x, np.float64)
    if approximate == "tanh":
        return 0.5 * x * (1 + np.tanh(SQRT_2_PI * (x + 0.044715 * x ** 3)))
    return 0.5 * x * (1 + np.vectorize(math.erf)(x / math.sqrt(2)))


def dgelu64(x, approximate):
    x = np.asarray(x, np.float64)
    if approximate == "tanh":
        th = np.tanh(SQRT_2_PI * (x + 0.044715 * x ** 3))
        return 0.5 * (1 + th) + 0.5 * x * (1 - th ** 2) * SQRT_2_PI * (1 + 3 * 0.044715 * x ** 2)
    return 0.5 * (1 + np.vectorize(math.erf)(x / math.sqrt(2))) + x * np.exp(-x * x / 2) / math.sqrt(2 * math.pi)


GRID = np.linspace(-10, 10, 40001).astype(np.float32)
APPROX = ["tanh", "none"]


@pytest.mark.parametrize("approximate", APPROX)
def test_gelu_against_float64(approximate):
    g = ref.gelu_f32(GRID, approximate)
    assert g.dtype == np.float32
    assert np.max(np.abs(g - gelu64(GRID, approximate))) <= 2e-6
    t = torch.nn.functional.gelu(torch.from_numpy(GRID.astype(np.float64)), approximate=approximate).numpy()
    assert np.max(np.abs(g - t)) <= 2e-6


@pytest.mark.parametrize("approximate", APPROX)
def test_dgelu_against_float64(approximate):
    d = ref.dgelu_f32(GRID, approximate)
    assert d.dtype == np.float32
    assert np.max(np.abs(d - dgelu64(GRID, approximate))) <= 2e-6
    x = torch.from_numpy(GRID.astype(np.float64)).requires_grad_()
    torch.nn.functional.gelu(x, approximate=approximate).sum().backward()
    assert np.max(np.abs(d - x.grad.numpy())) <= 2e-6


@pytest.mark.parametrize("approximate", APPROX)
def test_dgelu_is_the_derivative_of_gelu(approximate):
    """Central differences of the library's own float32 gelu agree with its dgelu."""
    h = 2.0 ** -8
    x = GRID[::7]
    fd = (ref.gelu_f32(x + f32(h), approximate).astype(np.float64)
          - ref.gelu_f32(x - f32(h), approximate).astype(np.float64)) / (2 * h)
    assert np.max(np.abs(ref.dgelu_f32(x, approximate) - fd)) <= 5e-4


@pytest.mark.parametrize("approximate", APPROX)
def test_activation_special_values(approximate):
    x = np.array([np.inf, -np.inf, np.nan, 0.0, -0.0, 1e30, -1e30, 3e38, -3e38, 2.0 ** -140], np.float32)
    g = ref.gelu_f32(x, approximate)
    assert g[0] == np.inf
    # gelu(-inf) is NaN, as jax.nn.gelu and torch's tanh gelu give (-inf * 0 in every formulation).
    assert np.isnan(g[1])
    assert np.isnan(g[2])
    assert g.view(np.uint32)[3] == 0x00000000 and g.view(np.uint32)[4] == 0x80000000  # +-0 keep their sign
    assert g[5] == f32(1e30) and g[7] == f32(3e38)  # huge: identity
    assert g[6] == 0 and g[8] == 0  # huge negative: (-)0
    assert g[9] == f32(2.0 ** -141)  # x/2 near 0, denormal kept
    d = ref.dgelu_f32(x, approximate)
    np.testing.assert_array_equal(d[[0, 1, 3, 4, 5, 6, 7, 8, 9]], [1, 0, 0.5, 0.5, 1, 0, 1, 0, 0.5])
    assert np.isnan(d[2])


def test_activation_rejects_bad_approximate():
    with pytest.raises(ValueError, match="approximate must be 'tanh' or 'none'; got 'erf'"):
        ref.gelu_quantize(np.ones(3, np.float32), f32(1.0), approximate="erf")
    with pytest.raises(ValueError, match="approximate"):
        ref.dgelu_quantize(np.ones(3, np.float32), np.ones(3, np.float32), f32(1.0), approximate=None)


@pytest.mark.parametrize("approximate", APPROX)
@pytest.mark.parametrize("dtype", IN_DTYPES, ids=IN_IDS)
def test_gelu_quantize_is_cast_of_gelu(approximate, dtype, rng):
    x = (rng.standard_normal((33, 47)) * 4).astype(dtype)
    x[0, 0] = np.nan
    r = ref.gelu_quantize(x, f32(16.0), "e4m3", approximate, transpose=True)
    y = ref.gelu_f32(x.astype(np.float32), approximate)
    np.testing.assert_array_equal(r.data.view(np.uint8), oracle_fp8(y * f32(16.0), E4M3))
    np.testing.assert_array_equal(r.data_t.view(np.uint8), r.data.view(np.uint8).T)
    assert np.isnan(r.amax)
    r2 = ref.gelu_quantize(x[1:], f32(16.0), "e4m3", approximate)
    assert r2.amax == np.max(np.abs(y[1:]))  # amax of the activation output, not of x


@pytest.mark.parametrize("approximate", APPROX)
@pytest.mark.parametrize("shape", [(64, 128), (303, 300), (1, 1), (7,), (2, 9, 13)],
                         ids=["aligned-64x128", "ragged-303x300", "1x1", "1d-7", "3d-2x9x13"])
def test_dgelu_quantize_and_dbias(approximate, shape, rng):
    dy = (rng.standard_normal(shape) * 1e-3).astype(np.float32)
    x = (rng.standard_normal(shape) * 3).astype(np.float32)
    r = ref.dgelu_quantize(dy, x, f32(2.0 ** 12), "e5m2", approximate, transpose=True, dbias=True)
    dx = dy * ref.dgelu_f32(x, approximate)
    np.testing.assert_array_equal(r.data.view(np.uint8), oracle_fp8(dx * f32(2.0 ** 12), E5M2))
    assert r.amax == np.max(np.abs(dx.astype(np.float64)))
    n = shape[-1]
    dx64 = (dy.astype(np.float64) * dgelu64(x, approximate)).reshape(-1, n)
    assert r.dbias.dtype == np.float32 and r.dbias.shape == (n,)
    tol = 1e-5 * np.abs(dx64).sum(axis=0)  # relative to the column's magnitude (sums can cancel)
    assert np.all(np.abs(r.dbias - dx64.sum(axis=0)) <= tol)
    np.testing.assert_array_equal(r.data_t.view(np.uint8), r.data.reshape(-1, n).view(np.uint8).T)
    assert ref.dgelu_quantize(dy, x, f32(1.0), "e5m2", approximate).dbias is None


def test_dgelu_quantize_empty_dbias_is_zero():
    r = ref.dgelu_quantize(np.zeros((0, 16), np.float32), np.zeros((0, 16), np.float32), f32(1.0), dbias=True)
    assert r.amax == 0 and r.data.shape == (0, 16)
    np.testing.assert_array_equal(r.dbias, np.zeros(16, np.float32))


def test_dgelu_quantize_shape_mismatch():
    with pytest.raises(ValueError, match="dy and x must have the same shape"):
        ref.dgelu_quantize(np.ones((2, 3), np.float32), np.ones((3, 2), np.float32), f32(1.0))


# ---- dequantize ------------------------------------------------------------------------------
def f32_to_bf16_bits(v: np.ndarray) -> np.ndarray:
    """Round-to-nearest-even float32 -> bfloat16 by integer arithmetic (finite and inf inputs)."""
    b = v.astype(np.float32).view(np.uint32).astype(np.uint64)
    return ((b + 0x7FFF + ((b >> 16) & 1)) >> 16).astype(np.uint16)


@pytest.mark.filterwarnings("ignore:overflow encountered in cast:RuntimeWarning")  # 1e4 * 57344 > fp16 max
@pytest.mark.parametrize("scale_inv", [1.0, 2.0 ** -7, 3.0, 1e-3, 1e4], ids=["1", "2^-7", "3", "1e-3", "1e4"])
@pytest.mark.parametrize("out", IN_DTYPES, ids=IN_IDS)
@pytest.mark.parametrize("fmt", FMTS, ids=FMT_IDS)
def test_dequantize_all_codes(fmt, out, scale_inv):
    q = np.arange(256, dtype=np.uint8).view(fmt.numpy_dtype)
    got = ref.dequantize(q, np.array([scale_inv], np.float32), out)
    assert got.dtype == out and got.shape == (256,)
    with np.errstate(over="ignore", invalid="ignore"):
        v = decode_all(fmt).astype(np.float32) * f32(scale_inv)  # fp8 -> fp32 exact, one fp32 multiply
        nan = np.isnan(v)
        if out == BF16:
            expect = f32_to_bf16_bits(v)
            got_bits = got.view(np.uint16)
        elif out == np.float16:
            expect = v.astype(np.float16).view(np.uint16)
            got_bits = got.view(np.uint16)
        else:
            expect = v.view(np.uint32)
            got_bits = got.view(np.uint32)
    np.testing.assert_array_equal(got_bits[~nan], expect[~nan])
    canonical = {BF16: 0x7FC0, np.dtype(np.float16): 0x7E00, np.dtype(np.float32): 0x7FC00000}[np.dtype(out)]
    assert np.all(got_bits[nan] == canonical)  # the dtype's canonical NaN, as the kernel writes
    assert nan.sum() == (2 if fmt.name == "e4m3" else 6)


# ---- the activation a kernel quantizes -------------------------------------------------------
@pytest.mark.parametrize("approximate", APPROX)
@pytest.mark.parametrize("dtype", IN_DTYPES, ids=IN_IDS)
def test_activation_is_what_each_op_quantizes(approximate, dtype, rng):
    x = (rng.standard_normal((9, 11)) * 4).astype(dtype)
    dy = (rng.standard_normal((9, 11)) * 1e-3).astype(dtype)
    ident = ref.activation("identity", x)
    assert ident.dtype == np.float32 and ident.tobytes() == ref.to_float32(x).tobytes()
    g = ref.activation("gelu", x, approximate=approximate)
    assert g.tobytes() == ref.gelu_f32(x.astype(np.float32), approximate).tobytes()
    d = ref.activation("dgelu", dy, x, approximate)
    want = (dy.astype(np.float32) * ref.dgelu_f32(x.astype(np.float32), approximate)).astype(np.float32)
    assert d.dtype == np.float32 and d.tobytes() == want.tobytes()
    # the quantize functions quantize exactly these values
    assert ref.gelu_quantize(x, f32(8.0), "e4m3", approximate).data.tobytes() == \
        ref.finish(g, ref.amax(g), f32(8.0), "e4m3", False).data.tobytes()
    assert ref.dgelu_quantize(dy, x, f32(8.0), "e5m2", approximate).data.tobytes() == \
        ref.cast_to_fp8(d * f32(8.0), "e5m2").tobytes()
    with pytest.raises(ValueError, match="approximate must be 'tanh' or 'none'"):
        ref.activation("gelu", x, approximate="erf")


def test_to_float32_is_exact_and_refuses_other_dtypes():
    x = np.array([1.0, -2.5, 65504.0, 2.0 ** -24], np.float16)
    assert ref.to_float32(x).tolist() == [1.0, -2.5, 65504.0, 2.0 ** -24]
    b = np.array([3.0, 1e-39], np.float32).astype(BF16)
    assert ref.to_float32(b).tobytes() == b.astype(np.float32).tobytes()
    with pytest.raises(TypeError, match="x must be float32, float16 or bfloat16; got float64"):
        ref.to_float32(np.ones(2))
