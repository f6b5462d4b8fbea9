"""State integrity of the JAX front end (issue 16): a module that gets no cotangent (2), a module
used several times in one step (3), second derivatives (4), denormal scales on the jax.numpy
path (7), donating a fresh meta (12), a CUDA impl without a GPU (16), a numpy state (17); layers
stacked by nn.scan / nn.vmap (a leading layer axis on the state) and under nn.remat; a state an
optimizer updated as a parameter (the plain optax loop) refused."""
from __future__ import annotations

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import optax
import pytest
from flax import linen as nn
from flax.training import train_state

import fusedfp8 as ff
from fusedfp8.launch import probe
from fusedfp8.jax import fp8_dot, fp8_mlp, quantize_weight
from fusedfp8.jax import primitives as P
from fusedfp8.jax.flax import OVERWRITE_WITH_GRADIENT as FP8
from fusedfp8.jax.flax import Fp8DotGeneral, Fp8MLP, TrainState, accumulate_gradients
from fusedfp8.jax.meta import META_FIELDS, corrupted, fresh_meta, refuse_corrupted
from fusedfp8.numerics import reference as ref

R = ff.DelayedScaling(amax_history_len=8)
X = jax.random.normal(jax.random.key(0), (32, 16), jnp.float32)
Y = jax.random.normal(jax.random.key(1), (32, 16), jnp.float32)


def _dense(recipe, name=None):
    return nn.Dense(16, dot_general_cls=lambda: Fp8DotGeneral(recipe=recipe), name=name)


class _NoCotangent(nn.Module):
    """``a`` reaches the loss; ``b`` runs but its output gets no cotangent (how: stop_gradient,
    unused, or the branch not taken by lax.cond)."""
    how: str
    recipe: ff.DelayedScaling

    @nn.compact
    def __call__(self, x):
        a = _dense(self.recipe, "a")(x)
        b = _dense(self.recipe, "b")
        if self.how == "stop_gradient":
            return a + jax.lax.stop_gradient(b(x))
        if self.how == "unused":
            b(x)
            return a
        # a branch never taken (flax's lifted cond; its variables made at init, outside the cond)
        if self.is_initializing():
            b(x)
        taken = nn.cond(jnp.sum(x) > 1e9, lambda mdl, v: mdl(v), lambda mdl, v: jnp.zeros((v.shape[0], 16), v.dtype),
                        b, x)
        return a + taken


def _train(model, state_cls, steps):
    v = jax.jit(model.init)(jax.random.key(2), X)
    st = state_cls.create(apply_fn=model.apply, params=v, tx=optax.adam(1e-3))

    @jax.jit
    def step(st):
        loss, g = jax.value_and_grad(lambda p: jnp.mean((st.apply_fn(p, X) - Y) ** 2))(st.params)
        return st.apply_gradients(grads=g), loss

    losses = []
    for _ in range(steps):
        st, loss = step(st)
        losses.append(float(loss))
    return v, st, losses


# ---- 2. no cotangent ------------------------------------------------------------------------------
# (fusedfp8's TrainState and an untaken branch: the unrolled twin of the scanned-layers test below)
NO_COTANGENT = [("stop_gradient", "current"), ("stop_gradient", "unit"), ("unused", "current")]


@pytest.mark.parametrize("how, first_step", NO_COTANGENT)
def test_fusedfp8_train_state_keeps_the_state_of_a_module_without_cotangent(how, first_step):
    recipe = ff.DelayedScaling(amax_history_len=8, first_step=first_step)
    v, st, losses = _train(_NoCotangent(how, recipe), TrainState, 3)
    assert np.all(np.isfinite(losses))
    before, after = v[FP8]["b"]["Fp8DotGeneral_0"], st.params[FP8]["b"]["Fp8DotGeneral_0"]
    for k in before:
        np.testing.assert_array_equal(np.asarray(after[k]), np.asarray(before[k]), err_msg=k)
    a = st.params[FP8]["a"]["Fp8DotGeneral_0"]
    assert np.asarray(a["updates"]).tolist() == [2, 2, 2]  # the module that trains still advances


@pytest.mark.parametrize("how, first_step", [("stop_gradient", "unit"), ("untaken_branch", "current")])
def test_with_flax_train_state_a_module_without_cotangent_restarts_never_zeroes(how, first_step):
    """flax's own TrainState writes the zero gradient over the state: the marker shows it, and
    the next forward starts that module over (scale 1 or its current amax): never scale 0, never
    a NaN loss (the losses of steps 2 and 3 come after the zeroing)."""
    recipe = ff.DelayedScaling(amax_history_len=8, first_step=first_step)
    _, st, losses = _train(_NoCotangent(how, recipe), train_state.TrainState, 3)
    assert np.all(np.isfinite(losses))
    b = st.params[FP8]["b"]["Fp8DotGeneral_0"]
    assert np.asarray(b["writes"]).tolist() == [0, 0, 0]  # zeroed by the overwrite, and marked so


# ---- 3. one module used several times in a step ---------------------------------------------------
class _Shared(nn.Module):
    uses: int

    @nn.compact
    def __call__(self, x):
        d = _dense(R)
        for _ in range(self.uses):
            self.sow("intermediates", "inputs", x)
            x = d(x)
        return x


@pytest.mark.parametrize("state_cls, uses", [(train_state.TrainState, 2), (TrainState, 3)])
def test_a_shared_module_advances_once_per_step_and_max_accumulates(state_cls, uses):
    steps = 4
    model = _Shared(uses)
    v, st, losses = _train(model, state_cls, steps)
    s = {k: np.asarray(a) for k, a in st.params[FP8]["Dense_0"]["Fp8DotGeneral_0"].items()}
    assert s["updates"].tolist() == [steps - 1] * 3  # once per step, not uses times
    assert s["writes"].tolist() == [1, 1, 1]
    np.testing.assert_allclose(s["scale"] * s["scale_inv"], 1.0, rtol=2e-7)  # never doubled

    @jax.jit  # one program (eagerly each op of the emulated numerics was a compile of its own)
    def sown_and_grad(p):
        sown = model.apply(p, X, mutable=["intermediates"])[1]["intermediates"]["inputs"]
        return sown, jax.grad(lambda q: jnp.mean((model.apply(q, X) - Y) ** 2))(p)

    # the staged input amax of the first step: the max over every use's input, exactly
    inputs, g = sown_and_grad(v)
    assert len(inputs) == uses
    staged = np.asarray(g[FP8]["Dense_0"]["Fp8DotGeneral_0"]["amax_history"])[0]
    assert staged[0] == max(np.abs(np.asarray(i)).max() for i in inputs)
    assert staged[1] == np.abs(np.asarray(v["params"]["Dense_0"]["kernel"])).max()
    assert staged[2] > 0


def test_a_reused_fp8_mlp_advances_once_per_step():
    class Twice(nn.Module):
        @nn.compact
        def __call__(self, x):
            m = Fp8MLP(32, recipe=R)
            return m(m(x))

    _, st, losses = _train(Twice(), TrainState, 3)
    for fc in ("fc1", "fc2"):
        s = st.params[FP8]["Fp8MLP_0"][fc]
        assert np.asarray(s["updates"]).tolist() == [2, 2, 2]
        assert np.asarray(s["writes"]).tolist() == [1, 1, 1]


def test_two_unchained_uses_of_one_meta_are_marked_and_never_doubled():
    """The functional fp8_dot cannot chain two calls that share a meta: their new metas are
    summed by autodiff. The marker (2) shows it and the next step starts the meta over."""
    meta = fresh_meta(R)
    w = jax.random.normal(jax.random.key(3), (16, 16))
    new = jax.grad(lambda m: jnp.sum(fp8_dot(X, w, m, R)) + jnp.sum(fp8_dot(X * 2, w, m, R)))(meta)
    assert np.asarray(new[5]).tolist() == [2, 2, 2]
    y = jax.grad(lambda m: jnp.sum(fp8_dot(X, w, m, R)))(new)  # decodes: a fresh start, scale 1 -> current
    assert np.asarray(y[5]).tolist() == [1, 1, 1] and np.asarray(y[4]).tolist() == [0, 0, 0]


# ---- stacked layers: nn.scan, nn.remat, nn.vmap --------------------------------------------------
N_LAYERS = 2
IDX = jnp.arange(N_LAYERS)


def _fp8_dense(name):
    # no bias: XLA:CPU sums a bias gradient in another order inside a loop than unrolled
    return nn.Dense(16, use_bias=False, dot_general_cls=lambda: Fp8DotGeneral(recipe=R), name=name)


class _Block(nn.Module):
    """``a``, then ``b`` in layer 1 only (lax.cond on the layer's index): in layer 0 ``b`` gets no
    cotangent, so one stacked state holds a layer to keep and a layer to write."""

    @nn.compact
    def __call__(self, x, i):
        a, b = _fp8_dense("a"), _fp8_dense("b")
        if self.is_initializing():
            b(x)
        return jnp.tanh(nn.cond(i == 1, lambda mdl, v: mdl(v), lambda mdl, v: v, b, a(x))), None


class _Scanned(nn.Module):
    @nn.compact
    def __call__(self, x, idx):
        layers = nn.scan(nn.remat(_Block), variable_axes={"params": 0, FP8: 0}, split_rngs={"params": True},
                         length=N_LAYERS)
        return layers(name="layers")(x, idx)[0]


class _Unrolled(nn.Module):
    @nn.compact
    def __call__(self, x, idx):
        for i in range(N_LAYERS):
            x = _Block(name=f"layers_{i}")(x, idx[i])[0]
        return x


def _train_two_micro_batches(model, variables, steps):
    """fusedfp8's TrainState, each step two micro-batches (accumulate_gradients). The gradients
    and the update are two programs: in one, XLA:CPU contracts Adam's multiply-adds into FMAs
    where fusion lets it, which differs between a loop and its unrolled copy (flax's own
    TrainState then differs in the last bit as well)."""
    grad = jax.jit(jax.value_and_grad(lambda p, x: jnp.mean((model.apply(p, x, IDX) - Y) ** 2)))

    @jax.jit
    def update(st, g1, g2):
        total = accumulate_gradients(jax.tree.map(jnp.zeros_like, g1), g1, 0.5)
        return st.apply_gradients(grads=accumulate_gradients(total, g2, 0.5))

    st = TrainState.create(apply_fn=model.apply, params=variables, tx=optax.adam(1e-2))
    for _ in range(steps):
        st = update(st, grad(st.params, X)[1], grad(st.params, X * 3)[1])
    return st


def test_scanned_rematerialized_layers_train_as_the_unrolled_model_bit_for_bit():
    """nn.scan over nn.remat'ed layers (the state stacked on a leading layer axis) against the same
    layers unrolled, from the same variables, three steps of two micro-batches: every parameter
    and every FP8 state equal bit for bit; the module that got no cotangent in layer 0 kept its
    state, layer 1's advanced."""
    steps = 3
    v = jax.jit(_Scanned().init)(jax.random.key(2), X, IDX)
    layer = lambda tree, i: jax.tree.map(lambda a: a[i], tree)
    unrolled = {c: {f"layers_{i}": layer(v[c]["layers"], i) for i in range(N_LAYERS)} for c in v}
    scanned = _train_two_micro_batches(_Scanned(), v, steps)
    plain = _train_two_micro_batches(_Unrolled(), unrolled, steps)
    for c in v:
        for i in range(N_LAYERS):
            got, want = layer(scanned.params[c]["layers"], i), plain.params[c][f"layers_{i}"]
            for (path, a), b in zip(jax.tree_util.tree_flatten_with_path(got)[0], jax.tree.leaves(want), strict=True):
                where = f"{c} layer {i} {jax.tree_util.keystr(path)}"
                np.testing.assert_array_equal(np.asarray(a), np.asarray(b), err_msg=where)
    state = lambda name: {k: np.asarray(a) for k, a in scanned.params[FP8]["layers"][name]["Fp8DotGeneral_0"].items()}
    a, b, b0 = state("a"), state("b"), {k: np.asarray(x) for k, x in v[FP8]["layers"]["b"]["Fp8DotGeneral_0"].items()}
    assert a["updates"].tolist() == [[steps - 1] * 3] * N_LAYERS
    for k in b:
        np.testing.assert_array_equal(b[k][0], b0[k][0], err_msg=k)  # layer 0: kept
    assert b["updates"][1].tolist() == [steps - 1] * 3 and (b["amax_history"][1, 0] > 0).all()  # layer 1: trained


class _Member(nn.Module):
    @nn.compact
    def __call__(self, x):
        return _fp8_dense("a")(x) + jax.lax.stop_gradient(_fp8_dense("b")(x))


def test_vmapped_layers_keep_and_write_their_stacked_states():
    """nn.vmap'ed members (the state stacked on a leading member axis): fusedfp8's TrainState
    writes the trained module's states as flax's does and keeps the stop_gradient'ed module's
    (flax's TrainState zeroes them); the next step reads both."""
    model = nn.vmap(_Member, variable_axes={"params": 0, FP8: 0}, split_rngs={"params": True})()
    xs = jnp.stack([X, X * 3])
    v = jax.jit(model.init)(jax.random.key(3), xs)
    grad = jax.jit(jax.grad(lambda p: jnp.mean((model.apply(p, xs) - Y) ** 2)))
    update = jax.jit(lambda st, g: st.apply_gradients(grads=g))
    step = lambda st: update(st, grad(st.params))
    ours = step(TrainState.create(apply_fn=model.apply, params=v, tx=optax.adam(1e-2)))
    flax_ = step(train_state.TrainState.create(apply_fn=model.apply, params=v, tx=optax.adam(1e-2)))
    for k in ("amax_history", "scale", "updates", "writes"):
        np.testing.assert_array_equal(np.asarray(ours.params[FP8]["a"]["Fp8DotGeneral_0"][k]),
                                      np.asarray(flax_.params[FP8]["a"]["Fp8DotGeneral_0"][k]), err_msg=k)
        np.testing.assert_array_equal(np.asarray(ours.params[FP8]["b"]["Fp8DotGeneral_0"][k]),
                                      np.asarray(v[FP8]["b"]["Fp8DotGeneral_0"][k]), err_msg=k)
    assert np.asarray(flax_.params[FP8]["b"]["Fp8DotGeneral_0"]["writes"]).tolist() == [[0] * 3] * 2
    ours = step(ours)
    assert np.asarray(ours.params[FP8]["a"]["Fp8DotGeneral_0"]["updates"]).tolist() == [[1] * 3] * 2


# ---- the FP8 state updated by an optimizer ----------------------------------------------------------
def test_the_plain_optax_loop_over_the_fp8_state_is_refused_at_the_next_call():
    """tx.update / optax.apply_updates over the whole variables: Adam's first step makes the state
    corrupted (staged amaxes -lr, marker 1 - lr); the next jitted step's forward is refused with
    NaN, and an eager forward raises saying how to train."""
    model = _dense(R)
    v = jax.jit(model.init)(jax.random.key(2), X)
    tx = optax.adam(1e-3)

    @jax.jit
    def step(v, opt):
        loss, g = jax.value_and_grad(lambda p: jnp.mean((model.apply(p, X) - Y) ** 2))(v)
        updates, opt = tx.update(g, opt, v)
        return optax.apply_updates(v, updates), opt, loss

    v1, opt, loss0 = step(v, tx.init(v))
    s = v1[FP8]["Fp8DotGeneral_0"]
    assert np.isfinite(float(loss0)) and float(np.asarray(s["amax_history"])[0].max()) == pytest.approx(-1e-3, rel=1e-4)
    assert bool(corrupted(tuple(s[k] for k in META_FIELDS)))
    assert np.isnan(float(step(v1, opt)[2]))
    with pytest.raises(ValueError, match=r"^the FP8 state of /Fp8DotGeneral_0 holds values no training step writes "
                                         r".*optimizer updated it as a parameter.*fusedfp8\.jax\.flax\.TrainState"):
        model.apply(v1, X)


def _corruptions():
    """What optimizers make of a fresh meta (each one field), and what a step can write (no refusal):
    a zeroed state (flax's TrainState, no cotangent) and the sum of two unchained uses."""
    i = {k: META_FIELDS.index(k) for k in META_FIELDS}
    bad = {"negative amax": ("amax_history", lambda a: a.at[0, 1].set(-1e-3)),
           "fractional counter": ("updates", lambda a: a.at[2].set(0.5)),
           "negative counter": ("overflows", lambda a: a.at[0].set(-1.0)),
           "NaN counter": ("updates", lambda a: a.at[1].set(jnp.nan)),
           "fractional marker": ("writes", lambda a: a * 0.999)}
    ok = {"zeroed": ("writes", jnp.zeros_like), "summed": ("writes", lambda a: a * 2)}

    def make(field, f):
        m = list(fresh_meta(R))
        m[i[field]] = f(m[i[field]])
        return tuple(m)

    return {k: make(*v) for k, v in bad.items()}, {k: make(*v) for k, v in ok.items()}


def test_a_corrupted_meta_is_refused_by_every_route():
    """fp8_dot, fp8_mlp (either meta), quantize_weight and the flax modules: ValueError naming the
    argument (the module) on an eager call, before anything runs; all-NaN outputs under jax.jit.
    A zeroed or summed state is no corruption: the call starts it over, finite."""
    bad, ok = _corruptions()
    w = jax.random.normal(jax.random.key(3), (16, 16)) * 0.1
    w1, w2, b1, b2 = w, jnp.ones((16, 16)) * 0.1, jnp.zeros(16), jnp.zeros(16)
    fresh = fresh_meta(R)
    dense = {"kernel": w, "bias": b1}
    params = {"norm": {"scale": jnp.ones(16), "bias": b1}, "fc1": dense, "fc2": dense}
    dot_jit = jax.jit(lambda m: fp8_dot(X, w, m, R))
    mlp_jit = jax.jit(lambda m1, m2: fp8_mlp(X, w1, b1, w2, b2, m1, m2, R))
    for kind, meta in bad.items():
        for call, arg in [(lambda: fp8_dot(X, w, meta, R), "meta"), (lambda: quantize_weight(w, meta, R), "meta"),
                          (lambda: fp8_mlp(X, w1, b1, w2, b2, fresh, meta, R), "meta2"),
                          (lambda: fp8_mlp(X, w1, b1, w2, b2, meta, fresh, R), "meta1")]:
            with pytest.raises(ValueError, match=rf"^{arg} holds values no training step writes"):
                call()
        states = {"fc1": dict(zip(META_FIELDS, fresh)), "fc2": dict(zip(META_FIELDS, meta))}
        with pytest.raises(ValueError, match=r"^the FP8 state of /fc2 holds values no training step writes"):
            Fp8MLP(16, recipe=R).apply({"params": params, FP8: states}, X)
        assert np.isnan(np.asarray(dot_jit(meta))).all(), kind
        assert np.isnan(np.asarray(mlp_jit(fresh, meta))).all(), kind
    assert np.isfinite(np.asarray(dot_jit(fresh))).all() and np.isfinite(np.asarray(mlp_jit(fresh, fresh))).all()
    for kind, meta in ok.items():
        assert not corrupted(meta), kind
        refuse_corrupted(meta)  # the host check of an eager call passes it
        assert np.isfinite(np.asarray(dot_jit(meta))).all(), kind


# ---- 4. second derivatives --------------------------------------------------------------------------
def _penalty_fns():
    w = jax.random.normal(jax.random.key(4), (16, 16)) * 0.1
    w2 = jax.random.normal(jax.random.key(5), (32, 16)) * 0.1
    w1 = jax.random.normal(jax.random.key(6), (16, 32)) * 0.1
    meta = fresh_meta(R)
    dot = lambda x: jnp.sum((x + fp8_dot(x, w, meta, R)) ** 2)
    mlp = lambda x: jnp.sum((x + fp8_mlp(x, w1, jnp.zeros(32), w2, jnp.zeros(16), meta, fresh_meta(R), R)) ** 2)
    dense = _dense(R)
    v = dense.init(jax.random.key(7), X)
    flax_ = lambda x: jnp.sum((x + dense.apply(v, x)) ** 2)
    return {"fp8_dot": dot, "fp8_mlp": mlp, "flax": flax_}


@pytest.mark.parametrize("kind", ["fp8_dot", "fp8_mlp", "flax"])
def test_second_derivatives_are_refused_clearly(kind):
    f = _penalty_fns()[kind]
    jax.grad(f)(X)  # first order works
    with pytest.raises(TypeError, match="second derivatives"):
        jax.grad(lambda x: jnp.sum(jax.grad(f)(x) ** 2))(X)
    if kind == "fp8_dot":
        with pytest.raises(TypeError, match="second derivatives"):
            jax.hessian(f)(X[:4])


# ---- 7. denormal scales on the jax.numpy path ------------------------------------------------------
@pytest.mark.parametrize("fmt_grad", [False, True], ids=["e4m3", "e5m2"])
@pytest.mark.parametrize("scale", [1e-39, 1e-45, np.float32(1) / np.finfo(np.float32).max])
def test_a_denormal_scale_quantizes_as_the_reference(fmt_grad, scale):
    x = np.array([np.inf, -np.inf, 3e38, -3e38, 1.0, 0.0, -1e-39, 1e30, np.nan], np.float32)
    state = ff.ScalingState.create([fmt_grad], R)
    state = state.replace(scale=np.array([scale], np.float32), updates=np.ones(1, np.int32))
    r, _ = jax.jit(lambda x, s: P.quantize(x, s, 0, R, impl="jnp"))(jnp.asarray(x), state)
    want = ref.quantize(x, np.array([scale], np.float32), "e5m2" if fmt_grad else "e4m3").data
    np.testing.assert_array_equal(np.asarray(r.data).view(np.uint8), want.view(np.uint8))


@pytest.mark.parametrize("fmt", [ml_dtypes.float8_e4m3fn, ml_dtypes.float8_e5m2], ids=["e4m3", "e5m2"])
def test_dequantize_with_a_denormal_scale_inv_matches_the_reference_where_the_result_is_normal(fmt):
    q = np.array([448.0, -448.0, 240.0, 16.0, 4.0, -4.0], np.float32).astype(fmt)
    si = np.array([np.float32(1) / np.finfo(np.float32).max], np.float32)
    got = np.asarray(jax.jit(P.dequantize)(jnp.asarray(q), jnp.asarray(si)))
    np.testing.assert_array_equal(got, ref.dequantize(q, si))
    assert np.all(got != 0)


# ---- 12. a fresh meta can be donated ----------------------------------------------------------------
def test_a_fresh_meta_can_be_donated_to_a_jitted_step():
    meta = fresh_meta(R)
    ptrs = {m.unsafe_buffer_pointer() for m in meta}
    assert len(ptrs) == len(meta)
    w = jax.random.normal(jax.random.key(8), (16, 16))
    step = jax.jit(lambda m: jax.grad(lambda mm: jnp.sum(fp8_dot(X, w, mm, R)))(m), donate_argnums=0)
    new = step(meta)
    assert np.asarray(new[5]).tolist() == [1, 1, 1]


# ---- 16. a CUDA impl where no kernel can run --------------------------------------------------
@pytest.mark.skipif(probe()[0], reason="a usable GPU is present: impl='kernel' is legal here")
@pytest.mark.parametrize("impl", ["ffi", "callback"])
def test_a_cuda_impl_without_a_gpu_is_refused_naming_impl(impl):
    state = ff.ScalingState.create(3, R)
    with pytest.raises(ValueError, match=rf"^impl='{impl}' runs the CUDA kernels, which cannot run here"):
        P.quantize(X, state, 0, R, impl=impl)
    with pytest.raises(ValueError, match=r"^impl="):
        fp8_dot(X, jnp.ones((16, 16)), fresh_meta(R), R, impl=impl)


# ---- 17. a numpy state -------------------------------------------------------------------------------
def test_a_numpy_state_is_taken_by_the_jax_functions():
    np_state = ff.ScalingState.create([False, True], R)
    jx_state = ff.ScalingState.create([False, True], R, like=jnp.zeros(1))
    r1, s1 = P.quantize(X, np_state, 1, R, transpose=True)
    r2, s2 = P.quantize(X, jx_state, 1, R, transpose=True)
    np.testing.assert_array_equal(np.asarray(r1.data).view(np.uint8), np.asarray(r2.data).view(np.uint8))
    import fusedfp8.jax as fj

    u1, u2 = fj.update_scales(s1, R), fj.update_scales(s2, R)
    for f in ("amax_history", "scale", "scale_inv", "overflows", "updates"):
        np.testing.assert_array_equal(np.asarray(getattr(u1, f)), np.asarray(getattr(u2, f)))


def test_a_torch_state_is_refused_by_the_jax_functions():
    torch = pytest.importorskip("torch")
    with pytest.raises(TypeError, match=r"^state\.amax_history: fusedfp8\.jax needs jax \(or numpy\) arrays"):
        P.quantize(X, ff.ScalingState.create(2, R, like=torch.zeros(1)), 0, R)
