"""CurrentScaling (issue 21, stage 1): the recipe, and the framework-agnostic functions with a
current-scaling state. Every step's scale is the one of that step's own amax, written out here in
float32 (not through the library's formula), and the FP8 bytes are the reference cast with it;
a non-finite amax keeps the scale and is counted at the update; the update closes the step and
changes no scale. The ``device`` fixture runs each test on the host (the NumPy reference) and on
the GPU (the kernels: the first-step pre-pass on every call)."""
from __future__ import annotations

import dataclasses

import numpy as np
import pytest
import torch

import fusedfp8 as ff
from fusedfp8.numerics import reference as ref
from fusedfp8.numerics.constants import FLT_MAX
from fusedfp8.numerics.jnp import JnpNamespace
from fusedfp8.numerics.scaling import close_step
from fusedfp8.numerics.xp import NumpyNamespace, TorchNamespace
from fusedfp8.recipe import CURRENT_HISTORY_LEN
from support.frameworks import same_bytes, to_np

f32 = np.float32
R = ff.CurrentScaling()


def want_scale(amax, fmt_max: float, margin: float = 0) -> np.float32:
    """``(fmt_max / amax) / 2**margin`` in float32, FLT_MAX where that is inf."""
    with np.errstate(over="ignore", divide="ignore"):
        s = f32(f32(fmt_max) / f32(amax)) / f32(2.0 ** margin)
    return f32(FLT_MAX) if np.isinf(s) else f32(s)


def cast(x, s, fmt: str) -> np.ndarray:
    with np.errstate(all="ignore"):
        return ref.cast_to_fp8(ref.to_float32(x) * f32(s), fmt)


def t(x: np.ndarray, device: str) -> torch.Tensor:
    return torch.from_numpy(np.ascontiguousarray(x)).to(device)


def rows(seed: int, shape=(33, 48), mag: float = 1.0) -> np.ndarray:
    g = np.random.default_rng(seed)
    return (g.standard_normal(shape) * mag * np.exp2(g.integers(-6, 7, (shape[0], 1)))).astype(np.float32)


# ---- the recipe ------------------------------------------------------------------------------
def test_recipe_defaults_fields_and_what_the_state_reads():
    assert R == ff.CurrentScaling("hybrid", 0) and hash(R) == hash(ff.CurrentScaling())
    assert [f.name for f in dataclasses.fields(R)] == ["fp8_format", "margin"]
    assert (R.current, R.amax_history_len, R.amax_compute_algo, R.first_step) == (True, 2, "most_recent", "current")
    assert R.format_for(False) == ff.E4M3 and R.format_for(True) == ff.E5M2
    e = ff.CurrentScaling("e4m3", margin=3)
    assert e.format_for(True) == ff.E4M3 and e.margin_factor == 8.0
    assert R != ff.DelayedScaling(amax_history_len=2, amax_compute_algo="most_recent")
    assert not ff.DelayedScaling().current
    with pytest.raises(dataclasses.FrozenInstanceError):
        R.margin = 1


@pytest.mark.parametrize("kwargs, exc, match", [
    ({"fp8_format": "e5m2"}, ValueError,
     r"^CurrentScaling\.fp8_format must be one of \('hybrid', 'e4m3'\); got 'e5m2'"),
    ({"fp8_format": 1}, TypeError, r"^CurrentScaling\.fp8_format must be a str, one of \('hybrid', 'e4m3'\); got int"),
    ({"margin": -1}, ValueError, r"^CurrentScaling\.margin must be a finite number >= 0; got -1"),
    ({"margin": float("nan")}, ValueError, r"^CurrentScaling\.margin must be a finite number >= 0; got nan"),
    ({"margin": 65}, ValueError, r"^CurrentScaling\.margin must be in \[0, 64\]"),
    ({"margin": True}, TypeError, r"^CurrentScaling\.margin must be a number >= 0; got bool"),
    ({"margin": "1"}, TypeError, r"^CurrentScaling\.margin must be a number >= 0; got str"),
    ({"amax_history_len": 4}, TypeError, r"amax_history_len"),
], ids=["format-e5m2", "format-int", "margin-negative", "margin-nan", "margin-65", "margin-bool", "margin-str",
        "no-history-field"])
def test_recipe_refuses_bad_fields_by_name(kwargs, exc, match):
    with pytest.raises(exc, match=match):
        ff.CurrentScaling(**kwargs)


def test_a_state_for_current_scaling_has_two_rows():
    st = ff.ScalingState.create([False, True], R)
    assert st.amax_history.shape == (CURRENT_HISTORY_LEN, 2)
    st.validate(R)
    with pytest.raises(ValueError, match="amax_history has 1024 rows but the recipe's amax_history_len is 2"):
        ff.ScalingState.create(2, ff.DelayedScaling()).slot(0, R)


# ---- several steps through the functions -----------------------------------------------------
@pytest.mark.parametrize("fmt_name, margin", [("hybrid", 0), ("e4m3", 2)], ids=["hybrid", "e4m3-margin2"])
def test_every_step_is_quantized_with_the_scale_of_its_own_amax(device, fmt_name, margin):
    r = ff.CurrentScaling(fmt_name, margin)
    st = ff.ScalingState.create([False, True], r, like=torch.empty(0, device=device))
    mags = [1.0, 1e-3, 300.0, 1e-30, 2.0]  # up, down, a tiny amax (FLT_MAX scale), back
    for step, mag in enumerate(mags):
        x, dy = rows(step, mag=mag), rows(100 + step, mag=mag * 1e-4)
        q = ff.quantize(t(x, device), st.slot(0, r), transpose=True)
        g = ff.dgelu_quantize(t(dy, device), t(x, device), st.slot(1, r))
        sx = want_scale(ref.amax(x), r.format_for(False).max, margin)
        dx = ref.activation("dgelu", dy, x)
        sg = want_scale(ref.amax(dx), r.format_for(True).max, margin)
        assert same_bytes(q.data, cast(x, sx, r.format_for(False).name)), step
        assert same_bytes(q.data_t, cast(x, sx, r.format_for(False).name).T), step
        assert same_bytes(g.data, cast(dx, sg, r.format_for(True).name)), step
        assert same_bytes(q.scale_inv, np.array([f32(1) / sx])) and same_bytes(g.scale_inv, np.array([f32(1) / sg]))
        assert same_bytes(st.scale, np.array([sx, sg])), step  # the scale used, readable in the state
        assert same_bytes(st.scale_inv, np.array([f32(1) / sx, f32(1) / sg]))
        staged = np.array([ref.amax(x), ref.amax(dx)], np.float32)
        assert same_bytes(st.amax_history[0], staged)
        st = ff.update_scales(st, r)
        assert same_bytes(st.amax_history, np.stack([np.zeros(2, np.float32), staged]))  # row 1: the last amax
        assert same_bytes(st.scale, np.array([sx, sg]))  # the update changes no scale
        assert to_np(st.updates).tolist() == [0, 0] and to_np(st.overflows).tolist() == [0, 0]
    assert float(to_np(st.scale)[0]) != 1.0


def test_gelu_and_layernorm_with_a_current_scaling_state(device):
    st = ff.ScalingState.create(2, R, like=torch.empty(0, device=device))
    for step in range(3):
        x = rows(step, (20, 24), mag=10.0 ** (2 * step - 2))
        w, b = rows(50 + step, (1, 24))[0], rows(60 + step, (1, 24))[0]
        a = ff.gelu_quantize(t(x, device), st.slot(0, R), approximate="none")
        n = ff.layernorm_quantize(t(x, device), t(w, device), t(b, device), 1e-5, st.slot(1, R))
        y = ref.activation("gelu", x, None, "none")
        assert same_bytes(a.data, cast(y, want_scale(ref.amax(y), 448.0), "e4m3"))
        want_ln = ff.layernorm_quantize(x, w, b, 1e-5, float(want_scale(ref.amax(to_np(n.quantized.amax)), 448.0)))
        assert same_bytes(n.quantized.data, want_ln.quantized.data)
        assert same_bytes(n.mean, want_ln.mean) and same_bytes(n.rstd, want_ln.rstd)
        st = ff.update_scales(st, R)


def test_a_non_finite_amax_keeps_the_scale_and_is_counted_at_the_update(device):
    st = ff.ScalingState.create(1, R, like=torch.empty(0, device=device))
    x = rows(0)
    ff.quantize(t(x, device), st.slot(0, R))
    st = ff.update_scales(st, R)
    s0 = want_scale(ref.amax(x), 448.0)
    for bad in (np.nan, np.inf, -np.inf):
        y = rows(1)
        y[3, 5] = bad
        q = ff.quantize(t(y, device), st.slot(0, R))
        assert same_bytes(q.data, cast(y, s0, "e4m3"))  # quantized with the kept scale
        assert same_bytes(st.scale, np.array([s0]))
        st = ff.update_scales(st, R)
        assert float(to_np(st.amax_history)[0, 0]) == 0.0  # the slot is cleared, the last amax kept
        assert same_bytes(st.amax_history[1], np.array([ref.amax(x)]))
    assert to_np(st.overflows).tolist() == [3] and to_np(st.updates).tolist() == [0]
    z = rows(2)
    q = ff.quantize(t(z, device), st.slot(0, R))  # and the next finite amax gives its own scale again
    assert same_bytes(q.data, cast(z, want_scale(ref.amax(z), 448.0), "e4m3"))


def test_a_non_finite_first_amax_leaves_the_tensor_unscaled(device):
    st = ff.ScalingState.create(1, R, like=torch.empty(0, device=device))
    y = rows(3)
    y[0, 0] = np.nan
    q = ff.quantize(t(y, device), st.slot(0, R))
    assert same_bytes(q.data, cast(y, 1.0, "e4m3")) and same_bytes(st.scale, np.ones(1, np.float32))
    st = ff.update_scales(st, R)
    assert to_np(st.overflows).tolist() == [1]


def test_a_tensor_that_did_not_run_or_was_zero_changes_nothing(device):
    st = ff.ScalingState.create(2, R, like=torch.empty(0, device=device))
    x = rows(4)
    ff.quantize(t(x, device), st.slot(0, R))
    ff.quantize(t(x, device), st.slot(1, R))
    st = ff.update_scales(st, R)
    before = {f: to_np(a).copy() for f, a in st.arrays().items()}
    q = ff.quantize(t(np.zeros((5, 8), np.float32), device), st.slot(0, R))  # amax 0: the kept scale
    assert same_bytes(q.data, np.zeros((5, 8), np.uint8).view(ref.cast_to_fp8(np.zeros(1), "e4m3").dtype))
    assert same_bytes(q.scale_inv, before["scale_inv"][:1])
    st = ff.update_scales(st, R)  # tensor 0 staged 0, tensor 1 did not run
    assert all(same_bytes(a, before[f]) for f, a in st.arrays().items())


def test_several_calls_before_an_update_share_the_staged_max(device):
    """Stage 1's contract: the scale comes from the staged slot, so a second quantization of the
    same tensor before the update (a micro-batch) is cast with the running max of the step."""
    st = ff.ScalingState.create(1, R, like=torch.empty(0, device=device))
    big, small = rows(5, mag=100.0), rows(6, mag=0.01)
    ff.quantize(t(big, device), st.slot(0, R))
    q = ff.quantize(t(small, device), st.slot(0, R))
    assert same_bytes(q.data, cast(small, want_scale(ref.amax(big), 448.0), "e4m3"))
    st = ff.update_scales(st, R)
    q = ff.quantize(t(small, device), st.slot(0, R))  # the next step starts over
    assert same_bytes(q.data, cast(small, want_scale(ref.amax(small), 448.0), "e4m3"))


def test_current_scaling_is_the_delayed_first_step_on_every_step(device):
    """The twin by construction: a fresh DelayedScaling state (first_step='current') each step
    gives the same bytes as one CurrentScaling state carried through the steps."""
    d = ff.DelayedScaling(amax_history_len=2, amax_compute_algo="most_recent")
    st = ff.ScalingState.create([False, True], R, like=torch.empty(0, device=device))
    for step in range(4):
        x, dy = rows(10 + step, mag=4.0 ** step), rows(20 + step, mag=0.5 ** step)
        fresh = ff.ScalingState.create([False, True], d, like=torch.empty(0, device=device))
        for state, recipe in ((st, R), (fresh, d)):
            out = [ff.gelu_quantize(t(x, device), state.slot(0, recipe), transpose=True),
                   ff.dgelu_quantize(t(dy, device), t(x, device), state.slot(1, recipe), transpose=True, dbias=True)]
            if recipe is R:
                mine = out
        for a, b in zip(mine, out):
            assert same_bytes(a.data, b.data) and same_bytes(a.data_t, b.data_t)
            assert same_bytes(a.scale_inv, b.scale_inv)
        assert same_bytes(mine[1].dbias, out[1].dbias)
        assert same_bytes(st.scale, fresh.scale) and same_bytes(st.amax_history[0], fresh.amax_history[0])
        st = ff.update_scales(st, R)


def test_the_update_through_a_jax_state_returns_a_new_state():
    import jax.numpy as jnp

    st = ff.ScalingState.create(2, R)
    ff.quantize(rows(7), st.slot(0, R))
    jst = st.replace(**{f: jnp.asarray(a) for f, a in st.arrays().items()})
    new = ff.update_scales(jst, R)
    assert new is not jst and same_bytes(new.amax_history[1], np.array([ref.amax(rows(7)), 0], np.float32))


# ---- close_step: one rule, every namespace ---------------------------------------------------
def test_close_step_agrees_on_numpy_torch_and_jax():
    import jax.numpy as jnp

    tiny = np.array([1e-45], np.float32)[0]  # a denormal amax counts (compared as bits)
    hist = np.array([[0.0, -0.0, 3.0, np.nan, np.inf, tiny, 5.0],
                     [2.0, 2.0, 2.0, 2.0, 2.0, 2.0, 0.0]], np.float32)
    scale = np.arange(1, 8, dtype=np.float32)
    arrays = (hist, scale, f32(1) / scale, np.arange(7, dtype=np.int32), np.zeros(7, np.int32))
    want_hist = np.array([[0.0, -0.0, 0, 0, 0, 0, 0], [2.0, 2.0, 3.0, 2.0, 2.0, tiny, 5.0]], np.float32)
    outs = [close_step(NumpyNamespace(), *arrays),
            close_step(TorchNamespace(), *(torch.from_numpy(a.copy()) for a in arrays)),
            close_step(JnpNamespace(), *(jnp.asarray(a) for a in arrays))]
    for out in outs:
        assert same_bytes(out[0], want_hist)
        assert same_bytes(out[1], arrays[1]) and same_bytes(out[2], arrays[2]) and same_bytes(out[4], arrays[4])
        assert to_np(out[3]).tolist() == [0, 1, 2, 4, 5, 5, 6]


# ---- bad input -------------------------------------------------------------------------------
def test_a_delayed_state_or_a_wrong_recipe_is_refused_before_any_write():
    st = ff.ScalingState.create(2, ff.DelayedScaling(amax_history_len=16))
    before = {f: a.copy() for f, a in st.arrays().items()}
    with pytest.raises(ValueError, match="amax_history has 16 rows but the recipe's amax_history_len is 2"):
        ff.update_scales(st, R)
    with pytest.raises(ValueError, match="amax_history has 16 rows but the recipe's amax_history_len is 2"):
        ff.quantize(rows(0), st.slot(0, R))
    with pytest.raises(TypeError, match=r"^recipe must be a fusedfp8\.DelayedScaling or a fusedfp8\.CurrentScaling; "
                                        r"got type"):
        ff.update_scales(st, ff.CurrentScaling)
    assert all(same_bytes(a, before[f]) for f, a in st.arrays().items())
    cur = ff.ScalingState.create(2, R)
    cur.amax_history.setflags(write=False)
    with pytest.raises(ValueError, match="ScalingState.amax_history is a read-only numpy array"):
        ff.update_scales(cur, R)
