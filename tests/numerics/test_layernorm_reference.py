"""The LayerNorm + FP8 twins (fusedfp8/numerics/layernorm.py, the NumPy reference of
cuda_src/layernorm_quantize.cu, and its jax.numpy twin in fusedfp8/numerics/jnp_layernorm.py).

The reference gets its own oracles: float64 LayerNorm (and torch's) within float32 accuracy, and
a lane-by-lane emulation of the kernel's reduction (the xor-butterflies it runs, not the halving
trees the reference writes) that must give the reference's bits. The jax.numpy twin is compared
with the reference byte for byte under jax.jit on the CPU: shapes with ragged columns, one row,
3-D, several eps, non-finite rows, missing weight / bias, and the first step's current scale."""
import jax
import ml_dtypes
import numpy as np
import pytest
import torch

from fusedfp8.formats import get_format
from fusedfp8.numerics import jnp as jn
from fusedfp8.numerics import jnp_layernorm as jln
from fusedfp8.numerics import layernorm as ln
from fusedfp8.numerics import reference as ref

f32 = np.float32
BF16 = np.dtype(ml_dtypes.bfloat16)
DTYPES = {"f32": np.dtype(np.float32), "f16": np.dtype(np.float16), "bf16": BF16}


def u32(a) -> np.ndarray:
    return np.asarray(a, f32).view(np.uint32)


def data(rng, shape, dtype=np.float32, offset=1.5, spread=3.0) -> np.ndarray:
    """Plain activations: a per-row offset and spread (LayerNorm inputs are rarely centred)."""
    rows = int(np.prod(shape[:-1], dtype=np.int64))
    x = rng.standard_normal((rows, shape[-1])) * spread * rng.uniform(0.1, 2, (rows, 1)) + offset * rng.standard_normal(
        (rows, 1))
    return x.astype(np.float32).astype(dtype).reshape(shape)


def params(rng, cols, dtype=np.float32):
    return ((1 + 0.2 * rng.standard_normal(cols)).astype(np.float32).astype(dtype),
            (0.1 * rng.standard_normal(cols)).astype(np.float32).astype(dtype))


# ---- the layout ----------------------------------------------------------------------------------
@pytest.mark.parametrize("cols, threads, steps", [(1, 32, 1), (8, 32, 1), (300, 32, 2), (1024, 32, 4), (1025, 64, 3),
                                                  (2048, 64, 4), (4096, 128, 4), (8192, 256, 4), (16384, 512, 4),
                                                  (16392, 512, 5), (40000, 512, 10)])
def test_layout(cols, threads, steps):
    """Threads per row: the fewest (a power of two from 32) that hold the row in 4 chunks of 8 each,
    at most 512; the chunk steps a thread takes."""
    assert ln.layout(cols) == (threads, steps)
    assert ln.threads_per_row(cols) == threads


def kernel_row_sum(v: np.ndarray) -> np.ndarray:
    """The kernel's reduction, emulated lane by lane: per thread 8 position sums over its chunks
    (t, t + T, ...), the in-thread halving tree, then the xor-butterflies the kernel runs (over the
    32 lanes of each warp, then over lanes 0..W-1 holding the warp sums, the other lanes 0); every
    lane of a butterfly must end with the same bits."""
    rows, cols = v.shape
    T, _ = ln.layout(cols)
    chunks = -(-cols // 8)
    out = np.empty(rows, f32)
    for r in range(rows):
        acc = np.zeros((T, 8), f32)
        for c in range(chunks):  # thread c % T adds its chunk c // T-th
            seg = np.zeros(8, f32)
            seg[:min(8, cols - 8 * c)] = v[r, 8 * c:8 * c + 8]
            acc[c % T] = acc[c % T] + seg
        a = acc
        for h in (4, 2, 1):
            a = np.concatenate([a[:, :h] + a[:, h:2 * h], a[:, 2 * h:]], axis=1)
        lane_vals = a[:, 0].reshape(T // 32, 32)
        for o in (16, 8, 4, 2, 1):
            lane_vals = lane_vals + lane_vals[:, np.arange(32) ^ o]
        assert (u32(lane_vals) == u32(lane_vals[:, :1])).all()
        W = T // 32
        w = np.zeros(32, f32)
        w[:W] = lane_vals[:, 0]
        o = W // 2
        while o >= 1:
            w = w + w[np.arange(32) ^ o]
            o //= 2
        assert (u32(w[:W]) == u32(w[0])).all()
        out[r] = w[0]
    return out


@pytest.mark.parametrize("cols", [1, 7, 8, 33, 300, 1024, 1031, 4100, 9000, 20000])
def test_row_sum_is_the_kernels_order(cols, rng):
    """The vectorised reference sum is bitwise the emulated kernel's, on data with cancellation,
    a large offset and mixed magnitudes (where another order would differ), and differs from a plain
    sequential sum (the order is not an accident of the data)."""
    v = np.concatenate([data(rng, (2, cols), offset=1000.0),
                        (rng.standard_normal((1, cols)) * np.exp2(rng.integers(-20, 20, (1, cols)))).astype(f32)])
    got = ln.row_sum(v)
    assert (u32(got) == u32(kernel_row_sum(v))).all()
    if cols >= 300:
        seq = np.array([np.add.accumulate(row, dtype=f32)[-1] for row in v])
        assert (u32(seq) != u32(got)).any()


def test_row_sum_of_negative_zeros_is_plus_zero():
    """The sums start at +0: a row of -0 sums to +0 in every position (as the kernel's)."""
    v = np.full((2, 300), -0.0, f32)
    assert (u32(ln.row_sum(v)) == 0).all()
    _, mean, _ = ln.layernorm_f32(v, None, None, 1e-5)
    assert (u32(mean) == 0).all()


# ---- the reference against float64 ----------------------------------------------------------------
def layernorm64(x, w, b, eps):
    x = np.asarray(x).astype(np.float64)
    mean = x.mean(-1)
    var = ((x - mean[..., None]) ** 2).mean(-1)
    rstd = 1 / np.sqrt(var + eps)
    y = (x - mean[..., None]) * rstd[..., None]
    if w is not None:
        y = y * np.asarray(w).astype(np.float64)
    if b is not None:
        y = y + np.asarray(b).astype(np.float64)
    return y, mean.reshape(-1), rstd.reshape(-1)


@pytest.mark.parametrize("eps", [1e-5, 1e-6, 1e-2, 0.0])
@pytest.mark.parametrize("dtype", list(DTYPES))
@pytest.mark.parametrize("shape", [(64, 1024), (9, 4096), (33, 300), (1, 8), (3, 5, 40), (4, 20000)],
                         ids=lambda s: "x".join(map(str, s)))
def test_reference_is_layernorm_in_float32_accuracy(shape, dtype, eps, rng):
    x = data(rng, shape, DTYPES[dtype])
    w, b = params(rng, shape[-1])
    y, mean, rstd = ln.layernorm_f32(x, w, b, eps)
    y64, mean64, rstd64 = layernorm64(x, w, b, eps)
    cols = shape[-1]
    scale = np.abs(np.asarray(x, np.float64)).reshape(-1, cols).max(-1)
    assert np.all(np.abs(mean - mean64) <= 4e-7 * scale + 1e-30)
    assert np.all(np.abs(rstd - rstd64) <= 2e-6 * rstd64)
    assert np.abs(y - y64).max() <= 4e-6 * max(1.0, np.abs(y64).max())
    assert y.dtype == mean.dtype == rstd.dtype == np.float32 and mean.shape == rstd.shape == (scale.size,)


def test_reference_agrees_with_torch_layer_norm(rng):
    x = data(rng, (16, 1024))
    w, b = params(rng, 1024)
    y, _, _ = ln.layernorm_f32(x, w, b, 1e-5)
    t = torch.nn.functional.layer_norm(torch.from_numpy(x).double(), (1024,), torch.from_numpy(w).double(),
                                       torch.from_numpy(b).double(), 1e-5).numpy()
    assert np.abs(y - t).max() <= 4e-6 * np.abs(t).max()


def test_missing_weight_and_bias_are_exact_identities(rng):
    """No weight is a weight of 1 and no bias a bias of -0: the same bits (signed zeros included)."""
    x = data(rng, (7, 300))
    x[2] = 3.0  # a constant row: d = 0 everywhere, y = +-0 + bias
    x[3, :150] = -0.0
    x[3, 150:] = 0.0
    y0, m0, r0 = ln.layernorm_f32(x, None, None, 1e-5)
    y1, m1, r1 = ln.layernorm_f32(x, np.ones(300, f32), np.full(300, -0.0, f32), 1e-5)
    assert u32(y0).tobytes() == u32(y1).tobytes() and u32(m0).tobytes() == u32(m1).tobytes()
    assert u32(r0).tobytes() == u32(r1).tobytes()


def test_non_finite_rows():
    x = np.ones((6, 40), f32) * np.arange(40, dtype=f32)
    x[0, 3] = np.nan
    x[1, 5] = np.inf
    x[2, 5], x[2, 6] = np.inf, -np.inf
    x[3] = 7.0  # constant
    x[4, :] = 3e38  # the sum overflows: mean inf
    y, mean, rstd = ln.layernorm_f32(x, None, None, 1e-5)
    for r in (0, 1, 2, 4):
        assert np.isnan(y[r]).all(), r
    assert np.isnan(mean[[0, 2]]).all() and mean[1] == np.inf and mean[4] == np.inf
    assert np.isnan(rstd[[0, 1, 2]]).all() and rstd[4] == 0  # (d = -inf, var inf: rstd 0, y = -inf * 0)
    assert (u32(mean[np.isnan(mean)]) == 0x7FC00000).all() and (u32(rstd[np.isnan(rstd)]) == 0x7FC00000).all()
    assert (y[3] == 0).all() and rstd[3] == f32(1) / np.sqrt(f32(1e-5))
    assert np.isfinite(y[5]).all()
    y0, _, r0 = ln.layernorm_f32(x[3:4], None, None, 0.0)  # constant row, eps 0: rstd inf, y NaN
    assert r0[0] == np.inf and np.isnan(y0).all()


def test_quantize_is_finish_of_y(rng):
    x = data(rng, (33, 300), BF16)
    w, b = params(rng, 300, BF16)
    y, mean, rstd = ln.layernorm_f32(x, w, b, 1e-5)
    got, m2, r2 = ln.layernorm_quantize(x, w, b, 1e-5, f32(32.0), "e4m3", transpose=True)
    want = ref.finish(y, ref.amax(y), f32(32.0), "e4m3", True)
    assert got.data.tobytes() == want.data.tobytes() and got.data_t.tobytes() == want.data_t.tobytes()
    assert got.amax == want.amax and got.data_t.shape == (300, 33)
    assert u32(m2).tobytes() == u32(mean).tobytes() and u32(r2).tobytes() == u32(rstd).tobytes()


@pytest.mark.parametrize("shape, pad_to", [((33, 300), 16), ((3, 5, 40), 16), ((1, 8), 3), ((32, 64), 16)])
def test_padded_quantize_is_the_result_in_a_corner_of_zeros(shape, pad_to, rng):
    """pad_to: data is y's (rows, cols) view rounded up to multiples of pad_to, data_t its transpose,
    zeros in the pad (reference.pad2d); amax, mean and rstd those of the unpadded call."""
    x = data(rng, shape, BF16)
    w, b = params(rng, shape[-1])
    plain, mean, rstd = ln.layernorm_quantize(x, w, b, 1e-5, f32(8.0), "e4m3", transpose=True)
    got, m2, r2 = ln.layernorm_quantize(x, w, b, 1e-5, f32(8.0), "e4m3", transpose=True, pad_to=pad_to)
    rows, cols = int(np.prod(shape[:-1])), shape[-1]
    prows, pcols = -(-rows // pad_to) * pad_to, -(-cols // pad_to) * pad_to
    assert got.data.shape == (prows, pcols) and got.data_t.shape == (pcols, prows)
    assert got.data.tobytes() == ref.pad2d(plain.data.reshape(rows, cols), prows, pcols).tobytes()
    assert got.data_t.tobytes() == ref.pad2d(plain.data_t, pcols, prows).tobytes()
    assert u32(got.amax).tobytes() == u32(plain.amax).tobytes()
    assert u32(m2).tobytes() == u32(mean).tobytes() and u32(r2).tobytes() == u32(rstd).tobytes()
    for bad in (0, -16, 1.5, True):
        with pytest.raises(ValueError, match="pad_to must be a positive int"):
            ln.layernorm_quantize(x, w, b, 1e-5, f32(8.0), pad_to=bad)


def test_reference_refuses_a_wrong_parameter_shape():
    with pytest.raises(ValueError, match=r"weight must have shape \(8,\)"):
        ln.layernorm_f32(np.ones((2, 8), f32), np.ones(7, f32), None, 1e-5)
    with pytest.raises(ValueError, match="at least 1 dimension"):
        ln.layernorm_f32(np.float32(1), None, None, 1e-5)


# ---- the jax.numpy twin ---------------------------------------------------------------------------
def test_sqrt_rn_is_ieee(rng):
    """jnp.sqrt_rn is NumPy's float32 sqrt bit for bit: random bit patterns (denormals among them),
    specials, squares and their neighbours."""
    v = rng.integers(0, 2**32, 200_000, dtype=np.uint64).astype(np.uint32).view(f32)
    sq = (rng.uniform(1, 2, 2000) * np.exp2(rng.integers(-70, 60, 2000))).astype(f32)
    sq = (sq * sq).astype(f32)
    edge = np.array([0.0, -0.0, np.inf, -np.inf, np.nan, 1e-45, 2e-45, 1.1754942e-38, 1.1754944e-38, 3.4028235e38, 1,
                     2, 4, 0.25, -1, 1e-5, 1e-5 + 1e-12], f32)
    v = np.concatenate([v, sq, np.nextafter(sq, f32(np.inf)), np.nextafter(sq, f32(0)), edge])
    got = np.asarray(jax.jit(jln.sqrt_rn)(v))
    with np.errstate(invalid="ignore"):
        want = np.sqrt(v)
    nan = np.isnan(want)
    assert np.array_equal(np.isnan(got), nan)
    assert np.array_equal(u32(got)[~nan], u32(want)[~nan])


JNP_CASES = {  # id: (shape, input dtype, param dtype or None, eps)
    "64x1024-bf16": ((64, 1024), "bf16", "f32", 1e-5),
    "33x300-f32": ((33, 300), "f32", "f32", 1e-5),
    "4x4100-f16-f16params": ((4, 4100), "f16", "f16", 1e-6),
    "1x8-bf16-bf16params": ((1, 8), "bf16", "bf16", 1e-5),
    "3x5x7-f32-no-params": ((3, 5, 7), "f32", None, 1e-2),
    "2x20000-bf16": ((2, 20000), "bf16", "f32", 0.0),
}


@pytest.mark.parametrize("case", list(JNP_CASES))
def test_jnp_layernorm_matches_reference(case, rng):
    """y, mean, rstd, the FP8 bytes (with transpose) and amax of the jax.numpy twin under jax.jit
    equal the reference's, with rows of every kind: plain, NaN, +inf, +-inf, constant, -0."""
    shape, dtype, pdtype, eps = JNP_CASES[case]
    x = data(rng, shape, DTYPES[dtype]).reshape(-1, shape[-1])
    special = {0: np.nan, 1: np.inf, 2: -np.inf}
    for r, v in special.items():
        if r < x.shape[0] and x.shape[0] > 3:
            x[r, r % shape[-1]] = v
    if x.shape[0] > 4:
        x[3] = 1.25
        x[4] = -0.0
        x[4, 0] = 0.0
    x = x.reshape(shape)
    w, b = params(rng, shape[-1], DTYPES[pdtype]) if pdtype else (None, None)
    # (both functions in one program: one compile per case)
    fn = jax.jit(lambda x, w, b: (jln.layernorm_quantize(x, w, b, eps, f32(8.0), "e4m3", transpose=True),
                                  jln.layernorm_f32(x, w, b, eps)[0]))
    quantized, y = fn(x, w, b)
    q, q_t, amax, mean, rstd = (np.asarray(a) for a in quantized)
    want, wmean, wrstd = ln.layernorm_quantize(x, w, b, eps, f32(8.0), "e4m3", transpose=True)
    assert q.tobytes() == want.data.view(np.uint8).tobytes()
    assert q_t.tobytes() == want.data_t.view(np.uint8).tobytes()
    assert u32(amax).tobytes() == u32(want.amax).tobytes()
    assert u32(mean).tobytes() == u32(wmean).tobytes() and u32(rstd).tobytes() == u32(wrstd).tobytes()
    wy, _, _ = ln.layernorm_f32(x, w, b, eps)
    y, wy = np.asarray(y), np.asarray(wy)
    same = (u32(y) == u32(wy)) | (np.isnan(y) & np.isnan(wy))
    assert same.all()


@pytest.mark.parametrize("fmt", ["e4m3", "e5m2"])
def test_jnp_first_step_scale_matches_reference(fmt, rng):
    """The first step quantizes with the current scale of amax(y) (the same rule on both sides),
    here a tiny-valued LayerNorm output (weight 1e-4) that scale 1 would flush in E5M2."""
    x = data(rng, (16, 256), BF16)
    w, b = np.full(256, 1e-4, f32), np.zeros(256, f32)
    f = get_format(fmt)
    y, _, _ = ln.layernorm_f32(x, w, b, 1e-5)
    s_ref = ref.current_scale(ref.amax(y), fmt, 1.0, f32(1.0))

    def step(x):
        y, _, _ = jln.layernorm_f32(x, w, b, 1e-5)
        s = jn.current_scale(jn.amax(y), f, 1.0, jax.numpy.float32(1.0))
        q, _, a, _, _ = jln.layernorm_quantize(x, w, b, 1e-5, s, fmt)
        return q, a, s

    q, a, s = (np.asarray(v) for v in jax.jit(step)(x))
    assert u32(s) == u32(s_ref) and s_ref > 1000
    want, _, _ = ln.layernorm_quantize(x, w, b, 1e-5, s_ref, fmt)
    assert q.tobytes() == want.data.view(np.uint8).tobytes() and (q & 0x7F).any()
    assert u32(a) == u32(want.amax)
