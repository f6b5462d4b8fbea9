"""The JAX weight cache for gradient accumulation (issue 19), on the CPU: ``quantize_weight`` +
``fp8_dot(fp8_weight=)`` give the bytes of the uncached path (output, gradients, new meta: fresh,
advanced and ragged cases, both first-step rules; ``fp8_mlp(fp8_weights=)`` through the flax
Fp8MLP below) while the weight is quantized once per step instead of once per micro-batch
(counted in the jaxpr: the CUDA branch of every quantization is a buffer_callback whose first
result has the quantized array's shape); ``stage_amax`` is the state effect of a quantization;
the flax path (``quantize_weights``, the FP8_WEIGHTS collection, ``accumulate_gradients``)
trains a model of Fp8DotGeneral and Fp8MLP over micro-batches in ``lax.scan`` to the same bytes
with and without the cache, its states staging the max over the micro-batches and advancing once
per step; bad cached weights are refused naming the argument. The GPU twin is in
test_jax_kernels.py."""
from __future__ import annotations

from collections import Counter

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import fusedfp8
from fusedfp8.jax import functional as F
from fusedfp8.jax import meta as JM
from fusedfp8.jax import primitives as P
from fusedfp8.jax.flax import (FP8_WEIGHTS, OVERWRITE_WITH_GRADIENT, Fp8DotGeneral, Fp8MLP, TrainState,
                               accumulate_gradients, quantize_weights)
from fusedfp8.numerics import reference as ref
from fusedfp8.state import ScalingState
from fusedfp8.types import Quantized

RECIPE = fusedfp8.DelayedScaling(amax_history_len=4)
UNIT = fusedfp8.DelayedScaling(amax_history_len=4, first_step="unit")


def bf16(rng, shape, scale=1.0):
    return jnp.asarray(rng.standard_normal(shape) * scale, jnp.bfloat16)


def assert_same_bytes(a, b):
    la, lb = jax.tree.leaves(a), jax.tree.leaves(b)
    assert len(la) == len(lb)
    for u, v in zip(la, lb):
        assert u.shape == v.shape and u.dtype == v.dtype
        np.testing.assert_array_equal(np.asarray(u).reshape(-1).view(np.uint8), np.asarray(v).reshape(-1).view(np.uint8))


def quantizations(fn, *args) -> Counter:
    """Shape -> how many quantizations in the jaxpr of ``fn(*args)`` write an FP8 array of that
    shape: the buffer_callbacks of the CUDA branch (on the CPU the jaxpr holds it beside the
    jax.numpy one). One trace for every shape asked about."""
    def walk(jaxpr, n):
        for e in jaxpr.eqns:
            if e.primitive.name in ("buffer_callback", "ffi_call"):
                first = e.params["result_avals"][0]
                if first.dtype == jnp.uint8:
                    n[first.shape] += 1
            for p in e.params.values():
                for q in p if isinstance(p, (list, tuple)) else [p]:
                    inner = getattr(q, "jaxpr", None)
                    if inner is not None:
                        walk(getattr(inner, "jaxpr", inner), n)
        return n

    return walk(jax.make_jaxpr(fn)(*args).jaxpr, Counter())


def stepped_meta(rng, k, n, recipe):
    """The meta after one step of fp8_dot (staged amaxes, so the next use advances it); jitted: one
    compile instead of the eager grad's dozens (the same bytes)."""
    x, w = bf16(rng, (8, k)), bf16(rng, (k, n), 0.1)
    return jax.jit(jax.grad(lambda m: F.fp8_dot(x, w, m, recipe).astype(jnp.float32).sum()))(JM.fresh_meta(recipe))


# ---- primitives: stage_amax is the state effect of quantize ------------------------------------
@pytest.mark.parametrize("updates", [0, 3], ids=["first-step", "later-step"])
@pytest.mark.parametrize("recipe", [RECIPE, UNIT], ids=["current", "unit"])
@pytest.mark.parametrize("special", [None, np.nan, np.inf, 0.0], ids=["normal", "nan", "inf", "zeros"])
def test_stage_amax_is_what_quantize_does_to_the_state(rng, updates, recipe, special):
    w = rng.standard_normal((24, 40)).astype(np.float32)
    if special == 0.0:
        w[:] = 0.0
    elif special is not None:
        w[3, 5] = special
    st = ScalingState.create([False, False, True], recipe, like=jnp.zeros(1))
    st = st.replace(amax_history=st.amax_history.at[0, 1].set(0.25).at[2, 1].set(3.0),
                    scale=st.scale.at[1].set(2.0), scale_inv=st.scale_inv.at[1].set(0.5),
                    updates=jnp.full((3,), updates, jnp.int32))
    r, want = P.quantize(jnp.asarray(w), st, 1, recipe, transpose=True)
    got = P.stage_amax(st, 1, jnp.float32(ref.amax(w)), recipe)
    assert_same_bytes(got, want)
    assert_same_bytes(P.stage_amax(st, 1, r.amax, recipe), want)  # the staged slot (a cache's amax): idempotent


def test_stage_amax_refuses_a_bad_amax():
    st = ScalingState.create([False, False, True], RECIPE, like=jnp.zeros(1))
    with pytest.raises(ValueError, match=r"amax must be a float32 scalar; got float32 \(3,\)"):
        P.stage_amax(st, 1, jnp.zeros(3), RECIPE)
    with pytest.raises(IndexError, match=r"index must be in \[0, 3\); got 3"):
        P.stage_amax(st, 3, jnp.float32(1), RECIPE)


# ---- fp8_dot / fp8_mlp: the same bytes, one weight quantization --------------------------------
DOT_CASES = [("fresh", (32, 24, 48), RECIPE), ("advanced-ragged", (30, 20, 36), RECIPE), ("unit", (32, 24, 48), UNIT)]


@pytest.mark.parametrize("case, mkn, recipe", DOT_CASES, ids=[c[0] for c in DOT_CASES])
def test_fp8_dot_with_the_cached_weight_gives_the_same_bytes(rng, case, mkn, recipe):
    m, k, n = mkn
    w = bf16(rng, (k, n), 0.1)
    meta = stepped_meta(rng, k, n, recipe) if case.startswith("advanced") else JM.fresh_meta(recipe)
    xs = [bf16(rng, (m, k)) for _ in range(2)]

    @jax.jit
    def grads(x, w, meta, q):
        def loss(x, w, meta):
            return (F.fp8_dot(x, w, meta, recipe, fp8_weight=q).astype(jnp.float32) ** 2).sum()

        return jax.value_and_grad(loss, argnums=(0, 1, 2))(x, w, meta)

    q = jax.jit(lambda w, meta: F.quantize_weight(w, meta, recipe))(w, meta)
    assert isinstance(q, Quantized) and q.data.shape == (k, n) and q.data_t.shape == (n, k)
    assert q.data.dtype == jnp.float8_e4m3fn and q.dbias is None
    for x in xs:  # two micro-batches of one step, one copy of the weight
        assert_same_bytes(grads(x, w, meta, q), grads(x, w, meta, None))


def test_the_weight_is_quantized_once_for_all_micro_batches(rng):
    """Three micro-batches of one step (unrolled): without the cache the jaxpr quantizes the
    (24, 48) weight three times, with it once; the inputs and gradients three times either way
    (each written padded by its kernel: K = 24 is ragged)."""
    w, meta = bf16(rng, (24, 48), 0.1), JM.fresh_meta(RECIPE)
    xs = bf16(rng, (3, 32, 24))

    def step(xs, w, meta, cache):
        q = F.quantize_weight(w, meta, RECIPE, pad_to=cache) if cache else None
        total = jnp.zeros_like(w)
        for x in xs:
            total += jax.grad(lambda w: F.fp8_dot(x, w, meta, RECIPE, fp8_weight=q).astype(jnp.float32).sum())(w)
        return total

    # K = 24 is ragged, so the kernels write every operand padded to multiples of 16: the inputs
    # (32, 24) as (32, 32), the weight (24, 48) as (32, 48) beside the 3 output gradients (32,
    # 48); the cache holds the weight as (24, 48) (padded again in each use) or, with pad_to=16,
    # padded by its kernel
    for cache, weights in ((0, {(32, 48): 3}), (1, {(24, 48): 1}), (16, {(32, 48): 1})):
        n = quantizations(lambda xs, w, meta: step(xs, w, meta, cache), xs, w, meta)
        want = Counter({(32, 32): 3, (32, 48): 3})
        want.update(weights)
        assert n == want, cache
    want = jax.jit(lambda *a: step(*a, 0))(xs, w, meta)
    for cache in (1, 16):
        assert_same_bytes(jax.jit(lambda *a: step(*a, cache))(xs, w, meta), want)


BAD = [
    ("not-quantized", lambda q: (q.data, q.data_t), TypeError,
     r"fp8_weight must be None or the Quantized that fusedfp8\.jax\.quantize_weight returned .*; got tuple"),
    ("no-transpose", lambda q: q._replace(data_t=None), TypeError, r"fp8_weight must be None or the Quantized"),
    ("other-weight", lambda q: q._replace(data=q.data[:8]), ValueError,
     r"fp8_weight\.data must be float8_e4m3fn of shape \(24, 48\) \(the FP8 copy of a \(24, 48\) weight under this "
     r"recipe\); got float8_e4m3fn \(8, 48\)"),
    ("e5m2", lambda q: q._replace(data_t=q.data_t.astype(jnp.float8_e5m2)), ValueError,
     r"fp8_weight\.data_t must be float8_e4m3fn of shape \(48, 24\) .*; got float8_e5m2 \(48, 24\)"),
    ("amax-shape", lambda q: q._replace(amax=q.amax.reshape(1)), ValueError,
     r"fp8_weight\.amax must be float32 of shape \(\)"),
]


@pytest.mark.parametrize("make, exc, match", [pytest.param(*b[1:], id=b[0]) for b in BAD])
def test_a_bad_cached_weight_is_refused_naming_the_argument(rng, make, exc, match):
    x, w, meta = bf16(rng, (32, 24)), bf16(rng, (24, 48), 0.1), JM.fresh_meta(RECIPE)
    q = F.quantize_weight(w, meta, RECIPE)
    with pytest.raises(exc, match=match):
        F.fp8_dot(x, w, meta, RECIPE, fp8_weight=make(q))
    args = (x, w, jnp.zeros(48, jnp.bfloat16), w.T, jnp.zeros(24, jnp.bfloat16), meta, meta, RECIPE)
    with pytest.raises(TypeError, match=r"fp8_weights must be None or a pair \(fc1's, fc2's\) .*; got Quantized"):
        F.fp8_mlp(*args, fp8_weights=q)
    with pytest.raises(ValueError, match=r"fp8_weights\[1\]\.data must be float8_e4m3fn of shape \(48, 24\)"):
        F.fp8_mlp(*args, fp8_weights=(q, q))


# ---- flax: quantize_weights, the FP8_WEIGHTS collection, accumulate_gradients ------------------
def _model():
    return nn.Sequential([nn.Dense(48, dot_general_cls=lambda: Fp8DotGeneral(recipe=RECIPE)), Fp8MLP(64, recipe=RECIPE)])


def _train(model, variables, xs, ys, cache: bool, steps: int):
    """``steps`` optimizer steps, each over the micro-batches of xs / ys in lax.scan."""
    state = TrainState.create(apply_fn=model.apply, params=variables, tx=optax.adam(1e-2))

    @jax.jit
    def step(state):
        fp8_weights = quantize_weights(state.apply_fn, state.params, xs[0]) if cache else None

        def micro(total, batch):
            x, y = batch

            def loss_fn(params):
                v = params if fp8_weights is None else {**params, FP8_WEIGHTS: fp8_weights}
                return jnp.mean((state.apply_fn(v, x).astype(jnp.float32) - y) ** 2)

            loss, grads = jax.value_and_grad(loss_fn)(state.params)
            return accumulate_gradients(total, grads, 1 / len(xs)), loss

        total, losses = jax.lax.scan(micro, jax.tree.map(jnp.zeros_like, state.params), (xs, ys))
        return state.apply_gradients(grads=total), losses

    out = []
    for _ in range(steps):
        state, losses = step(state)
        out.append((np.asarray(losses), jax.tree.map(np.asarray, state.params)))
    return out


@pytest.mark.slow
def test_flax_gradient_accumulation_with_the_cache_gives_the_same_bytes(rng):
    model = _model()
    xs, ys = bf16(rng, (3, 32, 24)), jnp.asarray(rng.standard_normal((3, 32, 48)), jnp.float32)
    variables = jax.jit(model.init)(jax.random.key(0), xs[0])
    assert FP8_WEIGHTS not in variables  # init makes no cache
    plain, cached = _train(model, variables, xs, ys, False, 2), _train(model, variables, xs, ys, True, 2)
    for (lp, pp), (lc, pc) in zip(plain, cached):
        np.testing.assert_array_equal(lp, lc)
        assert_same_bytes(pp, pc)
    first = plain[0][1][OVERWRITE_WITH_GRADIENT]["layers_0"]["Fp8DotGeneral_0"]
    # step 1's new state: the micro-batches' input amaxes combined by max, the marker valid
    assert first["amax_history"][0, 0] == max(ref.amax(np.asarray(x)) for x in xs)
    np.testing.assert_array_equal(first["writes"], [1, 1, 1])
    last = plain[-1][1][OVERWRITE_WITH_GRADIENT]
    for st in (last["layers_0"]["Fp8DotGeneral_0"], last["layers_1"]["fc1"], last["layers_1"]["fc2"]):
        np.testing.assert_array_equal(st["updates"], [1, 1, 1])  # advanced once per optimizer step
    assert plain[-1][0].mean() < plain[0][0].mean()


def test_quantize_weights_fills_the_collection_and_the_forward_reads_it(rng):
    model = _model()
    x = bf16(rng, (32, 24))
    variables = jax.jit(model.init)(jax.random.key(0), x)
    cache = jax.jit(lambda v, x: quantize_weights(model.apply, v, x))(variables, x)
    shapes = jax.tree.map(lambda a: (a.shape, a.dtype.name), cache)
    assert shapes == {"layers_0": {"Fp8DotGeneral_0": {"data": ((24, 48), "float8_e4m3fn"),
                                                       "data_t": ((48, 24), "float8_e4m3fn"),
                                                       "amax": ((), "float32"), "scale_inv": ((1,), "float32")}},
                      "layers_1": {"fc1": {"data": ((48, 64), "float8_e4m3fn"), "data_t": ((64, 48), "float8_e4m3fn"),
                                           "amax": ((), "float32"), "scale_inv": ((1,), "float32")},
                                   "fc2": {"data": ((64, 48), "float8_e4m3fn"), "data_t": ((48, 64), "float8_e4m3fn"),
                                           "amax": ((), "float32"), "scale_inv": ((1,), "float32")}}}
    kernel = variables["params"]["layers_0"]["kernel"]
    want = F.quantize_weight(kernel, tuple(variables[OVERWRITE_WITH_GRADIENT]["layers_0"]["Fp8DotGeneral_0"][k]
                                           for k in JM.META_FIELDS), RECIPE)
    assert_same_bytes(dict(cache["layers_0"]["Fp8DotGeneral_0"]), {k: getattr(want, k) for k in cache["layers_0"]
                                                                    ["Fp8DotGeneral_0"]})
    # a cache passed in with the variables is not used by quantize_weights: it makes a new one
    stale = jax.tree.map(jnp.zeros_like, cache)
    again = jax.jit(lambda v, x: quantize_weights(model.apply, {**v, FP8_WEIGHTS: stale}, x))(variables, x)
    assert_same_bytes(again, cache)
    # the forward with the cache (read-only) counts one quantization fewer per linear
    fwd = lambda v, x: model.apply(v, x)  # noqa: E731
    with_cache = {**variables, FP8_WEIGHTS: cache}
    # (K = 24 is ragged: the first linear's operands are written padded, its weight as (32, 48),
    # the shape of the MLP's input h)
    assert quantizations(fwd, variables, x)[(32, 48)] == 2  # the first weight and h
    n = quantizations(fwd, with_cache, x)
    assert n[(32, 48)] == 1 and n[(24, 48)] == 0  # h only
    assert n[(48, 64)] == 0  # fc1's weight
    assert n[(32, 32)] == 1  # the input (32, 24), padded, still is
    assert quantize_weights(nn.Dense(4).apply, nn.Dense(4).init(jax.random.key(0), x), x) == {}  # no FP8 module


def test_accumulate_gradients_combines_the_states_where_a_sum_would_restart_them(rng):
    model = nn.Dense(48, dot_general_cls=lambda: Fp8DotGeneral(recipe=RECIPE))
    xs = bf16(rng, (2, 32, 24))
    variables = jax.jit(model.init)(jax.random.key(0), xs[0])
    grad = jax.jit(jax.grad(lambda v, x: model.apply(v, x).astype(jnp.float32).sum()))
    g0, g1 = grad(variables, xs[0]), grad(variables, xs[1])
    zeros = jax.tree.map(jnp.zeros_like, variables)
    total = accumulate_gradients(accumulate_gradients(zeros, g0, 0.5), g1, 0.5)
    np.testing.assert_array_equal(total["params"]["kernel"], 0.5 * g0["params"]["kernel"] + 0.5 * g1["params"]["kernel"])
    st, s0, s1 = (t[OVERWRITE_WITH_GRADIENT]["Fp8DotGeneral_0"] for t in (total, g0, g1))
    np.testing.assert_array_equal(st["amax_history"][0], np.maximum(s0["amax_history"][0], s1["amax_history"][0]))
    np.testing.assert_array_equal(st["writes"], [1, 1, 1])
    summed = jax.tree.map(jnp.add, g0, g1)[OVERWRITE_WITH_GRADIENT]["Fp8DotGeneral_0"]
    np.testing.assert_array_equal(summed["writes"], [2, 2, 2])  # what decode turns into a fresh state
    unused = jax.tree.map(jnp.zeros_like, g1)  # a micro-batch that did not reach the module adds nothing
    again = accumulate_gradients(total, unused)[OVERWRITE_WITH_GRADIENT]["Fp8DotGeneral_0"]
    assert_same_bytes(again, st)
