"""The task that ``python -m fusedfp8 demo`` and ``scripts/bench_mlp_torch.py`` /
``scripts/bench_mlp_jax.py`` train, and the high-precision twins of the FP8 MLPs they train.

The task. Regress y from x ~ N(0, I) (``hidden`` wide) with MSE, where y = tanh(x @ W1) @ W2 / s
for a fixed random teacher W1, W2 ~ N(0, 1/hidden) (hidden x hidden) and s = sqrt(E tanh(z)^2),
z ~ N(0, 1), the teacher's output std, so that y has unit variance. With label noise,
y = (tanh(x @ W1) @ W2 / s + noise * n) / sqrt(1 + noise**2), n ~ N(0, 1): still unit variance.
:meth:`Task.torch_batch` and :meth:`Task.jax_batch` draw batch ``step`` (bf16 x and y) on the
device; the teacher depends on (seed, hidden) only, a batch on (seed, hidden, step). Each
framework draws with its own generator: the same task, not the same numbers.

Its two uses. The demo trains on one fixed batch (batch 0 at every step) without noise: the loss
falls towards 0 and the curves show the scaling at work. The benchmarks take a fresh batch at
every step of their loss curve, with :data:`BENCH_NOISE`: on one fixed batch the student
memorises it, noise included, and a relative comparison of final losses then measures
memorisation speed and rounding (0.0013 against 0.0066 reads "+400%"); on fresh batches the loss
falls towards the noise floor (0.5) and the 2% criterion compares how well FP8 and bf16 learned
the signal. Timing reuses one batch (a step is the same work on any batch).

The twins (the high-precision models the FP8 ones are compared with, same parameter names, so
that both start from the same weights):

- ``TorchMLP``: LayerNorm -> nn.Linear -> gelu -> nn.Linear, :class:`fusedfp8.pytorch.Fp8MLP`
  without FP8 (same construction order, so the same initial weights for one seed);
- ``FlaxMLP``: LayerNorm -> Dense -> gelu -> Dense, :class:`fusedfp8.jax.flax.Fp8MLP` without
  FP8 (or with flax's own FP8 ops through ``dot_general_cls``).

:func:`torch_initial_weights` / :func:`flax_initial_params` give the shared starting weights
(bf16), :func:`torch_model` / :func:`flax_variables` a model of either kind holding them.
Importing this module imports neither torch nor jax: ``TorchMLP`` and ``FlaxMLP`` are built at
their first use.
"""
from __future__ import annotations

import functools
import math
from dataclasses import dataclass
from typing import Any

import numpy as np

from ..recipe import DelayedScaling
from ..types import check_approximate

BENCH_NOISE = 1.0  # the benchmarks' label noise (std, relative to the teacher's unit-variance output)
_TEACHER, _BATCH = 0, 1  # first word of the seed of the teacher / of a batch


@functools.lru_cache(maxsize=None)
def teacher_std() -> float:
    """sqrt(E tanh(z)^2), z ~ N(0, 1): the std of tanh(x @ W1) @ W2 over x and the teacher
    (the same for every hidden and every batch)."""
    z = np.linspace(-8.0, 8.0, 20001)
    pdf = np.exp(-z * z / 2) / math.sqrt(2 * math.pi)
    return math.sqrt(float(np.sum(np.tanh(z) ** 2 * pdf) * (z[1] - z[0])))


def _seed(*words: int) -> int:
    """A 32-bit seed mixed from ``words`` (any ints)."""
    return int(np.random.SeedSequence([w % 2**64 for w in words]).generate_state(1)[0])


@dataclass(frozen=True)
class Task:
    """The regression task at one shape: ``hidden`` features, ``tokens`` rows per batch,
    ``seed`` (teacher and batches), ``noise`` (label noise std; 0: none)."""

    hidden: int
    tokens: int
    seed: int = 0
    noise: float = 0.0

    def torch_batch(self, step: int = 0, device=None):
        """Batch ``step`` as bf16 torch tensors (x (tokens, hidden), y (tokens, hidden)) on ``device``."""
        import torch

        device = torch.device(device or "cpu")
        h = self.hidden
        g = torch.Generator(device=device)
        g.manual_seed(_seed(_TEACHER, self.seed, h))
        w1 = torch.randn(h, h, generator=g, device=device) / math.sqrt(h)
        w2 = torch.randn(h, h, generator=g, device=device) / math.sqrt(h)
        g.manual_seed(_seed(_BATCH, self.seed, h, step))
        x = torch.randn(self.tokens, h, generator=g, device=device)
        y = torch.tanh(x @ w1) @ w2 / teacher_std()
        if self.noise:
            y = (y + self.noise * torch.randn(y.shape, generator=g, device=device)) / math.sqrt(1 + self.noise ** 2)
        return x.to(torch.bfloat16), y.to(torch.bfloat16)

    def jax_batch(self, step: int = 0, device=None):
        """Batch ``step`` as bf16 jax arrays, drawn by one jitted function on ``device`` (default:
        jax's default device)."""
        import jax

        seeds = (np.uint32(_seed(_TEACHER, self.seed, self.hidden)),
                 np.uint32(_seed(_BATCH, self.seed, self.hidden, step)))
        fn = _jax_batch_fn(self.hidden, self.tokens, float(self.noise))
        if device is None:
            return fn(*seeds)
        with jax.default_device(device):
            return fn(*seeds)


@functools.lru_cache(maxsize=None)
def _jax_batch_fn(hidden: int, tokens: int, noise: float):
    import jax
    import jax.numpy as jnp

    std = teacher_std()

    @jax.jit
    def batch(teacher_seed, batch_seed):
        k1, k2 = jax.random.split(jax.random.key(teacher_seed))
        w1 = jax.random.normal(k1, (hidden, hidden), jnp.float32) / math.sqrt(hidden)
        w2 = jax.random.normal(k2, (hidden, hidden), jnp.float32) / math.sqrt(hidden)
        kx, kn = jax.random.split(jax.random.key(batch_seed))
        x = jax.random.normal(kx, (tokens, hidden), jnp.float32)
        y = jnp.dot(jnp.tanh(jnp.dot(x, w1, precision="highest")), w2, precision="highest") / std
        if noise:
            y = (y + noise * jax.random.normal(kn, y.shape, jnp.float32)) / math.sqrt(1 + noise ** 2)
        return x.astype(jnp.bfloat16), y.astype(jnp.bfloat16)

    return batch


# ---- torch -----------------------------------------------------------------------------------
@functools.lru_cache(maxsize=None)
def _torch_mlp_class():
    import torch
    import torch.nn.functional as F
    from torch import nn

    class TorchMLP(nn.Module):
        """LayerNorm -> nn.Linear -> gelu -> nn.Linear in plain torch: :class:`fusedfp8.pytorch.Fp8MLP`
        without FP8.

        The high-precision twin of Fp8MLP (the reference it is compared and benchmarked
        against): the same computation, ``fc2(gelu(fc1(norm(x))))``, in the parameters' dtype
        (bf16 or float32), the same construction order (so the same initial weights for one
        seed) and the same parameter names. Its ``state_dict()`` loads into an Fp8MLP with
        ``strict=False`` (the FP8 state keeps its current values; a strict load refuses a state
        without one), and an Fp8MLP's weights load into it once its FP8 state keys are dropped.
        :func:`fusedfp8.pytorch.convert_to_fp8` turns ``fc1`` and ``fc2`` into Fp8Linear (the
        gelu then stays in torch, unfused).

        Parameters
        ----------
        hidden, ffn : int
            Input/output width and the inner width (fc1: hidden -> ffn, fc2: ffn -> hidden).
        approximate : {'tanh', 'none'}
            The gelu (as ``torch.nn.functional.gelu``); 'tanh' as Fp8MLP's default.
        bias : bool
        device, dtype : as for ``nn.Linear`` (all parameters, the LayerNorm's included).

        Attributes: ``norm`` (nn.LayerNorm), ``fc1``, ``fc2`` (nn.Linear).
        Input (..., hidden), of the parameters' dtype (as any nn.Linear); output (..., hidden).

        Raises
        ------
        ValueError
            At construction, on an ``approximate`` other than 'tanh' or 'none'.
        """

        def __init__(self, hidden: int, ffn: int, *, approximate: str = "tanh", bias: bool = True, device=None,
                     dtype=None):
            check_approximate(approximate)
            super().__init__()
            self.approximate = approximate
            self.norm = nn.LayerNorm(hidden, device=device, dtype=dtype)
            self.fc1 = nn.Linear(hidden, ffn, bias, device=device, dtype=dtype)
            self.fc2 = nn.Linear(ffn, hidden, bias, device=device, dtype=dtype)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return self.fc2(F.gelu(self.fc1(self.norm(x)), approximate=self.approximate))

    TorchMLP.__module__, TorchMLP.__qualname__ = __name__, "TorchMLP"  # pickles as fusedfp8.demo.task.TorchMLP
    return TorchMLP


def torch_initial_weights(hidden: int, ffn: int, seed: int = 0, device=None) -> dict:
    """The bf16 state dict of a ``TorchMLP(hidden, ffn)`` built on the CPU after seeding torch's
    CPU generator with ``seed`` (so the same weights on every device), moved to ``device``.
    torch's global random state is left as it was."""
    import torch

    with torch.random.fork_rng(devices=[]):
        torch.default_generator.manual_seed(seed)
        model = _torch_mlp_class()(hidden, ffn)
    return {k: v.to(device=device, dtype=torch.bfloat16) for k, v in model.state_dict().items()}


def torch_model(kind: str, hidden: int, ffn: int, weights: dict, recipe: DelayedScaling = DelayedScaling(),
                device=None):
    """A bf16 ``TorchMLP`` (``kind='bf16'``) or ``fusedfp8.pytorch.Fp8MLP(recipe)`` (``'fp8'``, its
    FP8 state fresh and float32) on ``device``, holding ``weights``."""
    import torch

    import fusedfp8.pytorch as fp8

    if kind not in ("bf16", "fp8"):
        raise ValueError(f"kind must be 'bf16' or 'fp8'; got {kind!r}")
    with torch.device(device or "cpu"):
        model = _torch_mlp_class()(hidden, ffn) if kind == "bf16" else fp8.Fp8MLP(hidden, ffn, recipe)
    model = model.to(torch.bfloat16)  # an Fp8MLP keeps its FP8 state in float32
    missing, unexpected = model.load_state_dict(weights, strict=False)
    buffers = {name for name, _ in model.named_buffers()}
    if unexpected or set(missing) - buffers:
        raise RuntimeError(f"the initial weights do not fit the {kind} model: missing "
                           f"{sorted(set(missing) - buffers)}, unexpected {unexpected}")
    return model


# ---- jax -------------------------------------------------------------------------------------
@functools.lru_cache(maxsize=None)
def _flax_mlp_class():
    import flax.linen as nn
    import jax.numpy as jnp

    class FlaxMLP(nn.Module):
        """LayerNorm -> Dense(ffn) -> gelu -> Dense(out) in flax: :class:`fusedfp8.jax.flax.Fp8MLP`
        without FP8 (parameters named ``norm``, ``fc1``, ``fc2`` as there, so weights carry over).

        Attributes as Fp8MLP: ``ffn``, ``out_features`` (default: the input width),
        ``approximate`` ('tanh' or 'none'), ``dtype`` (computation dtype, default the input's),
        ``param_dtype``; and ``dot_general_cls`` for both Dense layers (None: plain
        ``lax.dot_general``; ``flax.linen.Fp8DotGeneralOp``: flax's own FP8, whose state lives
        in the '_overwrite_with_gradient' collection).
        """

        ffn: int
        out_features: int | None = None
        approximate: str = "tanh"
        dtype: Any = None
        param_dtype: Any = jnp.float32
        dot_general_cls: Any = None

        @nn.compact
        def __call__(self, x):
            check_approximate(self.approximate, "FlaxMLP.approximate")
            dtype = self.dtype or x.dtype
            dense = {"dtype": dtype, "param_dtype": self.param_dtype}
            if self.dot_general_cls is not None:
                dense["dot_general_cls"] = self.dot_general_cls
            h = nn.LayerNorm(dtype=dtype, param_dtype=self.param_dtype, name="norm")(x)
            z = nn.Dense(self.ffn, name="fc1", **dense)(h)
            out = self.out_features or x.shape[-1]
            return nn.Dense(out, name="fc2", **dense)(nn.gelu(z, approximate=self.approximate == "tanh"))

    FlaxMLP.__module__, FlaxMLP.__qualname__ = __name__, "FlaxMLP"
    return FlaxMLP


def flax_initial_params(hidden: int, ffn: int, seed: int = 0, init: str = "f32") -> dict:
    """The shared bf16 parameters of every jax model: ``FlaxMLP(ffn)``'s for ``jax.random.key(seed)``.

    ``init='f32'``: flax's initializers run in float32, then rounded to bf16 (as torch's bf16
    models are made). ``'bf16'``: the initializers run in bf16 itself, which gives each kernel
    only 128 distinct values and a mean of about -0.017 sigma (measured at 1024/4096); their E4M3
    rounding errors then do not average out (mean error ~80x what independent roundings give),
    which shifted the FP8 output's mean by ~6% at K=4096 and the first FP8 loss 2.6% above bf16's
    on the H200.
    """
    import jax
    import jax.numpy as jnp

    if init not in ("f32", "bf16"):
        raise ValueError(f"init must be 'f32' or 'bf16'; got {init!r}")
    model = _flax_mlp_class()(ffn, dtype=jnp.bfloat16, param_dtype=jnp.float32 if init == "f32" else jnp.bfloat16)
    params = model.lazy_init(jax.random.key(seed), jax.ShapeDtypeStruct((1, hidden), jnp.bfloat16))["params"]
    return jax.tree.map(lambda a: a.astype(jnp.bfloat16), params)


def flax_variables(model, params: dict, hidden: int) -> dict:
    """``model``'s variables: copies of ``params`` (its own buffers, as a jitted step may donate
    them) and the model's own fresh other collections (an FP8 state), from a jitted
    ``model.init`` on 16 rows of zeros (the fresh state does not depend on the input; a model
    with parameters only is not initialised at all)."""
    import jax
    import jax.numpy as jnp

    x = jax.ShapeDtypeStruct((16, hidden), jnp.bfloat16)
    if set(jax.eval_shape(model.init, jax.random.key(0), x)) == {"params"}:
        fresh = {"params": params}
    else:
        fresh = dict(jax.jit(model.init)(jax.random.key(0), jnp.zeros(x.shape, x.dtype)))
    want = jax.tree.map(lambda a: (a.shape, a.dtype), fresh["params"])
    got = jax.tree.map(lambda a: (a.shape, a.dtype), params)
    if want != got:
        raise RuntimeError(f"the initial parameters do not fit {type(model).__name__}: it has {want}, got {got}")
    fresh["params"] = jax.tree.map(jnp.copy, params)
    return fresh


def __getattr__(name: str):
    if name == "TorchMLP":
        return _torch_mlp_class()
    if name == "FlaxMLP":
        return _flax_mlp_class()
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
