"""fusedfp8.jax.flax on the CPU (the jax.numpy backend): nn.Dense with the drop-in Fp8DotGeneral and
Fp8MLP trained with flax's TrainState over several steps; the FP8 state in the
'_overwrite_with_gradient' collection advances by the rule (counters, rolls, scale_inv), the MLP
matches the layout of the plain flax MLP and trains. The GPU twin of the MLP step is in
test_jax_kernels.py."""
import functools

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax.training.train_state import TrainState

import fusedfp8
from fusedfp8.jax.flax import OVERWRITE_WITH_GRADIENT, Fp8DotGeneral, Fp8MLP
from fusedfp8.numerics import reference as ref

f32 = np.float32


def train(model, x, y, steps, variables=None):
    """``steps`` Adam steps on (x, y); (the state, [(loss, the FP8 state after the step, the
    step's output)]): the first output is the forward of the fresh variables."""
    if variables is None:  # (jitted: one compile, not the op-by-op dispatch of the emulated numerics)
        variables = jax.jit(model.init)(jax.random.key(0), x)
    state = TrainState.create(apply_fn=model.apply, params=variables, tx=optax.adam(1e-2))

    @jax.jit
    def step(state):
        def loss_fn(p):
            out = state.apply_fn(p, x)
            return jnp.mean((out.astype(jnp.float32) - y) ** 2), out

        (loss, out), grads = jax.value_and_grad(loss_fn, has_aux=True)(state.params)
        return state.apply_gradients(grads=grads), loss, out

    history = []
    for _ in range(steps):
        state, loss, out = step(state)
        history.append((float(loss), jax.tree.map(np.asarray, state.params[OVERWRITE_WITH_GRADIENT]), out))
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


@pytest.mark.parametrize("layer", [nn.Dense, nn.DenseGeneral], ids=["Dense", "DenseGeneral"])
def test_flax_an_instance_as_dot_general_cls_is_told_to_pass_the_class(layer):
    """flax calls ``dot_general_cls()`` and then the result with the operands: an instance gets the
    zero-argument call; it says what to pass instead, before any variable exists, and what it
    suggests works."""
    recipe = fusedfp8.DelayedScaling(amax_history_len=4)
    x = jnp.ones((4, 16))
    with pytest.raises(TypeError, match=r"^Fp8DotGeneral was called with no operands: dot_general_cls takes the "
                                        r"class, not an instance .*; pass dot_general_cls=Fp8DotGeneral, or .*"
                                        r"functools\.partial\(Fp8DotGeneral, recipe=r\) or "
                                        r"lambda: Fp8DotGeneral\(recipe=r\)(\n|$)"):  # (jax may append a note)
        layer(8, dot_general_cls=Fp8DotGeneral(recipe=recipe)).init(jax.random.key(0), x)
    for cls, rows in ((Fp8DotGeneral, 1024), (functools.partial(Fp8DotGeneral, recipe=recipe), 4),
                      (lambda: Fp8DotGeneral(recipe=recipe), 4)):
        # (traced, not run: the variables' shapes are the point, and eagerly each init compiled the FP8 dot)
        variables = jax.eval_shape(layer(8, dot_general_cls=cls).init, jax.random.key(0), x)
        assert variables[OVERWRITE_WITH_GRADIENT]["Fp8DotGeneral_0"]["amax_history"].shape == (rows, 3)


def test_flax_dot_general_with_an_operand_missing_says_what_it_needs():
    with pytest.raises(TypeError, match=r"^Fp8DotGeneral needs lhs, rhs and dimension_numbers"):
        Fp8DotGeneral().init(jax.random.key(0), jnp.ones((2, 8)), jnp.ones((8, 3)))


@pytest.mark.slow
def test_flax_mlp_trains_and_matches_the_bf16_layout(rng):
    recipe = fusedfp8.DelayedScaling(amax_history_len=4)
    x = jnp.asarray(rng.standard_normal((32, 16)).astype(f32))
    y = jnp.asarray(np.tanh(rng.standard_normal((32, 16))).astype(f32))
    model = Fp8MLP(32, recipe=recipe)
    ref_model = nn.Sequential([nn.LayerNorm(name="norm"), nn.Dense(32, name="fc1"),
                               lambda z: nn.gelu(z, approximate=True), nn.Dense(16, name="fc2")])
    variables = jax.jit(model.init)(jax.random.key(0), x)
    ref_vars = {"params": {f"layers_{i}": variables["params"][n] for i, n in ((0, "norm"), (1, "fc1"), (3, "fc2"))}}
    want = ref_model.apply(ref_vars, x)
    state, hist = train(model, x, y, 8, variables)
    out = hist[0][2]  # the forward of the fresh state (from the first step: no program of its own)
    assert np.linalg.norm(np.asarray(out) - np.asarray(want)) / np.linalg.norm(np.asarray(want)) < 0.1
    assert hist[-1][0] < 0.8 * hist[0][0]
    last = hist[-1][1]
    for layer in ("fc1", "fc2"):
        np.testing.assert_array_equal(last[layer]["updates"], [7, 7, 7])
        assert (last[layer]["amax_history"] > 0).all()  # the history filled and rolled


@pytest.mark.slow
def test_flax_mlp_fused_layernorm_matches_the_unfused_path(rng):
    """The LayerNorm fused into the quantization of fc1's input (the default) against
    ``fuse_layernorm=False`` (flax's nn.LayerNorm, its output quantized): the same variables
    (names, shapes, init values: either model loads the other's), no flax LayerNorm in the fused
    program, the output and every gradient (the LayerNorm's parameters included) close, the FP8
    state's staged amaxes too. A 3-D ragged input: the kernel pads h for the GEMMs."""
    recipe = fusedfp8.DelayedScaling(amax_history_len=4)
    x = jnp.asarray((rng.standard_normal((2, 15, 24)) * 2 + 0.3).astype(f32))
    y = jnp.asarray(rng.standard_normal((2, 15, 24)).astype(f32))
    fused, unfused = Fp8MLP(40, recipe=recipe, impl="jnp"), Fp8MLP(40, recipe=recipe, impl="jnp", fuse_layernorm=False)
    variables = jax.jit(fused.init)(jax.random.key(0), x)
    other = jax.jit(unfused.init)(jax.random.key(0), x)
    assert jax.tree.structure(variables) == jax.tree.structure(other)
    for a, b in zip(jax.tree.leaves(variables), jax.tree.leaves(other), strict=True):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
    assert set(variables["params"]["norm"]) == {"scale", "bias"}
    norm = variables["params"]["norm"]  # parameters away from their init, so their gradients mean something
    variables["params"]["norm"] = {"scale": norm["scale"] + jnp.asarray(rng.standard_normal(24).astype(f32) / 5),
                                   "bias": norm["bias"] + jnp.asarray(rng.standard_normal(24).astype(f32) / 10)}

    def grads(model):
        return jax.jit(jax.value_and_grad(lambda v: jnp.mean((model.apply(v, x) - y) ** 2)))(variables)

    (lf, gf), (lu, gu) = grads(fused), grads(unfused)
    np.testing.assert_allclose(float(lf), float(lu), rtol=1e-4)
    for (path, a), b in zip(jax.tree_util.tree_flatten_with_path(gf)[0], jax.tree.leaves(gu), strict=True):
        a, b = np.asarray(a), np.asarray(b)
        assert a.dtype == b.dtype, path
        assert np.linalg.norm(a - b) <= 1e-3 * np.linalg.norm(b), (jax.tree_util.keystr(path), a, b)
    assert np.abs(np.asarray(gf["params"]["norm"]["scale"])).max() > 0
    assert "rsqrt" in jax.jit(unfused.apply).lower(variables, x).as_text()  # flax's LayerNorm ...
    assert "rsqrt" not in jax.jit(fused.apply).lower(variables, x).as_text()  # ... is not in the fused program
