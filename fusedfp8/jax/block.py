"""Block scaling as traceable JAX functions: :func:`block_quantize`, :func:`block_gelu_quantize`,
:func:`block_dgelu_quantize` and :func:`block_layernorm_quantize`.

It works inside ``jax.jit`` and ``jax.vmap`` on any backend, with the backends of
:mod:`fusedfp8.jax.primitives` (``impl``: 'auto', 'jnp', 'ffi', 'callback', chosen and checked
there): on CUDA the block_quantize kernel runs on XLA's own buffers and stream through the launch
plan of :func:`fusedfp8.launch.block_quantize_plan` (the XLA FFI handler ``fusedfp8_launch`` of
the compiled shim, or a Python ``buffer_callback``; :mod:`fusedfp8.jax.callbacks`), everywhere
else its jax.numpy twin (:mod:`fusedfp8.numerics.block_jnp`), byte for byte the same.

Block scaling keeps no state: the functions are pure, and carry no derivative (a straight-through
or FP8 GEMM wrapper defines one where it is used).
"""
from __future__ import annotations

from typing import NamedTuple

import jax
import jax.numpy as jnp
from jax import lax

from .. import _interop as io
from .. import launch
from ..block import BlockOp, block_shapes, check_block_args, check_block_input, check_block_op
from ..checks import _check_eps
from ..formats import get_format
from ..numerics import block_jnp as _block_jnp
from ..types import BlockQuantized, LayerNormQuantized
from . import callbacks
from .jnp_backend import _as_f32
from .layernorm import check_layernorm_params, param_sources
from .primitives import _check_impl, _dispatch, compiled_when_eager

__all__ = ["block_quantize", "block_gelu_quantize", "block_dgelu_quantize", "block_layernorm_quantize"]


class _BCfg(NamedTuple):
    """Static configuration of one block quantization."""

    fmt: str  # 'e4m3' | 'e5m2'
    block: tuple  # (1, 128) | (128, 128)
    pow2: bool
    transpose: bool
    pad_to: int
    op: BlockOp = BlockOp()


def _block_jnp_impl(cfg: _BCfg, x, b=None):
    r = _block_jnp.block_quantize(_as_f32(x), cfg.fmt, cfg.block, cfg.pow2, cfg.transpose, cfg.pad_to, cfg.op.op,
                                  None if b is None else _as_f32(b), cfg.op.approximate, cfg.op.dbias)
    t = (r.data_t, r.scale_inv_t) if cfg.transpose else ()
    return (r.data, r.scale_inv, *t, r.amax.reshape(1), *((r.dbias,) if cfg.op.dbias else ()))


def _block_kernel(cfg: _BCfg, backend: str, x, b=None):
    sh = block_shapes(x.shape, cfg)
    plans = {dev: launch.block_quantize_plan(dev, x.dtype.name, cfg.fmt, cfg.block, sh.rows, sh.cols, cfg.transpose,
                                             cfg.pow2, cfg.pad_to, cfg.op.kernel, cfg.op.dbias)
             for dev in callbacks.gpu_devices()}
    u8, f32 = jnp.uint8, jnp.float32
    shapes = [jax.ShapeDtypeStruct(sh.q, u8), jax.ShapeDtypeStruct(sh.scale_inv, f32)]
    sources = {"x": ("in", 0), "q": ("out", 0), "scale_inv": ("out", 1)}
    if b is not None:
        sources["b"] = ("in", 1)
    if cfg.transpose:
        shapes += [jax.ShapeDtypeStruct(sh.q_t, u8), jax.ShapeDtypeStruct(sh.scale_inv_t, f32)]
        sources.update(q_t=("out", 2), scale_inv_t=("out", 3))
    shapes.append(jax.ShapeDtypeStruct((1,), f32))  # the amax: the plan zeroes it, the kernel max-accumulates
    sources["amax"] = ("out", len(shapes) - 1)
    if cfg.op.dbias:  # dbias, then its workspaces (outputs nobody reads: dropped below)
        part_shape, n_counters = launch.block_dbias_workspace(sh.rows, sh.cols, cfg.pad_to)
        at = len(shapes)
        shapes += [jax.ShapeDtypeStruct((sh.cols,), f32), jax.ShapeDtypeStruct(part_shape, f32),
                   jax.ShapeDtypeStruct((n_counters,), jnp.int32)]
        sources.update(dbias=("out", at), partial=("out", at + 1), counters=("out", at + 2))
    args = (x,) if b is None else (x, b)
    outs = callbacks.run(backend, plans, shapes, args, launch.BLOCK_SLOTS.arrange(sources, None), {})
    return tuple(outs[:len(outs) - 2] if cfg.op.dbias else outs)


@compiled_when_eager(0, 3)
def _run(cfg: _BCfg, x, b, impl: str) -> BlockQuantized:
    x = lax.stop_gradient(x)
    if b is None:  # platform_dependent passes arrays only
        outs = _dispatch(impl, lambda a: _block_jnp_impl(cfg, a), lambda be, a: _block_kernel(cfg, be, a), x)
    else:
        outs = _dispatch(impl, lambda a, c: _block_jnp_impl(cfg, a, c), lambda be, a, c: _block_kernel(cfg, be, a, c),
                         x, lax.stop_gradient(b))
    outs = list(outs)
    fp8 = jnp.dtype(get_format(cfg.fmt).dtype_name)
    q, s = lax.bitcast_convert_type(outs.pop(0), fp8), outs.pop(0)
    q_t = s_t = None
    if cfg.transpose:
        q_t, s_t = lax.bitcast_convert_type(outs.pop(0), fp8), outs.pop(0)
    amax = outs.pop(0)
    return BlockQuantized(q, s, q_t, s_t, amax, outs.pop(0) if cfg.op.dbias else None)


def _check_x(x, argname: str):
    x = io.as_jax(x, argname)
    check_block_input(x.dtype.name, x.shape, argname)
    return x


def block_quantize(x, recipe, *, weight: bool = False, grad: bool = False, transpose: bool = False,
                   dbias: bool = False, pad_to: int = 1, impl: str = "auto") -> BlockQuantized:
    """:func:`fusedfp8.block_quantize` for jax arrays, traceable: the same arguments, results and
    bytes (FP8 data as ``jnp.float8_e4m3fn`` / ``float8_e5m2``, ``scale_inv`` float32 in
    cuBLASLt's layout, ``amax`` (1,) float32). ``impl``: as :mod:`fusedfp8.jax.primitives` ('auto':
    the kernel on CUDA, jax.numpy elsewhere; 'jnp'; 'ffi'; 'callback').

    Raises
    ------
    TypeError, ValueError
        As :func:`fusedfp8.block_quantize`, and on an ``impl`` that cannot run here; at trace time.
    """
    args = check_block_args(recipe, weight, grad, transpose, pad_to)
    op = check_block_op("identity", "tanh", dbias, args.block)
    _check_impl(impl)
    return _run(_BCfg(args.fmt.name, args.block, args.pow2, args.transpose, args.pad_to, op), _check_x(x, "x"), None,
                impl)


def block_gelu_quantize(x, recipe, *, approximate: str = "tanh", transpose: bool = False, pad_to: int = 1,
                        impl: str = "auto") -> BlockQuantized:
    """:func:`fusedfp8.block_gelu_quantize` for jax arrays, traceable (``impl`` as
    :func:`block_quantize`): y = gelu(x) quantized with 1x128 blocks in one pass."""
    args = check_block_args(recipe, False, False, transpose, pad_to)
    op = check_block_op("gelu", approximate, False, args.block)
    _check_impl(impl)
    return _run(_BCfg(args.fmt.name, args.block, args.pow2, args.transpose, args.pad_to, op), _check_x(x, "x"), None,
                impl)


def block_dgelu_quantize(dy, x, recipe, *, approximate: str = "tanh", transpose: bool = False, dbias: bool = False,
                         pad_to: int = 1, impl: str = "auto") -> BlockQuantized:
    """:func:`fusedfp8.block_dgelu_quantize` for jax arrays, traceable (``impl`` as
    :func:`block_quantize`): y = dy * gelu'(x) quantized with 1x128 blocks in the gradient format,
    with ``dbias`` its column sums, in one pass."""
    args = check_block_args(recipe, False, True, transpose, pad_to)
    op = check_block_op("dgelu", approximate, dbias, args.block)
    _check_impl(impl)
    dy, x = _check_x(dy, "dy"), _check_x(x, "x")
    if dy.shape != x.shape or dy.dtype != x.dtype:
        raise ValueError(f"dy and x must have the same shape and dtype; got {dy.shape} {dy.dtype} and {x.shape} "
                         f"{x.dtype}")
    return _run(_BCfg(args.fmt.name, args.block, args.pow2, args.transpose, args.pad_to, op), dy, x, impl)


class _BLnCfg(NamedTuple):
    """Static configuration of one block_layernorm_quantize."""

    fmt: str
    pow2: bool
    transpose: bool
    pad_to: int
    eps: float  # as float32 (checks._check_eps)
    has_weight: bool
    has_bias: bool
    block: tuple = (1, 128)  # (read by block_shapes)


def _block_ln_jnp(cfg: _BLnCfg, x, *params):
    w = _as_f32(params[0]) if cfg.has_weight else None
    b = _as_f32(params[int(cfg.has_weight)]) if cfg.has_bias else None
    r, mean, rstd = _block_jnp.block_layernorm_quantize(_as_f32(x), w, b, cfg.eps, cfg.fmt, cfg.pow2, cfg.transpose,
                                                        cfg.pad_to)
    t = (r.data_t, r.scale_inv_t) if cfg.transpose else ()
    return (r.data, r.scale_inv, *t, r.amax.reshape(1), mean, rstd)


def _block_ln_kernel(cfg: _BLnCfg, backend: str, x, *params):
    sh = block_shapes(x.shape, cfg)
    param = params[0].dtype.name if params else "float32"
    plans = {dev: launch.block_layernorm_plan(dev, x.dtype.name, param, cfg.fmt, sh.rows, sh.cols, cfg.transpose,
                                              cfg.pow2, cfg.pad_to, cfg.eps) for dev in callbacks.gpu_devices()}
    u8, f32 = jnp.uint8, jnp.float32
    shapes = [jax.ShapeDtypeStruct(sh.q, u8), jax.ShapeDtypeStruct(sh.scale_inv, f32)]
    sources = {"x": ("in", 0), **param_sources(cfg.has_weight, cfg.has_bias), "q": ("out", 0),
               "scale_inv": ("out", 1)}
    if cfg.transpose:
        shapes += [jax.ShapeDtypeStruct(sh.q_t, u8), jax.ShapeDtypeStruct(sh.scale_inv_t, f32)]
        sources.update(q_t=("out", 2), scale_inv_t=("out", 3))
    at = len(shapes)
    shapes += [jax.ShapeDtypeStruct((1,), f32), jax.ShapeDtypeStruct((sh.rows,), f32),
               jax.ShapeDtypeStruct((sh.rows,), f32)]
    sources.update(amax=("out", at), mean=("out", at + 1), rstd=("out", at + 2))
    return tuple(callbacks.run(backend, plans, shapes, (x, *params), launch.BLOCK_SLOTS.arrange(sources, None), {}))


@compiled_when_eager(0, 4)
def _run_ln(cfg: _BLnCfg, x, w, b, impl: str) -> LayerNormQuantized:
    x, w, b = lax.stop_gradient((x, w, b))
    params = tuple(p for p in (w, b) if p is not None)  # platform_dependent passes arrays only
    outs = list(_dispatch(impl, lambda *a: _block_ln_jnp(cfg, *a), lambda be, *a: _block_ln_kernel(cfg, be, *a), x,
                          *params))
    fp8 = jnp.dtype(get_format(cfg.fmt).dtype_name)
    q, s = lax.bitcast_convert_type(outs.pop(0), fp8), outs.pop(0)
    q_t = s_t = None
    if cfg.transpose:
        q_t, s_t = lax.bitcast_convert_type(outs.pop(0), fp8), outs.pop(0)
    amax, mean, rstd = outs
    return LayerNormQuantized(BlockQuantized(q, s, q_t, s_t, amax, None), mean, rstd)


def block_layernorm_quantize(x, weight, bias, eps: float, recipe, *, transpose: bool = False, pad_to: int = 1,
                             impl: str = "auto") -> LayerNormQuantized:
    """:func:`fusedfp8.block_layernorm_quantize` for jax arrays, traceable (``impl`` as
    :func:`block_quantize`): LayerNorm(x) quantized with 1x128 blocks in the forward format, with
    the rows' (rows,) float32 mean and rstd; no derivative (:func:`fusedfp8.jax.functional.fp8_mlp`
    defines the block MLP's)."""
    args = check_block_args(recipe, False, False, transpose, pad_to)
    _check_impl(impl)
    x = _check_x(x, "x")
    if x.shape[-1] == 0:
        raise ValueError(f"x: LayerNorm normalises over the last dimension, which must not be empty; got shape "
                         f"{x.shape}")
    eps = _check_eps(eps)
    w, b = check_layernorm_params(weight, bias, x.shape[-1])
    return _run_ln(_BLnCfg(args.fmt.name, args.pow2, args.transpose, args.pad_to, eps, w is not None, b is not None),
                   x, w, b, impl)
