"""The one form in which the flax modules and the differentiable functions carry a
:class:`fusedfp8.ScalingState` across steps: the *meta*, a tuple of float32 arrays in the order
of :data:`fusedfp8.state.STATE_FIELDS` ``(amax_history (L, n), scale (n,), scale_inv (n,),
overflows (n,), updates (n,))``.

Counters are float32 in a meta so that ``jax.grad`` over a flax variable tree works (flax's
"overwrite with gradient" convention hands the new meta back as a gradient); they are exact up
to 2**24. Everything here is built from the state's field list, so the state, the meta and the
flax variables cannot drift apart.
"""
from __future__ import annotations

import jax
import jax.numpy as jnp
from jax import lax

from ..recipe import DelayedScaling
from ..state import STATE_FIELDS, ScalingState

__all__ = ["LINEAR_GRAD", "fresh_meta", "meta_to_state", "state_to_meta", "check_meta", "declare_state"]

LINEAR_GRAD = (False, False, True)  # tensors of a linear's meta: input, weight, output gradient
_COUNTERS = ("overflows", "updates")


def _fresh(name: str, L: int, n: int) -> jax.Array:
    """A fresh meta field: history zeros, scales one, counters zero (each its own buffer)."""
    if name == "amax_history":
        return jnp.zeros((L, n), jnp.float32)
    return (jnp.ones if name in ("scale", "scale_inv") else jnp.zeros)((n,), jnp.float32)


def fresh_meta(recipe: DelayedScaling, n: int = 3) -> tuple:
    """A fresh float32 meta of ``n`` tensors; every field is a buffer of its own (a meta can be
    donated to a jitted step)."""
    return tuple(_fresh(name, recipe.amax_history_len, n) for name in STATE_FIELDS)


def meta_to_state(meta, grad=LINEAR_GRAD) -> ScalingState:
    """The :class:`ScalingState` (int32 counters) of a float32 meta."""
    arrays = {name: jnp.asarray(m) for name, m in zip(STATE_FIELDS, meta)}
    for name in _COUNTERS:
        arrays[name] = arrays[name].astype(jnp.int32)
    return ScalingState(**arrays, grad=tuple(grad))


def state_to_meta(state: ScalingState) -> tuple:
    return tuple(getattr(state, name).astype(jnp.float32) if name in _COUNTERS else getattr(state, name)
                 for name in STATE_FIELDS)


def check_meta(meta, n: int, recipe: DelayedScaling, argname: str = "meta") -> tuple:
    """``meta`` as a tuple of jax arrays of the right shapes and dtype; TypeError / ValueError
    naming the field otherwise."""
    if not isinstance(meta, (tuple, list)) or len(meta) != len(STATE_FIELDS):
        raise TypeError(f"{argname} must be a tuple {STATE_FIELDS}; got {type(meta).__name__}"
                        + (f" of length {len(meta)}" if isinstance(meta, (tuple, list)) else ""))
    meta = tuple(jnp.asarray(m) for m in meta)
    for name, m in zip(STATE_FIELDS, meta):
        shape = (recipe.amax_history_len, n) if name == "amax_history" else (n,)
        if m.shape != shape or m.dtype != jnp.float32:
            raise ValueError(f"{argname}.{name} must be float32 of shape {shape} (recipe.amax_history_len="
                             f"{recipe.amax_history_len}); got {m.dtype} {m.shape}")
    return meta


def declare_state(module, collection: str, recipe: DelayedScaling, n: int = 3) -> tuple:
    """Declare (on init) and read a flax module's state variables in ``collection``, one per
    state field, as a float32 meta."""
    L = recipe.amax_history_len
    meta = []
    for name in STATE_FIELDS:
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
