"""impl 'ptx' on a GPU (fusedfp8/jax/ptx.py: every launch of a plan as one of XLA's own PTX custom
calls): byte for byte the 'ffi' path (the same kernels, plans and grids; the first step as the
two-launch plan instead of the cooperative launch) and the jax.numpy path, over a first step and a
later one (after update_scales), every op, transpose, dbias, padding, ragged, empty and 3-d shapes,
and the amax-only launch; the FUSEDFP8_JAX_IMPL override of impl='auto'; a flax train step (the
seed's block with Fp8DotGeneral, and Fp8MLP, whose LayerNorm falls back to 'ffi') equal to the
'ffi' one. One jit per (case, impl): fast enough for a GPU session (about a minute at -n 8).
Skipped with the probe's reason where there is no GPU with jax's GPU backend, or where this jaxlib
lacks the PTX custom call. (Lowering without a GPU: test_jax_ptx_lowering.py.)"""
from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import fusedfp8
from fusedfp8.jax import gemm as G
from fusedfp8.jax.flax import OVERWRITE_WITH_GRADIENT
from fusedfp8.jax import primitives as P
from fusedfp8.jax import ptx as X
from fusedfp8.state import STATE_FIELDS, ScalingState
from support.frameworks import mse_train_step
from support.ptx import require_ptx

pytestmark = [pytest.mark.gpu, pytest.mark.jax_gpu]

RECIPE = fusedfp8.DelayedScaling(amax_history_len=8)


@pytest.fixture(autouse=True, scope="module")
def ptx_runs_here():
    require_ptx()


def gpu(a):
    return jax.device_put(a, jax.devices("gpu")[0])


def inputs(shape, dtype, seed, scale, special=False):
    rng = np.random.default_rng(seed)
    x = (rng.standard_normal(shape) * scale).astype(np.float32)
    if x.size and special:
        x.reshape(-1)[:4] = [np.inf, -0.0, 1e-40, 448.0][: min(4, x.size)]
    return gpu(jnp.asarray(x).astype(dtype))


def u8(a) -> np.ndarray:
    return np.asarray(jax.device_get(a)).reshape(-1).view(np.uint8)  # (a 0-d amax too)


def _quantizations(dy, x, st, impl, pad_to):
    """The three ops on one state: quantize (E4M3, transpose), gelu_quantize (flat, erf) and
    dgelu_quantize (E5M2, transpose, dbias), and the amax-only launch of dgelu."""
    r0, st = P.quantize(x, st, 0, RECIPE, transpose=True, pad_to=pad_to, impl=impl)
    r1, st = P.gelu_quantize(x, st, 1, RECIPE, approximate="none", pad_to=pad_to, impl=impl)
    r2, st = P.dgelu_quantize(dy, x, st, 2, RECIPE, transpose=True, dbias=True, pad_to=pad_to, impl=impl)
    return (r0, r1, r2), st, P.amax(dy, x, op="dgelu", impl=impl)


def _two_steps(dy, x, dy2, x2, st, impl, pad_to):
    """A first step (updates 0: the scale of the tensor's own amax), update_scales, a later step."""
    first, st, a1 = _quantizations(dy, x, st, impl, pad_to)
    st = P.update_scales(st, RECIPE, impl=impl)
    later, st2, a2 = _quantizations(dy2, x2, st, impl, pad_to)
    return first, later, st, st2, a1, a2


@functools.lru_cache(maxsize=None)
def program(impl, pad_to):
    return jax.jit(functools.partial(_two_steps, impl=impl, pad_to=pad_to))


def flat_bytes(out) -> dict:
    """name -> the bytes (or float64 values, for dbias) of every result of _two_steps."""
    first, later, st, st2, a1, a2 = out
    got = {}
    for step, rs in (("first", first), ("later", later)):
        for k, r in enumerate(rs):
            got[f"{step}[{k}].data"] = u8(r.data)
            got[f"{step}[{k}].scale_inv"] = u8(r.scale_inv)
            got[f"{step}[{k}].amax"] = u8(r.amax)
            if r.data_t is not None:
                got[f"{step}[{k}].data_t"] = u8(r.data_t)
            if r.dbias is not None:
                got[f"{step}[{k}].dbias"] = np.asarray(r.dbias, np.float64)
    for name, s in (("after update", st), ("after later", st2)):
        for f in STATE_FIELDS:
            got[f"{name}: state.{f}"] = u8(getattr(s, f))
    got["amax first"], got["amax later"] = u8(a1), u8(a2)
    return got


CASES = {  # id -> (shape, dtype, pad_to, edge values in x: inf, -0, a denormal, 448)
    "seed-2048x1024-bf16": ((2048, 1024), "bfloat16", 1, False),
    "aligned-256x1024-f32-special": ((256, 1024), "float32", 1, True),
    "ragged-303x300-bf16-special": ((303, 300), "bfloat16", 1, True),
    "ragged-303x300-bf16-pad16": ((303, 300), "bfloat16", 16, False),
    "rows-only-pad-300x32-f16-pad16": ((300, 32), "float16", 16, False),
    "ragged-3d-3x5x7-f16": ((3, 5, 7), "float16", 1, False),
    "ragged-1x1-f32": ((1, 1), "float32", 1, False),
    "ragged-0x16-bf16": ((0, 16), "bfloat16", 1, False),
}


@pytest.mark.parametrize("shape, dtype, pad_to, special", [pytest.param(*c, id=i) for i, c in CASES.items()])
def test_ptx_is_byte_for_byte_ffi_and_jnp(shape, dtype, pad_to, special):
    """Every FP8 byte, scale_inv, amax and state byte of both steps equal across ptx, ffi and jnp;
    dbias equal to ffi's bit for bit (the same kernel and grid) and to jnp's to float32 rounding."""
    args = (inputs(shape, dtype, 1, 1e-2), inputs(shape, dtype, 2, 3.0, special), inputs(shape, dtype, 3, 2e-2),
            inputs(shape, dtype, 4, 5.0), ScalingState.create((False, False, True), RECIPE, like=gpu(jnp.zeros(1))))
    got = {impl: flat_bytes(program(impl, pad_to)(*args)) for impl in ("ptx", "ffi", "jnp")}
    assert set(got["ptx"]) == set(got["ffi"]) == set(got["jnp"])
    for name, v in got["ptx"].items():
        np.testing.assert_array_equal(v, got["ffi"][name], err_msg=f"ptx vs ffi: {name}")
        if name.endswith(".dbias"):
            np.testing.assert_allclose(v, got["jnp"][name], rtol=1e-5, atol=1e-6, err_msg=f"ptx vs jnp: {name}")
        else:
            np.testing.assert_array_equal(v, got["jnp"][name], err_msg=f"ptx vs jnp: {name}")
    if np.prod(shape) and not special:  # the first step staged finite amaxes: every tensor updated once
        assert got["ptx"]["after update: state.updates"].view(np.int32).tolist() == [1, 1, 1]


def test_ptx_program_has_ptx_calls_and_no_ffi_launch():
    """The compiled program of impl 'ptx': only XLA's PTX calls (a first step: pre-pass + cast per
    tensor, one update), no fusedfp8_launch."""
    x = inputs((256, 512), "bfloat16", 0, 1.0)
    st = ScalingState.create((False, False, True), RECIPE, like=gpu(jnp.zeros(1)))
    text = jax.jit(functools.partial(_two_steps, impl="ptx", pad_to=1)).lower(x, x, x, x, st).compile().as_text()
    assert "fusedfp8_launch" not in text
    assert text.count(X.TARGET) >= 2 * (2 * 3 + 1) + 1, text.count(X.TARGET)


def test_environment_override_runs_auto_as_ptx(monkeypatch):
    monkeypatch.setenv("FUSEDFP8_JAX_IMPL", "ptx")
    x = inputs((128, 256), "bfloat16", 0, 1.0)
    st = ScalingState.create((False, False, True), RECIPE, like=gpu(jnp.zeros(1)))
    fn = functools.partial(_two_steps, impl="auto", pad_to=1)
    text = jax.jit(fn).lower(x, x, x, x, st).as_text()
    assert X.TARGET in text and "fusedfp8_launch" not in text
    got = flat_bytes(jax.jit(fn)(x, x, x, x, st))
    want = flat_bytes(program("ffi", 1)(x, x, x, x, st))
    for name, v in want.items():
        np.testing.assert_array_equal(got[name], v, err_msg=name)


# ---- a flax train step ---------------------------------------------------------------------------
def _seed_model(impl):
    import flax.linen as nn

    from fusedfp8.jax.flax import Fp8DotGeneral

    class Block(nn.Module):  # scripts/seed_flax_mlp.py's MLP at a small size
        @nn.compact
        def __call__(self, x):
            dg = functools.partial(Fp8DotGeneral, impl=impl, recipe=RECIPE)
            x = nn.LayerNorm(dtype=jnp.bfloat16)(x)
            x = nn.DenseGeneral(1024, dtype=jnp.bfloat16, dot_general_cls=dg)(x)
            return nn.DenseGeneral(256, dtype=jnp.bfloat16, dot_general_cls=dg)(nn.gelu(x))

    return Block()


def _fp8_mlp(impl):
    from fusedfp8.jax.flax import Fp8MLP

    return Fp8MLP(1024, impl=impl, recipe=RECIPE, dtype=jnp.bfloat16)


@pytest.mark.fp8_gemm
@pytest.mark.parametrize("make", [_seed_model, _fp8_mlp], ids=["seed-block", "fp8_mlp"])
def test_flax_train_steps_ptx_equal_ffi(make):
    """Three Adam steps of the same model and data under impl 'ptx' and 'ffi' (the GEMM, and
    Fp8MLP's LayerNorm, are the FFI calls in both): the FP8 state (amax histories, scales, counters)
    byte for byte, the losses and parameters to float32 rounding (the programs differ only in how
    the quantizations are called; XLA may fuse around them differently)."""
    import optax
    from flax.training.train_state import TrainState

    x = inputs((2, 256, 256), "bfloat16", 0, 1.0)
    y = inputs((2, 256, 256), "bfloat16", 1, 0.5)
    variables = jax.jit(make("ffi").init)(jax.random.key(0), x)
    runs = {}
    for impl in ("ptx", "ffi"):
        model = make(impl)
        state = TrainState.create(apply_fn=model.apply, params=variables, tx=optax.adam(1e-3))
        step = mse_train_step(x, y)
        if impl == "ptx":
            text = step.lower(state).compile().as_text()
            assert X.TARGET in text and G.TARGET in text
        losses = []
        for _ in range(3):
            state, loss = step(state)
            losses.append(float(loss))
        runs[impl] = (state.params, losses)
    (pp, lp), (pf, lf) = runs["ptx"], runs["ffi"]
    np.testing.assert_allclose(lp, lf, rtol=1e-6)
    flat_p = jax.tree_util.tree_flatten_with_path(pp)[0]
    flat_f = dict(jax.tree_util.tree_flatten_with_path(pf)[0])
    n_state = 0
    for path, v in flat_p:
        name = jax.tree_util.keystr(path)
        w = flat_f[path]
        if OVERWRITE_WITH_GRADIENT in name:  # the FP8 meta (amax history, scales, counters)
            np.testing.assert_array_equal(u8(v), u8(w), err_msg=name)
            n_state += 1
        else:
            np.testing.assert_allclose(np.asarray(v, np.float64), np.asarray(w, np.float64), rtol=1e-5, atol=1e-7,
                                       err_msg=name)
    assert n_state >= 2 * len(STATE_FIELDS)  # the meta of both layers was compared
