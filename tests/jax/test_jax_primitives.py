"""fusedfp8.jax on the CPU (the jax.numpy backend): the traceable primitives byte-exact against
the reference (a fresh state's current first step, a set scale, special values, the activations),
the state machine inside jit over several steps, vmap, and the custom_vjp gradients of
quantize_ste, fp8_dot and fp8_mlp. The GPU kernel path against this one is test_jax_kernels.py."""
import logging
import math
import re

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest

import fusedfp8
from fusedfp8.formats import E4M3, E5M2
from fusedfp8.jax import functional as F
from fusedfp8.jax import meta as JM
from fusedfp8.jax import layernorm as JLN
from fusedfp8.jax import primitives as P
from fusedfp8.numerics import jnp_gelu as jg
from fusedfp8.numerics import layernorm as ln_ref
from fusedfp8.numerics import reference as ref
from fusedfp8.state import ScalingState, apply_update
from support import hlo
from support import shapes as S

f32 = np.float32
BF16 = np.dtype(ml_dtypes.bfloat16)
DTYPES = {"f32": np.dtype(np.float32), "bf16": BF16, "f16": np.dtype(np.float16)}
RECIPE = fusedfp8.DelayedScaling(amax_history_len=5)


def u8(a) -> np.ndarray:
    return np.asarray(a).view(np.uint8)


def test_the_face_of_fusedfp8_jax():
    import fusedfp8.jax as fj

    assert sorted(fj.__all__) == sorted(["update_scales", "sync_staged", "fp8_dot", "block_dot", "fp8_mlp", "block_mlp",
                                         "quantize_weight", "quantize_ste", "IMPLS"])
    assert fj.fp8_dot is F.fp8_dot and fj.update_scales is P.update_scales and fj.IMPLS == P.IMPLS
    for name in ("quantize", "gelu_quantize", "dgelu_quantize", "dequantize"):  # in primitives
        assert not hasattr(fj, name) and callable(getattr(P, name))
    assert not hasattr(fj, "layernorm_quantize") and callable(JLN.layernorm_quantize)  # fusedfp8.jax.layernorm


# ---- primitives: byte-exact against the reference (fresh state, current first step) ------------
def fresh(like=jnp.zeros(1), grad=(False, False, True)):
    return ScalingState.create(grad, RECIPE, like=like)


def ref_current(y, fmt):
    a = ref.amax(y)
    return ref.current_scale(a, fmt, RECIPE.margin_factor, f32(1.0))


@pytest.mark.parametrize("shape", S.params(*S.SMALL_SET))
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
        x = S.special_values(rng)
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


# ---- layernorm_quantize -------------------------------------------------------------------------
LN_CASES = {  # id: (shape, input dtype, param dtype or None, eps, pad_to)
    "64x128-bf16-f32params": ((64, 128), "bf16", "f32", 1e-5, 1),
    "33x17-f32-pad16": ((33, 17), "f32", "f32", 1e-6, 16),
    "3x5x7-f16-no-params-pad16": ((3, 5, 7), "f16", None, 1e-2, 16),
    "1x1-bf16-bf16params": ((1, 1), "bf16", "bf16", 1e-5, 1),
    "0x16-f32": ((0, 16), "f32", "f32", 1e-5, 16),
}


def ln_inputs(case, rng):
    shape, dtype, pdtype, eps, pad_to = LN_CASES[case]
    x = (rng.standard_normal(shape) * 3 + 1).astype(f32).astype(DTYPES[dtype])
    if x.size > 8:
        x.reshape(-1, shape[-1])[1, 0] = np.nan  # one NaN row: mean, rstd NaN, the amax NaN
    w = b = None
    if pdtype:
        w = (rng.standard_normal(shape[-1]) + 1).astype(f32).astype(DTYPES[pdtype])
        b = (rng.standard_normal(shape[-1]) / 4).astype(f32).astype(DTYPES[pdtype])
    return x, w, b, eps, pad_to


def assert_ln_matches_reference(r, new, x, w, b, eps, pad_to, s, fmt, index):
    """The primitive's LayerNormQuantized and state against the reference quantizing with scale ``s``."""
    want, wmean, wrstd = ln_ref.layernorm_quantize(x, w, b, eps, s, fmt, transpose=True, pad_to=pad_to)
    q = r.quantized
    assert q.data.dtype == jnp.dtype(fmt.dtype_name) and q.data.shape == want.data.shape
    assert u8(q.data).tobytes() == u8(want.data).tobytes()
    assert u8(q.data_t).tobytes() == u8(want.data_t).tobytes()
    assert np.asarray(r.mean).tobytes() == wmean.tobytes() and np.asarray(r.rstd).tobytes() == wrstd.tobytes()
    assert np.asarray(q.scale_inv).tobytes() == np.array([f32(1.0) / s], f32).tobytes()
    assert np.asarray(q.amax).tobytes() == np.asarray(new.amax_history)[0, index].tobytes()
    return want


@pytest.mark.parametrize("case", list(LN_CASES))
def test_layernorm_quantize_matches_reference(case, rng):
    """The jax.numpy impl under jit byte for byte against fusedfp8.numerics.layernorm: a fresh
    state (the first step's current scale of amax(y)), then delayed scaling (a set scale and a
    staged amax to accumulate into); padded and plain shapes, with and without parameters."""
    x, w, b, eps, pad_to = ln_inputs(case, rng)
    fn = jax.jit(lambda x, w, b, s: JLN.layernorm_quantize(x, w, b, eps, s, 0, RECIPE, transpose=True, pad_to=pad_to,
                                                         impl="jnp"))
    y, _, _ = ln_ref.layernorm_f32(x, w, b, eps)
    a = ref.amax(y)
    st = fresh()
    r, new = fn(x, w, b, st)
    s = ref.current_scale(a, E4M3, RECIPE.margin_factor, f32(1.0)) if x.size else f32(1.0)
    assert_ln_matches_reference(r, new, x, w, b, eps, pad_to, s, E4M3, 0)
    assert np.asarray(new.amax_history)[0, 0].tobytes() == np.float32(a).tobytes()
    assert np.asarray(new.scale)[0] == s and np.asarray(new.scale_inv)[0] == f32(1.0) / s
    # delayed scaling: the state's scale, the amax max-accumulated into the staged slot
    st = fresh().replace(scale=jnp.asarray([0.75, 1, 1], jnp.float32), updates=jnp.ones(3, jnp.int32),
                         amax_history=jnp.zeros((5, 3), jnp.float32).at[0, 0].set(2.5))
    # placed on the device as fresh() places its arrays: an argument committed in one call and not
    # in the other makes jit compile the function again
    r, new = fn(x, w, b, jax.device_put(st, jax.devices("cpu")[0]))
    assert_ln_matches_reference(r, new, x, w, b, eps, pad_to, f32(0.75), E4M3, 0)
    staged = np.asarray(new.amax_history)[0, 0]
    assert (np.isnan(staged) and np.isnan(a)) or staged == max(f32(2.5), a)
    assert (np.asarray(new.scale) == [0.75, 1, 1]).all() and (np.asarray(new.updates) == 1).all()


def test_layernorm_quantize_eager_and_gradient_slot(rng):
    """Outside jit it is one compiled program and gives the jitted bytes; the gradient slot of a
    'hybrid' recipe quantizes to E5M2; without transpose no data_t; q keeps x's shape."""
    x, w, b, eps, _ = ln_inputs("64x128-bf16-f32params", rng)
    x, w, b = jnp.asarray(x), jnp.asarray(w), jnp.asarray(b)
    st = fresh()
    eager = []
    assert compiled_programs(lambda: eager.append(JLN.layernorm_quantize(x, w, b, eps, st, 2, RECIPE)) or eager[0]) == [
        "jit(_run_layernorm)"]
    r, new = eager[0]
    rj, newj = jax.jit(lambda x, s: JLN.layernorm_quantize(x, w, b, eps, s, 2, RECIPE))(x, st)
    for a, c in zip(jax.tree.leaves((r, new)), jax.tree.leaves((rj, newj)), strict=True):
        assert np.asarray(a).tobytes() == np.asarray(c).tobytes()
    assert r.quantized.data.dtype == jnp.float8_e5m2 and r.quantized.data_t is None and r.quantized.data.shape == x.shape
    y, _, _ = ln_ref.layernorm_f32(np.asarray(x), np.asarray(w), np.asarray(b), eps)
    s = ref.current_scale(ref.amax(y), E5M2, RECIPE.margin_factor, f32(1.0))
    want = ln_ref.layernorm_quantize(np.asarray(x), np.asarray(w), np.asarray(b), eps, s, E5M2)[0]
    assert u8(r.quantized.data).tobytes() == u8(want.data).tobytes()


def test_layernorm_quantize_refuses_bad_arguments_by_name():
    st, x = fresh(), jnp.ones((4, 8))
    cases = [
        (lambda: JLN.layernorm_quantize(jnp.ones(()), None, None, 1e-5, st, 0, RECIPE), ValueError,
         "x: layernorm_quantize needs an input of at least 1 dimension; got a scalar"),
        (lambda: JLN.layernorm_quantize(jnp.ones((4, 0)), None, None, 1e-5, st, 0, RECIPE), ValueError,
         r"x: layernorm_quantize normalises over the last dimension, which must not be empty; got shape \(4, 0\)"),
        (lambda: JLN.layernorm_quantize(x.astype(jnp.int32), None, None, 1e-5, st, 0, RECIPE), TypeError,
         "x must be float32, float16 or bfloat16; got int32"),
        (lambda: JLN.layernorm_quantize(x, jnp.ones(7), None, 1e-5, st, 0, RECIPE), ValueError,
         r"weight must have shape \(8,\) \(the last dimension of x\); got \(7,\)"),
        (lambda: JLN.layernorm_quantize(x, None, jnp.ones(8, jnp.int8), 1e-5, st, 0, RECIPE), TypeError,
         "bias must be float32, float16 or bfloat16; got int8"),
        (lambda: JLN.layernorm_quantize(x, jnp.ones(8), jnp.ones(8, jnp.bfloat16), 1e-5, st, 0, RECIPE), TypeError,
         "weight and bias must have the same dtype; got float32 and bfloat16"),
        (lambda: JLN.layernorm_quantize(x, None, None, -1.0, st, 0, RECIPE), ValueError,
         r"eps must be a finite number >= 0 \(and finite as float32\); got -1.0"),
        (lambda: JLN.layernorm_quantize(x, None, None, jnp.float32(1e-5), st, 0, RECIPE), TypeError,
         "eps must be a real number"),
        (lambda: JLN.layernorm_quantize(x, None, None, 1e-5, st, 0, RECIPE, pad_to=0), ValueError,
         "pad_to must be a positive int"),
        (lambda: JLN.layernorm_quantize(x, None, None, 1e-5, st, 3, RECIPE), IndexError,
         r"index must be in \[0, 3\); got 3"),
        (lambda: JLN.layernorm_quantize(x, None, None, 1e-5, st, 0, RECIPE, impl="cuda"), ValueError,
         "impl must be one of"),
    ]
    for call, exc, message in cases:
        with pytest.raises(exc, match=message):
            call()


def test_vmap_quantizes_each_example_on_its_own(rng):
    x = rng.standard_normal((4, 8, 16)).astype(f32) * np.array([1, 10, 100, 1000], f32)[:, None, None]
    st = fresh()
    compiled = jax.jit(jax.vmap(lambda x: P.quantize(x, st, 0, RECIPE, transpose=True))).lower(x).compile()
    assert not hlo.xors_with_zero(compiled.as_text())  # the hiding zero stays hidden under vmap
    r, new = compiled(jnp.asarray(x))
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
            if want.updates[idx] == 0:  # its first step: current scaling, decided per tensor
                s = ref.current_scale(a, fmt, recipe.margin_factor, s)
                want.scale[idx], want.scale_inv[idx] = s, f32(1.0) / s
            want.amax_history[0, idx] = a
            np.testing.assert_array_equal(u8(q), u8(ref.quantize(v, s, fmt).data))
        apply_update(want, recipe)
        for name in ("amax_history", "scale", "scale_inv", "overflows", "updates"):
            np.testing.assert_array_equal(np.asarray(getattr(st, name)), getattr(want, name),
                                          err_msg=f"{name} step {i}")
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
    meta = JM.fresh_meta(RECIPE)

    @jax.jit  # (one compile; op by op, the emulated numerics dispatch thousands of small programs)
    def forward_and_vjp(x, w, meta, g):
        y, vjp = jax.vjp(lambda x, w, m: F.fp8_dot(x, w, m, RECIPE), x, w, meta)
        return y, vjp(g)

    y, (dx, dw, new_meta) = forward_and_vjp(jnp.asarray(x), jnp.asarray(w), meta, jnp.asarray(g))
    xq, sx = fp8_values(x, E4M3)
    wq, sw = fp8_values(w, E4M3)
    gq, sg = fp8_values(g, E5M2)
    np.testing.assert_allclose(np.asarray(y), (xq @ wq) * (sx * sw), rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(np.asarray(dx), (gq @ wq.T) * (sg * sw), rtol=1e-5, atol=1e-9)
    np.testing.assert_allclose(np.asarray(dw), (xq.T @ gq) * (sx * sg), rtol=1e-5, atol=1e-9)
    # the VJP w.r.t. the meta is the new meta: the three amaxes staged, first-step scales set
    new = dict(zip(JM.META_FIELDS, (np.asarray(m) for m in new_meta)))
    np.testing.assert_array_equal(new["amax_history"][0], [ref.amax(x), ref.amax(w), ref.amax(g)])
    np.testing.assert_array_equal(new["scale_inv"], [sx, sw, sg])
    assert (new["amax_history"][1:] == 0).all() and (new["updates"] == 0).all()
    assert len(new_meta) == len(JM.META_FIELDS) and (new.get("writes", np.ones(3)) == 1).all()
    # and the bf16 product is close to the exact one
    exact = x @ w
    assert np.linalg.norm(np.asarray(y) - exact) / np.linalg.norm(exact) < 0.08


@pytest.mark.slow
def test_fp8_mlp_matches_the_unfused_composition(rng):
    M, H, Fw = 16, 32, 48
    h = jnp.asarray(rng.standard_normal((M, H)).astype(f32))
    w1 = jnp.asarray((rng.standard_normal((H, Fw)) / 6).astype(f32))
    w2 = jnp.asarray((rng.standard_normal((Fw, H)) / 7).astype(f32))
    b1, b2 = jnp.asarray(rng.standard_normal(Fw).astype(f32) / 10), jnp.asarray(rng.standard_normal(H).astype(f32))
    m1, m2 = JM.fresh_meta(RECIPE), JM.fresh_meta(RECIPE)

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


def layernorm_f32(x, w, b, eps):
    """LayerNorm in plain float32 jax ops (flax's and torch's formula, not the kernel's op order)."""
    xf = x.astype(jnp.float32)
    mu = xf.mean(-1, keepdims=True)
    y = (xf - mu) * jax.lax.rsqrt(((xf - mu) ** 2).mean(-1, keepdims=True) + eps)
    y = y * w.astype(jnp.float32) if w is not None else y
    return y + b.astype(jnp.float32) if b is not None else y


def test_layernorm_backward_column_sums_in_two_stages_equal_the_sums(rng):
    """fp8_mlp's LayerNorm backward sums columns in two stages (partials over 128 rows): the sums of
    float64 within float32 rounding for one row, exactly 128, one more (a padded last block) and a
    ragged count; no array, no sum."""
    from fusedfp8.jax.layernorm import column_sums as _column_sums
    for m in (1, 128, 129, 2044):
        a = rng.standard_normal((m, 24)).astype(f32)
        b = (rng.standard_normal((m, 24)) * 100 + 3).astype(f32)
        sa, sb = jax.jit(_column_sums)(jnp.asarray(a), jnp.asarray(b))
        for got, x in ((sa, a), (sb, b)):
            want = x.astype(np.float64).sum(0)
            bound = 4 * m * np.finfo(f32).eps * np.abs(x.astype(np.float64)).sum(0)
            assert got.shape == (24,) and got.dtype == jnp.float32
            assert np.all(np.abs(np.asarray(got, np.float64) - want) <= bound), m
    assert _column_sums() == ()


@pytest.mark.slow
def test_fp8_mlp_fused_layernorm_matches_layernorm_then_fp8_mlp(rng, M=300):  # ragged, and the weight's
    # gradient summed in partials of 128 rows
    """fp8_mlp(x, ..., ln_weight=, ln_eps=) against fp8_mlp(LayerNorm(x), ...): bf16 x, bf16
    LayerNorm weight and no bias, ragged tokens (the kernel pads h), the LayerNorm's float32 output
    handed on unrounded (out_dtype bf16): y, the gradients of x, the weights and the LayerNorm
    weight (in their own dtypes) and the new metas agree."""
    H, Fw, eps = 32, 48, 1e-5
    bf = jnp.bfloat16
    x = jnp.asarray((rng.standard_normal((M, H)) * 2 + 0.5).astype(f32)).astype(bf)
    lw = jnp.asarray((rng.standard_normal(H) * 0.3 + 1).astype(f32)).astype(bf)
    w1 = jnp.asarray((rng.standard_normal((H, Fw)) / 6).astype(f32)).astype(bf)
    w2 = jnp.asarray((rng.standard_normal((Fw, H)) / 7).astype(f32)).astype(bf)
    b1, b2 = jnp.zeros(Fw, bf) + 0.1, jnp.zeros(H, bf) - 0.1
    m1, m2 = JM.fresh_meta(RECIPE), JM.fresh_meta(RECIPE)

    def fused(x, lw, w1, w2, m1, m2):
        return F.fp8_mlp(x, w1, b1, w2, b2, m1, m2, RECIPE, ln_weight=lw, ln_eps=eps)

    def unfused(x, lw, w1, w2, m1, m2):
        return F.fp8_mlp(layernorm_f32(x, lw, None, eps), w1, b1, w2, b2, m1, m2, RECIPE, out_dtype=bf)

    def run(fn):
        def loss(*a):
            return jnp.sum(fn(*a).astype(jnp.float32) ** 2)

        args = (x, lw, w1, w2, m1, m2)
        step = jax.jit(lambda *a: (fn(*a), jax.grad(loss, argnums=tuple(range(6)))(*a))).lower(*args).compile()
        assert not hlo.xors_with_zero(step.as_text())  # every hidden product and constant stays hidden
        return step(*args)

    (yf, gf), (yu, gu) = run(fused), run(unfused)
    assert yf.shape == (M, H) and yf.dtype == bf

    def err(a, b):
        a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
        return np.linalg.norm(a - b) / np.linalg.norm(b)

    assert err(yf, yu) < 1e-2
    for name, a, b in zip(("dx", "dln_weight", "dw1", "dw2"), gf[:4], gu[:4]):
        assert a.dtype == b.dtype == bf, name
        assert err(a, b) < 1e-2, (name, err(a, b))
    hist_f, hist_u = np.asarray(gf[4][0]), np.asarray(gu[4][0])
    np.testing.assert_allclose(hist_f[0], hist_u[0], rtol=1e-3)
    assert hist_f[0, 0] == ref.amax(ln_ref.layernorm_f32(np.asarray(x), np.asarray(lw), None, eps)[0])


def test_fp8_mlp_refuses_bad_layernorm_arguments_by_name():
    h, w1, w2 = jnp.ones((4, 8)), jnp.ones((8, 16)), jnp.ones((16, 8))
    b1, b2, m = jnp.zeros(16), jnp.zeros(8), JM.fresh_meta(RECIPE)
    cases = [({"ln_weight": jnp.ones(8)}, ValueError, "ln_weight / ln_bias are the parameters of the fused LayerNorm, "
              "which ln_eps turns on; got ln_eps=None"),
             ({"ln_eps": -1.0}, ValueError, r"^ln_eps must be a finite number >= 0"),
             ({"ln_eps": "1e-5"}, TypeError, r"^ln_eps must be a real number"),
             ({"ln_eps": 1e-5, "ln_bias": jnp.ones(7)}, ValueError,
              r"^ln_bias must have shape \(8,\) \(the last dimension of h\); got \(7,\)"),
             ({"ln_eps": 1e-5, "ln_weight": jnp.ones(8), "ln_bias": jnp.ones(8, jnp.float16)}, TypeError,
              "^ln_weight and ln_bias must have the same dtype; got float32 and float16"),
             ({"out_dtype": jnp.int8}, TypeError, "out_dtype must be float32, float16 or bfloat16; got int8")]
    for kwargs, exc, message in cases:
        with pytest.raises(exc, match=message):
            F.fp8_mlp(h, w1, b1, w2, b2, m, m, RECIPE, **kwargs)


# ---- what the jax.numpy path costs on the CPU ------------------------------------------------------
def compiled_programs(fn) -> list[str]:
    """The names of the XLA programs compiled while ``fn()`` runs (jax's log_compiles messages)."""
    messages = []
    handler = logging.Handler()
    handler.emit = lambda record: messages.append(record.getMessage())
    log = logging.getLogger("jax")
    log.addHandler(handler)
    try:
        with jax.log_compiles(True):
            jax.block_until_ready(fn())
    finally:
        log.removeHandler(handler)
    head = "Finished XLA compilation of "
    return [m[len(head):].split(" in ")[0] for m in messages if m.startswith(head)]


def test_an_eager_call_is_one_compiled_program_with_the_jitted_bytes(rng):
    """Outside jax.jit (flax's ``model.init`` and ``apply`` run the modules eagerly) each call is
    one XLA program: op by op, the emulated numerics dispatched thousands of small ones (20 s for
    the un-jitted init of README's flax model on 2 cores)."""
    recipe = fusedfp8.DelayedScaling(amax_history_len=11)  # shapes no other test compiles
    x = jnp.asarray((rng.standard_normal((24, 40)) * 3).astype(f32))
    w = jnp.asarray((rng.standard_normal((40, 56)) / 6).astype(f32))
    st = ScalingState.create((False, True), recipe, like=x)
    meta = JM.fresh_meta(recipe)
    calls = {"jit(_run)": lambda: P.gelu_quantize(x, st, 0, recipe, transpose=True),
             "jit(_update)": lambda: P.update_scales(st, recipe),
             "jit(_dot)": lambda: F.fp8_dot(x, w, meta, recipe)}
    for name, call in calls.items():
        eager = []
        assert compiled_programs(lambda: eager.append(call()) or eager[0]) == [name]
        traced = jax.jit(call)()
        for a, b in zip(jax.tree.leaves(eager[0]), jax.tree.leaves(traced), strict=True):
            assert np.asarray(a).tobytes() == np.asarray(b).tobytes(), name


_INSTRUCTION = re.compile(r"^\s+(ROOT )?%\S+ = ", re.M)


@pytest.mark.parametrize("op", ["gelu", "dgelu"])
def test_the_emulated_activation_is_compiled_once(op):
    """XLA:CPU drops optimization barriers before it fuses and copies a producer of cheap ops into
    every fusion that reads it: the emulated activation (hundreds of ops an element) was compiled
    into the amax, the cast, the transpose and the dbias fusions (the README's flax step: 8.9 s of
    XLA compile, 4 s once). The quantization with the activation must stay below the same
    quantization without it plus one and a half times the activation alone (a copy into a second
    reader would be twice)."""
    cpu = jax.devices("cpu")[0]
    x = jax.device_put(jnp.ones((64, 128), jnp.bfloat16), cpu)
    st = ScalingState.create((False, True), RECIPE, like=x)

    def instructions(fn, *args):
        text = jax.jit(fn).lower(*args).compile().as_text()
        assert not hlo.xors_with_zero(text)  # every hidden product and constant stays hidden
        return len(_INSTRUCTION.findall(text))

    if op == "gelu":
        alone = instructions(lambda x: jg.gelu_f32(x.astype(jnp.float32), "tanh"), x)
        fused = instructions(lambda x, s: P.gelu_quantize(x, s, 0, RECIPE, transpose=True, impl="jnp"), x, st)
        plain = instructions(lambda x, s: P.quantize(x.astype(jnp.float32), s, 0, RECIPE, transpose=True, impl="jnp"),
                             x, st)
    else:
        alone = instructions(lambda x: jg.dgelu_f32(x.astype(jnp.float32), "tanh"), x)
        fused = instructions(lambda x, s: P.dgelu_quantize(x, x, s, 1, RECIPE, transpose=True, dbias=True,
                                                           impl="jnp"), x, st)
        plain = instructions(lambda x, s: P.quantize(x.astype(jnp.float32) * x.astype(jnp.float32), s, 1, RECIPE,
                                                     transpose=True, dbias=True, impl="jnp"), x, st)
    assert alone > 400  # (the count is of instructions: the activation is a big graph)
    assert fused < plain + 1.5 * alone, (fused, plain, alone)


@pytest.mark.parametrize("mkn", [(303, 300, 200), (17, 33, 50), (64, 32, 48)], ids=str)
def test_fp8_dot_pads_ragged_operands_and_slices_its_results(mkn):
    """fp8_dot with GEMM dimensions that are not multiples of 16: the padded FP8 GEMMs give the
    unpadded problem's shapes, and the values of a GEMM of the unpadded quantized operands."""
    from fusedfp8.jax import functional as F
    from fusedfp8.jax import meta as JM

    M, K, N = mkn
    rng = np.random.default_rng(0)
    x = jnp.asarray(rng.standard_normal((M, K)), jnp.bfloat16)
    w = jnp.asarray(rng.standard_normal((K, N)) * 0.05, jnp.bfloat16)
    meta = JM.fresh_meta(fusedfp8.DelayedScaling(amax_history_len=8))
    recipe = fusedfp8.DelayedScaling(amax_history_len=8)
    @jax.jit  # the product, its reference and the gradients in one program: one compile
    def run(x, w, meta):
        y = F.fp8_dot(x, w, meta, recipe)
        st = JM.meta_to_state(meta, JM.LINEAR_GRAD)
        rx, st = P.quantize(x, st, 0, recipe)
        rw, st = P.quantize(w, st, 1, recipe, transpose=True)
        want = F.gemm(rx.data, rw.data_t, rx.scale_inv, rw.scale_inv, jnp.bfloat16, fast_accum=True)
        grads = jax.grad(lambda x, w: jnp.sum(F.fp8_dot(x, w, meta, recipe).astype(jnp.float32) ** 2),
                         argnums=(0, 1))(x, w)
        return y, want, grads

    y, want, (dx, dw) = run(x, w, meta)
    assert y.shape == (M, N)
    np.testing.assert_allclose(np.asarray(y, np.float32), np.asarray(want, np.float32), rtol=1e-2, atol=1e-2)
    assert dx.shape == (M, K) and dw.shape == (K, N)
    assert bool(jnp.all(jnp.isfinite(dx.astype(jnp.float32)))) and float(jnp.abs(dw.astype(jnp.float32)).max()) > 0


@pytest.mark.parametrize("dims", [(30, 40, 72), (17, 24, 33), (64, 32, 48)], ids=str)
def test_fp8_mlp_pads_ragged_operands_and_slices_its_results(dims):
    """fp8_mlp with ragged tokens / hidden / ffn (the GEMMs on padded FP8 operands, sliced): the
    unpadded shapes out, values within FP8's error of the float32 MLP, finite gradients of the
    operands' shapes."""
    from fusedfp8.jax import functional as F
    from fusedfp8.jax import meta as JM

    m, hid, ffn = dims
    recipe = fusedfp8.DelayedScaling(amax_history_len=8)
    rng = np.random.default_rng(1)
    h = jnp.asarray(rng.standard_normal((m, hid)), jnp.bfloat16)
    w1 = jnp.asarray(rng.standard_normal((hid, ffn)) * 0.1, jnp.bfloat16)
    w2 = jnp.asarray(rng.standard_normal((ffn, hid)) * 0.1, jnp.bfloat16)
    b1, b2 = jnp.zeros((ffn,), jnp.bfloat16) + 0.1, jnp.zeros((hid,), jnp.bfloat16) - 0.1
    metas = (JM.fresh_meta(recipe), JM.fresh_meta(recipe))

    def loss(h, w1, w2, m1, m2):
        y = F.fp8_mlp(h, w1, b1, w2, b2, m1, m2, recipe)
        return jnp.sum(y.astype(jnp.float32) ** 2), y

    # the output as the loss's aux: one program for the forward and the gradients
    grads, y = jax.jit(jax.grad(loss, argnums=(0, 1, 2, 3, 4), has_aux=True))(h, w1, w2, *metas)
    f32 = [a.astype(jnp.float32) for a in (h, w1, b1, w2, b2)]
    want = jax.nn.gelu(f32[0] @ f32[1] + f32[2], approximate=True) @ f32[3] + f32[4]
    assert y.shape == (m, hid)
    err = float(jnp.linalg.norm(y.astype(jnp.float32) - want) / jnp.linalg.norm(want))
    assert err < 0.1, err
    assert [g.shape for g in grads[:3]] == [(m, hid), (hid, ffn), (ffn, hid)]
    assert all(bool(jnp.all(jnp.isfinite(g.astype(jnp.float32)))) for g in grads[:3])


def _decoded_numpy_state(meta, recipe, grad):
    """A flax meta decoded by hand (a column whose marker is not 1 starts over), as a numpy state."""
    hist, scale, scale_inv, ovf, upd, writes = (np.array(a, copy=True) for a in meta)
    bad = ~(writes == 1.0)
    hist[:, bad], scale[bad], scale_inv[bad], ovf[bad], upd[bad] = 0.0, 1.0, 1.0, 0.0, 0.0
    return ScalingState(amax_history=hist, scale=scale, scale_inv=scale_inv, overflows=ovf.astype(np.int32),
                        updates=upd.astype(np.int32), grad=grad)


def _nine_column_meta(L):
    """A meta of nine columns that a step can write, reaching every branch of the rule and of the decoding."""
    rng = np.random.default_rng(1)
    n = 9
    hist = (np.abs(rng.standard_normal((L, n))) * 10).astype(f32)
    hist[0] = [3.5, np.nan, np.inf, -0.0, 0.0, 1e-40, 7.25, 2.0 ** -20, 448.0]
    meta = (hist, (rng.random(n) * 100 + 1).astype(f32), rng.random(n).astype(f32),
            rng.integers(0, 50, n).astype(f32), rng.integers(0, 5000, n).astype(f32),
            np.array([1, 1, 1, 1, 0, 1, 2, 3, 1], f32))
    return meta, (False,) * 4 + (True,) * 5


@pytest.mark.parametrize("L,algo,margin", [(1, "max", 0), (5, "most_recent", 0), (7, "max", 2)])
def test_update_meta_is_decode_then_the_rule(L, algo, margin):
    """update_meta (the first use of a flax meta in a step) equals the reference rule on the meta
    decoded by hand: every branch (normal, NaN, inf, +-0, denormal amaxes; markers 0, 2, 3), and
    the counters it hands the output meta are the state's as float32 (no conversion left to do)."""
    recipe = fusedfp8.DelayedScaling(amax_history_len=L, amax_compute_algo=algo, margin=margin)
    meta, grad = _nine_column_meta(L)
    st, (ovf_f, upd_f) = jax.jit(lambda m: P.update_meta(m, recipe, grad, impl="jnp"))(tuple(map(jnp.asarray, meta)))
    want = apply_update(_decoded_numpy_state(meta, recipe, grad), recipe)
    for name in ("amax_history", "scale", "scale_inv", "overflows", "updates"):
        a, b = np.asarray(getattr(st, name)), getattr(want, name)
        assert a.dtype == b.dtype and a.tobytes() == b.tobytes(), (name, a, b)
    assert ovf_f.dtype == upd_f.dtype == jnp.float32
    np.testing.assert_array_equal(np.asarray(ovf_f), want.overflows.astype(f32))
    np.testing.assert_array_equal(np.asarray(upd_f), want.updates.astype(f32))
    assert np.asarray(st.scale)[4] == 1 and int(st.updates[4]) == 0 and int(st.overflows[1]) == meta[3][1] + 1


@pytest.mark.parametrize("field,row,col,value", [
    ("amax_history", -1, 8, -1e-3), ("amax_history", 0, 0, -0.5), ("overflows", None, 3, 0.5),
    ("updates", None, 4, np.nan), ("updates", None, 2, -1.0), ("writes", None, 6, 0.999)])
def test_update_meta_refuses_a_corrupted_meta(field, row, col, value):
    """A meta holding what no step writes in ANY cell (an optimizer updated it as a parameter) is
    refused in the update itself: every column's scale and scale_inv NaN (the step's casts and
    GEMMs give NaN under jax.jit), its int32 update count at least 1 (no first-step scale from
    the tensor's own amax), everything else as the rule gives it on the decoded meta."""
    L = 5
    recipe = fusedfp8.DelayedScaling(amax_history_len=L)
    meta, grad = _nine_column_meta(L)
    meta = tuple(np.array(a, copy=True) for a in meta)
    k = JM.META_FIELDS.index(field)
    if row is None:
        meta[k][col] = value
    else:
        meta[k][row, col] = value
    assert bool(JM.corrupted(meta, np))
    st, (ovf_f, upd_f) = jax.jit(lambda m: P.update_meta(m, recipe, grad, impl="jnp"))(tuple(map(jnp.asarray, meta)))
    want = apply_update(_decoded_numpy_state(meta, recipe, grad), recipe)
    assert np.isnan(np.asarray(st.scale)).all() and np.isnan(np.asarray(st.scale_inv)).all()
    np.testing.assert_array_equal(np.asarray(st.updates), np.maximum(want.updates, 1))
    for name in ("amax_history", "overflows"):
        assert np.asarray(getattr(st, name)).tobytes() == getattr(want, name).tobytes(), name
    np.testing.assert_array_equal(np.asarray(upd_f), want.updates.astype(f32))  # the stored counters: the rule's


def test_update_meta_refuses_current_scaling():
    with pytest.raises(ValueError, match="delayed scaling only"):
        P.update_meta(JM.fresh_meta(fusedfp8.DelayedScaling()), fusedfp8.CurrentScaling(), JM.LINEAR_GRAD, impl="jnp")
