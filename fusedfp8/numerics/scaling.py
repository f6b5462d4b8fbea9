"""The delayed-scaling rule, the current-scaling step close and the scale formula, written once
over an array namespace (:mod:`fusedfp8.numerics.xp`).

The same functions run on numpy (the reference and the CPU backend), cupy, torch and
jax.numpy (traced inside ``jax.jit``); the CUDA kernels (``update_scales.cu`` and the first-step
path of ``quantize.cu``) are tested byte for byte against them.
"""
from __future__ import annotations

from .constants import FLT_MAX

_MAG = 0x7FFFFFFF  # the magnitude bits of a float32


def compute_scale(xp, amax, fmt_max, margin_factor):
    """``(fmt_max / amax) / margin_factor`` in float32, FLT_MAX where that is inf. ``amax`` > 0.
    A ``margin_factor`` given as the Python float 1.0 (margin 0, the default) is not divided by:
    s / 1 is s, and a traced division is a few dozen ops (numerics.jnp.div_rn)."""
    s = xp.divide(fmt_max, amax)
    if not (isinstance(margin_factor, float) and margin_factor == 1.0):
        s = xp.divide(s, margin_factor)
    return xp.where(xp.isinf(s), xp.asarray(FLT_MAX, xp.float32, s), s)


def seen(xp, a):
    """Whether a staged amax ``a`` counts: finite and not zero. Compared as bits (-0 is 0: the
    tensor did not run), so that a backend which treats denormals as zero (XLA on the CPU) still
    sees a denormal amax."""
    return xp.isfinite(a) & ((xp.bits(a) & _MAG) != 0)


def current_scale(xp, a, fmt_max, margin_factor, fallback):
    """First-step (current) scale from the tensor's own amax ``a``: the rule's formula, or
    ``fallback`` where ``a`` is 0 or non-finite."""
    ok = seen(xp, a)
    s = compute_scale(xp, xp.where(ok, a, xp.asarray(1.0, xp.float32, a)), fmt_max, margin_factor)
    return xp.where(ok, s, fallback)


def update_rule(xp, amax_history, scale, overflows, updates, fmt_max, margin_factor, algo):
    """One step of delayed scaling for every tensor (column) at once; returns the new arrays.

    Per column, with ``a = amax_history[0]`` (the staged amax of this step):
      a NaN/inf -> overflow: scale kept, overflows += 1, slot cleared, no roll;
      a == 0    -> (+0 or -0) not quantized this step: nothing changes;
      otherwise -> amax = max |history| or |a|; scale = fmt_max / amax / 2**margin (FLT_MAX if
                   inf); the column rolls by -1 (a moves to the last row); slot cleared.
    scale_inv = 1 / scale always. Returns (amax_history, scale, scale_inv, overflows, updates).
    """
    a = amax_history[0]
    finite = xp.isfinite(a)
    ok = seen(xp, a)
    amax = xp.amax(xp.abs(amax_history), axis=0) if algo == "max" else xp.abs(a)
    one = xp.asarray(1.0, xp.float32, a)
    s = compute_scale(xp, xp.where(ok, amax, one), fmt_max, margin_factor)
    new_scale = xp.where(ok, s, scale)
    past = amax_history[1:]
    if amax_history.shape[0] > 1:
        rolled = xp.concatenate([amax_history[2:], a[None]], axis=0)
        past = xp.where(ok[None], rolled, past)
    new_history = xp.concatenate([xp.zeros_like(a)[None], past], axis=0)
    new_scale_inv = xp.divide(one, new_scale)
    new_overflows = overflows + xp.astype(~finite, xp.int32)
    new_updates = updates + xp.astype(ok, xp.int32)
    return new_history, new_scale, new_scale_inv, new_overflows, new_updates


def close_step(xp, amax_history, scale, scale_inv, overflows, updates):
    """The update of a current-scaling state (2 rows): close the step, change no scale.

    Per column, with ``a = amax_history[0]`` (the staged amax of this step):
      a NaN/inf -> overflow: overflows += 1, slot cleared;
      a == 0    -> (+0 or -0) not quantized this step: nothing changes;
      otherwise -> row 1 (the last amax) = a, slot cleared.
    ``scale`` / ``scale_inv`` (the last scale the quantizations used, which they wrote) and
    ``updates`` (0: every step is a first step) are returned as they came. Returns
    (amax_history, scale, scale_inv, overflows, updates).
    """
    a = amax_history[0]
    finite = xp.isfinite(a)
    ok = seen(xp, a)
    staged = xp.where(ok | ~finite, xp.zeros_like(a), a)
    last = xp.where(ok, a, amax_history[1])
    new_history = xp.concatenate([staged[None], last[None]], axis=0)
    new_overflows = overflows + xp.astype(~finite, xp.int32)
    return new_history, scale, scale_inv, new_overflows, updates
