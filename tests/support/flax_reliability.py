"""Fault injection in flax FP8 training (the flax twin of tests/support/reliability.py), on the
jax.numpy path: shared by tests/jax/test_flax_reliability.py and tests/run/flax_checkpoint.py.

The model is Dense(Fp8DotGeneral) -> residual Fp8MLP -> Dense(Fp8DotGeneral), trained with Adam
(cosine schedule over 100 steps) through a flax ``TrainState`` on a noisy linear teacher (fresh
batches; the label noise sets a loss floor). A fault puts inf or NaN into one element of the input
batch. The train step does what a mixed-precision loop does: it keeps the parameters and
optimizer state when a gradient is not finite (FP8 saturates inf to the format's max, so an inf
alone leaves the gradients finite; a NaN does not), and always stores the new FP8 state (the
'_overwrite_with_gradient' "gradient").

Flax defers the scale update to the next forward: the state stored after step k has step k's
amaxes staged in row 0 of the history, and step k+1 first applies the update rule to it. So a
fault at step f shows in the state stored after step f+1 (rows 1.. and the other arrays are the
rule applied to the state stored after step f).
"""
from __future__ import annotations

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import optax
from flax.training.train_state import TrainState

import fusedfp8
from fusedfp8.jax.flax import OVERWRITE_WITH_GRADIENT as OWG
from fusedfp8.jax.flax import STATE_VARIABLES, Fp8DotGeneral, Fp8MLP
from fusedfp8.recipe import DelayedScaling
from fusedfp8.state import STATE_FIELDS, ScalingState

IN, HIDDEN, FFN, OUT, BATCH = 16, 32, 64, 8, 32
TOTAL = 100
RECIPE = DelayedScaling(amax_history_len=16)
FAULTS = ("input-inf", "input-nan")
# modules in MODULES order; column 0 input, 1 weight, 2 output gradient
MODULES = (("l0", "Fp8DotGeneral_0"), ("mlp", "fc1"), ("mlp", "fc2"), ("head", "Fp8DotGeneral_0"))
ALL_ACTIVATIONS = {(m, c) for m in range(4) for c in (0, 2)}
EXPECTED_OVERFLOWS = {"input-inf": {(0, 0)}, "input-nan": ALL_ACTIVATIONS}


def _fp8_dense(features, name):
    return nn.Dense(features, dot_general_cls=lambda: Fp8DotGeneral(recipe=RECIPE, impl="jnp"), name=name)


class Net(nn.Module):
    @nn.compact
    def __call__(self, x):
        h = _fp8_dense(HIDDEN, "l0")(x)
        return _fp8_dense(OUT, "head")(h + Fp8MLP(FFN, recipe=RECIPE, impl="jnp", name="mlp")(h))


class Task:
    """y = x @ W + 0.5 noise, x with rows of varied magnitude; batch(step) is a fresh batch."""

    def __init__(self, seed=123):
        self.seed = seed
        self.w = np.random.default_rng(seed).standard_normal((IN, OUT)).astype(np.float32) / IN ** 0.5
        (x1, y1), (x2, y2) = self.batch(10_000), self.batch(10_001)
        self.eval_x, self.eval_y = np.concatenate([x1, x2]), np.concatenate([y1, y2])

    def batch(self, step: int, fault: str | None = None):
        g = np.random.default_rng(self.seed * 100_003 + step)
        x = (g.standard_normal((BATCH, IN)) * np.exp2(g.integers(-2, 3, (BATCH, 1)))).astype(np.float32)
        y = (x @ self.w + 0.5 * g.standard_normal((BATCH, OUT))).astype(np.float32)
        if fault is not None:
            x[3, 5] = float(fault.split("-")[1])
        return x, y


MODEL = Net()
TX = optax.adam(optax.cosine_decay_schedule(1e-2, TOTAL))  # one model and tx: train_step compiles once


def make_state(seed=0) -> TrainState:
    variables = jax.jit(MODEL.init)(jax.random.key(seed), jnp.zeros((BATCH, IN), jnp.float32))
    # step as an array from the start (a Python int would make the second call compile again)
    return TrainState.create(apply_fn=MODEL.apply, params=variables, tx=TX).replace(step=jnp.zeros((), jnp.int32))


@jax.jit
def train_step(state: TrainState, x, y):
    """(new state, loss, whether the optimizer stepped)."""
    def loss_fn(v):
        return jnp.mean((state.apply_fn(v, x) - y) ** 2)

    loss, grads = jax.value_and_grad(loss_fn)(state.params)
    finite = jnp.all(jnp.asarray([jnp.isfinite(g).all() for g in jax.tree.leaves(grads["params"])]))
    new = state.apply_gradients(grads=grads)
    keep = lambda a, b: jnp.where(finite, a, b)  # noqa: E731
    new = new.replace(params={"params": jax.tree.map(keep, new.params["params"], state.params["params"]),
                              OWG: new.params[OWG]},  # the FP8 state: always
                      opt_state=jax.tree.map(keep, new.opt_state, state.opt_state))
    return new, loss, finite


@jax.jit
def _predict(variables, x):
    return MODEL.apply(variables, x)


def eval_loss(state: TrainState, task: Task) -> float:
    return float(jnp.mean((_predict(state.params, task.eval_x) - task.eval_y) ** 2))


def states(state: TrainState) -> list[dict]:
    """Every module's FP8 state as numpy copies (counters as stored: float32), in MODULES order."""
    owg = state.params[OWG]
    return [{f: np.array(owg[a][b][f]) for f in STATE_VARIABLES} for a, b in MODULES]


def reference_update(stored: dict) -> dict:
    """The reference update rule (numpy) applied to a copy of one stored (staged) state."""
    twin = ScalingState(**{f: np.array(stored[f], np.float32 if f not in ("overflows", "updates") else np.int32)
                           for f in STATE_FIELDS}, grad=(False, False, True))
    fusedfp8.update_scales(twin, RECIPE)
    return {f: np.asarray(getattr(twin, f), np.float32) for f in STATE_FIELDS}


def _check_applied(want: dict, got: dict, tag: str) -> None:
    """``got`` (stored after the next step) is ``want`` with a new row 0 staged, and every other
    stored variable (beyond the state's arrays) marks a valid, written state (1)."""
    for f in STATE_FIELDS:
        w, g = (want[f][1:], got[f][1:]) if f == "amax_history" else (want[f], got[f])
        assert w.tobytes() == g.tobytes(), f"{tag}: {f}"
    for f in set(STATE_VARIABLES) - set(STATE_FIELDS):
        assert (got[f] == 1).all(), f"{tag}: {f} = {got[f]}"


def check_fault_step(fault: str, warm: int = 12, after: int = 30) -> None:
    task = Task()
    st = make_state()
    losses = []
    for s in range(warm):
        st, loss, _ = train_step(st, *task.batch(s))
        losses.append(float(loss))
    before = states(st)  # staged by step warm-1
    st, loss, stepped = train_step(st, *task.batch(warm, fault))
    assert bool(stepped) == (fault == "input-inf"), (fault, float(loss))
    staged_fault = states(st)
    for m in range(4):  # the faulty amax is staged as it came (the rule deals with it next step)
        assert (m, 0) not in EXPECTED_OVERFLOWS[fault] or not np.isfinite(staged_fault[m]["amax_history"][0, 0])
    st, loss_next, stepped_next = train_step(st, *task.batch(warm + 1))
    assert bool(stepped_next)
    applied = states(st)  # the rule applied to the faulty step's staged state, then a clean amax staged
    for m in range(4):
        _check_applied(reference_update(staged_fault[m]), applied[m], f"{fault}: module {m} vs the reference")
        b, a = staged_fault[m], applied[m]
        for c in range(3):
            tag = f"{fault}: module {m} column {c}"
            if (m, c) in EXPECTED_OVERFLOWS[fault]:
                assert a["overflows"][c] == b["overflows"][c] + 1, tag
                assert a["scale"][c].tobytes() == b["scale"][c].tobytes(), tag + ": scale kept"
                assert a["scale_inv"][c].tobytes() == b["scale_inv"][c].tobytes(), tag
                assert a["amax_history"][1:, c].tobytes() == b["amax_history"][1:, c].tobytes(), tag + ": no roll"
                assert a["updates"][c] == b["updates"][c], tag
            else:
                assert a["overflows"][c] == b["overflows"][c], tag
                assert a["updates"][c] == b["updates"][c] + 1, tag + ": a normal update"
            assert np.isfinite(a["amax_history"]).all() and np.isfinite(a["scale"]).all(), tag + ": not poisoned"
        assert np.isfinite(a["amax_history"][0]).all()  # the clean step staged finite amaxes
        assert (before[m]["overflows"] == b["overflows"]).all()
    # the next clean step updates every tensor normally
    st, loss2, _ = train_step(st, *task.batch(warm + 2))
    now = states(st)
    for m in range(4):
        _check_applied(reference_update(applied[m]), now[m], f"{fault}: module {m} after the next clean step")
        assert (now[m]["updates"] == applied[m]["updates"] + 1).all(), fault
        assert (now[m]["overflows"] == applied[m]["overflows"]).all(), fault
    losses += [float(loss), float(loss_next), float(loss2)]
    for s in range(warm + 3, warm + 3 + after):
        st, loss, _ = train_step(st, *task.batch(s))
        losses.append(float(loss))
    assert np.isfinite(losses[warm + 1:]).all(), losses
    assert np.mean(losses[-5:]) < 0.7 * np.mean(losses[warm - 5:warm]), losses


def fault_at(s: int, every: int = 10) -> str | None:
    return FAULTS[(s // every) % len(FAULTS)] if s % every == every - 1 else None


def check_periodic_overflows(steps: int = TOTAL, tol: float = 0.02) -> dict:
    """A run with a fault every 10th step (alternating FAULTS) ends within ``tol`` of the clean
    run's held-out loss. The clean run leaves out the optimizer steps that the faulty run must
    skip (its NaN batches: 5 of 100 steps of a cosine schedule), so that the comparison measures
    what the overflows do to the FP8 state and to training, not the cost of 5% fewer steps: with
    every step in the clean run the gap was 1.1-3.5% depending on the LayerNorm's epsilon and on
    whether it is fused (2026-12-03), all of it above the task's noise floor. Returns the numbers."""
    task = Task()
    result = {}
    for name in ("clean", "faulty"):
        st = make_state()
        skipped = 0
        for s in range(steps):
            fault = fault_at(s)
            if name == "clean" and fault == "input-nan":
                continue  # the step the faulty run cannot take
            st, _, stepped = train_step(st, *task.batch(s, fault if name == "faulty" else None))
            skipped += not bool(stepped)
        st, _, _ = train_step(st, *task.batch(steps))  # applies the last staged amaxes (lr is 0 by now)
        overflows = sum(float(m["overflows"].sum()) for m in states(st))
        result[name] = (eval_loss(st, task), skipped, overflows)
    (clean, clean_skipped, clean_over), (faulty, skipped, over) = result["clean"], result["faulty"]
    assert clean_skipped == 0 and clean_over == 0, result
    assert skipped == sum(fault_at(s) == "input-nan" for s in range(steps)), result
    assert over > 0, result
    assert abs(faulty - clean) <= tol * clean, result
    return result
