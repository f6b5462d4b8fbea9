"""fusedfp8's framework-agnostic functions (fusedfp8/ops.py) and their interop (fusedfp8/_interop.py):
every bad argument is refused by name before anything is written (host arrays of numpy, torch and
jax; and the GPU-only cases), results come back in the caller's framework (cupy and jax GPU arrays,
torch FP8 outputs allocated without a copy), on the caller's stream. Byte-exactness against the
reference, on both devices, is tests/kernels/test_kernels.py."""
import jax.numpy as jnp
import numpy as np
import pytest
import torch

import fusedfp8
from fusedfp8 import ops
from fusedfp8.numerics import reference as ref
from fusedfp8.recipe import DelayedScaling
from fusedfp8.state import STATE_FIELDS, ScalingState
from support import shapes as S
from support.frameworks import BF16, HOST_FRAMEWORKS, bytes_of, scalar, to_fw

FRAMEWORKS = list(HOST_FRAMEWORKS)
FMTS = {"e4m3": fusedfp8.E4M3, "e5m2": fusedfp8.E5M2}


def test_the_face_is_the_ops_module():
    for name in ops.__all__:
        assert getattr(fusedfp8, name) is getattr(ops, name)


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
        self.state_other = ScalingState.create((False, True), self.recipe,
                                               like=torch.zeros(0) if fw != "torch" else None)

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
    ("scale-a-string", ANY, lambda c: ops.quantize(c.x, "2.0", amax=c.amax), TypeError,
     r"^scale: expected a Python float, a 1-element float32 array on the input's device, or a Slot"),
    ("scale-a-bool", ANY, lambda c: ops.quantize(c.x, True, amax=c.amax), TypeError, r"^scale: expected"),
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
    ("dy-int32", ANY, lambda c: ops.dgelu_quantize(c.x_i32, c.x, c.scale, amax=c.amax), TypeError,
     r"^dy must be float32"),
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


@pytest.mark.parametrize("fmt", list(FMTS))
def test_dequantize_uint8_with_format(fmt):
    codes = np.arange(256, dtype=np.uint8)
    got = ops.dequantize(codes, np.array([2.0], np.float32), "float32", fmt=fmt)
    want = ref.dequantize(codes.view(FMTS[fmt].numpy_dtype), np.array([2.0], np.float32), np.float32)
    assert got.tobytes() == want.tobytes()


@pytest.mark.parametrize("fw", ["numpy", "torch"])
def test_a_torch_state_array_that_requires_grad_or_is_an_inference_tensor_is_refused(fw):
    """A slot writes its state in place: autograd forbids that for a tensor that requires grad,
    and an inference tensor cannot be written outside inference mode."""
    r = DelayedScaling(amax_history_len=4)
    x = to_fw(np.ones((4, 4), np.float32), fw)
    if fw == "numpy":
        st = ScalingState.create(1, r)
        st.amax_history.flags.writeable = False
        with pytest.raises(ValueError, match=r"^state\.amax_history is a read-only numpy array"):
            ops.quantize(x, st.slot(0, r))
        return
    st = ScalingState.create(1, r, like=torch.zeros(0))
    st.scale.requires_grad_(True)
    with pytest.raises(ValueError, match=r"^state\.scale is a tensor that requires grad"):
        ops.quantize(x, st.slot(0, r))
    with torch.inference_mode():
        inf = ScalingState.create(1, r, like=torch.zeros(0))
    with pytest.raises(ValueError, match=r"^state\.(scale|amax_history|scale_inv) is an inference tensor"):
        ops.quantize(x, inf.slot(0, r))
    assert inf.amax_history.sum().item() == 0 and inf.scale.item() == 1.0
    with torch.inference_mode():  # inside inference mode it is an ordinary call
        ops.quantize(x, inf.slot(0, r))
    assert inf.amax_history[0, 0].item() == 1.0


def test_state_arrays_that_share_memory_are_refused():
    r = DelayedScaling(amax_history_len=4)
    st = ScalingState.create(2, r)
    bad = st.replace(scale_inv=st.scale)
    before = [getattr(bad, f).tobytes() for f in STATE_FIELDS]
    with pytest.raises(ValueError, match=r"^state\.scale and state\.scale_inv share memory; both are written"):
        ops.update_scales(bad, r)
    with pytest.raises(ValueError, match=r"share memory"):
        ops.quantize(np.ones(4, np.float32), bad.slot(0, r))
    assert [getattr(bad, f).tobytes() for f in STATE_FIELDS] == before


# ---- the GPU: device mismatches, interop, allocation, streams -----------------------------------
@pytest.mark.gpu
def test_gpu_errors_leave_state_unchanged():
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
        (lambda: ops.quantize(x, torch.ones(1, device="cuda", dtype=torch.float64)), TypeError,
         "scale must be a float32"),
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


@pytest.mark.gpu
def test_cupy_arrays():
    import cupy

    rng = np.random.default_rng(5)
    xn = S.make_input(rng, (300, 512), "float32", "e4m3")
    x = cupy.asarray(xn)
    r = ops.quantize(x, cupy.ones(1, dtype=cupy.float32), "e4m3", transpose=True)
    assert isinstance(r.data, cupy.ndarray) and r.data.dtype == cupy.uint8
    want = ref.quantize(xn, np.float32(1), "e4m3", True)
    assert bytes_of(r.data) == want.data.tobytes() and bytes_of(r.data_t) == want.data_t.tobytes()
    assert bytes_of(r.amax) == np.float32(want.amax).tobytes()
    back = ops.dequantize(r.data, cupy.ones(1, dtype=cupy.float32), "float32", fmt="e4m3")
    assert bytes_of(back) == ref.dequantize(want.data, np.float32(1)).tobytes()
    assert bytes_of(ops.quantize(x, 1.0, "e4m3").data) == want.data.tobytes()  # a Python float scale


@pytest.mark.gpu
@pytest.mark.jax_gpu
def test_jax_gpu_arrays():
    import cupy
    import jax

    rng = np.random.default_rng(6)
    xn = S.make_input(rng, (256, 384), "bfloat16", "e4m3")
    x = jax.device_put(jnp.asarray(xn), jax.devices("gpu")[0])
    assert cupy.from_dlpack(x).data.ptr == x.unsafe_buffer_pointer()  # the kernels read jax's buffer
    r = ops.quantize(x, jax.device_put(jnp.ones(1, jnp.float32), jax.devices("gpu")[0]), "e4m3", transpose=True)
    assert r.data.dtype == jnp.float8_e4m3fn
    want = ref.quantize(xn, np.float32(1), "e4m3", True)
    assert bytes_of(r.data) == want.data.tobytes() and bytes_of(r.data_t) == want.data_t.tobytes()
    assert bytes_of(r.amax) == np.float32(want.amax).tobytes()
    # a jax state is immutable: the update returns a new one and leaves the old arrays alone
    recipe = DelayedScaling(amax_history_len=4)
    st = ScalingState.create([False, True], recipe, like=x)
    st = st.replace(amax_history=st.amax_history.at[0].set(jnp.array([2.0, 0.5], jnp.float32)))
    new = ops.update_scales(st, recipe)
    assert np.asarray(st.amax_history)[0].tolist() == [2.0, 0.5] and np.asarray(st.scale).tolist() == [1.0, 1.0]
    host = ScalingState.create([False, True], recipe)
    host.amax_history[0] = [2.0, 0.5]
    ops.update_scales(host, recipe)
    for name in STATE_FIELDS:
        np.testing.assert_array_equal(np.asarray(getattr(new, name)), getattr(host, name))


@pytest.mark.gpu
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


@pytest.mark.gpu
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
    assert bytes_of(r.data) == want.data.tobytes() and bytes_of(r.data_t) == want.data_t.tobytes()


def test_torch_arrays_written_in_place_advance_their_versions(device):
    """What a function writes behind torch's back (the kernels, the host path's numpy views) is
    recorded as an in-place write: exactly the written state tensors (and a given amax) move
    their version counters, so autograd's check of saved tensors sees the writes."""
    recipe = DelayedScaling(amax_history_len=4)
    st = ScalingState.create(2, recipe, like=torch.zeros(1, device=device))
    x = torch.randn(32, 48, device=device)
    quantized = {"amax_history", "scale", "scale_inv"}
    for call, written in [(lambda: ops.quantize(x, st.slot(0, recipe), transpose=True), quantized),
                          (lambda: ops.layernorm_quantize(x, None, None, 1e-5, st.slot(1, recipe)), quantized),
                          (lambda: ops.update_scales(st, recipe), set(STATE_FIELDS))]:
        before = [getattr(st, f)._version for f in STATE_FIELDS]
        call()
        after = [getattr(st, f)._version for f in STATE_FIELDS]
        assert {f for f, b, a in zip(STATE_FIELDS, before, after) if a > b} == written
    amax = torch.zeros(1, device=device)
    v = amax._version
    ops.gelu_quantize(x, 1.0, amax=amax)
    assert amax._version > v and amax.item() > 0
