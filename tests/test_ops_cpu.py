"""fusedfp8.ops on host arrays: numpy, torch CPU and jax CPU give the reference's bytes, in the
caller's framework types, and every bad argument is refused by name before anything is written."""
import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest
import torch

from fusedfp8 import ops
from fusedfp8 import reference as ref
from fusedfp8.formats import E4M3, E5M2
from fusedfp8.recipe import DelayedScaling
from fusedfp8.state import STATE_FIELDS, ScalingState

f32 = np.float32
BF16 = np.dtype(ml_dtypes.bfloat16)
DTYPES = {"f32": np.dtype(np.float32), "f16": np.dtype(np.float16), "bf16": BF16}
FRAMEWORKS = ["numpy", "torch", "jax"]
FMTS = {"e4m3": E4M3, "e5m2": E5M2}

SHAPES = {  # label: shape (the shape groups of STYLE.md; 'large' runs on the GPU only)
    "aligned-64x128": (64, 128),
    "ragged-303x300": (303, 300),
    "ragged-1x1": (1, 1),
    "ragged-7": (7,),
    "ragged-0x16": (0, 16),
    "ragged-odd-tail-33x17": (33, 17),
    "ragged-3d-3x5x7": (3, 5, 7),
}


# ---- framework plumbing ----------------------------------------------------------------------
def to_fw(x: np.ndarray, fw: str):
    """A copy of the numpy array x (float32/float16/ml_dtypes bfloat16/float8) in framework fw."""
    x = np.array(x, order="C", copy=True)  # (np.ascontiguousarray would make a 0-d array 1-d)
    if fw == "numpy":
        return x
    if fw == "jax":
        return jnp.asarray(x)
    if x.dtype.itemsize == 1 and x.dtype.kind not in "iub":  # float8
        return torch.from_numpy(x.view(np.uint8)).view(getattr(torch, x.dtype.name))
    if x.dtype == BF16:
        return torch.from_numpy(x.view(np.int16)).view(torch.bfloat16)
    return torch.from_numpy(x)


def to_np(a) -> np.ndarray:
    """Framework array -> numpy, bfloat16 / float8 as ml_dtypes (bits preserved)."""
    if isinstance(a, torch.Tensor):
        name = str(a.dtype).replace("torch.", "")
        if name == "bfloat16":
            return a.view(torch.int16).numpy().view(BF16)
        if name.startswith("float8"):
            return a.view(torch.uint8).numpy().view(getattr(ml_dtypes, name))
        return a.numpy()
    return np.asarray(a)


def bytes_of(a) -> bytes:
    return to_np(a).tobytes()


def assert_type(a, fw: str, dtype_name: str, shape) -> None:
    if fw == "torch":
        assert isinstance(a, torch.Tensor) and a.device.type == "cpu"
        assert a.dtype == getattr(torch, dtype_name)
    elif fw == "jax":
        assert isinstance(a, jax.Array)
        assert a.dtype == jnp.dtype(dtype_name)
    else:
        assert type(a) is np.ndarray
        assert a.dtype == (BF16 if dtype_name == "bfloat16" else np.dtype(getattr(ml_dtypes, dtype_name, dtype_name)))
    assert tuple(a.shape) == tuple(shape)


def scalar(fw: str, v: float, dtype=np.float32):
    return to_fw(np.array([v], dtype), fw)


def data(shape, dtype, rng, spread=100.0) -> np.ndarray:
    return (rng.standard_normal(shape) * spread).astype(np.float32).astype(dtype)


def t_shape(shape):
    return (shape[-1], int(np.prod(shape[:-1], dtype=np.int64)) if len(shape) > 1 else 1)


# ---- results equal the reference, in the caller's types --------------------------------------
@pytest.mark.parametrize("shape", list(SHAPES.values()), ids=list(SHAPES))
@pytest.mark.parametrize("fmt", list(FMTS))
@pytest.mark.parametrize("dtype", list(DTYPES))
@pytest.mark.parametrize("fw", FRAMEWORKS)
def test_quantize(fw, dtype, fmt, shape, rng):
    x = data(shape, DTYPES[dtype], rng)
    want = ref.quantize(x, f32(3.0), fmt, transpose=True)
    got = ops.quantize(to_fw(x, fw), scalar(fw, 3.0), fmt, transpose=True)
    assert_type(got.data, fw, FMTS[fmt].dtype_name, shape)
    assert_type(got.data_t, fw, FMTS[fmt].dtype_name, t_shape(shape))
    assert_type(got.amax, fw, "float32", (1,))
    assert bytes_of(got.data) == want.data.tobytes()
    assert bytes_of(got.data_t) == want.data_t.tobytes()
    assert bytes_of(got.amax) == np.array([want.amax]).tobytes()
    assert got.dbias is None and ops.quantize(to_fw(x, fw), scalar(fw, 3.0), fmt).data_t is None


@pytest.mark.parametrize("shape", list(SHAPES.values()), ids=list(SHAPES))
@pytest.mark.parametrize("approximate", ["tanh", "none"])
@pytest.mark.parametrize("dtype", list(DTYPES))
@pytest.mark.parametrize("fw", FRAMEWORKS)
def test_gelu_quantize(fw, dtype, approximate, shape, rng):
    x = data(shape, DTYPES[dtype], rng, spread=4.0)
    want = ref.gelu_quantize(x, f32(64.0), "e4m3", approximate, transpose=True)
    got = ops.gelu_quantize(to_fw(x, fw), scalar(fw, 64.0), "e4m3", approximate=approximate, transpose=True)
    assert_type(got.data, fw, "float8_e4m3fn", shape)
    assert bytes_of(got.data) == want.data.tobytes()
    assert bytes_of(got.data_t) == want.data_t.tobytes()
    assert bytes_of(got.amax) == np.array([want.amax]).tobytes()


@pytest.mark.parametrize("shape", list(SHAPES.values()), ids=list(SHAPES))
@pytest.mark.parametrize("approximate", ["tanh", "none"])
@pytest.mark.parametrize("dtype", list(DTYPES))
@pytest.mark.parametrize("fw", FRAMEWORKS)
def test_dgelu_quantize(fw, dtype, approximate, shape, rng):
    dy = data(shape, DTYPES[dtype], rng, spread=1e-3)
    x = data(shape, DTYPES[dtype], rng, spread=3.0)
    want = ref.dgelu_quantize(dy, x, f32(2.0 ** 14), "e5m2", approximate, transpose=True, dbias=True)
    got = ops.dgelu_quantize(to_fw(dy, fw), to_fw(x, fw), scalar(fw, 2.0 ** 14), "e5m2", approximate=approximate,
                             transpose=True, dbias=True)
    assert_type(got.data, fw, "float8_e5m2", shape)
    assert_type(got.dbias, fw, "float32", (shape[-1],))
    assert bytes_of(got.data) == want.data.tobytes()
    assert bytes_of(got.data_t) == want.data_t.tobytes()
    assert bytes_of(got.amax) == np.array([want.amax]).tobytes()
    assert bytes_of(got.dbias) == want.dbias.tobytes()
    plain = ops.dgelu_quantize(to_fw(dy, fw), to_fw(x, fw), scalar(fw, 2.0 ** 14), "e5m2", approximate=approximate)
    assert plain.dbias is None and plain.data_t is None


@pytest.mark.parametrize("shape", [(16, 16), (303, 300), (7,), (0, 16)], ids=["aligned-16x16", "ragged-303x300",
                                                                              "ragged-7", "ragged-0x16"])
@pytest.mark.parametrize("out", ["float32", "float16", "bfloat16"])
@pytest.mark.parametrize("fmt", list(FMTS))
@pytest.mark.parametrize("fw", FRAMEWORKS)
def test_dequantize(fw, fmt, out, shape):
    codes = (np.arange(int(np.prod(shape)), dtype=np.int64) % 256).astype(np.uint8).reshape(shape)
    q = codes.view(FMTS[fmt].numpy_dtype)
    out_np = BF16 if out == "bfloat16" else np.dtype(out)
    want = ref.dequantize(q, np.array([0.375], np.float32), out_np)
    got = ops.dequantize(to_fw(q, fw), scalar(fw, 0.375), out)
    assert_type(got, fw, out, shape)
    assert bytes_of(got) == want.tobytes()
    # the same with the format given explicitly (it must agree)
    assert bytes_of(ops.dequantize(to_fw(q, fw), scalar(fw, 0.375), out, fmt=fmt)) == want.tobytes()


@pytest.mark.parametrize("fmt", list(FMTS))
def test_dequantize_uint8_with_format(fmt):
    codes = np.arange(256, dtype=np.uint8)
    got = ops.dequantize(codes, np.array([2.0], np.float32), "float32", fmt=fmt)
    want = ref.dequantize(codes.view(FMTS[fmt].numpy_dtype), np.array([2.0], np.float32), np.float32)
    assert got.tobytes() == want.tobytes()


@pytest.mark.parametrize("dtype", list(DTYPES))
@pytest.mark.parametrize("fw", FRAMEWORKS)
def test_special_values(fw, dtype):
    v = np.array([0.0, -0.0, np.inf, -np.inf, 1e4, -1e4, 448.0, 464.0, 2.0 ** -10, 2.0 ** -9, 3 * 2.0 ** -10, 1e-7,
                  -1e-7, np.nan, 5e-41, 2.0 ** -24], np.float32).astype(DTYPES[dtype])
    for fmt in FMTS:
        want = ref.quantize(v, f32(1.0), fmt)
        got = ops.quantize(to_fw(v, fw), scalar(fw, 1.0), fmt)
        assert bytes_of(got.data) == want.data.tobytes(), fmt
        assert np.isnan(to_np(got.amax)[0])
        finite = v[:-3]  # no NaN: amax is inf
        assert to_np(ops.quantize(to_fw(finite, fw), scalar(fw, 1.0), fmt).amax)[0] == np.inf


@pytest.mark.parametrize("dtype, bits, value", [("f16", 0x0001, 2.0 ** -24), ("bf16", 0x0001, 2.0 ** -133)],
                         ids=["f16", "bf16"])
@pytest.mark.parametrize("fw", FRAMEWORKS)
def test_denormal_amax(fw, dtype, bits, value):
    raw = np.zeros(9, np.uint16)
    raw[3] = bits
    x = raw.view(DTYPES[dtype])
    got = to_np(ops.quantize(to_fw(x, fw), scalar(fw, 1.0)).amax)
    assert got[0] == np.float32(value) and got[0] != 0


# ---- amax= accumulates in place --------------------------------------------------------------
@pytest.mark.parametrize("start, x_has_nan, expect", [
    (0.0, False, "amax"), (1e6, False, 1e6), (np.nan, False, np.nan), (0.0, True, np.nan), (5.0, True, np.nan),
], ids=["from-0", "keeps-larger", "keeps-nan", "nan-in-x", "nan-in-x-over-value"])
@pytest.mark.parametrize("op", ["quantize", "gelu_quantize", "dgelu_quantize"])
@pytest.mark.parametrize("fw", ["numpy", "torch"])
def test_amax_accumulates_in_place(fw, op, start, x_has_nan, expect, rng):
    x = data((13, 21), np.float32, rng)
    if x_has_nan:
        x[4, 4] = np.nan
    amax = scalar(fw, start)
    if op == "quantize":
        r = ops.quantize(to_fw(x, fw), scalar(fw, 1.0), amax=amax)
        own = ref.amax(x)
    elif op == "gelu_quantize":
        r = ops.gelu_quantize(to_fw(x, fw), scalar(fw, 1.0), amax=amax)
        own = ref.gelu_quantize(x, f32(1.0)).amax
    else:
        r = ops.dgelu_quantize(to_fw(x, fw), to_fw(x, fw), scalar(fw, 1.0), amax=amax)
        own = ref.dgelu_quantize(x, x, f32(1.0)).amax
    assert r.amax is amax  # the caller's array, written in place
    got = to_np(amax)[0]
    want = own if expect == "amax" else expect
    if np.isnan(want):
        assert np.isnan(got)
    else:
        assert got == np.float32(want)


@pytest.mark.parametrize("fw", ["numpy", "torch"])
def test_amax_accumulates_over_calls_and_ignores_empty(fw, rng):
    amax = scalar(fw, 0.0)
    xs = [data((5, 6), np.float32, rng, spread=s) for s in (1.0, 50.0, 2.0)] + [np.zeros((0, 6), np.float32)]
    for x in xs:
        ops.quantize(to_fw(x, fw), scalar(fw, 1.0), amax=amax)
    assert to_np(amax)[0] == max(ref.amax(x) for x in xs)


# ---- the error matrix --------------------------------------------------------------------------
class Ctx:
    """Arguments of one framework, and the writable arrays a rejected call must leave alone."""

    def __init__(self, fw: str):
        self.fw = fw
        other = "torch" if fw != "torch" else "numpy"
        base = np.arange(32, dtype=np.float32).reshape(4, 8) - 10
        self.x = to_fw(base, fw)
        self.x_bf16 = to_fw(base.astype(BF16), fw)
        self.x_t = to_fw(base, fw).T if fw != "jax" else None
        self.x_other_shape = to_fw(base.reshape(8, 4), fw)
        self.x_i32 = to_fw(base.astype(np.int32), fw)
        self.x0 = to_fw(np.array(3.0, np.float32), fw)
        self.scale = scalar(fw, 2.0)
        self.scale_f64 = scalar(fw, 2.0, np.float64)  # (jax without x64 makes it float32: host only)
        self.scale_f16 = scalar(fw, 2.0, np.float16)
        self.scale_2 = to_fw(np.array([2.0, 2.0], np.float32), fw)
        self.scale_other = scalar(other, 2.0)
        self.q = ops.quantize(self.x, self.scale).data
        self.q_u8 = to_fw(np.zeros(4, np.uint8), fw)
        self.amax = scalar(fw, 0.0) if fw != "jax" else None  # would become 21 if written
        self.amax_jax = jnp.zeros(1, jnp.float32)
        self.amax_f64 = scalar(fw, 0.0, np.float64)
        self.amax_ro = None
        if fw == "numpy":
            self.amax_ro = np.zeros(1, np.float32)
            self.amax_ro.flags.writeable = False
        self.recipe = DelayedScaling(amax_history_len=31)
        like = {"numpy": None, "torch": torch.zeros(0), "jax": jnp.zeros(0)}[fw]
        self.state = ScalingState.create((False, True), self.recipe, like=like)
        self.state_other = ScalingState.create((False, True), self.recipe, like=torch.zeros(0) if fw != "torch" else None)

    def snapshot(self):
        arrays = [getattr(s, f) for s in (self.state, self.state_other) for f in STATE_FIELDS]
        arrays += [a for a in (self.amax, self.amax_jax, self.amax_f64, self.amax_ro) if a is not None]
        return [bytes_of(a) for a in arrays]


ANY = FRAMEWORKS
HOST_MUTABLE = ["numpy", "torch"]
ERRORS = [  # id, frameworks, call, exception, message pattern (anchored: the message starts with the argument)
    ("x-int32", ANY, lambda c: ops.quantize(c.x_i32, c.scale, amax=c.amax), TypeError,
     r"^x must be float32, float16 or bfloat16; got int32"),
    ("x-not-an-array", ANY, lambda c: ops.quantize([1.0, 2.0], c.scale), TypeError, r"^x: expected a numpy"),
    ("x-non-contiguous", HOST_MUTABLE, lambda c: ops.quantize(c.x_t, c.scale, amax=c.amax), ValueError,
     r"^x must be contiguous"),
    ("x-scalar-transpose", ANY, lambda c: ops.quantize(c.x0, c.scale, transpose=True), ValueError, r"^x: transpose"),
    ("scale-f64", HOST_MUTABLE, lambda c: ops.quantize(c.x, c.scale_f64, amax=c.amax), TypeError,
     r"^scale must be a float32 array; got float64"),
    ("scale-f16", ANY, lambda c: ops.quantize(c.x, c.scale_f16, amax=c.amax), TypeError,
     r"^scale must be a float32 array; got float16"),
    ("scale-2-elements", ANY, lambda c: ops.quantize(c.x, c.scale_2, amax=c.amax), ValueError,
     r"^scale must hold exactly one element; got shape \(2,\)"),
    ("scale-other-framework", ANY, lambda c: ops.quantize(c.x, c.scale_other, amax=c.amax), TypeError,
     r"^scale is a (torch|numpy) array but the input is a (numpy|torch|jax) array"),
    ("scale-python-float", ANY, lambda c: ops.quantize(c.x, 2.0, amax=c.amax), TypeError, r"^scale: expected"),
    ("amax-jax", ["jax"], lambda c: ops.quantize(to_fw(np.ones(3, np.float32), "jax"), scalar("jax", 1.0),
                                             amax=c.amax_jax), TypeError, r"^amax: jax arrays are immutable"),
    ("amax-f64", HOST_MUTABLE, lambda c: ops.quantize(c.x, c.scale, amax=c.amax_f64), TypeError,
     r"^amax must be a float32 array; got float64"),
    ("amax-read-only", ["numpy"], lambda c: ops.quantize(c.x, c.scale, amax=c.amax_ro), ValueError,
     r"^amax is a read-only numpy array"),
    ("fmt-unknown", ANY, lambda c: ops.quantize(c.x, c.scale, "e4m4", amax=c.amax), ValueError,
     r"^fmt: unsupported FP8 format 'e4m4'; expected one of 'e4m3', 'e5m2'"),
    ("fmt-int", ANY, lambda c: ops.quantize(c.x, c.scale, 8, amax=c.amax), ValueError, r"^fmt: unsupported FP8"),
    ("approximate-gelu", ANY, lambda c: ops.gelu_quantize(c.x, c.scale, approximate="erf", amax=c.amax), ValueError,
     r"^approximate must be 'tanh' or 'none'; got 'erf'"),
    ("approximate-dgelu", ANY, lambda c: ops.dgelu_quantize(c.x, c.x, c.scale, approximate=True, amax=c.amax),
     ValueError, r"^approximate must be"),
    ("dy-x-shape", ANY, lambda c: ops.dgelu_quantize(c.x, c.x_other_shape, c.scale, amax=c.amax), ValueError,
     r"^dy and x must have the same shape; got \(4, 8\) and \(8, 4\)"),
    ("dy-x-dtype", ANY, lambda c: ops.dgelu_quantize(c.x, c.x_bf16, c.scale, amax=c.amax), TypeError,
     r"^dy and x must have the same dtype"),
    ("dy-int32", ANY, lambda c: ops.dgelu_quantize(c.x_i32, c.x, c.scale, amax=c.amax), TypeError, r"^dy must be float32"),
    ("dgelu-x-int32", ANY, lambda c: ops.dgelu_quantize(c.x, c.x_i32, c.scale, amax=c.amax), TypeError,
     r"^x must be float32"),
    ("dgelu-x-non-contiguous", HOST_MUTABLE,
     lambda c: ops.dgelu_quantize(to_fw(np.ones((8, 4), np.float32), c.fw), c.x_t, c.scale, amax=c.amax), ValueError,
     r"^x must be contiguous"),
    ("slot-fmt-disagrees", HOST_MUTABLE, lambda c: ops.quantize(c.x, c.state.slot(0, c.recipe), "e5m2"), ValueError,
     r"^fmt: 'e5m2' disagrees with the slot's recipe format 'e4m3'"),
    ("slot-grad-fmt-disagrees", HOST_MUTABLE, lambda c: ops.quantize(c.x, c.state.slot(1, c.recipe), "e4m3"),
     ValueError, r"^fmt: 'e4m3' disagrees with the slot's recipe format 'e5m2'"),
    ("slot-with-amax", HOST_MUTABLE, lambda c: ops.quantize(c.x, c.state.slot(0, c.recipe), amax=c.amax), ValueError,
     r"^amax: a slot accumulates into its state"),
    ("slot-other-framework", HOST_MUTABLE, lambda c: ops.quantize(c.x, c.state_other.slot(0, c.recipe)), TypeError,
     r"^state\.scale is a (torch|numpy) array but the input is a"),
    ("slot-x-int32", HOST_MUTABLE, lambda c: ops.quantize(c.x_i32, c.state.slot(0, c.recipe)), TypeError,
     r"^x must be float32"),
    ("slot-jax-state", ["jax"], lambda c: ops.quantize(c.x, c.state.slot(0, c.recipe)), TypeError,
     r"^state\.scale: jax arrays are immutable"),
    ("dequantize-q-float32", ANY, lambda c: ops.dequantize(c.x, c.scale), TypeError,
     r"^q must be a float8_e4m3fn / float8_e5m2 array"),
    ("dequantize-uint8-no-fmt", ANY, lambda c: ops.dequantize(c.q_u8, c.scale), ValueError, r"^q is uint8: pass fmt"),
    ("dequantize-fmt-disagrees", ANY, lambda c: ops.dequantize(c.q, c.scale, fmt="e5m2"), ValueError,
     r"^fmt: 'e5m2' disagrees with q's dtype float8_e4m3fn"),
    ("dequantize-dtype", ANY, lambda c: ops.dequantize(c.q, c.scale, "float64"), ValueError,
     r"^dtype must be one of \('float32', 'float16', 'bfloat16'\); got 'float64'"),
    ("dequantize-scale_inv-f16", ANY, lambda c: ops.dequantize(c.q, c.scale_f16), TypeError,
     r"^scale_inv must be a float32 array; got float16"),
    ("dequantize-scale_inv-size", ANY, lambda c: ops.dequantize(c.q, c.scale_2), ValueError,
     r"^scale_inv must hold exactly one element"),
    ("dequantize-non-contiguous", HOST_MUTABLE,
     lambda c: ops.dequantize(ops.quantize(c.x_t.T, c.scale).data.T, c.scale), ValueError, r"^q must be contiguous"),
]
ERROR_PARAMS = [pytest.param(fw, call, exc, match, id=f"{fw}-{name}")
                for name, fws, call, exc, match in ERRORS for fw in fws]


@pytest.mark.parametrize("fw, call, exc, match", ERROR_PARAMS)
def test_errors_name_the_argument_and_change_nothing(fw, call, exc, match):
    c = Ctx(fw)
    before = c.snapshot()
    with pytest.raises(exc, match=match):
        call(c)
    assert c.snapshot() == before


def test_the_error_matrix_would_have_written():
    """Control for the test above: the same arrays do change on an accepted call."""
    c = Ctx("numpy")
    before = c.snapshot()
    ops.quantize(c.x, c.scale, amax=c.amax)
    ops.quantize(c.x, c.state.slot(0, c.recipe))
    after = c.snapshot()
    assert after != before
    assert c.amax[0] == 21.0 and c.state.amax_history[0, 0] == 21.0 and c.state.scale[0] == np.float32(448 / 21)


def test_dy_and_x_from_two_frameworks_are_refused():
    x = np.ones((2, 3), np.float32)
    with pytest.raises(ValueError, match=r"^dy is on cpu \(numpy\) but x is on cpu \(torch\)"):
        ops.dgelu_quantize(x, torch.ones(2, 3), np.ones(1, np.float32))


SCALAR_OPS = {  # op: (call, input dtype)
    "quantize": (lambda x, s: ops.quantize(x, s).data, np.float32),
    "gelu_quantize": (lambda x, s: ops.gelu_quantize(x, s).data, np.float32),
    "dgelu_quantize": (lambda x, s: ops.dgelu_quantize(x, x, s).data, np.float32),
    "dequantize": (lambda q, s: ops.dequantize(q, s), ml_dtypes.float8_e4m3fn),
}


@pytest.mark.parametrize("op", list(SCALAR_OPS))
@pytest.mark.parametrize("fw", FRAMEWORKS)
def test_scalar_input(fw, op):
    call, dtype = SCALAR_OPS[op]
    one = call(to_fw(np.array([3.0], np.float32).astype(dtype), fw), scalar(fw, 1.0))
    got = call(to_fw(np.array(3.0, np.float32).astype(dtype), fw), scalar(fw, 1.0))
    assert tuple(got.shape) == () and bytes_of(got) == bytes_of(one)
