"""fusedfp8.jax.flax on the CPU (the jax.numpy backend): nn.Dense with the drop-in Fp8DotGeneral and
Fp8MLP trained with flax's TrainState over several steps; the FP8 state in the
'_overwrite_with_gradient' collection advances by the rule (counters, rolls, scale_inv), the MLP
matches the layout of the plain flax MLP and trains. The GPU twin of the MLP step is in
test_jax_kernels.py."""
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
    if variables is None:  # (jitted: one compile, not the op-by-op dispatch of the emulated numerics)
        variables = jax.jit(model.init)(jax.random.key(0), x)
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


@pytest.mark.slow
def test_flax_mlp_trains_and_matches_the_bf16_layout(rng):
    recipe = fusedfp8.DelayedScaling(amax_history_len=4)
    x = jnp.asarray(rng.standard_normal((32, 16)).astype(f32))
    y = jnp.asarray(np.tanh(rng.standard_normal((32, 16))).astype(f32))
    model = Fp8MLP(32, recipe=recipe)
    ref_model = nn.Sequential([nn.LayerNorm(name="norm"), nn.Dense(32, name="fc1"),
                               lambda z: nn.gelu(z, approximate=True), nn.Dense(16, name="fc2")])
    out, variables = jax.jit(model.init_with_output)(jax.random.key(0), x)  # the forward of a fresh state
    ref_vars = {"params": {f"layers_{i}": variables["params"][n] for i, n in ((0, "norm"), (1, "fc1"), (3, "fc2"))}}
    want = ref_model.apply(ref_vars, x)
    assert np.linalg.norm(np.asarray(out) - np.asarray(want)) / np.linalg.norm(np.asarray(want)) < 0.1
    state, hist = train(model, x, y, 8, variables)
    assert hist[-1][0] < 0.8 * hist[0][0]
    last = hist[-1][1]
    for layer in ("fc1", "fc2"):
        np.testing.assert_array_equal(last[layer]["updates"], [7, 7, 7])
        assert (last[layer]["amax_history"] > 0).all()  # the history filled and rolled
