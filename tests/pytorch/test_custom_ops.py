"""fusedfp8.pytorch.custom_ops (the torch.library ops, their fake implementations and the direct
call path) and fusedfp8.pytorch.autograd's straight-through quantizer, on the CPU (reference
numerics); the ops' kernels on the GPU are tests/kernels/, their use in modules tests/pytorch/."""
from __future__ import annotations

import contextlib

import numpy as np
import pytest
import torch

import fusedfp8.pytorch as fp8
from fusedfp8.numerics import reference as ref
from fusedfp8.recipe import DelayedScaling
from fusedfp8.state import ScalingState
from support.frameworks import same_bytes
from support.frameworks import to_np as np_of
from support.torch_helpers import inputs

OPS = ["quantize", "quantize_t", "gelu_quantize", "gelu_quantize_t", "dgelu_quantize_t", "dequantize"]


# ---- custom ops ------------------------------------------------------------------------------
def _state_args(recipe=DelayedScaling(amax_history_len=4)):
    s = ScalingState.create([False, True], recipe, like=torch.empty(0))
    return s, [s.amax_history, s.scale, s.scale_inv, s.updates]


def _op_args(name):
    x = inputs(32, 48, torch.bfloat16)
    _, st = _state_args()
    if name == "dequantize":
        return (torch.randn(4, 16).to(torch.float8_e4m3fn), torch.tensor([0.5]), torch.bfloat16)
    if name == "dgelu_quantize_t":
        return (x, inputs(32, 48, torch.bfloat16, seed=1), *st, 1, "e5m2", 1.0, True, "tanh", True)
    if name.startswith("gelu"):
        return (x, *st, 0, "e4m3", 2.0, True, "none")
    return (x, *st, 0, "e4m3", 1.0, True)


@pytest.mark.parametrize("name", OPS)
def test_custom_op_fake_and_aot(name):
    """Fake implementations agree with the real ones, and AOTAutograd traces every op (the
    schema test of opcheck cannot compare float8 outputs on the CPU; mutation is tested below)."""
    op = getattr(torch.ops.fusedfp8, name).default
    result = torch.library.opcheck(op, _op_args(name),
                                   test_utils=("test_autograd_registration", "test_faketensor",
                                               "test_aot_dispatch_dynamic"))
    assert set(result.values()) == {"SUCCESS"}


@pytest.mark.parametrize("name", OPS[:-1])
def test_custom_op_schema_declares_the_state_mutation(name):
    schema = getattr(torch.ops.fusedfp8, name).default._schema
    written = {a.name for a in schema.arguments if a.alias_info is not None and a.alias_info.is_write}
    assert written == {"amax_history", "scale", "scale_inv"}


def test_custom_op_quantize_t_matches_reference_and_writes_only_the_slot():
    recipe = DelayedScaling(amax_history_len=4)
    s, st = _state_args(recipe)
    x = inputs(40, 24, torch.bfloat16)
    q, q_t, si = torch.ops.fusedfp8.quantize_t(x, *st, 1, "e5m2", recipe.margin_factor, True)
    amax = ref.amax(np_of(x))
    scale = ref.current_scale(amax, "e5m2", 1.0, np.float32(1))  # first step: current scaling
    want = ref.quantize(np_of(x), scale, "e5m2", transpose=True)
    assert same_bytes(q, want.data) and same_bytes(q_t, want.data_t)
    assert same_bytes(si, s.scale_inv[1:]) and si.data_ptr() != s.scale_inv.data_ptr() + 4  # its own buffer
    assert s.amax_history[0, 1].item() == amax and s.amax_history[0, 0].item() == 0
    assert same_bytes(s.scale[1:], np.array([scale], np.float32)) and s.scale[0].item() == 1.0
    assert s.updates.tolist() == [0, 0]
    # with current_first=False the stored scale is used as is
    q2, si2 = torch.ops.fusedfp8.quantize(x, *st, 0, "e4m3", 1.0, False)
    assert same_bytes(q2, ref.quantize(np_of(x), np.float32(1), "e4m3").data) and si2.tolist() == [1.0]


def test_custom_op_dgelu_dbias_and_its_empty_placeholder():
    _, st = _state_args()
    dy, x = inputs(16, 32, seed=2), inputs(16, 32, seed=3)
    q, q_t, db, si = torch.ops.fusedfp8.dgelu_quantize_t(dy, x, *st, 1, "e5m2", 1.0, True, "tanh", True)
    want = ref.dgelu_quantize(np_of(dy), np_of(x), st[1][1:].numpy(), "e5m2", "tanh", transpose=True, dbias=True)
    assert same_bytes(q, want.data) and same_bytes(q_t, want.data_t) and same_bytes(si, st[2][1:])
    np.testing.assert_allclose(db.numpy(), want.dbias, rtol=1e-6)
    _, st = _state_args()
    assert torch.ops.fusedfp8.dgelu_quantize_t(dy, x, *st, 1, "e5m2", 1.0, True, "tanh", False)[2].shape == (0,)


def test_call_skips_the_dispatcher_only_when_nothing_traces(monkeypatch):
    from torch._subclasses.fake_tensor import FakeTensor, FakeTensorMode

    from fusedfp8.pytorch import custom_ops as fops

    _, st = _state_args()
    x = inputs(16, 32)
    monkeypatch.setitem(fops._IMPLS, fops.quantize_t, lambda *args: "direct")
    assert fops.call(fops.quantize_t, x, *st, 0, "e4m3", 1.0, True) == "direct"
    with FakeTensorMode() as mode:  # a dispatch mode is tracing: the custom op (its fake) runs
        fake = [mode.from_tensor(t) for t in (x, *st)]
        q, q_t, si = fops.call(fops.quantize_t, *fake, 0, "e4m3", 1.0, True)
    assert isinstance(q, FakeTensor) and q.dtype == torch.float8_e4m3fn and q_t.shape == (32, 16)
    assert si.shape == (1,) and si.dtype == torch.float32


# ---- straight-through quantizer --------------------------------------------------------------
def test_quantize_ste_forward_is_fake_quant_and_gradient_is_identity():
    recipe = DelayedScaling(amax_history_len=4)
    state = ScalingState.create(1, recipe, like=torch.empty(0))
    x = inputs(8, 16).requires_grad_()
    y = fp8.quantize_ste(x, state, 0, recipe)
    scale = ref.current_scale(ref.amax(np_of(x)), "e4m3", 1.0, np.float32(1))
    want = ref.dequantize(ref.quantize(np_of(x), scale, "e4m3").data, np.float32(1) / scale)
    assert same_bytes(y, want)
    assert not torch.equal(y, x)  # it did quantize
    g = torch.randn(8, 16)
    y.backward(g)
    assert torch.equal(x.grad, g)
    assert state.amax_history[0, 0].item() == ref.amax(np_of(x))


def test_quantize_ste_rejects_a_bad_index():
    recipe = DelayedScaling(amax_history_len=4)
    state = ScalingState.create(1, recipe, like=torch.empty(0))
    with pytest.raises(IndexError, match=r"index must be in \[0, 1\)"):
        fp8.quantize_ste(torch.ones(4), state, 3, recipe)



@pytest.mark.parametrize("first", [True, False], ids=["first-step", "later"])
@pytest.mark.parametrize("shape, params", [((2048, 1024), "bf16"), ((303, 300), "none"), ((4, 7, 96), "f32"),
                                           ((1, 8), "bf16")], ids=str)
@pytest.mark.parametrize("transpose", [True, False], ids=["transpose", "plain"])
def test_custom_op_layernorm_quantize_matches_the_eager_function(device, shape, params, transpose, first):
    """fusedfp8::layernorm_quantize (on CUDA: the once-per-signature check and the cached plan)
    against fusedfp8.layernorm_quantize with a Slot of a twin state: the same bytes in q, q_t,
    scale_inv, mean, rstd and the state, over two calls (the second with the cached plan)."""
    import fusedfp8

    recipe = DelayedScaling(amax_history_len=4)
    a = ScalingState.create(3, recipe, like=torch.zeros(1, device=device))
    b = ScalingState.create(3, recipe, like=torch.zeros(1, device=device))
    if not first:
        for st in (a, b):
            st.updates.fill_(1)
            st.scale.fill_(7.0)
    cols = shape[-1]
    pdt = {"bf16": torch.bfloat16, "f32": torch.float32, "none": None}[params]
    w = None if pdt is None else (torch.rand(cols, device=device) + 0.5).to(pdt)
    bias = None if pdt is None else (torch.rand(cols, device=device) - 0.5).to(pdt)
    for seed in range(2):
        x = inputs(int(np.prod(shape[:-1])), cols, torch.bfloat16, seed=seed, device=device).reshape(shape)
        q, q_t, si, mean, rstd = fp8.custom_ops.call(fp8.custom_ops.layernorm_quantize, x, w, bias, 1e-5,
                                                     a.amax_history, a.scale, a.scale_inv, a.updates, 1, "e4m3",
                                                     recipe.margin_factor, True, transpose)
        r = fusedfp8.layernorm_quantize(x, w, bias, 1e-5, b.slot(1, recipe), transpose=transpose)
        assert same_bytes(q, r.quantized.data) and same_bytes(si, r.quantized.scale_inv)
        assert same_bytes(mean, r.mean) and same_bytes(rstd, r.rstd)
        if transpose:
            assert same_bytes(q_t, r.quantized.data_t)
        else:
            assert q_t.numel() == 0
        for f in ("amax_history", "scale", "scale_inv", "updates"):
            assert same_bytes(getattr(a, f), getattr(b, f)), f


@pytest.mark.parametrize("shape", [(1000, 40), (8190, 1024), (17, 33)], ids=str)
def test_custom_op_layernorm_quantize_pads_as_the_eager_function(device, shape):
    """pad_to=16 through the op (the kernel writes the pad) against fusedfp8.layernorm_quantize."""
    import fusedfp8

    recipe = DelayedScaling(amax_history_len=4)
    a = ScalingState.create(3, recipe, like=torch.zeros(1, device=device))
    b = ScalingState.create(3, recipe, like=torch.zeros(1, device=device))
    x = inputs(shape[0], shape[1], torch.bfloat16, device=device)
    w = torch.rand(shape[1], device=device).to(torch.bfloat16) + 0.5
    q, q_t, si, mean, rstd = fp8.custom_ops.call(fp8.custom_ops.layernorm_quantize, x, w, None, 1e-5, a.amax_history,
                                                 a.scale, a.scale_inv, a.updates, 0, "e4m3", 1.0, True, True, 16)
    r = fusedfp8.layernorm_quantize(x, w, None, 1e-5, b.slot(0, recipe), transpose=True, pad_to=16)
    assert tuple(q.shape) == tuple(-(-d // 16) * 16 for d in shape)
    assert same_bytes(q, r.quantized.data) and same_bytes(q_t, r.quantized.data_t)
    assert same_bytes(mean, r.mean) and same_bytes(rstd, r.rstd) and same_bytes(si, r.quantized.scale_inv)
    assert same_bytes(a.amax_history, b.amax_history) and same_bytes(a.scale, b.scale)


# ---- version counters: the direct call bumps what the dispatcher bumps -------------------------
WRITING = OPS[:-1] + ["layernorm_quantize"]


def _writing_args(name, device):
    """(args, state) of a call of ``name`` on ``device`` that writes the state (a first step)."""
    s, st = _state_args()
    st = [t.to(device) for t in st]
    if name == "layernorm_quantize":
        x = inputs(32, 48, torch.bfloat16, device=device)
        return (x, None, None, 1e-5, *st, 0, "e4m3", 1.0, True, True), st
    args = tuple(a.to(device) if isinstance(a, torch.Tensor) else a for a in _op_args(name))
    n_in = 2 if name.startswith("dgelu") else 1
    return (*args[:n_in], *st, *args[n_in + 4:]), st


@pytest.mark.parametrize("device, cpp", [pytest.param("cpu", False, id="cpu"),
                                         pytest.param("cuda", True, id="cuda-cpp", marks=pytest.mark.gpu),
                                         pytest.param("cuda", False, id="cuda-python", marks=pytest.mark.gpu)])
@pytest.mark.parametrize("name", WRITING)
def test_the_direct_call_bumps_the_versions_the_dispatcher_bumps(device, cpp, name):
    """fops.call's direct routes (the Python implementation; on CUDA also the C++ one) advance
    the version counters of exactly the state tensors the schema declares written, as the
    dispatcher's route does: autograd's saved-tensor check sees every write."""
    from fusedfp8.pytorch import custom_ops as fops
    from support.torch_helpers import launch_path

    op = getattr(fops, name)
    with launch_path(cpp) if device == "cuda" else contextlib.nullcontext():
        deltas = []
        for route in (lambda a: fops.call(op, *a), lambda a: op(*a)):
            args, st = _writing_args(name, device)
            before = [t._version for t in st]
            route(args)
            deltas.append([t._version - b for t, b in zip(st, before)])
    assert deltas[0] == deltas[1] and min(deltas[0][:3]) >= 1 and deltas[0][3] == 0  # updates is only read


def test_a_saved_state_written_by_the_direct_call_fails_the_backward(device):
    """The consequence: a state tensor saved for a backward and then written is caught, not read
    with its new values."""
    from fusedfp8.pytorch import custom_ops as fops

    args, st = _writing_args("quantize", device)
    w = torch.ones(2, device=device, requires_grad=True)
    y = (st[1] * w).sum()  # saves scale for w's gradient
    fops.call(fops.quantize, *args)
    with pytest.raises(RuntimeError, match="modified by an inplace operation"):
        y.backward()


def test_the_direct_call_bumps_no_version_of_an_inference_tensor():
    from fusedfp8.pytorch import custom_ops as fops

    with torch.inference_mode():
        args, st = _writing_args("quantize", "cpu")
        fops.call(fops.quantize, *args)
    assert all(t.is_inference() for t in st) and st[0][0, 0].item() > 0
