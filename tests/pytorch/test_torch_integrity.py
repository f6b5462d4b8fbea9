"""State integrity of the torch front end (issue 16): the first step decided per tensor in
modules (1), second derivatives refused (4), CPU autocast (10), zero-size layers (13), the
generic update of a module's state (14), and a refused model update writes nothing (11)."""
from __future__ import annotations

import warnings

import pytest
import torch
from torch import nn

import fusedfp8 as ff
import fusedfp8.pytorch as fp8
from fusedfp8.state import STATE_FIELDS

R = ff.DelayedScaling(amax_history_len=8)


def _two_layers(device, zero_second: bool, kind: str):
    torch.manual_seed(0)
    if kind == "convert":
        model = nn.Sequential(nn.Linear(16, 32), nn.Linear(32, 16)).to(device)
        if zero_second:
            nn.init.zeros_(model[1].weight)
        return fp8.convert_to_fp8(model, R), model
    model = nn.Sequential(fp8.Fp8Linear(16, 32, recipe=R, device=device), fp8.Fp8Linear(32, 16, recipe=R, device=device))
    if zero_second:
        nn.init.zeros_(model[1].weight)
    return model, None


# ---- 1. a tensor whose first amax was 0 keeps current scaling for its first real step -----------
@pytest.mark.parametrize("kind", ["modules", "convert"])
def test_a_zero_initialised_layer_does_not_starve_the_layer_before_it(device, kind):
    """The issue's example: the second layer's weight is zero, so at step 0 the first layer's
    output gradient is exactly 0 (its first amax is 0). At step 1 the second weight is non-zero
    and the first layer's gradient must be quantized with current scaling: its weight gradient is
    non-zero (with scale 1 the ~1e-6 gradients flush to zero in E5M2)."""
    model, _ = _two_layers(device, True, kind)
    opt = torch.optim.Adam(model.parameters(), lr=1e-3)
    x = torch.randn(64, 16, device=device)
    grads = []
    for step in range(3):
        loss = (model(x) - 0.1).pow(2).mean()
        loss.backward()
        grads.append(model[0].weight.grad.abs().max().item())
        opt.step()
        opt.zero_grad()
        fp8.update_model_scales(model)
    assert grads[0] == 0.0  # nothing flows through a zero weight
    assert grads[1] > 0.0 and grads[2] > 0.0
    upd = model[0].updates.tolist()
    assert upd[0] == 3 and upd[1] == 3 and upd[2] == 2  # the gradient's first real step was step 1


def test_an_all_zero_first_batch_leaves_the_input_on_its_first_step(device):
    lin = fp8.Fp8Linear(16, 16, recipe=R, device=device)
    lin(torch.zeros(8, 16, device=device)).sum().backward()
    fp8.update_model_scales(lin)
    assert lin.updates.tolist() == [0, 1, 1]
    x = torch.full((8, 16), 1e-3, device=device)
    lin(x)
    assert lin.scale[0].item() == pytest.approx(448.0 / 1e-3, rel=1e-6)  # current scaling, not 1


@pytest.mark.parametrize("fault", ["inf", "nan"])
def test_a_first_step_that_overflowed_uses_current_scaling_next(device, fault):
    mlp = fp8.Fp8MLP(16, 32, R, device=device)
    x = torch.randn(8, 16, device=device)
    x[0, 0] = float(fault)
    mlp(x)
    mlp.zero_grad()
    fp8.update_model_scales(mlp)
    assert mlp.fc1.updates[0].item() == 0 and mlp.fc1.overflows[0].item() == 1
    mlp(torch.randn(8, 16, device=device))
    assert mlp.fc1.scale[0].item() != 1.0


# ---- 4. second derivatives ---------------------------------------------------------------------
@pytest.mark.parametrize("kind", ["linear", "mlp", "convert"])
def test_a_gradient_penalty_through_fp8_layers_raises(kind):
    torch.manual_seed(0)
    if kind == "linear":
        layer = fp8.Fp8Linear(16, 16, recipe=R)
    elif kind == "mlp":
        layer = fp8.Fp8MLP(16, 32, R)
    else:
        layer = fp8.convert_to_fp8(nn.Sequential(nn.Linear(16, 16)), R)
    x = torch.randn(8, 16, requires_grad=True)
    y = x + layer(x)  # residual: the input gradient has a path that is differentiable twice
    (g,) = torch.autograd.grad(y.pow(2).sum(), x, create_graph=True)
    with pytest.raises(RuntimeError, match="once_differentiable"):
        g.pow(2).sum().backward()


# ---- 10. CPU autocast ----------------------------------------------------------------------------
@pytest.mark.parametrize("kind", ["linear", "mlp"])
def test_cpu_autocast_does_not_change_the_emulated_gemm(kind):
    torch.manual_seed(0)
    layer = fp8.Fp8Linear(16, 32, recipe=R) if kind == "linear" else fp8.Fp8MLP(16, 32, R)
    x = torch.randn(8, 16)
    want = layer(x)
    state = {k: v.clone() for k, v in layer.state_dict().items()}
    layer.load_state_dict(state)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        got = layer(x)
    assert got.dtype == want.dtype and torch.equal(got, want)


# ---- 13. zero-size layers ------------------------------------------------------------------------
@pytest.mark.parametrize("shape", [(0, 4, 3), (4, 0, 3), (4, 4, 0)], ids=["in0", "out0", "tokens0"])
def test_a_zero_size_linear_behaves_as_nn_linear(device, shape):
    fin, fout, tokens = shape
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # torch's "Initializing zero-element tensors is a no-op"
        lin = fp8.Fp8Linear(fin, fout, recipe=R, device=device)
        ref = nn.Linear(fin, fout, device=device)
    ref.load_state_dict({"weight": lin.weight.detach(), "bias": lin.bias.detach()})
    x = torch.randn(tokens, fin, device=device, requires_grad=True)
    xr = x.detach().clone().requires_grad_()
    y, yr = lin(x), ref(xr)
    assert y.shape == yr.shape and torch.equal(y, yr)
    y.sum().backward()
    yr.sum().backward()
    assert torch.equal(lin.bias.grad, ref.bias.grad) and lin.weight.grad.shape == ref.weight.grad.shape
    assert torch.equal(x.grad, xr.grad)


# ---- 14. the generic update of a module's state --------------------------------------------------
def test_the_generic_update_of_a_module_state_counts_as_its_update():
    lin = fp8.Fp8Linear(16, 16, recipe=R)
    opt = torch.optim.SGD(lin.parameters(), lr=0.1)
    x = torch.randn(8, 16)
    for _ in range(3):
        lin(x).sum().backward()
        opt.step()
        opt.zero_grad()
        ff.update_scales(lin.fp8_state, lin.recipe)
    assert lin.updates.tolist() == [3, 3, 3]
    lin(x).sum().backward()  # no update after this step's backward: the next one must raise
    opt.step()
    opt.zero_grad()
    with pytest.raises(fp8.MissedScaleUpdateError):
        lin(x).sum().backward()


def test_a_copy_of_a_module_state_does_not_update_the_module():
    lin = fp8.Fp8Linear(16, 16, recipe=R)
    copied = lin.fp8_state.copy()
    assert copied.on_update is None
    lin(torch.randn(8, 16)).sum().backward()
    ff.update_scales(copied, lin.recipe)
    assert lin.updates.tolist() == [0, 0, 0]


# ---- 11. a module whose state cannot be written is refused before any write --------------------
def _awkward(kind: str, how: str):
    make = (lambda: fp8.Fp8MLP(16, 32, R)) if kind == "mlp" else (lambda: fp8.Fp8Linear(16, 16, recipe=R))
    if how == "inference-mode":
        with torch.inference_mode():
            return make()
    m = make()
    last = m.fc2 if kind == "mlp" else m
    last.register_buffer("scale_inv", last.scale_inv.detach().clone().requires_grad_())
    return m


@pytest.mark.parametrize("kind", ["linear", "mlp"])
@pytest.mark.parametrize("how, match", [("inference-mode", "inference tensor"),
                                        ("buffer-requires-grad", "requires grad")])
def test_a_module_whose_state_cannot_be_written_is_refused_before_any_write(kind, how, match):
    module = _awkward(kind, how)
    linears = [module.fc1, module.fc2] if kind == "mlp" else [module]
    before = [getattr(m, f).detach().clone() for m in linears for f in STATE_FIELDS]
    with pytest.raises(ValueError, match=match):
        module(torch.randn(8, 16))
    after = [getattr(m, f).detach() for m in linears for f in STATE_FIELDS]
    assert all(torch.equal(a, b) for a, b in zip(before, after))
