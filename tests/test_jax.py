"""fusedfp8.jax on the CPU (the jax.numpy backend): byte-exact against the reference, the state
machine inside jit over several steps, custom_vjp gradients, vmap, and the flax modules with
TrainState over several steps."""
import math

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import optax
import pytest
import flax.linen as nn
from flax.training.train_state import TrainState

import fusedfp8
from fusedfp8 import reference as ref
from fusedfp8.formats import E4M3, E5M2
from fusedfp8.jax import functional as F
from fusedfp8.jax import numerics as jn
from fusedfp8.jax import primitives as P
from fusedfp8.jax.flax import OVERWRITE_WITH_GRADIENT, Fp8DotGeneral, Fp8MLP
from fusedfp8.state import ScalingState, apply_update

f32 = np.float32
BF16 = np.dtype(ml_dtypes.bfloat16)
DTYPES = {"f32": np.dtype(np.float32), "bf16": BF16, "f16": np.dtype(np.float16)}
RECIPE = fusedfp8.DelayedScaling(amax_history_len=5)


def u8(a) -> np.ndarray:
    return np.asarray(a).view(np.uint8)


def special_values(rng) -> np.ndarray:
    """Random values over many binades, the fp8 boundaries, denormals and non-finite values."""
    e = rng.integers(-30, 20, 3000)
    v = rng.uniform(1, 2, 3000) * np.exp2(e) * rng.choice([-1.0, 1.0], 3000)
    special = [0.0, -0.0, np.inf, -np.inf, 448.0, 449.0, 464.0, 57344.0, 61440.0, 2.0 ** -9, 2.0 ** -10,
               1.5 * 2 ** -9, 2.0 ** -16, 2.0 ** -17, 1e-40, -1e-40, 3e38, -3e38, 1e30]
    return np.concatenate([v, special]).astype(np.float32)


# ---- numerics ----------------------------------------------------------------------------------
def test_fma_is_correctly_rounded(rng):
    n = 200_000
    # exponents over +-40 (results stay normal: XLA:CPU flushes denormal results)
    a = (rng.standard_normal(n) * np.exp2(rng.integers(-40, 40, n))).astype(f32)
    b = (rng.standard_normal(n) * np.exp2(rng.integers(-40, 40, n))).astype(f32)
    c_exact = (-(a.astype(np.float64) * b)).astype(f32)  # near-cancellation: the hard cases
    c_rand = (rng.standard_normal(n) * np.exp2(rng.integers(-60, 60, n))).astype(f32)
    fma = jax.jit(jn.fma_f32)
    for c in (c_rand, c_exact, np.nextafter(c_exact, f32(np.inf))):
        np.testing.assert_array_equal(u8(fma(a, b, c)), u8(ref.fma_f32(a, b, c)))


def test_plain_xla_would_not_match():
    """The hazards numerics.py guards against are real on this XLA: a * b + c is contracted."""
    rng = np.random.default_rng(0)
    a, b, c = (rng.standard_normal(10_000).astype(f32) for _ in range(3))
    naive = np.asarray(jax.jit(lambda a, b, c: a * b + c)(a, b, c))
    assert (naive != (a * b + c)).any()  # contracted into an fma (two roundings expected)
    assert np.asarray(jax.jit(lambda x: x * f32(2.0 ** 100))(np.float32(1e-40))) == 0  # denormals flushed


GRID = np.concatenate([np.linspace(-30, 30, 120_001, dtype=np.float32),
                       np.array([np.inf, -np.inf, np.nan, 0.0, -0.0, 1e30, -1e30, 3e38, -3e38], np.float32)])
# the documented gap: where the reference's erf intermediates are denormal (gradual underflow),
# XLA:CPU flushes them
ERF_DENORMAL = (GRID > -13.25) & (GRID < -12.9)


@pytest.mark.parametrize("approximate", ["tanh", "none"])
def test_activations_match_reference(approximate):
    keep = ~ERF_DENORMAL if approximate == "none" else np.ones(GRID.shape, bool)
    g = np.asarray(jax.jit(lambda x: jn.gelu_f32(x, approximate))(GRID))
    d = np.asarray(jax.jit(lambda x: jn.dgelu_f32(x, approximate))(GRID))
    np.testing.assert_array_equal(u8(g)[np.repeat(keep, 4)], u8(ref.gelu_f32(GRID, approximate))[np.repeat(keep, 4)])
    np.testing.assert_array_equal(u8(d)[np.repeat(keep, 4)], u8(ref.dgelu_f32(GRID, approximate))[np.repeat(keep, 4)])


@pytest.mark.parametrize("fmt", [E4M3, E5M2], ids=["e4m3", "e5m2"])
def test_cast_matches_reference(fmt, rng):
    v = special_values(rng)
    v = np.concatenate([v, np.nextafter(v, f32(np.inf)), np.nextafter(v, f32(-np.inf)), [np.nan, -np.nan]]).astype(f32)
    v = v[np.abs(v) >= 2.0 ** -126]  # denormal *products* are flushed, and are fp8 zero anyway
    np.testing.assert_array_equal(np.asarray(jax.jit(lambda v: jn.cast_to_fp8(v, fmt))(v)),
                                  u8(ref.cast_to_fp8(v, fmt)))


def test_amax_is_exact_with_denormals_and_nan():
    x = np.array([1e-40, -3e-39, 0.0], f32)
    assert jn.amax(x) == f32(3e-39)
    assert np.isnan(jn.amax(np.array([1.0, np.nan, np.inf], f32)))
    assert jn.amax(np.array([1.0, -np.inf], f32)) == np.inf
    assert jn.amax(np.zeros((0, 4), f32)) == 0


# ---- primitives: byte-exact against the reference (fresh state, current first step) ------------
def fresh(like=jnp.zeros(1), grad=(False, False, True)):
    return ScalingState.create(grad, RECIPE, like=like)


def ref_current(y, fmt):
    a = ref.amax(y)
    return ref.current_scale(a, fmt, RECIPE.margin_factor, f32(1.0))


SHAPES = {"aligned-64x128": (64, 128), "ragged-33x17": (33, 17), "ragged-1x1": (1, 1), "ragged-0x16": (0, 16),
          "ragged-3d-3x5x7": (3, 5, 7)}


@pytest.mark.parametrize("shape", list(SHAPES.values()), ids=list(SHAPES))
@pytest.mark.parametrize("dtype", list(DTYPES.values()), ids=list(DTYPES))
def test_quantize_first_step_matches_reference(shape, dtype, rng):
    x = (rng.standard_normal(shape) * 3).astype(f32).astype(dtype)
    st = fresh()
    r, new = jax.jit(lambda x, s: P.quantize(x, s, 0, RECIPE, transpose=True))(jnp.asarray(x), st)
    s = ref_current(x, E4M3)
    want = ref.quantize(x, s, E4M3, transpose=True)
    np.testing.assert_array_equal(u8(r.data), u8(want.data))
    np.testing.assert_array_equal(u8(r.data_t), u8(want.data_t))
    assert r.data.dtype == jnp.float8_e4m3fn and r.data_t.shape == (shape[-1], math.prod(shape[:-1]))
    assert np.asarray(new.amax_history)[0, 0] == ref.amax(x) and np.asarray(new.scale)[0] == s
    assert np.asarray(r.scale_inv)[0] == f32(1.0) / s and np.asarray(new.scale_inv)[0] == f32(1.0) / s
    assert (np.asarray(new.amax_history)[:, 1:] == 0).all() and (np.asarray(new.scale)[1:] == 1).all()


@pytest.mark.parametrize("fmt", [E4M3, E5M2], ids=["e4m3", "e5m2"])
def test_quantize_special_values_with_a_set_scale(fmt, rng):
    """Delayed scaling (updates > 0: the state's scale is used), values over every binade,
    denormal inputs (a scale of FLT_MAX makes them normal FP8 values) and non-finite inputs."""
    for scale in (f32(3.0), f32(np.finfo(f32).max), f32(2.0 ** -3)):
        x = special_values(rng)
        st = fresh(grad=(fmt is E5M2,)).replace(scale=jnp.asarray([scale]), updates=jnp.ones(1, jnp.int32))
        r, new = P.quantize(jnp.asarray(x), st, 0, RECIPE)
        np.testing.assert_array_equal(u8(r.data), u8(ref.quantize(x, scale, fmt).data))
        assert np.isnan(np.asarray(new.amax_history)[0, 0]) == np.isnan(ref.amax(x))
    tiny = np.array([1e-40, -2e-39, 3e-45], f32)  # all denormal: current scaling gives FLT_MAX
    r, new = P.quantize(jnp.asarray(tiny), fresh(grad=(fmt is E5M2,)), 0, RECIPE)
    s = ref_current(tiny, fmt)
    assert s == np.finfo(f32).max and np.asarray(new.scale)[0] == s
    np.testing.assert_array_equal(u8(r.data), u8(ref.quantize(tiny, s, fmt).data))
    assert u8(r.data).any()


@pytest.mark.parametrize("approximate, dtype", [("tanh", BF16), ("none", np.dtype(np.float32))],
                         ids=["tanh-bf16", "none-f32"])
def test_gelu_and_dgelu_quantize_match_reference(approximate, dtype, rng):
    shape = (67, 48)
    x = (rng.standard_normal(shape) * 4).astype(f32).astype(dtype)
    dy = (rng.standard_normal(shape) * 1e-3).astype(f32).astype(dtype)
    st = fresh(grad=(False, True))
    fn = jax.jit(lambda x, dy, s: (P.gelu_quantize(x, s, 0, RECIPE, approximate=approximate, transpose=True)[0],
                                   P.dgelu_quantize(dy, x, s, 1, RECIPE, approximate=approximate, transpose=True,
                                                    dbias=True)[0]))
    rg, rd = fn(jnp.asarray(x), jnp.asarray(dy), st)
    y = ref.gelu_f32(x.astype(f32), approximate)
    want = ref.gelu_quantize(x, ref_current(y, E4M3), E4M3, approximate, transpose=True)
    np.testing.assert_array_equal(u8(rg.data), u8(want.data))
    np.testing.assert_array_equal(u8(rg.data_t), u8(want.data_t))
    dx = dy.astype(f32) * ref.dgelu_f32(x.astype(f32), approximate)
    want = ref.dgelu_quantize(dy, x, ref_current(dx, E5M2), E5M2, approximate, transpose=True, dbias=True)
    assert rd.data.dtype == jnp.float8_e5m2
    np.testing.assert_array_equal(u8(rd.data), u8(want.data))
    np.testing.assert_array_equal(u8(rd.data_t), u8(want.data_t))
    np.testing.assert_allclose(np.asarray(rd.dbias), want.dbias, rtol=1e-5, atol=1e-9)


def test_bad_arguments_are_refused_by_name():
    st = fresh()
    with pytest.raises(TypeError, match="x must be float32, float16 or bfloat16; got int32"):
        P.quantize(jnp.ones(3, jnp.int32), st, 0, RECIPE)
    with pytest.raises(IndexError, match=r"index must be in \[0, 3\); got 3"):
        P.quantize(jnp.ones(3), st, 3, RECIPE)
    with pytest.raises(ValueError, match="impl must be one of"):
        P.quantize(jnp.ones(3), st, 0, RECIPE, impl="cuda")
    with pytest.raises(ValueError, match="amax_history_len is 7"):
        P.quantize(jnp.ones(3), st, 0, fusedfp8.DelayedScaling(amax_history_len=7))
    with pytest.raises(ValueError, match="approximate must be 'tanh' or 'none'; got 'erf'"):
        P.gelu_quantize(jnp.ones(3), st, 0, RECIPE, approximate="erf")


def test_vmap_quantizes_each_example_on_its_own(rng):
    x = rng.standard_normal((4, 8, 16)).astype(f32) * np.array([1, 10, 100, 1000], f32)[:, None, None]
    st = fresh()
    r, new = jax.vmap(lambda x: P.quantize(x, st, 0, RECIPE, transpose=True))(jnp.asarray(x))
    for i in range(4):
        s = ref_current(x[i], E4M3)
        np.testing.assert_array_equal(u8(r.data[i]), u8(ref.quantize(x[i], s, E4M3).data))
        assert np.asarray(new.amax_history)[i, 0, 0] == ref.amax(x[i])


# ---- the state machine inside jit over several steps ----------------------------------------------
@pytest.mark.parametrize("algo", ["max", "most_recent"])
def test_state_machine_in_jit_replays_the_reference(algo, rng):
    recipe = fusedfp8.DelayedScaling(amax_history_len=3, amax_compute_algo=algo, margin=1)
    grad = (False, True)
    st = ScalingState.create(grad, recipe, like=jnp.zeros(1))
    want = ScalingState.create(grad, recipe)
    host_fresh = np.ones(2, bool)

    @jax.jit
    def step(st, x, g, run_g):
        r0, st = P.quantize(x, st, 0, recipe)
        r1, st2 = P.quantize(g, st, 1, recipe)
        st = jax.tree.map(lambda a, b: jnp.where(run_g, a, b), st2, st)
        return P.update_scales(st, recipe), r0.data, r1.data

    scales = []
    for i in range(7):
        x = (rng.standard_normal(64) * 2.0 ** (i - 3)).astype(f32)
        g = (rng.standard_normal(64) * 1e-4).astype(f32)
        if i == 4:
            x[3] = np.nan  # an overflow: counted, scale kept, no roll
        run_g = i not in (1, 2)  # steps where the gradient tensor did not run
        st, q0, q1 = step(st, jnp.asarray(x), jnp.asarray(g), run_g)
        for idx, v, ran, q in ((0, x, True, q0), (1, g, run_g, q1)):
            if not ran:
                continue
            fmt = recipe.format_for(grad[idx])
            a = ref.amax(v)
            s = want.scale[idx]
            if host_fresh[idx] and want.updates[idx] == 0:
                s = ref.current_scale(a, fmt, recipe.margin_factor, s)
                want.scale[idx], want.scale_inv[idx] = s, f32(1.0) / s
            want.amax_history[0, idx] = a
            np.testing.assert_array_equal(u8(q), u8(ref.quantize(v, s, fmt).data))
        apply_update(want, recipe)
        for name in ("amax_history", "scale", "scale_inv", "overflows", "updates"):
            np.testing.assert_array_equal(np.asarray(getattr(st, name)), getattr(want, name), err_msg=f"{name} step {i}")
        scales.append(np.asarray(st.scale).copy())
    assert np.asarray(st.overflows)[0] == 1 and np.asarray(st.updates)[1] == 5
    assert len({s[0] for s in scales}) > 3  # the scale really moved from step to step


# ---- custom_vjp gradients ---------------------------------------------------------------------------
def test_quantize_ste_gradient_is_the_identity(rng):
    x = jnp.asarray(rng.standard_normal((8, 16)).astype(f32))
    st = fresh()
    y, new = F.quantize_ste(x, st, 0, RECIPE)
    s = ref_current(np.asarray(x), E4M3)
    q = ref.quantize(np.asarray(x), s, E4M3).data
    np.testing.assert_array_equal(np.asarray(y), ref.dequantize(q, np.array([f32(1.0) / s])))
    w = jnp.asarray(rng.standard_normal((8, 16)).astype(f32))
    grad = jax.grad(lambda x: jnp.sum(F.quantize_ste(x, st, 0, RECIPE)[0] * w))(x)
    np.testing.assert_array_equal(np.asarray(grad), np.asarray(w))


def fp8_values(a, fmt):
    """The float32 values an FP8 quantization with current scaling gives, and the scale_inv."""
    s = ref_current(a, fmt)
    return ref.quantize(a, s, fmt).data.astype(f32), f32(1.0) / s


def test_fp8_dot_forward_and_gradients(rng):
    M, K, N = 32, 48, 24
    x = rng.standard_normal((M, K)).astype(f32)
    w = (rng.standard_normal((K, N)) / 7).astype(f32)
    g = (rng.standard_normal((M, N)) * 1e-3).astype(f32)
    meta = F.fresh_meta(RECIPE)
    y, vjp = jax.vjp(lambda x, w, m: F.fp8_dot(x, w, m, RECIPE), jnp.asarray(x), jnp.asarray(w), meta)
    dx, dw, new_meta = vjp(jnp.asarray(g))
    xq, sx = fp8_values(x, E4M3)
    wq, sw = fp8_values(w, E4M3)
    gq, sg = fp8_values(g, E5M2)
    np.testing.assert_allclose(np.asarray(y), (xq @ wq) * (sx * sw), rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(np.asarray(dx), (gq @ wq.T) * (sg * sw), rtol=1e-5, atol=1e-9)
    np.testing.assert_allclose(np.asarray(dw), (xq.T @ gq) * (sx * sg), rtol=1e-5, atol=1e-9)
    # the VJP w.r.t. the meta is the new meta: the three amaxes staged, first-step scales set
    hist, scale, scale_inv, overflows, updates = (np.asarray(m) for m in new_meta)
    np.testing.assert_array_equal(hist[0], [ref.amax(x), ref.amax(w), ref.amax(g)])
    np.testing.assert_array_equal(scale_inv, [sx, sw, sg])
    assert (hist[1:] == 0).all() and (updates == 0).all()
    # and the bf16 product is close to the exact one
    exact = x @ w
    assert np.linalg.norm(np.asarray(y) - exact) / np.linalg.norm(exact) < 0.08


def test_fp8_mlp_matches_the_unfused_composition(rng):
    M, H, Fw = 16, 32, 48
    h = jnp.asarray(rng.standard_normal((M, H)).astype(f32))
    w1 = jnp.asarray((rng.standard_normal((H, Fw)) / 6).astype(f32))
    w2 = jnp.asarray((rng.standard_normal((Fw, H)) / 7).astype(f32))
    b1, b2 = jnp.asarray(rng.standard_normal(Fw).astype(f32) / 10), jnp.asarray(rng.standard_normal(H).astype(f32))
    m1, m2 = F.fresh_meta(RECIPE), F.fresh_meta(RECIPE)

    def loss(h, w1, b1, w2, b2, m1, m2):
        return jnp.sum(F.fp8_mlp(h, w1, b1, w2, b2, m1, m2, RECIPE) ** 2)

    grads = jax.jit(jax.grad(loss, argnums=tuple(range(7))))(h, w1, b1, w2, b2, m1, m2)

    def exact(h, w1, b1, w2, b2):
        return jnp.sum((jax.nn.gelu(h @ w1 + b1, approximate=True) @ w2 + b2) ** 2)

    want = jax.grad(exact, argnums=tuple(range(5)))(h, w1, b1, w2, b2)
    for name, got, w in zip(("dh", "dw1", "db1", "dw2", "db2"), grads[:5], want):
        err = np.linalg.norm(np.asarray(got) - np.asarray(w)) / np.linalg.norm(np.asarray(w))
        assert err < 0.15, (name, err)
    hist1, hist2 = np.asarray(grads[5][0]), np.asarray(grads[6][0])
    assert (hist1[0] > 0).all() and (hist2[0] > 0).all()  # all six tensors staged an amax
    z = np.asarray(h @ w1 + b1)  # fc2's input amax is of gelu(z) (up to the FP8 GEMM's error)
    assert abs(hist2[0, 0] / np.abs(np.asarray(jax.nn.gelu(z, approximate=True))).max() - 1) < 0.1


# ---- flax ------------------------------------------------------------------------------------------
def train(model, x, y, steps):
    variables = model.init(jax.random.key(0), x)
    state = TrainState.create(apply_fn=model.apply, params=variables, tx=optax.adam(1e-2))

    @jax.jit
    def step(state):
        def loss_fn(p):
            return jnp.mean((state.apply_fn(p, x).astype(jnp.float32) - y) ** 2)

        loss, grads = jax.value_and_grad(loss_fn)(state.params)
        return state.apply_gradients(grads=grads), loss

    history = []
    for _ in range(steps):
        state, loss = step(state)
        history.append((float(loss), jax.tree.map(np.asarray, state.params[OVERWRITE_WITH_GRADIENT])))
    return state, history


def test_flax_dense_train_state_updates_the_fp8_state(rng):
    recipe = fusedfp8.DelayedScaling(amax_history_len=3, amax_compute_algo="most_recent")
    x = jnp.asarray(rng.standard_normal((16, 24)).astype(f32)).astype(jnp.bfloat16)
    y = jnp.asarray(rng.standard_normal((16, 8)).astype(f32))
    model = nn.Dense(8, dot_general_cls=lambda: Fp8DotGeneral(recipe=recipe), param_dtype=jnp.bfloat16)
    state, hist = train(model, x, y, 6)
    metas = [h[1]["Fp8DotGeneral_0"] for h in hist]
    # step 0 staged three amaxes with current scaling; each later forward first rolled them in
    np.testing.assert_array_equal(metas[0]["updates"], [0, 0, 0])
    for i in range(1, 6):
        np.testing.assert_array_equal(metas[i]["updates"], [i, i, i])
        np.testing.assert_array_equal(metas[i]["amax_history"][-1], metas[i - 1]["amax_history"][0])  # rolled
        np.testing.assert_array_equal(metas[i]["scale_inv"], np.float32(1) / metas[i]["scale"])
    assert metas[0]["amax_history"][0, 0] == ref.amax(np.asarray(x))
    assert len({float(m["scale"][1]) for m in metas}) >= 3  # the weight changes, so does its scale
    assert hist[-1][0] < hist[0][0]


def test_flax_dense_rejects_batch_dims():
    with pytest.raises(ValueError, match="Fp8DotGeneral supports lhs contracting its trailing"):
        Fp8DotGeneral().init(jax.random.key(0), jnp.ones((2, 4, 8)), jnp.ones((2, 8, 3)),
                             (((2,), (1,)), ((0,), (0,))))


def test_flax_mlp_trains_and_matches_the_bf16_layout(rng):
    recipe = fusedfp8.DelayedScaling(amax_history_len=4)
    x = jnp.asarray(rng.standard_normal((32, 16)).astype(f32))
    y = jnp.asarray(np.tanh(rng.standard_normal((32, 16))).astype(f32))
    model = Fp8MLP(32, recipe=recipe)
    ref_model = nn.Sequential([nn.LayerNorm(name="norm"), nn.Dense(32, name="fc1"),
                               lambda z: nn.gelu(z, approximate=True), nn.Dense(16, name="fc2")])
    variables = model.init(jax.random.key(0), x)
    ref_vars = {"params": {f"layers_{i}": variables["params"][n] for i, n in ((0, "norm"), (1, "fc1"), (3, "fc2"))}}
    out, want = model.apply(variables, x), ref_model.apply(ref_vars, x)
    assert np.linalg.norm(np.asarray(out) - np.asarray(want)) / np.linalg.norm(np.asarray(want)) < 0.1
    state, hist = train(model, x, y, 8)
    assert hist[-1][0] < 0.8 * hist[0][0]
    last = hist[-1][1]
    for layer in ("fc1", "fc2"):
        np.testing.assert_array_equal(last[layer]["updates"], [7, 7, 7])
        assert (last[layer]["amax_history"] > 0).all()  # the history filled and rolled


def test_div_rn_is_ieee_division():
    """numerics.div_rn is NumPy's float32 division bit for bit (XLA:GPU's `/` is not; XLA:CPU
    flushes denormal quotients): random bit patterns, denormals, specials, the scale rule's
    fmt_max / amax and 1 / scale."""
    rng = np.random.default_rng(7)
    n = 200_000
    a = rng.integers(0, 2**32, n, dtype=np.uint64).astype(np.uint32).view(f32)
    b = rng.integers(0, 2**32, n, dtype=np.uint64).astype(np.uint32).view(f32)
    edge = np.array([0, -0.0, np.inf, -np.inf, np.nan, 1e-45, -1e-45, 1.1754942e-38, 1.1754944e-38,
                     3.4028235e38, 1, 2, 3, 448, 57344, 0.5, 3163.3286, 4.6875, 0.9375], f32)
    ea, eb = (v.ravel() for v in np.meshgrid(edge, edge))
    denormal = rng.integers(1, 2**23, 20_000).astype(np.uint32).view(f32)
    normal = rng.standard_normal(20_000).astype(f32)
    a = np.concatenate([a, ea, np.full(20_000, 448, f32), np.ones(20_000, f32), denormal, normal])
    b = np.concatenate([b, eb, denormal, normal * f32(1e36), normal, denormal])
    got = np.asarray(jax.jit(jn.div_rn)(a, b))
    with np.errstate(all="ignore"):
        want = a / b
    both_nan = np.isnan(got) & np.isnan(want)
    assert np.array_equal(got.view(np.uint32)[~both_nan], want.view(np.uint32)[~both_nan])
    assert np.array_equal(np.isnan(got), np.isnan(want))
    # the denormal quotients that XLA:CPU's own division flushes are kept
    tiny = np.asarray(jax.jit(jn.div_rn)(f32(1.0), f32(3.4028235e38)))
    assert tiny == f32(1.0) / f32(3.4028235e38) and tiny > 0
