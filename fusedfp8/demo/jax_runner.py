"""The demo in JAX: ``FlaxMLP`` (bf16) and :class:`fusedfp8.jax.flax.Fp8MLP` (identical parameter
names, so both start from the same bf16 weights), trained with ``optax.adam`` in a flax
``TrainState`` by one jitted step each, compiled before the timed steps.

Each step is timed with ``time.perf_counter`` around the call and ``jax.block_until_ready``.
The flax modules defer the scale update to the next forward (the staged amaxes of a step become
scales when the next step starts); to plot the scale after each step as the torch runner does,
the step also applies ``fusedfp8.jax.update_scales`` to a copy of each FP8 state (the trained
state is left as the modules keep it). On the CPU the FP8 numerics run in jax.numpy, compiled by
XLA, and XLA runs the FP8 GEMMs in software.
"""
from __future__ import annotations

import platform
import time

import flax
import jax
import jax.numpy as jnp
import numpy as np
import optax
from flax.training.train_state import TrainState

import fusedfp8
import fusedfp8.jax as fjax
from fusedfp8.jax.flax import OVERWRITE_WITH_GRADIENT, Fp8MLP

from .config import Curve, DemoConfig, DemoError, joined_state, tensor_names
from .task import FlaxMLP, Task, flax_initial_params, flax_variables

LINEAR_GRAD = (False, False, True)  # an FP8 linear's tensors: input, weight, output gradient


def _device(device: str):
    """The jax device for 'cuda' / 'cpu'; DemoError when jax has no GPU backend."""
    plat = "gpu" if device == "cuda" else "cpu"
    try:
        return jax.devices(plat)[0]
    except RuntimeError as e:
        raise DemoError(f"--framework jax on {device}: jax has no {plat} backend ({e}); install a CUDA build of "
                        "jax or pass --device cpu") from None


def _state(variables: dict) -> fusedfp8.ScalingState:
    """The :class:`fusedfp8.ScalingState` of one FP8 linear's variables (float32 counters -> int32)."""
    return fusedfp8.ScalingState(amax_history=variables["amax_history"], scale=variables["scale"],
                                 scale_inv=variables["scale_inv"], overflows=variables["overflows"].astype(jnp.int32),
                                 updates=variables["updates"].astype(jnp.int32), grad=LINEAR_GRAD)


def _train_one(model, variables: dict, config: DemoConfig, device: str, x, y, bar) -> Curve:
    recipe = config.recipe
    fp8_mods = sorted(variables.get(OVERWRITE_WITH_GRADIENT, {}))  # ['fc1', 'fc2']
    state = TrainState.create(apply_fn=model.apply, params=variables, tx=optax.adam(config.lr))

    def updated(params) -> list:
        """Each FP8 linear's state after the update that turns this step's staged amaxes (row 0
        of its history) into the next step's scales (the step returns them, joined: their scales
        are plotted, the last step's go into the summary table)."""
        return [fjax.update_scales(_state(params[OVERWRITE_WITH_GRADIENT][m]), recipe) for m in fp8_mods]

    def step(state, x, y):
        def loss_fn(params):
            out = model.apply(params, x)
            return jnp.mean((out.astype(jnp.float32) - y.astype(jnp.float32)) ** 2)

        loss, grads = jax.value_and_grad(loss_fn)(state.params)
        state = state.apply_gradients(grads=grads)  # stores the new FP8 states
        if not fp8_mods:
            return state, loss, None, None
        amax = jnp.concatenate([state.params[OVERWRITE_WITH_GRADIENT][m]["amax_history"][0] for m in fp8_mods])
        return state, loss, amax, joined_state(updated(state.params), lambda arrays: jnp.concatenate(arrays, -1))

    bar.set_postfix_str("compiling")
    step = jax.jit(step, donate_argnums=0).lower(state, x, y).compile()  # outside the timed steps
    losses, amaxes, scales, step_ms = [], [], [], []
    for _ in range(config.steps):
        t0 = time.perf_counter()
        state, loss, amax, updated_state = step(state, x, y)
        jax.block_until_ready(loss)  # device-side completion of the whole step
        jax.block_until_ready(state)
        step_ms.append((time.perf_counter() - t0) * 1e3)
        losses.append(loss)
        amaxes.append(amax)
        scales.append(None if updated_state is None else updated_state.scale)
        if device == "cpu":
            bar.set_postfix_str(f"loss {float(loss):.4f}")
        bar.update(1)
    curve = Curve(loss=np.asarray(jax.device_get(losses), np.float32), step_ms=np.array(step_ms))
    bar.set_postfix_str(f"loss {curve.loss[-1]:.4f}")
    if fp8_mods:
        curve.tensors = tensor_names(fp8_mods)
        curve.amax = np.asarray(jax.device_get(amaxes), np.float32)
        curve.scale = np.asarray(jax.device_get(scales), np.float32)
        curve.state_table = updated_state.summary(recipe, curve.tensors)
        curve.overflows = np.asarray(updated_state.overflows)
    return curve


def train(config: DemoConfig, device: str, bar) -> dict:
    """{'bf16': Curve, 'fp8': Curve} of ``config`` on ``device`` ('cuda' or 'cpu')."""
    dev = _device(device)
    hidden, ffn, tokens = config.shape_for(device)
    models = {"bf16": FlaxMLP(ffn, dtype=jnp.bfloat16, param_dtype=jnp.bfloat16),
              "fp8": Fp8MLP(ffn, recipe=config.recipe, param_dtype=jnp.bfloat16)}
    curves = {}
    with jax.default_device(dev):
        x, y = Task(hidden, tokens, config.seed).jax_batch(0, dev)
        params = flax_initial_params(hidden, ffn, config.seed, "f32")
        for kind, model in models.items():
            bar.set_description(f"{kind} ({device}, jax)")
            curves[kind] = _train_one(model, flax_variables(model, params, hidden), config, device, x, y, bar)
    return curves


def meta(device: str) -> dict:
    """Versions and the device's name, for the JSON."""
    dev = _device(device)
    return {"jax": jax.__version__, "flax": flax.__version__, "optax": optax.__version__, "jax_backend": dev.platform,
            "device_name": dev.device_kind if device == "cuda" else platform.processor() or platform.machine() or "cpu"}
