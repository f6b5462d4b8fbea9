"""The bad-input matrix (issue 8) for fusedfp8.jax and its flax modules, on the jax.numpy path
(the torch / ops / state matrix is tests/api/test_bad_input.py): every rejected call raises the
documented exception type with a message that names the argument. jax arrays are immutable, so
"no state changed" means: the call raised before any quantize / update primitive was dispatched
(a counter on primitives._dispatch stays at 0), and every variable the world holds (a Dense with
Fp8DotGeneral and an Fp8MLP, trained one step, and a float32 meta) is byte-identical afterwards,
as is the tree that holds them (flax apply could write into it)."""
from __future__ import annotations

import re

import flax.linen as fnn
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from fusedfp8.jax import functional as JF
from fusedfp8.jax import gemm as JG
from fusedfp8.jax import meta as JM
from fusedfp8.jax import primitives as JP
from fusedfp8.jax.flax import OVERWRITE_WITH_GRADIENT as OWG
from fusedfp8.jax.flax import Fp8DotGeneral, Fp8MLP
from fusedfp8.recipe import DelayedScaling
from support.frameworks import bytes_of as _bytes

R = DelayedScaling(amax_history_len=8)
R_OTHER = DelayedScaling(amax_history_len=16)


def _param(case):
    return pytest.param(*case, id=case[0])


def _dense(recipe=R):
    return fnn.Dense(16, dot_general_cls=lambda: Fp8DotGeneral(recipe=recipe, impl="jnp"))


class JaxWorld:
    """Variables of a Dense(Fp8DotGeneral) and an Fp8MLP after one training step (staged amaxes,
    scales set), a meta, an input. Built once; values are immutable, so every case shares it."""

    _built = None

    @classmethod
    def get(cls) -> "JaxWorld":
        if cls._built is None:
            cls._built = cls()
        return cls._built

    def __init__(self):
        rng = np.random.default_rng(0)
        self.x = jnp.asarray((rng.standard_normal((4, 16)) * 10).astype(np.float32))
        self.w = jnp.asarray(rng.standard_normal((16, 16)).astype(np.float32))
        self.dense, self.mlp = _dense(), Fp8MLP(32, recipe=R, impl="jnp")
        variables = jax.jit(self.dense.init)(jax.random.key(0), self.x)
        step = jax.jit(jax.grad(lambda v: jnp.mean(self.dense.apply(v, self.x) ** 2)))
        self.dense_vars = self._apply(variables, step(variables))
        self.dense_next = step(self.dense_vars)[OWG]  # for the control: what an accepted step returns
        self.meta = tuple(self.dense_vars[OWG]["Fp8DotGeneral_0"][k] for k in JM.META_FIELDS)
        # the MLP's FP8 state: the trained Dense's (same shapes; compiling an MLP step costs seconds)
        mlp_vars = jax.jit(self.mlp.init)(jax.random.key(1), self.x)
        self.mlp_vars = {**mlp_vars, OWG: {"fc1": self.dense_vars[OWG]["Fp8DotGeneral_0"],
                                           "fc2": self.dense_vars[OWG]["Fp8DotGeneral_0"]}}

    @staticmethod
    def _apply(variables, grads):
        """One SGD step; the overwrite-with-gradient convention: the state's gradient is the new state."""
        return {"params": jax.tree.map(lambda p, g: p - 0.1 * g, variables["params"], grads["params"]), OWG: grads[OWG]}

    def snapshot(self) -> list:
        trees = (self.x, self.w, self.meta, self.dense_vars, self.mlp_vars)
        return [jax.tree.structure(trees)] + [_bytes(a) for a in jax.tree.leaves(trees)]


def _with_var(variables, module, **replace):
    """A copy of flax ``variables`` with some FP8 state variables of ``module`` replaced."""
    owg = dict(variables[OWG])
    owg[module] = {**owg[module], **replace}
    return {**variables, OWG: owg}


JAX_CASES = [
    # ---- fp8_dot / fp8_mlp (functional) --------------------------------------------------------
    ("jax-dot-x-int32", lambda w: lambda: JF.fp8_dot(w.x.astype(jnp.int32), w.w, w.meta, R, impl="jnp"),
     TypeError, r"^x must be float32, float16 or bfloat16; got int32"),
    ("jax-dot-x-3d", lambda w: lambda: JF.fp8_dot(w.x.reshape(2, 2, 16), w.w, w.meta, R, impl="jnp"),
     ValueError, r"^x must be 2-D; got shape \(2, 2, 16\)"),
    ("jax-dot-w-1d", lambda w: lambda: JF.fp8_dot(w.x, w.w[0], w.meta, R, impl="jnp"),
     ValueError, r"^w must be 2-D; got shape \(16,\)"),
    ("jax-dot-recipe-a-string", lambda w: lambda: JF.fp8_dot(w.x, w.w, w.meta, "hybrid", impl="jnp"),
     TypeError, r"^recipe must be a fusedfp8\.DelayedScaling, a fusedfp8\.CurrentScaling or a fusedfp8\.BlockScaling; "
     r"got str"),
    ("jax-dot-meta-history-of-another-recipe", lambda w: lambda: JF.fp8_dot(w.x, w.w, w.meta, R_OTHER, impl="jnp"),
     ValueError, r"^meta\.amax_history must be float32 of shape \(16, 3\) \(recipe\.amax_history_len=16\); got "
                 r"float32 \(8, 3\)"),
    ("jax-dot-meta-missing-a-field", lambda w: lambda: JF.fp8_dot(w.x, w.w, w.meta[:4], R, impl="jnp"),
     TypeError, r"^meta must be a tuple \(" + ", ".join(JM.META_FIELDS) + r"\); got tuple of length 4"),
    ("jax-dot-meta-int-counters", lambda w: lambda: JF.fp8_dot(
        w.x, w.w, w.meta[:3] + (w.meta[3].astype(jnp.int32),) + w.meta[4:], R, impl="jnp"),
     ValueError, r"^meta\.overflows must be float32 of shape \(3,\)"),
    ("jax-dot-out-dtype-int8", lambda w: lambda: JF.fp8_dot(w.x, w.w, w.meta, R, out_dtype=jnp.int8, impl="jnp"),
     TypeError, r"^out_dtype must be float32, float16 or bfloat16; got int8"),
    ("jax-dot-unknown-impl", lambda w: lambda: JF.fp8_dot(w.x, w.w, w.meta, R, impl="cuda"),
     ValueError, r"^impl must be one of " + re.escape(repr(tuple(JP.IMPLS))) + r"; got 'cuda'"),
    ("jax-mlp-b1-wrong-shape", lambda w: lambda: JF.fp8_mlp(
        w.x, w.w, jnp.zeros(3), w.w, jnp.zeros(16), w.meta, w.meta, R, impl="jnp"),
     ValueError, r"^b1 must have shape \(16,\) and b2 \(16,\); got \(3,\), \(16,\)"),
    ("jax-mlp-meta2-of-another-recipe", lambda w: lambda: JF.fp8_mlp(
        w.x, w.w, jnp.zeros(16), w.w, jnp.zeros(16), w.meta, JM.fresh_meta(R_OTHER), R, impl="jnp"),
     ValueError, r"^meta2\.amax_history must be float32 of shape \(8, 3\)"),
    # ---- primitives --------------------------------------------------------------------------
    ("jax-quantize-state-a-tuple", lambda w: lambda: JP.quantize(w.x, w.meta, 0, R, impl="jnp"),
     TypeError, r"^state must be a fusedfp8\.ScalingState \(of jax arrays\); got tuple"),
    ("jax-quantize-transpose-of-a-scalar", lambda w: lambda: JP.quantize(
        w.x[0, 0], JM.meta_to_state(w.meta), 0, R, transpose=True, impl="jnp"),
     ValueError, r"^x: transpose / dbias need an input of at least 1 dimension; got a scalar"),
    ("jax-quantize-recipe-of-another-length", lambda w: lambda: JP.quantize(
        w.x, JM.meta_to_state(w.meta), 0, R_OTHER, impl="jnp"),
     ValueError, r"amax_history_len is 16"),
    ("jax-quantize-vmapped-over-the-tensor-index", lambda w: lambda: jax.vmap(
        lambda i: JP.quantize(w.x, JM.meta_to_state(w.meta), i, R, impl="jnp"))(jnp.arange(3)),
     TypeError, r"^index must be an int; got .*Tracer"),
    ("jax-update-scales-recipe-a-string", lambda w: lambda: JP.update_scales(JM.meta_to_state(w.meta), "hybrid"),
     TypeError, r"^recipe must be a fusedfp8\.DelayedScaling or a fusedfp8\.CurrentScaling; got str"),
    ("jax-dgelu-shapes-differ", lambda w: lambda: JP.dgelu_quantize(
        w.x, w.x[:, :8], JM.meta_to_state(w.meta), 2, R, impl="jnp"),
     ValueError, r"^dy and x must have the same shape and dtype; got \(4, 16\) float32 and \(4, 8\) float32"),
    # ---- flax: Dense(dot_general_cls=Fp8DotGeneral), Fp8MLP ----------------------------------
    ("flax-dense-variables-of-another-recipe", lambda w: lambda: _dense(R_OTHER).apply(
        w.dense_vars, w.x, mutable=[OWG]),
     ValueError, r"^Fp8DotGeneral: variable 'amax_history' has shape \(8, 3\) but the recipe "
                 r"\(amax_history_len=16\) needs \(16, 3\)"),
    ("flax-dense-scale-of-the-wrong-shape", lambda w: lambda: w.dense.apply(
        _with_var(w.dense_vars, "Fp8DotGeneral_0", scale=jnp.ones(2)), w.x, mutable=[OWG]),
     ValueError, r"^Fp8DotGeneral: variable 'scale' has shape \(2,\) but the recipe \(amax_history_len=8\) needs "
                 r"\(3,\)"),
    ("flax-dense-int32-counters", lambda w: lambda: w.dense.apply(
        _with_var(w.dense_vars, "Fp8DotGeneral_0", updates=jnp.zeros(3, jnp.int32)), w.x, mutable=[OWG]),
     TypeError, r"^Fp8DotGeneral: variable 'updates' must be float32 \(or flax's fp32_max_grad\); got int32"),
    ("flax-dense-recipe-a-string", lambda w: lambda: fnn.Dense(16, dot_general_cls=lambda: Fp8DotGeneral(
        recipe="hybrid")).apply(w.dense_vars, w.x, mutable=[OWG]),
     TypeError, r"^Fp8DotGeneral\.recipe must be a fusedfp8\.DelayedScaling, a fusedfp8\.CurrentScaling or a "
                r"fusedfp8\.BlockScaling; got str"),
    ("flax-dense-unknown-impl", lambda w: lambda: fnn.Dense(16, dot_general_cls=lambda: Fp8DotGeneral(
        recipe=R, impl="cuda")).apply(w.dense_vars, w.x, mutable=[OWG]),
     ValueError, r"^impl must be one of .*; got 'cuda'"),
    ("flax-dotgeneral-batch-dimensions", lambda w: lambda: Fp8DotGeneral(recipe=R, impl="jnp").init(
        jax.random.key(0), jnp.ones((2, 4, 8)), jnp.ones((2, 8, 3)), (((2,), (1,)), ((0,), (0,)))),
     ValueError, r"^Fp8DotGeneral supports lhs contracting its trailing and rhs its leading dimensions, without "
                 r"batch dimensions; got dimension_numbers="),
    ("flax-dotgeneral-rhs-contracting-its-last-dim", lambda w: lambda: Fp8DotGeneral(recipe=R, impl="jnp").apply(
        {OWG: w.dense_vars[OWG]["Fp8DotGeneral_0"]}, w.x, w.w, (((1,), (1,)), ((), ()))),
     ValueError, r"^Fp8DotGeneral supports .*dimension_numbers=\(\(\(1,\), \(1,\)\), \(\(\), \(\)\)\) for shapes "
                 r"\(4, 16\) and \(16, 16\)"),
    ("flax-mlp-input-int32", lambda w: lambda: w.mlp.apply(w.mlp_vars, w.x.astype(jnp.int32), mutable=[OWG]),
     TypeError, r"^Fp8MLP: x must be float32, float16 or bfloat16; got int32"),
    ("flax-mlp-variables-of-another-recipe", lambda w: lambda: Fp8MLP(32, recipe=R_OTHER, impl="jnp").apply(
        w.mlp_vars, w.x, mutable=[OWG]),
     ValueError, r"^_DenseParams: variable 'amax_history' has shape \(8, 3\) but the recipe \(amax_history_len=16\)"),
    ("flax-mlp-recipe-none", lambda w: lambda: Fp8MLP(32, recipe=None).apply(w.mlp_vars, w.x, mutable=[OWG]),
     TypeError, r"^Fp8MLP\.recipe must be a fusedfp8\.DelayedScaling, a fusedfp8\.CurrentScaling or a "
                r"fusedfp8\.BlockScaling; got NoneType"),
    ("flax-mlp-approximate-unknown", lambda w: lambda: Fp8MLP(32, recipe=R, approximate="erf", impl="jnp").apply(
        w.mlp_vars, w.x, mutable=[OWG]),
     ValueError, r"^approximate must be 'tanh' or 'none'; got 'erf'"),
]


@pytest.fixture
def dispatch_count(monkeypatch):
    """How many quantize / update primitives were dispatched (traced or run) since the fixture."""
    calls = []
    real = JP._dispatch
    monkeypatch.setattr(JP, "_dispatch", lambda *a, **k: (calls.append(a[0]), real(*a, **k))[1])
    return calls


@pytest.mark.parametrize("name, setup, exc, match", [_param(c) for c in JAX_CASES])
def test_jax_bad_input_is_refused_by_name_before_any_primitive_runs(name, setup, exc, match, dispatch_count):
    world = JaxWorld.get()
    dispatch_count.clear()  # (building the world dispatched)
    before = world.snapshot()
    call = setup(world)
    with pytest.raises(exc, match=match):
        call()
    assert dispatch_count == [], f"{name}: a primitive ran before the refusal"
    assert world.snapshot() == before, f"{name}: the world changed"


def test_the_jax_matrix_has_at_least_8_flax_cases():
    assert len(JAX_CASES) >= 25 and sum(c[0].startswith("flax-") for c in JAX_CASES) >= 8


def test_accepted_jax_calls_on_the_same_world_dispatch_and_return_a_new_state(dispatch_count):
    """Control: the checks above can fail. Good calls dispatch primitives (traced here with
    eval_shape), and an accepted training step returns FP8 state that differs from the world's
    (the next step's), while the world stays as it was."""
    world = JaxWorld.get()
    before = world.snapshot()
    dispatch_count.clear()
    for model, variables in ((world.dense, world.dense_vars), (world.mlp, world.mlp_vars)):
        n = len(dispatch_count)
        jax.eval_shape(jax.grad(lambda v: jnp.mean(model.apply(v, world.x) ** 2)), variables)
        assert len(dispatch_count) > n
    assert [_bytes(a) for a in jax.tree.leaves(world.dense_next)] != \
        [_bytes(a) for a in jax.tree.leaves(world.dense_vars[OWG])]
    assert world.snapshot() == before


def test_a_bad_gemm_bias_is_refused_naming_it():
    """fp8_gemm's bias: (n,) of the output's dtype, else ValueError naming it (no GPU needed)."""
    a = jnp.zeros((32, 64), jnp.float8_e4m3fn)
    s = jnp.ones((1,), jnp.float32)
    for bias, got in ((jnp.zeros((31,), jnp.bfloat16), "bfloat16 (31,)"), (jnp.zeros((32,), jnp.float32), "float32 (32,)")):
        with pytest.raises(ValueError, match=rf"^bias must be None or a \(32,\) bfloat16 array .*got {re.escape(got)}"):
            JG.fp8_gemm(a, a, s, s, jnp.bfloat16, bias=bias, impl="jnp")
