"""fusedfp8.pytorch's modules (Fp8Linear, Fp8MLP) and convert_to_fp8, one test body per check for
the CPU (reference numerics, torch's float32 emulation of _scaled_mm) and the GPU (the kernels,
torch._scaled_mm; skipped with the probe's reason where there is no GPU with FP8 GEMMs): against
nn.Linear and the plain-torch MLP, every GEMM operand byte for byte against fusedfp8's functions on
NumPy twins of the states over several steps, the state as buffers (state_dict, torch.save,
.to()), conversion, and the errors."""
from __future__ import annotations

import copy
import io

import numpy as np
import pytest
import torch
from torch import nn

import fusedfp8
import fusedfp8.pytorch as fp8
from fusedfp8.numerics import reference as ref
from fusedfp8.recipe import DelayedScaling
from fusedfp8.state import STATE_FIELDS, ScalingState
from support.frameworks import same_bytes
from support.frameworks import to_np as np_of
from support.torch_helpers import Spy, TorchMLP, inputs, same_state, sqnr, train_step

GRAD = (False, False, True)
DTYPES = {"f32": torch.float32, "bf16": torch.bfloat16}

pytestmark = pytest.mark.fp8_gemm  # (on the GPU: torch._scaled_mm)


def per_device(cpu: list, cuda: list) -> list:
    """(device, value) parameters: the CPU's values and the GPU's (multiples of 16, larger)."""
    return ([pytest.param("cpu", v, id=f"cpu-{k}") for k, v in cpu]
            + [pytest.param("cuda", v, id=f"cuda-{k}", marks=pytest.mark.gpu) for k, v in cuda])


# ---- Fp8Linear against nn.Linear -------------------------------------------------------------
@pytest.mark.parametrize("bias", [True, False], ids=["bias", "no-bias"])
@pytest.mark.parametrize("dtypes", [(torch.bfloat16, torch.bfloat16), (torch.float32, torch.float32),
                                    (torch.bfloat16, torch.float32)], ids=["bf16", "f32", "bf16-in-f32-master"])
@pytest.mark.parametrize("device, shape", per_device([("aligned", (64, 48, 32)), ("ragged", (33, 17, 5))],
                                                     [("384x256x512", (384, 256, 512))]))
def test_fp8_linear_close_to_nn_linear(device, shape, dtypes, bias):
    """Outputs and all gradients within FP8 noise of nn.Linear (20 <= SQNR < 60 dB: close, yet
    quantized). The output gradient is ~1e-7: E5M2 at scale 1 flushes it to zero, so this also
    proves the first step uses current scaling (see the 'unit' test below)."""
    rows, in_f, out_f = shape
    x_dtype, w_dtype = dtypes
    torch.manual_seed(0)
    lin = nn.Linear(in_f, out_f, bias=bias, device=device, dtype=w_dtype)
    f = fp8.convert_to_fp8(copy.deepcopy(lin), DelayedScaling(amax_history_len=16))
    x = inputs(rows, in_f, x_dtype, device=device)
    x1, x2 = x.clone().requires_grad_(), x.clone().requires_grad_()
    g = (inputs(rows, out_f, seed=5, device=device) * 1e-7).to(x_dtype)
    y_ref = nn.functional.linear(x1, lin.weight.to(x_dtype), None if lin.bias is None else lin.bias.to(x_dtype))
    y = f(x2)
    y_ref.backward(g)
    y.backward(g)
    assert y.dtype == x_dtype and y.shape == y_ref.shape and f.weight.grad.dtype == w_dtype
    for want, got in [(y_ref, y), (x1.grad, x2.grad), (lin.weight.grad, f.weight.grad)]:
        assert 20 <= sqnr(want, got) < 60
    if bias:  # the bias gradient sums the unquantized output gradient
        assert f.bias.grad.dtype == w_dtype
        if x_dtype == w_dtype and device == "cpu":
            torch.testing.assert_close(f.bias.grad, lin.bias.grad)
        else:
            torch.testing.assert_close(f.bias.grad.float(), lin.bias.grad.float(), rtol=1e-2, atol=1e-9)


def test_first_step_unit_flushes_tiny_gradients(device):
    """The control for the test above: with first_step='unit' the tiny gradient is lost."""
    torch.manual_seed(0)
    lin = nn.Linear(64, 32, device=device)
    f = fp8.convert_to_fp8(copy.deepcopy(lin), DelayedScaling(amax_history_len=16, first_step="unit"))
    x = inputs(48, 64, device=device).requires_grad_()
    f(x).backward(inputs(48, 32, seed=5, device=device) * 1e-7)
    lin_x = x.detach().clone().requires_grad_()
    lin(lin_x).backward(inputs(48, 32, seed=5, device=device) * 1e-7)
    assert sqnr(lin_x.grad, x.grad) < 5


# ---- byte-exact operands and state -----------------------------------------------------------
@pytest.mark.parametrize("dtype", DTYPES.values(), ids=DTYPES.keys())
@pytest.mark.parametrize("device, dims", per_device([("48x32x16", (48, 32, 16))], [("96x128x64", (96, 128, 64))]))
def test_fp8_linear_operands_and_state_replay(monkeypatch, device, dims, dtype):
    """Every GEMM operand and scale_inv byte for byte against fusedfp8's functions on a NumPy twin
    of the state (the reference), and the module state bit for bit against the twin after each of
    several updates (input magnitudes change from step to step, one step skips the backward)."""
    tokens, in_f, out_f = dims
    recipe = DelayedScaling(amax_history_len=3, margin=1)
    torch.manual_seed(0)
    f = fp8.Fp8Linear(in_f, out_f, recipe=recipe, device=device, dtype=dtype)
    twin = ScalingState.create(GRAD, recipe)
    opt = torch.optim.SGD(f.parameters(), lr=0.5)
    spy = Spy(monkeypatch)
    for step in range(5):
        spy.calls.clear()
        x = (inputs(tokens, in_f, seed=step, device=device) * 2.0 ** (step - 2)).to(dtype)
        t = (inputs(tokens, out_f, seed=10 + step, device=device) * 1e-3).to(dtype)
        w = f.weight.detach().clone()
        with_backward = step != 2
        if with_backward:
            (f(x.requires_grad_()) * t).sum().backward()
        else:
            with torch.no_grad():
                f(x)
        rx = fusedfp8.quantize(np_of(x), twin.slot(0, recipe), transpose=True)
        rw = fusedfp8.quantize(np_of(w), twin.slot(1, recipe), transpose=True)
        (xa, wb, sa, sb, _) = spy.calls[0]
        assert same_bytes(xa, rx.data) and same_bytes(wb.t(), rw.data)
        assert same_bytes(sa, twin.scale_inv[0:1]) and same_bytes(sb, twin.scale_inv[1:2])
        if with_backward:
            rg = fusedfp8.quantize(np_of(t), twin.slot(2, recipe), transpose=True)
            (ga, wtb, gsa, wsb, _), (gta, xtb, _, xsb, _) = spy.calls[1:3]
            assert same_bytes(ga, rg.data) and same_bytes(wtb.t(), rw.data_t)
            assert same_bytes(gta, rg.data_t) and same_bytes(xtb.t(), rx.data_t)
            assert same_bytes(gsa, twin.scale_inv[2:3]) and same_bytes(wsb, twin.scale_inv[1:2])
            assert same_bytes(xsb, twin.scale_inv[0:1])
            opt.step()
            opt.zero_grad()
        assert same_state(f, twin)
        fp8.update_model_scales(f)
        fusedfp8.update_scales(twin, recipe)
        assert same_state(f, twin)
    assert f.updates.tolist() == [5, 5, 4]


def test_fp8_linear_output_is_the_scaled_gemm_of_its_operands(monkeypatch):
    """(CPU: the float32 emulation of _scaled_mm against a float64 product of the operands.)"""
    spy = Spy(monkeypatch)
    torch.manual_seed(0)
    f = fp8.convert_to_fp8(nn.Linear(32, 16), DelayedScaling(amax_history_len=16))
    x = inputs(24, 32)
    y = f(x)
    a, b, sa, sb, _ = spy.calls[0]
    want = (np_of(a).astype(np.float64) @ np_of(b).astype(np.float64)) * float(sa) * float(sb) + f.bias.detach().numpy()
    assert a.shape == (32, 32)  # 24 tokens with a weight gradient to come: the operands are padded to 16
    np.testing.assert_allclose(y.detach().numpy(), want[:24], rtol=1e-5, atol=1e-6)


def test_scales_change_step_to_step_by_the_rule(device):
    recipe = DelayedScaling(amax_history_len=2, amax_compute_algo="most_recent")
    f = fp8.Fp8Linear(16, 16, recipe=recipe, device=device)
    opt = torch.optim.SGD(f.parameters(), lr=0.0)
    seen = []
    for step in range(3):
        x = inputs(16, 16, device=device) * 4.0 ** step
        train_step(f, x, torch.zeros(16, 16, device=device), opt)
        seen.append(f.scale.clone())
        assert f.scale[0].item() == np.float32(448.0) / ref.amax(np_of(x))  # most_recent: this step's amax
    assert len({s[0].item() for s in seen}) == 3 and f.updates.tolist() == [3, 3, 3]


# ---- Fp8MLP ----------------------------------------------------------------------------------
def _mlp_pair(hidden, ffn, dtype, recipe=DelayedScaling(amax_history_len=8), approximate="tanh", device="cpu"):
    torch.manual_seed(0)
    m = fp8.Fp8MLP(hidden, ffn, recipe, approximate=approximate, device=device, dtype=dtype)
    ref_mlp = TorchMLP(hidden, ffn, approximate=approximate, device=device, dtype=dtype)
    ref_mlp.load_state_dict({k: v for k, v in m.state_dict().items() if k.split(".")[-1] in ("weight", "bias")})
    return m, ref_mlp


@pytest.mark.parametrize("approximate", ["tanh", "none"])
@pytest.mark.parametrize("dtype", DTYPES.values(), ids=DTYPES.keys())
@pytest.mark.parametrize("device, shape", per_device([("64x128x48", (64, 128, 48))],
                                                     [("small", (256, 1024, 512)), ("bench-1024", (1024, 4096, 2048))]))
def test_fp8_mlp_close_to_the_plain_mlp(device, shape, dtype, approximate):
    hidden, ffn, tokens = shape
    m, ref_mlp = _mlp_pair(hidden, ffn, dtype, approximate=approximate, device=device)
    x = inputs(tokens, hidden, dtype, device=device)
    x1, x2 = x.clone().requires_grad_(), x.clone().requires_grad_()
    g = (inputs(tokens, hidden, seed=7, device=device) * 1e-6).to(dtype)
    y_ref, y = ref_mlp(x1), m(x2)
    y_ref.backward(g)
    y.backward(g)
    assert 20 <= sqnr(y_ref, y) < 60 and 20 <= sqnr(x1.grad, x2.grad) < 60  # close, yet quantized
    for (_, p_ref), (name, p) in zip(ref_mlp.named_parameters(), m.named_parameters()):
        assert sqnr(p_ref.grad, p.grad) >= 20, name  # fc2.bias sums the unquantized gradient: exact


def test_the_plain_mlp_is_the_twin_of_fp8_mlp():
    """TorchMLP: the same initial weights for one seed, parameter names and gelu as Fp8MLP, its
    state dict loads into an Fp8MLP (strict=False: there is no FP8 state in it), and
    convert_to_fp8 turns its two Linears into Fp8Linear."""
    torch.manual_seed(0)
    ref_mlp = TorchMLP(32, 64)
    torch.manual_seed(0)
    m = fp8.Fp8MLP(32, 64, DelayedScaling(amax_history_len=4))
    assert ref_mlp.approximate == m.approximate == "tanh"
    weights = {k: v for k, v in m.state_dict().items() if k.split(".")[-1] in ("weight", "bias")}
    assert list(ref_mlp.state_dict()) == list(weights)
    assert all(torch.equal(v, weights[k]) for k, v in ref_mlp.state_dict().items())
    x = inputs(8, 32)
    want = ref_mlp.fc2(torch.nn.functional.gelu(ref_mlp.fc1(ref_mlp.norm(x)), approximate="tanh"))
    assert torch.equal(ref_mlp(x), want)
    with pytest.raises(ValueError, match="no FP8 state"):
        m.load_state_dict(ref_mlp.state_dict())
    missing, unexpected = m.load_state_dict(ref_mlp.state_dict(), strict=False)
    assert not unexpected and {k.rsplit(".", 1)[-1] for k in missing} == set(STATE_FIELDS)
    converted = fp8.convert_to_fp8(TorchMLP(32, 64, bias=False), DelayedScaling(amax_history_len=4))
    assert isinstance(converted.fc1, fp8.Fp8Linear) and isinstance(converted.fc2, fp8.Fp8Linear)
    assert converted.fc1.bias is None and isinstance(converted.norm, nn.LayerNorm)
    assert TorchMLP(16, 32, approximate="none", dtype=torch.bfloat16).fc1.weight.dtype == torch.bfloat16
    with pytest.raises(ValueError, match="approximate must be 'tanh' or 'none'"):
        TorchMLP(16, 32, approximate="fast")
    assert not hasattr(fp8, "MLP")  # the plain twin is not part of the torch face


@pytest.mark.parametrize("dtype", DTYPES.values(), ids=DTYPES.keys())
@pytest.mark.parametrize("device, dims", per_device([("16x32x64", (16, 32, 64))], [("64x128x256", (64, 128, 256))]))
def test_fp8_mlp_operands_are_the_fused_kernels(monkeypatch, device, dims, dtype):
    """The input operand is layernorm_quantize(x), the activation operand gelu_quantize(z) of the
    fc1 output z, the fc1 gradient operand dgelu_quantize(da, z) and the fc1 bias gradient its
    dbias, all against fusedfp8's functions on NumPy twins of both states."""
    tokens, hidden, ffn = dims
    recipe = DelayedScaling(amax_history_len=4)
    m, _ = _mlp_pair(hidden, ffn, dtype, recipe, device=device)
    tw1, tw2 = ScalingState.create(GRAD, recipe), ScalingState.create(GRAD, recipe)
    spy = Spy(monkeypatch)
    x = inputs(tokens, hidden, dtype, device=device)
    t = (inputs(tokens, hidden, seed=3, device=device) * 1e-3).to(dtype)
    (m(x) * t).sum().backward()
    (ha, w1b, *_, z), (aa, w2b, *_), (gya, w2tb, *_, da), (gyta, atb, *_), (dza, w1tb, *_), (dzta, htb, *_) = spy.calls
    # h = LayerNorm(x) quantized in the same pass (never rounded to the input's dtype)
    rh = fusedfp8.layernorm_quantize(np_of(x), np_of(m.norm.weight), np_of(m.norm.bias), m.norm.eps,
                                     tw1.slot(0, recipe), transpose=True).quantized
    rw1 = fusedfp8.quantize(np_of(m.fc1.weight), tw1.slot(1, recipe), transpose=True)
    ra = fusedfp8.gelu_quantize(np_of(z), tw2.slot(0, recipe), transpose=True)
    rw2 = fusedfp8.quantize(np_of(m.fc2.weight), tw2.slot(1, recipe), transpose=True)
    rgy = fusedfp8.quantize(np_of(t), tw2.slot(2, recipe), transpose=True)
    rdz = fusedfp8.dgelu_quantize(np_of(da), np_of(z), tw1.slot(2, recipe), transpose=True, dbias=True)
    for got, want in [(ha, rh.data), (w1b.t(), rw1.data), (aa, ra.data), (w2b.t(), rw2.data), (gya, rgy.data),
                      (w2tb.t(), rw2.data_t), (gyta, rgy.data_t), (atb.t(), ra.data_t), (dza, rdz.data),
                      (w1tb.t(), rw1.data_t), (dzta, rdz.data_t), (htb.t(), rh.data_t)]:
        assert same_bytes(got, want)
    if dtype == torch.float32 and device == "cpu":  # the host path sums as the reference does
        np.testing.assert_allclose(np_of(m.fc1.bias.grad), rdz.dbias, rtol=1e-6, atol=1e-9)
    elif dtype == torch.float32:  # the kernel's dbias: within float32 summation order
        np.testing.assert_allclose(np_of(m.fc1.bias.grad), rdz.dbias, rtol=2e-5,
                                   atol=1e-5 * float(np.abs(rdz.dbias).max()))
    else:  # the bias gradient in bf16
        np.testing.assert_allclose(np_of(m.fc1.bias.grad.float()), rdz.dbias.astype(np.float32), rtol=1e-2,
                                   atol=1e-3 * float(np.abs(rdz.dbias).max()))
    assert same_state(m.fc1, tw1) and same_state(m.fc2, tw2)


# ---- state: buffers, state_dict, torch.save, .to() ---------------------------------------------
def _trained(recipe=DelayedScaling(amax_history_len=8), steps=3):
    torch.manual_seed(0)
    model = nn.Sequential(fp8.Fp8MLP(32, 64, recipe), fp8.Fp8Linear(32, 16, recipe=recipe))
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    for s in range(steps):
        train_step(model, inputs(16, 32, seed=s), torch.zeros(16, 16), opt)
    return model


def test_state_is_registered_buffers_and_a_scaling_state_view():
    f = fp8.Fp8Linear(16, 32, recipe=DelayedScaling(amax_history_len=5))
    bufs = dict(f.named_buffers())
    assert list(bufs) == list(STATE_FIELDS)
    assert bufs["amax_history"].shape == (5, 3) and bufs["scale"].dtype == torch.float32
    st = f.fp8_state
    assert st.grad == GRAD and st.amax_history is f.amax_history


def _save_load(obj):
    blob = io.BytesIO()
    torch.save(obj, blob)
    blob.seek(0)
    return torch.load(blob)


@pytest.mark.parametrize("through", ["state_dict", "torch.save"])
def test_state_dict_round_trip_is_bitwise_and_training_continues_identically(through):
    """(torch.save / torch.load runs in this process: the NVRTC compile check, which breaks
    torch.load in the process that runs it, has a process of its own, tests/run/.)"""
    model = _trained()
    saved = {k: v.clone() for k, v in model.state_dict().items()}
    if through == "torch.save":
        saved = _save_load(model.state_dict())
    recipe = DelayedScaling(amax_history_len=8)
    torch.manual_seed(1)
    other = nn.Sequential(fp8.Fp8MLP(32, 64, recipe), fp8.Fp8Linear(32, 16, recipe=recipe))
    other.load_state_dict(saved)
    for (k, a), (_, b) in zip(model.state_dict().items(), other.state_dict().items()):
        assert same_bytes(a, b), k
    o1, o2 = torch.optim.SGD(model.parameters(), lr=0.1), torch.optim.SGD(other.parameters(), lr=0.1)
    for s in range(2):
        x = inputs(16, 32, seed=20 + s)
        assert torch.equal(train_step(model, x, torch.zeros(16, 16), o1), train_step(other, x, torch.zeros(16, 16), o2))
    for (k, a), (_, b) in zip(model.state_dict().items(), other.state_dict().items()):
        assert same_bytes(a, b), k


def test_load_state_with_another_history_length_is_refused_clearly():
    f = fp8.Fp8Linear(16, 16, recipe=DelayedScaling(amax_history_len=8))
    g = fp8.Fp8Linear(16, 16, recipe=DelayedScaling(amax_history_len=4))
    with pytest.raises(ValueError, match=r"'amax_history' has shape \(8, 3\).*amax_history_len=4.*"
                                         r"DelayedScaling\(amax_history_len=8\)"):
        g.load_state_dict(f.state_dict())


def test_load_state_dict_strict_false_takes_the_weights_of_a_plain_linear():
    """torch hands strict=True to every _load_from_state_dict; strict=False must still load a
    plain nn.Linear's weights and keep the FP8 state (a regression the bench script hit)."""
    lin, m = nn.Linear(16, 16), fp8.Fp8Linear(16, 16)
    before = {k: v.clone() for k, v in m.state_dict().items() if k in STATE_FIELDS}
    res = m.load_state_dict(lin.state_dict(), strict=False)
    assert sorted(res.missing_keys) == sorted(STATE_FIELDS) and torch.equal(m.weight, lin.weight)
    assert all(torch.equal(m.state_dict()[k], v) for k, v in before.items())
    parent = nn.Sequential(fp8.Fp8MLP(16, 32))
    plain = {k: v for k, v in parent.state_dict().items() if k.split(".")[-1] in ("weight", "bias")}
    assert parent.load_state_dict(plain, strict=False).missing_keys


def test_dtype_conversion_keeps_the_state_float32_bitwise():
    model = _trained()
    before = {k: v.clone() for k, v in model.state_dict().items()}
    model.to(torch.bfloat16)
    f = model[1]
    assert f.weight.dtype == torch.bfloat16 and f.scale.dtype == torch.float32 and f.updates.dtype == torch.int32
    for k in before:
        if k.split(".")[-1] in STATE_FIELDS:
            assert same_bytes(before[k], model.state_dict()[k]), k
    fp8.update_model_scales(model)  # the links survived (no copy was made): still one group
    assert len({id(m._group) for m in fp8.fp8_modules(model)}) == 1
    model(inputs(16, 32, torch.bfloat16))


@pytest.mark.gpu
def test_cpu_model_moved_to_the_gpu_carries_its_state():
    recipe = DelayedScaling(amax_history_len=8)
    torch.manual_seed(0)
    model = nn.Sequential(fp8.Fp8Linear(64, 128, recipe=recipe), fp8.Fp8Linear(128, 32, recipe=recipe))
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    x = torch.randn(32, 64)
    for _ in range(2):
        train_step(model, x, torch.zeros(32, 32), opt)
    before = {k: v.clone() for k, v in model.state_dict().items()}
    model.to("cuda")
    for k, v in model.state_dict().items():
        assert v.is_cuda and same_bytes(v, before[k]), k
    train_step(model, x.to("cuda"), torch.zeros(32, 32, device="cuda"), opt)  # relinks, one launch on the GPU
    assert model[0]._group is model[1]._group and model[0].updates.tolist() == [3, 3, 3]


# ---- convert_to_fp8 --------------------------------------------------------------------------
class _Net(nn.Module):
    def __init__(self):
        super().__init__()
        self.attn = nn.MultiheadAttention(32, 4, batch_first=True)
        self.body = nn.Sequential(nn.Linear(32, 64), nn.ReLU(), nn.Linear(64, 32))
        self.head = nn.Linear(32, 8)

    def forward(self, x):
        x = x + self.attn(x, x, x, need_weights=False)[0]
        return self.head(self.body(x))


def test_convert_to_fp8_swaps_linears_in_place_with_filter():
    torch.manual_seed(0)
    net = _Net()
    ref_net = copy.deepcopy(net)
    w0 = net.body[0].weight
    opt = torch.optim.SGD(net.parameters(), lr=0.1)  # built before the conversion
    recipe = DelayedScaling(amax_history_len=4)
    out = fp8.convert_to_fp8(net, recipe, filter_fn=lambda fqn, m: not fqn.startswith("head"))
    assert out is net
    assert type(net.body[0]) is fp8.Fp8Linear and type(net.body[2]) is fp8.Fp8Linear
    assert type(net.head) is nn.Linear and type(net.attn.out_proj) is not fp8.Fp8Linear
    assert net.body[0].weight is w0 and net.body[0].recipe is recipe
    x = inputs(32, 32).reshape(2, 16, 32)
    assert sqnr(ref_net(x), net(x)) >= 20
    before = w0.detach().clone()
    train_step(net, x, torch.zeros(2, 16, 8), opt)
    assert not torch.equal(before, w0)  # the old optimizer still drives the converted layer


def test_convert_to_fp8_of_a_bare_linear_and_bad_arguments():
    lin = nn.Linear(16, 16)
    f = fp8.convert_to_fp8(lin)
    assert type(f) is fp8.Fp8Linear and f.weight is lin.weight
    with pytest.raises(TypeError, match="recipe must be a fusedfp8.DelayedScaling"):
        fp8.convert_to_fp8(nn.Sequential(nn.Linear(4, 4)), recipe="hybrid")
    with pytest.raises(TypeError, match="model must be a torch.nn.Module"):
        fp8.convert_to_fp8(lin.weight)
    with pytest.raises(ValueError, match="missed_update must be one of"):
        fp8.convert_to_fp8(nn.Linear(4, 4), missed_update="loud")


# ---- errors ----------------------------------------------------------------------------------
def test_forward_errors_name_the_problem_and_change_no_state():
    f = fp8.Fp8Linear(16, 32, recipe=DelayedScaling(amax_history_len=4))
    before = {k: v.clone() for k, v in f.state_dict().items()}
    with pytest.raises(ValueError, match=r"16 features in its last dimension; got shape \(4, 8\)"):
        f(torch.ones(4, 8))
    with pytest.raises(TypeError, match="input must be float32, float16 or bfloat16; got torch.int64"):
        f(torch.ones(4, 16, dtype=torch.int64))
    with pytest.raises(TypeError, match="weight must be float32, float16 or bfloat16; got torch.float64"):
        copy.deepcopy(f).double()(torch.ones(4, 16))
    for k, v in f.state_dict().items():
        assert same_bytes(v, before[k])
    with pytest.raises(TypeError, match="recipe must be a fusedfp8.DelayedScaling"):
        fp8.Fp8Linear(4, 4, recipe={"margin": 0})
    with pytest.raises(ValueError, match="approximate must be 'tanh' or 'none'"):
        fp8.Fp8MLP(16, 32, approximate="fast")


@pytest.mark.gpu
def test_input_on_another_device_is_refused():
    f = fp8.Fp8Linear(64, 64, device="cuda")
    with pytest.raises(ValueError, match="input is on cpu but the weight is on cuda"):
        f(torch.randn(16, 64))


def test_fp8_mlp_runs_its_layernorm_inside_the_quantization(monkeypatch, device):
    """With fuse_layernorm (the default) torch's LayerNorm forward never runs: h comes quantized
    from layernorm_quantize, and the LayerNorm's parameters still get their gradients (within
    FP8's error of the unfused path's); fuse_layernorm=False runs norm(x) in torch."""
    torch.manual_seed(0)
    m = fp8.Fp8MLP(64, 128, DelayedScaling(amax_history_len=4), device=device, dtype=torch.bfloat16)
    with torch.no_grad():
        m.norm.weight.uniform_(0.5, 1.5)
        m.norm.bias.uniform_(-0.5, 0.5)
    plain = copy.deepcopy(m)
    plain.fuse_layernorm = False
    x = inputs(32, 64, torch.bfloat16, device=device)
    calls = []
    real = torch.nn.functional.layer_norm
    monkeypatch.setattr(torch.nn.functional, "layer_norm", lambda *a, **k: calls.append(1) or real(*a, **k))
    y = m(x)
    y.float().square().mean().backward()
    assert calls == []
    yp = plain(x)
    yp.float().square().mean().backward()
    assert calls == [1]
    assert sqnr(yp, y) >= 20
    for (name, p), q in zip(m.named_parameters(), plain.parameters()):
        assert sqnr(q.grad, p.grad) >= 15, name


# ---- what the layers hand their autograd functions -----------------------------------------------
def test_the_layers_hand_their_autograd_functions_tensors_and_one_frozen_config(monkeypatch):
    """Fp8Linear and Fp8MLP call _LinearFn / _MLPFn with tensors (or None) and one frozen,
    hashable config that says what the layer is (columns, formats, margin, first step, the
    transposes a backward needs, the pad, the GEMM backends, the fused LayerNorm's eps); _MLPFn
    also gets fc2's weight cache (a holder, not configuration)."""
    import dataclasses

    from fusedfp8.pytorch import autograd as A8
    from fusedfp8.pytorch.ste import QuantizeConfig

    seen = {}
    for fn in (A8._LinearFn, A8._MLPFn):
        real = fn.apply
        monkeypatch.setattr(fn, "apply", lambda *a, fn=fn, real=real: seen.setdefault(fn, a) and real(*a))
    recipe = DelayedScaling(amax_history_len=4, margin=1)
    lin = fp8.Fp8Linear(32, 24, recipe=recipe)
    lin(inputs(10, 32))  # (an input without a gradient: no dgrad, so no transposed weight)
    mlp = fp8.Fp8MLP(32, 48, recipe)
    mlp(inputs(16, 32))
    *tensors, cfg = seen[A8._LinearFn]
    assert all(t is None or isinstance(t, torch.Tensor) for t in tensors)
    mf = recipe.margin_factor
    assert cfg == A8.LinearConfig(0, "e4m3", "e5m2", mf, True, False, True, 16, "scaled_mm", None)
    *tensors, cfg, cache = seen[A8._MLPFn]
    assert all(t is None or isinstance(t, torch.Tensor) for t in tensors) and cache is None
    assert cfg == A8.MLPConfig(0, 0, "e4m3", "e5m2", mf, True, True, "tanh", True, 1, 1e-5,
                               ("scaled_mm", "scaled_mm"), None)
    for c in (cfg, QuantizeConfig(1, "e5m2", 1.0, False)):
        assert hash(c) == hash(dataclasses.replace(c)) and c == dataclasses.replace(c)
        with pytest.raises(dataclasses.FrozenInstanceError):
            setattr(c, dataclasses.fields(c)[0].name, 7)
