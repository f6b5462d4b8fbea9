"""Block scaling as a traceable JAX function: :func:`block_quantize`.

It works inside ``jax.jit`` and ``jax.vmap`` on any backend, with the backends of
:mod:`fusedfp8.jax.primitives` (``impl``: 'auto', 'jnp', 'ffi', 'callback', chosen and checked
there): on CUDA the block_quantize kernel runs on XLA's own buffers and stream through the launch
plan of :func:`fusedfp8.launch.block_quantize_plan` (the XLA FFI handler ``fusedfp8_launch`` of
the compiled shim, or a Python ``buffer_callback``; :mod:`fusedfp8.jax.callbacks`), everywhere
else its jax.numpy twin (:mod:`fusedfp8.numerics.block_jnp`), byte for byte the same.

Block scaling keeps no state: the function is pure, and carries no derivative (a straight-through
or FP8 GEMM wrapper defines one where it is used).
"""
from __future__ import annotations

from typing import NamedTuple

import jax
import jax.numpy as jnp
from jax import lax

from .. import _interop as io
from .. import launch
from ..block import block_shapes, check_block_args, check_block_input
from ..formats import get_format
from ..numerics import block_jnp as _block_jnp
from ..types import BlockQuantized
from . import callbacks
from .jnp_backend import _as_f32
from .primitives import _check_impl, _dispatch, compiled_when_eager

__all__ = ["block_quantize"]


class _BCfg(NamedTuple):
    """Static configuration of one block quantization."""

    fmt: str  # 'e4m3' | 'e5m2'
    block: tuple  # (1, 128) | (128, 128)
    pow2: bool
    transpose: bool
    pad_to: int


def _block_jnp_impl(cfg: _BCfg, x):
    r = _block_jnp.block_quantize(_as_f32(x), cfg.fmt, cfg.block, cfg.pow2, cfg.transpose, cfg.pad_to)
    t = (r.data_t, r.scale_inv_t) if cfg.transpose else ()
    return (r.data, r.scale_inv, *t, r.amax.reshape(1))


def _block_kernel(cfg: _BCfg, backend: str, x):
    sh = block_shapes(x.shape, cfg)
    plans = {dev: launch.block_quantize_plan(dev, x.dtype.name, cfg.fmt, cfg.block, sh.rows, sh.cols, cfg.transpose,
                                             cfg.pow2, cfg.pad_to) for dev in callbacks.gpu_devices()}
    u8, f32 = jnp.uint8, jnp.float32
    shapes = [jax.ShapeDtypeStruct(sh.q, u8), jax.ShapeDtypeStruct(sh.scale_inv, f32)]
    sources = {"x": ("in", 0), "q": ("out", 0), "scale_inv": ("out", 1)}
    if cfg.transpose:
        shapes += [jax.ShapeDtypeStruct(sh.q_t, u8), jax.ShapeDtypeStruct(sh.scale_inv_t, f32)]
        sources.update(q_t=("out", 2), scale_inv_t=("out", 3))
    shapes.append(jax.ShapeDtypeStruct((1,), f32))  # the amax: the plan zeroes it, the kernel max-accumulates
    sources["amax"] = ("out", len(shapes) - 1)
    return tuple(callbacks.run(backend, plans, shapes, (x,), launch.BLOCK_SLOTS.arrange(sources, None), {}))


@compiled_when_eager(0, 2)
def _run(cfg: _BCfg, x, impl: str) -> BlockQuantized:
    outs = list(_dispatch(impl, lambda a: _block_jnp_impl(cfg, a), lambda be, a: _block_kernel(cfg, be, a),
                          lax.stop_gradient(x)))
    fp8 = jnp.dtype(get_format(cfg.fmt).dtype_name)
    q, s = lax.bitcast_convert_type(outs.pop(0), fp8), outs.pop(0)
    q_t = s_t = None
    if cfg.transpose:
        q_t, s_t = lax.bitcast_convert_type(outs.pop(0), fp8), outs.pop(0)
    return BlockQuantized(q, s, q_t, s_t, outs.pop(0))


def block_quantize(x, recipe, *, weight: bool = False, grad: bool = False, transpose: bool = False,
                   pad_to: int = 1, impl: str = "auto") -> BlockQuantized:
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
    _check_impl(impl)
    x = io.as_jax(x, "x")
    check_block_input(x.dtype.name, x.shape)
    return _run(_BCfg(args.fmt.name, args.block, args.pow2, args.transpose, args.pad_to), x, impl)
