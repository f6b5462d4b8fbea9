"""fusedfp8.layernorm_quantize against the NumPy reference (fusedfp8.numerics.layernorm), byte for
byte, on both sides of the launch interface: 'cpu' (numpy, torch CPU and jax CPU arrays: the host
path) and 'cuda' (torch CUDA tensors: cuda_src/layernorm_quantize.cu). Every result is compared:
the FP8 data and its transpose, amax, the handed-out scale_inv, and the per-row mean and rstd.

The shapes cover each row layout of the kernel: one warp per row (up to 1024 columns), several
warps per row (2056, 4096: the shared-memory step of the reduction), rows wider than the
registers hold (20000: chunks read again), ragged columns (the element path), one row, 0 rows,
3-D; with transpose the shared tile of 16, 8 and 4 rows and a ragged last tile. The 'large' shapes
(2048 x 1024 / 4096, the hidden sizes of the FP8 MLP) run on the GPU only."""
from __future__ import annotations

import struct
import zlib

import ml_dtypes
import numpy as np
import pytest
import torch

import fusedfp8
from fusedfp8 import launch
from fusedfp8.launch import executor as E, kernels as K, plans as PL
from fusedfp8.formats import get_format
from fusedfp8.numerics import layernorm as ln
from fusedfp8.numerics import reference as ref
from fusedfp8.recipe import DelayedScaling
from fusedfp8.state import ScalingState
from support import shapes as S
from support.frameworks import HOST_FRAMEWORKS, assert_type, bytes_of, np_dtype, scalar, to_fw, to_np, to_torch

DTYPES = ["float32", "float16", "bfloat16"]
FMTS = ["e4m3", "e5m2"]
SHAPES = {  # label: shape
    "aligned-64x128": (64, 128),
    "aligned-96x1024": (96, 1024),
    "aligned-40x4096": (40, 4096),
    "ragged-303x300": (303, 300),
    "ragged-17x2056": (17, 2056),
    "ragged-1x8": (1, 8),
    "ragged-1x1": (1, 1),
    "ragged-odd-tail-33x17": (33, 17),
    "ragged-3d-3x5x40": (3, 5, 40),
    "ragged-0x16": (0, 16),
    "wide-5x20000": (5, 20000),
}
LARGE = {  # (with transpose: 16-row tiles, 16-byte stores; 8-row tiles with 8-byte stores / ragged; 4-row tiles)
    "large-2048x1024": (2048, 1024),
    "large-2048x4096": (2048, 4096),
    "large-256x8192": (256, 8192),
    "large-300x16384": (300, 16384),
    "large-64x20000": (64, 20000),
}


def on_devices(small, large=LARGE) -> list:
    """(device, shape) parameters: the small shapes on both sides, the large ones on 'cuda' only."""
    out = []
    for device in ("cpu", "cuda"):
        marks = [pytest.mark.gpu] if device == "cuda" else []
        for label, shape in [*small.items(), *(large.items() if device == "cuda" else ())]:
            out.append(pytest.param(device, shape, id=f"{device}-{label}", marks=marks))
    return out


def frameworks(device: str) -> tuple:
    return HOST_FRAMEWORKS if device == "cpu" else ("torch",)


def seeded(*key) -> np.random.Generator:
    return np.random.default_rng(zlib.crc32(repr(key).encode()))


def activations(rng, shape, dtype: str) -> np.ndarray:
    """Plain LayerNorm inputs: each row its own offset and spread."""
    rows = int(np.prod(shape[:-1], dtype=np.int64))
    x = (rng.standard_normal((rows, shape[-1])) * rng.uniform(0.1, 4, (rows, 1))
         + 2 * rng.standard_normal((rows, 1)))
    return x.astype(np.float32).astype(np_dtype(dtype)).reshape(shape)


def layer_params(rng, cols: int, dtype: str = "float32"):
    return ((1 + 0.3 * rng.standard_normal(cols)).astype(np.float32).astype(np_dtype(dtype)),
            (0.2 * rng.standard_normal(cols)).astype(np.float32).astype(np_dtype(dtype)))


def check(device, xn, wn, bn, eps, scale, fmt, transpose, fws=None, inputs=None):
    """layernorm_quantize of ``xn`` through the frameworks ``fws`` (default: every framework of
    ``device``; ``inputs``: ready torch (x, weight, bias)) equals the reference: FP8 data and
    transpose, amax, scale_inv (1 / scale, in a buffer of its own), mean and rstd byte for byte,
    every result in the caller's framework, dtype and shape."""
    want, mean, rstd = ln.layernorm_quantize(xn, wn, bn, eps, np.float32(scale), fmt, transpose)
    fdt = get_format(fmt).dtype_name
    rows = int(np.prod(np.shape(xn)[:-1], dtype=np.int64))
    for fw in ("torch",) if inputs is not None else fws or frameworks(device):
        if inputs is not None:
            x, w, b = inputs
        else:
            x, w, b = (None if a is None else to_fw(a, fw, device) for a in (xn, wn, bn))
        got = fusedfp8.layernorm_quantize(x, w, b, eps, scalar(fw, scale, device=device), fmt, transpose=transpose)
        q = got.quantized
        where = f"{fw} on {device}"
        assert isinstance(got, fusedfp8.LayerNormQuantized) and isinstance(q, fusedfp8.Quantized)
        assert_type(q.data, fw, fdt, np.shape(xn), device)
        assert bytes_of(q.data) == np.ascontiguousarray(want.data).tobytes(), where
        assert_type(q.amax, fw, "float32", (1,), device)
        assert bytes_of(q.amax) == np.float32(want.amax).tobytes(), (where, to_np(q.amax), want.amax)
        assert bytes_of(q.scale_inv) == (np.float32(1) / np.float32(scale)).tobytes(), where
        if transpose:
            assert_type(q.data_t, fw, fdt, (np.shape(xn)[-1], rows), device)
            assert bytes_of(q.data_t) == np.ascontiguousarray(want.data_t).tobytes(), where
        else:
            assert q.data_t is None
        assert q.dbias is None
        for name, have, expect in (("mean", got.mean, mean), ("rstd", got.rstd, rstd)):
            assert_type(have, fw, "float32", (rows,), device)
            assert bytes_of(have) == expect.tobytes(), (where, name)
    return want, mean, rstd


# ---- the whole matrix ----------------------------------------------------------------------------
@pytest.mark.parametrize("transpose", [False, True], ids=["no-transpose", "transpose"])
@pytest.mark.parametrize("fmt", FMTS)
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("device, shape", on_devices(SHAPES))
def test_layernorm_quantize_matches_reference(device, shape, dtype, fmt, transpose):
    """Two inputs per case: LayerNorm-like activations at a scale that makes the FP8 values
    meaningful (every framework of the device), and values over many binades with the edge values
    sprinkled in (NaN and inf rows among them; torch tensors)."""
    rng = seeded(shape, dtype, fmt, transpose)
    w, b = layer_params(rng, shape[-1])
    check(device, activations(rng, shape, dtype), w, b, 1e-5, 16.0 if fmt == "e4m3" else 1024.0, fmt, transpose)
    check(device, S.make_input(rng, shape, dtype, fmt), w, b, 1e-5, 1.5, fmt, transpose, fws=("torch",))


PARAMS = {  # id: (weight dtype or None, bias dtype or None)
    "f32": ("float32", "float32"), "bf16": ("bfloat16", "bfloat16"), "f16": ("float16", "float16"),
    "weight-only": ("bfloat16", None), "bias-only": (None, "float32"), "none": (None, None),
}


@pytest.mark.parametrize("params", list(PARAMS))
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("device, shape", on_devices({k: SHAPES[k] for k in ("aligned-96x1024", "ragged-303x300",
                                                                            "aligned-40x4096")},
                                                     large={"large-2048x4096": LARGE["large-2048x4096"]}))
def test_parameter_dtypes_and_missing_parameters(device, shape, dtype, params):
    """weight and bias of each float dtype (read as float32), or left out (1 and 0)."""
    rng = seeded("params", shape, dtype, params)
    wd, bd = PARAMS[params]
    w, b = layer_params(rng, shape[-1], wd or "float32")
    b = b.astype(np_dtype(bd)) if bd else None
    check(device, activations(rng, shape, dtype), w if wd else None, b, 1e-5, 8.0, "e4m3", True)


def test_non_finite_and_constant_rows(device):
    """Rows with a NaN, an inf, both infinities, a sum that overflows, a constant row, a row of
    -0, next to plain rows: NaN rows quantize to NaN bytes, the amax is the canonical NaN, mean and
    rstd the canonical NaN where NaN; eps 0 with a constant row gives rstd inf and NaN bytes."""
    rng = seeded("non-finite")
    x = activations(rng, (12, 300), "float32")
    x[1, 7] = np.nan
    x[2, 9] = np.inf
    x[3, 4], x[3, 200] = np.inf, -np.inf
    x[4, :] = 3e38
    x[5] = 2.5
    x[6] = -0.0
    x[7, 0] = -np.nan
    w, b = layer_params(rng, 300)
    for dtype in DTYPES:
        with np.errstate(over="ignore"):  # (3e38 is inf in float16: an inf row there)
            xd = x.astype(np_dtype(dtype))
        want, mean, _ = check(device, xd, w, b, 1e-5, 4.0, "e4m3", True)
        assert np.isnan(want.amax) and np.isnan(mean[[1, 3, 7]]).all()
        check(device, xd[5:9], w, b, 1e-5, 4.0, "e5m2", False)
        check(device, xd[5:9], None, None, 0.0, 4.0, "e5m2", True)  # a constant row with eps 0: NaN
        check(device, xd[8:], w, b, 1e-5, 4.0, "e4m3", True)  # plain rows only: a finite amax


@pytest.mark.parametrize("eps", [0.0, 1e-12, 1e-6, 1e-5, 0.1, 1.0, 3.0e-45])
def test_eps_values(device, eps):
    rng = seeded("eps", eps)
    x = activations(rng, (40, 520), "bfloat16")
    x[3] = 1.0  # var 0: rstd = 1 / sqrt(eps)
    x[4] = (rng.standard_normal(520) * 1e-3 + 5).astype(np.float32).astype(ml_dtypes.bfloat16)  # var ~ eps
    w, b = layer_params(rng, 520)
    check(device, x, w, b, eps, 32.0, "e4m3", True)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("offset", [1, 3, 8], ids=lambda o: f"offset{o}")
def test_unaligned_pointers(device, offset, dtype):
    """x, weight and bias starting at an odd element offset (never 16-byte aligned for offsets 1
    and 3): the element path, the same bytes."""
    rng = seeded("unaligned", offset, dtype)
    base = activations(rng, (40 * 128 + offset,), dtype)
    pw = layer_params(rng, 128 + offset)
    xt = to_torch(base, device)[offset:].view(40, 128)
    wt, bt = (to_torch(p, device)[offset:] for p in pw)
    check(device, base[offset:].reshape(40, 128), pw[0][offset:], pw[1][offset:], 1e-5, 8.0, "e4m3", True,
          inputs=(xt, wt, bt))


@pytest.mark.parametrize("start, nan_in_x, expect", [
    (0.0, False, "amax"), (1e6, False, 1e6), (np.nan, False, np.nan), (0.0, True, np.nan), (-0.0, False, "amax"),
], ids=["from-0", "keeps-larger", "keeps-nan", "nan-in-x", "from-minus-0"])
def test_amax_accumulates_in_place(device, start, nan_in_x, expect):
    rng = seeded("amax", start, nan_in_x)
    x = activations(rng, (13, 64), "float32")
    if nan_in_x:
        x[4, 4] = np.nan
    w, b = layer_params(rng, 64)
    y, _, _ = ln.layernorm_f32(x, w, b, 1e-5)
    want = ref.amax(y) if expect == "amax" else expect
    for fw in [f for f in frameworks(device) if f != "jax"]:  # (jax arrays are immutable)
        amax = scalar(fw, start, device=device)
        r = fusedfp8.layernorm_quantize(*(to_fw(a, fw, device) for a in (x, w, b)), 1e-5, scalar(fw, 1.0, device=device),
                                        amax=amax)
        assert r.quantized.amax is amax
        got = to_np(amax)[0]
        assert (np.isnan(got) if np.isnan(want) else got == np.float32(want)), fw


def test_zero_rows(device):
    """0 rows: empty data, transpose and statistics; 1 / scale still handed out; the amax slot untouched."""
    x = np.zeros((0, 48), np.float32)
    check(device, x, np.ones(48, np.float32), np.zeros(48, np.float32), 1e-5, 4.0, "e4m3", True)
    amax = scalar("torch", 7.0, device=device)
    fusedfp8.layernorm_quantize(to_torch(x, device), None, None, 1e-5, scalar("torch", 4.0, device=device), amax=amax)
    assert to_np(amax)[0] == 7.0


# ---- delayed scaling: slots and the first step -------------------------------------------------------
@pytest.mark.parametrize("first_step", ["current", "unit"])
@pytest.mark.parametrize("fmt_recipe", ["hybrid-grad", "e4m3"])
def test_slots_and_the_first_step(device, first_step, fmt_recipe):
    """Three steps of two micro-batches into tensor 1 of a state (E5M2 for a gradient slot of the
    hybrid recipe), with update_scales between steps: on its first step the tensor is quantized
    with the scale of its own (max-accumulated) amax ('current') or with 1 ('unit'), afterwards
    with the stored scale; the state's slot, scale and scale_inv after every call, and the bytes,
    are the reference's. The LayerNorm output is tiny (weight 1e-6), so scale 1 would flush it."""
    grad = fmt_recipe == "hybrid-grad"
    recipe = DelayedScaling(amax_history_len=4, first_step=first_step, fp8_format="hybrid" if grad else "e4m3",
                            margin=1)
    st = ScalingState.create([False, grad], recipe, like=torch.zeros(1, device=device))
    fmt = st.format_of(1, recipe)
    rng = seeded("slots", first_step, fmt_recipe)
    w = np.full(256, 1e-6, np.float32)
    b = np.zeros(256, np.float32)
    for step in range(3):
        for mb in range(2):
            x = activations(rng, (24, 256), "bfloat16")
            y, mean, rstd = ln.layernorm_f32(x, w, b, 1e-5)
            slot_before = to_np(st.amax_history)[0, 1]
            acc = ref.amax(y) if slot_before == 0 else max(slot_before, ref.amax(y))
            fresh = first_step == "current" and to_np(st.updates)[1] == 0
            s = ref.current_scale(acc, fmt, recipe.margin_factor, to_np(st.scale)[1]) if fresh else to_np(st.scale)[1]
            r = fusedfp8.layernorm_quantize(*(to_torch(a, device) for a in (x, w, b)), 1e-5, st.slot(1, recipe),
                                            transpose=True)
            want = ref.finish(y, acc, s, fmt, True)
            where = f"step {step} micro-batch {mb}"
            assert bytes_of(r.quantized.data) == want.data.tobytes(), where
            assert bytes_of(r.quantized.data_t) == want.data_t.tobytes(), where
            assert bytes_of(r.mean) == mean.tobytes() and bytes_of(r.rstd) == rstd.tobytes(), where
            assert to_np(st.amax_history)[0, 1] == acc, where
            assert bytes_of(st.scale[1:2]) == np.float32(s).tobytes(), where
            assert bytes_of(r.quantized.scale_inv) == bytes_of(st.scale_inv[1:2]) == (np.float32(1) / s).tobytes()
            if step == 0 and mb == 0:
                assert bool((to_np(r.quantized.data).view(np.uint8) & 0x7F).any()) == (first_step == "current")
        fusedfp8.update_scales(st, recipe)
    assert to_np(st.updates).tolist() == [0, 3]


@pytest.mark.gpu
def test_first_step_pre_pass_is_one_extra_launch():
    """With first_step='current' a slot quantization launches the pre-pass and the main kernel
    (the pre-pass exits at once past the first step); with 'unit' the main kernel only."""
    x = torch.randn(256, 1024, device="cuda", dtype=torch.bfloat16)
    w, b = torch.ones(1024, device="cuda"), torch.zeros(1024, device="cuda")
    for first, per_call in (("current", 2), ("unit", 1)):
        r = DelayedScaling(amax_history_len=4, first_step=first)
        st = ScalingState.create([False], r, like=torch.zeros(1, device="cuda"))
        fusedfp8.layernorm_quantize(x, w, b, 1e-5, st.slot(0, r))  # compiles
        fusedfp8.update_scales(st, r)
        with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
            fusedfp8.layernorm_quantize(x, w, b, 1e-5, st.slot(0, r), transpose=True)
            torch.cuda.synchronize()
        kernels = [e.name for e in prof.events() if e.device_type == torch.autograd.DeviceType.CUDA]
        split = PL.split_transpose(1024)  # (q_t then from a transpose_fp8 launch after the main kernel)
        assert len(kernels) == per_call + split, (first, kernels)
        assert all("layernorm_quantize" in k for k in kernels[:per_call]), (first, kernels)
        assert not split or "transpose_fp8" in kernels[-1], kernels


@pytest.mark.gpu
def test_results_are_deterministic():
    """The fixed reduction: the same bits on every run (2048 x 4096, several warps a row)."""
    rng = seeded("determinism")
    x = to_torch(activations(rng, (2048, 4096), "bfloat16"), "cuda")
    w, b = (to_torch(p, "cuda") for p in layer_params(rng, 4096))
    first = fusedfp8.layernorm_quantize(x, w, b, 1e-5, torch.ones(1, device="cuda"), transpose=True)
    for _ in range(3):
        again = fusedfp8.layernorm_quantize(x, w, b, 1e-5, torch.ones(1, device="cuda"), transpose=True)
        for a, c in ((first.mean, again.mean), (first.rstd, again.rstd), (first.quantized.data, again.quantized.data),
                     (first.quantized.data_t, again.quantized.data_t)):
            assert torch.equal(a.view(torch.uint8), c.view(torch.uint8))


# ---- pad_to: padded outputs for the FP8 GEMMs -------------------------------------------------------
PAD_CASES = {  # label: (shape, pad_to)
    "8190x1024-16": ((8190, 1024), 16),  # ragged tokens: pad rows only, one warp a row
    "303x300-16": ((303, 300), 16),  # pad rows and columns, the element path
    "300x1000-16": ((300, 1000), 16),  # pad columns on the vector path (1000 and 1008 multiples of 8)
    "40x4096-16": ((40, 4096), 16),  # several warps a row; pad rows only
    "17x40-16": ((17, 40), 16),
    "1x8-16": ((1, 8), 16),  # one row: 15 pad rows
    "3d-3x5x40-16": ((3, 5, 40), 16),  # data 2-D
    "9x8200-16": ((9, 8200), 16),  # with q_t: 8-row tiles
    "5x20000-16": ((5, 20000), 16),  # chunks read again; with q_t: 4-row tiles
    "17x40-3": ((17, 40), 3),  # an odd pad: element stores, padded rows not a multiple of the tile
    "33x17-128": ((33, 17), 128),  # far more pad than data: the tile's pitch from the padded columns
    "aligned-32x64-16": ((32, 64), 16),  # nothing to pad: the unpadded kernel, data 2-D
    "0x20-16": ((0, 20), 16),  # no rows: (0, 32) and (32, 0)
}


def pad_cases(labels=None, gpu_only=False) -> list:
    """(device, shape, pad_to) parameters of PAD_CASES (every label on both sides)."""
    out = []
    for device in ("cuda",) if gpu_only else ("cpu", "cuda"):
        marks = [pytest.mark.gpu] if device == "cuda" else []
        for label in labels or PAD_CASES:
            out.append(pytest.param(device, *PAD_CASES[label], id=f"{device}-{label}", marks=marks))
    return out


def padded_shape(shape, pad_to) -> tuple[int, int, int, int]:
    rows, cols = int(np.prod(shape[:-1], dtype=np.int64)), shape[-1]
    return rows, cols, -(-rows // pad_to) * pad_to, -(-cols // pad_to) * pad_to


def check_padded(plain, padded, shape, pad_to, want=None) -> None:
    """``padded`` (a pad_to call) is ``plain`` (the same call with pad_to=1) in a corner of zeros:
    data and data_t byte for byte against reference.pad2d of the unpadded bytes (and against the
    reference's own padded result ``want``); amax, scale_inv, mean and rstd the same bytes."""
    rows, cols, prows, pcols = padded_shape(shape, pad_to)
    q, pq = plain.quantized, padded.quantized
    assert tuple(pq.data.shape) == (prows, pcols)
    assert bytes_of(pq.data) == ref.pad2d(to_np(q.data).reshape(rows, cols), prows, pcols).tobytes()
    if q.data_t is not None:
        assert tuple(pq.data_t.shape) == (pcols, prows)
        assert bytes_of(pq.data_t) == ref.pad2d(to_np(q.data_t), pcols, prows).tobytes()
    else:
        assert pq.data_t is None
    if want is not None:
        assert bytes_of(pq.data) == want.data.tobytes()
        assert want.data_t is None or bytes_of(pq.data_t) == want.data_t.tobytes()
    assert bytes_of(pq.amax) == bytes_of(q.amax), "the pad takes no part in the amax"
    assert bytes_of(pq.scale_inv) == bytes_of(q.scale_inv)
    assert tuple(padded.mean.shape) == tuple(padded.rstd.shape) == (rows,)
    assert bytes_of(padded.mean) == bytes_of(plain.mean) and bytes_of(padded.rstd) == bytes_of(plain.rstd)


@pytest.mark.parametrize("affine", [True, False], ids=["weight-bias", "no-params"])
@pytest.mark.parametrize("transpose", [False, True], ids=["no-transpose", "transpose"])
@pytest.mark.parametrize("device, shape, pad_to", pad_cases())
def test_padded_layernorm_is_the_unpadded_result_in_a_corner_of_zeros(device, shape, pad_to, transpose, affine):
    rng = seeded("pad", shape, pad_to, transpose, affine)
    xn = activations(rng, shape, "bfloat16")
    wn, bn = layer_params(rng, shape[-1]) if affine else (None, None)
    x, w, b = (None if a is None else to_torch(a, device) for a in (xn, wn, bn))
    scale = torch.tensor([16.0], device=device)
    plain = fusedfp8.layernorm_quantize(x, w, b, 1e-5, scale, "e4m3", transpose=transpose)
    padded = fusedfp8.layernorm_quantize(x, w, b, 1e-5, scale, "e4m3", transpose=transpose, pad_to=pad_to)
    want, _, _ = ln.layernorm_quantize(xn, wn, bn, 1e-5, np.float32(16.0), "e4m3", transpose, pad_to=pad_to)
    check_padded(plain, padded, shape, pad_to, want)


@pytest.mark.parametrize("fmt", FMTS)
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("device, shape, pad_to", pad_cases(["303x300-16"]))
def test_padded_layernorm_dtypes_formats_and_frameworks(device, shape, pad_to, dtype, fmt):
    """Each input dtype and format, weight / bias in the input's dtype, every framework of the
    device: the padded results in the caller's framework, dtype and padded shape."""
    rng = seeded("pad-dtypes", dtype, fmt)
    xn = activations(rng, shape, dtype)
    wn, bn = (p.astype(np_dtype(dtype)) for p in layer_params(rng, shape[-1]))
    rows, cols, prows, pcols = padded_shape(shape, pad_to)
    for fw in frameworks(device):
        x, w, b = (to_fw(a, fw, device) for a in (xn, wn, bn))
        plain = fusedfp8.layernorm_quantize(x, w, b, 1e-5, scalar(fw, 4.0, device=device), fmt, transpose=True)
        padded = fusedfp8.layernorm_quantize(x, w, b, 1e-5, scalar(fw, 4.0, device=device), fmt, transpose=True,
                                             pad_to=pad_to)
        assert_type(padded.quantized.data, fw, get_format(fmt).dtype_name, (prows, pcols), device)
        assert_type(padded.quantized.data_t, fw, get_format(fmt).dtype_name, (pcols, prows), device)
        check_padded(plain, padded, shape, pad_to)


@pytest.mark.gpu
@pytest.mark.parametrize("transpose", [False, True], ids=["no-transpose", "transpose"])
@pytest.mark.parametrize("device, shape, pad_to", pad_cases([k for k in PAD_CASES if not k.startswith("0x")],
                                                            gpu_only=True))
def test_the_padded_kernel_writes_every_byte_of_the_pad(device, shape, pad_to, transpose):
    """Through the launch interface into outputs filled with 0xA5 first: every byte of q and q_t,
    pad included, is the reference's (a pad the kernel left unwritten would show as 0xA5, where
    fresh memory might hold zeros by chance)."""
    rng = seeded("pad-garbage", shape, pad_to, transpose)
    xn = activations(rng, shape, "bfloat16")
    wn, bn = layer_params(rng, shape[-1])
    rows, cols, prows, pcols = padded_shape(shape, pad_to)
    want, mean, rstd = ln.layernorm_quantize(xn, wn, bn, 1e-5, np.float32(8.0), "e4m3", transpose, pad_to=pad_to)
    x, w, b = (to_torch(a, "cuda") for a in (xn, wn, bn))
    q = torch.full((prows, pcols), 0xA5, dtype=torch.uint8, device="cuda")
    q_t = torch.full((pcols, prows), 0xA5, dtype=torch.uint8, device="cuda") if transpose else None
    m, r = torch.empty(rows, device="cuda"), torch.empty(rows, device="cuda")
    scale, amax, siu = (torch.tensor([v], device="cuda") for v in (8.0, 0.0, 0.0))
    buffers = dict(x=x.data_ptr(), weight=w.data_ptr(), bias=b.data_ptr(), q=q.data_ptr(), mean=m.data_ptr(),
                   rstd=r.data_ptr(), scale=scale.data_ptr(), amax=amax.data_ptr(),
                   q_t=q_t.data_ptr() if transpose else 0, scale_inv_used=siu.data_ptr())
    launch.layernorm_quantize(0, torch.cuda.current_stream().cuda_stream, buffers, dtype="bfloat16", param="float32",
                              fmt="e4m3", rows=rows, cols=cols, eps=1e-5, pad_to=pad_to)
    torch.cuda.synchronize()
    assert bytes_of(q) == want.data.tobytes()
    if transpose:
        assert bytes_of(q_t) == want.data_t.tobytes()
    assert bytes_of(amax) == np.float32(want.amax).tobytes()
    assert bytes_of(m) == mean.tobytes() and bytes_of(r) == rstd.tobytes()


@pytest.mark.parametrize("first_step", ["current", "unit"])
def test_padded_first_step_and_slots(device, first_step):
    """Two steps of a slot (the first one a first step: the pre-pass and the scale of y's own amax
    when the recipe says so), padded (to 16) and unpadded into twin states: the same state after
    every call, the padded bytes the unpadded ones in a corner of zeros."""
    recipe = DelayedScaling(amax_history_len=4, first_step=first_step, margin=1)
    twins = [ScalingState.create([False, False], recipe, like=torch.zeros(1, device=device)) for _ in range(2)]
    rng = seeded("pad-slots", first_step)
    wn, bn = layer_params(rng, 40)
    w, b = to_torch(wn, device), to_torch(bn, device)
    for step in range(2):
        x = to_torch(activations(rng, (2, 17, 40), "bfloat16"), device)
        plain = fusedfp8.layernorm_quantize(x, w, b, 1e-5, twins[0].slot(1, recipe), transpose=True)
        padded = fusedfp8.layernorm_quantize(x, w, b, 1e-5, twins[1].slot(1, recipe), transpose=True, pad_to=16)
        check_padded(plain, padded, (2, 17, 40), 16)
        for field in ("amax_history", "scale", "scale_inv", "updates"):
            assert bytes_of(getattr(twins[0], field)) == bytes_of(getattr(twins[1], field)), (step, field)
        if step == 0:
            assert bool((to_np(padded.quantized.data).view(np.uint8) & 0x7F).any())
        for st in twins:
            fusedfp8.update_scales(st, recipe)


def test_bad_pad_to_is_refused_before_anything_is_written(device):
    x = to_torch(activations(seeded("pad-bad"), (17, 40), "float32"), device)
    amax = torch.full((1,), 5.0, device=device)
    recipe = DelayedScaling(amax_history_len=4)
    st = ScalingState.create([False], recipe, like=torch.zeros(1, device=device))
    before = [bytes_of(getattr(st, f)) for f in ("amax_history", "scale", "scale_inv", "updates")]
    for bad in (0, -16, 1.5, True, "16", None):
        with pytest.raises(ValueError, match=f"pad_to must be a positive int .*got {bad!r}"):
            fusedfp8.layernorm_quantize(x, None, None, 1e-5, 2.0, amax=amax, pad_to=bad)
        with pytest.raises(ValueError, match="pad_to must be a positive int"):
            fusedfp8.layernorm_quantize(x, None, None, 1e-5, st.slot(0, recipe), transpose=True, pad_to=bad)
    assert to_np(amax)[0] == 5.0
    assert [bytes_of(getattr(st, f)) for f in ("amax_history", "scale", "scale_inv", "updates")] == before


# ---- the launch plans (no GPU: fake kernels) -------------------------------------------------------
SMS = 132


def fake_refs() -> dict:
    names = K.name_expressions(K.ModuleKey("layernorm_quantize", "bfloat16", "e4m3", param="float32"))
    return {role: PL.KernelRef(0x7F40_0000_1000 + 0x100 * i, expr, role, 2, 1 + i) for i, (role, expr) in
            enumerate(names.items())}


@pytest.mark.parametrize("cols, optin, want", [
    (1024, 227 << 10, (16, 16 << 10)), (300, 227 << 10, (16, 16 * 304)), (4096, 227 << 10, (16, 64 << 10)),
    (8192, 227 << 10, (8, 64 << 10)), (16384, 227 << 10, (8, 128 << 10)), (20000, 227 << 10, (4, 80000)),
    (16384, 99 << 10, (4, 64 << 10)), (50000, 227 << 10, (4, 200000)),
])
def test_transposed_tile(cols, optin, want):
    """Rows of the shared tile: 16 while the tile stays within 64 KiB, 8 within 128 KiB, else 4, all
    within the device's opt-in shared memory (227 KiB on an H200, 99 KiB on sm_89) less the static."""
    assert PL.layernorm_tile(cols, optin) == want


@pytest.mark.parametrize("cols, tile_rows, want", [
    (1024, 16, 512), (4096, 16, 512), (300, 16, 512), (8, 16, 512), (16384, 8, 512), (20000, 4, 512), (1024, 0, 256),
    (16384, 0, 512),
])
def test_layernorm_block(cols, tile_rows, want):
    """Threads per block of the layernorm kernel: max(256, threads per row) without q_t; with q_t a
    tile's rows in one pass, at most 512 threads, so that the rows per tile stay a multiple of the
    rows per pass."""
    got = PL.layernorm_block(ln.threads_per_row(cols), tile_rows)
    assert got == want and (not tile_rows or tile_rows % (got // ln.threads_per_row(cols)) == 0)


@pytest.mark.parametrize("cols, split", [(1, False), (1024, False), (4095, False), (4096, True), (16384, True),
                                         (60000, True)])
def test_which_widths_take_q_t_from_a_second_launch(cols, split):
    """LayerNorm's q_t from transpose_fp8 after the main kernel from LN_SPLIT_COLS (4096) padded
    columns on, from the kernel's shared tile below."""
    assert PL.LN_SPLIT_COLS == 4096 and PL.split_transpose(cols) == split


def test_a_split_q_t_takes_any_width():
    """The split plan keeps no tile of whole rows in shared memory, so q_t of a width the fused
    kernel refuses (60000 columns) is planned: the kernel without q_t, then transpose_fp8 over q."""
    with pytest.raises(ValueError, match="at most"):
        PL.layernorm_tile(60000, 227 << 10)
    refs = fake_refs()
    plan = PL.build_layernorm_plan(refs, SMS, 3, 60000, True, False, 1e-5, 1.0, 0, (0, 0), 1)
    assert [v.func for step in plan.steps for v in step.variants] == [refs["layernorm_store1"].func,
                                                                     refs["transpose_tiled"].func]
    assert plan.steps[-1].variants[0].grid == min(1 * 938, 2 * SMS) and plan.steps[-1].block == 256


def test_transposed_tile_too_wide_is_refused():
    with pytest.raises(ValueError, match=r"transpose=True needs 4 rows .* at most 24832 columns; got 30000"):
        PL.layernorm_tile(30000, 99 << 10)


@pytest.mark.parametrize("rows, cols, transpose, first, pad_to", [
    (2048, 1024, False, False, 1), (2048, 4096, True, True, 1), (303, 300, True, False, 1), (5, 20000, False, True, 1),
    (0, 64, True, True, 1),
    # padded: the padded main kernel (the pre-pass the unpadded one), its groups over the padded rows
    (303, 300, True, False, 16), (303, 300, False, True, 16), (8190, 1024, True, True, 16), (1, 8, False, False, 16),
    (5, 20000, True, True, 16), (17, 40, True, False, 3), (33, 17, True, False, 128), (17, 40, True, False, 1),
    # nothing to pad (aligned, or no rows): what pad_to=1 launches
    (2048, 1024, True, True, 16), (0, 20, True, True, 16),
    # q_t from a second launch (from 4096 columns on)
    (2048, 4096, True, False, 1), (264, 16384, True, True, 1), (100, 20000, True, False, 16), (3, 4090, True, True, 16),
])
def test_plan_launches(rows, cols, transpose, first, pad_to):
    """The launches of a plan, packed as the driver gets them: the pre-pass on a first step (at
    most one block per multiprocessor, no outputs), the main kernel (the transposed role with the
    tile's shared memory), block max(256, threads per row), one resident wave at most; for 0 rows
    one block that only hands out 1 / scale. With a pad: the padded main kernel, with the padded
    shape after the logical one, its groups (and the tile's columns) those of the padded shape.
    The transposed main kernel takes a tile's rows in one pass: tile_rows * threads per row threads
    (at most 512, at least 256). From 4096 padded columns on q_t comes from a second launch: the main
    kernel without q_t (no tile), then transpose_fp8 over q (the padded q: prows x pcols), one block of
    256 per 128 x 64 tile, one resident wave at most."""
    refs = fake_refs()
    prows, pcols = launch.padded(rows, cols, pad_to)
    split = transpose and pcols >= 4096
    pad = rows > 0 and (prows, pcols) != (rows, cols)
    fused_t = transpose and not split
    tile = PL.layernorm_tile(pcols, 227 << 10) if fused_t else (0, 0)
    plan = PL.build_layernorm_plan(refs, SMS, rows, cols, transpose, first, 1e-5, 0.5, 8, tile, pad_to)
    ptrs = tuple(0x7000_0000_0000 + 0x10_0000 * (i + 1) for i in range(len(PL.LAYERNORM_SLOTS)))
    s = dict(zip(PL.LAYERNORM_SLOTS, ptrs))
    tpr = ln.threads_per_row(cols)
    block = max(256, tpr)
    fmt = PL.SIGNATURES["layernorm"]

    def pack(*args):
        return struct.pack(fmt, *args)

    def pack_main(*args):  # the logical shape at 13, 14; the padded one after it
        if not pad:
            return pack(*args)
        return struct.pack(PL.SIGNATURES["padded_layernorm"], *args[:15], prows, pcols, *args[15:])

    def st(name):
        return s[name] + 8

    want = []
    if rows == 0:
        want.append((refs["layernorm_store1_t" if fused_t else "layernorm_store1"].func, 1, block, 0, pack(
            s["x"], s["weight"], s["bias"], 0, 0, 0, 0, st("scale"), st("amax"), 0, 0, s["scale_inv_used"], 0, 0, cols,
            tpr, 0, int(cols % 8 == 0), 0, 1e-5, 0.5)))
    else:
        if first:
            want.append((refs["layernorm_store0"].func, min(-(-rows // (block // tpr)), SMS), block, 0, pack(
                s["x"], s["weight"], s["bias"], 0, 0, 0, 0, st("scale"), st("amax"), 0, 0, 0, st("updates"), rows,
                cols, tpr, 0, int(cols % 8 == 0), 0, 1e-5, 0.5)))
        group = tile[0] if fused_t else block // tpr
        main = refs[("padded_" if pad else "") + ("layernorm_store1_t" if fused_t else "layernorm_store1")]
        main_block = min(512, max(block, tile[0] * tpr)) if fused_t else block
        want.append((main.func, min(-(-prows // group), 2 * SMS), main_block, tile[1], pack_main(
            s["x"], s["weight"], s["bias"], s["q"], s["q_t"] if fused_t else 0, s["mean"], s["rstd"], st("scale"),
            st("amax"), st("scale_out") if first else 0, st("scale_inv_out") if first else 0, s["scale_inv_used"],
            st("updates") if first else 0, rows, cols, tpr, tile[0], int(cols % 8 == 0 and pcols % 8 == 0),
            int(fused_t and prows % tile[0] == 0), 1e-5, 0.5)))
        if split:
            tiles = -(-prows // 128) * -(-pcols // 64)
            want.append((refs["transpose_tiled"].func, min(tiles, 2 * SMS), 256, 0, struct.pack(
                PL.SIGNATURES["transpose"], s["q"], s["q_t"], prows, pcols, int(pcols % 16 == 0),
                int(prows % 16 == 0))))
    got = []
    dry = E.dry_run(plan, ptrs)
    at = 0
    while at < len(dry):
        _, func, grid, blk, shared, size = struct.unpack_from("<qQqqqq", dry, at)
        got.append((func, grid, blk, shared, dry[at + 48:at + 48 + size]))
        at += 48 + size + (-size % 8)
    assert got == want
    second = split and rows > 0
    assert [step.layout for step in plan.steps] == [PL.signature("layernorm")] * (len(plan.steps) - 1 - second) + [
        PL.signature("padded_layernorm" if pad else "layernorm")] + [PL.signature("transpose")] * second
    if not pad:  # pad_to changes nothing where there is nothing to pad
        same = PL.build_layernorm_plan(refs, SMS, rows, cols, transpose, first, 1e-5, 0.5, 8, tile, 1)
        assert plan.steps == same.steps
