"""fusedfp8.pytorch.scaling: update_model_scales links every FP8 state of a model into one state
per recipe and updates it in one call (one launch on the GPU), keeps the links through copies,
dtype changes and loads, MAX-reduces over a process group (world size 1 here; tests/pytorch/
test_distributed.py spawns 2 and 4 ranks), and the modules detect a forgotten update."""
from __future__ import annotations

import copy
import io
import warnings

import numpy as np
import pytest
import torch
from torch import nn

import fusedfp8.pytorch as fp8
from fusedfp8 import ops
from fusedfp8.numerics import reference as ref
from fusedfp8.pytorch import scaling as fp8_scaling
from fusedfp8.recipe import DelayedScaling
from fusedfp8.state import STATE_FIELDS
from support.frameworks import same_bytes
from support.torch_helpers import inputs, train_step


def _trained(recipe=DelayedScaling(amax_history_len=8), steps=3):
    torch.manual_seed(0)
    model = nn.Sequential(fp8.Fp8MLP(32, 64, recipe), fp8.Fp8Linear(32, 16, recipe=recipe))
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    for s in range(steps):
        train_step(model, inputs(16, 32, seed=s), torch.zeros(16, 16), opt)
    return model


# ---- one launch for the whole model ----------------------------------------------------------
def _count_launches(monkeypatch):
    calls = []
    real = ops.update_scales

    def counting(state, recipe):
        calls.append(state.num_tensors)
        return real(state, recipe)

    monkeypatch.setattr(fp8_scaling.ops, "update_scales", counting)
    return calls


def test_update_scales_is_one_launch_over_linked_states(monkeypatch):
    model = _trained(steps=1)
    calls = _count_launches(monkeypatch)
    fp8.update_model_scales(model)
    assert calls == [9]  # fc1, fc2 of the MLP and the last linear: 3 modules x 3 tensors, one call
    mods = fp8.fp8_modules(model)
    base = mods[0].amax_history.untyped_storage().data_ptr()
    assert all(m.amax_history.untyped_storage().data_ptr() == base for m in mods)
    group = mods[0]._group
    assert group.state.amax_history.shape == (8, 9)
    assert torch.equal(group.state.scale[3:6], mods[1].scale)


def test_links_are_rebuilt_after_new_buffer_objects_and_values_are_kept(monkeypatch):
    model = _trained()
    before = {k: v.clone() for k, v in model.state_dict().items()}
    model._apply(lambda t: t.clone())  # new tensor objects for every buffer: the links break
    copied = copy.deepcopy(model)
    calls = _count_launches(monkeypatch)
    for m in (model, copied):
        for k, v in m.state_dict().items():
            assert same_bytes(v, before[k]), k
        fp8.update_model_scales(m)
    assert calls == [9, 9]
    assert fp8.fp8_modules(copied)[0]._group is not fp8.fp8_modules(model)[0]._group
    # load_state_dict copies into the views: the links hold
    group = fp8.fp8_modules(model)[0]._group
    model.load_state_dict(before)
    assert group.intact()


def test_models_with_two_recipes_get_one_launch_each(monkeypatch):
    model = nn.Sequential(fp8.Fp8Linear(16, 16, recipe=DelayedScaling(amax_history_len=4)),
                          fp8.Fp8Linear(16, 16, recipe=DelayedScaling(amax_history_len=4, margin=2)),
                          fp8.Fp8Linear(16, 16, recipe=DelayedScaling(amax_history_len=4)))
    calls = _count_launches(monkeypatch)
    fp8.update_model_scales(model)
    assert calls == [6, 3]


def test_update_scales_refuses_a_model_without_fp8_modules():
    with pytest.raises(ValueError, match="holds no Fp8Linear"):
        fp8.update_model_scales(nn.Linear(4, 4))
    with pytest.raises(TypeError, match="model must be a torch.nn.Module"):
        fp8.update_model_scales("model")


def test_update_scales_max_reduces_over_a_process_group(tmp_path):
    """World size 1 (gloo): the reduction runs, and a NaN staged amax still counts as overflow."""
    import torch.distributed as dist

    dist.init_process_group("gloo", store=dist.FileStore(str(tmp_path / "store"), 1), rank=0, world_size=1)
    try:
        f = fp8.Fp8Linear(16, 16, recipe=DelayedScaling(amax_history_len=4))
        f(inputs(16, 16))
        f.amax_history[0, 1] = float("nan")
        fp8.update_model_scales(f, dist.group.WORLD)
        assert f.overflows.tolist() == [0, 1, 0] and f.updates.tolist() == [1, 0, 0]
        assert f.scale[0].item() == np.float32(448.0) / ref.amax(inputs(16, 16).numpy())
    finally:
        dist.destroy_process_group()


# ---- missed updates --------------------------------------------------------------------------
def _loop(model, steps, update, micro=1):
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    for s in range(steps):
        for k in range(micro):
            (model(inputs(16, 32, seed=s * micro + k)).float() ** 2).mean().backward()
        opt.step()
        opt.zero_grad()
        if update:
            fp8.update_model_scales(model)


def _mlp_model(mode):
    torch.manual_seed(0)
    return nn.Sequential(fp8.Fp8MLP(32, 64, DelayedScaling(amax_history_len=4), missed_update=mode))


def test_forgotten_update_raises_by_default():
    with pytest.raises(fp8.MissedScaleUpdateError, match=r"update_model_scales\(model\) was not called"):
        _loop(_mlp_model("raise"), steps=2, update=False)


def test_forgotten_update_warns_or_is_ignored_on_request():
    with pytest.warns(fp8.MissedScaleUpdateWarning, match="optimizer step"):
        _loop(_mlp_model("warn"), steps=2, update=False)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        _loop(_mlp_model("ignore"), steps=3, update=False)


def test_correct_loops_never_trigger_the_check():
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        _loop(_mlp_model("raise"), steps=3, update=True)
        _loop(_mlp_model("raise"), steps=3, update=True, micro=3)  # gradient accumulation
        _loop(_mlp_model("raise"), steps=1, update=False, micro=4)  # one step, not yet updated


def _copies():
    """Every way to copy a module: deepcopy, a pickle through torch.save, a state-dict load."""
    def pickled(m):
        buf = io.BytesIO()
        torch.save(m, buf)
        buf.seek(0)
        return torch.load(buf, weights_only=False)

    def loaded(m):
        fresh = _mlp_model("raise")
        fresh.load_state_dict(m.state_dict())
        return fresh

    return {"deepcopy": copy.deepcopy, "pickle": pickled, "state_dict": loaded}


@pytest.mark.parametrize("how", _copies().keys())
def test_a_copy_made_after_a_backward_is_not_an_optimizer_step(how):
    """A copy taken between a backward and the optimizer step (an EMA model, a checkpoint) has new
    weight tensors, whose version counters start over: the copy's next backward is no missed update,
    and a real missed update on the copy is still caught."""
    model = _mlp_model("raise")
    x = torch.randn(8, 32)
    with torch.no_grad():  # in-place changes before the first backward (init, a load): versions > 0
        for p in model.parameters():
            p.mul_(1.0)
    model(x).sum().backward()
    twin = _copies()[how](model)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        twin(x).sum().backward()  # the copy's own first backward: no complaint
        twin(x).sum().backward()  # gradient accumulation on the copy
    with torch.no_grad():
        for p in twin.parameters():
            p.add_(1.0)  # an optimizer step on the copy, with no update_model_scales
    with pytest.raises(fp8.MissedScaleUpdateError):
        twin(x).sum().backward()


@pytest.mark.fp8_gemm
@pytest.mark.parametrize("how", ["deepcopy", "pickle"])
def test_a_copy_of_a_linked_model_trains_like_the_original(device, how):
    """update_model_scales links the modules' states as column views of one array per model; a
    copy drops the link, and its states must be tensors of their own that the kernels take (a
    column view is not contiguous: the CUDA ops would refuse the copy's first forward). The copy
    then trains bit for bit like the original, and writing its state leaves the original's alone."""
    model = _mlp_model("raise").to(device)
    opts = {}

    def loop(m, steps, seed):
        opt = opts.setdefault(id(m), torch.optim.SGD(m.parameters(), lr=0.01))
        for s in range(steps):
            (m(inputs(16, 32, seed=seed + s, device=device)).float() ** 2).mean().backward()
            opt.step()
            opt.zero_grad()
            fp8.update_model_scales(m)

    loop(model, 2, 0)  # linked now: every module's state is a view of the model-level arrays
    assert not fp8.fp8_modules(model)[0].amax_history.is_contiguous()
    twin = _copies()[how](model)
    for m in fp8.fp8_modules(twin):
        assert all(getattr(m, name).is_contiguous() for name in STATE_FIELDS), how
    loop(model, 2, 10)
    loop(twin, 2, 10)
    for (name, a), b in zip(model.state_dict().items(), twin.state_dict().values()):
        assert same_bytes(a.detach().cpu(), b.detach().cpu()), name
    before = fp8.fp8_modules(model)[0].scale.clone()
    with torch.no_grad():
        fp8.fp8_modules(twin)[0].scale.fill_(3.0)
    assert torch.equal(fp8.fp8_modules(model)[0].scale, before)


def test_forgotten_update_is_detected_in_copies_and_compiled_models():
    model = copy.deepcopy(_mlp_model("raise"))
    with pytest.raises(fp8.MissedScaleUpdateError):
        _loop(model, steps=2, update=False)
    compiled = torch.compile(_mlp_model("raise"), backend="aot_eager", fullgraph=True)
    with pytest.raises(fp8.MissedScaleUpdateError):
        _loop(compiled, steps=2, update=False)
