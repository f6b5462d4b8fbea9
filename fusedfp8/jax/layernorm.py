"""layernorm_quantize as a traceable JAX function, state in and state out: LayerNorm over the last
dimension fused with its FP8 quantization (the numerics of :mod:`fusedfp8.numerics.layernorm`),
on the backends of :mod:`fusedfp8.jax.primitives` (whose checks, dispatch and staging it
uses): the jax.numpy twin, or the layernorm_quantize kernels (padded
variant included) through the XLA FFI handler or a buffer_callback, on XLA's buffers and stream.
"""
from __future__ import annotations

from typing import NamedTuple

import jax
import jax.numpy as jnp
from jax import lax

from .. import launch
from ..formats import Format
from ..numerics import jnp as jn
from ..numerics.jnp_layernorm import layernorm_f32
from ..checks import _check_eps
from ..recipe import DelayedScaling
from ..state import ScalingState
from ..types import FLOAT_INPUTS, LayerNormQuantized, Quantized, check_pad_to
from . import callbacks
from . import primitives as P
from .jnp_backend import _as_f32, _rows_cols, _stage_and_cast, pad_fp8

__all__ = ["layernorm_quantize", "layernorm_amax", "check_layernorm_params", "check_mlp_layernorm", "param_sources",
           "layernorm_backward", "column_sums"]


class _LnCfg(NamedTuple):
    """Static configuration of one layernorm_quantize primitive."""

    index: int
    fmt: Format
    transpose: bool
    margin_factor: float
    current_first: bool
    eps: float  # as float32 (checks._check_eps)
    pad_to: int
    has_weight: bool
    has_bias: bool


def _layernorm_jnp(cfg: _LnCfg, x, w, b, hist, scale, scale_inv, updates):
    w, b = (None if p is None else _as_f32(p) for p in (w, b))
    y, mean, rstd = layernorm_f32(_as_f32(x), w, b, cfg.eps)
    y = jn.computed_once(y)  # read by the amax, the cast and the transpose
    q, si_used, hist, scale, scale_inv = _stage_and_cast(cfg, y, hist, scale, scale_inv, updates)
    outs = pad_fp8(q, *_rows_cols(x.shape), cfg.pad_to, cfg.transpose)  # FP8 zeros in the pad
    return (*outs, mean, rstd, si_used, hist, scale, scale_inv)


def _layernorm_kernel(cfg: _LnCfg, backend: str, x, *rest):
    """``rest``: weight and bias (those present), then hist, scale, scale_inv, updates."""
    params, (hist, scale, scale_inv, updates) = rest[:-4], rest[-4:]
    rows, cols = _rows_cols(x.shape)
    prows, pcols = launch.padded(rows, cols, cfg.pad_to)
    param = params[0].dtype.name if params else "float32"
    plans = callbacks.layernorm_plans(x.dtype.name, param, cfg.fmt.name, rows, cols, cfg.transpose, cfg.current_first,
                                      cfg.eps, cfg.margin_factor, 4 * cfg.index, cfg.pad_to)
    u8, f4 = jnp.uint8, jnp.float32
    shapes = [jax.ShapeDtypeStruct(x.shape if cfg.pad_to == 1 else (prows, pcols), u8)]
    if cfg.transpose:
        shapes.append(jax.ShapeDtypeStruct((pcols, prows), u8))
    shapes += [jax.ShapeDtypeStruct((rows,), f4), jax.ShapeDtypeStruct((rows,), f4), jax.ShapeDtypeStruct((1,), f4)]
    shapes += [jax.ShapeDtypeStruct(a.shape, a.dtype) for a in (hist, scale, scale_inv)]
    ins = (x, *params, hist, scale, scale_inv, updates)
    first_state = 1 + len(params)
    n_out = len(shapes)
    aliases = {first_state + k: n_out - 3 + k for k in range(3)}  # hist, scale, scale_inv: updated in place

    def out(k):
        return ("out", k)

    at_mean = 1 + cfg.transpose
    si_used, hist_o, scale_o, scale_inv_o = (out(k) for k in range(n_out - 4, n_out))
    # the amax is staged in row 0 of the history; the state's scale is read, and written on a first step
    sources = {"x": ("in", 0), **param_sources(cfg.has_weight, cfg.has_bias), "q": out(0), "mean": out(at_mean),
               "rstd": out(at_mean + 1), "scale": scale_o, "amax": hist_o, "scale_out": scale_o,
               "scale_inv_out": scale_inv_o, "scale_inv_used": si_used, "updates": ("in", first_state + 3)}
    if cfg.transpose:
        sources["q_t"] = out(1)
    return tuple(callbacks.run(backend, plans, shapes, ins, launch.LAYERNORM_SLOTS.arrange(sources, None), aliases))


def param_sources(has_weight: bool, has_bias: bool) -> dict:
    """Where weight and bias come from: the operands after x, those present."""
    return {name: ("in", 1 + k) for k, name in enumerate(n for n, on in (("weight", has_weight), ("bias", has_bias))
                                                          if on)}


@P.compiled_when_eager(0, 5)
def _run_layernorm(cfg: _LnCfg, x, w, b, state: ScalingState, impl: str) -> tuple[LayerNormQuantized, ScalingState]:
    x, w, b, state = lax.stop_gradient((x, w, b, state))
    params = tuple(p for p in (w, b) if p is not None)  # platform_dependent passes arrays only

    def jnp_fn(x, *rest):
        w_ = rest[0] if cfg.has_weight else None
        b_ = rest[int(cfg.has_weight)] if cfg.has_bias else None
        return _layernorm_jnp(cfg, x, w_, b_, *rest[-4:])

    outs = list(P._dispatch(impl, jnp_fn, lambda be, *a: _layernorm_kernel(cfg, be, *a), x, *params,
                          state.amax_history, state.scale, state.scale_inv, state.updates))
    fp8 = jnp.dtype(cfg.fmt.dtype_name)
    q = lax.bitcast_convert_type(outs.pop(0), fp8)
    q_t = lax.bitcast_convert_type(outs.pop(0), fp8) if cfg.transpose else None
    mean, rstd, si_used, hist, scale, scale_inv = outs
    new = state.replace(amax_history=hist, scale=scale, scale_inv=scale_inv)
    return LayerNormQuantized(Quantized(q, hist[0, cfg.index], q_t, None, si_used), mean, rstd), new


def _layernorm_amax_kernel(eps: float, has_weight: bool, has_bias: bool, backend: str, x, *params):
    rows, cols = _rows_cols(x.shape)
    param = params[0].dtype.name if params else "float32"
    plans = {dev: launch.layernorm_amax_plan(dev, x.dtype.name, param, rows, cols, eps)
             for dev in callbacks.gpu_devices()}
    # nothing but x, weight, bias and the amax (a (2,) buffer: the amax, the zeroed flag)
    sources = launch.LAYERNORM_SLOTS.arrange({"x": ("in", 0), **param_sources(has_weight, has_bias),
                                              "amax": ("out", 0)}, None)
    ins = (x, *params, jnp.zeros((2,), jnp.float32))  # the amax buffer, aliased to the result (as primitives.amax)
    return (callbacks.run(backend, plans, [jax.ShapeDtypeStruct((2,), jnp.float32)], ins, sources,
                          {len(ins) - 1: 0})[0][0],)


@P.compiled_when_eager(3, 4)
def _run_layernorm_amax(x, w, b, eps: float, impl: str):
    params = tuple(p for p in (w, b) if p is not None)
    has_w, has_b = w is not None, b is not None

    def jnp_fn(x, *rest):
        w_ = _as_f32(rest[0]) if has_w else None
        b_ = _as_f32(rest[int(has_w)]) if has_b else None
        return (jn.amax(layernorm_f32(_as_f32(x), w_, b_, eps)[0]),)

    return P._dispatch(impl, jnp_fn, lambda be, *a: _layernorm_amax_kernel(eps, has_w, has_b, be, *a),
                       *lax.stop_gradient((x, *params)))[0]


def layernorm_amax(x, weight, bias, eps: float, *, impl: str = "auto"):
    """``max |LayerNorm(x) * weight + bias|`` as a float32 scalar, without a cast: the amax that
    :func:`layernorm_quantize` stages, bit for bit (on CUDA its kernel's first-step pre-pass
    alone, :func:`fusedfp8.launch.layernorm_amax_plan`). Arguments as there."""
    P._check_impl(impl)
    x = P._check_x(x, "x", True)
    if x.shape[-1] == 0:
        raise ValueError(f"x: the LayerNorm normalises over the last dimension, which must not be empty; got shape "
                         f"{x.shape}")
    weight, bias = check_layernorm_params(weight, bias, x.shape[-1])
    return _run_layernorm_amax(x, weight, bias, _check_eps(eps), impl)


def check_layernorm_params(weight, bias, cols: int, names=("weight", "bias"), x_name: str = "x"):
    """(weight, bias) of a LayerNorm over ``cols`` columns as jax arrays (None stays None): each
    (cols,) float32 / float16 / bfloat16, both of one dtype (``names``: theirs in messages)."""
    out = []
    for p, name in zip((weight, bias), names):
        if p is not None:
            p = jnp.asarray(p)
            if p.dtype.name not in FLOAT_INPUTS:
                raise TypeError(f"{name} must be float32, float16 or bfloat16; got {p.dtype}")
            if p.shape != (cols,):
                raise ValueError(f"{name} must have shape ({cols},) (the last dimension of {x_name}); got {p.shape}")
        out.append(p)
    if out[0] is not None and out[1] is not None and out[0].dtype != out[1].dtype:
        raise TypeError(f"{names[0]} and {names[1]} must have the same dtype; got {out[0].dtype} and {out[1].dtype}")
    return tuple(out)


def check_mlp_layernorm(ln_weight, ln_bias, ln_eps, cols: int):
    """(ln_eps as float32, (weight, bias)) of an MLP's fused LayerNorm over ``cols`` columns of h, or
    (None, None) where ``ln_eps`` is None (then ``ln_weight`` / ``ln_bias`` must be None too)."""
    if ln_eps is None:
        if ln_weight is not None or ln_bias is not None:
            raise ValueError("ln_weight / ln_bias are the parameters of the fused LayerNorm, which ln_eps turns on; "
                             "got ln_eps=None")
        return None, None
    try:
        ln_eps = _check_eps(ln_eps)
    except (TypeError, ValueError) as e:
        raise type(e)(f"ln_{e}") from None  # "ln_eps must be ..."
    return ln_eps, check_layernorm_params(ln_weight, ln_bias, cols, ("ln_weight", "ln_bias"), "h")


def layernorm_quantize(x, weight, bias, eps: float, state: ScalingState, index: int, recipe: DelayedScaling, *,
                       transpose: bool = False, pad_to: int = 1,
                       impl: str = "auto") -> tuple[LayerNormQuantized, ScalingState]:
    """LayerNorm over the last dimension of ``x``, quantized with tensor ``index`` of ``state`` in
    the same pass (:func:`fusedfp8.layernorm_quantize`'s numerics: the normalised output is never
    written in 16 or 32 bits; the amax staged is of that output).

    Parameters
    ----------
    x : float32 / float16 / bfloat16 array, at least 1-D, last dimension >= 1
    weight, bias : (cols,) arrays of one float dtype, or None (1 and 0)
    eps : number >= 0, added to the variance (as float32)
    state, index, recipe, transpose, impl : as :func:`quantize`
    pad_to : 1 (``data`` has x's shape), or ``data`` is the (rows, cols) view rounded up to
        multiples of ``pad_to`` (``data_t`` its transpose), FP8 zeros in the pad, outside the amax
        (what an FP8 GEMM of ragged shape needs; written by the same kernel)

    Returns
    -------
    (LayerNormQuantized, ScalingState)
        ``quantized`` as :func:`quantize` returns it, ``mean`` and ``rstd`` ((rows,) float32, NaN
        canonical: ``xhat = (x - mean) * rstd`` for the backward), and the new state.

    On the CUDA backends ``transpose=True`` takes any width: below 4096 columns q_t comes from the
    kernel's shared tile, from 4096 on from a second launch over q
    (:func:`fusedfp8.launch.plans.split_transpose`).
    """
    P._check_impl(impl)
    state = P._check_state(state, recipe)
    x = P._check_x(x, "x", False)
    if x.ndim < 1:
        raise ValueError("x: layernorm_quantize needs an input of at least 1 dimension; got a scalar")
    if x.shape[-1] == 0:
        raise ValueError(f"x: layernorm_quantize normalises over the last dimension, which must not be empty; "
                         f"got shape {x.shape}")
    pad_to = check_pad_to(pad_to)
    eps = _check_eps(eps)
    weight, bias = check_layernorm_params(weight, bias, x.shape[-1])
    i = state.check_index(index)
    cfg = _LnCfg(i, state.format_of(i, recipe), bool(transpose), float(recipe.margin_factor),
                 recipe.first_step == "current", eps, pad_to, weight is not None, bias is not None)
    return _run_layernorm(cfg, x, weight, bias, state, impl)


_PARTIAL_ROWS = 128  # rows per partial column sum


def column_sums(*arrays):
    """The column sums (over axis 0) of (M, H) float32 arrays, in two stages: partial sums over
    blocks of rows, then over the blocks. XLA spreads a column reduction over the columns only
    (H / 32 thread blocks, each looping over all M rows: a few dozen blocks on a GPU of 132 SMs),
    and fuses the elementwise producers into that narrow grid; the partials give it M / 128 times
    the blocks. The barrier keeps XLA from merging the two stages back into one reduction."""
    if not arrays or arrays[0].shape[0] <= _PARTIAL_ROWS:
        return tuple(jnp.sum(a, axis=0) for a in arrays)
    h, pad = arrays[0].shape[1], -arrays[0].shape[0] % _PARTIAL_ROWS
    parts = tuple(jnp.sum(jnp.pad(a, ((0, pad), (0, 0))).reshape(-1, _PARTIAL_ROWS, h), axis=1) for a in arrays)
    return tuple(jnp.sum(p, axis=0) for p in jax.lax.optimization_barrier(parts))


def layernorm_backward(dh, x, mean, rstd, w, b):
    """(dx, dweight, dbias) of LayerNorm(x) (x (M, H)) from its saved (M,) float32 mean and rstd:
    the standard formula in float32, each result cast to its primal's dtype (None for a missing
    parameter)."""
    g = dh.astype(jnp.float32)
    xhat = (x.astype(jnp.float32) - mean[:, None]) * rstd[:, None]
    sums = column_sums(*([g * xhat] if w is not None else []), *([g] if b is not None else []))
    dw = sums[0].astype(w.dtype) if w is not None else None
    db = sums[-1].astype(b.dtype) if b is not None else None
    if w is not None:
        g = g * w.astype(jnp.float32)
    dx = rstd[:, None] * (g - jnp.mean(g, axis=-1, keepdims=True)
                          - xhat * jnp.mean(g * xhat, axis=-1, keepdims=True))
    return dx.astype(x.dtype), dw, db
