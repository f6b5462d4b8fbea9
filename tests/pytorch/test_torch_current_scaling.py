"""CurrentScaling in fusedfp8.pytorch (issue 21, stage 1): Fp8Linear and Fp8MLP over several
train steps, on the CPU (reference numerics) and the GPU (the kernels, torch._scaled_mm). Each
step's scales are those of that step's own amaxes (input, weight, output gradient; for the MLP
also the LayerNorm and gelu outputs and the gelu gradient), written out here in float32; every
output and gradient is byte for byte the one of a twin module whose DelayedScaling state is reset
to fresh before each step (its first step is current scaling); a non-finite amax is counted at
the update, keeps the scale, and training goes on."""
from __future__ import annotations

import io

import numpy as np
import pytest
import torch

import fusedfp8 as ff
import fusedfp8.pytorch as fp8
from fusedfp8.numerics import reference as ref
from fusedfp8.state import STATE_FIELDS, ScalingState
from support.frameworks import same_bytes
from support.frameworks import to_np as np_of
from support.torch_helpers import inputs

pytestmark = pytest.mark.fp8_gemm  # (on the GPU: torch._scaled_mm)

R = ff.CurrentScaling()
TWIN = ff.DelayedScaling(amax_history_len=2, amax_compute_algo="most_recent")  # first_step='current'


def want_scale(amax, fmt_max: float) -> float:
    with np.errstate(over="ignore", divide="ignore"):
        s = np.float32(np.float32(fmt_max) / np.float32(amax))
    return float(np.float32(3.4028234663852886e38) if np.isinf(s) else s)


def reset(model) -> None:
    """Every FP8 state of ``model`` back to fresh (zeros, ones, counters 0), in place."""
    for m in fp8.fp8_modules(model):
        fresh = ScalingState.create((False, False, True), m.recipe, like=m.amax_history)
        for name in STATE_FIELDS:
            getattr(m, name).copy_(getattr(fresh, name))


def step(model, x, dy, opt):
    """Forward, backward with ``dy`` as the output gradient; returns (output, input gradient,
    parameter gradients) before the optimizer step and the update."""
    x = x.clone().requires_grad_(True)
    out = model(x)
    out.backward(dy)
    grads = [p.grad.clone() for p in model.parameters()]
    return out.detach(), x.grad, grads


def finish(model, opt):
    opt.step()
    opt.zero_grad()
    fp8.update_model_scales(model)


def pair(make, device):
    torch.manual_seed(0)
    a = make(R).to(device)
    torch.manual_seed(0)
    b = make(TWIN).to(device)
    return a, b, torch.optim.SGD(a.parameters(), lr=0.05), torch.optim.SGD(b.parameters(), lr=0.05)


def test_fp8_linear_scales_come_from_each_steps_own_amaxes(device):
    f, twin, opt, opt_t = pair(lambda r: fp8.Fp8Linear(32, 16, recipe=r), device)
    for k, mag in enumerate([1.0, 64.0, 1 / 64, 3.0]):
        x = inputs(48, 32, seed=k, device=device) * mag
        dy = inputs(48, 16, seed=50 + k, device=device) * 1e-3 / mag
        reset(twin)
        got, want = step(f, x, dy, opt), step(twin, x, dy, opt_t)
        assert same_bytes(got[0], want[0]) and same_bytes(got[1], want[1]), k
        assert all(same_bytes(a, b) for a, b in zip(got[2], want[2])), k
        amaxes = [ref.amax(np_of(x)), ref.amax(np_of(f.weight.detach())), ref.amax(np_of(dy))]
        scales = [want_scale(amaxes[0], 448.0), want_scale(amaxes[1], 448.0), want_scale(amaxes[2], 57344.0)]
        assert f.scale.tolist() == scales, k
        assert same_bytes(f.scale, twin.scale) and same_bytes(f.scale_inv, twin.scale_inv)
        finish(f, opt)
        finish(twin, opt_t)
        assert f.updates.tolist() == [0, 0, 0] and f.overflows.tolist() == [0, 0, 0]
        assert f.amax_history[0].tolist() == [0.0, 0.0, 0.0]
        assert f.amax_history[1].tolist() == amaxes and f.scale.tolist() == scales  # the last amax and scale


def test_fp8_mlp_matches_the_fresh_delayed_twin_every_step(device):
    m, twin, opt, opt_t = pair(lambda r: fp8.Fp8MLP(32, 64, r), device)
    for k, mag in enumerate([1.0, 100.0, 0.01]):
        x = inputs(32, 32, seed=k, device=device) * mag
        dy = inputs(32, 32, seed=70 + k, device=device) * 1e-4
        reset(twin)
        got, want = step(m, x, dy, opt), step(twin, x, dy, opt_t)
        assert same_bytes(got[0], want[0]) and same_bytes(got[1], want[1]), k
        assert all(same_bytes(a, b) for a, b in zip(got[2], want[2])), k
        for a, b in ((m.fc1, twin.fc1), (m.fc2, twin.fc2)):
            assert same_bytes(a.scale, b.scale) and same_bytes(a.amax_history[0], b.amax_history[0])
        w1 = np_of(m.fc1.weight.detach())
        assert m.fc1.scale[1].item() == want_scale(ref.amax(w1), 448.0)
        assert m.fc2.scale[2].item() == want_scale(ref.amax(np_of(dy)), 57344.0)  # the output gradient
        finish(m, opt)
        finish(twin, opt_t)
        assert m.fc1.updates.tolist() == [0, 0, 0] and m.fc2.updates.tolist() == [0, 0, 0]


def test_a_non_finite_input_is_counted_keeps_the_scale_and_training_goes_on(device):
    f = fp8.Fp8Linear(32, 16, recipe=R, device=device)
    opt = torch.optim.SGD(f.parameters(), lr=0.0)
    x = inputs(32, 32, seed=1, device=device)
    dy = inputs(32, 16, seed=2, device=device)
    step(f, x, dy, opt)
    finish(f, opt)
    kept = f.scale[0].item()
    bad = x.clone()
    bad[3, 4] = float("nan")
    out, _, _ = step(f, bad, dy, opt)
    assert f.scale[0].item() == kept and torch.isnan(out[3]).all() and torch.isfinite(out[4:]).all()
    finish(f, opt)
    assert f.overflows.tolist() == [1, 0, 0] and f.amax_history[0, 0].item() == 0.0
    x2 = x * 8
    step(f, x2, dy, opt)
    assert f.scale[0].item() == want_scale(ref.amax(np_of(x2)), 448.0)
    finish(f, opt)
    text = f.fp8_state.summary(R, names=["input", "weight", "grad_output"])
    assert f"{ref.amax(np_of(x2)):.4g}" in text.splitlines()[2]  # the last amax is readable


def test_state_dict_round_trip_and_a_delayed_state_is_refused():
    f = fp8.Fp8Linear(16, 16, recipe=R)
    opt = torch.optim.SGD(f.parameters(), lr=0.1)
    for k in range(2):
        step(f, inputs(16, 16, seed=k), inputs(16, 16, seed=9 + k), opt)
        finish(f, opt)
    buf = io.BytesIO()
    torch.save(f.state_dict(), buf)
    g = fp8.Fp8Linear(16, 16, recipe=R)
    g.load_state_dict(torch.load(io.BytesIO(buf.getvalue())))
    assert all(same_bytes(getattr(f, n), getattr(g, n)) for n in STATE_FIELDS)
    d = fp8.Fp8Linear(16, 16, recipe=TWIN)
    step(d, inputs(16, 16), inputs(16, 16, seed=3), torch.optim.SGD(d.parameters(), lr=0.0))
    fp8.update_model_scales(d)
    before = {n: getattr(g, n).clone() for n in STATE_FIELDS}
    with pytest.raises(ValueError, match=r"'updates' is \[1, 1, 1\], but under CurrentScaling every step is a "
                                         r"first step"):
        g.load_state_dict(d.state_dict())
    assert all(same_bytes(getattr(g, n), before[n]) for n in STATE_FIELDS)


def test_a_forgotten_update_is_still_caught():
    f = fp8.Fp8Linear(16, 16, recipe=R)
    opt = torch.optim.SGD(f.parameters(), lr=0.1)
    step(f, inputs(16, 16), inputs(16, 16, seed=1), opt)
    opt.step()
    opt.zero_grad()
    with pytest.raises(fp8.MissedScaleUpdateError):
        step(f, inputs(16, 16, seed=2), inputs(16, 16, seed=3), opt)


def test_modules_refuse_a_recipe_that_is_not_one():
    with pytest.raises(TypeError, match=r"^recipe must be a fusedfp8\.DelayedScaling, a fusedfp8\.CurrentScaling or a "
                                        r"fusedfp8\.BlockScaling; got type"):
        fp8.Fp8Linear(16, 16, recipe=ff.CurrentScaling)
    with pytest.raises(ValueError, match=r"^CurrentScaling\.fp8_format must be one of"):
        fp8.Fp8MLP(16, 32, ff.CurrentScaling("e5m2"))


def test_convert_to_fp8_and_one_model_update_under_current_scaling():
    model = fp8.convert_to_fp8(torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.GELU(), torch.nn.Linear(32, 16)),
                               R)
    mods = fp8.fp8_modules(model)
    assert len(mods) == 2 and all(m.recipe == R and m.amax_history.shape == (2, 3) for m in mods)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    x, dy = inputs(16, 16, seed=4), inputs(16, 16, seed=5)
    step(model, x, dy, opt)
    staged = torch.cat([m.amax_history[0] for m in mods])
    finish(model, opt)
    assert same_bytes(torch.cat([m.amax_history[1] for m in mods]), staged)
    assert all(m.updates.tolist() == [0, 0, 0] and m.amax_history[0].tolist() == [0.0] * 3 for m in mods)
    assert mods[0].scale[0].item() == want_scale(ref.amax(np_of(x)), 448.0)
