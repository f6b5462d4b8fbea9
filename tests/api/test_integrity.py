"""State integrity through the framework-agnostic API (issue 16): every way to reach each class of
silent corruption, on the host path and, where the class can happen there, on the GPU.

Classes here: the first step decided per tensor (1, array API), aliasing (5), numpy scalars as
write targets (6), concurrent host-path accumulation (8), a -0 amax slot (9), half-updated
states (11), the generic update of a module's state (14, see also tests/pytorch), the margin's
range (15), ScalingState's grad argument (18), no warnings from the library's own arithmetic
(19). Each case checks that a refused call changed no byte of any state array."""
from __future__ import annotations

import copy
import sys
import threading
import warnings

import numpy as np
import pytest
import torch

import fusedfp8 as ff
from fusedfp8.state import STATE_FIELDS

R = ff.DelayedScaling(amax_history_len=8)


def _make(framework: str, device: str, a: np.ndarray):
    if framework == "numpy":
        if device != "cpu":
            pytest.skip("numpy arrays live on the host")
        return a.copy()
    if framework == "torch":
        return torch.from_numpy(a.copy()).to(device)
    if device == "cpu":
        pytest.skip("cupy arrays live on the GPU")
    import cupy

    return cupy.asarray(a)


def _host(a) -> np.ndarray:
    return a.detach().cpu().numpy() if isinstance(a, torch.Tensor) else (a.get() if hasattr(a, "get") else np.asarray(a))


def _snapshot(*arrays) -> list[bytes]:
    return [_host(a).tobytes() for a in arrays]


FRAMEWORKS = ["numpy", "torch", "cupy"]


# ---- 1. the first step is decided per tensor, on the device ----------------------------------
@pytest.mark.parametrize("framework", FRAMEWORKS)
@pytest.mark.parametrize("first_amax", ["zero", "inf", "nan"])
def test_a_tensor_whose_first_amax_did_not_count_stays_on_its_first_step(framework, device, first_amax):
    """Tensor 0 sees an all-zero (or non-finite) first step, tensor 1 a normal one; after the
    update tensor 1 is past its first step, tensor 0 is not: its next quantization uses current
    scaling (the scale of its own amax), not scale 1."""
    state = ff.ScalingState.create(2, R, like=_make(framework, device, np.zeros(1, np.float32)))
    bad = {"zero": 0.0, "inf": np.inf, "nan": np.nan}[first_amax]
    x0 = _make(framework, device, np.full((4, 8), bad, np.float32))
    x1 = _make(framework, device, np.linspace(-3, 3, 32, dtype=np.float32).reshape(4, 8))
    ff.quantize(x0, state.slot(0, R))
    ff.quantize(x1, state.slot(1, R))
    state = ff.update_scales(state, R)
    assert _host(state.updates).tolist() == [0, 1]
    x = _make(framework, device, np.full((4, 8), 1e-3, np.float32))
    r = ff.quantize(x, state.slot(0, R))
    want = np.float32(448.0) / np.float32(1e-3)
    assert _host(state.scale)[0] == want  # current scaling: fmt_max / amax, not 1
    assert np.all(_host(r.data.view(torch.uint8) if isinstance(r.data, torch.Tensor) else r.data).view(np.uint8)
                  == np.uint8(0x7E))  # 448 in E4M3: the tensor fills the format
    assert _host(state.scale)[1] == np.float32(448.0) / np.float32(3.0)


# ---- 5. aliasing -------------------------------------------------------------------------------
def _state_with_shared(framework, device, shared: tuple[str, str]):
    state = ff.ScalingState.create(2, R, like=_make(framework, device, np.zeros(1, np.float32)))
    a, b = shared
    bad = copy.copy(state)
    object.__setattr__(bad, b, getattr(state, a))
    return bad


@pytest.mark.parametrize("framework", FRAMEWORKS)
@pytest.mark.parametrize("shared", [("scale", "scale_inv"), ("scale_inv", "scale")])
def test_a_state_whose_arrays_share_memory_is_refused_before_any_write(framework, device, shared):
    bad = _state_with_shared(framework, device, shared)
    x = _make(framework, device, np.ones((4, 8), np.float32))
    ff.quantize(_make(framework, device, np.ones((2, 2), np.float32)), ff.ScalingState.create(
        2, R, like=_make(framework, device, np.zeros(1, np.float32))).slot(0, R))  # warm: compiled kernels
    before = _snapshot(*(getattr(bad, f) for f in STATE_FIELDS))
    with pytest.raises(ValueError, match=r"share memory"):
        ff.update_scales(bad, R)
    with pytest.raises(ValueError, match=r"share memory|overlaps"):
        ff.quantize(x, bad.slot(0, R))
    assert _snapshot(*(getattr(bad, f) for f in STATE_FIELDS)) == before


@pytest.mark.parametrize("framework", FRAMEWORKS)
@pytest.mark.parametrize("target", ["x", "dy", "scale"])
def test_an_amax_that_aliases_any_input_is_refused(framework, device, target):
    dy = _make(framework, device, np.linspace(-1, 1, 32, dtype=np.float32).reshape(4, 8))
    x = _make(framework, device, np.linspace(-2, 2, 32, dtype=np.float32).reshape(4, 8))
    scale = _make(framework, device, np.array([2.0], np.float32))
    amax = {"x": x.reshape(-1)[3:4], "dy": dy.reshape(-1)[5:6], "scale": scale}[target]
    before = _snapshot(dy, x, scale)
    with pytest.raises(ValueError, match=r"^amax overlaps"):
        ff.dgelu_quantize(dy, x, scale, "e5m2", amax=amax)
    assert _snapshot(dy, x, scale) == before


# ---- 6. a numpy scalar is not memory ------------------------------------------------------------
@pytest.mark.parametrize("scalar", [np.float32(0.0), np.float64(0.0)], ids=["float32", "float64"])
def test_a_numpy_scalar_as_amax_is_refused(scalar):
    x = np.ones((2, 2), np.float32)
    with pytest.raises((ValueError, TypeError), match=r"^amax"):
        ff.quantize(x, np.array([1.0], np.float32), amax=scalar)


def test_a_0d_numpy_array_as_amax_accumulates():
    amax = np.array(0.5, np.float32)
    ff.quantize(np.full((2, 2), 3.0, np.float32), np.array([1.0], np.float32), amax=amax)
    assert amax == np.float32(3.0)


# ---- 8. threads ----------------------------------------------------------------------------------
@pytest.mark.parametrize("framework", ["numpy", "torch"])
@pytest.mark.parametrize("target", ["amax", "slot"])
def test_concurrent_host_quantizations_keep_every_maximum(framework, target):
    old = sys.getswitchinterval()
    sys.setswitchinterval(1e-6)
    try:
        n = 8
        xs = [_make(framework, "cpu", np.full((16, 16), float(i + 1), np.float32)) for i in range(n * 4)]
        state = ff.ScalingState.create(1, R, like=_make(framework, "cpu", np.zeros(1, np.float32)))
        amax = _make(framework, "cpu", np.zeros(1, np.float32))
        scale = _make(framework, "cpu", np.ones(1, np.float32))

        def work(k):
            for x in xs[k::n]:
                if target == "amax":
                    ff.quantize(x, scale, amax=amax)
                else:
                    ff.quantize(x, state.slot(0, ff.DelayedScaling(amax_history_len=8, first_step="unit")))

        threads = [threading.Thread(target=work, args=(k,)) for k in range(n)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        got = _host(amax)[0] if target == "amax" else _host(state.amax_history)[0, 0]
        assert got == np.float32(len(xs))
    finally:
        sys.setswitchinterval(old)


# ---- 9. a slot holding -0 ------------------------------------------------------------------------
@pytest.mark.parametrize("framework", FRAMEWORKS)
@pytest.mark.parametrize("dtype", ["float32", "float16", "bfloat16"])
@pytest.mark.parametrize("value", [2.5, np.nan, 0.0])
def test_an_amax_slot_holding_minus_zero_takes_the_next_amax(framework, device, dtype, value):
    if framework == "numpy" and dtype == "bfloat16":
        import ml_dtypes

        x = np.full((8, 16), value, np.float32).astype(ml_dtypes.bfloat16)
    elif framework == "numpy":
        x = np.full((8, 16), value, dtype)
    else:
        x = _make(framework, device, np.full((8, 16), value, np.float32))
        x = x.to(getattr(torch, dtype)) if framework == "torch" else x.astype(dtype) if dtype != "bfloat16" else None
        if x is None:
            pytest.skip("cupy has no bfloat16")
    amax = _make(framework, device, np.array([-0.0], np.float32))
    ff.quantize(x, _make(framework, device, np.ones(1, np.float32)), amax=amax)
    got = _host(amax)[0]
    if np.isnan(value):
        assert np.isnan(got)
    else:
        assert got == np.float32(value) and not np.signbit(got)


# ---- 11. a refused update writes nothing ---------------------------------------------------------
def _torch_bad_states(device):
    t = ff.ScalingState.create(3, R, like=torch.zeros(1, device=device))
    t.amax_history[0] = torch.tensor([1.0, 2.0, 3.0], device=device)
    with torch.inference_mode():
        inf = ff.ScalingState.create(3, R, like=torch.zeros(1, device=device))
    grad = copy.copy(t)
    object.__setattr__(grad, "scale", t.scale.clone().requires_grad_())
    return {"scale-requires-grad": (grad, "requires grad"), "inference-tensors-outside-inference-mode": (
        inf, "inference tensor")}


@pytest.mark.parametrize("case", ["scale-requires-grad", "inference-tensors-outside-inference-mode"])
def test_a_torch_state_that_cannot_be_written_is_refused_before_any_write(device, case):
    state, match = _torch_bad_states(device)[case]
    before = _snapshot(*(getattr(state, f) for f in STATE_FIELDS))
    with pytest.raises(ValueError, match=match):
        ff.update_scales(state, R)
    with pytest.raises(ValueError, match=match):
        ff.quantize(torch.ones(4, 4, device=device), state.slot(0, R))
    assert _snapshot(*(getattr(state, f) for f in STATE_FIELDS)) == before


def test_a_state_without_grad_cannot_be_built():
    with pytest.raises(TypeError, match="grad"):
        ff.ScalingState(np.zeros((8, 3), np.float32), np.ones(2, np.float32), np.ones(2, np.float32),
                        np.zeros(2, np.int32), np.zeros(2, np.int32))
    with pytest.raises(ValueError, match=r"amax_history has 3 tensors"):
        ff.ScalingState(np.zeros((8, 3), np.float32), np.ones(2, np.float32), np.ones(2, np.float32),
                        np.zeros(2, np.int32), np.zeros(2, np.int32), grad=(False, True))


# ---- 15. the margin's range ----------------------------------------------------------------------
@pytest.mark.parametrize("margin", [64.5, 128, 1024, 1e30])
def test_a_margin_beyond_64_is_refused_at_the_recipe(margin):
    with pytest.raises(ValueError, match=r"^DelayedScaling\.margin must be in \[0, 64\]"):
        ff.DelayedScaling(margin=margin)


@pytest.mark.parametrize("framework", ["numpy", "torch"])
def test_the_largest_margin_gives_a_finite_nonzero_scale(framework):
    r = ff.DelayedScaling(amax_history_len=2, margin=64)
    state = ff.ScalingState.create(1, r, like=_make(framework, "cpu", np.zeros(1, np.float32)))
    ff.quantize(_make(framework, "cpu", np.full((2, 2), 1e6, np.float32)), state.slot(0, r))
    state = ff.update_scales(state, r)
    s, si = _host(state.scale)[0], _host(state.scale_inv)[0]
    assert 0 < s < np.inf and 0 < si < np.inf


# ---- 18. ScalingState's grad ---------------------------------------------------------------------
@pytest.mark.parametrize("grad, exc", [(True, TypeError), ("abc", TypeError), ([0, 1], TypeError), ([], ValueError),
                                       (0, ValueError), (None, TypeError)])
def test_create_refuses_a_grad_that_is_not_a_count_or_bools(grad, exc):
    with pytest.raises(exc, match=r"^grad"):
        ff.ScalingState.create(grad, R)


def test_create_takes_a_count_or_bools():
    assert ff.ScalingState.create(3, R).grad == (False, False, False)
    assert ff.ScalingState.create((False, np.bool_(True)), R).grad == (False, True)


# ---- 19. no warnings from the library's own arithmetic -------------------------------------------
@pytest.mark.parametrize("scale", [0.0, 1e-45, 1e-40, np.inf])
def test_a_stateless_quantization_with_an_extreme_scale_warns_nothing(scale):
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        r = ff.quantize(np.array([1.0, -2.0, np.inf], np.float32), np.array([scale], np.float32))
    assert r.scale_inv.dtype == np.float32


def test_a_python_float_scale_is_accepted():
    r = ff.quantize(np.array([0.1, -3.0, 1000.0], np.float32), 16.0, "e4m3")
    assert r.data.astype(np.float32).tolist() == [1.625, -48.0, 448.0]
    with pytest.raises(TypeError, match=r"^scale: expected a Python float"):
        ff.quantize(np.ones(2, np.float32), "16")
