"""GPU kernels against the NumPy reference, byte for byte. Skipped (with the probe's reason)
where there is no usable GPU; run on the GPU machine before any kernel change is called done."""
from __future__ import annotations

import ml_dtypes
import numpy as np
import pytest

from fusedfp8 import _cuda, ops
from fusedfp8 import reference as ref
from fusedfp8.recipe import DelayedScaling
from fusedfp8.state import ScalingState

GPU_OK, GPU_REASON = _cuda.probe()
pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not GPU_OK, reason=GPU_REASON)]

torch = pytest.importorskip("torch") if GPU_OK else None

DTYPES = ["float32", "float16", "bfloat16"]
FMTS = ["e4m3", "e5m2"]
SHAPES = {
    "aligned-64x128": (64, 128),
    "aligned-256x1024": (256, 1024),
    "ragged-303x300": (303, 300),
    "ragged-1x1": (1, 1),
    "ragged-7": (7,),
    "ragged-empty-0x16": (0, 16),
    "ragged-65x17": (65, 17),
    "3d-5x3x40": (5, 3, 40),
    "large-2048x4096": (2048, 4096),
}
OPS = ["identity", "gelu_tanh", "gelu_none", "dgelu_tanh", "dgelu_none"]


def edge_values(fmt: str) -> np.ndarray:
    m = 448.0 if fmt == "e4m3" else 57344.0
    tiny = 2.0 ** -9 if fmt == "e4m3" else 2.0 ** -16
    return np.array([0.0, -0.0, m, -m, np.nextafter(np.float32(m), np.float32(np.inf)), 1e30, -1e30,
                     tiny, tiny / 2, tiny * 0.75, -tiny / 2, 1e-40, -1e-40, 1.0, 1.0625, 1.1875, 3.0, np.inf,
                     -np.inf, np.nan], np.float32)


def make_input(rng, shape, dtype, fmt, edges=True):
    """Random values over many binades with edge values sprinkled in (never all zeros)."""
    n = int(np.prod(shape))
    v = (rng.standard_normal(n) * np.exp2(rng.integers(-12, 8, n))).astype(np.float32)
    if edges and n >= 64:
        e = edge_values(fmt)
        idx = rng.choice(n, size=min(len(e), n // 8), replace=False)
        v[idx] = e[: len(idx)]
    np_dtype = ml_dtypes.bfloat16 if dtype == "bfloat16" else np.dtype(dtype)
    return v.astype(np_dtype).reshape(shape)


def to_torch(a: np.ndarray, device="cuda"):
    if a.dtype == ml_dtypes.bfloat16:
        return torch.from_numpy(a.view(np.int16).copy()).view(torch.bfloat16).to(device)
    return torch.from_numpy(a.copy()).to(device)


def torch_bytes(t) -> np.ndarray:
    return t.detach().contiguous().cpu().view(torch.uint8).numpy()


def ref_bytes(a: np.ndarray) -> np.ndarray:
    return np.ascontiguousarray(a).view(np.uint8)


def same_amax(got: np.float32, want: np.float32) -> bool:
    return np.float32(got).tobytes() == np.float32(want).tobytes()


def run_op(op, x, b, scale, fmt, transpose, dbias=False):
    if op == "identity":
        return ops.quantize(x, scale, fmt, transpose=transpose)
    kind, approx = op.split("_")
    if kind == "gelu":
        return ops.gelu_quantize(x, scale, fmt, approximate=approx, transpose=transpose)
    return ops.dgelu_quantize(x, b, scale, fmt, approximate=approx, transpose=transpose, dbias=dbias)


def ref_op(op, x, b, scale, fmt, transpose, dbias=False):
    if op == "identity":
        return ref.quantize(x, scale, fmt, transpose)
    kind, approx = op.split("_")
    if kind == "gelu":
        return ref.gelu_quantize(x, scale, fmt, approx, transpose)
    return ref.dgelu_quantize(x, b, scale, fmt, approx, transpose, dbias)


def check(op, xn, bn, scale, fmt, transpose, dbias=False, x=None, b=None):
    x = to_torch(xn) if x is None else x
    b = (to_torch(bn) if b is None else b) if bn is not None else None
    s = torch.tensor([scale], dtype=torch.float32, device="cuda")
    got = run_op(op, x, b, s, fmt, transpose, dbias)
    want = ref_op(op, xn, bn, np.float32(scale), fmt, transpose, dbias)
    assert got.data.dtype == getattr(torch, want.data.dtype.name)
    assert tuple(got.data.shape) == want.data.shape
    np.testing.assert_array_equal(torch_bytes(got.data), ref_bytes(want.data))
    assert same_amax(got.amax.cpu().numpy()[0], want.amax), (got.amax, want.amax)
    # the kernel hands out 1 / scale in a (1,) buffer of its own, aligned for cuBLASLt
    assert got.scale_inv.shape == (1,) and got.scale_inv.data_ptr() % 16 == 0
    assert same_amax(got.scale_inv.cpu().numpy()[0], np.float32(1) / np.float32(scale))
    if transpose:
        np.testing.assert_array_equal(torch_bytes(got.data_t), ref_bytes(want.data_t))
    if dbias:
        np.testing.assert_allclose(got.dbias.cpu().numpy(), want.dbias, rtol=2e-5, atol=1e-5 * float(
            np.nanmax(np.abs(want.dbias), initial=1.0)))


@pytest.mark.parametrize("shape", list(SHAPES.values()), ids=list(SHAPES))
@pytest.mark.parametrize("fmt", FMTS)
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("transpose", [False, True], ids=["flat", "transpose"])
def test_quantize_matches_reference(dtype, fmt, shape, transpose):
    rng = np.random.default_rng(hash((dtype, fmt, shape, transpose)) % 2**32)
    xn = make_input(rng, shape, dtype, fmt)
    for scale in (1.0, 3.0, 2.0 ** -7):
        check("identity", xn, None, scale, fmt, transpose)


@pytest.mark.parametrize("shape", [(64, 128), (303, 300), (1, 1), (0, 16), (130, 72), (1024, 2048)],
                         ids=["aligned", "ragged", "1x1", "empty", "130x72", "large"])
@pytest.mark.parametrize("op", OPS[1:])
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("transpose", [False, True], ids=["flat", "transpose"])
def test_activation_ops_match_reference(op, dtype, shape, transpose):
    rng = np.random.default_rng(hash((op, dtype, shape, transpose)) % 2**32)
    fmt = "e5m2" if op.startswith("d") else "e4m3"
    xn = make_input(rng, shape, dtype, fmt)
    bn = make_input(rng, shape, dtype, fmt) if op.startswith("d") else None
    check(op, xn, bn, 1.5, fmt, transpose, dbias=op.startswith("d") and transpose)


@pytest.mark.parametrize("shape", [(64, 128), (303, 300), (1, 5), (4096, 8192)], ids=["aligned", "ragged", "1x5", "large"])
@pytest.mark.parametrize("approx", ["tanh", "none"])
@pytest.mark.parametrize("transpose", [False, True], ids=["no-transpose", "transpose"])
def test_dgelu_dbias_matches_reference(shape, approx, transpose):
    rng = np.random.default_rng(7)
    xn = make_input(rng, shape, "bfloat16", "e5m2", edges=False)
    bn = make_input(rng, shape, "bfloat16", "e5m2", edges=False)
    check(f"dgelu_{approx}", xn, bn, 100.0, "e5m2", transpose, dbias=True)


def test_dbias_is_deterministic():
    rng = np.random.default_rng(3)
    dy = to_torch(make_input(rng, (4096, 1024), "bfloat16", "e5m2", edges=False))
    x = to_torch(make_input(rng, (4096, 1024), "bfloat16", "e5m2", edges=False))
    s = torch.ones(1, device="cuda")
    first = ops.dgelu_quantize(dy, x, s, "e5m2", dbias=True, transpose=True).dbias
    for _ in range(5):
        again = ops.dgelu_quantize(dy, x, s, "e5m2", dbias=True, transpose=True).dbias
        assert torch.equal(first.view(torch.int32), again.view(torch.int32))


@pytest.mark.parametrize("offset", [1, 3, 8], ids=lambda o: f"offset{o}")
@pytest.mark.parametrize("dtype", DTYPES)
def test_unaligned_input_pointer(dtype, offset):
    """A slice at an odd element offset: its data pointer is not 16-byte aligned (scalar path)."""
    rng = np.random.default_rng(offset)
    base = make_input(rng, (4096 + offset,), dtype, "e4m3")
    xt = to_torch(base)[offset:]  # offsets 1 and 3 are never 16-byte aligned; 8 is for 2-byte types
    check("identity", base[offset:], None, 2.0, "e4m3", False, x=xt)
    check("gelu_tanh", base[offset:], None, 2.0, "e4m3", False, x=xt)
    x2 = xt[: 4000].view(40, 100)
    check("identity", base[offset:offset + 4000].reshape(40, 100), None, 2.0, "e4m3", True, x=x2)


def test_nan_inf_amax_and_canonical_nan():
    for fmt in FMTS:
        x = torch.tensor([1.0, float("nan"), -float("nan"), float("inf"), -2.0], device="cuda")
        r = ops.quantize(x, torch.ones(1, device="cuda"), fmt)
        assert np.isnan(r.amax.cpu().numpy()[0])
        assert r.amax.cpu().view(torch.int32).item() == 0x7FC00000
        b = torch_bytes(r.data)
        want = ref_bytes(ref.quantize(x.cpu().numpy(), np.float32(1), fmt).data)
        np.testing.assert_array_equal(b, want)


def test_amax_accumulates_with_max_in_place():
    x1 = torch.full((1000,), 2.0, device="cuda")
    x2 = torch.full((1000,), -5.0, device="cuda")
    amax = torch.zeros(1, device="cuda")
    s = torch.ones(1, device="cuda")
    r = ops.quantize(x2, s, amax=amax)
    assert r.amax.data_ptr() == amax.data_ptr()
    ops.quantize(x1, s, amax=amax)
    assert amax.item() == 5.0
    ops.quantize(torch.tensor([float("nan")], device="cuda"), s, amax=amax)
    assert np.isnan(amax.item())
    ops.quantize(x2, s, amax=amax)
    assert np.isnan(amax.item())


def test_denormal_bf16_amax_not_flushed():
    x = torch.tensor([1e-39, -3e-40], dtype=torch.bfloat16, device="cuda")
    r = ops.quantize(x, torch.ones(1, device="cuda"))
    assert r.amax.item() == float(torch.tensor(1e-39, dtype=torch.bfloat16).float())
    assert r.amax.item() > 0


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("fmt", FMTS)
@pytest.mark.parametrize("n", [0, 1, 17, 4096, 1 << 20])
def test_dequantize_matches_reference(dtype, fmt, n):
    codes = np.arange(n, dtype=np.int64) % 256
    q = torch.from_numpy(codes.astype(np.uint8)).cuda().view(getattr(torch, ref.get_format(fmt).dtype_name))
    for si in (1.0, 0.375, 1e-30):
        s = torch.tensor([si], device="cuda")
        got = ops.dequantize(q, s, dtype)
        want = ref.dequantize(codes.astype(np.uint8).view(ref.get_format(fmt).numpy_dtype), np.float32(si),
                              ml_dtypes.bfloat16 if dtype == "bfloat16" else np.dtype(dtype))
        np.testing.assert_array_equal(torch_bytes(got), np.ascontiguousarray(want).view(np.uint8))


# ---- update_scales ---------------------------------------------------------------------------
def random_history(rng, L, n):
    h = np.abs(rng.standard_normal((L, n)) * np.exp2(rng.integers(-20, 20, (L, n)))).astype(np.float32)
    h[1:][rng.random((L - 1, n)) < 0.1] = 0.0
    row0 = h[0]
    kinds = rng.integers(0, 7, n)
    row0[kinds == 0] = 0.0
    row0[kinds == 1] = np.nan
    row0[kinds == 2] = np.inf
    row0[kinds == 3] = 1e-40  # denormal amax -> scale FLT_MAX
    row0[kinds == 4] = 1e-37
    return h


@pytest.mark.parametrize("L", [1, 2, 31, 1024, 1026, 2500])  # 1026+: more than one roll chunk
@pytest.mark.parametrize("n", [1, 7, 1024])
@pytest.mark.parametrize("algo", ["max", "most_recent"])
@pytest.mark.parametrize("margin", [0, 2])
def test_update_scales_matches_rule(L, n, algo, margin):
    rng = np.random.default_rng(L * 7 + n)
    recipe = DelayedScaling(margin=margin, amax_history_len=L, amax_compute_algo=algo)
    grad = tuple(bool(g) for g in rng.integers(0, 2, n))
    host = ScalingState.create(grad, recipe)
    dev = ScalingState.create(grad, recipe, like=torch.zeros(1, device="cuda"))
    for step in range(4):
        h = random_history(rng, L, n)
        if step:
            h[1:] = host.amax_history[1:]
        host.amax_history[...] = h
        dev.amax_history.copy_(torch.from_numpy(h))
        ops.update_scales(host, recipe)
        ops.update_scales(dev, recipe)
        for name in ("amax_history", "scale", "scale_inv", "overflows", "updates"):
            np.testing.assert_array_equal(torch_bytes(getattr(dev, name)), getattr(host, name).view(np.uint8),
                                          err_msg=f"{name} differs at step {step}")


def test_update_scales_is_one_launch():
    recipe = DelayedScaling(amax_history_len=1024)
    st = ScalingState.create(1024, recipe, like=torch.zeros(1, device="cuda"))
    st.amax_history[0].uniform_(0.5, 2.0)
    ops.update_scales(st, recipe)  # compile + cache the fmt_max array
    st.amax_history[0].uniform_(0.5, 2.0)
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
        ops.update_scales(st, recipe)
        torch.cuda.synchronize()
    kernels = [e for e in prof.events() if e.device_type == torch.autograd.DeviceType.CUDA]
    names = {e.name for e in kernels}
    assert len(kernels) == 1, names
    assert "update_scales" in next(iter(names))


# ---- first step (current scaling) and slots --------------------------------------------------
@pytest.mark.parametrize("first_step", ["current", "unit"])
def test_slot_sequence_matches_host_path(first_step):
    """A few steps of quantize-into-slots + update on the GPU equal the same on the CPU."""
    rng = np.random.default_rng(11)
    recipe = DelayedScaling(amax_history_len=16, first_step=first_step)
    host = ScalingState.create([False, True], recipe, like=torch.zeros(1))
    dev = ScalingState.create([False, True], recipe, like=torch.zeros(1, device="cuda"))
    for step in range(5):
        for mb in range(2):  # two micro-batches per step accumulate into the slots
            xn = (make_input(rng, (96, 64), "bfloat16", "e4m3", edges=False).astype(np.float32)
                  * np.float32(10 ** (step - 2))).astype(ml_dtypes.bfloat16)
            gn = (make_input(rng, (96, 64), "bfloat16", "e5m2", edges=False) * np.float32(1e-5)).astype(ml_dtypes.bfloat16)
            for st, dev_name in ((host, "cpu"), (dev, "cuda")):
                x = to_torch(xn, dev_name)
                g = to_torch(gn, dev_name)
                r0 = ops.quantize(x, st.slot(0, recipe), transpose=True)
                r1 = ops.dgelu_quantize(g, x, st.slot(1, recipe), transpose=True)
                st.__dict__.setdefault("_last", []).append((torch_bytes(r0.data), torch_bytes(r0.data_t),
                                                             torch_bytes(r1.data), torch_bytes(r0.scale_inv),
                                                             torch_bytes(r1.scale_inv)))
                # the scale_inv handed out is the state's (also on a first step, set by this call)
                np.testing.assert_array_equal(torch_bytes(torch.cat([r0.scale_inv, r1.scale_inv])),
                                              torch_bytes(st.scale_inv))
            for a, b in zip(host._last[-1], dev._last[-1]):
                np.testing.assert_array_equal(a, b, err_msg=f"step {step} micro-batch {mb}")
            for name in ("amax_history", "scale", "scale_inv"):
                np.testing.assert_array_equal(torch_bytes(getattr(dev, name)), torch_bytes(getattr(host, name)),
                                              err_msg=f"{name} at step {step} micro-batch {mb}")
        ops.update_scales(host, recipe)
        ops.update_scales(dev, recipe)
        for name in ("amax_history", "scale", "scale_inv", "overflows", "updates"):
            np.testing.assert_array_equal(torch_bytes(getattr(dev, name)), torch_bytes(getattr(host, name)))
    if first_step == "current":
        assert host.updates.tolist() == [5, 5]


def test_first_step_gradient_is_not_flushed():
    """E5M2 with scale 1 flushes 1e-6 gradients to zero; the first step's current scaling keeps them."""
    g = torch.randn(256, 256, device="cuda", dtype=torch.bfloat16) * 1e-6
    for first, nonzero in (("current", True), ("unit", False)):
        r = DelayedScaling(amax_history_len=4, first_step=first)
        st = ScalingState.create([True], r, like=torch.zeros(1, device="cuda"))
        q = ops.quantize(g, st.slot(0, r)).data
        assert (torch_bytes(q) & 0x7F).any() == nonzero, first


# ---- interop: other frameworks, zero copy, streams ------------------------------------------
def test_cupy_arrays():
    cupy = pytest.importorskip("cupy")
    rng = np.random.default_rng(5)
    xn = make_input(rng, (300, 512), "float32", "e4m3")
    x = cupy.asarray(xn)
    r = ops.quantize(x, cupy.ones(1, dtype=cupy.float32), "e4m3", transpose=True)
    assert isinstance(r.data, cupy.ndarray) and r.data.dtype == cupy.uint8
    want = ref.quantize(xn, np.float32(1), "e4m3", True)
    np.testing.assert_array_equal(cupy.asnumpy(r.data), ref_bytes(want.data))
    np.testing.assert_array_equal(cupy.asnumpy(r.data_t), ref_bytes(want.data_t))
    assert same_amax(cupy.asnumpy(r.amax)[0], want.amax)
    back = ops.dequantize(r.data, cupy.ones(1, dtype=cupy.float32), "float32", fmt="e4m3")
    np.testing.assert_array_equal(cupy.asnumpy(back), ref.dequantize(want.data, np.float32(1)))


def test_jax_arrays():
    jax = pytest.importorskip("jax")
    jnp = jax.numpy
    if not any(d.platform == "gpu" for d in jax.devices()):
        pytest.skip("jax has no GPU backend here")
    rng = np.random.default_rng(6)
    xn = make_input(rng, (256, 384), "bfloat16", "e4m3")
    x = jnp.asarray(xn)
    import cupy

    assert cupy.from_dlpack(x).data.ptr == x.unsafe_buffer_pointer()  # the kernels read jax's buffer
    r = ops.quantize(x, jnp.ones(1, jnp.float32), "e4m3", transpose=True)
    assert r.data.dtype == jnp.float8_e4m3fn
    want = ref.quantize(xn, np.float32(1), "e4m3", True)
    np.testing.assert_array_equal(np.asarray(r.data).view(np.uint8), ref_bytes(want.data))
    np.testing.assert_array_equal(np.asarray(r.data_t).view(np.uint8), ref_bytes(want.data_t))
    assert same_amax(np.asarray(r.amax)[0], want.amax)
    # a jax state is immutable: the update returns a new one and leaves the old arrays alone
    recipe = DelayedScaling(amax_history_len=4)
    st = ScalingState.create([False, True], recipe, like=x)
    st = st.replace(amax_history=st.amax_history.at[0].set(jnp.array([2.0, 0.5], jnp.float32)))
    new = ops.update_scales(st, recipe)
    assert np.asarray(st.amax_history)[0].tolist() == [2.0, 0.5] and np.asarray(st.scale).tolist() == [1.0, 1.0]
    host = ScalingState.create([False, True], recipe)
    host.amax_history[0] = [2.0, 0.5]
    ops.update_scales(host, recipe)
    for name in ("amax_history", "scale", "scale_inv", "overflows", "updates"):
        np.testing.assert_array_equal(np.asarray(getattr(new, name)), getattr(host, name))


def test_torch_output_is_allocated_in_fp8_no_copy():
    x = torch.randn(128, 256, device="cuda", dtype=torch.bfloat16)
    amax = torch.zeros(1, device="cuda")
    r = ops.quantize(x, torch.ones(1, device="cuda"), amax=amax)
    assert r.data.dtype == torch.float8_e4m3fn and r.data.is_cuda and r.data.is_contiguous()
    assert r.amax.data_ptr() == amax.data_ptr()
    st = ScalingState.create(2, DelayedScaling(amax_history_len=4), like=torch.zeros(1, device="cuda"))
    sl = st.slot(1, DelayedScaling(amax_history_len=4))
    assert sl.amax.data_ptr() == st.amax_history[0, 1:].data_ptr()
    ops.quantize(x, sl)
    assert st.amax_history[0, 1].item() == x.abs().max().float().item()


def test_non_default_stream_ordering():
    s = torch.cuda.Stream()
    x0 = torch.randn(4096, 4096, device="cuda")
    with torch.cuda.stream(s):
        big = x0 @ x0  # a long producer on the side stream
        x = big * 1e-3
        r = ops.quantize(x, torch.ones(1, device="cuda"), "e4m3", transpose=True)
        done = torch.cuda.Event()
        done.record(s)
    done.synchronize()
    want = ref.quantize(x.cpu().numpy(), np.float32(1), "e4m3", True)
    np.testing.assert_array_equal(torch_bytes(r.data), ref_bytes(want.data))
    np.testing.assert_array_equal(torch_bytes(r.data_t), ref_bytes(want.data_t))


# ---- errors before any launch ----------------------------------------------------------------
def test_errors_leave_state_unchanged():
    recipe = DelayedScaling(amax_history_len=8)
    st = ScalingState.create(2, recipe, like=torch.zeros(1, device="cuda"))
    st.amax_history[0] = 3.0
    before = {k: v.clone() for k, v in st.arrays().items()}
    x = torch.randn(64, 64, device="cuda")
    cases = [
        (lambda: ops.quantize(x, torch.ones(1)), ValueError, "scale is on cpu"),
        (lambda: ops.quantize(x.int(), torch.ones(1, device="cuda")), TypeError, "x must be float32"),
        (lambda: ops.quantize(x.t(), st.slot(0, recipe)), ValueError, "contiguous"),
        (lambda: ops.quantize(x, st.slot(0, recipe), "e5m2"), ValueError, "fmt"),
        (lambda: ops.quantize(x, torch.ones(2, device="cuda")), ValueError, "scale must hold exactly one"),
        (lambda: ops.quantize(x, torch.ones(1, device="cuda", dtype=torch.float64)), TypeError, "scale must be a float32"),
        (lambda: ops.quantize(x, torch.ones(1, device="cuda"), "e3m4"), ValueError, "unsupported FP8 format"),
        (lambda: ops.dgelu_quantize(x, x[:32], st.slot(1, recipe)), ValueError, "same shape"),
        (lambda: ops.update_scales(st, DelayedScaling(amax_history_len=16)), ValueError, "amax_history_len"),
    ]
    if torch.cuda.device_count() > 1:
        cases.append((lambda: ops.quantize(x, torch.ones(1, device="cuda:1")), ValueError, "same device"))
    for fn, exc, match in cases:
        with pytest.raises(exc, match=match):
            fn()
    torch.cuda.synchronize()
    for k, v in st.arrays().items():
        assert torch.equal(v, before[k]), k


# ---- property test ---------------------------------------------------------------------------
hypothesis = pytest.importorskip("hypothesis")
from hypothesis import given, settings, strategies as st_  # noqa: E402


@settings(max_examples=150, deadline=None, derandomize=True)
@given(rows=st_.integers(0, 70), cols=st_.integers(1, 70), offset=st_.integers(0, 9),
       dtype=st_.sampled_from(DTYPES), fmt=st_.sampled_from(FMTS), op=st_.sampled_from(OPS),
       transpose=st_.booleans(), seed=st_.integers(0, 2**31 - 1), log_scale=st_.integers(-20, 20))
def test_property_random_shapes_offsets_values(rows, cols, offset, dtype, fmt, op, transpose, seed, log_scale):
    rng = np.random.default_rng(seed)
    n = rows * cols
    base = make_input(rng, (n + offset,), dtype, fmt)
    other = make_input(rng, (n + offset,), dtype, fmt)
    xn, bn = base[offset:].reshape(rows, cols), other[offset:].reshape(rows, cols)
    x = to_torch(base)[offset:].view(rows, cols)
    b = to_torch(other)[offset:].view(rows, cols)
    check(op, xn, bn if op.startswith("d") else None, float(2.0 ** log_scale), fmt, transpose,
          dbias=op.startswith("d") and transpose, x=x, b=b if op.startswith("d") else None)


@pytest.mark.parametrize("dtype", DTYPES)
def test_zero_dim_input(dtype):
    xn = np.array(3.0, np.float32).astype(ml_dtypes.bfloat16 if dtype == "bfloat16" else dtype)
    check("identity", xn, None, 2.0, "e4m3", False)
    check("gelu_none", xn, None, 2.0, "e4m3", False)
    with pytest.raises(ValueError, match="transpose"):
        ops.quantize(to_torch(xn), torch.ones(1, device="cuda"), transpose=True)
