"""The fused MLP block in FP8: ``[LayerNorm ->] Linear -> gelu -> Linear`` as one ``custom_vjp``.

Beside :mod:`fusedfp8.jax.dot` (whose meta convention, GEMM layouts and helpers it shares), the
block takes out what two ``fp8_dot`` calls leave to XLA: the activation is quantized (with its
transpose) straight from the first GEMM's output by the fused gelu kernel, the biases are added
in the GEMMs' epilogues, the gelu backward, its quantization and the first bias gradient are one
dgelu kernel, the second bias gradient comes from the gradient's own quantization, and with a
LayerNorm in front the normalised input goes straight to FP8 in the layernorm_quantize kernel.
"""
from __future__ import annotations

from functools import partial
from typing import NamedTuple

import jax
import jax.numpy as jnp

from ..recipe import BlockScaling, DelayedScaling
from ..types import check_approximate, check_recipe, gemm_pad_to
from . import layernorm as LN
from . import primitives as P
from .block_dot import block_mlp, check_fp8_weight_pair, check_mlp_shapes
from .dot import (_across, _advance, _check_fp8_weight, _check_operand, _first_order, _refused_here, _sync, _weight,
                  _weight_amax, _zeros_like, gemm)
from .meta import combine, decode, meta_to_state, refuse_corrupted, refusing, state_to_meta
from .meta import check_meta as _check_meta

__all__ = ["fp8_mlp", "fp8_mlp_use"]


class _MlpCfg(NamedTuple):
    recipe: DelayedScaling
    impl: str
    approximate: str
    axis_name: str | tuple | None = None
    forward_fast_accum: bool = True
    first: bool = True
    dtype: str = "float32"  # of the GEMM outputs: z, y and the gradient GEMMs before the LayerNorm's backward
    ln_eps: float | None = None  # a float: h is the block's input, normalised inside its quantization


def _mlp_fwd(h, w1, b1, w2, b2, meta1, meta2, fp8_weights, ln, cfg: _MlpCfg, training: bool = True):
    h, w1, b1, w2, b2 = map(_first_order, (h, w1, b1, w2, b2))
    ln = jax.tree.map(_first_order, ln)
    r, impl, dt = cfg.recipe, cfg.impl, jnp.dtype(cfg.dtype)
    if _refused_here(cfg):
        # both linears' staged amaxes in one all-reduce, then the two (local) updates (none under
        # CurrentScaling across devices: the staged amaxes are global already)
        st1, st2 = P.sync_staged([meta_to_state(decode(meta1)), meta_to_state(decode(meta2))],
                                 None if _across(cfg) else cfg.axis_name)
        st1, st2 = P.update_scales(st1, r, impl=impl), P.update_scales(st2, r, impl=impl)
        fc1 = fc2 = None  # (state_to_meta converts the counters)
    else:  # each meta as fp8_dot's (_advance: one update_meta launch a meta on a first use)
        (st1, fc1), (st2, fc2) = _advance(meta1, cfg), _advance(meta2, cfg)
    (m, hid), ffn, out = h.shape, w1.shape[1], w2.shape[1]
    p = gemm_pad_to(m, hid, ffn, out)  # ragged: every FP8 operand written padded by its kernel, as fp8_dot
    ln_saved = None
    q1, q2 = fp8_weights or (None, None)
    h_amax = ((lambda: P.amax(h, impl=impl)) if cfg.ln_eps is None else
              (lambda: LN.layernorm_amax(h, *ln, cfg.ln_eps, impl=impl)))
    st1, r1 = _sync(st1, [(0, h_amax), (1, _weight_amax(w1, q1, impl))], cfg)  # (h, w1): one pmax
    if cfg.ln_eps is None:
        rh, st1 = P.quantize(h, st1, 0, r1, transpose=training, pad_to=p, impl=impl)
    else:  # LayerNorm(h) straight to FP8
        rn, st1 = LN.layernorm_quantize(h, *ln, cfg.ln_eps, st1, 0, r1, transpose=training, pad_to=p, impl=impl)
        rh = rn.quantized
        ln_saved = (h, rn.mean, rn.rstd, *ln) if training else None
    rw1, st1 = _weight(w1, q1, st1, r1, impl, p)
    fast = cfg.forward_fast_accum
    sh = refusing(rh.scale_inv, (meta1, meta2) if _refused_here(cfg) else ())  # NaN out where a stored meta is corrupted
    # the biases in the GEMMs' epilogues (added before the one rounding; no pass of their own)
    z = gemm(rh.data, rw1.data_t, sh, rw1.scale_inv, dt, fast_accum=fast, impl=impl, shape=(m, ffn), bias=b1.astype(dt))
    st2, r2 = _sync(st2, [(0, lambda: P.amax(z, op="gelu", approximate=cfg.approximate, impl=impl)),
                          (1, _weight_amax(w2, q2, impl))], cfg)  # (gelu(z), w2): one pmax
    ra, st2 = P.gelu_quantize(z, st2, 0, r2, approximate=cfg.approximate, transpose=training, pad_to=p, impl=impl)
    rw2, st2 = _weight(w2, q2, st2, r2, impl, p)
    y = gemm(ra.data, rw2.data_t, ra.scale_inv, rw2.scale_inv, dt, fast_accum=fast, impl=impl, shape=(m, out),
             bias=b2.astype(dt))
    # dtypes, and the real shapes of h, w1, w2 (zero-size arrays: static)
    dtypes = (jnp.zeros((0, m, hid), h.dtype), jnp.zeros((0, hid, ffn), w1.dtype), jnp.zeros((0,), b1.dtype),
              jnp.zeros((0, ffn, out), w2.dtype), jnp.zeros((0,), b2.dtype))
    return (y, state_to_meta(st1, fc1), state_to_meta(st2, fc2)), (
        rh.data_t, rw1.data, z, ra.data_t, rw2.data, rh.scale_inv, rw1.scale_inv, ra.scale_inv,
        rw2.scale_inv, st1, st2, fc1, fc2, dtypes, fp8_weights, ln_saved)


@partial(jax.custom_vjp, nondiff_argnums=(9,))
def _mlp(h, w1, b1, w2, b2, meta1, meta2, fp8_weights, ln, cfg: _MlpCfg):
    """(y, fc1's meta after this use, fc2's): as :func:`fusedfp8.jax.dot._dot`. ``ln``: None, or the LayerNorm's
    (weight, bias) (either may be None) when ``cfg.ln_eps`` is set."""
    return _mlp_fwd(h, w1, b1, w2, b2, meta1, meta2, fp8_weights, ln, cfg, training=False)[0]


def _mlp_bwd(cfg: _MlpCfg, res, cts):
    g, later1, later2 = cts
    g = _first_order(g)
    h_t, w1_q, z, a_t, w2_q, sh, sw1, sa, sw2, st1, st2, fc1, fc2, (hz, w1z, b1z, w2z, b2z), fp8_weights, ln_saved = res
    (_, m, hid), (_, ffn, out) = hz.shape, w2z.shape
    p = gemm_pad_to(m, hid, ffn, out)  # as the forward padded
    impl = cfg.impl
    st2, r = _sync(st2, [(2, lambda: P.amax(g, impl=impl))], cfg)
    # the bias gradient from the same read as the cast (not a reduction of its own)
    rg, st2 = P.quantize(g, st2, 2, r, transpose=True, dbias=True, pad_to=p, impl=impl)
    da = gemm(rg.data, w2_q, rg.scale_inv, sw2, z.dtype, impl=impl, shape=(m, ffn))
    dw2 = gemm(a_t, rg.data_t, sa, rg.scale_inv, w2z.dtype, impl=impl, shape=(ffn, out))
    db2 = rg.dbias.astype(b2z.dtype)
    st1, r = _sync(st1, [(2, lambda: P.amax(da, z, op="dgelu", approximate=cfg.approximate, impl=impl))], cfg)
    rdz, st1 = P.dgelu_quantize(da, z, st1, 2, r, approximate=cfg.approximate, transpose=True, dbias=True,
                                pad_to=p, impl=impl)
    dw1 = gemm(h_t, rdz.data_t, sh, rdz.scale_inv, w1z.dtype, impl=impl, shape=(hid, ffn))
    dln = None
    if ln_saved is None:
        dh = gemm(rdz.data, w1_q, rdz.scale_inv, sw1, hz.dtype, impl=impl, shape=(m, hid))
    else:  # the GEMM's dh is the LayerNorm output's gradient: through the LayerNorm's backward to x
        dh = gemm(rdz.data, w1_q, rdz.scale_inv, sw1, z.dtype, impl=impl, shape=(m, hid))
        dh, dlw, dlb = LN.layernorm_backward(dh, *ln_saved)
        dln = (dlw, dlb)
    return (dh, dw1, rdz.dbias.astype(b1z.dtype), dw2, db2, combine(later1, state_to_meta(st1, fc1)),
            combine(later2, state_to_meta(st2, fc2)), _zeros_like(fp8_weights), dln)


_mlp.defvjp(_mlp_fwd, _mlp_bwd)
_mlp_call = P.compiled_when_eager(9)(_mlp)


def _block_call(h, w1, b1, w2, b2, meta1, meta2, recipe, approximate, axis_name, impl, out_dtype, ln_weight, ln_bias,
                ln_eps, fp8_weights):
    """fp8_mlp under BlockScaling: :func:`fusedfp8.jax.block_dot.block_mlp` (no state: the metas and
    axis_name None; fp8_weights the block quantize_weight pair), the LayerNorm fused there as well."""
    for name, v in (("meta1", meta1), ("meta2", meta2), ("axis_name", axis_name)):
        if v is not None:
            raise ValueError(f"{name} must be None under BlockScaling (no state: each block's scale is its own max, "
                             f"the same on every device); got {type(v).__name__}")
    return block_mlp(h, w1, b1, w2, b2, recipe, approximate=approximate, out_dtype=out_dtype, impl=impl,
                     fp8_weights=fp8_weights, ln_weight=ln_weight, ln_bias=ln_bias, ln_eps=ln_eps)


def fp8_mlp(h, w1, b1, w2, b2, meta1, meta2, recipe: DelayedScaling = DelayedScaling(), *,
            approximate: str = "tanh", axis_name=None, impl: str = "auto", forward_fast_accum: bool = True,
            out_dtype=None, ln_weight=None, ln_bias=None, ln_eps: float | None = None, fp8_weights=None):
    return fp8_mlp_use(h, w1, b1, w2, b2, meta1, meta2, recipe, approximate=approximate, axis_name=axis_name,
                       impl=impl, forward_fast_accum=forward_fast_accum, out_dtype=out_dtype, ln_weight=ln_weight,
                       ln_bias=ln_bias, ln_eps=ln_eps, fp8_weights=fp8_weights)[0]


def fp8_mlp_use(h, w1, b1, w2, b2, meta1, meta2, recipe: DelayedScaling = DelayedScaling(), *,
                approximate: str = "tanh", axis_name=None, impl: str = "auto", forward_fast_accum: bool = True,
                out_dtype=None, ln_weight=None, ln_bias=None, ln_eps: float | None = None, first: bool = True,
                fp8_weights=None):
    """``gelu(h @ w1 + b1) @ w2 + b2`` with FP8 GEMMs, the activation quantized (with its
    transpose) straight from the first GEMM's output by the fused gelu kernel, and the gelu
    backward (+ the first bias gradient) by the fused dgelu kernel.

    h (M, H); w1 (H, F), b1 (F,); w2 (F, H2), b2 (H2,); meta1 / meta2: the metas of fc1 (h,
    w1, dz) and fc2 (gelu(z), w2, dy), whose VJPs are the new metas. Output (M, H2) in
    ``out_dtype`` (h's dtype by default); the pre-activation z is saved for the backward in that
    dtype, everything else saved is FP8. ``axis_name``, ``impl``, ``forward_fast_accum``: as
    :func:`fp8_dot` (one ``lax.pmax`` for both metas). ``fp8_weights``: None, or
    ``(quantize_weight(w1, meta1, ...), quantize_weight(w2, meta2, ...))`` of this step, reused as
    ``fp8_weight`` of :func:`fp8_dot`. :func:`fp8_mlp_use`: as :func:`fp8_dot_use` (results: y,
    fc1's output meta, fc2's).

    Under a :class:`fusedfp8.BlockScaling` recipe: :func:`fusedfp8.jax.block_dot.block_mlp` (the
    metas and ``axis_name`` None; ``fp8_weights`` the block ``quantize_weight`` pair; with
    ``ln_eps`` the LayerNorm fused into the quantization of its input with 1x128 blocks,
    :func:`fusedfp8.jax.block.block_layernorm_quantize`; :func:`fp8_mlp_use`'s metas come back None).

    With ``ln_eps`` (a number >= 0) the block is ``LayerNorm -> Linear -> gelu -> Linear``: h is
    the block's input x, and LayerNorm(x) (weight ``ln_weight``, bias ``ln_bias``: (H,) arrays of
    one float dtype, or None) goes straight to FP8 in the fused layernorm_quantize kernel (with
    its transpose, padded for ragged GEMMs by the kernel): the normalised h is never written in
    16 or 32 bits. x, the per-row mean and rstd are saved; the LayerNorm's backward runs in JAX
    (float32) from them, and the gradients of x, ``ln_weight`` and ``ln_bias`` come in their
    dtypes.
    """
    if isinstance(recipe, BlockScaling):
        return _block_call(h, w1, b1, w2, b2, meta1, meta2, recipe, approximate, axis_name, impl, out_dtype, ln_weight,
                           ln_bias, ln_eps, fp8_weights), None, None
    h, w1, w2 = _check_operand(h, "h"), _check_operand(w1, "w1"), _check_operand(w2, "w2")
    b1, b2 = jnp.asarray(b1), jnp.asarray(b2)
    check_mlp_shapes(h, w1, b1, w2, b2)
    check_recipe(recipe)
    meta1, meta2 = _check_meta(meta1, 3, recipe, "meta1"), _check_meta(meta2, 3, recipe, "meta2")
    if first:
        refuse_corrupted(meta1, "meta1")
        refuse_corrupted(meta2, "meta2")
    out_name = jnp.dtype(out_dtype or h.dtype).name
    if out_name not in ("float32", "float16", "bfloat16"):
        raise TypeError(f"out_dtype must be float32, float16 or bfloat16; got {out_name}")
    ln_eps, ln = LN.check_mlp_layernorm(ln_weight, ln_bias, ln_eps, h.shape[1])
    cfg = _MlpCfg(recipe, P._check_impl(impl), check_approximate(approximate), P._check_axis_name(axis_name),
                  bool(forward_fast_accum), bool(first), out_name, ln_eps)
    # inside shard_map, every operand varies over the mesh axes that any does (the implicit
    # broadcast that plain ops insert; its transpose sums a replicated weight's gradient)
    ops = (h, w1, b1, w2, b2, *meta1, *meta2, *(p for p in ln or () if p is not None))
    h, w1, b1, w2, b2, *rest = P._as_varying_as(ops, ops)
    k = len(meta1)
    metas1, metas2, rest = tuple(rest[:k]), tuple(rest[k:2 * k]), rest[2 * k:]
    if ln is not None:
        ln = tuple(None if p is None else rest.pop(0) for p in ln)
    fp8_weights = check_fp8_weight_pair(fp8_weights, w1, w2, recipe, _check_fp8_weight)
    return _mlp_call(h, w1, b1, w2, b2, metas1, metas2, fp8_weights, ln, cfg)
