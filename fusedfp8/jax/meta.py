"""The one form in which the flax modules and the differentiable functions carry a
:class:`fusedfp8.ScalingState` across steps: the *meta*, a tuple of float32 arrays named
:data:`META_FIELDS`: the state's arrays in the order of :data:`fusedfp8.state.STATE_FIELDS`
``(amax_history (L, n), scale (n,), scale_inv (n,), overflows (n,), updates (n,))`` and a
validity marker ``writes (n,)``.

Counters are float32 in a meta so that ``jax.grad`` over a flax variable tree works (flax's
"overwrite with gradient" convention hands the new meta back as a gradient); they are exact up
to 2**24.

The marker. The new meta of a step reaches the stored variables as their "gradient", which
``TrainState.apply_gradients`` writes over them. Every step's new meta carries ``writes = 1``.
Two things can break that, and the marker shows both: a module whose output got no cotangent
(stop_gradient, an unused head, an untaken branch) has a zero gradient, so its variables are
overwritten with zeros (``writes = 0``); a meta used k times whose uses were not chained has the
sum of k new metas (``writes = k``). :func:`decode` turns such columns back into fresh ones (scale 1,
empty history, zero counters: the next quantization starts over with the recipe's first step)
instead of quantizing with a zero or a k-fold state; ``fusedfp8.jax.flax.TrainState`` keeps the
previous state of a module that got no gradient, so with it nothing is lost. The flax modules
chain the uses of one module in one step (:func:`combine`), so they never produce a sum.

Not a parameter. An optimizer that updates the meta as a parameter (``tx.update`` /
``optax.apply_updates`` over the whole variables, the FP8 collection included) turns it into
values no step writes: Adam's first step moves every staged amax to -lr and the marker to
1 - lr. Nothing at the level of dtypes or shapes can tell such a loop from a correct one
(``jax.grad`` over the variables needs float leaves, and optax keeps their dtypes), so the
first use in a step checks the values (:func:`corrupted`): where they are concrete (an eager
call) it raises ValueError saying how to train (:func:`refuse_corrupted`); under ``jax.jit``
the forward refuses by returning NaN: the update of a delayed-scaling meta makes its scales NaN
(:func:`fusedfp8.jax.primitives.update_meta`, in the same launch on CUDA), the other first uses
take :func:`refusing`.

Everything here is built from the state's field list, so the state, the meta and the flax
variables cannot drift apart.
"""
from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

from ..recipe import DelayedScaling
from ..state import STATE_FIELDS, ScalingState
from ..types import check_recipe

__all__ = ["META_FIELDS", "LINEAR_GRAD", "fresh_meta", "meta_to_state", "state_to_meta", "float_counters", "check_meta",
           "per_column", "decode", "combine", "corrupted", "refuse_corrupted", "refusing",
           "declare_state"]

META_FIELDS = (*STATE_FIELDS, "writes")
LINEAR_GRAD = (False, False, True)  # tensors of a linear's meta: input, weight, output gradient
_COUNTERS = ("overflows", "updates")
_WHOLE = (*_COUNTERS, "writes")  # whole numbers >= 0 in every meta a step writes
_HISTORY = META_FIELDS.index("amax_history")
_WRITES = META_FIELDS.index("writes")


def _fresh(name: str, L: int, n: int) -> jax.Array:
    """A fresh meta field: history zeros, scales one, counters zero, marker one (each its own buffer)."""
    if name == "amax_history":
        return jnp.zeros((L, n), jnp.float32)
    return (jnp.ones if name in ("scale", "scale_inv", "writes") else jnp.zeros)((n,), jnp.float32)


def fresh_meta(recipe: DelayedScaling, n: int = 3) -> tuple:
    """A fresh float32 meta of ``n`` tensors; every field is a buffer of its own (a meta can be
    donated to a jitted step)."""
    check_recipe(recipe)
    return tuple(_fresh(name, recipe.amax_history_len, n) for name in META_FIELDS)


def meta_to_state(meta, grad=LINEAR_GRAD) -> ScalingState:
    """The :class:`ScalingState` (int32 counters) of a float32 meta (the marker is dropped)."""
    arrays = {name: jnp.asarray(m) for name, m in zip(META_FIELDS, meta) if name in STATE_FIELDS}
    for name in _COUNTERS:
        arrays[name] = arrays[name].astype(jnp.int32)
    return ScalingState(**arrays, grad=tuple(grad))


def float_counters(meta) -> tuple:
    """A meta's counters as they are in it, float32: (overflows, updates)."""
    return tuple(meta[META_FIELDS.index(name)] for name in _COUNTERS)


def state_to_meta(state: ScalingState, counters=None) -> tuple:
    """The float32 meta of a state, marked valid (``writes = 1``). ``counters``: None, or the
    state's (overflows, updates) as float32 already (:func:`fusedfp8.jax.primitives.update_meta`
    writes them; a later use's meta holds them): taken instead of converting the state's."""
    given = dict(zip(_COUNTERS, counters)) if counters is not None else {}
    fields = tuple(given[name] if name in given else getattr(state, name).astype(jnp.float32)
                   if name in _COUNTERS else getattr(state, name) for name in STATE_FIELDS)
    return (*fields, jnp.ones_like(state.scale))  # (ones_like keeps the mesh-axis type under shard_map)


def per_column(mask, name: str):
    """A per-tensor ``mask`` (..., n) shaped to select in meta field ``name``: the history
    (..., L, n) takes it for each of its rows. Leading axes (layers stacked by ``nn.scan`` /
    ``nn.vmap``) pass through."""
    return mask[..., None, :] if name == "amax_history" else mask


def decode(meta) -> tuple:
    """``meta`` with every column whose marker is not 1 (overwritten by a zero gradient, or the sum
    of several unchained uses) replaced by a fresh column; the marker set to 1. Any leading axes."""
    meta = tuple(jnp.asarray(m) for m in meta)
    ok = meta[_WRITES] == 1.0
    L, n = meta[_HISTORY].shape[-2:]
    return tuple(jnp.where(per_column(ok, name), m, _fresh(name, L, n)) if name != "writes" else jnp.ones_like(m)
                 for name, m in zip(META_FIELDS, meta))


def combine(later, own) -> tuple:
    """The new meta of a use that later uses of the same step continued from.

    ``own``: this use's meta (everything it staged, the gradient's amax included). ``later``: the
    cotangent of this use's output meta: the new meta that the next use handed back (it started
    from this use's output, so it holds everything but this use's gradient amax), or zeros when no
    later use ran a backward. The result is ``later`` with its staged row max-accumulated with
    ``own``'s, or ``own``."""
    from ..numerics import jnp as jn

    later = tuple(jnp.asarray(m) for m in later)
    used = later[_WRITES] > 0
    merged = list(later)
    staged = jn.nan_max(later[_HISTORY][..., 0, :], own[_HISTORY][..., 0, :])
    merged[_HISTORY] = later[_HISTORY].at[..., 0, :].set(staged)
    merged[_WRITES] = jnp.ones_like(later[_WRITES])
    return tuple(jnp.where(per_column(used, name), m, o) for name, m, o in zip(META_FIELDS, merged, own))


def corrupted(meta, xp=jnp):
    """Whether ``meta`` holds what no step writes (a bool scalar): a negative amax, or a counter
    or marker that is not a whole number >= 0. A zeroed state (``writes = 0``) or the sum of k
    states (``writes = k``) is not corrupted: :func:`decode` starts those columns over. ``xp``:
    jax.numpy, or numpy for a check on the host."""
    bad = xp.asarray(meta[_HISTORY]) < 0
    for name in _WHOLE:
        c = xp.asarray(meta[META_FIELDS.index(name)])
        bad = bad | per_column((c < 0) | (c != xp.floor(c)), "amax_history")  # (a NaN count too)
    return xp.any(bad)  # one reduction over the history's shape: one small fusion


def refuse_corrupted(meta, what: str = "meta") -> None:
    """ValueError naming ``what`` if ``meta`` is :func:`corrupted` and its values are concrete
    (checked on the host, also inside a trace such as flax's lifted ``nn.cond`` of an eager call);
    a traced meta is refused by the forward's NaN instead."""
    if any(isinstance(m, jax.core.Tracer) for m in meta):
        return
    meta = tuple(np.asarray(m) for m in meta)
    if not corrupted(meta, np):
        return
    hist, writes = meta[_HISTORY], meta[_WRITES]
    raise ValueError(
        f"{what} holds values no training step writes (lowest amax {np.fmin.reduce(hist, axis=None):g}, marker "
        f"'writes' {writes.tolist()}): "
        f"an optimizer updated it as a parameter (tx.update / optax.apply_updates over the whole variables). The FP8 "
        f"state is not a parameter: its gradient is its next value. Train with fusedfp8.jax.flax.TrainState, or keep "
        f"the '_overwrite_with_gradient' collection out of tx.init / tx.update and store its gradient in its place "
        f"(fusedfp8.jax.flax.keep_unwritten(old, grads['_overwrite_with_gradient'])); then start the FP8 state over "
        f"(model.init). Under jax.jit such a state makes the forward return NaN")


def refusing(scale_inv, stored=()):
    """``scale_inv`` for a forward GEMM, or NaN (the GEMM's output all NaN) where a meta in
    ``stored`` (the metas a first use in a step read; none for a later use) is
    :func:`corrupted`: under ``jax.jit`` the refusal cannot raise. A select of one (1,) array."""
    if not stored:
        return scale_inv
    bad = corrupted(stored[0])
    for m in stored[1:]:
        bad = bad | corrupted(m)
    return jnp.where(bad, jnp.float32(jnp.nan), scale_inv)


def check_meta(meta, n: int, recipe: DelayedScaling, argname: str = "meta") -> tuple:
    """``meta`` as a tuple of jax arrays of the right shapes and dtype; TypeError / ValueError
    naming the field otherwise."""
    if not isinstance(meta, (tuple, list)) or len(meta) != len(META_FIELDS):
        raise TypeError(f"{argname} must be a tuple ({', '.join(META_FIELDS)}); got {type(meta).__name__}"
                        + (f" of length {len(meta)}" if isinstance(meta, (tuple, list)) else ""))
    meta = tuple(jnp.asarray(m) for m in meta)
    for name, m in zip(META_FIELDS, meta):
        shape = (recipe.amax_history_len, n) if name == "amax_history" else (n,)
        if m.shape != shape or m.dtype != jnp.float32:
            raise ValueError(f"{argname}.{name} must be float32 of shape {shape} (recipe.amax_history_len="
                             f"{recipe.amax_history_len}); got {m.dtype} {m.shape}")
    return meta


def declare_state(module, collection: str, recipe: DelayedScaling, n: int = 3) -> tuple:
    """Declare (on init) and read a flax module's state variables in ``collection``, one per
    meta field, as a float32 meta."""
    L = recipe.amax_history_len
    meta = []
    for name in META_FIELDS:
        v = module.variable(collection, name, _fresh, name, L, n).value
        shape = (L, n) if name == "amax_history" else (n,)
        if v.shape != shape:
            raise ValueError(f"{module.__class__.__name__}: variable '{name}' has shape {v.shape} but the recipe "
                             f"(amax_history_len={L}) needs {shape}")
        if v.dtype != jnp.float32:
            if not jnp.issubdtype(v.dtype, jax.dtypes.extended):  # flax's fp32_max_grad wraps float32
                raise TypeError(f"{module.__class__.__name__}: variable '{name}' must be float32 (or flax's "
                                f"fp32_max_grad); got {v.dtype}")
            v = lax.convert_element_type(v, jnp.float32)  # max-accumulated cotangents
        meta.append(v)
    return tuple(meta)
