"""The jax.numpy backend of the JAX primitives (:mod:`fusedfp8.jax.primitives`): the kernels' op
sequences on the primitives' operands, byte for byte the reference's on every backend (the
numerics themselves are :mod:`fusedfp8.numerics.jnp`), and the static configuration of a
quantize primitive that both backends read.
"""
from __future__ import annotations

import math
from typing import NamedTuple

import jax.numpy as jnp
from jax import lax

from .. import launch
from ..formats import Format
from ..numerics import jnp as jn
from ..numerics.jnp_gelu import dgelu_f32, gelu_f32
from ..numerics.scaling import update_rule
from ..recipe import DelayedScaling

class _QCfg(NamedTuple):
    """Static configuration of one quantize primitive."""

    op: str  # 'identity' | 'gelu' | 'dgelu'
    approximate: str
    index: int
    fmt: Format
    transpose: bool
    dbias: bool
    margin_factor: float
    current_first: bool
    pad_to: int = 1  # > 1: q is the (rows, cols) view rounded up to multiples of it, q_t its transpose


def _rows_cols(shape) -> tuple[int, int]:
    return (math.prod(shape[:-1]), int(shape[-1])) if shape else (1, 1)


def pad_fp8(q, rows: int, cols: int, pad_to: int, transpose: bool) -> list:
    """The jax.numpy twin of the kernels' padded outputs: ``q`` (the codes, x's shape) as it
    is (``pad_to`` 1) or its (rows, cols) view with FP8 zeros appended to multiples of
    ``pad_to``, then (with ``transpose``) the transpose likewise: [q, q_t]."""
    q2 = q.reshape(rows, cols)
    prows, pcols = launch.padded(rows, cols, pad_to)
    out = [q if pad_to == 1 else jnp.pad(q2, ((0, prows - rows), (0, pcols - cols)))]
    if transpose:
        out.append(q2.T if pad_to == 1 else jnp.pad(q2.T, ((0, pcols - cols), (0, prows - rows))))
    return out


# ---- quantize ---------------------------------------------------------------------------------
def _as_f32(x):
    """x widened to float32 exactly as the kernels read it. The barrier keeps a bf16/f16 input
    rounded: XLA (xla_allow_excess_precision) otherwise folds convert(convert(h, bf16), f32) of
    the producer into h and quantizes the unrounded float32 value, which the kernels never see."""
    return x if x.dtype == jnp.float32 else lax.optimization_barrier(x).astype(jnp.float32)


def _activation(cfg: _QCfg, x, b):
    xf = _as_f32(x)
    if cfg.op == "identity":
        return xf
    if cfg.op == "gelu":
        return gelu_f32(xf, cfg.approximate)
    return jn._mul(xf, dgelu_f32(_as_f32(b), cfg.approximate))


def _stage_jnp(cfg: _QCfg, amax, hist, scale, scale_inv, updates):
    """What quantizing a tensor of amax ``amax`` does to the state: the scale it quantizes with and
    its reciprocal, and the new history, scale, scale_inv: the amax max-accumulated into its
    staging slot and, on the tensor's first step under first_step='current', the current scale
    from that slot."""
    i = cfg.index
    acc = jn.computed_once(jn.nan_max(hist[0, i], amax))
    fresh = updates[i] == 0
    s = scale[i]
    if cfg.current_first:
        s = jn.computed_once(jnp.where(fresh, jn.current_scale(acc, cfg.fmt, cfg.margin_factor, s), s))
    # 1 / s is read twice (the scale_inv the cast used, and the state's): computed once, or XLA
    # copies the whole division into both readers
    inv = jn.computed_once(jn.div_rn(1.0, s))
    if cfg.current_first:
        scale = scale.at[i].set(s)
        scale_inv = scale_inv.at[i].set(jnp.where(fresh, inv, scale_inv[i]))
    return s, inv, hist.at[0, i].set(acc), scale, scale_inv


def _stage_and_cast(cfg, y, hist, scale, scale_inv, updates):
    """The float32 ``y`` quantized with tensor ``cfg.index`` of the state: (q codes, (1,) 1 / the
    scale used, hist, scale, scale_inv), its amax staged as :func:`_stage_jnp` does."""
    s, inv, hist, scale, scale_inv = _stage_jnp(cfg, jn.amax(y), hist, scale, scale_inv, updates)
    s = jn.computed_once(s)  # a scalar read by every element: not recomputed in each reader
    q = jn.cast_to_fp8(jn.mul(y, s), cfg.fmt)
    return q, inv.reshape(1), hist, scale, scale_inv


def _quantize_jnp(cfg: _QCfg, x, b, hist, scale, scale_inv, updates):
    y = _activation(cfg, x, b)
    if cfg.op != "identity":  # computed once, not in each of the amax, cast, transpose, dbias
        y = jn.computed_once(y)
    q, si_used, hist, scale, scale_inv = _stage_and_cast(cfg, y, hist, scale, scale_inv, updates)
    rows, cols = _rows_cols(x.shape)
    outs = pad_fp8(q, rows, cols, cfg.pad_to, cfg.transpose)  # the pad: zeros after the amax, as the kernels
    if cfg.dbias:
        outs.append(jnp.sum(y.reshape(rows, cols), axis=0, dtype=jnp.float32))
    return (*outs, si_used, hist, scale, scale_inv)


# ---- update_scales, and the first use of a flax meta in a step ------------------------------------
def _update_jnp(recipe: DelayedScaling, hist, scale, scale_inv, overflows, updates, fmt_max):
    margin = jn.margin_operand(recipe.margin_factor)
    return update_rule(jn.JnpNamespace(), hist, scale, overflows, updates, fmt_max, margin, recipe.amax_compute_algo)


def _meta_update_jnp(recipe: DelayedScaling, grad: tuple, hist, scale, scale_inv, ovf_f, upd_f, writes, fmt_max):
    from .meta import corrupted, decode, meta_to_state

    meta = (hist, scale, scale_inv, ovf_f, upd_f, writes)
    st = meta_to_state(decode(meta), grad)
    h, s, si, o, u = _update_jnp(recipe, st.amax_history, st.scale, st.scale_inv, st.overflows, st.updates, fmt_max)
    counters = (o.astype(jnp.float32), u.astype(jnp.float32))
    bad = corrupted(meta)  # refused: NaN scales, and no first-step scale from the tensors' own amaxes
    nan = jnp.float32(jnp.nan)
    return (h, jnp.where(bad, nan, s), jnp.where(bad, nan, si), o, jnp.where(bad, jnp.maximum(u, 1), u), *counters)
