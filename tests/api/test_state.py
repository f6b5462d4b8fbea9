"""Delayed-scaling state (state.py) and the update rule (numerics/scaling.py), replayed by hand.

The hand replay below is written from docs/design.md alone, one tensor at a time with Python floats
and lists (each float32 operation is a double operation rounded once to float32, which is exact
for a single + - * /). It never calls fusedfp8.numerics.scaling.update_rule.
"""
import copy
import dataclasses
import math

import jax.numpy as jnp
import numpy as np
import pytest
import torch

import fusedfp8
from fusedfp8 import ops
from fusedfp8.numerics import reference as ref
from fusedfp8.numerics.constants import FLT_MAX as FLT_MAX32
from fusedfp8.recipe import DelayedScaling
from fusedfp8.state import STATE_FIELDS, ScalingState, Slot, apply_update

FLT_MAX = float(FLT_MAX32)
assert FLT_MAX == float(np.finfo(np.float32).max)


def r32(v: float) -> float:
    """Round a double to the nearest float32 (ties to even; overflow to inf)."""
    with np.errstate(over="ignore"):
        return float(np.float32(v))


# ---- the rule, by hand ----------------------------------------------------------------------
class HandTensor:
    """One tensor's state: a list of L amaxes (row 0 = staging), scale, scale_inv, counters."""

    def __init__(self, L: int):
        self.h = [0.0] * L
        self.scale, self.scale_inv, self.overflows, self.updates = 1.0, 1.0, 0, 0

    def stage(self, a: float) -> None:
        """What a quantization does to the slot: max-accumulate (the slot is float32), NaN sticks."""
        cur, a = self.h[0], r32(a)
        self.h[0] = math.nan if (math.isnan(cur) or math.isnan(a)) else max(cur, a)

    def update(self, fmt_max: float, margin: float, algo: str) -> None:
        a = self.h[0]
        if math.isnan(a) or math.isinf(a):  # 1. overflow: keep scale, count, clear the slot, no roll
            self.overflows += 1
            self.h[0] = 0.0
        elif a == 0.0:  # 2. not quantized this step: nothing
            pass
        else:  # 3. new scale from the history, then roll by -1 and clear the slot
            amax = max(self.h) if algo == "max" else a
            s = r32(r32(fmt_max / amax) / r32(2.0 ** margin))
            self.scale = FLT_MAX if math.isinf(s) else s
            self.h = self.h[1:] + [a]
            self.h[0] = 0.0
            self.updates += 1
        self.scale_inv = r32(1.0 / self.scale)  # 4.


def hand_arrays(tensors) -> dict:
    return {
        "amax_history": np.array([t.h for t in tensors], np.float32).T.copy(),
        "scale": np.array([t.scale for t in tensors], np.float32),
        "scale_inv": np.array([t.scale_inv for t in tensors], np.float32),
        "overflows": np.array([t.overflows for t in tensors], np.int32),
        "updates": np.array([t.updates for t in tensors], np.int32),
    }


def as_numpy(a) -> np.ndarray:
    if isinstance(a, torch.Tensor):
        return a.numpy()
    return np.asarray(a)


def assert_state_bytes(state: ScalingState, expect: dict, where: str) -> None:
    for name in STATE_FIELDS:
        got = as_numpy(getattr(state, name))
        assert got.dtype == expect[name].dtype and got.shape == expect[name].shape, (where, name)
        if got.tobytes() != expect[name].tobytes():
            raise AssertionError(f"{where}: {name} differs\n got {got!r}\nwant {expect[name]!r}")


# ---- staging into a state of any framework --------------------------------------------------
def stage(state: ScalingState, i: int, a: float) -> ScalingState:
    """Max-accumulate a into row 0 of column i, as quantize does (NaN sticks)."""
    cur = float(as_numpy(state.amax_history)[0, i])
    new = math.nan if (math.isnan(cur) or math.isnan(a)) else max(cur, a)
    h = state.amax_history
    if isinstance(h, torch.Tensor):
        h[0, i] = new
        return state
    if isinstance(h, np.ndarray):
        h[0, i] = new
        return state
    return state.replace(amax_history=h.at[0, i].set(np.float32(new)))


LIKE = {"numpy": None, "torch": torch.zeros(0), "jax": jnp.zeros(0)}
UPDATERS = {"apply_update": apply_update, "ops.update_scales": ops.update_scales}

# Three tensors: two forward (E4M3) and one gradient (E5M2 under 'hybrid'). None: the tensor did
# not run that step. Lists: several micro-batches staged into the slot before the update.
GRAD = (False, False, True)
SEQUENCE = [
    [2.0, 0.25, 1e-5],
    [3.5, None, [3e-5, 1e-5]],
    [None, 0.5, math.nan],
    [[1.0, 0.5], math.inf, 2e-5],
    [[0.5, math.nan], 0.125, None],
    [0.5, 0.75, 1e-6],
    [math.inf, None, 4e-5],
    [100.0, 1.5, [1e-4, math.inf]],
    [1e-3, 2.0, math.inf],
    [0.75, None, 5e-6],
    [None, None, None],
    [5.0, 3.0, 2e-5],
]


def replay(framework, updater, L, margin, algo, fp8_format):
    recipe = DelayedScaling(margin=margin, amax_history_len=L, amax_compute_algo=algo, fp8_format=fp8_format)
    state = ScalingState.create(GRAD, recipe, like=LIKE[framework])
    hand = [HandTensor(L) for _ in GRAD]
    fmt_max = [recipe.format_for(g).max for g in GRAD]
    assert_state_bytes(state, hand_arrays(hand), "fresh")
    for step, amaxes in enumerate(SEQUENCE):
        for i, a in enumerate(amaxes):
            for mb in ([] if a is None else a if isinstance(a, list) else [a]):
                state = stage(state, i, mb)
                hand[i].stage(mb)
        assert_state_bytes(state, hand_arrays(hand), f"step {step} staged")
        with np.errstate(all="ignore"):
            state = UPDATERS[updater](state, recipe)
        for i, t in enumerate(hand):
            t.update(fmt_max[i], margin, algo)
        assert_state_bytes(state, hand_arrays(hand), f"step {step} updated")
    return state, hand


CONFIGS = [(L, m, algo, f) for L in (1, 31, 1024) for m in (0, 2) for algo in ("max", "most_recent")
           for f in ("hybrid", "e4m3")]
CONFIG_IDS = [f"L{L}-margin{m}-{algo}-{f}" for L, m, algo, f in CONFIGS]


@pytest.mark.parametrize("updater", list(UPDATERS))
@pytest.mark.parametrize("L, margin, algo, fp8_format", CONFIGS, ids=CONFIG_IDS)
def test_replay_numpy(L, margin, algo, fp8_format, updater):
    state, hand = replay("numpy", updater, L, margin, algo, fp8_format)
    # The update really ran: scales moved, overflows were counted, the history holds past amaxes.
    assert all(t.scale != 1.0 for t in hand)
    assert [t.overflows for t in hand] == [2, 1, 3]
    assert [t.updates for t in hand] == [8, 7, 7]


@pytest.mark.parametrize("updater", list(UPDATERS))
@pytest.mark.parametrize("L, margin, algo, fp8_format", CONFIGS, ids=CONFIG_IDS)
def test_replay_torch_cpu(L, margin, algo, fp8_format, updater):
    state, _ = replay("torch", updater, L, margin, algo, fp8_format)
    assert isinstance(state.scale, torch.Tensor) and state.scale.dtype == torch.float32


@pytest.mark.parametrize("updater", list(UPDATERS))
@pytest.mark.parametrize("L, margin, algo, fp8_format", CONFIGS, ids=CONFIG_IDS)
def test_replay_jax_cpu(L, margin, algo, fp8_format, updater):
    # SEQUENCE holds no denormal amax and no scale whose inverse is a float32 denormal, so XLA's
    # flush-to-zero on CPU does not come into it (those cases are tested on numpy / torch only).
    state, _ = replay("jax", updater, L, margin, algo, fp8_format)
    assert "jax" in type(state.scale).__module__


def test_hand_rule_spot_values():
    """Known numbers, so the hand rule and the library cannot be wrong together."""
    r = DelayedScaling(margin=0, amax_history_len=4)
    state = ScalingState.create(GRAD, r)
    state.amax_history[0] = [2.0, 0.25, 1e-5]
    ops.update_scales(state, r)
    np.testing.assert_array_equal(state.scale, np.float32([224.0, 1792.0, np.float32(57344.0) / np.float32(1e-5)]))
    np.testing.assert_array_equal(state.scale_inv, np.float32(1) / state.scale)
    np.testing.assert_array_equal(state.amax_history[:, 0], [0, 0, 0, 2.0])
    np.testing.assert_array_equal(state.updates, [1, 1, 1])
    state.amax_history[0] = [1.0, 0.0, 4e-5]
    ops.update_scales(state, DelayedScaling(margin=2, amax_history_len=4))
    # 'max' over the history: 2.0 for tensor 0, 4e-5 for tensor 2; margin 2 divides by 4.
    assert state.scale[0] == 56.0 and state.scale[1] == 1792.0
    assert state.scale[2] == np.float32(np.float32(57344.0) / np.float32(4e-5)) / np.float32(4)
    np.testing.assert_array_equal(state.amax_history[:, 0], [0, 0, 2.0, 1.0])
    np.testing.assert_array_equal(state.amax_history[:, 1], [0, 0, 0, 0.25])


# ---- the edge cases, one at a time -----------------------------------------------------------
FRAMEWORKS_ALL = ["numpy", "torch", "jax"]


def fresh(framework, L=31, grad=(False,), **kw):
    r = DelayedScaling(amax_history_len=L, **kw)
    return ScalingState.create(grad, r, like=LIKE[framework]), r


def snapshot(state) -> dict:
    return {f: as_numpy(getattr(state, f)).copy() for f in STATE_FIELDS}


@pytest.mark.parametrize("framework", FRAMEWORKS_ALL)
@pytest.mark.parametrize("bad", [math.nan, math.inf], ids=["nan", "inf"])
def test_overflow_keeps_scale_clears_slot_then_recovers(framework, bad):
    state, r = fresh(framework)
    for a in (4.0, 8.0):
        state = ops.update_scales(stage(state, 0, a), r)
    before = snapshot(state)
    assert before["scale"][0] == 56.0  # 448 / max(4, 8)
    state = ops.update_scales(stage(state, 0, bad), r)
    after = snapshot(state)
    assert after["overflows"][0] == 1 and after["updates"][0] == 2
    assert after["scale"].tobytes() == before["scale"].tobytes()
    assert after["scale_inv"].tobytes() == before["scale_inv"].tobytes()
    # slot cleared, no roll, nothing non-finite anywhere in the history
    assert after["amax_history"].tobytes() == before["amax_history"].tobytes()
    assert np.isfinite(after["amax_history"]).all()
    state = ops.update_scales(stage(state, 0, 112.0), r)
    s = snapshot(state)
    assert s["scale"][0] == 4.0 and s["scale_inv"][0] == 0.25 and s["updates"][0] == 3
    np.testing.assert_array_equal(s["amax_history"][-3:, 0], [4.0, 8.0, 112.0])


@pytest.mark.parametrize("framework", FRAMEWORKS_ALL)
@pytest.mark.parametrize("algo", ["max", "most_recent"])
def test_tensor_that_did_not_run_changes_nothing(framework, algo):
    state, r = fresh(framework, L=5, amax_compute_algo=algo)
    state = ops.update_scales(stage(state, 0, 2.0), r)
    before = snapshot(state)
    for _ in range(3):
        state = ops.update_scales(state, r)
        after = snapshot(state)
        for f in STATE_FIELDS:
            assert after[f].tobytes() == before[f].tobytes(), f


@pytest.mark.parametrize("framework", ["numpy", "torch"])  # not jax: XLA on CPU flushes the denormal 1/FLT_MAX
@pytest.mark.parametrize("algo", ["max", "most_recent"])
@pytest.mark.parametrize("margin", [0, 2])
@pytest.mark.parametrize("tiny", [1e-37, 2.0 ** -140, 2.0 ** -149, 6.6e-37],
                         ids=["1e-37", "denormal-2^-140", "denormal-min", "overflows-before-margin"])
def test_tiny_amax_gives_flt_max(framework, algo, margin, tiny):
    # 6.6e-37: 448 / a overflows float32 but (448 / a) / 4 would not in double: the rule is in fp32.
    state, r = fresh(framework, margin=margin, amax_compute_algo=algo)
    state = ops.update_scales(stage(state, 0, tiny), r)
    s = snapshot(state)
    assert s["scale"][0] == np.float32(FLT_MAX)
    assert s["scale_inv"].tobytes() == (np.float32(1) / np.float32(FLT_MAX)).tobytes()
    assert s["scale_inv"][0] != 0  # a float32 denormal, not flushed
    assert s["amax_history"][-1, 0] == np.float32(tiny) and s["updates"][0] == 1


@pytest.mark.parametrize("tiny", [1e-37, 2.0 ** -140], ids=["1e-37", "denormal-2^-140"])
def test_tiny_amax_jax(tiny):
    """On jax (XLA on CPU flushes denormals) what must still hold: a denormal amax counts as seen
    (the rule compares bits), the scale is FLT_MAX and the history keeps the amax bit for bit.
    scale_inv = 1/FLT_MAX is a float32 denormal that XLA's CPU backend flushes, so it is not checked."""
    state, r = fresh("jax")
    state = ops.update_scales(stage(state, 0, tiny), r)
    s = snapshot(state)
    assert s["scale"][0] == np.float32(FLT_MAX) and s["updates"][0] == 1 and s["overflows"][0] == 0
    assert s["amax_history"][-1, 0:1].tobytes() == np.float32([tiny]).tobytes()


@pytest.mark.parametrize("framework", FRAMEWORKS_ALL)
@pytest.mark.parametrize("fp8_format, grad_max", [("hybrid", 57344.0), ("e4m3", 448.0)], ids=["hybrid", "e4m3"])
def test_gradient_tensors_use_their_format(framework, fp8_format, grad_max):
    state, r = fresh(framework, grad=(False, True, True, False), fp8_format=fp8_format)
    for i in range(4):
        state = stage(state, i, 2.0)
    state = ops.update_scales(state, r)
    np.testing.assert_array_equal(as_numpy(state.scale), np.float32([224.0, grad_max / 2, grad_max / 2, 224.0]))


@pytest.mark.parametrize("L", [1, 31, 1024])
def test_history_window_drops_the_oldest(L):
    """'max' sees the staged amax and the L-1 before it: an amax counts for L updates, then is dropped."""
    state, r = fresh("numpy", L=L)
    state = ops.update_scales(stage(state, 0, 64.0), r)
    assert state.scale[0] == 7.0
    for k in range(1, L + 1):
        state = ops.update_scales(stage(state, 0, 1.0), r)
        expect = 7.0 if k <= L - 1 else 448.0
        assert state.scale[0] == expect, (k, state.scale[0])


# ---- ScalingState construction and validation ------------------------------------------------
@pytest.mark.parametrize("framework", FRAMEWORKS_ALL)
@pytest.mark.parametrize("grad, expect", [(3, (False,) * 3), ([False, True], (False, True)),
                                          (np.int64(2), (False, False)), ((True, False, True), (True, False, True)),
                                          ((np.bool_(True), False), (True, False))],
                         ids=["int", "list", "np-int", "tuple-bools", "numpy-bools"])
def test_create(framework, grad, expect):
    r = DelayedScaling(amax_history_len=31)
    s = ScalingState.create(grad, r, like=LIKE[framework])
    n = len(expect)
    assert s.grad == expect and s.num_tensors == n and s.history_len == 31
    if framework != "numpy":
        assert all(framework in type(getattr(s, f)).__module__ for f in STATE_FIELDS)
    a = snapshot(s)
    assert a["amax_history"].shape == (31, n) and a["amax_history"].dtype == np.float32
    assert not a["amax_history"].any()
    for f, v, dt in (("scale", 1, np.float32), ("scale_inv", 1, np.float32), ("overflows", 0, np.int32),
                     ("updates", 0, np.int32)):
        assert a[f].dtype == dt and a[f].shape == (n,)
        assert (a[f] == v).all()
    s.validate(r)


@pytest.mark.parametrize("grad, recipe, exc, match", [
    (0, DelayedScaling(), ValueError, "grad"),
    (-1, DelayedScaling(), ValueError, "grad"),
    ([], DelayedScaling(), ValueError, "grad"),
    (2, "recipe", TypeError, "recipe must be a fusedfp8.DelayedScaling"),
    (2, None, TypeError, "recipe"),
    ((1, 0, 1), DelayedScaling(), TypeError, r"^grad must hold bools \(True for a gradient\); got 1 \(int\)"),
    ("ab", DelayedScaling(), TypeError, r"^grad must be a sequence of bool"),
], ids=["zero", "negative", "empty", "str-recipe", "None-recipe", "tuple-ints", "str"])
def test_create_rejects(grad, recipe, exc, match):
    with pytest.raises(exc, match=match):
        ScalingState.create(grad, recipe)


def _arrays(n=2, L=4):
    return dict(amax_history=np.zeros((L, n), np.float32), scale=np.ones(n, np.float32),
                scale_inv=np.ones(n, np.float32), overflows=np.zeros(n, np.int32), updates=np.zeros(n, np.int32))


@pytest.mark.parametrize("field, value, exc, match", [
    ("amax_history", np.zeros(2, np.float32), ValueError, r"ScalingState\.amax_history must be 2-D"),
    ("scale", np.ones((1, 2), np.float32), ValueError, r"ScalingState\.scale must be 1-D"),
    ("scale", np.ones(2, np.float64), TypeError, r"ScalingState\.scale must be float32; got float64"),
    ("scale_inv", np.ones(2, np.float16), TypeError, r"ScalingState\.scale_inv must be float32"),
    ("overflows", np.zeros(2, np.int64), TypeError, r"ScalingState\.overflows must be int32"),
    ("updates", np.zeros(2, np.float32), TypeError, r"ScalingState\.updates must be int32"),
    ("scale", np.ones(3, np.float32), ValueError, r"ScalingState\.scale has 3 tensors"),
    ("amax_history", np.zeros((4, 3), np.float32), ValueError, r"ScalingState\.amax_history has 3 tensors"),
    ("amax_history", np.zeros((0, 2), np.float32), ValueError, r"ScalingState\.amax_history must have at least 1 row"),
    ("scale", torch.ones(2), TypeError, r"ScalingState\.scale is a torch array"),
    ("overflows", jnp.zeros(2, jnp.int32), TypeError, r"ScalingState\.overflows is a jax array"),
    ("scale", [1.0, 1.0], TypeError, r"ScalingState\.scale must be an array"),
], ids=["history-1d", "scale-2d", "scale-f64", "scale_inv-f16", "overflows-i64", "updates-f32", "scale-n3",
        "history-n3", "history-0-rows", "mixed-torch", "mixed-jax", "list"])
def test_state_validation(field, value, exc, match):
    arrays = _arrays()
    arrays[field] = value
    with pytest.raises(exc, match=match):
        ScalingState(**arrays, grad=(False, True))
    # validate() itself, on a state whose field was replaced after construction
    s = ScalingState(**_arrays(), grad=(False, True))
    setattr(s, field, value)
    with pytest.raises(exc, match=match):
        s.validate()


def test_validate_history_len_against_recipe():
    s = ScalingState(**_arrays(L=31), grad=(False, True))
    s.validate(DelayedScaling(amax_history_len=31))
    with pytest.raises(ValueError, match="amax_history has 31 rows but the recipe's amax_history_len is 1024"):
        s.validate(DelayedScaling())


# ---- a rejected update changes nothing -------------------------------------------------------
def _staged(framework):
    state, r = fresh(framework, L=31, grad=(False, True))
    state = ops.update_scales(stage(stage(state, 0, 2.0), 1, 1e-3), r)
    return stage(stage(state, 0, 3.0), 1, math.nan), r  # an update would change every array


def _bad_dtype(state, r):
    state.overflows = state.overflows.astype(np.int64) if isinstance(state.overflows, np.ndarray) else \
        state.overflows.to(torch.int64)
    return state, r


def _non_contiguous(state, r):
    if isinstance(state.scale, np.ndarray):
        state.scale = np.repeat(state.scale, 2)[::2]
    else:
        state.scale = state.scale.repeat_interleave(2)[::2]
    return state, r


REJECTS = {
    "recipe-history-len": (lambda s, r: (s, DelayedScaling(amax_history_len=30)), ValueError,
                           "amax_history has 31 rows but the recipe's amax_history_len is 30"),
    "recipe-not-a-recipe": (lambda s, r: (s, {"margin": 0}), TypeError, "recipe must be a fusedfp8.DelayedScaling"),
    "state-dtype": (_bad_dtype, TypeError, r"ScalingState\.overflows must be int32"),
    "state-non-contiguous": (_non_contiguous, ValueError, "contiguous"),
}


@pytest.mark.parametrize("framework", ["numpy", "torch"])
@pytest.mark.parametrize("how", list(REJECTS))
def test_rejected_update_leaves_state_untouched(framework, how):
    state, r = _staged(framework)
    breaker, exc, match = REJECTS[how]
    state, bad_recipe = breaker(state, r)
    before = snapshot(state)
    with pytest.raises(exc, match=match):
        ops.update_scales(state, bad_recipe)
    after = snapshot(state)
    for f in STATE_FIELDS:
        assert after[f].tobytes() == before[f].tobytes(), f


def test_update_scales_rejects_non_state():
    with pytest.raises(TypeError, match="state must be a fusedfp8.ScalingState"):
        ops.update_scales({"scale": np.ones(1, np.float32)}, DelayedScaling())


# ---- slots and the first step through ops.quantize -------------------------------------------
def to_fw(x: np.ndarray, framework: str):
    return torch.from_numpy(x.copy()) if framework == "torch" else x.copy()


def q_bytes(q) -> np.ndarray:
    if isinstance(q, torch.Tensor):
        return q.view(torch.uint8).numpy()
    return np.asarray(q).view(np.uint8)


def hand_current_scale(amax: float, fmt_max: float, margin: float) -> float:
    s = r32(r32(fmt_max / amax) / r32(2.0 ** margin))
    return FLT_MAX if math.isinf(s) else s


@pytest.mark.parametrize("framework", ["numpy", "torch"])
@pytest.mark.parametrize("margin", [0, 2])
@pytest.mark.parametrize("grad", [False, True], ids=["fwd", "grad"])
def test_first_step_current_scaling(framework, margin, grad, rng):
    r = DelayedScaling(margin=margin, amax_history_len=31, first_step="current")
    state = ScalingState.create((not grad, grad), r, like=LIKE[framework])
    i = 1
    fmt = r.format_for(grad)
    sl = state.slot(i, r)
    assert isinstance(sl, Slot) and sl.fmt is fmt and sl.current_first
    x1 = (rng.standard_normal((37, 41)) * (1e-5 if grad else 3.0)).astype(np.float32)
    x2 = x1 * np.float32(4.0)  # larger: the second micro-batch moves the accumulated amax
    x3 = x1 * np.float32(0.5)  # smaller: it does not
    x4 = x1 * np.float32(100.0)  # after the update: quantized with the state's scale, not its own amax

    a1 = float(ref.amax(x1))
    r1 = ops.quantize(to_fw(x1, framework), sl)
    s1 = hand_current_scale(a1, fmt.max, margin)
    np.testing.assert_array_equal(q_bytes(r1.data), ref.quantize(x1, np.float32(s1), fmt).data.view(np.uint8))
    s = snapshot(state)
    assert s["scale"][i] == np.float32(s1) and s["scale_inv"][i] == np.float32(r32(1.0 / s1))
    assert s["amax_history"][0, i] == np.float32(a1) and float(as_numpy(r1.amax)[0]) == a1
    assert s["scale"][0] == 1 and s["amax_history"][0, 0] == 0  # the other tensor is untouched

    a2 = float(ref.amax(x2))
    r2 = ops.quantize(to_fw(x2, framework), sl)
    s2 = hand_current_scale(max(a1, a2), fmt.max, margin)
    np.testing.assert_array_equal(q_bytes(r2.data), ref.quantize(x2, np.float32(s2), fmt).data.view(np.uint8))
    r3 = ops.quantize(to_fw(x3, framework), sl)
    np.testing.assert_array_equal(q_bytes(r3.data), ref.quantize(x3, np.float32(s2), fmt).data.view(np.uint8))
    s = snapshot(state)
    assert s["amax_history"][0, i] == np.float32(a2) and s["scale"][i] == np.float32(s2)

    ops.update_scales(state, r)
    s = snapshot(state)
    assert s["updates"][i] == 1 and s["scale"][i] == np.float32(s2) and s["amax_history"][-1, i] == np.float32(a2)
    r4 = ops.quantize(to_fw(x4, framework), state.slot(i, r))
    np.testing.assert_array_equal(q_bytes(r4.data), ref.quantize(x4, np.float32(s2), fmt).data.view(np.uint8))
    after = snapshot(state)
    assert after["scale"][i] == np.float32(s2)  # not rewritten from x4's own amax
    assert after["amax_history"][0, i] == ref.amax(x4)


@pytest.mark.parametrize("framework", ["numpy", "torch"])
def test_first_step_unit_scale(framework, rng):
    r = DelayedScaling(amax_history_len=31, first_step="unit")
    state = ScalingState.create((False, True), r, like=LIKE[framework])
    x = (rng.standard_normal((16, 24)) * 1e-5).astype(np.float32)
    res = ops.quantize(to_fw(x, framework), state.slot(1, r))
    np.testing.assert_array_equal(q_bytes(res.data), ref.quantize(x, np.float32(1.0), "e5m2").data.view(np.uint8))
    s = snapshot(state)
    assert s["scale"][1] == 1 and s["scale_inv"][1] == 1 and s["amax_history"][0, 1] == ref.amax(x)


@pytest.mark.parametrize("framework", ["numpy", "torch"])
def test_first_step_lasts_until_an_update_completes(framework, rng):
    """A NaN first step is an overflow: no completed update, so the next step is still 'first'."""
    r = DelayedScaling(amax_history_len=31)
    state = ScalingState.create(1, r, like=LIKE[framework])
    x = (rng.standard_normal((8, 8)) * 3).astype(np.float32)
    xn = x.copy()
    xn[3, 3] = np.nan
    res = ops.quantize(to_fw(xn, framework), state.slot(0, r))
    # amax NaN: no usable current scale, the state's scale (1) is used and kept
    np.testing.assert_array_equal(q_bytes(res.data), ref.quantize(xn, np.float32(1.0), "e4m3").data.view(np.uint8))
    assert snapshot(state)["scale"][0] == 1
    ops.update_scales(state, r)
    s = snapshot(state)
    assert s["overflows"][0] == 1 and s["updates"][0] == 0
    res = ops.quantize(to_fw(x, framework), state.slot(0, r))
    sc = hand_current_scale(float(ref.amax(x)), 448.0, 0)
    np.testing.assert_array_equal(q_bytes(res.data), ref.quantize(x, np.float32(sc), "e4m3").data.view(np.uint8))


@pytest.mark.parametrize("framework", ["numpy", "torch"])
@pytest.mark.parametrize("order", ["big-small", "small-big", "nan-first", "nan-second", "zero-sized"])
def test_micro_batches_accumulate_with_max(framework, order, rng):
    r = DelayedScaling(amax_history_len=31, first_step="unit")
    state = ScalingState.create(1, r, like=LIKE[framework])
    big = (rng.standard_normal((9, 10)) * 10).astype(np.float32)
    small = big * np.float32(0.25)
    nan = small.copy()
    nan[0, 0] = np.nan
    seq, expect = {
        "big-small": ([big, small], ref.amax(big)),
        "small-big": ([small, big], ref.amax(big)),
        "nan-first": ([nan, big], np.nan),
        "nan-second": ([big, nan], np.nan),
        "zero-sized": ([big, np.zeros((0, 10), np.float32)], ref.amax(big)),
    }[order]
    for x in seq:
        ops.quantize(to_fw(x, framework), state.slot(0, r))
    got = snapshot(state)["amax_history"][0, 0]
    if np.isnan(expect):
        assert np.isnan(got)
    else:
        assert got == expect


def test_slot_views_share_the_state_memory():
    r = DelayedScaling(amax_history_len=31)
    state = ScalingState.create(3, r)
    sl = state.slot(2, r)
    assert sl.amax.shape == (1,) and np.shares_memory(sl.amax, state.amax_history)
    assert np.shares_memory(sl.scale, state.scale) and np.shares_memory(sl.scale_inv, state.scale_inv)
    assert sl.margin_factor == 1.0 and sl.fmt is fusedfp8.E4M3


@pytest.mark.parametrize("index, exc", [(3, IndexError), (-1, IndexError), (True, TypeError), (1.0, TypeError)],
                         ids=["3", "-1", "bool", "float"])
def test_slot_index_checks(index, exc):
    r = DelayedScaling(amax_history_len=31)
    with pytest.raises(exc, match="index"):
        ScalingState.create(3, r).slot(index, r)


def test_slot_checks_the_recipe_history_len():
    state = ScalingState.create(2, DelayedScaling(amax_history_len=31))
    with pytest.raises(ValueError, match="amax_history_len is 1024"):
        state.slot(0, DelayedScaling())


def test_jax_slot_is_refused_for_eager_quantize():
    r = DelayedScaling(amax_history_len=31)
    state = ScalingState.create(1, r, like=jnp.zeros(0))
    before = snapshot(state)
    with pytest.raises(TypeError, match="state.scale: jax arrays are immutable"):
        ops.quantize(jnp.ones((4, 4), jnp.float32), state.slot(0, r))
    after = snapshot(state)
    for f in STATE_FIELDS:
        assert after[f].tobytes() == before[f].tobytes()


def test_negative_zero_amax_is_not_a_quantization():
    """-0 staged (or left in the history by a caller) is 0: no update, no FLT_MAX scale from the
    sign bit (the fuzz found the kernel's bitwise max ranking -0 above every amax)."""
    recipe = DelayedScaling(amax_history_len=3)
    s = ScalingState.create([False, False], recipe)
    s.amax_history[0] = [-0.0, 2.0]
    s.amax_history[1] = [1.0, -0.0]
    ops.update_scales(s, recipe)
    assert s.updates.tolist() == [0, 1] and s.scale[0] == 1.0
    assert s.scale[1] == np.float32(448.0) / np.float32(2.0)


# ---- the state object: declared fields, copies -------------------------------------------------
def test_every_field_is_declared_and_grad_is_required():
    names = [f.name for f in dataclasses.fields(ScalingState)]
    assert names == [*STATE_FIELDS, "grad", "on_update"]
    s = ScalingState(**_arrays(), grad=(False, True))
    assert not hasattr(s, "__dict__")  # slots: nothing undeclared can ride along
    with pytest.raises(AttributeError):
        s.fmt_max_cache = np.ones(2, np.float32)
    with pytest.raises(TypeError, match="grad"):
        ScalingState(**_arrays())


@pytest.mark.parametrize("framework", FRAMEWORKS_ALL)
def test_copy_and_replace_keep_every_field(framework):
    state, r = fresh(framework, grad=(False, True, True))
    state = ops.update_scales(stage(stage(state, 0, 2.0), 2, 1e-3), r)
    calls = []
    state.on_update = lambda: calls.append(1)
    c = state.copy()
    assert c.grad == state.grad and c.on_update is None  # the owner of the arrays does not own the copy's
    for f in STATE_FIELDS:
        assert as_numpy(getattr(c, f)).tobytes() == as_numpy(getattr(state, f)).tobytes(), f
        if framework != "jax":  # mutable arrays: the copy has its own memory
            assert not np.shares_memory(as_numpy(getattr(c, f)), as_numpy(getattr(state, f))), f
    r2 = state.replace(scale=c.scale)
    assert r2.grad == state.grad and r2.on_update is state.on_update and r2.scale is c.scale
    assert all(getattr(r2, f) is getattr(state, f) for f in STATE_FIELDS if f != "scale")
    assert copy.copy(state).on_update is state.on_update


def test_on_update_is_called_after_an_in_place_update():
    state, r = fresh("numpy")
    calls = []
    state.on_update = lambda: calls.append(state.updates.copy())
    ops.update_scales(stage(state, 0, 2.0), r)
    assert len(calls) == 1 and calls[0].tolist() == [1]


def test_check_index():
    s = ScalingState.create(3, DelayedScaling(amax_history_len=4))
    assert s.check_index(2) == 2 and s.check_index(np.int64(1)) == 1
    with pytest.raises(IndexError, match=r"^index must be in \[0, 3\); got 3"):
        s.check_index(3)
    with pytest.raises(TypeError, match="^index must be an int; got bool"):
        s.check_index(True)
