"""fusedfp8's functions against the NumPy reference, byte for byte, on both sides of the one
launch interface: 'cpu' (numpy, torch CPU and jax CPU arrays: the host path) and 'cuda' (torch
CUDA tensors: the fused kernels). One test body per check; the 'cuda' runs skip with the probe's
reason where there is no usable GPU and must pass on the GPU machine before any kernel change
is called done. Results come back in the caller's framework (FP8 as torch / jax float8, ml_dtypes
float8 for numpy), and the 'large' shapes run on the GPU only."""
from __future__ import annotations

import zlib

import ml_dtypes
import numpy as np
import pytest
import torch

import fusedfp8
from fusedfp8 import launch
from fusedfp8.launch import kernels as K, plans as PL
from fusedfp8.formats import get_format
from fusedfp8.numerics import reference as ref
from fusedfp8.recipe import DelayedScaling
from fusedfp8.state import STATE_FIELDS, ScalingState
from support import shapes as S
from support.frameworks import (BF16, HOST_FRAMEWORKS, assert_type, bytes_of, np_dtype, scalar, to_fw, to_np,
                                to_torch)

DTYPES = ["float32", "float16", "bfloat16"]
FMTS = ["e4m3", "e5m2"]
ACT_OPS = ["gelu_tanh", "gelu_none", "dgelu_tanh", "dgelu_none"]


def frameworks(device: str) -> tuple:
    """The frameworks whose arrays a device's run goes through (cupy and jax on the GPU: test_ops)."""
    return HOST_FRAMEWORKS if device == "cpu" else ("torch",)


def seeded(*key) -> np.random.Generator:
    """A generator seeded from the test's parameters (stable across runs, unlike hash())."""
    return np.random.default_rng(zlib.crc32(repr(key).encode()))


def run_op(op, x, b, scale, fmt, transpose, dbias=False):
    if op == "identity":
        return fusedfp8.quantize(x, scale, fmt, transpose=transpose, dbias=dbias)
    kind, approx = op.split("_")
    if kind == "gelu":
        return fusedfp8.gelu_quantize(x, scale, fmt, approximate=approx, transpose=transpose)
    return fusedfp8.dgelu_quantize(x, b, scale, fmt, approximate=approx, transpose=transpose, dbias=dbias)


def ref_op(op, x, b, scale, fmt, transpose, dbias=False):
    if op == "identity":
        return ref.quantize(x, scale, fmt, transpose, dbias)
    kind, approx = op.split("_")
    if kind == "gelu":
        return ref.gelu_quantize(x, scale, fmt, approx, transpose)
    return ref.dgelu_quantize(x, b, scale, fmt, approx, transpose, dbias)


def check(device, op, xn, bn, scale, fmt, transpose, dbias=False, want=None, inputs=None, fws=None):
    """``op`` on ``xn`` (and ``bn``) through the frameworks ``fws`` (default: every framework of
    ``device``) equals the reference:
    FP8 data, transpose and amax byte for byte, the handed-out scale_inv is 1 / scale in a (1,)
    buffer of its own, dbias bitwise on the host and within float32 summation order on the GPU,
    every result in the caller's framework and dtype. ``inputs`` gives ready (x, b) arrays."""
    want = want if want is not None else ref_op(op, xn, bn, np.float32(scale), fmt, transpose, dbias)
    fdt = get_format(fmt).dtype_name
    for fw in ("torch",) if inputs is not None else fws or frameworks(device):
        x, b = inputs if inputs is not None else (to_fw(xn, fw, device), None if bn is None else to_fw(bn, fw, device))
        got = run_op(op, x, b, scalar(fw, scale, device=device), fmt, transpose, dbias)
        where = f"{fw} on {device}"
        assert_type(got.data, fw, fdt, want.data.shape, device)
        assert bytes_of(got.data) == np.ascontiguousarray(want.data).tobytes(), where
        assert bytes_of(got.amax) == np.float32(want.amax).tobytes(), (where, to_np(got.amax), want.amax)
        assert_type(got.amax, fw, "float32", (1,), device)
        assert_type(got.scale_inv, fw, "float32", (1,), device)
        assert bytes_of(got.scale_inv) == (np.float32(1) / np.float32(scale)).tobytes(), where
        if fw == "torch" and device == "cuda":  # its own buffer, aligned for cuBLASLt
            assert got.scale_inv.data_ptr() % 16 == 0
        if transpose:
            assert_type(got.data_t, fw, fdt, S.transposed(want.data.shape), device)
            assert bytes_of(got.data_t) == np.ascontiguousarray(want.data_t).tobytes(), where
        else:
            assert got.data_t is None
        if dbias:
            assert_type(got.dbias, fw, "float32", (want.data.shape[-1],), device)
            if device == "cpu":
                assert bytes_of(got.dbias) == want.dbias.tobytes(), where
            else:
                np.testing.assert_allclose(to_np(got.dbias), want.dbias, rtol=2e-5, atol=1e-5 * float(
                    np.nanmax(np.abs(want.dbias), initial=1.0)))
        else:
            assert got.dbias is None
    return want


# ---- quantize ----------------------------------------------------------------------------------
@pytest.mark.parametrize("transpose", [False, True], ids=["flat", "transpose"])
@pytest.mark.parametrize("fmt", FMTS)
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("device, shape", S.on_devices(S.ALIGNED, S.RAGGED))
def test_quantize_matches_reference(device, shape, dtype, fmt, transpose):
    xn = S.make_input(seeded(dtype, fmt, shape, transpose), shape, dtype, fmt)
    for scale in (1.0, 3.0, 2.0 ** -7):
        check(device, "identity", xn, None, scale, fmt, transpose)


def test_python_float_scale(device):
    """A Python float is a scale too (stateless use): the same bytes as a 1-element array."""
    xn = S.make_input(seeded("float-scale"), (33, 40), "bfloat16", "e4m3")
    want = ref.quantize(xn, np.float32(16.0), "e4m3", transpose=True)
    for fw in frameworks(device):
        x = to_fw(xn, fw, device)
        for scale in (16.0, 16, np.float32(16.0)):
            got = fusedfp8.quantize(x, scale, "e4m3", transpose=True)
            assert bytes_of(got.data) == want.data.tobytes() and bytes_of(got.data_t) == want.data_t.tobytes(), fw
            assert bytes_of(got.scale_inv) == np.float32(1 / 16).tobytes()
            assert_type(got.amax, fw, "float32", (1,), device)
        g = fusedfp8.gelu_quantize(x, 16.0, "e4m3")
        assert bytes_of(g.data) == ref.gelu_quantize(xn, np.float32(16.0), "e4m3").data.tobytes()


# ---- activations (+ transpose, + dbias) --------------------------------------------------------
ACT_SHAPES = ("aligned-64x128", "ragged-303x300", "ragged-1x1", "ragged-7", "ragged-0x16", "ragged-odd-tail-33x17",
              "ragged-3d-3x5x7", "ragged-130x72")


@pytest.mark.parametrize("transpose", [False, True], ids=["flat", "transpose"])
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("op", ACT_OPS)
@pytest.mark.parametrize("device, shape", S.on_devices(*ACT_SHAPES, large=("large-1024x2048",)))
def test_activation_ops_match_reference(device, shape, op, dtype, transpose):
    """Two inputs per case: many binades with the edge values at scale 1.5 (torch tensors), and
    plain data at a scale that makes the FP8 values meaningful (x spread 4 at 64 for gelu; dy 1e-3
    and x 3 at 2**14 for the gradient; every framework of the device)."""
    grad = op.startswith("d")
    fmt = "e5m2" if grad else "e4m3"
    dbias = grad and transpose
    rng = seeded(op, dtype, shape, transpose)
    xn = S.make_input(rng, shape, dtype, fmt)
    bn = S.make_input(rng, shape, dtype, fmt) if grad else None
    check(device, op, xn, bn, 1.5, fmt, transpose, dbias, fws=("torch",))
    if grad:
        dy = (rng.standard_normal(shape) * 1e-3).astype(np.float32).astype(np_dtype(dtype))
        x = (rng.standard_normal(shape) * 3).astype(np.float32).astype(np_dtype(dtype))
        check(device, op, dy, x, 2.0 ** 14, fmt, transpose, dbias)
    else:
        x = (rng.standard_normal(shape) * 4).astype(np.float32).astype(np_dtype(dtype))
        check(device, op, x, None, 64.0, fmt, transpose)


@pytest.mark.parametrize("transpose", [False, True], ids=["no-transpose", "transpose"])
@pytest.mark.parametrize("approx", ["tanh", "none"])
@pytest.mark.parametrize("device, shape", S.on_devices("aligned-64x128", "ragged-303x300", "ragged-1x5",
                                                      large=("large-4096x8192",)))
def test_dgelu_dbias_matches_reference(device, shape, approx, transpose):
    rng = np.random.default_rng(7)
    xn = S.make_input(rng, shape, "bfloat16", "e5m2", edges=False)
    bn = S.make_input(rng, shape, "bfloat16", "e5m2", edges=False)
    check(device, f"dgelu_{approx}", xn, bn, 100.0, "e5m2", transpose, dbias=True)


@pytest.mark.parametrize("transpose", [False, True], ids=["no-transpose", "transpose"])
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("device, shape", S.on_devices("aligned-64x128", "ragged-303x300", "ragged-1x5", "ragged-0x16",
                                                      large=("large-4096x8192",)))
def test_gradient_dbias_matches_reference(device, shape, dtype, transpose):
    """quantize of a plain gradient with its bias gradient (the identity's dbias kernel): FP8 bytes,
    amax and transpose as the reference's, the column sums bitwise on the host and within float32
    summation order on the GPU."""
    rng = seeded("gradient-dbias", dtype, shape, transpose)
    xn = S.make_input(rng, shape, dtype, "e5m2", edges=False)
    check(device, "identity", xn, None, 100.0, "e5m2", transpose, dbias=True)



@pytest.mark.gpu
def test_dbias_is_deterministic():
    """The tiled kernel's dbias (partial sums per row tile, the last block per column strip adds
    them in order) is the same bits on every run."""
    rng = np.random.default_rng(3)
    dy = to_torch(S.make_input(rng, (4096, 1024), "bfloat16", "e5m2", edges=False), "cuda")
    x = to_torch(S.make_input(rng, (4096, 1024), "bfloat16", "e5m2", edges=False), "cuda")
    s = torch.ones(1, device="cuda")
    first = fusedfp8.dgelu_quantize(dy, x, s, "e5m2", dbias=True, transpose=True).dbias
    for _ in range(5):
        again = fusedfp8.dgelu_quantize(dy, x, s, "e5m2", dbias=True, transpose=True).dbias
        assert torch.equal(first.view(torch.int32), again.view(torch.int32))


# (rows, cols, pad_to): every path of the tiled kernel: full tiles (1024x2048: 128 tiles, one a block, or
# 18-19 a block on a grid of 7), rows and cols % 16 == 8 (8-byte q stores, byte stores of q_t on full
# tiles), ragged edges, unaligned cols (no vector path), padded outputs
TILED_CASES = [(1024, 2048, 1), (136, 1032, 1), (303, 300, 1), (333, 517, 16), (1000, 81, 16), (40, 24, 16)]


@pytest.fixture
def tiled_grid(monkeypatch):
    """``tiled_grid(g=None)``: the tiled kernel's grid fixed to ``g`` blocks (None: the default one)
    for the quantize plans built from now on; the default grid comes back after."""
    grid = PL._tiled_grid

    def use(g=None):  # (set where the plan builders read it)
        monkeypatch.setattr(PL, "_tiled_grid", grid if g is None else lambda ref, sms, rows, cols: g)
        launch.quantize_plan.cache_clear()

    yield use
    monkeypatch.undo()
    launch.quantize_plan.cache_clear()


@pytest.mark.gpu
@pytest.mark.parametrize("op", ["identity", "gelu_tanh", "dgelu_tanh"])
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])  # (float16 takes bfloat16's 2-byte code)
@pytest.mark.parametrize("rows, cols, pad_to", TILED_CASES, ids=lambda v: str(v))
def test_tiled_kernel_matches_reference(tiled_grid, rows, cols, pad_to, dtype, op):
    """The tiled kernel, on its default grid and on a grid of 7 blocks (which pipelines many tiles
    a block), writes the reference's bytes (q, q_t, amax, scale_inv), with transpose and dbias, and
    the same bytes on both grids; dbias within float32 summation order of the reference's and the
    same bits on both grids; without transpose (the flat kernel where unpadded) the same q and amax."""
    grad = op.startswith("d")
    fmt = "e5m2" if grad else "e4m3"
    small = rows * cols < 10 ** 6
    rng = seeded("tiled-variants", rows, cols, pad_to, dtype, op)
    xn = S.make_input(rng, (rows, cols), dtype, fmt, edges=small and not grad)
    bn = S.make_input(rng, (rows, cols), dtype, fmt, edges=False) if grad else None
    x, b = to_torch(xn, "cuda"), to_torch(bn, "cuda") if grad else None
    s = torch.full((1,), 1.5, device="cuda")

    def run(grid=None, transpose=True):
        tiled_grid(grid)
        if op == "identity":
            return fusedfp8.quantize(x, s, fmt, transpose=transpose, pad_to=pad_to)
        if op == "gelu_tanh":
            return fusedfp8.gelu_quantize(x, s, fmt, approximate="tanh", transpose=transpose, pad_to=pad_to)
        return fusedfp8.dgelu_quantize(x, b, s, fmt, approximate="tanh", transpose=transpose, dbias=transpose,
                                       pad_to=pad_to)

    want = ref_op(op, xn, bn, np.float32(1.5), fmt, True, grad)
    prows, pcols = launch.padded(rows, cols, pad_to)
    expect = {"data": ref.pad2d(want.data, prows, pcols).tobytes(),
              "data_t": ref.pad2d(want.data_t, pcols, prows).tobytes(),
              "amax": np.float32(want.amax).tobytes(), "scale_inv": (np.float32(1) / np.float32(1.5)).tobytes()}
    default, piped, flat = run(), run(7), run(transpose=False)
    for name, value in expect.items():
        assert bytes_of(getattr(default, name)) == value, name
        assert bytes_of(getattr(piped, name)) == value, (name, "grid of 7")
        if name != "data_t":
            assert bytes_of(getattr(flat, name)) == value, (name, "no transpose")
    if grad:
        assert bytes_of(default.dbias) == bytes_of(piped.dbias)
        np.testing.assert_allclose(to_np(default.dbias), want.dbias, rtol=2e-5,
                                   atol=1e-5 * float(np.nanmax(np.abs(want.dbias), initial=1.0)))


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("offset", [1, 3, 8], ids=lambda o: f"offset{o}")
def test_unaligned_input_pointer(device, offset, dtype):
    """A slice at an odd element offset: on the GPU its data pointer is not 16-byte aligned (the
    scalar path); offsets 1 and 3 are never aligned, 8 is for 2-byte types."""
    rng = np.random.default_rng(offset)
    base = S.make_input(rng, (4096 + offset,), dtype, "e4m3")
    xt = to_torch(base, device)[offset:]
    check(device, "identity", base[offset:], None, 2.0, "e4m3", False, inputs=(xt, None))
    check(device, "gelu_tanh", base[offset:], None, 2.0, "e4m3", False, inputs=(xt, None))
    x2 = xt[: 4000].view(40, 100)
    check(device, "identity", base[offset:offset + 4000].reshape(40, 100), None, 2.0, "e4m3", True, inputs=(x2, None))


# ---- special values, amax --------------------------------------------------------------------
@pytest.mark.parametrize("dtype", DTYPES)
def test_special_values_and_canonical_nan(device, dtype):
    v = np.array([0.0, -0.0, np.inf, -np.inf, 1e4, -1e4, 448.0, 464.0, 2.0 ** -10, 2.0 ** -9, 3 * 2.0 ** -10, 1e-7,
                  -1e-7, np.nan, 5e-41, 2.0 ** -24], np.float32).astype(np_dtype(dtype))
    for fw in frameworks(device):
        for fmt in FMTS:
            got = fusedfp8.quantize(to_fw(v, fw, device), scalar(fw, 1.0, device=device), fmt)
            assert bytes_of(got.data) == ref.quantize(v, np.float32(1.0), fmt).data.tobytes(), (fw, fmt)
            assert np.isnan(to_np(got.amax)[0])
            finite = v[:-3]  # no NaN: amax is inf
            assert to_np(fusedfp8.quantize(to_fw(finite, fw, device), scalar(fw, 1.0, device=device), fmt).amax)[0] \
                == np.inf
        # any NaN in (negative, with a payload): the canonical amax and the canonical FP8 NaN out
        x = np.array([1.0, np.nan, -np.nan, np.inf, -2.0], np.float32)
        x.view(np.uint32)[2] = 0xFFC00001
        x = x.astype(np_dtype(dtype))
        for fmt in FMTS:
            r = fusedfp8.quantize(to_fw(x, fw, device), scalar(fw, 1.0, device=device), fmt)
            assert to_np(r.amax).view(np.uint32)[0] == 0x7FC00000, (fw, fmt)
            assert bytes_of(r.data) == ref.quantize(x, np.float32(1), fmt).data.tobytes()
            assert list(to_np(r.data).view(np.uint8)[1:3]) == [0x7F, 0x7F]


@pytest.mark.parametrize("dtype, bits, value", [("float16", 0x0001, 2.0 ** -24), ("bfloat16", 0x0001, 2.0 ** -133),
                                                ("bfloat16", 0x8007, 7 * 2.0 ** -133)],
                         ids=["f16", "bf16", "bf16-negative"])
def test_denormal_amax_is_not_flushed(device, dtype, bits, value):
    raw = np.zeros(9, np.uint16)
    raw[3] = bits
    x = raw.view(np_dtype(dtype))
    pair = np.array([1e-39, -3e-40], np.float32).astype(np_dtype(dtype))  # values, rounded to the dtype
    for fw in frameworks(device):
        got = to_np(fusedfp8.quantize(to_fw(x, fw, device), scalar(fw, 1.0, device=device)).amax)
        assert got[0] == np.float32(value) and got[0] != 0, fw
        got = to_np(fusedfp8.quantize(to_fw(pair, fw, device), scalar(fw, 1.0, device=device)).amax)
        assert got[0] == np.abs(pair.astype(np.float32)).max() and (got[0] > 0) == (dtype != "float16"), fw


@pytest.mark.parametrize("start, x_has_nan, expect", [
    (0.0, False, "amax"), (1e6, False, 1e6), (np.nan, False, np.nan), (0.0, True, np.nan), (5.0, True, np.nan),
], ids=["from-0", "keeps-larger", "keeps-nan", "nan-in-x", "nan-in-x-over-value"])
@pytest.mark.parametrize("op", ["quantize", "gelu_quantize", "dgelu_quantize"])
def test_amax_accumulates_in_place(device, op, start, x_has_nan, expect, rng):
    x = (rng.standard_normal((13, 21)) * 100).astype(np.float32)
    if x_has_nan:
        x[4, 4] = np.nan
    own = {"quantize": lambda: ref.amax(x), "gelu_quantize": lambda: ref.gelu_quantize(x, np.float32(1.0)).amax,
           "dgelu_quantize": lambda: ref.dgelu_quantize(x, x, np.float32(1.0)).amax}[op]()
    want = own if expect == "amax" else expect
    for fw in [f for f in frameworks(device) if f != "jax"]:  # (jax arrays are immutable: refused, test_ops)
        amax = scalar(fw, start, device=device)
        xs, one = to_fw(x, fw, device), scalar(fw, 1.0, device=device)
        r = {"quantize": lambda: fusedfp8.quantize(xs, one, amax=amax),
             "gelu_quantize": lambda: fusedfp8.gelu_quantize(xs, one, amax=amax),
             "dgelu_quantize": lambda: fusedfp8.dgelu_quantize(xs, xs, one, amax=amax)}[op]()
        assert r.amax is amax  # the caller's array, written in place
        got = to_np(amax)[0]
        if np.isnan(want):
            assert np.isnan(got), fw
        else:
            assert got == np.float32(want), fw


def test_amax_accumulates_over_calls_and_ignores_empty(device, rng):
    xs = [(rng.standard_normal((5, 6)) * s).astype(np.float32) for s in (1.0, 50.0, 2.0)]
    xs += [np.zeros((0, 6), np.float32), np.full((1000,), 2.0, np.float32), np.full((1000,), -5.0, np.float32)]
    for fw in [f for f in frameworks(device) if f != "jax"]:
        amax = scalar(fw, 0.0, device=device)
        for x in xs:
            fusedfp8.quantize(to_fw(x, fw, device), scalar(fw, 1.0, device=device), amax=amax)
        assert to_np(amax)[0] == max(ref.amax(x) for x in xs), fw
        fusedfp8.quantize(to_fw(np.array([np.nan], np.float32), fw, device), scalar(fw, 1.0, device=device), amax=amax)
        assert np.isnan(to_np(amax)[0])
        fusedfp8.quantize(to_fw(xs[-1], fw, device), scalar(fw, 1.0, device=device), amax=amax)
        assert np.isnan(to_np(amax)[0]), "a NaN stays"


# ---- dequantize --------------------------------------------------------------------------------
@pytest.mark.parametrize("out", DTYPES)
@pytest.mark.parametrize("fmt", FMTS)
@pytest.mark.parametrize("shape", [(0,), (1,), (17,), (16, 16), (303, 300), (7,), (0, 16), (1 << 20,)],
                         ids=["n0", "n1", "n17", "aligned-16x16", "ragged-303x300", "ragged-7", "ragged-0x16", "n1M"])
def test_dequantize_matches_reference(device, fmt, out, shape):
    codes = (np.arange(int(np.prod(shape)), dtype=np.int64) % 256).astype(np.uint8).reshape(shape)
    q = codes.view(get_format(fmt).numpy_dtype)
    for fw in frameworks(device):
        qd = to_fw(q, fw, device)
        for si in (1.0, 0.375, 1e-30):
            want = ref.dequantize(q, np.array([si], np.float32), np_dtype(out))
            got = fusedfp8.dequantize(qd, scalar(fw, si, device=device), out)
            assert_type(got, fw, out, shape, device)
            assert bytes_of(got) == np.ascontiguousarray(want).tobytes(), (fw, si)
        # the same with the format given explicitly (it must agree)
        assert bytes_of(fusedfp8.dequantize(qd, scalar(fw, 0.375, device=device), out, fmt=fmt)) == \
            np.ascontiguousarray(ref.dequantize(q, np.float32(0.375), np_dtype(out))).tobytes()


# ---- scalar (0-d) inputs -----------------------------------------------------------------------
SCALAR_OPS = {  # op: (call, input dtype)
    "quantize": (lambda x, s: fusedfp8.quantize(x, s).data, np.float32),
    "gelu_quantize": (lambda x, s: fusedfp8.gelu_quantize(x, s).data, np.float32),
    "gelu_quantize-erf": (lambda x, s: fusedfp8.gelu_quantize(x, s, approximate="none").data, np.float32),
    "dgelu_quantize": (lambda x, s: fusedfp8.dgelu_quantize(x, x, s).data, np.float32),
    "dequantize": (lambda q, s: fusedfp8.dequantize(q, s), ml_dtypes.float8_e4m3fn),
}


@pytest.mark.parametrize("op", list(SCALAR_OPS))
def test_zero_dim_input(device, op):
    """A 0-d input gives a 0-d result: the bytes of the 1-element input's result, and for the
    quantizing ops the reference's (data, amax, scale_inv: the full check)."""
    call, dtype = SCALAR_OPS[op]
    kernel_op = {"quantize": "identity", "gelu_quantize": "gelu_tanh", "gelu_quantize-erf": "gelu_none"}.get(op)
    for in_dtype in ([dtype] if op == "dequantize" else [np.float32, np.float16, BF16]):
        v = np.array(3.0, np.float32).astype(in_dtype)
        if kernel_op is not None:
            check(device, kernel_op, v, None, 2.0, "e4m3", False)
        for fw in frameworks(device):
            one = call(to_fw(v.reshape(1), fw, device), scalar(fw, 2.0, device=device))
            got = call(to_fw(v, fw, device), scalar(fw, 2.0, device=device))
            assert tuple(got.shape) == () and bytes_of(got) == bytes_of(one), (fw, in_dtype)
    with pytest.raises(ValueError, match="transpose"):
        fusedfp8.quantize(to_torch(np.array(3.0, np.float32), device), torch.ones(1, device=device), transpose=True)


# ---- update_scales -----------------------------------------------------------------------------
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


@pytest.mark.parametrize("margin", [0, 2])
@pytest.mark.parametrize("algo", ["max", "most_recent"])
@pytest.mark.parametrize("n", [1, 7, 1024])
@pytest.mark.parametrize("L", [1, 2, 31, 1024, 1026, 2500])  # 1026+: more than one roll chunk of the kernel
def test_update_scales_matches_the_rule_on_numpy(device, L, n, algo, margin):
    """A torch state (the kernel on the GPU, the rule through torch's namespace on the CPU)
    against a numpy state (the rule through numpy's), every array byte for byte, four steps."""
    rng = np.random.default_rng(L * 7 + n)
    recipe = DelayedScaling(margin=margin, amax_history_len=L, amax_compute_algo=algo)
    grad = tuple(bool(g) for g in rng.integers(0, 2, n))
    host = ScalingState.create(grad, recipe)
    dev = ScalingState.create(grad, recipe, like=torch.zeros(1, device=device))
    for step in range(4):
        h = random_history(rng, L, n)
        if step:
            h[1:] = host.amax_history[1:]
        host.amax_history[...] = h
        dev.amax_history.copy_(torch.from_numpy(h))
        fusedfp8.update_scales(host, recipe)
        fusedfp8.update_scales(dev, recipe)
        for name in STATE_FIELDS:
            assert bytes_of(getattr(dev, name)) == getattr(host, name).tobytes(), f"{name} differs at step {step}"


@pytest.mark.gpu
def test_update_scales_is_one_launch():
    recipe = DelayedScaling(amax_history_len=1024)
    st = ScalingState.create(1024, recipe, like=torch.zeros(1, device="cuda"))
    st.amax_history[0].uniform_(0.5, 2.0)
    fusedfp8.update_scales(st, recipe)  # compile + cache the fmt_max array
    st.amax_history[0].uniform_(0.5, 2.0)
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
        fusedfp8.update_scales(st, recipe)
        torch.cuda.synchronize()
    kernels = [e for e in prof.events() if e.device_type == torch.autograd.DeviceType.CUDA]
    names = {e.name for e in kernels}
    assert len(kernels) == 1, names
    assert "update_scales" in next(iter(names))


# ---- slots and the first step (current scaling, decided on the device per tensor) ---------------
@pytest.mark.gpu
@pytest.mark.parametrize("first_step", ["current", "unit"])
def test_slot_sequence_matches_host_path(first_step):
    """A few steps of quantize-into-slots + update on the GPU equal the same on the CPU."""
    rng = np.random.default_rng(11)
    recipe = DelayedScaling(amax_history_len=16, first_step=first_step)
    states = {"cpu": ScalingState.create([False, True], recipe, like=torch.zeros(1)),
              "cuda": ScalingState.create([False, True], recipe, like=torch.zeros(1, device="cuda"))}
    for step in range(5):
        for mb in range(2):  # two micro-batches per step accumulate into the slots
            xn = (S.make_input(rng, (96, 64), "bfloat16", "e4m3", edges=False).astype(np.float32)
                  * np.float32(10 ** (step - 2))).astype(ml_dtypes.bfloat16)
            gn = (S.make_input(rng, (96, 64), "bfloat16", "e5m2", edges=False) * np.float32(1e-5)).astype(
                ml_dtypes.bfloat16)
            outputs = {}
            for dev, st in states.items():
                x, g = to_torch(xn, dev), to_torch(gn, dev)
                r0 = fusedfp8.quantize(x, st.slot(0, recipe), transpose=True)
                r1 = fusedfp8.dgelu_quantize(g, x, st.slot(1, recipe), transpose=True)
                outputs[dev] = [bytes_of(t) for t in (r0.data, r0.data_t, r1.data, r0.scale_inv, r1.scale_inv)]
                # the scale_inv handed out is the state's (also on a first step, set by this call)
                assert bytes_of(torch.cat([r0.scale_inv, r1.scale_inv])) == bytes_of(st.scale_inv)
            assert outputs["cpu"] == outputs["cuda"], f"step {step} micro-batch {mb}"
            for name in ("amax_history", "scale", "scale_inv"):
                assert bytes_of(getattr(states["cuda"], name)) == bytes_of(getattr(states["cpu"], name)), \
                    f"{name} at step {step} micro-batch {mb}"
        for st in states.values():
            fusedfp8.update_scales(st, recipe)
        for name in STATE_FIELDS:
            assert bytes_of(getattr(states["cuda"], name)) == bytes_of(getattr(states["cpu"], name))
    if first_step == "current":
        assert states["cpu"].updates.tolist() == [5, 5]


def test_first_step_gradient_is_not_flushed(device):
    """E5M2 with scale 1 flushes 1e-6 gradients to zero; the first step's current scaling keeps them."""
    g = torch.randn(256, 256, dtype=torch.bfloat16, generator=torch.Generator().manual_seed(0)).to(device) * 1e-6
    for first, nonzero in (("current", True), ("unit", False)):
        r = DelayedScaling(amax_history_len=4, first_step=first)
        st = ScalingState.create([True], r, like=torch.zeros(1, device=device))
        q = fusedfp8.quantize(g, st.slot(0, r)).data
        assert bool((to_np(q).view(np.uint8) & 0x7F).any()) == nonzero, first


def test_first_step_is_decided_per_tensor_from_updates(device):
    """The first-step decision is made from each tensor's own ``updates`` (on the GPU by the
    kernel, on every quantization): a tensor past its first step keeps its scale while its
    neighbour in the same state, still on its first step, gets a current scale; a state whose
    ``updates`` is reset (a loaded checkpoint of a fresh run) is on its first step again."""
    r = DelayedScaling(amax_history_len=4)
    st = ScalingState.create([False, False], r, like=torch.zeros(1, device=device))
    x = torch.full((64, 64), 3.0, device=device)
    fusedfp8.quantize(x, st.slot(0, r))
    fusedfp8.update_scales(st, r)  # tensor 0 completes its first update; tensor 1 never ran
    assert to_np(st.updates).tolist() == [1, 0]
    s0 = bytes_of(st.scale[0:1])
    big = torch.full((64, 64), 100.0, device=device)
    q0 = fusedfp8.quantize(big, st.slot(0, r))
    q1 = fusedfp8.quantize(big, st.slot(1, r))
    assert bytes_of(st.scale[0:1]) == s0  # delayed: the stored scale (448 / 3), not one from 100
    assert bytes_of(q0.data) == ref.quantize(to_np(big), to_np(st.scale)[0], "e4m3").data.tobytes()
    s1 = ref.current_scale(np.float32(100.0), "e4m3", 1.0, np.float32(1.0))
    assert to_np(st.scale)[1] == s1 == np.float32(448.0) / np.float32(100.0)  # current: from its own amax
    assert bytes_of(q1.data) == ref.quantize(to_np(big), s1, "e4m3").data.tobytes()
    with torch.no_grad():
        st.updates.zero_()  # tensor 0 is on its first step again: its next quantization rescales
    fusedfp8.quantize(big, st.slot(0, r))
    assert to_np(st.scale)[0] == np.float32(448.0) / np.float32(100.0)


@pytest.mark.gpu
def test_first_step_current_is_one_launch_that_decides_on_the_device():
    """With first_step='current' every quantization into a slot is ONE launch of the cooperative
    current_quantize kernel (the host keeps no first-step mirror): for a tensor past its first step
    it skips the amax pass and the grid barrier, and its result is the delayed-scaling one; with
    'unit' it is the plain quantize kernel."""
    x = torch.full((256, 256), 3.0, device="cuda")

    def launches(st, r):
        with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
            q = fusedfp8.quantize(x, st.slot(0, r)).data
            torch.cuda.synchronize()
        return [e.name for e in prof.events() if e.device_type == torch.autograd.DeviceType.CUDA], q

    for first, cooperative in (("current", True), ("unit", False)):
        r = DelayedScaling(amax_history_len=4, first_step=first)
        st = ScalingState.create([False], r, like=torch.zeros(1, device="cuda"))
        fusedfp8.quantize(x, st.slot(0, r))  # compiles
        fusedfp8.update_scales(st, r)
        st.scale.fill_(2.0)
        names, q = launches(st, r)  # past the first step: the stored scale
        assert len(names) == 1 and ("GridAmax" in names[0]) == cooperative, (first, names)
        assert bytes_of(q) == ref.quantize(np.full((256, 256), 3.0, np.float32), np.float32(2.0), "e4m3").data.tobytes()


# ---- property test -----------------------------------------------------------------------------
def _property(device: str, max_examples: int) -> None:
    from hypothesis import given, settings
    from hypothesis import strategies as st

    @settings(max_examples=max_examples, deadline=None, derandomize=True, database=None)
    @given(rows=st.integers(0, 70), cols=st.integers(1, 70), offset=st.integers(0, 9), dtype=st.sampled_from(DTYPES),
           fmt=st.sampled_from(FMTS), op=st.sampled_from(["identity", *ACT_OPS]), transpose=st.booleans(),
           seed=st.integers(0, 2**31 - 1), log_scale=st.integers(-20, 20))
    def prop(rows, cols, offset, dtype, fmt, op, transpose, seed, log_scale):
        rng = np.random.default_rng(seed)
        n = rows * cols
        base = S.make_input(rng, (n + offset,), dtype, fmt)
        other = S.make_input(rng, (n + offset,), dtype, fmt)
        xn, bn = base[offset:].reshape(rows, cols), other[offset:].reshape(rows, cols)
        x = to_torch(base, device)[offset:].view(rows, cols)
        b = to_torch(other, device)[offset:].view(rows, cols)
        grad = op.startswith("d")
        check(device, op, xn, bn if grad else None, float(2.0 ** log_scale), fmt, transpose,
              dbias=grad and transpose, inputs=(x, b if grad else None))

    prop()


def test_property_random_shapes_offsets_values(device):
    """Random shapes (0..70 x 1..70), offsets, dtypes, formats, ops, scales and seeds: 150 cases
    on the GPU, 40 on the host path (torch CPU tensors at the same offsets)."""
    _property(device, 150 if device == "cuda" else 40)


# ---- the launch interface ----------------------------------------------------------------------
def test_launch_interface_tables():
    """What every GPU entry point shares: op ids in the kernels' order, format ids, workspaces."""
    assert list(K.OPS) == ["identity", "gelu_tanh", "gelu_erf", "dgelu_tanh", "dgelu_erf"]
    assert list(K.OPS.values()) == [0, 1, 2, 3, 4] and K.FMT_IDS == {"e4m3": 0, "e5m2": 1}
    assert launch.dbias_workspace(0, 0) == ((1, 0), 1)
    assert launch.dbias_workspace(300, 130) == ((-(-300 // PL.TILE_R), 130), -(-130 // PL.TILE_C))
    assert PL.aligned(0, 16, 4096) and not PL.aligned(16, 8)
