"""Flax (linen) modules: ``Fp8DotGeneral``, a drop-in ``dot_general_cls``, and ``Fp8MLP``;
``dot_general_cls_for`` picks per layer between ``Fp8DotGeneral`` and flax's own dot by the
calibration table of ``policy='auto'`` (:mod:`fusedfp8.policy`).

::

    import flax.linen as nn
    from fusedfp8.jax.flax import Fp8DotGeneral, TrainState

    dense = nn.Dense(4096, dot_general_cls=Fp8DotGeneral)
    variables = dense.init(key, x)        # {'params': ..., '_overwrite_with_gradient': ...}
    state = TrainState.create(apply_fn=dense.apply, params=variables, tx=optax.adam(1e-3))
    grads = jax.grad(loss_fn)(state.params)
    state = state.apply_gradients(grads=grads)    # also stores the new FP8 state

State. Each module keeps the delayed-scaling state of its tensors (input, weight, output
gradient) in flax's ``'_overwrite_with_gradient'`` collection, as float32 variables
``amax_history`` (L, 3), ``scale`` (3,) (multiplies before the cast), ``scale_inv`` (3,)
(``1 / scale``, what flax's own FP8 ops call "scale"), ``overflows`` and ``updates`` (3,)
(counters, stored as float32 so that ``jax.grad`` over the variables works; exact to 2**24).
The "gradient" of that collection is the new state (see :mod:`fusedfp8.jax.dot`), which
``TrainState.apply_gradients`` stores as it does for flax's ``Fp8DotGeneralOp``. It is not a
parameter: ``tx.update`` / ``optax.apply_updates`` over the whole variables makes values no step
writes, which the next forward refuses (ValueError where the values are concrete, NaN output
under ``jax.jit``: :func:`fusedfp8.jax.meta.corrupted`). The previous
step's staged amaxes become scales at the start of the next forward (one fused update per
module per step). Variables converted to flax's ``fp32_max_grad`` dtype (as pipelined
``nn.scan`` users do) accumulate the staged amaxes of several uses with max. Layers stacked by
``nn.scan`` or ``nn.vmap`` (``variable_axes={..., '_overwrite_with_gradient': 0}``: a leading
layer axis on every state variable) train with :class:`TrainState`, :func:`keep_unwritten` and
:func:`accumulate_gradients` as they are, each layer's state on its own. With a
:class:`fusedfp8.CurrentScaling` recipe the history has 2 rows (staged, last amax), ``updates``
stays 0 (every step is a first step: each tensor is quantized with the scale of its own amax),
and the update at the start of the forward only closes the previous step.

Gradient accumulation. The micro-batches of one step add their gradients with
:func:`accumulate_gradients` (their new FP8 states combine by max; a sum would restart them).
:func:`quantize_weights` makes every module's FP8 weight once per step (the ``'fp8_weights'``
collection); passed with the variables, the modules reuse it instead of quantizing their weight
in each micro-batch (docs/accumulation.md).

:class:`TrainState`, :func:`keep_unwritten` and :func:`accumulate_gradients` are written in
:mod:`fusedfp8.jax.flax_train` (they need no module of this file) and reached from here.
"""
from __future__ import annotations

import functools
import math

import flax.linen as nn
import jax
import jax.numpy as jnp

from .. import policy as _policy
from ..recipe import BlockScaling, DelayedScaling
from ..types import BlockQuantized, Quantized, check_recipe
from . import functional as F
from .flax_train import OVERWRITE_WITH_GRADIENT, STATE_VARIABLES, TrainState, accumulate_gradients, keep_unwritten
from .meta import declare_state, refuse_corrupted

FP8_WEIGHTS = "fp8_weights"  # the collection of the weight cache (quantize_weights)
_CACHED = ("data", "data_t", "amax", "scale_inv")  # its variables per linear: a Quantized without dbias
_BLOCK_CACHED = ("data", "scale_inv", "data_t", "scale_inv_t")  # under BlockScaling: a BlockQuantized's operands
_USES = "_fusedfp8_uses"  # attribute of a root flax scope: module path -> (stored value, last output meta)

__all__ = ["Fp8DotGeneral", "Fp8MLP", "TrainState", "keep_unwritten", "dot_general_cls_for", "quantize_weights",
           "accumulate_gradients", "OVERWRITE_WITH_GRADIENT", "FP8_WEIGHTS", "STATE_VARIABLES"]


def _declare_state(module: nn.Module, recipe: DelayedScaling):
    """The module's state variables (created on init), read as a float32 meta; refused where an
    optimizer updated them (:func:`fusedfp8.jax.meta.refuse_corrupted`)."""
    meta = declare_state(module, OVERWRITE_WITH_GRADIENT, recipe)
    if not module.is_initializing():
        refuse_corrupted(meta, f"the FP8 state of /{'/'.join(module.scope.path)}")
    return meta


def _this_use(module, stored: tuple):
    """(meta, first) for this call of ``module``: its stored variables on the first call in this
    apply, the output meta of its previous call on a later one (so that one step advances the
    state once and max-accumulates every call's amaxes, instead of summing the calls' states)."""
    uses = module.scope.root.__dict__.setdefault(_USES, {})
    prev = uses.get(module.scope.path)
    if prev is not None and prev[0] is stored[0]:
        return prev[1], False
    return stored, True


def _remember(module, stored: tuple, out) -> None:
    module.scope.root.__dict__[_USES][module.scope.path] = (stored[0], out)


def _fp8_weight(module: nn.Module, w, stored: tuple, first: bool, recipe: DelayedScaling, axis_name, impl):
    """The FP8 copy of the weight ``w`` for this call, from the module's :data:`FP8_WEIGHTS`
    variables, or None (quantize it in the call). Where the collection is mutable (outside init),
    the first call in an apply quantizes ``w`` from the ``stored`` state
    (:func:`fusedfp8.jax.quantize_weight`) and stores it; a later call of the same apply, and
    every call where the collection is passed in read-only, reuses what it holds."""
    if module.is_initializing():
        return None
    block = isinstance(recipe, BlockScaling)  # (no state: the first call in an apply is the one that finds none)
    names, kind = (_BLOCK_CACHED, BlockQuantized) if block else (_CACHED, Quantized)
    if module.is_mutable_collection(FP8_WEIGHTS) and (not module.has_variable(FP8_WEIGHTS, "data") or
                                                      (first and not block)):
        q = F.quantize_weight(w, None if block else stored, recipe, axis_name=None if block else axis_name, impl=impl)
        for name in names:
            module.put_variable(FP8_WEIGHTS, name, getattr(q, name))
        return q
    if not module.has_variable(FP8_WEIGHTS, "data"):
        return None
    return kind(**{name: module.get_variable(FP8_WEIGHTS, name) for name in names})


_NO_OPERAND = object()  # the default of Fp8DotGeneral's operands: tells flax's zero-argument call apart


def _no_operand_error(none_given: bool) -> TypeError:
    """Flax instantiates ``dot_general_cls`` with no arguments, then calls the result with the
    operands; given an instance, it calls the instance with no arguments."""
    if not none_given:
        return TypeError("Fp8DotGeneral needs lhs, rhs and dimension_numbers (as lax.dot_general)")
    return TypeError("Fp8DotGeneral was called with no operands: dot_general_cls takes the class, not an instance "
                     "(flax calls dot_general_cls() to make the module, then the module with the operands); pass "
                     "dot_general_cls=Fp8DotGeneral, or for options a zero-argument callable such as "
                     "functools.partial(Fp8DotGeneral, recipe=r) or lambda: Fp8DotGeneral(recipe=r)")


class Fp8DotGeneral(nn.Module):
    """FP8 ``lax.dot_general`` with delayed scaling, for ``dot_general_cls`` of ``nn.Dense`` /
    ``nn.DenseGeneral``: ``nn.Dense(features, dot_general_cls=Fp8DotGeneral)``.

    Supported contractions: the lhs contracts its trailing dimensions and the rhs its leading
    ones, in order, with no batch dimensions (every Dense / DenseGeneral over trailing axes).
    Others raise ValueError. The lhs is cast to the rhs (kernel) dtype first, as flax's FP8 ops
    do; ``precision`` is ignored (FP8); the output dtype is ``preferred_element_type`` or the
    kernel dtype.

    Attributes: ``recipe`` (DelayedScaling or CurrentScaling; or BlockScaling: no state variables,
    :func:`fusedfp8.jax.block_dot.block_dot`, ``axis_name`` must stay None and
    ``forward_fast_accum`` does not apply), ``impl`` (see
    :data:`fusedfp8.jax.IMPLS`), ``axis_name`` (None, or the mesh axis name(s) inside ``shard_map``
    over which the staged amaxes are MAX-reduced before each update: ``functools.partial(Fp8DotGeneral,
    axis_name='data')``), ``forward_fast_accum`` (the forward GEMM with cuBLASLt's fast
    accumulation; the gradient GEMMs always split).
    """

    recipe: DelayedScaling = DelayedScaling()
    impl: str = "auto"
    axis_name: str | tuple | None = None
    forward_fast_accum: bool = True

    @nn.compact
    def __call__(self, lhs=_NO_OPERAND, rhs=_NO_OPERAND, dimension_numbers=_NO_OPERAND, precision=None,
                 preferred_element_type=None):
        if any(a is _NO_OPERAND for a in (lhs, rhs, dimension_numbers)):
            raise _no_operand_error(lhs is _NO_OPERAND and rhs is _NO_OPERAND)
        recipe = check_recipe(self.recipe, f"{type(self).__name__}.recipe", block=True)
        (lc, rc), (lb, rb) = dimension_numbers
        lc, rc = tuple(int(d) % max(lhs.ndim, 1) for d in lc), tuple(int(d) % max(rhs.ndim, 1) for d in rc)
        nc = len(lc)
        if lb or rb or lc != tuple(range(lhs.ndim - nc, lhs.ndim)) or rc != tuple(range(nc)):
            raise ValueError(f"Fp8DotGeneral supports lhs contracting its trailing and rhs its leading dimensions, "
                             f"without batch dimensions; got dimension_numbers={dimension_numbers} for shapes "
                             f"{lhs.shape} and {rhs.shape}")
        lead, k = lhs.shape[:lhs.ndim - nc], math.prod(lhs.shape[lhs.ndim - nc:])
        rest = rhs.shape[nc:]
        if k != math.prod(rhs.shape[:nc]):
            raise ValueError(f"contracting dimensions disagree: {lhs.shape} and {rhs.shape}")
        x2 = jnp.asarray(lhs, rhs.dtype).reshape(math.prod(lead), k)
        w2 = rhs.reshape(k, math.prod(rest))
        if isinstance(recipe, BlockScaling):  # no state: no variables, nothing to remember between calls
            fp8_weight = _fp8_weight(self, w2, (), True, recipe, None, self.impl)
            y, _ = F.fp8_dot_use(x2, w2, None, recipe, out_dtype=preferred_element_type or rhs.dtype,
                                 axis_name=self.axis_name, impl=self.impl, fp8_weight=fp8_weight)
            return y.reshape(*lead, *rest)
        stored = _declare_state(self, recipe)
        meta, first = _this_use(self, stored)
        fp8_weight = _fp8_weight(self, w2, stored, first, recipe, self.axis_name, self.impl)
        y, out = F.fp8_dot_use(x2, w2, meta, recipe, out_dtype=preferred_element_type or rhs.dtype,
                               axis_name=self.axis_name, impl=self.impl, forward_fast_accum=self.forward_fast_accum,
                               first=first, fp8_weight=fp8_weight)
        _remember(self, stored, out)
        return y.reshape(*lead, *rest)


_DOT_GENERAL_OPTIONS = ("recipe", "impl", "axis_name", "forward_fast_accum")


def _device_name(device) -> str | None:
    """The CUDA name of ``device`` (a jax Device, a name, or None: jax's first device), or None
    when it is not a GPU."""
    if isinstance(device, str):
        return device
    if device is not None and not hasattr(device, "device_kind"):
        raise TypeError(f"device must be a jax Device, a GPU's name or None; got {type(device).__name__}")
    device = device if device is not None else jax.devices()[0]
    return device.device_kind if device.platform == "gpu" else None


def dot_general_cls_for(tokens: int, in_features: int, out_features: int, policy: str = "auto", *,
                        mode: str = "compiled", table=None, device=None, **options):
    """The ``dot_general_cls`` for one ``nn.Dense`` by the policy of
    ``fusedfp8.pytorch.convert_to_fp8`` (see :mod:`fusedfp8.policy`): :class:`Fp8DotGeneral`
    where FP8 is predicted faster than bf16 for a layer of ``in_features -> out_features`` that
    sees ``tokens`` rows per step (per device, per micro-batch), else None (flax's own
    ``lax.dot_general``)::

        cls = dot_general_cls_for(2048, 1024, 4096)              # from the GPU's calibration table
        layer = nn.Dense(4096, dot_general_cls=cls)

    Parameters
    ----------
    tokens, in_features, out_features : int
    policy : {'auto', 'all'}
        'auto' reads the calibration table; 'all' always returns the FP8 class.
    mode : {'compiled', 'graphed', 'eager'}
        How the step runs. 'compiled' (the default: a jitted step) decides from the table's
        CUDA-graphed figures, which stand in for compiled ones (an approximation, see
        :mod:`fusedfp8.policy`); a table without them raises MissingModeError.
    table : fusedfp8.policy.PolicyTable or path, optional
        By default ``$FUSEDFP8_POLICY_TABLE``, else the table shipped for the GPU.
    device : jax Device or its name, optional
        The GPU whose table is used (default: ``jax.devices()[0]`` when it is a GPU).
    **options : ``recipe``, ``impl``, ``axis_name``, ``forward_fast_accum`` of :class:`Fp8DotGeneral`;
        given, the FP8 class comes back as ``functools.partial(Fp8DotGeneral, **options)``.

    ``fusedfp8.policy.decide(tokens, in_features, out_features, mode='compiled', device=...,
    table=...)`` gives the figures behind the decision. Raises as :func:`fusedfp8.policy.decide`
    (MissingTableError without a table for the GPU, MissingModeError without the mode's figures,
    ValueError on a bad mode), and TypeError on an unknown option.
    """
    unknown = sorted(set(options) - set(_DOT_GENERAL_OPTIONS))
    if unknown:
        raise TypeError(f"options must be fields of Fp8DotGeneral {_DOT_GENERAL_OPTIONS}; got {unknown}")
    if "recipe" in options:
        check_recipe(options["recipe"])
    policy = _policy.check_policy(policy, allow_none=False)
    name = None if policy == "all" or table is not None else _device_name(device)
    decision = _policy.decide(tokens, in_features, out_features, policy=policy, mode=mode, device=name, table=table)
    if not decision.fp8:
        return None
    return functools.partial(Fp8DotGeneral, **options) if options else Fp8DotGeneral


class _DenseParams(nn.Module):
    """The parameters and FP8 state of one linear of :class:`Fp8MLP` (names as ``nn.Dense``)."""

    features_in: int
    features: int
    recipe: DelayedScaling
    param_dtype: jnp.dtype

    @nn.compact
    def __call__(self):
        kernel = self.param("kernel", nn.initializers.lecun_normal(), (self.features_in, self.features),
                            self.param_dtype)
        bias = self.param("bias", nn.initializers.zeros_init(), (self.features,), self.param_dtype)
        return kernel, bias, None if isinstance(self.recipe, BlockScaling) else _declare_state(self, self.recipe)

    def fp8_weight(self, w, stored: tuple, first: bool, axis_name, impl):
        """This linear's cached FP8 weight, or None (:func:`_fp8_weight`, in this module's scope)."""
        return _fp8_weight(self, w, stored, first, self.recipe, axis_name, impl)


class _LayerNormParams(nn.Module):
    """The parameters of :class:`Fp8MLP`'s fused LayerNorm, as ``nn.LayerNorm`` declares them."""

    features: int
    param_dtype: jnp.dtype

    @nn.compact
    def __call__(self):
        scale = self.param("scale", nn.initializers.ones, (self.features,), self.param_dtype)
        bias = self.param("bias", nn.initializers.zeros, (self.features,), self.param_dtype)
        return scale, bias


_FUSED_LN_MAX = 16384  # widest row the fused LayerNorm takes (as the torch Fp8MLP: the transposed tile fits)


class Fp8MLP(nn.Module):
    """LayerNorm -> Dense(ffn) -> gelu -> Dense(out) with FP8 GEMMs, the LayerNorm and the
    activation fused into FP8 (:func:`fusedfp8.jax.fp8_mlp`): neither LayerNorm(x) nor gelu(z) is
    ever written in high precision. The LayerNorm's backward runs in JAX (float32) from the saved
    input, mean and rstd.

    Parameters as ``nn.LayerNorm(name='norm')``, ``nn.Dense(ffn, name='fc1')``,
    ``nn.Dense(out, name='fc2')`` would have them (so weights carry over from such a model, and
    variables stored before the LayerNorm was fused load as they are); the FP8 state of fc1 and
    fc2 in ``'_overwrite_with_gradient'``.

    Under a :class:`fusedfp8.BlockScaling` recipe the same parameters, no state variables:
    :func:`fusedfp8.jax.block_dot.block_mlp` with the LayerNorm and the gelu fused.

    Attributes: ``ffn`` (inner width), ``out_features`` (default: the input width), ``recipe``,
    ``approximate`` ('tanh' or 'none'), ``dtype`` (computation dtype, default the input's: the
    activations, biases and output; the two weights are quantized to FP8 straight from
    ``param_dtype``, without a ``dtype`` copy first, and their gradients come in it),
    ``param_dtype``, ``impl``, ``axis_name``, ``forward_fast_accum`` (as :class:`Fp8DotGeneral`;
    one ``lax.pmax`` for both linears), ``epsilon`` (the LayerNorm's, as ``nn.LayerNorm``),
    ``fuse_layernorm`` (default True; False, or an input wider than 16384, runs ``nn.LayerNorm``
    and quantizes its output written in ``dtype``).

    Under ``shard_map`` with ``axis_name``, carry the '_overwrite_with_gradient' collection as a
    per-device value (e.g. a leading device axis with ``P(axis_name)``): after a step, row 0 of
    each history holds that device's own amaxes until the next forward reduces them; a
    replicated (``P()``) state would have its "gradient" summed over the devices. Under
    ``first_step='current'`` the first step's scales are each device's own (see
    :mod:`fusedfp8.jax.primitives`); ``first_step='unit'`` keeps the devices identical from step 0.
    """

    ffn: int
    out_features: int | None = None
    recipe: DelayedScaling = DelayedScaling()
    approximate: str = "tanh"
    dtype: jnp.dtype | None = None
    param_dtype: jnp.dtype = jnp.float32
    impl: str = "auto"
    axis_name: str | tuple | None = None
    forward_fast_accum: bool = True
    epsilon: float = 1e-6
    fuse_layernorm: bool = True

    @nn.compact
    def __call__(self, x):
        recipe = check_recipe(self.recipe, f"{type(self).__name__}.recipe", block=True)
        if jnp.asarray(x).dtype.name not in ("float32", "float16", "bfloat16"):  # before LayerNorm's own message
            raise TypeError(f"Fp8MLP: x must be float32, float16 or bfloat16; got {jnp.asarray(x).dtype}")
        hidden = x.shape[-1]
        out = self.out_features or hidden
        dtype = self.dtype or x.dtype
        if isinstance(recipe, BlockScaling):
            return self._block(x, recipe, hidden, out, dtype)
        h, ln = self._norm(x, hidden, dtype, self.fuse_layernorm and hidden <= _FUSED_LN_MAX)
        fc1 = _DenseParams(hidden, self.ffn, recipe, self.param_dtype, name="fc1")
        fc2 = _DenseParams(self.ffn, out, recipe, self.param_dtype, name="fc2")
        (w1, b1, stored1), (w2, b2, stored2) = fc1(), fc2()
        prev, first = _this_use(self, (*stored1, *stored2))
        meta1, meta2 = (stored1, stored2) if first else prev
        # the weights go to FP8 in their own dtype (float32 parameters: one rounding, and no convert
        # pass over them before the quantization); their gradients come in that dtype
        q1 = fc1.fp8_weight(w1, stored1, first, self.axis_name, self.impl)
        q2 = fc2.fp8_weight(w2, stored2, first, self.axis_name, self.impl)
        y, out1, out2 = F.fp8_mlp_use(h.reshape(-1, hidden), w1, b1.astype(dtype), w2, b2.astype(dtype), meta1, meta2,
                                      recipe, approximate=self.approximate, axis_name=self.axis_name, impl=self.impl,
                                      forward_fast_accum=self.forward_fast_accum, out_dtype=dtype, first=first,
                                      fp8_weights=None if q1 is None else (q1, q2), **ln)
        _remember(self, (*stored1, *stored2), (out1, out2))
        return y.reshape(*x.shape[:-1], out)

    def _norm(self, x, hidden: int, dtype, fuse: bool):
        """(h, ln): with ``fuse``, x itself and the LayerNorm's parameters for the quantization that
        computes LayerNorm(x) on the way to FP8; else nn.LayerNorm(x) in ``dtype`` and no parameters."""
        if fuse:
            ln_w, ln_b = _LayerNormParams(hidden, self.param_dtype, name="norm")()
            return x, {"ln_weight": ln_w, "ln_bias": ln_b, "ln_eps": self.epsilon}
        h = nn.LayerNorm(epsilon=self.epsilon, dtype=dtype, param_dtype=self.param_dtype, name="norm")(x)
        return jnp.asarray(h, dtype), {}

    def _block(self, x, recipe: BlockScaling, hidden: int, out: int, dtype):
        """Under block scaling: :func:`fusedfp8.jax.block_dot.block_mlp`, LayerNorm(x) straight to FP8
        with 1x128 blocks (or, with ``fuse_layernorm`` off, nn.LayerNorm first); no state variables."""
        if self.axis_name is not None:
            raise ValueError(f"Fp8MLP.axis_name must be None under BlockScaling (no state to reduce); got "
                             f"{self.axis_name!r}")
        h, ln = self._norm(x, hidden, dtype, self.fuse_layernorm)
        fc1 = _DenseParams(hidden, self.ffn, recipe, self.param_dtype, name="fc1")
        fc2 = _DenseParams(self.ffn, out, recipe, self.param_dtype, name="fc2")
        (w1, b1, _), (w2, b2, _) = fc1(), fc2()
        q1, q2 = fc1.fp8_weight(w1, (), True, None, self.impl), fc2.fp8_weight(w2, (), True, None, self.impl)
        y = F.block_mlp(h.reshape(-1, hidden), w1, b1.astype(dtype), w2, b2.astype(dtype), recipe,
                        approximate=self.approximate, out_dtype=dtype, impl=self.impl,
                        fp8_weights=None if q1 is None else (q1, q2), **ln)
        return y.reshape(*x.shape[:-1], out)


def quantize_weights(apply_fn, variables, *args, **kwargs):
    """The weight cache of a flax model for one optimizer step: the FP8 copy (with its transpose)
    of the weight of every :class:`Fp8DotGeneral` and :class:`Fp8MLP` linear, quantized from
    ``variables`` as the step's first forward would (:func:`fusedfp8.jax.quantize_weight`), as
    the :data:`FP8_WEIGHTS` collection. Pass it with the variables to the micro-batches of that
    step, ``apply_fn({**variables, FP8_WEIGHTS: fp8_weights}, x)``: they reuse it instead of
    quantizing each weight again, with the same results, gradients and new FP8 states.

    ``args`` / ``kwargs`` are what ``apply_fn(variables, ...)`` takes for a forward (one
    micro-batch's input: the modules see their weights only when called). It runs that forward
    with the collection mutable and keeps only the collection: inside ``jax.jit`` XLA removes
    the rest of the forward, so it costs the weights' quantizations. Make it again after every
    ``apply_gradients`` (a copy of another step's weights is not detected)."""
    variables = {k: v for k, v in variables.items() if k != FP8_WEIGHTS}
    _, new = apply_fn(variables, *args, mutable=[FP8_WEIGHTS], **kwargs)
    return new.get(FP8_WEIGHTS, {})
